"""Dropout masks keyed by position: each keep/drop decision is a pure function of where it is.

An element of a dropout mask survives or not by a hash of

    (seed, iteration, layer, site)          which dropout: the model, the training step, the place
                                            in the model (layer index, site within the layer)
    (row, position, [head,] feature)        which element: its sequence's row in the step's whole
                                            batch, its token's position, and so on

and nothing else: no generator state, no count of calls. A rank that holds any subset of the tokens
(a data-parallel slice of the rows, a micro-batch, a shard of the sequence, chunks of it in any
order, some heads, some columns) computes the single-device decisions for exactly those elements,
so every layout drops exactly what one device drops. (Megatron-LM instead seeds each tensor-parallel
rank differently: statistically the same, but not comparable to a single device.) The hash is plain
integer arithmetic on ``xp`` arrays, so on a GPU the masks are computed on the device.

The hash, a tree of well-studied finalisers:

* the key and then each outer coordinate (rows, positions, ...) are folded in by SplitMix64
  (Steele, Lea & Flood 2014): h' = mix64(h + c * golden), Stafford's "Mix13" finaliser after a Weyl
  step, the generator Java's SplittableRandom uses and that passes BigCrush. These arrays are small
  (one value per row, or per row and position), so 64-bit arithmetic costs nothing there;
* the innermost coordinate, the one that makes the mask big, goes through MurmurHash3's fmix32
  (Appleby), keyed by the 64-bit value of its outer coordinates: its low half starts a 32-bit Weyl
  sequence, its high half is xor-ed in. NumPy multiplies 32-bit integers with vector instructions
  and 64-bit ones one at a time, so this keeps the masks as cheap as drawing from NumPy's generator.

Why that is good enough: dropout needs decisions that are uniform and uncorrelated to about 1e-3,
not cryptographic strength. Both finalisers are bijections with full avalanche (flipping any input
bit flips each output bit with probability ~1/2), so distinct counters give distinct words that
look unrelated. Two lines of a mask along the innermost axis (two query rows of attention) are
alike only if all 64 bits of their outer hashes are. The tests measure the keep rate, the
correlation of neighbours along every axis and the frequencies of patterns of four neighbours.
"""

import contextlib

import numpy

from minipar.backend import xp

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # 2^64 / golden ratio (odd): SplitMix64's Weyl step
_MIX64 = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # Stafford's Mix13
_GOLDEN32 = numpy.uint32(0x9E3779B9)
_FMIX32 = (numpy.uint32(0x85EBCA6B), numpy.uint32(0xC2B2AE35))  # MurmurHash3's fmix32


def _mix64_int(z):
    """Stafford's Mix13 on a Python int (the key: a few values, hashed on the host)."""
    z = ((z ^ (z >> 30)) * _MIX64[0]) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX64[1]) & _MASK64
    return z ^ (z >> 31)


def _mix64(z):
    """Mix13 on a uint64 array, in place (the arithmetic wraps modulo 2^64, as the hash wants)."""
    z ^= z >> numpy.uint64(30)
    z *= numpy.uint64(_MIX64[0])
    z ^= z >> numpy.uint64(27)
    z *= numpy.uint64(_MIX64[1])
    z ^= z >> numpy.uint64(31)
    return z


def _fmix32(z):
    """MurmurHash3's fmix32 on a uint32 array, in place."""
    z ^= z >> numpy.uint32(16)
    z *= _FMIX32[0]
    z ^= z >> numpy.uint32(13)
    z *= _FMIX32[1]
    z ^= z >> numpy.uint32(16)
    return z


def stream(key):
    """The 64-bit start of one dropout's hashes: the key's integers folded in one by one."""
    h = 0
    for k in key:
        h = _mix64_int((h + ((int(k) + 1) & _MASK64) * _GOLDEN64) & _MASK64)
    return h


def keep(key, p, *coords):
    """Which elements survive dropout with probability p: booleans of shape
    (len(coords[0]), len(coords[1]), ...), where element [i, j, ...] is decided by the hash of
    ``key`` (a tuple of integers) and coords[0][i], coords[1][j], ... alone. Each coordinate is a
    1-D array of non-negative integers: the rows, positions, heads or features these elements are."""
    if not coords:
        raise ValueError("keep: give at least one coordinate array")
    n = len(coords)
    h = xp.asarray(numpy.uint64(stream(key)))
    for axis, c in enumerate(coords):  # h: (len(c0), ..., len(c_axis), 1, ..., 1)
        c = xp.asarray(c).astype(xp.uint64).reshape((1,) * axis + (-1,) + (1,) * (n - 1 - axis))
        if axis < n - 1:
            h = _mix64(h + c * numpy.uint64(_GOLDEN64))
    lo, hi = h.astype(xp.uint32), (h >> numpy.uint64(32)).astype(xp.uint32)
    z = lo + c.astype(xp.uint32) * _GOLDEN32
    z ^= hi
    # survive when the 32-bit hash is at or above p's share of 2^32: probability 1 - p (to 2^-32)
    return _fmix32(z) >= numpy.uint32(int(p * 2**32))


