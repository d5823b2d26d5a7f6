"""What a training step's timelines say about its pipeline: the bubble it had, and the bubble its
own compute leaves when messages take no time.

Each rank sums up its timeline (``summary``): the time it computed, its span (its first
instruction's start to its last forward's or backward's end), and how long each of its forwards,
backwards (or B's) and W's took. The trainer averages these over the ranks of each stage in the
step's one all-reduce, so every rank holds a table of one row per stage.

The bubble is the mean over stages of 1 - busy / makespan, the makespan being the longest span:
every rank starts its step at about the same moment (the previous step ended in an all-reduce) and
its timeline with it (a later stage's first instruction is a receive), so no two ranks' clocks are
compared, and it holds across hosts. Measuring each rank against its own span instead would let
the last stage, which starts the step waiting and finishes before the first, hide part of its idle
time (with equal stages, 1F1B's p = 2, m = 8 would read 0.076 instead of the formula's 1/9).
PipeDream-2BW's ranks do not start a step together (nothing at its end makes them wait for each
other, ``weight_stash.py``), and each rank's steps follow each other with no gap: there the
makespan is the longest of the ranks' own steps, and the bubble the idle time within them.

``expected`` replays the schedule (``simulate``) with every instruction's measured duration and
free messages. The formula (p - 1)/(m + p - 1) assumes equal stages that take the same time for
every micro-batch; the replay keeps the stages as they ran (the last also runs the head and the
loss) and each micro-batch's own time (a machine shared with other work slows some of them, and
in 1F1B a late one holds up the other stage). So the measured bubble's excess over ``expected`` is
what waiting for messages and the executor's own work between instructions cost, and nothing else.
"""

from functools import lru_cache

import numpy

from minipar.parallel.pipeline.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE, FORWARD,
                                                 HEAD_WEIGHT, build, shape_of)
from minipar.parallel.pipeline.simulate import simulate
from minipar.parallel.validate import SPLIT_BACKWARD

# the kinds of compute a summary holds durations of: forwards, backwards (whole, or B), W's (a
# chunk has W's or deferred head W's, never both: only whole backwards defer the head's)
KINDS = ((FORWARD,), (BACKWARD, BACKWARD_INPUT), (BACKWARD_WEIGHT, HEAD_WEIGHT))
SIMULATE_UP_TO = 4096  # chunk-passes p x v x m: beyond this no durations travel and nothing is replayed


def width(p, v, m):
    """Numbers in a stage's summary: busy and span, then (with a pipeline short enough to replay
    every step) each kind's duration per chunk and micro-batch. ``m`` None: no replay."""
    return 2 + 3 * v * m if m is not None and 1 < p and p * v * m <= SIMULATE_UP_TO else 2


def summary(timeline, p, v, m):
    """One rank's [busy, span, durations (kind, chunk, micro-batch)] in seconds (``width`` numbers)."""
    out = numpy.zeros(width(p, v, m))
    work = [event for event in timeline if event[0] in COMPUTE]
    if not work:
        return out
    out[0] = sum(e - s for *_, s, e in work)
    out[1] = max(e for *_, e in work) - timeline[0][3]
    if len(out) > 2:
        each = out[2:].reshape(3, v, m)
        for op, mb, chunk, s, e in work:
            each[_kind(op), chunk, mb] = e - s
    return out


def bubble(table):
    """The step's bubble from a table of stage summaries (one row per stage)."""
    makespan = table[:, 1].max()
    return float(numpy.mean(1.0 - table[:, 0] / makespan)) if makespan > 0 else 0.0


def costs_ms(table, v, m):
    """Each stage's median forward, backward (or B) and W per chunk, in milliseconds, for a log."""
    each = table[:, 2:].reshape(len(table), 3, v, m) * 1e3
    return {name: numpy.median(each[:, kind], axis=-1).round(3).tolist()
            for kind, name in enumerate(("forward", "backward", "weight"))}


def expected(schedule, v, m, table, defer_head=False):
    """The bubble of ``schedule`` (``defer_head``: with the head's weight gradients at the flush)
    when every instruction takes the time it took (``table``) and messages none; None when the
    table has no durations (no pipeline, or too long to replay)."""
    p = len(table)
    if table.shape[1] != 2 + 3 * v * m:
        return None
    each = table[:, 2:].reshape(p, 3, v, m)
    split = schedule in SPLIT_BACKWARD
    # whole microseconds: the simulator's clocks stay ints
    us = numpy.maximum(1, numpy.round(each * 1e6)).astype(int)
    ops = (FORWARD, BACKWARD_INPUT if split else BACKWARD, HEAD_WEIGHT if defer_head else BACKWARD_WEIGHT)
    durations = {(r, op, mb, c): int(us[r, kind, c, mb]) for r in range(p) for c in range(v) for mb in range(m)
                 for kind, op in enumerate(ops) if kind < 2 or split or defer_head}
    sim = simulate(_plan(schedule, p, m, v, defer_head), m, v, weight=1 if split else None, shape=shape_of(schedule),
                   durations=durations)
    return float(sum(sim.bubble.values()) / p)


@lru_cache(maxsize=4)
def _plan(schedule, p, m, v, defer_head):
    """The schedule's instruction lists, built once per run, not once per step."""
    return build(schedule, p, m, v, defer_head)


def _kind(op):
    return next(k for k, ops in enumerate(KINDS) if op in ops)
