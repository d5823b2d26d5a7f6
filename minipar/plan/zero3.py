"""ZeRO-3's gathers and reduce-scatters on one pipeline rank, counted per parameter group as
``parallel/zero3.py`` makes and sends them, over the rank's schedule.

The groups (``zero3_units.unit_groups``): each block one (its experts another, over "edp", with
expert parallelism; without it the experts' gradients go over DP x CP, in the block's group), and
under sequence parallelism its partial sums (LayerNorms, row-parallel biases, the router) a group
of their own, held for the model's sums over TP and sent once after ``finalize_grads``. The
edges: on a stage with both ends the tied embedding is its own group (two units use it), the
positions and ln_f each one (held under SP); on a pipeline's end alone the tied embedding, summed
over "embedding" after backward, is held, with the positions (first) or ln_f (last) in its group
under SP, each a group apart otherwise (the latter sent as the blocks are).

A group is gathered before each forward of a unit that uses it and before each backward (B, in a
split one) of a unit whose backward reads it, and released after each: the blocks' and the head's
backwards read their weights (dx = g W, a LayerNorm's dx), the embeddings' lookups none (their
gradient needs the ids alone), and W none (dW = g^T x). So every unit but the embeddings is
gathered twice per micro-batch, whatever the schedule: a group goes out m times for each unit's
forward and m more for each reading backward (the tied embedding of a stage with both ends: 3m,
the embeddings' own groups m), and is sent once per micro-batch by each local chunk's backward or
W that completes it (a held group once, after ``finalize_grads``).

The most it holds during a step: ``zero3_peak.py``.
"""

from dataclasses import dataclass
from functools import lru_cache

from . import state


@dataclass
class Groups:
    """Parameter groups gathered and sent alike: over ``comm`` ("dp": DP x CP, or "edp"), used by
    units of the rank's local ``chunks`` (an entry per unit), ``read`` of those units' backwards
    reading them; how many, how many held (sent once), their parameters and the held ones'."""

    comm: str
    chunks: tuple
    read: int
    groups: int = 0
    held: int = 0
    params: int = 0
    held_params: int = 0

    def add(self, params, held):
        self.groups, self.params = self.groups + 1, self.params + params
        self.held, self.held_params = self.held + held, self.held_params + params * held


@dataclass(frozen=True)
class Unit:
    """One of ``GPT.units()`` on the rank: the groups gathered for its forward
    (``ZeRO3._unit_groups``) and for its backward (``zero3_units.read_in_backward``), the groups a
    whole backward completes, in the order its gradient hooks complete them, and a W's hooks, in a
    split backward's W and in the head's deferred W at the flush: each a sequence of groups in
    which a group's first entry is the hook that makes its buffer and its last the one that
    completes it."""

    name: str
    groups: tuple
    read: tuple
    backward: tuple
    weight: tuple
    head: tuple = ()