def scaled(keep, p, dtype):
    """Inverted dropout's mask from the survivors: 0 or 1/(1-p), so that E[x * mask] = x and
    evaluation needs no rescaling."""
    mask = keep.astype(dtype)
    mask *= 1.0 / (1.0 - p)
    return mask


def rows_of(batch, micro=(0, 1), replica=(0, 1)):
    """The global rows a rank holds when a batch of ``batch`` rows is cut into micro-batches
    ``micro`` = (i, k), rows i*batch/k ... first, and each of those across data-parallel replicas
    ``replica`` = (r, n) in equal consecutive slices (as ``split_batch`` and the pipeline do)."""
    (i, k), (r, n) = micro, replica
    if batch % (k * n):
        raise ValueError(f"a batch of {batch} rows does not cut into {k} micro-batches x {n} replicas")
    per_micro = batch // k
    start = i * per_micro + r * (per_micro // n)
    return xp.arange(start, start + per_micro // n)


def context_positions(length, context=(0, 1)):
    """The global positions of the ``length`` tokens a context-parallel rank holds, in the order it
    holds them. ``context`` = (r, n): the sequence of n x length tokens is cut into 2n chunks and
    rank r holds chunks r and 2n-1-r (Megatron-core's load balancing): under a causal mask an early
    chunk attends to few keys and a late one to many, so each rank takes one of each."""
    r, n = context
    if n == 1:
        return xp.arange(length)
    if length % 2 or not 0 <= r < n:
        raise ValueError(f"context-parallel rank {r} of {n} holds two equal chunks: {length} positions "
                         "per rank must be even (the sequence a multiple of 2 x CP)")
    half = length // 2
    return xp.concatenate([xp.arange(r * half, (r + 1) * half), xp.arange((2 * n - 1 - r) * half, (2 * n - r) * half)])


def part(coords, count, index):
    """Part ``index`` of ``count`` equal consecutive parts of the coordinates ``coords`` (a
    sequence-parallel rank's positions, a tensor-parallel rank's features)."""
    if not 0 <= index < count or len(coords) % count:
        raise ValueError(f"part {index} of {count} of {len(coords)} coordinates: no such part")
    size = len(coords) // count
    return coords[index * size : (index + 1) * size]


class DropoutRNG:
    """What a model's dropouts need beyond their own (layer, site): the seed, the training
    iteration (the training loop sets ``iteration`` every step) and where the tokens of the forward
    in progress sit in the step's whole batch (``at``).

    Without ``at``, a forward of B rows and T positions holds rows r*B ... (r+1)*B - 1, where
    ``replica`` = (r, n) says which data-parallel replica this model is (split_batch's slice), and
    positions 0 ... T - 1, or, for rank c of a context-parallel group of m (``context`` = (c, m)),
    its two chunks of a sequence of m x T (``context_positions``)."""

    def __init__(self, seed=0, replica=(0, 1), context=(0, 1)):
        self.seed, self.iteration, self.replica, self.context = int(seed), 0, tuple(replica), tuple(context)
        self.rows = self.positions = None

    @contextlib.contextmanager
    def at(self, rows=None, positions=None):
        """Forwards inside hold the tokens of global ``rows`` (one per row of their batch) and
        global ``positions`` (one per position of their sequences): integer arrays, in any order."""
        before = (self.rows, self.positions)
        if rows is not None:
            self.rows = xp.asarray(rows)
        if positions is not None:
            self.positions = xp.asarray(positions)
        try:
            yield self
        finally:
            self.rows, self.positions = before

    def key(self, layer, site):
        """The key of the dropout at ``site`` of layer ``layer`` in this iteration."""
        return (self.seed, self.iteration, int(layer), int(site))

    def where(self, batch, length):
        """(rows, positions) of a forward's ``batch`` sequences of ``length`` tokens."""
        rows, positions = self.rows, self.positions
        if rows is None:
            rows = xp.arange(self.replica[0] * batch, (self.replica[0] + 1) * batch)
        elif len(rows) != batch:
            raise ValueError(f"dropout was told of {len(rows)} rows (rng.at(rows=...)) for a batch of {batch}")
        if positions is None:
            positions = context_positions(length, self.context)
        elif len(positions) != length:
            raise ValueError(f"dropout was told of {len(positions)} positions (rng.at(positions=...)) "
                             f"for sequences of {length}")
        return rows, positions

    def state(self):
        """Everything a forward's masks depend on besides the layer (recomputation saves it)."""
        return {"seed": self.seed, "iteration": self.iteration, "rows": self.rows, "positions": self.positions}

    def set_state(self, state):
        self.seed, self.iteration = int(state["seed"]), int(state["iteration"])
        self.rows, self.positions = state.get("rows"), state.get("positions")
