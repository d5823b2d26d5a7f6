"""Argument checks shared by the ops, so that every op refuses bad input the same way.

* Float operands: Tensors must be floating point and of one dtype (a float32 tensor times a float64
  tensor is refused rather than silently upcast). Anything that is not a Tensor (an array, a list)
  is a constant and takes the tensors' dtype, as a Python scalar would; with no tensor among the
  operands it takes the default dtype.
* Axes must lie in [-ndim, ndim) and not repeat (NumPy would raise too; we must not wrap them).
* Probabilities lie in [0, 1).
"""

import numbers

import numpy

from minipar.autograd import Tensor
from minipar.dtypes import get_default_dtype, is_float


def scalar(x):
    """A NumPy or 0-d array scalar as a Python number (NumPy treats those as "weak": they never
    change an array's dtype, while ``numpy.float64(0.5)`` would upcast float32); others unchanged."""
    if isinstance(x, numpy.generic) or (hasattr(x, "ndim") and not isinstance(x, Tensor) and x.ndim == 0):
        return x.item()
    return x


def floats(op, *operands):
    """The operands as float Tensors of one dtype; ``None`` and Python numbers pass through.

    Every op of every step asks this, so the usual case, tensors of one float dtype, compares
    dtype objects and asks ``is_float`` once; names (``dtype.name`` is a Python property, 4.8 us
    in NumPy 2.4) are read only to word an error."""
    dtype = None
    for x in operands:
        if isinstance(x, Tensor):
            if dtype is None:
                dtype = x.dtype
            elif x.dtype != dtype:
                _refuse(op, operands)
    if dtype is None:
        dtype = get_default_dtype()
    elif not is_float(dtype):
        _refuse(op, operands)
    out = [
        x if x is None or isinstance(x, (Tensor, numbers.Number)) else Tensor(x, dtype=dtype)
        for x in operands
    ]
    return out[0] if len(out) == 1 else out


def _refuse(op, operands):
    """Raise the error of operands that are not float tensors of one dtype: the first problem in
    order, a tensor that is not float, then dtypes that differ."""
    tensors = [x for x in operands if isinstance(x, Tensor)]
    for t in tensors:
        if not is_float(t.dtype):
            raise TypeError(f"{op}: needs float tensors, got {t.dtype}; cast with Tensor(x, dtype=...)")
    names = sorted({t.dtype.name for t in tensors})
    if len(names) > 1:
        raise TypeError(
            f"{op}: operands are {' and '.join(names)}; cast one of them explicitly so that no "
            "silent upcast happens"
        )


def axes(op, axis, ndim):
    """``axis`` (None, an int or a sequence) as a sorted tuple of non-negative axes."""
    raw = tuple(range(ndim)) if axis is None else (axis,) if isinstance(axis, numbers.Integral) else tuple(axis)
    for a in raw:
        if not -ndim <= a < ndim:
            raise ValueError(f"{op}: axis {a} is out of range for a tensor with {ndim} axes")
    normal = tuple(sorted(int(a) % ndim for a in raw))
    if len(set(normal)) != len(normal):
        raise ValueError(f"{op}: repeated axis in {axis}")
    return normal


def probability(p, what="dropout probability"):
    if not isinstance(p, numbers.Real) or not 0.0 <= p < 1.0:
        raise ValueError(f"{what} must be a number in [0, 1), got {p!r}")
    return float(p)


def loss_targets(op, logits, targets, vocab_size, ignore_index, reduction):
    """Integer ``targets`` (the logits' shape without its last axis) for a cross-entropy over
    ``vocab_size`` classes, each in [0, vocab_size) or ``ignore_index``; with ``reduction="mean"``
    at least one not ignored, since the mean over none is undefined. Shared by the serial loss
    and the vocabulary-parallel one, which refuse alike."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{op}: reduction must be 'mean' or 'sum', got {reduction!r}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"{op}: targets of shape {targets.shape} do not match logits {logits.shape}")
    if targets.dtype.kind not in "iu":
        raise TypeError(f"{op}: targets must be integers, got {targets.dtype}")
    used = targets[targets != ignore_index]
    if reduction == "mean" and used.size == 0:
        raise ValueError(f"{op}: every target equals ignore_index, so the mean is undefined; use "
                         "reduction='sum' and normalise by the global count")
    if used.size and (int(used.min()) < 0 or int(used.max()) >= vocab_size):
        raise IndexError(f"{op}: targets must lie in [0, {vocab_size}) or equal ignore_index ({ignore_index}), "
                         f"got values in [{int(used.min())}, {int(used.max())}]")
    return targets
