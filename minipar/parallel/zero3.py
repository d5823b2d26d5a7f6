"""ZeRO stage 3: parameters sharded too; each layer's are gathered just in time and freed after.

Every rank keeps only its pieces of the parameters (see ``zero.py`` for the layout). Around each
unit of the model (the embeddings, each transformer block, the final LayerNorm with the head):

    forward   all-gather the unit's parameters, run it without recording a graph, free them
    backward  all-gather them again, run the unit again with a graph (``recompute.checkpoint``),
              backpropagate, reduce-scatter the unit's gradients into the shards, free them all

Running the unit without a graph in forward is what makes freeing real: a recorded graph would keep
the gathered weights alive (a linear layer saves its weight for backward). So stage 3 here always
recomputes, trading one extra forward per unit for holding only one unit's parameters at a time.

The tied embedding is used by two units, the embeddings and the head: it is gathered for each, and
its gradient arrives in two parts, each reduce-scattered and added to the same shard.
"""

import math

from minipar.backend import xp
from minipar.parallel.data import sync_replicas
from minipar.parallel.recompute import checkpoint
from minipar.parallel.shards import Group
from minipar.parallel.zero import NOT_WITH_PIPELINES, ZeroAdamW


def gpt_units(model):
    """(owner, method name, parameters it uses) for each unit of a GPT, in forward order."""
    tr = model.transformer
    units = [(model, "embed", [tr.wte.weight, tr.wpe.weight])]
    units += [(block, "forward", block.parameters()) for block in tr.h]
    units.append((model, "logits", tr.ln_f.parameters() + [tr.wte.weight]))
    return units


class Zero3(ZeroAdamW):
    def __init__(self, model, comm, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        if getattr(model, "pp", None) is not None:
            raise ValueError(NOT_WITH_PIPELINES.format(stage_1="ZeRO stage 1 (or 0)"))
        units = gpt_units(model)
        params = model.parameters()
        sync_replicas(model, comm)  # every rank starts from rank 0's weights ...
        tr = model.transformer
        order = [[tr.wte.weight], [tr.wpe.weight]] + [b.parameters() for b in tr.h] + [tr.ln_f.parameters()]
        groups, offset = [], 0
        for ps in order:
            groups.append(Group(ps, comm, offset))
            offset += groups[-1].piece
        self.shapes = {id(p): p.shape for p in params}
        dtype = params[0].dtype
        self.master = xp.empty(sum(g.piece for g in groups), dtype)
        for g in groups:  # one group's flat copy at a time, not the whole model's
            self.master[g.shard] = g.flatten([p.data for p in g.params], dtype)[slice(*g.own())]
        self._empty = xp.empty(0, dtype)
        self._gathered = set()  # ids of the groups whose parameters are whole right now
        for p in params:  # ... and keeps only its pieces
            p.held_by = self
            p.data = self._empty
        super().__init__(model, comm, 3, lr, betas, eps, weight_decay, groups=groups)
        self.ledger.add("parameters", self.master.nbytes)
        self._group_of = {id(p): g for g in groups for p in g.params}
        for owner, name, used in units:
            self._wrap(owner, name, [self._group_of[id(p)] for p in dict.fromkeys(used)])

    def master_pieces(self):
        return [self.master[g.shard] for g in self.groups]

    def numel(self, p):
        """The whole size of a parameter this optimizer holds in shards (its data may be empty)."""
        return math.prod(self.shapes[id(p)])

    def _wrap(self, owner, name, groups):
        groups = list({id(g): g for g in groups}.values())
        run = getattr(owner, name)

        params = [p for g in groups for p in g.params]

        def unit(x):
            return checkpoint(run, x, params, rng=getattr(self.model, "rng", None),
                              before=lambda: self.gather(groups), after=lambda: self.release(groups),
                              before_backward=lambda: self.gradient_buffers(groups),
                              after_backward=lambda: self.send_gradients(groups))

        setattr(owner, name, unit)

    def gather(self, groups):
        """All-gather the groups' parameters into whole buffers the parameters point into."""
        for g in groups:
            if id(g) in self._gathered:
                raise RuntimeError("a ZeRO-3 group was gathered twice without being released")
            self._gathered.add(id(g))
            whole = xp.empty((self.comm.size, g.piece), self.master.dtype)
            self.comm.all_gather(self.master[g.shard].copy(), out=whole)
            flat = whole.reshape(-1)
            for p, part in zip(g.params, g.unflatten(flat)):
                p.data = part.reshape(self.shapes[id(p)])
            self.ledger.add("parameters", flat.nbytes)

    def release(self, groups):
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
            flat = xp.zeros(g.padded, self.master.dtype)
            for p, part in zip(g.params, g.unflatten(flat)):
                p.grad = part.reshape(self.shapes[id(p)])
            self.ledger.add("gradients", flat.nbytes)
            self._flats.append(flat)

    def send_gradients(self, groups):
        """After a unit's backward: reduce-scatter its gradient buffers and drop the views."""
        for g, flat in zip(groups, self._flats):
            self.reduce_scatter(g, flat, counted=True)
            for p in g.params:
                p.grad = None
        self._flats = []

    def full_state_dict(self, model_names):
        """{name: whole array} gathered from the shards (a collective)."""
        names = {id(p): n for n, p in model_names}
        out = {}
        for g in self.groups:
            self.gather([g])
            for p in g.params:
                out[names[id(p)]] = p.data.copy()
            self.release([g])
        return out
