"""ZeRO-3's most bytes on one pipeline rank during a step (the groups and units it walks:
``zero3.py``).

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

from array import array
from functools import lru_cache
from itertools import accumulate

from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.instructions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, HEAD_WEIGHT,
                                                    STEP)
from minipar.parallel.zero import ShardedAdamW

from . import state
from .shapes import PRECISIONS
from .zero3 import rank_units


@lru_cache(maxsize=256)
def rank_passes(schedule, p, m, v, defer, rank):
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
    # (the planner asks for many layouts that differ only in what the replay does not read)
    same = state.sharded(layout, True)
    return dict(_peak(model, same, 3 * layout.pp if m is None else min(m, 3 * layout.pp), stage, dtype, in_flight))


@lru_cache(maxsize=4096)
def _peak(model, layout, m, stage, dtype, in_flight):
    return tuple(replay(model, layout, m, stage, dtype, in_flight).items())


def replay(model, layout, m, stage=0, dtype="float32", in_flight=None):
    """``peak_bytes`` of exactly m micro-batches: the walk over the rank's schedule (``_moves``),
    then its moves weighed in this layout's bytes (``_weigh``)."""
    groups, chunks = rank_units(model, layout, stage)
    passes = rank_passes(layout.schedule, layout.pp, m, layout.vpp, layout.defer_embedding_wgrad, stage)
    keep = ShardedAdamW.IN_FLIGHT if in_flight is None else in_flight
    moves = _moves(tuple(held for _, _, held in groups), chunks, passes, keep)
    return _weigh(moves, groups, PRECISIONS[dtype], state.state_bytes(model, layout, stage, dtype))


# When a group's bytes come and go depends on the groups and the schedule alone, what they weigh on
# the layout (TP, DP x CP, the precision): the walk is made once for the layouts that share their
# groups' shape and their rank's passes (the 1T model's 6,194 replays take 955 walks), each change
# of the ledger a move of one group: its whole parameters gathered (or prefetched) and released, its
# gradient buffer made, its send's piece received, and a send done (buffer and piece).
GATHER, RELEASE, BUFFER, SEND, DONE = range(5)
MOVES = 5


@lru_cache(maxsize=4096)
def _moves(held, chunks, passes, keep):
    """The ledger's moves over ``passes``, each ``MOVES * group + move``, in order: all of them, and
    those of the parameters and of the gradients (compact arrays: the planner keeps hundreds)."""
    walk = _Replay(held, keep)
    # the groups in the order the step gathers them, a forward's and a reading backward's: the last
    # step's record, which the prefetch follows
    walk.record = [u.groups if op == FORWARD else u.read
                   for op, c in passes if op in (FORWARD, BACKWARD, BACKWARD_INPUT)
                   for u in (chunks[c] if op == FORWARD else chunks[c][::-1]) if op == FORWARD or u.read]
    # a group two units of one chunk use gets its buffer in the second one's B: that B gives W a
    # second part of it (ZeRO3.before_unit_backward, weight_grad.second_part_in_w)
    for op, c in passes:
        units = chunks[c] if op != STEP else ()
        if op == FORWARD:
            for u in units:
                walk.forward(u)
        elif op in (BACKWARD, BACKWARD_INPUT):
            reached = set()  # the groups this B has reached so far
            for u in units[::-1]:
                # B makes no buffer (no weight gradient comes before W) but a group's whose second
                # part it gives W, nor the head's backward for what its deferred W fills
                walk.before_backward(u, [g for g in u.groups if g in reached] if op == BACKWARD_INPUT
                                     else [g for g in u.groups if g not in u.head])
                reached.update(u.groups)
                for g in u.backward if op == BACKWARD else ():
                    walk.complete(g)
                if u.name != "embed":  # (token ids in: no moment after its backward, which gathered nothing)
                    walk.after_backward(u)
        elif op in (BACKWARD_WEIGHT, HEAD_WEIGHT):
            for u in units[::-1]:
                walk.weight(u.weight if op == BACKWARD_WEIGHT else u.head)
        else:
            walk.finish()
    moves = walk.moves
    return (array("I", moves), array("I", (x for x in moves if x % MOVES < BUFFER)),
            array("I", (x for x in moves if x % MOVES >= BUFFER)))


def _weigh(moves, groups, d, base):
    """{kind: its peak, "total": the peak of their sum} over ``moves`` from ``base`` (the state after
    a step), each group's arrays its (padded) parameters' bytes: the whole parameters, the flat
    gradient buffer and the 1/N piece a send receives."""
    sizes = []
    for params, over, _ in groups:
        padded = -(-params // over) * over
        whole, flat, piece = d.param * padded, d.grad * padded, d.grad * padded // over
        sizes += [whole, -whole, flat, piece, -flat - piece]  # GATHER, RELEASE, BUFFER, SEND, DONE
    every, params, grads = moves
    peak = dict(base)  # each running sum at its highest
    peak["parameters"] = max(accumulate(map(sizes.__getitem__, params), initial=base["parameters"]))
    peak["gradients"] = max(accumulate(map(sizes.__getitem__, grads), initial=base["gradients"]))
    return {**peak, "total": max(accumulate(map(sizes.__getitem__, every), initial=sum(base.values())))}


class _Replay:
    """``ZeRO3``'s ledger over a step: its whole parameters (gathered, prefetched), gradient buffers
    and sends in flight, by the same rules, each change of it a move (``_moves``)."""

    def __init__(self, held, keep):
        self.held = held
        self.keep, self.record, self.next = keep, [], 0
        self.whole, self.prefetched, self.flats, self.pending = set(), set(), set(), []
        self.moves = []

    def add(self, move, g):
        self.moves.append(MOVES * g + move)

    def gather(self, groups):  # ZeRO3._gather_unit
        self.next += 1
        for g in groups:
            if g not in self.whole:
                self.whole.add(g)
                if g in self.prefetched:
                    self.prefetched.remove(g)
                else:
                    self.add(GATHER, g)
        self.prefetch()

    def prefetch(self):  # ZeRO3._prefetch_next: the next recorded unit's groups
        for g in self.record[self.next] if self.next < len(self.record) else ():
            if g not in self.whole and g not in self.prefetched:
                self.prefetched.add(g)
                self.add(GATHER, g)

    def release(self, g):
        if g in self.whole:
            self.whole.remove(g)
            self.add(RELEASE, g)

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

    def weight(self, hooks):
        """A W's hooks (ZeRO3._gradient_ready): a group's first makes its buffer, its last completes it."""
        last = {g: i for i, g in enumerate(hooks)}
        for i, g in enumerate(hooks):
            self.buffer(g)
            if last[g] == i:
                self.complete(g)

    def buffer(self, g):
        if g not in self.flats:
            self.flats.add(g)
            self.add(BUFFER, g)

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
        self.add(SEND, g)
        self.pending.append(g)
        self.collect(self.keep)
        self.prefetch()

    def collect(self, keep):
        while len(self.pending) > keep:
            g = self.pending.pop(0)
            self.add(DONE, g)

    def finish(self):  # finish_gradients: the groups still buffered (held ones), in order, then every send
        for g in sorted(self.flats):
            self.send(g)
        self.collect(0)
