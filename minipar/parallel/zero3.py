"""ZeRO stage 3: parameters sharded too; each layer's are gathered just in time and freed after.

Every rank keeps only its pieces of the parameters (see ``zero.py`` for the layout). Around each
unit of the model (the embeddings, each transformer block, the final LayerNorm with the head):

    forward   all-gather the unit's parameters, run it without recording a graph, free them
    backward  all-gather them again, run the unit again with a graph (``recompute.checkpoint``),
              backpropagate, reduce-scatter the unit's gradients into the shards, free them all

Running the unit without a graph in forward is what makes freeing real: a recorded graph would keep
the gathered weights alive (a linear layer saves its weight for backward). So stage 3 here always
recomputes, trading one extra forward per unit for holding only one unit's parameters at a time.

The units are the model's (FSDP's "wrapping units"): ``model.units()`` names them in forward order
with the parameters each uses, and ``model.wrap_units(runner)`` makes the model's forward run each
through ``runner(name, run, x)``, here ``checkpoint`` with the gathers around it. A parameter two
units use (the tied embedding: the embeddings and the head) is a group of its own, gathered for
each; its gradient arrives in two parts, each reduce-scattered and added to the same shard.

Prefetch (DeepSpeed's, by a recorded order): the all-gather of the next unit starts as soon as
this one's parameters are whole, so it travels while this unit computes. Which unit runs next
depends on the schedule (micro-batches, a pipeline's 1F1B, the recomputation in backward), so it
is not guessed: every training step records the units in the order it gathers them, and the next
step follows that record, one unit ahead (one more unit's parameters held: the bound). If the
last unit's forward is followed by its own backward, that gather starts when the forward frees
it. A step that departs from the record (another schedule, another number of micro-batches)
waits for what it prefetched, drops it, and records afresh; an optimizer step changes the
parameters, so nothing is prefetched across one; evaluation (no graph) neither records nor
prefetches.
"""

import math

from minipar.autograd import is_grad_enabled
from minipar.backend import xp
from minipar.parallel.data import sync_replicas
from minipar.parallel.recompute import checkpoint
from minipar.parallel.shards import Group
from minipar.parallel.zero import ShardedAdamW, refuse_unsupported


def unit_groups(units):
    """The parameter groups of ``units`` [(name, parameters)], in forward order: a parameter used
    by several units alone (so that each gathers it), then the rest of each unit's together."""
    uses = {}
    for _, params in units:
        for p in dict.fromkeys(params):
            uses[id(p)] = uses.get(id(p), 0) + 1
    order, seen = [], set()
    for _, params in units:
        shared = [p for p in dict.fromkeys(params) if uses[id(p)] > 1 and id(p) not in seen]
        rest = [p for p in dict.fromkeys(params) if uses[id(p)] == 1]
        order += [[p] for p in shared] + ([rest] if rest else [])
        seen.update(id(p) for p in shared)
    return order


