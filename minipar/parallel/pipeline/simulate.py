"""Run a schedule on paper: given costs (unit costs by default), no data, exact arithmetic.

Each rank executes its instruction list in order with its own clock. A forward of a chunk costs
``forward`` time units and a backward ``backward``, plus ``recompute`` when the backward first runs
the chunk's forward again (activation recompute). Sends take no time and never wait; a receive
waits until the matching send has happened.

The costs are inputs. The default is the textbook unit model: forward 1, backward 2 (a backward
computes two products per forward one, the gradients of the input and of the weights), recompute 0
(none; with recompute the model's cost is one more forward, 1, a third more compute). This engine
measures otherwise at the lesson's sizes (backward about 1.2 forwards: docs/pipeline_parallel.md
says why), so each cost may also be a dict {(rank, local chunk): cost}, e.g. the medians of a
measured timeline (``trace.op_costs``), in any one unit. Replaying all ranks this way

* proves the schedule free of deadlock (if at some point no rank can move, it raises and names the
  receives everyone is stuck on),
* checks that every receive has exactly one matching send and every send is received, and that
  each chunk's backward of a micro-batch comes after its forward,
* gives the timeline of the ideal run, from which the bubble: the fraction of the step a rank is
  idle, (makespan - its busy time) / makespan. With p ranks, m micro-batches and v chunks whose
  costs are the same on every rank, the formulas are

      GPipe, 1F1B:      (p - 1) / (m + p - 1)
      interleaved:      (p - 1) / (v*m + p - 1)

  (the fill and drain take p - 1 chunk-times of forward plus backward; the work, m (or v*m) of
  them), whatever backward / forward is: that ratio changes the step's length, not the fraction.
  Stages of unequal cost (the first embeds, the last runs the head and the loss) change it,
  mostly upward: the slowest sets the pace and the others wait for it.
  Some papers quote the bubble relative to the work instead, (p - 1)/m and (p - 1)/(v*m).
* counts the peak number of micro-batches whose activations a rank holds (forwards done, their
  backwards not yet): m for GPipe, p - rank for 1F1B.

Zero-bubble schedules split each backward into B (input gradient) and W (weights' gradients):
``backward`` is then B's cost and ``weight`` W's, and a micro-batch's activations stay held until
its W, which needs the layers' inputs. Their idle times are ``zero_bubble_idle``'s formulas.
A schedule with the head's weight gradients deferred (``schedules.defer_head_weight``) takes their
cost as ``head``, out of its chunk's backward and into each ``head_weight`` instruction.
"""

from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

from minipar.parallel.pipeline.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE, FORWARD,
                                                 HEAD_WEIGHT, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, Pipeline)


@dataclass
class Simulation:
    makespan: Fraction
    busy: dict  # rank -> time spent computing
    timeline: dict  # rank -> [(op, mb, chunk, start, end)] of forwards and backwards
    peak_alive: dict  # rank -> most micro-batch activations held at once (chunk activations)
    messages: int = 0
    bubble: dict = field(default_factory=dict)  # rank -> idle fraction of the makespan
    period: Fraction = Fraction(0)  # the longest span of a rank, its first instruction's start to its last's end


# what a message carries, by its op: its kind, and the global chunk that sends it, as an offset
# from the instruction's (an activation goes from global chunk g to g + 1, a gradient back)
MESSAGES = {SEND_ACT: ("act", 0), RECV_ACT: ("act", -1), SEND_GRAD: ("grad", 0), RECV_GRAD: ("grad", 1)}


def message_key(pipe, rank, ins):
    """What a send or receive carries, named the same on both sides: (kind, mb, sending global
    chunk)."""
    if ins.op not in MESSAGES:
        raise ValueError(f"{ins} is not a message")
    kind, offset = MESSAGES[ins.op]
    return kind, ins.mb, pipe.global_chunk(rank, ins.chunk) + offset


def peer(pipe, rank, ins):
    """The rank at the other end of a send or receive."""
    g = pipe.global_chunk(rank, ins.chunk)
    other = g + 1 if ins.op in (SEND_ACT, RECV_GRAD) else g - 1
    return pipe.place(other)[0]


