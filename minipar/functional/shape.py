"""Ops that move elements without changing them: reshape, transpose, indexing, split and concat.

Forwards return views where NumPy can; each backward moves the gradient back the opposite way.
"""

import numbers

import numpy

from minipar.autograd import Function, Tensor
from minipar.backend import xp
from minipar.dtypes import compute_dtype
from minipar.functional import checks


class Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape), None


class Transpose(Function):
    @staticmethod
    def forward(ctx, x, axes):
        ctx.inverse = tuple(numpy.argsort(axes))
        return x.transpose(axes)

    @staticmethod
    def backward(ctx, grad):
        return grad.transpose(ctx.inverse), None


def _is_basic_index(index):
    """Slices, ints, None and Ellipsis select each element at most once (a view in NumPy)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts)


class GetItem(Function):
    @staticmethod
    def forward(ctx, x, index):
        ctx.shape, ctx.dtype, ctx.index = x.shape, x.dtype, index
        return x[index]

    @staticmethod
    def backward(ctx, grad):
        if _is_basic_index(ctx.index):
            out = xp.zeros(ctx.shape, ctx.dtype)
            out[ctx.index] = grad
            return out, None
        # an integer array may pick the same element twice: those gradients must add up, and
        # 16-bit ones in float32 (rounded once: in bfloat16, 4096 ones add up to 256)
        wide = compute_dtype(ctx.dtype)
        out = xp.zeros(ctx.shape, wide)
        xp.add.at(out, ctx.index, grad.astype(wide, copy=False))
        return out.astype(ctx.dtype, copy=False), None


class Split(Function):
    @staticmethod
    def forward(ctx, x, sections, axis):
        ctx.axis = axis
        return tuple(xp.split(x, sections, axis=axis))

    @staticmethod
    def backward(ctx, *grads):
        return xp.concatenate(grads, axis=ctx.axis), None, None


class Concat(Function):
    @staticmethod
    def forward(ctx, *arrays, axis):
        ctx.axis = axis
        ctx.boundaries = numpy.cumsum([a.shape[axis] for a in arrays])[:-1].tolist()
        return xp.concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, grad):
        return tuple(xp.split(grad, ctx.boundaries, axis=ctx.axis))


def reshape(x, shape):
    return Reshape.apply(x, tuple(shape) if not isinstance(shape, int) else (shape,))


def transpose(x, axes=None):
    """Permute axes (all reversed when ``axes`` is None), as ``ndarray.transpose``."""
    if axes is None:
        axes = tuple(reversed(range(x.ndim)))
    if len(axes) != x.ndim or sorted(checks.axes("transpose", axes, x.ndim)) != list(range(x.ndim)):
        raise ValueError(f"transpose: {tuple(axes)} is not a permutation of the {x.ndim} axes")
    return Transpose.apply(x, tuple(int(a) % x.ndim for a in axes))


def _index_part(i):
    """An index array on the arrays' device (a NumPy index cannot pick from a CuPy array)."""
    if isinstance(i, Tensor):
        return i.data
    if isinstance(i, (list, numpy.ndarray)):
        return xp.asarray(i)
    return i


def getitem(x, index):
    index = tuple(map(_index_part, index)) if isinstance(index, tuple) else _index_part(index)
    return GetItem.apply(x, index)


def split(x, sections, axis=-1):
    """Split along ``axis`` into ``sections`` equal parts (an int) or into parts of the given sizes
    (a list), e.g. ``q, k, v = split(qkv, 3, axis=-1)`` for the fused attention projection."""
    axis = checks.axes("split", axis, x.ndim)[0]
    if isinstance(sections, numbers.Integral):
        sections = int(sections)
        if sections < 1 or x.shape[axis] % sections:
            raise ValueError(f"split: axis of size {x.shape[axis]} is not divisible into {sections} equal parts")
    else:
        sizes = list(sections)
        if any(not isinstance(n, numbers.Integral) or n < 0 for n in sizes):  # a negative size cut overlapping parts
            raise ValueError(f"split: sizes must be non-negative integers, got {sizes}")
        if sum(sizes) != x.shape[axis]:
            raise ValueError(f"split: sizes {sizes} do not add up to the axis size {x.shape[axis]}")
        sections = numpy.cumsum(sizes)[:-1].tolist()
    return Split.apply(x, sections, axis)


def concat(tensors, axis=0):
    if not len(tensors):
        raise ValueError("concat: needs at least one tensor")
    tensors = checks.floats("concat", *tensors)
    tensors = [tensors] if isinstance(tensors, Tensor) else tensors
    return Concat.apply(*tensors, axis=checks.axes("concat", axis, tensors[0].ndim)[0])
