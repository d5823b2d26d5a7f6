"""ZeRO-3's gathers and reduce-scatters on one pipeline rank, counted per parameter group as
``parallel/zero3.py`` makes and sends them, over the rank's schedule.

The groups (``zero3.unit_groups``): each block one (its experts another, over "edp", with expert
parallelism; without it the experts' gradients go over DP x CP, in the block's group), and under
sequence parallelism its partial sums (LayerNorms, row-parallel biases, the router) a group of
their own, held for the model's sums over TP and sent once after ``finalize_grads``. The edges: on
a stage with both ends the tied embedding is its own group (two units use it), the positions and
ln_f each one (held under SP); on a pipeline's end alone the tied embedding, summed over
"embedding" after backward, is held, with the positions (first) or ln_f (last) in its group under
SP, each a group apart otherwise (the latter sent as the blocks are).

A group is gathered before a unit's forward and its backward unless it is whole already, and
released after the forward; a whole backward sends it as it ends (held: releases it), a split one
(B, then W: zero-bubble schedules) leaves it whole after B, and W sends and releases it. So with a
whole backward a group goes out 2m times a step and is sent m times; with a split one a forward or
B that follows a B of its chunk gathers nothing (ZB-H1 and ZB-H2: rank r's first r or 2r B's, whose
W's it holds back, in closed form; ZB-V walked); the head's weight gradient at the flush
(``--defer-embedding-wgrad-compute``) keeps the tied embedding's group whole from a backward to the
next forward, m + 1 gathers in all. One stage with both ends gathers the tied embedding for each
of its two units' forwards (3m).

The most it holds (``peak_bytes``): besides its shards, the whole parameters of the groups
gathered and of the next recorded unit's (the prefetch, one unit ahead), the gradient buffer of
every group whose backward has begun and that is not sent yet (a held group's until
finalize_grads), and each send in flight, its buffer and the 1/N piece it receives
(``ShardedAdamW.IN_FLIGHT`` = 1 of them pending). Which moment is fullest depends on the layout,
so the step is replayed as ``parallel/zero3.py`` runs it, over the rank's schedule, unit by unit,
and the ledger's peak read off. The fullest moment is usually a unit's backward making its
buffers; with DP alone, p and g the bytes of a weight and a gradient, B a block's parameters and
V' h the tied embedding's (whole from the head's backward to the embeddings'):

    state after a step + (p + g) V' h + (2p + g (2 + 1/N)) B
        (block i whole, block i - 1 prefetched, block i's buffer, block i + 1's sent: buffer and piece)

Under a pipeline the first stage's block 0 has the embeddings prefetched, tied embedding too, and
the held tied embedding's buffer; a split backward's B leaves all of its chunk's units whole and
buffered until W (ZB-H1's stages hold their whole chunk so). When a send finishes is not
deterministic: the replay takes the worst case, no send done before the optimizer has to wait for
it, which runs do reach (``in_flight=0``, every send done at once, is the least); under that
timing it equals the ledger's peak exactly (tests/mpi/plan_counts.py). Every parameter is taken to
get its gradient in every backward (an expert no token reached leaves its group whole and waiting).
"""

from dataclasses import dataclass
from functools import lru_cache

from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.instructions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, HEAD_WEIGHT,
                                                    STEP)
from minipar.parallel.run_config import SPLIT_BACKWARD
from minipar.parallel.zero import ShardedAdamW

from . import state
from .bubble import ZERO_BUBBLE_ORDERS
from .shapes import PRECISIONS

HELD_BACK_W = {"zb-h1": 1, "zb-h2": 2}  # rank r holds back r or 2r W's (``zero_bubble.held_back``'s kept_w)


@dataclass
class Groups:
    """Parameter groups gathered and sent alike: over ``comm`` ("dp": DP x CP, or "edp"), used by
    the rank's local ``chunks``; how many, how many held (sent once), their parameters and the held
    ones'; ``deferred``: the tied embedding's, whose gradient waits for the flush."""

    comm: str
    chunks: tuple
    deferred: bool = False
    groups: int = 0
    held: int = 0
    params: int = 0
    held_params: int = 0

    def add(self, params, held):
        self.groups, self.params = self.groups + 1, self.params + params
        self.held, self.held_params = self.held + held, self.held_params + params * held


