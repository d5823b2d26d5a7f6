"""Where a rank's piece of a tensor lies in the whole tensor: boxes of global coordinates.

A checkpoint must not depend on the layout that wrote it. Every piece a rank holds (a TP shard of
a weight, or, under ZeRO, a flat range of Adam moments) is described as boxes of the whole,
single-device tensor: a box is a (start, stop) pair of index tuples, the block
``whole[start[0]:stop[0], start[1]:stop[1], ...]``. A loader on any other layout computes the boxes
it needs and reads their intersections with the boxes that were saved.

Two maps lead from a rank's memory to the whole tensor:

* a flat range [a, b) of the rank's local array (ZeRO's pieces are flat) is a few row-major
  boxes of the local array, each contiguous in memory (``flat_boxes``);
* a local box is a box of the whole tensor through the parameter's ``placement.split``
  (``to_global``): the split axis holds ``chunks`` blocks (q, k, v) each cut over the ranks of
  the split's group, after padding (the vocabulary) that the whole tensor does not have.
"""

import math


def volume(start, stop):
    return math.prod(b - a for a, b in zip(start, stop))


def flat_boxes(shape, a, b):
    """Boxes of an array of ``shape`` covering its row-major flat range [a, b), in order; each is
    contiguous in the flat order, so the range's values are the boxes' values one after another."""
    if a >= b:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((a,), (b,))]
    inner = math.prod(shape[1:])
    first, last = a // inner, (b - 1) // inner
    if a % inner == 0 and b % inner == 0:  # whole rows of the first axis
        return [((first,) + (0,) * (len(shape) - 1), (b // inner,) + tuple(shape[1:]))]
    if first == last:  # inside one row of the first axis: recurse into that row
        return [((first,) + s, (first + 1,) + e) for s, e in flat_boxes(shape[1:], a - first * inner, b - first * inner)]
    head = flat_boxes(shape, a, (first + 1) * inner)  # the rest of the first row
    middle = flat_boxes(shape, (first + 1) * inner, last * inner)  # whole rows
    tail = flat_boxes(shape, last * inner, b)  # the start of the last row
    return head + middle + tail


def to_global(split, index, n, start, stop):
    """[(global start, global stop, local start, local stop)] for a box of part ``index`` of ``n``
    of a tensor cut by ``split`` (a ``minipar.placement.Split``; None: the local array is the
    whole tensor): one per chunk the box crosses, with padding (beyond ``size``) cut off."""
    if split is None:
        return [(tuple(start), tuple(stop), tuple(start), tuple(stop))]
    ax = split.axis
    per_chunk_local = split.part_length(n)
    per_chunk_global = split.padded // split.chunks
    out, s = [], start[ax]
    while s < stop[ax]:
        chunk = s // per_chunk_local
        e = min(stop[ax], (chunk + 1) * per_chunk_local)
        g = chunk * per_chunk_global + index * per_chunk_local + (s - chunk * per_chunk_local)
        g_end = min(g + (e - s), split.size)
        if g < g_end:
            gs, ge, ls, le = list(start), list(stop), list(start), list(stop)
            gs[ax], ge[ax], ls[ax], le[ax] = g, g_end, s, s + (g_end - g)
            out.append((tuple(gs), tuple(ge), tuple(ls), tuple(le)))
        s = e
    return out


def intersect(a_start, a_stop, b_start, b_stop):
    """The box both boxes contain, or None."""
    start = tuple(max(x, y) for x, y in zip(a_start, b_start))
    stop = tuple(min(x, y) for x, y in zip(a_stop, b_stop))
    return (start, stop) if all(s < e for s, e in zip(start, stop)) else None


def region(start, stop, origin=None):
    """The index tuple of a box, relative to ``origin`` (the start of the array it lies in)."""
    origin = origin or (0,) * len(start)
    return tuple(slice(s - o, e - o) for s, e, o in zip(start, stop, origin))