@lru_cache(maxsize=256)  # asked for each replay of the rank (tuples: the planner's replays share them)
def rank_units(model, layout, stage):
    """(groups, chunks): the rank's ZeRO-3 groups in ``ZeRO3.groups``' order, each (parameters, the
    ranks it is sharded over, held until finalize_grads), and each local chunk's units in forward
    order (``zero3_units.unit_groups`` on ``GPT.units()``; ``groups`` gathers them into kinds)."""
    h, sp, n = model.hidden_size, layout.sequence_parallel and layout.tp > 1, layout.dp * layout.cp
    chunks, last = state.stage_chunks(layout, stage), layout.pp * layout.vpp - 1
    wte, wpe, lnf = state.token_embedding(model, layout), model.seq_length * model.hidden_size, 2 * h
    groups = []

    def new(params, held, over=n):
        groups.append((params, over, held))
        return len(groups) - 1

    both = 0 in chunks and last in chunks
    tied = new(wte, False) if both else None  # used by two units: a group of its own, first
    out = []
    for c in chunks:
        units = []
        # the embeddings' backward reads no table: a lookup's gradient needs the ids alone
        if c == 0 and both:  # its hooks: the positions', then the tied embedding's (after the head's)
            e = new(wpe, sp)
            units.append(Unit("embed", (tied, e), (), (e, tied), (e, tied)))
        elif c == 0:  # the tied embedding held for the "embedding" sum, with the positions under SP
            e = (new(wpe + wte, True),) if sp else (new(wpe, False), new(wte, True))
            units.append(Unit("embed", e, (), e, e))
        layers = state.chunk_layers(model, layout, c)
        parked = layers[::-1][:-(-layout.defer_wgrad_linears // 4)] if c == last else []  # deferred linears' blocks
        units += [_block(model, layout, layer, new, sp, n, layer in parked) for layer in layers]
        if c == last and both:  # in the embeddings' chunk the head leaves the tied embedding to their
            e = new(lnf, sp)  # backward (or W); in a chunk apart (a V) its own backward (or W) sends it
            hooks = (e,) if c == 0 else (tied, e)
            units.append(Unit("head", (e, tied), (e, tied), hooks, hooks))
        elif c == last and sp:  # one held group; deferred, its W and ln_f's hooks never complete it in one pass
            e = new(lnf + wte, True)
            units.append(Unit("head", (e,), (e,), () if layout.defer_embedding_wgrad else (e,), (e,)))
        elif c == last:  # the head's weight first, then ln_f's
            e, t = new(lnf, False), new(wte, True)
            defer = layout.defer_embedding_wgrad
            units.append(Unit("head", (e, t), (e, t), (e,) if defer else (t, e), (t, e), (t,) if defer else ()))
        out.append(tuple(units))
    return tuple(groups), tuple(out)


def _block(model, layout, layer, new, sp, n, parked=False):
    """Block ``layer``'s unit: its dense weights, SP's partial sums (held), its experts over "edp"
    (with EP; held under SP). A backward's hooks complete first the group whose first parameter the
    forward uses last: the experts, the other weights, the partial sums (ln_1); under full
    recomputation a whole backward fires all as the checkpoint's ends, in ``parameters()`` order (the
    groups'), while a W runs the recomputed B's parked nodes in backward order as ever. A W's first
    hooks, which make the buffers: a MoE block's router (its Linear's backward comes right after
    the unpermute's, before the experts'), the experts, then the next output projection's weight
    (dense) and bias (a partial sum under SP); its last ones as a whole backward's. ``parked``: some
    of its linear weights' gradients wait for the flush (``defer_wgrad_linears``), where each W is a
    pass of its own, so no pass fires every hook of its dense group: that group keeps its buffer,
    made by the backward, until the step sends it (held, and no backward completes it)."""
    params, expert = state.block_parameters(model, layout, layer)
    partial = state.partial_sums(model, layer) if sp else 0
    if layout.ep == 1:  # the experts' gradients summed over DP x CP too, in the block's runs
        params, partial, expert = params + expert, partial + expert * sp, 0
    dense = new(params - partial, parked)
    part = new(partial, True) if partial else None
    experts = new(expert, sp, n // layout.ep) if expert else None
    made = tuple(g for g in (dense, part, experts) if g is not None)
    hooks = tuple(g for g in (experts, dense, part) if g is not None)
    router = ((part if sp else dense),) if model.is_moe(layer) else ()
    weight = tuple(g for g in router + (experts, dense, part, dense, part) if g is not None)
    completes = tuple(g for g in (made if layout.recompute else hooks) if not (parked and g == dense))
    return Unit(f"h.{layer}", made, made, completes, weight)


def groups(model, layout, stage):
    """The rank's parameter groups (``rank_units``), gathered into kinds that are gathered and sent
    alike: over one communicator, by the units of the same local chunks, read by as many of their
    backwards."""
    # (the planner asks for many layouts that differ only in what the groups do not read)
    return [Groups(*kind) for kind in _groups(model, state.sharded(layout), stage)]  # (new: the cached stay as made)


@lru_cache(maxsize=4096)
def _groups(model, layout, stage):
    made, chunks = rank_units(model, layout, stage)
    n, used, read = layout.dp * layout.cp, {}, {}
    for local, units in enumerate(chunks):
        for unit in units:
            for g in unit.groups:
                used.setdefault(g, []).append(local)
                read[g] = read.get(g, 0) + (g in unit.read)
    kinds = {}
    for g, (params, over, held) in enumerate(made):
        key = ("dp" if over == n else "edp", tuple(used[g]), read[g])
        kinds.setdefault(key, Groups(*key)).add(params, held)
    return tuple((k.comm, k.chunks, k.read, k.groups, k.held, k.params, k.held_params) for k in kinds.values())


def uses(layout, m, stage, kind):
    """(gathers, sends): how often each group of ``kind`` is all-gathered and reduce-scattered in a
    step: for each unit's forward and each reading backward, every micro-batch; sent by each local
    chunk's backward (or W) of every micro-batch (a held group's sends are the one after
    finalize_grads, whatever this says)."""
    return m * (len(kind.chunks) + kind.read), m * len(set(kind.chunks))