def per_chunk(cost, schedules, v):
    """A cost as {(rank, local chunk): int or Fraction}: ``cost`` is one number for every chunk or
    such a dict already (floats are taken exactly, as the binary fractions they are; whole numbers
    stay ints, which the replay adds many times faster than Fractions)."""
    chunks = [(r, c) for r in schedules for c in range(v)]
    if not isinstance(cost, dict):
        cost = dict.fromkeys(chunks, cost)
    missing = [k for k in chunks if k not in cost]
    if missing:
        raise ValueError(f"no cost given for (rank, chunk) {missing[:5]}")
    if any(cost[k] < 0 for k in chunks):
        raise ValueError(f"costs must be >= 0, got {cost}")
    return {k: cost[k] if isinstance(cost[k], int) else Fraction(cost[k]) for k in chunks}


def simulate(schedules, m, v=1, forward=1, backward=2, recompute=0, weight=None, forward_only=False,
             shape="round-robin", durations=None, head=0):
    """Replay ``schedules`` ({rank: [Instruction]}) and return a Simulation; raises RuntimeError on
    a deadlock or a broken schedule (``forward_only``: an evaluation schedule, no backwards).
    ``forward``, ``backward``, ``weight`` and ``recompute`` (added to each backward's first half):
    a number for every chunk or {(rank, local chunk): number}; the defaults are the unit model, 1,
    2 and 0. With the backward split (zero-bubble schedules), ``backward`` is B's cost and
    ``weight`` W's, which such a schedule must be given; a fused backward costs backward + weight
    (weight 0 when None), so one set of costs (F, B, W) compares every schedule. ``shape``: how
    the chunks are placed (``Pipeline``), "v" for ZB-V. ``durations``: {(rank, op, mb, chunk): time}
    of instructions that took their own time (a measured step, micro-batch by micro-batch), in
    place of their chunk's cost. ``head``: the part of a backward (of its W) that is the head's
    weight gradient, moved to ``head_weight`` where the schedule defers it."""
    p = len(schedules)
    pipe = Pipeline(p, m, v, shape)
    split = any(ins.op == BACKWARD_WEIGHT for s in schedules.values() for ins in s)
    if split and weight is None:
        raise ValueError("the schedule splits the backward into B and W: give W's cost as weight=")
    w = per_chunk(0 if weight is None else weight, schedules, v)
    b = per_chunk(backward, schedules, v)
    extra = per_chunk(recompute, schedules, v)
    deferred = {(r, ins.chunk) for r, s in schedules.items() for ins in s if ins.op == HEAD_WEIGHT}
    h = {k: x if k in deferred else 0 for k, x in per_chunk(head, schedules, v).items()}
    cost = {FORWARD: per_chunk(forward, schedules, v), BACKWARD_WEIGHT: w, HEAD_WEIGHT: h,
            BACKWARD_INPUT: {k: b[k] + extra[k] for k in b},
            BACKWARD: {k: b[k] + extra[k] + w[k] - h[k] for k in b}}
    if any(x < 0 for x in cost[BACKWARD].values()):
        raise ValueError("the head's weight gradient cannot cost more than the backward it is taken from")
    # whole numbers until a cost is a Fraction: a replay of measured durations in integer
    # microseconds (``stage_times``) then runs on ints, which Python adds far faster
    clock = {r: 0 for r in schedules}
    at = {r: 0 for r in schedules}  # next instruction per rank
    sent = {}  # message key -> time it was sent
    received = Counter()
    alive = {r: set() for r in schedules}  # (mb, chunk) forwarded, its backward (or W) not yet run
    split_done = {r: set() for r in schedules}  # (mb, chunk) whose B has run, waiting for its W
    head_due = {r: set() for r in schedules}  # (mb, chunk) whose backward left the head's W
    peak = {r: 0 for r in schedules}
    busy = {r: 0 for r in schedules}
    timeline = {r: [] for r in schedules}

    def run(r, s):
        """Rank r runs its instructions until a receive blocks it or none are left: whether it
        moved. (Its clock, busy time and peak kept in locals, and each message's key made from its
        chunk's global index: the planner replays hundreds of schedules, most of its time here.)"""
        i = start = at[r]
        now, work, most, held, line = clock[r], busy[r], peak[r], alive[r], timeline[r]
        chunks = [pipe.global_chunk(r, c) for c in range(v)]
        while i < len(s):
            ins = s[i]
            op = ins.op
            if op in COMPUTE:
                _account(r, ins, alive, split_done, head_due if (r, ins.chunk) in deferred else None)
                if len(held) > most:
                    most = len(held)
                took = cost[op][r, ins.chunk]
                if durations is not None:
                    took = durations.get((r, op, ins.mb, ins.chunk), took)
                line.append((op, ins.mb, ins.chunk, now, now + took))
                now += took
                work += took
            elif op in MESSAGES:
                kind, offset = MESSAGES[op]  # (message_key's)
                key = kind, ins.mb, chunks[ins.chunk] + offset
                if op == RECV_ACT or op == RECV_GRAD:
                    if key not in sent:
                        break  # blocked; try the other ranks
                    received[key] += 1
                    if sent[key] > now:
                        now = sent[key]
                elif key in sent:
                    raise RuntimeError(f"rank {r} sends {key} twice")
                else:
                    sent[key] = now
            i += 1
        at[r], clock[r], busy[r], peak[r] = i, now, work, most
        return i > start

    while any(at[r] < len(s) for r, s in schedules.items()):
        moved = False
        for r, s in schedules.items():
            moved |= run(r, s)
        if not moved:
            stuck = {r: str(s[at[r]]) for r, s in schedules.items() if at[r] < len(s)}
            raise RuntimeError(f"deadlock: every unfinished rank waits on a receive: {stuck}")
    unmatched = [k for k in sent if received[k] != 1]
    if unmatched or any(v != 1 for v in received.values()):
        raise RuntimeError(f"sends and receives do not pair up: {unmatched[:5]}")
    for r in schedules:
        if split_done[r] or head_due[r]:
            raise RuntimeError(f"rank {r} ends with B's whose W never ran: {sorted(split_done[r] | head_due[r])}")
        if alive[r] and not forward_only:
            raise RuntimeError(f"rank {r} ends with forwards never backpropagated: {sorted(alive[r])}")
        done = Counter((op, c) for op, _, c, _, _ in timeline[r])
        kinds = () if forward_only else (BACKWARD_INPUT, BACKWARD_WEIGHT) if split else (BACKWARD,)
        runs = {(op, c) for c in range(v) for op in (FORWARD,) + kinds}
        runs |= {(HEAD_WEIGHT, c) for rank, c in deferred if rank == r and not forward_only}
        if any(n != m for n in done.values()) or set(done) != runs:
            raise RuntimeError(f"rank {r} does not run every micro-batch once through each chunk")
    makespan = max(clock.values())
    sim = Simulation(makespan, busy, timeline, peak, messages=len(sent))
    sim.bubble = {r: Fraction(makespan - busy[r]) / makespan for r in schedules}
    sim.period = max(t[-1][4] - t[0][3] for t in timeline.values() if t)
    return sim