@dataclass(frozen=True)
class Unit:
    """One of ``GPT.units()`` on the rank: the groups gathered for it (``ZeRO3._unit_groups``), and
    the groups a pass over it completes, in the order its gradient hooks complete them: in a whole
    backward, in a split backward's W, in the head's deferred W at the flush."""

    name: str
    groups: tuple
    backward: tuple
    weight: tuple
    head: tuple = ()


def rank_units(model, layout, stage):
    """(groups, chunks): the rank's ZeRO-3 groups in ``ZeRO3.groups``' order, each (parameters, the
    ranks it is sharded over, held until finalize_grads), and each local chunk's units in forward
    order (``zero3.unit_groups`` on ``GPT.units()``; ``groups`` gathers them into kinds)."""
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
        if c == 0 and both:  # its hooks: the positions', then the tied embedding's (after the head's)
            e = new(wpe, sp)
            units.append(Unit("embed", (tied, e), (e, tied), (e, tied)))
        elif c == 0:  # the tied embedding held for the "embedding" sum, with the positions under SP
            e = (new(wpe + wte, True),) if sp else (new(wpe, False), new(wte, True))
            units.append(Unit("embed", e, e, e))
        units += [_block(model, layout, layer, new, sp, n) for layer in state.chunk_layers(model, layout, c)]
        if c == last and both:  # the head's backward leaves the tied embedding to the embeddings'; its W sends it
            e = new(lnf, sp)
            units.append(Unit("head", (e, tied), (e,), (tied, e)))
        elif c == last and sp:  # one held group; deferred, its W and ln_f's hooks never complete it in one pass
            e = new(lnf + wte, True)
            units.append(Unit("head", (e,), () if layout.defer_embedding_wgrad else (e,), (e,)))
        elif c == last:  # the head's weight first, then ln_f's
            e, t = new(lnf, False), new(wte, True)
            defer = layout.defer_embedding_wgrad
            units.append(Unit("head", (e, t), (e,) if defer else (t, e), (t, e), (t,) if defer else ()))
        out.append(units)
    return groups, out


