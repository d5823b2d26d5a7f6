"""Lesson 4's formulas: what each schedule's bubble, activations held and bytes sent should be, and
the check of the runs' measured costs against them.

Unit costs are the zero-bubble paper's (Qi et al. 2024): a chunk's forward F = 1, the input half
of its backward B = 1, the weights' half W = 1; a fused backward (GPipe, 1F1B, interleaved) costs
B + W = 2, the textbook model. The bubble is idle time / the step's length (the makespan), each
rank's: with p ranks, m micro-batches and v chunks per rank,

    gpipe, 1f1b,     (p-1)(F+B+W) / (m(F+B+W) + (p-1)(F+B+W))  = (p-1)/(m+p-1)
    1f1b-slack
    interleaved      (p-1)/(v*m+p-1)
    zb-h1            idle (p-1)(F+B-W) = p-1, step 3m + p-1:        (p-1)/(3m+p-1)
    zb-h2            idle (p-1) max(F, F+B-2W) = p-1 (none inside each rank's span; the slant of
                     the parallelogram, when the step synchronises the ranks): (p-1)/(3m+p-1)
    zb-v             idle (p-1) F on a step of 2m(F+B+W) + (p-1) F (chunk costs: half a stage's):
                     (p-1)/(6m+p-1)

(``simulate.zero_bubble_idle`` holds the idle times; the zero-bubble ones need m >= p for ZB-H1 and
m >= 2p - 1 for ZB-H2 and ZB-V to reach the steady state: below that there is no formula.)
"""

import os
from fractions import Fraction
from types import SimpleNamespace

import numpy as np

from minipar.parallel.pipeline import schedules, stage_times, trace
from minipar.parallel.pipeline.simulate import simulate, theoretical_bubble, zero_bubble_idle

SPLIT = ("zb-h1", "zb-h2", "zb-v")  # the backward split into B and W
UNIT = dict(forward=1, backward=1, weight=1)  # F, B, W; a fused backward costs B + W


def bubble(name, p, m, v):
    """(the formula as text, its value as a Fraction or None where it does not apply)."""
    if name not in SPLIT:
        return f"(p-1)/({'v*' if v > 1 else ''}m+p-1)", theoretical_bubble(p, m, v)
    text = {"zb-h1": "(p-1)/(3m+p-1)", "zb-h2": "(p-1)/(3m+p-1)", "zb-v": "(p-1)/(6m+p-1)"}[name]
    try:
        idle = zero_bubble_idle(name, p, m, 1, 1, 1)
    except ValueError:  # too few micro-batches for the steady state
        return text, None
    if name == "zb-h1":
        return text, idle / (3 * m + idle)
    slant = (p - 1) * 1  # ZB-H2's max(F, F+B-2W) and ZB-V's F, per rank of the fill
    return text, Fraction(slant, (6 if name == "zb-v" else 3) * m + slant)


def held(name, p, m, v):
    """(most micro-batch activations per rank, in chunks, or None where no formula; the formula)."""
    if name == "gpipe":
        return [m] * p, "m"
    if name == "1f1b":
        return [min(p - r, m) for r in range(p)], "p - rank" + (" (at most m)" if m < p else "")
    if name == "1f1b-slack":
        return [min(p - r + (r < p - 1), m) for r in range(p)], "p - rank + 1, the last rank 1" + (
            " (at most m)" if m < p + 1 else "")
    if name == "interleaved":
        return ([min((p - r - 1) * 2 + (v - 1) * p + 1, v * m) for r in range(p)],
                f"(p-rank-1)*2+(v-1)*p+1 chunks of 1/{v} stage")
    few = " (at most m)" if m < p else ""  # fewer micro-batches than stages: no rank holds more than m
    if name == "zb-h1":
        return [min(p, m)] * p, "p: held until W" + few
    if name == "zb-h2":
        return [min(2 * p - 1, m)] * p, "2p-1: held until W" + (" (at most m)" if m < 2 * p - 1 else "")
    if m < 2 * p - 1:  # the V fills only from 2p - 1 micro-batches on
        return None, "2p chunks of 1/2 stage once m >= 2p-1 (not checked here)"
    return [2 * p] * p, "2p chunks of 1/2 stage (1F1B's)"


def bytes_sent(name, p, m, v, activation_bytes):
    """Bytes each rank sends per step: an activation per micro-batch from every chunk but the last
    global one, a gradient from every chunk but the first (ZB-V's rank p - 1 sends its own chunk 1
    one: a message to itself, counted like any other)."""
    pipe = schedules.Pipeline(p, m, v, schedules.shape_of(name))
    last = pipe.n_chunks - 1
    return [sum((g < last) + (g > 0) for g in (pipe.global_chunk(r, c) for c in range(v))) * m * activation_bytes
            for r in range(p)]


def unit_costs(name, recompute=0):
    """The simulator's unit costs for a schedule (fused backwards cost B + W)."""
    return dict(UNIT, recompute=recompute) if name in SPLIT else dict(forward=1, backward=2, recompute=recompute)