def chunk_peaks(order, v):
    """The micro-batches a rank holds in each of its v chunks at its peaks, from its own ``order``
    of (op, local chunk) alone (messages change when, not what): after each forward, the count per
    chunk; kept, those no other equals or exceeds in every chunk. A planner weighs them with each
    chunk's bytes (the first chunk's embeddings, the last's logits) and takes the largest sum,
    which a single total (``peak_alive``) cannot give when the chunks differ.

    A split backward (``backward_input`` ops) frees a micro-batch's graph but parks what its W
    needs, less than the graph held: each vector then has v counts more, the micro-batches whose
    W waits in each chunk, and is taken after each B too (under full recomputation the parked set
    is the larger). Where the order defers the head's weight gradients (``head_weight`` ops), each
    vector has one count more, the micro-batches whose head W is parked, and is taken after that
    chunk's backwards: they free its activations but park the head's input and the logits'
    gradient, so the sum can peak there. Last, v counts of 0 or 1: the chunk whose forward has
    just run, whose output is still whole until it is sent on (the executor then frees it)."""
    order = list(order)
    split = any(op == BACKWARD_INPUT for op, _ in order)
    deferring = {chunk for op, chunk in order if op == HEAD_WEIGHT}
    head = v * (2 if split else 1)  # the parked head W's count, after the W-pending ones
    fresh = head + bool(deferring)  # then the just-run forward's chunk
    counts, seen = [0] * (fresh + v), set()
    for op, chunk in order:
        counts[fresh:] = [0] * v
        if op == FORWARD:
            counts[chunk] += 1
            counts[fresh + chunk] = 1
            seen.add(tuple(counts))
        elif op == BACKWARD:
            counts[chunk] -= 1
            if chunk in deferring:
                counts[head] += 1
                seen.add(tuple(counts))
        elif op == BACKWARD_INPUT:
            counts[chunk] -= 1
            counts[v + chunk] += 1
            seen.add(tuple(counts))
        elif op == BACKWARD_WEIGHT:
            counts[v + chunk] -= 1
        elif op == HEAD_WEIGHT:
            counts[head] -= 1
    kept = []  # those no other equals or exceeds in every chunk: one that does has the larger sum,
    for c in sorted(seen, key=sum, reverse=True):  # so it (or one above it) is kept before c is looked at
        if not any(all(map(int.__ge__, o, c)) for o in kept):
            kept.append(c)
    return tuple(sorted(kept))


