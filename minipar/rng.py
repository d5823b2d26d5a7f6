"""Dropout randomness that does not depend on how the work is split across ranks.

A dropout mask is drawn from a NumPy generator seeded with a *key*: the model's seed, the number
of the dropout call (counted identically on every rank, since every rank runs the same program)
and a position: the sequence's row in the step's whole batch (and, in attention, the head). A rank that holds only part of a tensor
(a sequence shard, its attention heads, its slice of the batch) draws the mask of the whole tensor
for that key and keeps its own part, so

* ranks that hold the same (replicated) activation draw the same mask, and
* ranks that hold different parts draw different masks, and together they hold exactly the mask
  that a single device would have drawn.

That makes a tensor-parallel run with dropout equal to the single-device run, mask for mask.
(Megatron-LM instead seeds each tensor-parallel rank differently: statistically the same, but not
comparable to a single device.) Rows of the batch are drawn separately, so a micro-batch or a
data-parallel rank draws only its own rows; a sequence shard draws its rows whole and keeps its
positions (a counter-based generator could draw only those; NumPy's generators are not).
"""

import contextlib

import numpy

from minipar.backend import xp


class RNGTracker:
    """Hands out one key per dropout call: (seed, call number). Inside ``micro_batch(i, k)`` a
    forward is micro-batch i of k cutting one step's batch into consecutive rows: every micro-batch
    gets the keys the whole batch would get, and keeps its rows of the masks."""

    def __init__(self, seed=0):
        self.seed, self.calls = int(seed), 0
        self.micro = (0, 1)
        self._base = 0

    def next_key(self):
        key = (self.seed, self.calls)
        self.calls += 1
        return key

    @contextlib.contextmanager
    def micro_batch(self, index, count, calls=None):
        """``calls``: start counting from there instead (a pipeline stage runs a chunk of the
        model: its first dropout call is the single-device model's call number ``calls``)."""
        if calls is not None:
            self.calls = calls
        elif index == 0:
            self._base = self.calls
        else:  # the same dropout calls as micro-batch 0: they are parts of the same masks
            self.calls = self._base
        self.micro = (index, count)
        try:
            yield
        finally:
            self.micro = (0, 1)

    def state(self):
        return {"seed": self.seed, "calls": self.calls, "micro": self.micro}

    def set_state(self, state):
        self.seed, self.calls = int(state["seed"]), int(state["calls"])
        self.micro = tuple(state.get("micro", (0, 1)))


def _keep(key, shape, p, index):
    """Which elements survive, drawn on the host from (key, index)."""
    return numpy.random.default_rng([*key, *index]).random(shape, dtype=numpy.float32) >= p


def _scaled(keep, p, dtype):
    """The host's booleans as a mask on the device, in one copy: 0 or 1/(1-p)."""
    mask = xp.asarray(keep, dtype=dtype)
    mask *= 1.0 / (1.0 - p)
    return mask


def keep_mask(key, shape, p, dtype, index=()):
    """Inverted dropout's mask for ``key`` (and sub-position ``index``): 0 with probability p and
    1/(1-p) otherwise, so that E[x * mask] = x and evaluation needs no rescaling."""
    return _scaled(_keep(key, shape, p, index), p, dtype)


def keep_masks(key, shape, p, dtype, indices):
    """``keep_mask`` for each index, stacked (drawn on the host, moved to the device at once)."""
    return _scaled(numpy.stack([_keep(key, shape, p, index) for index in indices]), p, dtype)


def row_masks(key, shape, p, dtype, parts):
    """This rank's part of the dropout mask of a whole batch, drawn row by row: row (sequence) i
    of the whole batch gets its own mask from (key, i), so a rank draws only the rows it holds
    (a micro-batch of a pipeline does not draw the other micro-batches' rows). ``parts`` is a
    list of (axis, count, index) cuts, as in ``local_part``: those along axis 0 say which rows
    these are, the others are cut from each row."""
    first, row_cuts = 0, []
    for axis, count, index in parts:
        if axis == 0:
            first = first * count + index  # nested cuts of the rows: micro-batch, then DP rank
        else:
            row_cuts.append((axis - 1, count, index))
    first *= shape[0]
    row_shape = list(shape[1:])
    for axis, count, _ in row_cuts:
        row_shape[axis] *= count
    rows = [local_part(_keep(key, tuple(row_shape), p, (first + i,)), row_cuts) for i in range(shape[0])]
    return _scaled(numpy.stack(rows), p, dtype)  # a fresh array: no view keeps the whole rows alive


def local_part(full, parts):
    """This rank's part of ``full``: for each (axis, count, index) in ``parts``, in order, cut
    ``count`` equal parts along ``axis`` and keep part ``index``."""
    for axis, count, index in parts:
        if not 0 <= axis < full.ndim or not 0 <= index < count or full.shape[axis] % count:
            raise ValueError(f"part {index} of {count} along axis {axis} of a {full.shape} array: no such part")
        size = full.shape[axis] // count
        full = full[(slice(None),) * axis + (slice(index * size, (index + 1) * size),)]
    return full
