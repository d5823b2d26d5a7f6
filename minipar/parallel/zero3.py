"""ZeRO stage 3: parameters sharded too; each unit's are gathered just in time and freed after.

Every rank keeps only its pieces of the parameters (see ``zero.py`` for the layout). Around each
unit of the model (the embeddings, each transformer block, the final LayerNorm with the head), as
FSDP does (Zhao et al. 2023):

    forward   all-gather the unit's parameters, run it (recording its graph), free them
    backward  all-gather again the groups the unit's backward reads (``zero3_units.py``: an
              identity on the unit's output, whose backward comes before every op of the unit's,
              gathers those its graph says it reads, ``read_in_backward``): those an op saved for
              it (a linear layer's dx = g W, a LayerNorm's) or runs again (recomputation), not a
              lookup's (an embedding's dW needs the ids alone); accumulate the gradients into one
              flat buffer per group; free the parameters once the unit's backward is over
              (the same identity on its input, FSDP's post-backward); as soon as a group's
              gradients are complete (the gradient hooks data parallelism uses) reduce-scatter
              them into the shards and free the buffer; complete means every parameter's hook
              fired in this backward (one a micro-batch left unused keeps the buffer waiting for a
              later micro-batch, or the step's end)
    split     a zero-bubble schedule's B gathers and frees as backward does, and makes no buffer
              (no weight gradient comes in B; but a group's whose second part this B gives W,
              the tied embedding's on one chunk); its W reads no weight (dW = g^T x) and runs with
              the weights released: its first hook of a group makes the group's buffer, the last
              sends it

Freeing is real because the graph keeps parameters by reference, not their arrays
(``autograd.save_parameters_by_reference``): the whole buffer's last owner is this optimizer, and
releasing a unit after its forward checks that nothing else holds the buffer. So a rank holds one
or two units' parameters at a time, in a split backward too, and no unit runs twice
(recomputation, ``--recompute``, is a separate choice, as in FSDP and DeepSpeed). A unit whose
input carries no gradient (the embeddings: token ids) has no moment after its backward; it reads
no weight there unless recomputed, whose groups then wait for their gradients' hooks.

The units are the model's (FSDP's "wrapping units"): ``model.units()`` names them in forward order
with the parameters each uses, and ``model.wrap_units(runner)`` makes the model's forward run each
through ``runner(name, run, x)``. A parameter two units use (the tied embedding: the embeddings
and the head) is a group of its own, gathered for each unit's forward and for the head's backward;
its gradient is complete only after both units' backwards, so its buffer waits for the
embeddings' backward, and its two parts go out summed, once.

Prefetch (``zero3_prefetch.py``, DeepSpeed's, by a recorded order): the all-gather of the next
unit starts as soon as this one's parameters are whole, one unit ahead of the last step's order.
"""

import math
import sys
from functools import partial

from minipar.autograd import Tensor, is_grad_enabled, save_parameters_by_reference
from minipar.backend import xp
from minipar.parallel.data import sync_replicas
from minipar.parallel.protocol import check_same_layout, finished_by_model, gradient_group
from minipar.parallel.shards import Group
from minipar.parallel.zero import ShardedAdamW
from minipar.parallel.zero3_prefetch import PrefetchingGather
from minipar.parallel.zero3_units import UnitBackward, read_in_backward, unit_groups
from minipar.weight_grad import left_to_w, second_part_in_w, weight_pass