def _account(r, ins, alive, split_done, head_due):
    """Track the micro-batches whose activations rank r holds (a forward's, until its backward or,
    split, its W: W needs the layer inputs), and check the order F, then B, then W (or the head's
    W, which needs only the head's input and the logits' gradient, held apart from ``alive``;
    ``head_due`` None where the chunk defers none)."""
    unit = (ins.mb, ins.chunk)
    if ins.op == HEAD_WEIGHT:
        if head_due is None or unit not in head_due[r]:
            raise RuntimeError(f"rank {r} runs the head's W {unit} before its backward (or twice)")
        head_due[r].remove(unit)
    elif ins.op == FORWARD:
        if unit in alive[r]:
            raise RuntimeError(f"rank {r} runs forward {unit} twice")
        alive[r].add(unit)
    elif unit not in alive[r] or unit in split_done[r] and ins.op != BACKWARD_WEIGHT:
        raise RuntimeError(f"rank {r} runs {ins.op} {unit} before its forward (or twice)")
    elif ins.op == BACKWARD_INPUT:
        split_done[r].add(unit)
    elif ins.op == BACKWARD_WEIGHT:
        if unit not in split_done[r]:
            raise RuntimeError(f"rank {r} runs W {unit} before its B")
        split_done[r].remove(unit)
        alive[r].remove(unit)
    else:
        alive[r].remove(unit)
        if head_due is not None:
            head_due[r].add(unit)


def zero_bubble_idle(name, p, m, forward, backward, weight):
    """The idle time of each rank per step that Qi et al. (2024) give for the zero-bubble schedules,
    with F costing ``forward``, B ``backward`` and W ``weight`` on every rank and chunk (1F1B's is
    (p - 1)(T_F + T_B + T_W)):

        zb-h1:   (p - 1)(T_F + T_B - T_W)      over the step, every rank alike
        zb-h2:   (p - 1)(T_F + T_B - 2 T_W)    within the longest rank's span (``Simulation.period``)
        zb-v:    0 when T_F = T_B = T_W        within the longest rank's span

    ZB-H2's and ZB-V's spans form a parallelogram whose slant is idle too when the optimizer step
    synchronises the ranks: ZB-H2's step then takes m (T_F + T_B + T_W) + (p - 1) max(T_F, T_F +
    T_B - 2 T_W), ZB-V's 2m (T_F + T_B + T_W) + (p - 1) T_F (its costs are a chunk's, half a
    stage's). The formulas hold for T_W <= T_F (with a longer W the drain's W's cannot shorten the
    fill; ZB-V's for equal costs only, the case its order is built for) and enough micro-batches
    to reach the steady state: m >= p for ZB-H1, 2p - 1 for ZB-H2 and ZB-V."""
    f, b, w = Fraction(forward), Fraction(backward), Fraction(weight)
    if w > f:
        raise ValueError(f"the zero-bubble formulas assume T_W <= T_F, got T_W = {w} > T_F = {f}")
    need = {"zb-h1": p, "zb-h2": 2 * p - 1, "zb-v": 2 * p - 1}
    if name not in need:
        raise ValueError(f"no zero-bubble formula for {name!r}: choose one of {', '.join(need)}")
    if m < need[name]:
        raise ValueError(f"the {name} formula needs m >= {need[name]} micro-batches, got {m}")
    if name == "zb-v":
        if not f == b == w:
            raise ValueError(f"the zb-v formula is for T_F = T_B = T_W, got {f}, {b}, {w}")
        return Fraction(0)
    return (p - 1) * (f + b - (w if name == "zb-h1" else 2 * w))


def theoretical_bubble(p, m, v=1):
    """(p - 1) / (v*m + p - 1), as an exact fraction (v = 1 for GPipe and 1F1B)."""
    return Fraction(p - 1, v * m + p - 1)
