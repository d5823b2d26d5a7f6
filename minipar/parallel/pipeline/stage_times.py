"""What a training step's timelines say about its pipeline: the bubble it had, and the bubble its
stages' own costs leave when messages take no time.

Each rank sums up its timeline (``summary``): the time it computed, its span (its first
instruction's start to its last forward's or backward's end), and its median forward, backward (or
B) and W per chunk. The trainer averages these over the ranks of each stage in the step's one
all-reduce, so every rank holds a table of one row per stage.

The bubble is the mean over stages of 1 - busy / makespan, the makespan being the longest span:
every rank starts its step at about the same moment (the previous step ended in an all-reduce) and
its timeline with it (a later stage's first instruction is a receive), so no two ranks' clocks are
compared, and it holds across hosts. Measuring
each rank against its own span instead would let the last stage, which starts the step waiting
and finishes before the first, hide part of its idle time (with equal stages, 1F1B's p = 2,
m = 8 would read 0.076 instead of the formula's 1/9).

``expected`` replays the schedule (``simulate``) with the stages' measured costs. The formula
(p - 1)/(m + p - 1) assumes equal stages; these stages are as they ran (the last also runs the
head and the loss), so the measured bubble's excess over ``expected`` is what waiting for
messages and the executor's own work between instructions cost.
"""

import statistics

import numpy

from minipar.parallel.pipeline.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE, FORWARD, build,
                                                 shape_of)
from minipar.parallel.pipeline.simulate import simulate

# the cost rows of a summary: forwards, backwards (whole, or their input half B), W
KINDS = ((FORWARD,), (BACKWARD, BACKWARD_INPUT), (BACKWARD_WEIGHT,))
SIMULATE_UP_TO = 4096  # chunk-passes p x v x m: beyond this the replay is not worth its time each step


def summary(timeline, v):
    """One rank's [busy, span, F per chunk, B per chunk, W per chunk] in seconds (2 + 3 v numbers)."""
    out = numpy.zeros(2 + 3 * v)
    work = [(op, chunk, e - s) for op, _, chunk, s, e in timeline if op in COMPUTE]
    if not work:
        return out
    out[0] = sum(t for _, _, t in work)
    out[1] = max(e for op, _, _, _, e in timeline if op in COMPUTE) - timeline[0][3]
    for row, kinds in enumerate(KINDS):
        for chunk in range(v):
            times = [t for op, c, t in work if op in kinds and c == chunk]
            out[2 + row * v + chunk] = statistics.median(times) if times else 0.0
    return out


def bubble(table):
    """The step's bubble from a table of stage summaries (one row per stage)."""
    makespan = table[:, 1].max()
    return float(numpy.mean(1.0 - table[:, 0] / makespan)) if makespan > 0 else 0.0


def costs_ms(table, v):
    """Each stage's median forward, backward (or B) and W per chunk, in milliseconds, for a log."""
    per = table[:, 2:].reshape(len(table), 3, v) * 1e3
    return {name: per[:, row].round(3).tolist() for row, name in enumerate(("forward", "backward", "weight"))}


def expected(schedule, m, v, table, split):
    """The bubble of ``schedule`` with the stages' measured costs and free messages (None when the
    replay would be too long to run every step). ``split``: the backward runs as B and W."""
    p = len(table)
    if p == 1 or p * v * m > SIMULATE_UP_TO:
        return None
    # whole microseconds: the simulator's exact arithmetic stays on small integers
    us = numpy.maximum(1, numpy.round(table[:, 2:].reshape(p, 3, v) * 1e6)).astype(int)
    cost = [{(r, c): int(us[r, row, c]) for r in range(p) for c in range(v)} for row in range(3)]
    sim = simulate(build(schedule, p, m, v), m, v, forward=cost[0], backward=cost[1],
                   weight=cost[2] if split else None, shape=shape_of(schedule))
    return float(sum(sim.bubble.values()) / p)
