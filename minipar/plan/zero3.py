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

The most it holds (``peak_bytes``): besides its shards, the whole parameters of the groups
gathered and of the next recorded unit's (the prefetch, one unit ahead), the gradient buffer of
every group whose backward has begun (in a split backward: whose W has begun) and that is not sent
yet (a held group's until finalize_grads), and each send in flight, its buffer and the 1/N piece
it receives (``ShardedAdamW.IN_FLIGHT`` = 1 of them pending). Which moment is fullest depends on
the layout, so the step is replayed as ``parallel/zero3.py`` runs it, over the rank's schedule,
unit by unit, and the ledger's peak read off. The fullest moment is usually a block's backward
making its buffer; with DP alone, p and g the bytes of a weight and a gradient, B a block's
parameters, V' h the tied embedding's (buffered from the head's backward to the embeddings') and
T h the positions':

    state after a step + g V' h + (p + g (2 + 1/N)) B + p max(B, (V' + T) h)
        (block i whole; the unit before it prefetched: block i - 1, or before block 0 the next
        micro-batch's embeddings (B alone with one micro-batch); block i's buffer; block i + 1's
        sent: buffer and piece)

Under a pipeline the first stage's block 0 has the embeddings prefetched and the held tied
embedding's buffer; a split backward holds no more whole units than a whole one (B releases them,
W reads none) and its buffers only from a W's first hook of the group to its last. When a send
finishes is not deterministic: the replay takes the worst case, no send done before the optimizer
has to wait for it, which runs do reach (``in_flight=0``, every send done at once, is the least);
under that timing it equals the ledger's peak exactly (tests/mpi/plan_counts.py). Every parameter
gets its gradient in every backward (an expert no token reached runs on 0 rows: its hooks fire).
"""

from dataclasses import dataclass, replace
from functools import lru_cache

from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.instructions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, HEAD_WEIGHT,
                                                    STEP)
from minipar.parallel.zero import ShardedAdamW

from . import state
from .shapes import PRECISIONS


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
        units += [_block(model, layout, layer, new, sp, n) for layer in state.chunk_layers(model, layout, c)]
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
        out.append(units)
    return groups, out


def _block(model, layout, layer, new, sp, n):
    """Block ``layer``'s unit: its dense weights, SP's partial sums (held), its experts over "edp"
    (with EP; held under SP). A backward's hooks complete first the group whose first parameter the
    forward uses last: the experts, the other weights, the partial sums (ln_1); under full
    recomputation a whole backward fires all as the checkpoint's ends, in ``parameters()`` order (the
    groups'), while a W runs the recomputed B's parked nodes in backward order as ever. A W's first
    hooks, which make the buffers: a MoE block's router (its Linear's backward comes right after
    the unpermute's, before the experts'), the experts, then the next output projection's weight
    (dense) and bias (a partial sum under SP); its last ones as a whole backward's."""
    params, expert = state.block_parameters(model, layout, layer)
    partial = state.partial_sums(model, layer) if sp else 0
    if layout.ep == 1:  # the experts' gradients summed over DP x CP too, in the block's runs
        params, partial, expert = params + expert, partial + expert * sp, 0
    dense = new(params - partial, False)
    part = new(partial, True) if partial else None
    experts = new(expert, sp, n // layout.ep) if expert else None
    made = tuple(g for g in (dense, part, experts) if g is not None)
    hooks = tuple(g for g in (experts, dense, part) if g is not None)
    router = ((part if sp else dense),) if model.is_moe(layer) else ()
    weight = tuple(g for g in router + (experts, dense, part, dense, part) if g is not None)
    return Unit(f"h.{layer}", made, made, made if layout.recompute else hooks, weight)


def groups(model, layout, stage):
    """The rank's parameter groups (``rank_units``), gathered into kinds that are gathered and sent
    alike: over one communicator, by the units of the same local chunks, read by as many of their
    backwards."""
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
    return list(kinds.values())


def uses(layout, m, stage, kind):
    """(gathers, sends): how often each group of ``kind`` is all-gathered and reduce-scattered in a
    step: for each unit's forward and each reading backward, every micro-batch; sent by each local
    chunk's backward (or W) of every micro-batch (a held group's sends are the one after
    finalize_grads, whatever this says)."""
    return m * (len(kind.chunks) + kind.read), m * len(set(kind.chunks))


# ---- the most ZeRO-3 holds during a step ---------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _passes(schedule, p, m, v, defer, rank):
    """The rank's compute in a step, (op, local chunk), then its step: ``schedules.build``'s order
    without the messages (build checks m's MPI tags, and the walk's 3p may need more than the run's
    m); the head's deferred W's before the step, on the rank holding the last chunk."""
    passes = [(op, chunk) for op, _, chunk in schedules.compute_order(schedule, p, m, v, rank)]
    if defer and rank == p - 1:
        passes += [(HEAD_WEIGHT, v - 1)] * passes.count((BACKWARD, v - 1))
    return tuple(passes) + ((STEP, 0),)


def peak_bytes(model, layout, m=None, stage=0, dtype="float32", in_flight=None):
    """{"parameters", "gradients", "optimizer": each kind's peak, "total": the peak of their sum}:
    what ``ZeRO3``'s ledger reaches in a training step after the first (which records the order
    the next ones prefetch in), replayed over the rank's schedule of m micro-batches as
    ``parallel/zero3.py`` runs it. The peak grows with m up to m = 3p and stays there (tested: the
    first stage's fullest moment under an interleaved schedule, a backward of its first chunk with
    the next forward's embeddings prefetched, comes in its steady state, from m = 3p on), so m is
    taken as at most 3p, and as 3p when None: the most for any m. ``in_flight``: the
    reduce-scatters a send may leave pending (``ShardedAdamW.IN_FLIGHT``, the default: no send
    finishes before the optimizer must wait for it, the worst case; 0: each at once, the least)."""
    # the planner asks for many layouts that differ only in what the replay does not read
    same = replace(layout, micro_batch_size=1, selective_recompute=False, cp_comm_type="p2p")
    return dict(_peak(model, same, 3 * layout.pp if m is None else min(m, 3 * layout.pp), stage, dtype, in_flight))


@lru_cache(maxsize=4096)
def _peak(model, layout, m, stage, dtype, in_flight):
    return tuple(replay(model, layout, m, stage, dtype, in_flight).items())


def replay(model, layout, m, stage=0, dtype="float32", in_flight=None):
    """``peak_bytes`` of exactly m micro-batches: the walk over the rank's schedule."""
    groups, chunks = rank_units(model, layout, stage)
    walk = _Replay(groups, PRECISIONS[dtype], state.state_bytes(model, layout, stage, dtype),
                   ShardedAdamW.IN_FLIGHT if in_flight is None else in_flight)
    passes = _passes(layout.schedule, layout.pp, m, layout.vpp, layout.defer_embedding_wgrad, stage)
    # the groups in the order the step gathers them, a forward's and a reading backward's: the last
    # step's record, which the prefetch follows
    walk.record = [u.groups if op == FORWARD else u.read
                   for op, c in passes if op in (FORWARD, BACKWARD, BACKWARD_INPUT)
                   for u in (chunks[c] if op == FORWARD else chunks[c][::-1]) if op == FORWARD or u.read]
    # a group two units use gets its buffer in B where one W takes both parts (ZeRO3._two_parts)
    uses = [g for units in chunks for u in units for g in u.groups]
    two_parts = {g for g in uses if uses.count(g) > 1} if layout.pp * layout.vpp == 1 else set()
    for op, c in passes:
        units = chunks[c] if op != STEP else ()
        if op == FORWARD:
            for u in units:
                walk.forward(u)
        elif op in (BACKWARD, BACKWARD_INPUT):
            for u in units[::-1]:
                # B makes no buffer (no weight gradient comes before W) but a group's whose two parts
                # one W takes, nor the head's backward for what its deferred W fills
                walk.before_backward(u, [g for g in u.groups if g in two_parts] if op == BACKWARD_INPUT
                                     else [g for g in u.groups if g not in u.head])
                for g in u.backward if op == BACKWARD else ():
                    walk.complete(g)
                if u.name != "embed":  # (token ids in: no moment after its backward, which gathered nothing)
                    walk.after_backward(u)
        elif op in (BACKWARD_WEIGHT, HEAD_WEIGHT):
            for u in units[::-1]:
                walk.weight(u.weight if op == BACKWARD_WEIGHT else u.head)
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

    def gather(self, groups):  # ZeRO3._gather_unit
        self.next += 1
        for g in groups:
            if g not in self.whole:
                self.whole.add(g)
                if g in self.prefetched:
                    self.prefetched.remove(g)
                else:
                    self.add("parameters", self.whole_bytes[g])
        self.prefetch()

    def prefetch(self):  # ZeRO3._prefetch_next: the next recorded unit's groups
        for g in self.record[self.next] if self.next < len(self.record) else ():
            if g not in self.whole and g not in self.prefetched:
                self.prefetched.add(g)
                self.add("parameters", self.whole_bytes[g])

    def release(self, g):
        if g in self.whole:
            self.whole.remove(g)
            self.add("parameters", -self.whole_bytes[g])

    def forward(self, unit):  # ZeRO3._run_unit
        self.gather(unit.groups)
        for g in unit.groups:
            self.release(g)
        self.prefetch()

    def before_backward(self, unit, buffered):  # ZeRO3.before_unit_backward
        if unit.read:
            self.gather(unit.read)
        self.collect(self.keep)
        for g in buffered:
            self.buffer(g)

    def after_backward(self, unit):  # ZeRO3.after_unit_backward
        for g in unit.groups:
            self.release(g)
        self.prefetch()

    def weight(self, hooks):  # a W's hooks (ZeRO3._gradient_ready): a group's first makes its buffer,
        last = {g: i for i, g in enumerate(hooks)}  # its last completes it
        for i, g in enumerate(hooks):
            self.buffer(g)
            if last[g] == i:
                self.complete(g)

    def buffer(self, g):
        if g not in self.flats:
            self.flats.add(g)
            self.add("gradients", self.flat_bytes[g])

    def complete(self, g):
        """A group's hooks have all fired: held, its parameters go; else it is sent."""
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
