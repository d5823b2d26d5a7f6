"""The pipeline's bubble and the micro-batches each stage keeps in flight, from the schedule
simulator (``parallel/pipeline/simulate.py``) run on the schedule's own instruction lists.

The simulator replays every rank's instructions with unit costs (forward 1, backward 2, plus 1 per
recomputed forward), so the bubble it returns is the schedule's, not a formula's: for stages of
equal cost it equals (p - 1)/(v m + p - 1) (GPipe and 1F1B: v = 1), which the tests check. The
step's bubble is the mean of the ranks' idle fractions (the trainer reports the same mean).

A schedule of p x v x m chunk-passes costs the simulator a few microseconds each; beyond
``SIMULATE_UP_TO`` of them (the 1T model's 64 stages x 512 micro-batches) the planner takes the
closed forms instead, and says so (``source``): the bubble above, and the peak in flight of the
first stage, from the schedules' warm-up rules (``schedules.py``): GPipe m, 1F1B min(p, m),
1F1B-slack min(p + 1, m),
interleaved min(2 (p - 1) + (v - 1) p + 1, v m) chunk activations. The zero-bubble schedules
ZB-H1 and ZB-H2 (Qi et al. 2024; minipar's ``schedules.py``) split the backward into B and W, each
taken as half of it (F 1, B 1, W 1): bubble (p - 1)/(3 m + p - 1) once m >= p (ZB-H1) or
m >= 2p - 1 (ZB-H2), and p or 2p - 1 micro-batches alive on every rank, as the simulator finds
(tested). ZB-V (two chunks per rank in a V, ``zero_bubble.v``; F, B and W each 1 per chunk)
leaves (p - 1) idle units of 6 m + p - 1 on every rank once m >= 2p, with 2p chunk activations
(half-size chunks: 1F1B's memory) alive on every rank, as the simulator finds (tested).
"""

from fractions import Fraction
from functools import lru_cache

from minipar.parallel import validate
from minipar.parallel.pipeline import schedules, zero_bubble
from minipar.parallel.pipeline.instructions import COMPUTE
from minipar.parallel.pipeline.simulate import chunk_peaks, simulate, theoretical_bubble

SIMULATE_UP_TO = 4096  # chunk-passes p x v x m
ZERO_BUBBLE_ORDERS = {"zb-h1": zero_bubble.h1, "zb-h2": zero_bubble.h2, "zb-v": zero_bubble.v}  # one rank's compute


class NotPlanned(ValueError):
    """A layout whose bubble the planner can neither simulate nor write in closed form."""


def check_planned(schedule, p, m, v=1):
    """Raises NotPlanned where ``pipeline`` can neither simulate the schedule nor write it in closed
    form: a zero-bubble schedule short of its steady state beyond ``SIMULATE_UP_TO``."""
    # the zero-bubble schedules in closed form once each rank's steady state is reached
    steady = {"zb-h1": ("p", p), "zb-h2": ("2p - 1", 2 * p - 1), "zb-v": ("2p", 2 * p)}.get(schedule)
    if p > 1 and steady and m < steady[1] and p * v * m > SIMULATE_UP_TO:
        raise NotPlanned(f"{schedule} with m={m} < {steady[0]} (p={p}) has no closed form here and {p * v * m} "
                         f"chunk-passes are more than the simulator is run for ({SIMULATE_UP_TO})")