class ZeRO3(PrefetchingGather, ShardedAdamW):
    """ZeRO stage 3: parameters, gradients and optimizer state sharded (see the module docstring)."""

    stage = 3

    def __init__(self, model, comm, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, policy=None):
        # sequence parallelism's partial sums (finished_by_model) last in each unit, a group of their own
        units = [(name, [p for p in used if not finished_by_model(p)] + [p for p in used if finished_by_model(p)])
                 for name, used in model.units()]
        params = model.parameters()
        index = {id(p): str(i) for i, p in enumerate(params)}
        check_same_layout(model, comm, type(self).__name__, [f"policy: {policy}"] + [  # the units cut the groups
            f"unit {k}: {name} with parameters {', '.join(index.get(id(p), '?') for p in used)}"
            for k, (name, used) in enumerate(units)])
        named = {id(p) for _, used in units for p in used}
        missing = [n for n, p in model.named_parameters() if id(p) not in named]
        if missing:  # never gathered, its data would be empty in every forward
            raise ValueError(f"{type(self).__name__}: parameter {missing[0]} is in no unit of model.units(): "
                             "ZeRO-3 gathers a parameter only for the units that name it; add it to its unit")
        if named - {id(p) for p in params}:
            raise ValueError(f"{type(self).__name__}: model.units() names a parameter that model.parameters() does not")
        sync_replicas(model, comm)  # every rank starts from rank 0's weights ...
        groups, offset = [], 0
        summed_over = lambda p: gradient_group(p, model.grid, comm)  # noqa: E731 (DP x CP, or an expert's edp)
        for ps in unit_groups(units, key=lambda p: (id(summed_over(p)), finished_by_model(p))):
            groups.append(Group(ps, summed_over(ps[0]), offset))
            offset += groups[-1].piece
        self.shapes = {id(p): p.shape for p in params}
        dtype = params[0].dtype
        self.master = xp.empty(sum(g.piece for g in groups), dtype)
        for g in groups:  # one group's flat copy at a time, not the whole model's
            self.master[g.shard] = g.flatten([p.data for p in g.params], dtype)[slice(*g.own())]
        self._empty = xp.empty(0, dtype)
        self._whole = {}  # id(group) -> its whole parameters, while gathered
        self._flats = {}  # id(group) -> its gradient buffer, from its backward's start (or W's) to its reduce-scatter
        self._start_prefetching()
        for p in params:  # ... and keeps only its pieces
            p.held_by = self
            p.data = self._empty
        save_parameters_by_reference()
        super().__init__(model, comm, lr, betas, eps, weight_decay, groups=groups, policy=policy)
        self.ledger.add("parameters", self.master.nbytes)
        self._group_of = {id(p): g for g in groups for p in g.params}
        self._ready = {id(g): set() for g in groups}  # its parameters whose gradient this backward completed
        self._pass = {}  # id(group) -> the W (weight_grad.weight_pass) its count is of, in a split backward
        self._unit_groups = {name: tuple({id(self._group_of[id(p)]): self._group_of[id(p)] for p in used}.values())
                             for name, used in units}
        for p in params:  # gradients W makes before their group's buffer are summed in its dtype too
            p.accumulate_dtype = self.grad_dtype if self.grad_dtype != p.dtype else None
        model.wrap_units(self._run_unit)

    def master_pieces(self):
        return [self.master[g.shard] for g in self.groups]

    def shape_of(self, p):
        return self.shapes[id(p)]

    def numel(self, p):
        """The whole size of a parameter this optimizer holds in shards (its data may be empty)."""
        return math.prod(self.shapes[id(p)])

    # ---- forward ------------------------------------------------------------------------------
    def _run_unit(self, name, run, x):
        """Run one of the model's units with its parameters gathered, then free them: its graph
        holds them by reference, and ``UnitBackward`` gathers again those its backward reads."""
        groups = self._unit_groups[name]
        self._gather_unit(name, groups)
        try:
            if isinstance(x, Tensor) and x.requires_grad and is_grad_enabled():
                x = UnitBackward.apply(x, partial(self.after_unit_backward, name))
            y = run(x)
            read = read_in_backward(y, groups) if y.requires_grad else ()
        finally:
            self.release_parameters(groups, check=True)
            self._prefetch_next()  # the next unit may be this one (the last unit's backward)
        return UnitBackward.apply(y, partial(self.before_unit_backward, name, read)) if y.requires_grad else y

    def release_parameters(self, groups, check=False):
        """Drop the groups' whole parameters. ``check``: after a forward, nothing but the
        parameters may hold the buffer (a graph that kept a view of it would keep it alive)."""
        for g in groups:
            whole = self._whole.pop(id(g), None)
            if whole is None:
                continue
            for p in g.params:
                p.data = self._empty
            self.ledger.remove("parameters", whole.nbytes)
            if check and sys.getrefcount(whole) > 2:  # the name ``whole`` and getrefcount's argument
                raise RuntimeError(
                    "ZeRO-3 could not free a unit's gathered parameters: an op saved a view of a "
                    "parameter for backward instead of the array it received (see "
                    "autograd.save_parameters_by_reference)")

    # ---- backward -----------------------------------------------------------------------------
    def before_unit_backward(self, name, read):
        """Before a unit's backward: the groups it reads (``read``) whole again, and each group a
        flat zeroed gradient buffer its parameters' gradients are views into, so that the engine
        accumulates straight into what will be sent; not a group whose gradients all wait for a
        W (a split backward's B): its W makes the buffer at its first hook, unless this B gives
        that W a second part of it (the tied embedding's lookup after the head, in one chunk):
        the first would otherwise wait beside the buffer, whole and uncounted."""
        if read:  # else nothing to gather (the embeddings' lookups), nor to record for the prefetch
            self._gather_unit(name, read)
        self._collect(keep=self.IN_FLIGHT)  # the last unit's send may be done: its buffer goes first
        for g in self._unit_groups[name]:
            # a hook fires once per backward, at a parameter's last use: what fired in an earlier
            # backward (a micro-batch that left a parameter of the group unused) may fire again in
            # this one, so only this backward's count says the group is complete
            self._ready[id(g)] = set()
            left = all(left_to_w(p) for p in g.params) and not any(second_part_in_w(p) for p in g.params)
            if id(g) not in self._flats and not left:
                self._grad_buffer(g)  # (one made already keeps its earlier micro-batches' gradients)

    def after_unit_backward(self, name):
        """After a unit's backward (a split one's B): its parameters go, complete or not; what
        still adds to their gradients (W: dW = g^T x; the embeddings' lookups of a tied
        embedding) reads none of them."""
        self.release_parameters(self._unit_groups[name])
        self._prefetch_next()

    def _grad_buffer(self, g):
        """A group's flat gradient buffer, its parameters' gradients views into it (keeping what
        they hold: a W makes it at its first hook of the group, that parameter's gradient in)."""
        flat = xp.zeros(g.padded, self.grad_dtype)
        for p, part in zip(g.params, g.unflatten(flat)):
            view = part.reshape(self.shapes[id(p)])
            if p.grad is not None:
                view[...] = p.grad
            p.grad = view
        self.ledger.add("gradients", flat.nbytes)
        self._flats[id(g)] = flat

    def _gradient_ready(self, p):
        super()._gradient_ready(p)
        g = self._group_of[id(p)]
        if id(g) not in self._flats:
            if weight_pass() is None:  # its unit's backward never began: no buffer, maybe no data
                raise RuntimeError("a ZeRO-3 parameter got a gradient outside its unit's backward: run the "
                                   "model's forward (its units) to make the graph")
            # a split backward's W (zero-bubble schedules, the head's W at the flush): B made none
            self._grad_buffer(g)
        if weight_pass() is not None and self._pass.get(id(g)) != weight_pass():
            # a hook fires once per W, at the weight's last use there: only this W's count says complete
            self._pass[id(g)], self._ready[id(g)] = weight_pass(), set()
        self._ready[id(g)].add(id(p))
        self._progress_prefetch()  # a moment between two ops of backward: the prefetch moves on
        if len(self._ready[id(g)]) == len(g.params) and id(g) in self._later:
            self._ready[id(g)] = set()  # the parameters go as the others' do; the buffer waits for the sums
            self.release_parameters([g])
            self._prefetch_next()
        elif len(self._ready[id(g)]) == len(g.params):
            self.reduce_scatter_group(g)

    def reduce_scatter_group(self, g):
        """ZeRO-3's communication once backward has finished a group: reduce-scatter its gradient
        buffer into the owners' pieces, and free the buffer and the group's parameters."""
        self._ready[id(g)] = set()
        flat = self._flats.pop(id(g))
        for p in g.params:
            p.grad = None
        self.release_parameters([g])  # first: the send below may wait for an earlier one
        self.reduce_scatter(g, flat, counted=True)
        self._prefetch_next()

    def _send_rest(self):
        """Groups some parameter of which got no gradient: send what they have now."""
        for g in self.groups:
            if id(g) in self._flats:
                self.reduce_scatter_group(g)

    def step(self, grad_scale=1.0):  # the updated pieces stay where they are: the next forward gathers them
        self.finish_gradients()
        self._drop_prefetched()  # gathered before the update: stale after it
        self._adamw.step(grad_scale)

    def zero_grad(self):
        """The step's end, taken or skipped (fp16's overflow): its record is the next step's plan."""
        super().zero_grad()
        self._ready = {key: set() for key in self._ready}
        for g in self.groups:  # a step dropped before finish_gradients: its waiting buffers go too
            if id(g) in self._flats:
                self.ledger.remove("gradients", self._flats.pop(id(g)).nbytes)
                for p in g.params:
                    p.grad = None
                self.release_parameters([g])
        self._follow_record()

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