def _block(model, layout, layer, new, sp, n):
    """Block ``layer``'s unit: its dense weights, SP's partial sums (held), its experts over "edp"
    (with EP; held under SP). A backward's hooks complete first the group whose first parameter the
    forward uses last: the experts, the other weights, the partial sums (ln_1); under full
    recomputation a whole backward fires all as the checkpoint's ends, in ``parameters()`` order (the
    groups'), while a W runs the recomputed B's parked nodes in backward order as ever."""
    params, expert = state.block_parameters(model, layout, layer)
    partial = state.partial_sums(model, layer) if sp else 0
    if layout.ep == 1:  # the experts' gradients summed over DP x CP too, in the block's runs
        params, partial, expert = params + expert, partial + expert * sp, 0
    dense = new(params - partial, False)
    part = new(partial, True) if partial else None
    experts = new(expert, sp, n // layout.ep) if expert else None
    made = tuple(g for g in (dense, part, experts) if g is not None)
    hooks = tuple(g for g in (experts, dense, part) if g is not None)
    return Unit(f"h.{layer}", made, made if layout.recompute else hooks, hooks)


def groups(model, layout, stage):
    """The rank's parameter groups (``rank_units``), gathered into kinds that are gathered and sent
    alike: over one communicator, by the units of the same local chunks."""
    made, chunks = rank_units(model, layout, stage)
    n, used, deferred = layout.dp * layout.cp, {}, set()
    for local, units in enumerate(chunks):
        for unit in units:
            for g in unit.groups:
                used.setdefault(g, []).append(local)
                # the head's weight gradient at the flush: its group (held) whole from a backward to the next forward
                deferred.update([g] if layout.defer_embedding_wgrad and unit.name == "head" and made[g][2] else [])
    kinds = {}
    for g, (params, over, held) in enumerate(made):
        key = ("dp" if over == n else "edp", tuple(used[g]), g in deferred)
        kinds.setdefault(key, Groups(*key)).add(params, held)
    return list(kinds.values())


def uses(layout, m, stage, kind):
    """(gathers, sends): how often each group of ``kind`` is all-gathered and reduce-scattered in a
    step (a held group's sends are the one after finalize_grads, whatever this says)."""
    if layout.schedule in HELD_BACK_W:  # B's not followed by a W: the first W's held back, or all of them
        return 2 * m - min(HELD_BACK_W[layout.schedule] * stage, m - 1), m
    if layout.schedule in SPLIT_BACKWARD:
        return _walk(layout.schedule, layout.pp, m, stage)[kind.chunks]
    if kind.deferred:
        return m + 1, m
    # the tied embedding of a stage with both ends (in one chunk: no pipeline) is gathered for both units' forwards
    return (3 * m if len(kind.chunks) > 1 else 2 * m), m


@lru_cache(maxsize=256)
def _walk(schedule, p, m, rank):
    """{chunks: (gathers, sends)} of a group that the rank's local ``chunks`` use (one, or in a V
    both), over its split-backward order: F and B gather it unless a B left it whole; F and W
    release it; W sends it."""
    sets = [(0,), (1,), (0, 1)] if schedule == "zb-v" else [(0,)]
    whole, gathers, sends = dict.fromkeys(sets, False), dict.fromkeys(sets, 0), dict.fromkeys(sets, 0)
    for op, _, chunk in ZERO_BUBBLE_ORDERS[schedule](p, m, rank):
        for chunks in sets:
            if chunk not in chunks:
                continue
            if op in (FORWARD, BACKWARD_INPUT):
                gathers[chunks] += not whole[chunks]
                whole[chunks] = op == BACKWARD_INPUT
            elif op == BACKWARD_WEIGHT:
                sends[chunks], whole[chunks] = sends[chunks] + 1, False
    return {chunks: (gathers[chunks], sends[chunks]) for chunks in sets}


# ---- the most ZeRO-3 holds during a step ---------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _passes(schedule, p, m, v, defer, rank):
    """The rank's compute in a step, (op, local chunk), then its step: ``schedules.build``'s order
    without the messages (build checks m's MPI tags, and the walk's 2p may need more than the run's
    m); the head's deferred W's before the step, on the rank holding the last chunk."""
    passes = [(op, chunk) for op, _, chunk in schedules.compute_order(schedule, p, m, v, rank)]
    if defer and rank == p - 1:
        passes += [(HEAD_WEIGHT, v - 1)] * passes.count((BACKWARD, v - 1))
    return tuple(passes) + ((STEP, 0),)


def peak_bytes(model, layout, m=None, stage=0, dtype="float32", in_flight=None):
    """{"parameters", "gradients", "optimizer": each kind's peak, "total": the peak of their sum}:
    what ``ZeRO3``'s ledger reaches in a training step after the first (which records the order
    the next ones prefetch in), replayed over the rank's schedule of m micro-batches as
    ``parallel/zero3.py`` runs it. The peak grows with m up to m = 2p and stays there (tested), so
    m is taken as at most 2p, and as 2p when None: the most for any m. ``in_flight``: the
    reduce-scatters a send may leave pending (``ShardedAdamW.IN_FLIGHT``, the default: no send
    finishes before the optimizer must wait for it, the worst case; 0: each at once, the least)."""
    return replay(model, layout, 2 * layout.pp if m is None else min(m, 2 * layout.pp), stage, dtype, in_flight)


def replay(model, layout, m, stage=0, dtype="float32", in_flight=None):
    """``peak_bytes`` of exactly m micro-batches: the walk over the rank's schedule."""
    groups, chunks = rank_units(model, layout, stage)
    walk = _Replay(groups, PRECISIONS[dtype], state.state_bytes(model, layout, stage, dtype),
                   ShardedAdamW.IN_FLIGHT if in_flight is None else in_flight)
    passes = _passes(layout.schedule, layout.pp, m, layout.vpp, layout.defer_embedding_wgrad, stage)
    # the units in the order the step gathers them: the last step's record, which the prefetch follows
    walk.record = [u for op, c in passes if op in (FORWARD, BACKWARD, BACKWARD_INPUT)
                   for u in (chunks[c] if op == FORWARD else chunks[c][::-1])]
    for op, c in passes:
        units = chunks[c] if op != STEP else ()
        if op == FORWARD:
            for u in units:
                walk.forward(u)
        elif op in (BACKWARD, BACKWARD_INPUT):  # B: no hook fires, every group stays whole and buffered
            for u in units[::-1]:
                walk.before_backward(u)
                for g in u.backward if op == BACKWARD else ():
                    walk.complete(g)
        elif op in (BACKWARD_WEIGHT, HEAD_WEIGHT):
            for u in units[::-1]:
                for g in u.weight if op == BACKWARD_WEIGHT else u.head:
                    walk.complete(g, make=True)
        else:
            walk.finish()
    return {**walk.peak, "total": walk.peak_total}


class _Replay:
    """``ZeRO3``'s ledger over a step: its whole parameters (gathered, prefetched), gradient buffers
    and sends in flight, by the same rules, the groups' bytes for their arrays."""

    def __init__(self, groups, d, base, keep):
        self.held = [held for _, _, held in groups]
        padded = [-(-params // over) * over for params, over, _ in groups]
        self.whole_bytes = [d.param * size for size in padded]
        self.flat_bytes = [d.grad * size for size in padded]
        self.piece_bytes = [d.grad * size // over for size, (_, over, _) in zip(padded, groups)]
        self.keep, self.record, self.next = keep, [], 0
        self.whole, self.prefetched, self.flats, self.pending = set(), set(), set(), []
        self.now, self.peak = dict(base), dict(base)
        self.peak_total = sum(base.values())

    def add(self, kind, nbytes):
        self.now[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.now[kind])
        self.peak_total = max(self.peak_total, sum(self.now.values()))

    def gather(self, unit):  # ZeRO3._gather_unit
        self.next += 1
        for g in unit.groups:
            if g not in self.whole:
                self.whole.add(g)
                if g in self.prefetched:
                    self.prefetched.remove(g)
                else:
                    self.add("parameters", self.whole_bytes[g])
        self.prefetch()

    def prefetch(self):  # ZeRO3._prefetch_next: the next recorded unit's groups
        for g in self.record[self.next].groups if self.next < len(self.record) else ():
            if g not in self.whole and g not in self.prefetched:
                self.prefetched.add(g)
                self.add("parameters", self.whole_bytes[g])

    def release(self, g):
        if g in self.whole:
            self.whole.remove(g)
            self.add("parameters", -self.whole_bytes[g])

    def forward(self, unit):  # ZeRO3._run_unit
        self.gather(unit)
        for g in unit.groups:
            self.release(g)
        self.prefetch()

    def before_backward(self, unit):  # ZeRO3.before_unit_backward
        self.gather(unit)
        self.collect(self.keep)
        for g in unit.groups:
            self.buffer(g)

    def buffer(self, g):
        if g not in self.flats:
            self.flats.add(g)
            self.add("gradients", self.flat_bytes[g])

    def complete(self, g, make=False):
        """A group's hooks have all fired: held, its parameters go; else it is sent. ``make``: in
        a W, a group an earlier W sent gets a new buffer at its first hook."""
        if make:
            self.buffer(g)
        if self.held[g]:
            self.release(g)
            self.prefetch()
        else:
            self.send(g)

    def send(self, g):  # ZeRO3.reduce_scatter_group and ShardedAdamW.reduce_scatter
        self.flats.remove(g)
        self.release(g)
        self.add("gradients", self.piece_bytes[g])
        self.pending.append(g)
        self.collect(self.keep)
        self.prefetch()

    def collect(self, keep):
        while len(self.pending) > keep:
            g = self.pending.pop(0)
            self.add("gradients", -self.flat_bytes[g] - self.piece_bytes[g])

    def finish(self):  # finish_gradients: the groups still buffered (held ones), in order, then every send
        for g in sorted(self.flats):
            self.send(g)
        self.collect(0)