@lru_cache(maxsize=4096)
def pipeline(schedule, p, m, v=1, recompute=False):
    """(bubble: Fraction, in flight per rank: tuple of chunk activations, source) of a schedule."""
    if p == 1:
        return Fraction(0), (1,), "no pipeline"
    zero_bubble = schedule in validate.SPLIT_BACKWARD
    check_planned(schedule, p, m, v)
    if p * v * m <= SIMULATE_UP_TO:
        # a split backward: B and W each half of it (Qi et al. 2024 take T_B = T_W = T_F)
        # (defer_head given, as ``in_flight`` gives it: one cache key, one build)
        sim = simulate(_built(schedule, p, m, v, False), m, v, forward=1, backward=1 if zero_bubble else 2,
                       weight=1 if zero_bubble else None, recompute=int(recompute),
                       shape=schedules.SHAPES.get(schedule, "round-robin"))
        return sum(sim.bubble.values()) / p, tuple(sim.peak_alive[r] for r in range(p)), "simulator"
    if schedule == "zb-v":  # (p - 1) idle units of 2 chunks x 3 m + p - 1; 2p half-size chunks alive
        return Fraction(p - 1, 6 * m + p - 1), (2 * p,) * p, "closed form"
    if zero_bubble:  # (p - 1) idle units of 3 m + p - 1 on every rank; W keeps each input until it runs
        alive = [p if schedule == "zb-h1" else 2 * p - 1] * p
        return Fraction(p - 1, 3 * m + p - 1), tuple(alive), "closed form"
    if schedule == "gpipe":
        alive = [m] * p
    elif schedule == "interleaved":
        alive = [min(2 * (p - r - 1) + (v - 1) * p + 1, v * m) for r in range(p)]
    elif schedule == "1f1b-slack":  # one more forward in flight on every rank but the last
        alive = [min(p - r + (r < p - 1), m) for r in range(p)]
    else:
        alive = [min(p - r, m) for r in range(p)]
    return theoretical_bubble(p, m, v), tuple(alive), "closed form"


@lru_cache(maxsize=4096)
def in_flight(schedule, p, m, v, rank, defer_head=False):
    """The micro-batches rank ``rank`` holds in each of its v chunks at its peaks (``chunk_peaks``:
    count vectors, one count per local chunk; with a split backward v more, those whose W waits;
    then one per chunk, 1 for the chunk whose forward has just run, its output not yet sent).
    From the schedule's own instruction list up to ``SIMULATE_UP_TO`` chunk-passes; beyond, one
    chunk holds the closed form's total (v = 1), and interleaved's and the zero-bubble schedules'
    orders are walked without their messages (ZB-H1's rank r peaks at p - r micro-batches whole
    and r waiting for W, ZB-H2's at 2p - 1 - 2r and 2r; tested). ``defer_head`` (``schedules.defer_head_weight``):
    the last rank's vectors count one more, the head W's parked; in closed form (n, m - n) for n
    up to the total (v = 1: the last rank's backwards alternate with its forwards, each parking one,
    and none runs before the flush), and interleaved's walk takes the head W's at its end, as the
    instruction lists have them (tested)."""
    if p > 1 and p * v * m <= SIMULATE_UP_TO:  # the rank's own list (the planner asks for two or three),
        # its computations: the messages between them change when, not what (``chunk_peaks``)
        built = _built(schedule, p, m, v, defer_head)[rank]
        return chunk_peaks(((i.op, i.chunk) for i in built if i.op in COMPUTE), v)
    if defer_head:  # refused as schedules.build does: p = 1, or a schedule that never flushes
        validate.check(validate.RunConfig(pp=p, schedule=schedule, defer_embedding_wgrad=True),
                       what="pipeline schedule")
    if schedule in validate.SPLIT_BACKWARD:  # (the compute alone: no message tags to run out of)
        order = ZERO_BUBBLE_ORDERS[schedule](p, m, rank)
        return chunk_peaks(((op, chunk) for op, _, chunk in order), v)
    _, alive, _ = pipeline(schedule, p, m, v)  # closed forms
    parks = defer_head and rank == p - 1  # every deferring schedule places the last chunk round-robin
    if schedule == "interleaved":
        order = [(op, chunk) for op, _, chunk in schedules.interleaved_order(p, m, v, rank)]
        return chunk_peaks(order + [(schedules.HEAD_WEIGHT, v - 1)] * m * parks, v)
    if parks:  # (the last count: the just-run forward's chunk, the last, whose output is the loss)
        return tuple((n, m - n, int(n == alive[rank])) for n in range(alive[rank] + 1))
    return ((alive[rank], 1),)


@lru_cache(maxsize=16)  # (a build is up to some 25,000 instructions; the planner asks for a pipeline's together)
def _built(schedule, p, m, v, defer_head=False):
    """``schedules.build``'s instruction lists, as tuples (read, never changed): built once for the
    simulator with and without recomputation and for the peaks in flight, which read the same."""
    return {r: tuple(instructions) for r, instructions in schedules.build(schedule, p, m, v, defer_head).items()}
