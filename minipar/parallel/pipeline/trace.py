"""Timelines of a pipeline step: the bubble measured, a Chrome trace, and a Gantt picture.

A timeline is, per rank, the list of (op, mb, chunk, start, end) that the executor records (or that
``simulate`` computes with unit costs). The times of different ranks are comparable because they
come from the same monotonic clock of one host (``time.perf_counter``); across hosts they would
first need a common origin.
"""

import json
import os
import statistics
from fractions import Fraction

from minipar.parallel.pipeline.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE, FORWARD,
                                                 HEAD_WEIGHT, LETTERS)

# forward blue, backward (or its input half B) orange, the weights' half W green
COLORS = {FORWARD: "#4c72b0", BACKWARD: "#dd8452", BACKWARD_INPUT: "#dd8452", BACKWARD_WEIGHT: "#55a868",
          HEAD_WEIGHT: "#8172b3"}


def origin(timelines):
    """The earliest start over every rank."""
    return min(t[3] for events in timelines.values() for t in events)


def bubble(timelines):
    """{rank: idle fraction of the step}: 1 - (time in forwards and backwards) / makespan, the
    makespan running from the first rank's start to the end of the last backward anywhere (the
    optimizer step after it, and the gradient all-reduces it waits for, are not pipeline idle)."""
    t0 = origin(timelines)
    end = max(t[4] for events in timelines.values() for t in events if t[0] in COMPUTE)
    span = end - t0
    if isinstance(span, int):  # a simulator's whole units: the fractions stay exact
        span = Fraction(span)
    return {r: 1 - sum(e - s for op, _, _, s, e in events if op in COMPUTE) / span
            for r, events in timelines.items()}


def op_costs(timelines):
    """{op: {(rank, chunk): seconds}}: each chunk's median forward and backward (or B and W) on each rank, the
    measured costs ``simulate`` takes. The median, so that one instruction that lost its core to
    another process for a while does not stretch the rest."""
    times = {}
    for r, events in timelines.items():
        for op, _, chunk, start, end in events:
            if op in COMPUTE:
                times.setdefault(op, {}).setdefault((r, chunk), []).append(end - start)
    return {op: {k: statistics.median(d) for k, d in by_chunk.items()} for op, by_chunk in times.items()}


def label(op, mb, chunk, chunks=1):
    short = LETTERS.get(op, op)
    return f"{short}{mb}" + (f".{chunk}" if chunks > 1 else "")


def chrome_trace(timelines, path, chunks=1):
    """Write the timelines as Chrome trace JSON (load it in Perfetto or chrome://tracing): one
    track per rank, one slice per instruction, times in microseconds from the first start."""
    t0 = origin(timelines)
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
              for r in timelines]
    for r, timeline in timelines.items():
        for op, mb, chunk, start, end in timeline:
            events.append({"name": label(op, mb, chunk, chunks), "cat": op, "ph": "X", "pid": 0, "tid": r,
                           "ts": float(start - t0) * 1e6, "dur": float(end - start) * 1e6,
                           "args": {"micro_batch": mb, "chunk": chunk}})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def gantt(timelines, path, title, chunks=1, unit="ms"):
    """A Gantt picture: one row per rank, forwards blue, backwards (B) orange, W green, the head's
    deferred W (H) purple, each labelled with its micro-batch (and chunk), the gaps between them
    the bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = {"ms": 1e3, "units": 1}[unit]
    t0 = origin(timelines)
    span = float(max(t[4] for events in timelines.values() for t in events) - t0) * scale
    ranks = sorted(timelines)
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(ranks) + 1.2))
    for row, r in enumerate(ranks):
        bars = {}  # (op, chunk) -> its (start, width)s: one artist per kind, not per bar (a third faster)
        for op, mb, chunk, start, end in timelines[r]:
            if op not in COLORS:
                continue
            x, w = float(start - t0) * scale, float(end - start) * scale
            bars.setdefault((op, chunk), []).append((x, w))
            ax.text(x + w / 2, row, label(op, mb, chunk, chunks), ha="center", va="center",
                    fontsize=6 if w > span / 45 else 4, color="white", clip_on=True)
        for (op, chunk), spans in bars.items():
            shade = 1.0 - 0.35 * (chunk / max(chunks - 1, 1)) if chunks > 1 else 1.0
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLORS[op], alpha=shade,
                           edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    split = any(t[0] == BACKWARD_WEIGHT for events in timelines.values() for t in events)
    units = "time (unit costs: F, B and W as given)" if split else "time (unit costs: forward 1, backward 2)"
    ax.set_xlabel(units if unit == "units" else "time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
