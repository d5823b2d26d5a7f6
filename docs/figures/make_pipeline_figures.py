"""Draw docs/figures/pipeline_{gpipe,1f1b,interleaved,zb-h1,zb-h2,zb-v,pipedream-2bw}.png:
python docs/figures/make_pipeline_figures.py

The three schedules for p = 4 ranks and m = 8 micro-batches (v = 2 chunks per rank interleaved),
as the simulator runs them with the textbook unit costs: a stage's forward 1, its backward 2,
messages free. An interleaved rank runs v chunks of 1/v of a stage each, so a chunk's forward
costs 1/v and its backward 2/v: the three share one time axis. The gaps are the bubble. (This
engine's backward measures about 1.2 forwards: the bars would be shorter, the bubble's share of
the step the same, since every stage costs alike. docs/pipeline_parallel.md measures it.)

The zero-bubble schedules (Qi et al. 2024) on the same axis: the backward split into B 1 and W 1
(ZB-V's chunks half a stage: F, B, W 1/2 each). PipeDream-2BW: three batches of m = 4 with no
flush between them, against 1F1B's three flushed steps of the same batches.
"""

import os
from fractions import Fraction

from minipar.parallel.pipeline import schedules, trace
from minipar.parallel.pipeline.simulate import simulate, theoretical_bubble

P, M, V = 4, 8, 2


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", V)):
        # a chunk is 1/v of a rank's layers, so it costs 1/v of a stage's forward and backward
        sim = simulate(schedules.build(name, P, M, v), M, v, forward=Fraction(1, v), backward=Fraction(2, v))
        peak = max(sim.peak_alive.values())
        held = f"{peak} micro-batches" if v == 1 else f"{peak} chunks = {peak / v:g} micro-batches"
        title = (f"{name}: p={P}, m={M}" + (f", v={v}" if v > 1 else "") +
                 f"; bubble {theoretical_bubble(P, M, v)} = {float(theoretical_bubble(P, M, v)):.3f}"
                 f"; rank 0 holds up to {held}; ends at {float(sim.makespan):g}"
                 + (f"\n(each chunk is 1/{v} of a stage: forward {Fraction(1, v)}, backward {Fraction(2, v)})"
                    if v > 1 else ""))
        trace.gantt(sim.timeline, os.path.join(here, f"pipeline_{name}.png"), title, chunks=v, unit="units")
    for name, v in (("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)):
        c = Fraction(1, v)  # F, B and W of a chunk
        sim = simulate(schedules.build(name, P, M, v), M, v, forward=c, backward=c, weight=c,
                       shape=schedules.shape_of(name))
        idle = sim.makespan - sim.busy[0]
        title = (f"{name}: p={P}, m={M}" + (f", v={v} in a V" if v > 1 else "") + f"; F, B, W = {c} each;"
                 f" idle per rank {float(idle):g}, bubble {float(idle / sim.makespan):.3f};"
                 f" rank 0 holds up to {sim.peak_alive[0]} {'chunks' if v > 1 else 'micro-batches'}; "
                 f"ends at {float(sim.makespan):g}")
        trace.gantt(sim.timeline, os.path.join(here, f"pipeline_{name}.png"), title, chunks=v, unit="units")
    m, batches = 4, 3
    sim = simulate({r: schedules.pipedream_2bw(P, m, r, batches) for r in range(P)}, m * batches)
    flushed = batches * simulate(schedules.build("1f1b", P, m), m).makespan
    title = (f"pipedream-2bw: p={P}, {batches} batches of m={m} with no flush (micro-batch k of batch k div {m});"
             f"\nends at {float(sim.makespan):g}, where 1F1B's {batches} flushed steps end at {float(flushed):g}")
    trace.gantt(sim.timeline, os.path.join(here, "pipeline_pipedream-2bw.png"), title, unit="units")


if __name__ == "__main__":
    main()