def costs_beside_formulas(comm, args, grid, results, runs, n_embd):
    """Each cost of lesson 4's runs (``results``: {(schedule, recompute): (errors, costs)}) next to its
    formula (rank r of the table is pipeline rank r of replica 0), the costs that differ from theirs
    (a line each, [] if none), and the timelines drawn in --out."""
    p, m = grid.pp, args.micro_batches
    act_bytes = (args.batch_size // m // grid.dp) * args.block_size * n_embd * np.dtype(args.dtype).itemsize
    stage_ranks = [grid.layout.rank(pp=r) for r in range(p)]
    lines, failed = [], []
    for name, vv in runs:
        defer = args.defer_embedding_wgrad  # the head's W's at the flush: unit costs leave them free
        plan, shape = schedules.build(name, p, m, vv, defer), schedules.shape_of(name)
        recomputed = (name, True) in results
        text, theory = bubble(name, p, m, vv)
        units = [simulate(plan, m, vv, shape=shape, **unit_costs(name, r)) for r in (0, 1)[: 1 + recomputed]]
        # any equal costs keep a fused schedule's fraction; a split one's formula is for unit costs
        if not (theory is None or all(b == theory for sim in units for b in sim.bubble.values())):
            failed.append(f"{name}: the bubble with unit costs differs from {text}")
        costs = results[name, False][1]
        costs_r = results[name, True][1] if recomputed else None
        alive = [int(costs["peak_alive"][g]) for g in stage_ranks]
        formula, formula_text = held(name, p, m, vv)
        if not (alive == [units[0].peak_alive[r] for r in range(p)] and formula in (None, alive)):
            failed.append(f"{name}: the activations held differ from the simulator's or from {formula_text}")
        if not (costs_r is None or list(costs_r["peak_alive"]) == list(costs["peak_alive"])):  # as many with recompute
            failed.append(f"{name}: recompute held other micro-batches' activations than the plain run")
        per_rank = bytes_sent(name, p, m, vv, act_bytes)
        if costs["sent"] != per_rank[grid.pp_rank]:  # every rank checks its own
            failed.append(f"{name}: pipeline rank {grid.pp_rank} sent {costs['sent']:,} bytes, not "
                          f"{per_rank[grid.pp_rank]:,}")
        # each stage's median forward, backward (or B) and W, and with recompute what its backward
        # took beyond the plain run's: the costs table
        op = trace.op_costs(costs["timelines"])
        split = name in SPLIT
        fwd, bwd = op[schedules.FORWARD], op[schedules.BACKWARD_INPUT if split else schedules.BACKWARD]
        extra = {k: 0.0 for k in fwd}
        if recomputed:
            op_r = trace.op_costs(costs_r["timelines"])
            extra = {k: max(b - bwd[k], 0.0) for k, b in op_r[schedules.BACKWARD].items()}  # noise: >= 0
        # the schedule again with every forward and backward of the measured step as long as it
        # took, messages free (what the trainer logs as bubble_expected): measured minus this is
        # what the messages and the executor cost
        timed = [costs] + ([costs_r] if recomputed else [])
        replayed = [replay(name, run["timelines"], p, vv, m, defer) for run in timed]
        measured = [trace.bubble(run["timelines"]) for run in timed]
        mem = [int(costs["activation bytes"][g]) for g in stage_ranks]
        mem_r = [int(costs_r["activation bytes"][g]) for g in stage_ranks] if recomputed else None
        if not (mem_r is None or all(b < a for a, b in zip(mem, mem_r))):
            failed.append(f"{name}: recompute did not lower every rank's peak bytes")
        lines.append(SimpleNamespace(name=name, v=vv, text=text, theory=theory, units=units, replayed=replayed,
                                     measured=measured, alive=alive, held=formula_text, mem=mem, mem_r=mem_r,
                                     per_rank=per_rank,
                                     stage_costs={k: (fwd[k], bwd[k], extra[k]) for k in sorted(fwd)}))
        if comm.rank == 0:
            tag = f"{name}, p={p}, m={m}" + (f", v={vv}" if vv > 1 else "")
            trace.gantt(units[0].timeline, os.path.join(args.out, f"{name}_simulated.png"),
                        f"{tag}: unit costs, bubble {float(units[0].bubble[0]):.3f}", chunks=vv, unit="units")
            trace.gantt(costs["timelines"], os.path.join(args.out, f"{name}_measured.png"),
                        f"{tag}: measured on this machine", chunks=vv)
            trace.chrome_trace(costs["timelines"], os.path.join(args.out, f"{name}_trace.json"), chunks=vv)
    return lines, failed


def replay(name, timelines, p, v, m, defer_head=False):
    """The bubble of the step in ``timelines`` ({pipeline rank: timeline}) with free messages."""
    table = np.stack([stage_times.summary(timelines[r], p, v, m) for r in range(p)])
    return stage_times.expected(name, v, m, table, defer_head)


def gather_timelines(comm, grid, name, m, v, timeline, defer_head=False):
    """Every rank's (start, end) per instruction, on every rank; kept: the pipeline of replica 0."""
    plans = schedules.build(name, grid.pp, m, v, defer_head)
    n = max(len(s) for s in plans.values())
    mine = np.full((n, 2), np.nan)
    mine[: len(timeline)] = [(start, end) for *_, start, end in timeline]
    everyone = comm.all_gather(mine)
    out = {}
    for r, plan in plans.items():
        times = everyone[grid.layout.rank(pp=r)]
        out[r] = [(i.op, i.mb, i.chunk, s, e) for i, (s, e) in zip(plan, times)]
    return out