class ZeRO3(ShardedAdamW):
    """ZeRO stage 3: parameters, gradients and optimizer state sharded (see the module docstring)."""

    stage = 3

    def __init__(self, model, comm, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, policy=None):
        refuse_unsupported(model, 3, type(self).__name__)
        units = model.units()
        params = model.parameters()
        sync_replicas(model, comm)  # every rank starts from rank 0's weights ...
        groups, offset = [], 0
        for ps in unit_groups(units):
            groups.append(Group(ps, comm, offset))
            offset += groups[-1].piece
        self.shapes = {id(p): p.shape for p in params}
        dtype = params[0].dtype
        self.master = xp.empty(sum(g.piece for g in groups), dtype)
        for g in groups:  # one group's flat copy at a time, not the whole model's
            self.master[g.shard] = g.flatten([p.data for p in g.params], dtype)[slice(*g.own())]
        self._empty = xp.empty(0, dtype)
        self._gathered = set()  # ids of the groups whose parameters are whole right now
        self._prefetched = {}  # id(group) -> (the all-gather's Request, its whole buffer)
        self._record, self._plan, self._next = [], None, 0  # units gathered this step; the last step's
        self.unit_gathers = {"prefetched": 0, "on demand": 0}  # how each unit's parameters came, so far
        for p in params:  # ... and keeps only its pieces
            p.held_by = self
            p.data = self._empty
        super().__init__(model, comm, lr, betas, eps, weight_decay, groups=groups, policy=policy)
        self.ledger.add("parameters", self.master.nbytes)
        group_of = {id(p): g for g in groups for p in g.params}
        self._unit_groups = {name: list({id(group_of[id(p)]): group_of[id(p)] for p in used}.values())
                             for name, used in units}
        model.wrap_units(self._run_unit)

    def master_pieces(self):
        return [self.master[g.shard] for g in self.groups]

    def shape_of(self, p):
        return self.shapes[id(p)]

    def numel(self, p):
        """The whole size of a parameter this optimizer holds in shards (its data may be empty)."""
        return math.prod(self.shapes[id(p)])

    def _run_unit(self, name, run, x):
        """Run one of the model's units: gathered for its forward (no graph kept), gathered again for
        its backward, which recomputes it, and its gradients reduce-scattered after."""
        groups = self._unit_groups[name]
        params = [p for g in groups for p in g.params]
        return checkpoint(run, x, params, rng=self.model.rng,
                          before=lambda: self._gather_unit(name, groups),
                          after=lambda: self._release_unit(groups),
                          before_backward=lambda: self.gradient_buffers(groups),
                          after_backward=lambda: self.reduce_scatter_unit(groups))

    def _gather_unit(self, name, groups):
        """Gather a unit (from its prefetch, if one is on the way), then start the next one's."""
        if is_grad_enabled():
            self._record.append(name)
            if self._plan is not None and self._plan[self._next:self._next + 1] == [name]:
                self._next += 1
            elif self._plan is not None:  # another order than the last step's: record afresh
                self._drop_prefetched()
                self._plan = None
        ready = all(id(g) in self._prefetched for g in groups)
        self.unit_gathers["prefetched" if ready else "on demand"] += 1
        self.gather_parameters(groups)
        self._prefetch_next()

    def _release_unit(self, groups):
        self.release_parameters(groups)
        self._prefetch_next()  # the next unit may be this one (the last unit's backward)

    def _prefetch_next(self):
        """Start the all-gathers of the next recorded unit's groups that are not whole already."""
        if self._plan is None or self._next >= len(self._plan) or not is_grad_enabled():
            return
        for g in self._unit_groups[self._plan[self._next]]:
            if id(g) not in self._gathered and id(g) not in self._prefetched:
                whole = xp.empty((g.comm.size, g.piece), self.master.dtype)
                self._prefetched[id(g)] = (g.comm.iall_gather(self.master[g.shard].copy(), out=whole), whole)
                self.ledger.add("parameters", whole.nbytes)

    def _drop_prefetched(self):
        for request, whole in self._prefetched.values():
            request.wait()  # every rank started it: every rank completes it
            self.ledger.remove("parameters", whole.nbytes)
        self._prefetched = {}

    def gather_parameters(self, groups):
        """ZeRO-3's communication before a unit runs: all-gather the groups' parameters (or wait
        for their prefetch) into whole buffers the parameters point into."""
        for g in groups:
            if id(g) in self._gathered:
                raise RuntimeError("a ZeRO-3 group was gathered twice without being released")
            self._gathered.add(id(g))
            if id(g) in self._prefetched:
                request, whole = self._prefetched.pop(id(g))
                request.wait()
            else:
                whole = xp.empty((g.comm.size, g.piece), self.master.dtype)
                g.comm.all_gather(self.master[g.shard].copy(), out=whole)
                self.ledger.add("parameters", whole.nbytes)
            flat = whole.reshape(-1)
            for p, part in zip(g.params, g.unflatten(flat)):
                p.data = part.reshape(self.shapes[id(p)])

    def release_parameters(self, groups):
        """After a unit ran: drop the whole parameters again."""
        for g in groups:
            self._gathered.discard(id(g))
            for p in g.params:
                p.data = self._empty
            self.ledger.remove("parameters", g.padded * self.master.itemsize)

    def gradient_buffers(self, groups):
        """Before a unit's backward: one flat zeroed buffer per group, its parameters' gradients
        views into it, so that the engine accumulates straight into what will be sent."""
        self._flats = []
        for g in groups:
            flat = xp.zeros(g.padded, self.grad_dtype)
            for p, part in zip(g.params, g.unflatten(flat)):
                p.grad = part.reshape(self.shapes[id(p)])
            self.ledger.add("gradients", flat.nbytes)
            self._flats.append(flat)

    def reduce_scatter_unit(self, groups):
        """ZeRO-3's communication after a unit's backward: reduce-scatter its gradient buffers
        into the owners' pieces and drop the views."""
        for g, flat in zip(groups, self._flats):
            self.reduce_scatter(g, flat, counted=True)
            for p in g.params:
                p.grad = None
        self._flats = []

    def step(self, grad_scale=1.0):  # the updated pieces stay where they are: the next forward gathers them
        self.finish_gradients()
        self._drop_prefetched()  # gathered before the update: stale after it
        self._adamw.step(grad_scale)

    def zero_grad(self):
        """The step's end, taken or skipped (fp16's overflow): its record is the next step's plan."""
        super().zero_grad()
        self._drop_prefetched()
        self._plan = self._record if self._record else self._plan
        self._record, self._next = [], 0

    def _parameter_store(self):
        """This rank's pieces of the parameters: the fp32 masters if kept, else the shard itself."""
        return self.master if self.masters is None else self.masters

    def full_state_dict(self):
        """{name: whole array} gathered from the shards (a collective)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for g in self.groups:
            self.gather_parameters([g])
            for p in g.params:
                out[names[id(p)]] = p.data.copy()
            self.release_parameters([g])
        return out
