"""Matrix products: matmul (batched), linear (x W^T + b, fused) and embedding lookup.

For y = a @ b the two backward products are da = g @ b^T and db = a^T @ g. The transposes are views:
BLAS (or our GPU kernel) reads them with its transpose flag, no copy is made. Every product goes
through ``backend.matmul``.
"""

import numpy

from minipar import backend
from minipar.autograd import Function, Tensor
from minipar.backend import matmul as mm, xp
from minipar.dtypes import compute_dtype, is_16bit
from minipar.engine import _unbroadcast
from minipar.functional.checks import floats


def _mT(x):
    return xp.swapaxes(x, -1, -2)


class MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.a, ctx.b = a, b
        return mm(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.a, ctx.b
        need_a, need_b = ctx.needs_input_grad
        grad_a = _product_to(grad, _mT(b), a.shape) if need_a else None
        grad_b = None
        if need_b and b.ndim == 2 and a.ndim > 2:
            # A shared weight: fold the batch into rows and do one GEMM instead of a batch of
            # GEMMs followed by a sum over the batch.
            grad_b = mm(a.reshape(-1, a.shape[-1]).T, grad.reshape(-1, grad.shape[-1]))
        elif need_b:
            grad_b = _product_to(_mT(a), grad, b.shape)
        return grad_a, grad_b


def _product_to(x, y, shape):
    """x @ y for an operand of ``shape``, whose batch axes broadcasting may have widened: the
    engine sums those (``_unbroadcast``). A 16-bit gradient is summed here instead, in float32
    and rounded once, as every 16-bit reduction is (the engine would add the rounded products
    in 16 bits: 4096 ones sum to 256 in bfloat16)."""
    if not is_16bit(x.dtype) or numpy.broadcast_shapes(x.shape[:-2], y.shape[:-2]) == tuple(shape[:-2]):
        return mm(x, y)
    wide = compute_dtype(x.dtype)
    return _unbroadcast(mm(x.astype(wide), y.astype(wide)), shape).astype(x.dtype)


def matmul(a, b):
    """Matrix product over the last two axes, batched and broadcast over the leading ones."""
    a, b = floats("matmul", a, b)
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul needs operands with >= 2 axes, got shapes {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
    return MatMul.apply(a, b)


class Linear(Function):
    """y = x W^T + b with W shaped (out, in), the layout of PyTorch and GPT-2 checkpoints.

    All leading axes of x are folded into rows, so each product is one large GEMM:
    dx = g W,  dW = g^T x,  db = sum of g over rows.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        out = mm(x2, weight.T)
        if bias is not None:
            out += bias
        ctx.x2, ctx.weight, ctx.x_shape = x2, weight, x.shape
        return out.reshape(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def backward(ctx, grad):
        need_x, need_w, need_b = ctx.needs_input_grad
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = mm(g2, ctx.weight).reshape(ctx.x_shape) if need_x else None
        grad_w = mm(g2.T, ctx.x2) if need_w else None
        # a 16-bit bias gradient is a sum over every row: accumulated in float32, then narrowed
        grad_b = g2.sum(axis=0, dtype=compute_dtype(g2.dtype)).astype(g2.dtype, copy=False) if need_b else None
        return grad_x, grad_w, grad_b


def linear(x, weight, bias=None):
    x, weight, bias = floats("linear", x, weight, bias)
    if weight.ndim != 2 or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"linear: weight must be (out, in) and bias (out,), got {weight.shape}"
                         f" and {None if bias is None else bias.shape}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    return Linear.apply(x, weight, bias)


class Embedding(Function):
    """out[i] = W[ids[i]], or 0 where ``skip[i]`` (a vocabulary-parallel rank's ids outside its
    slice: zeroed where they are made, so no lookup and masked copy are both kept). In backward an
    id that occurs several times must receive the sum of all its rows of the gradient, which
    ``dW[ids] += g`` would not do (fancy-index assignment keeps only the last write). We sort the
    rows by id and sum each run of equal ids (``backend.sum_segments``): ~3x faster than ``add.at``
    for a batch of 1024 tokens on the CPU, and, unlike ``add.at`` on a GPU, the same sums in the
    same order every run."""

    @staticmethod
    def forward(ctx, ids, weight, skip):
        ctx.ids, ctx.skip, ctx.weight_shape, ctx.dtype = ids, skip, weight.shape, weight.dtype
        out = weight[ids]
        if skip is not None:
            out[skip] = 0
        return out

    @staticmethod
    def backward(ctx, grad):
        ids = ctx.ids.reshape(-1)
        rows = grad.reshape(-1, ctx.weight_shape[1])
        if ctx.skip is not None:  # a skipped row's gradient reaches no weight
            kept = ~ctx.skip.reshape(-1)
            ids, rows = ids[kept], rows[kept]
        order = xp.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        run_starts = xp.flatnonzero(xp.concatenate([xp.ones(1, bool), sorted_ids[1:] != sorted_ids[:-1]]))
        grad_w = xp.zeros(ctx.weight_shape, ctx.dtype)
        if ids.size == 0:
            return None, grad_w, None
        sums = backend.sum_segments(rows[order].astype(compute_dtype(rows.dtype), copy=False), run_starts)
        grad_w[sorted_ids[run_starts]] = sums  # a 16-bit gradient's rows summed in float32
        return None, grad_w, None


def embedding(ids, weight, skip=None):
    """Rows of ``weight`` (num_embeddings, dim) picked by the integer array ``ids``; zero rows
    where the boolean ``skip`` (the shape of ``ids``) is true."""
    ids = ids.data if isinstance(ids, Tensor) else xp.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding ids must be integers, got {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
        raise IndexError(
            f"embedding ids must lie in [0, {weight.shape[0]}), got [{int(ids.min())}, {int(ids.max())}]"
        )
    if skip is not None and (skip.shape != ids.shape or skip.dtype != bool):
        raise ValueError(f"embedding: skip must be a boolean array of the ids' shape {ids.shape}, got "
                         f"{skip.dtype} {skip.shape}")
    return Embedding.apply(ids, floats("embedding", weight), skip)
