"""Ops that compute in float32 when their inputs are 16-bit (mixed precision's rule).

A bfloat16 has 8 bits of mantissa, a float16 11: a mean over 768 features, the sum of a softmax's
exponentials, the log-sum-exp of a loss over 50k logits would each lose most of their digits, and
float16 cannot even hold exp(12). So, as Megatron does, LayerNorm, softmax, the loss, attention
and GELU take their 16-bit inputs, widen them to float32, run the same code as in float32, and
narrow the outputs (and in backward the gradients) to the input dtype again. The cross-entropy
keeps its loss in float32 (``keep_output``): it is the number the loss scale multiplies and the
one the logs print. Matrix products need no widening here: ``backend.matmul`` accumulates 16-bit
inputs in float32 itself. float32 and float64 inputs run the op unchanged.

``cast`` is the one explicit change of dtype in a graph (Megatron's router runs in float32 on a
bf16 model): forward to the new dtype, backward to the input's.
"""

import functools

from minipar.autograd import Function, Tensor
from minipar.dtypes import as_dtype, is_16bit, is_float
from minipar.engine import _unbroadcast

FLOAT32 = "float32"


def _widen(a):
    return a.astype(FLOAT32) if hasattr(a, "dtype") and is_16bit(a.dtype) else a


def _narrow(a, dtype):
    return a.astype(dtype) if a is not None and hasattr(a, "dtype") and a.dtype != dtype else a


def in_float32(keep_output=False):
    """Class decorator for a Function: with a 16-bit float input, forward and backward run in
    float32 and hand back the input's dtype (but the output stays float32 if ``keep_output``)."""

    def decorate(cls):
        forward, backward = cls.forward, cls.backward

        @functools.wraps(forward)
        def widened_forward(ctx, *args, **kwargs):
            narrow = next((a.dtype for a in args if hasattr(a, "dtype") and is_16bit(a.dtype)), None)
            ctx.narrow = narrow
            # the input shapes, to sum a broadcast gradient back in float32 (the engine would sum
            # the narrowed one in 16 bits)
            ctx.input_shapes = [getattr(a, "shape", None) for a in args]
            if narrow is None:
                return forward(ctx, *args, **kwargs)
            out = forward(ctx, *(_widen(a) for a in args), **kwargs)
            if keep_output:
                return out
            return tuple(_narrow(o, narrow) for o in out) if isinstance(out, tuple) else _narrow(out, narrow)

        @functools.wraps(backward)
        def widened_backward(ctx, *grads):
            if ctx.narrow is None:
                return backward(ctx, *grads)
            out = backward(ctx, *(_widen(g) for g in grads))
            if not isinstance(out, tuple):
                return _narrow(_unbroadcast(out, ctx.input_shapes[0]), ctx.narrow)
            return tuple(g if g is None else _narrow(_unbroadcast(g, shape), ctx.narrow)
                         for g, shape in zip(out, ctx.input_shapes))

        cls.forward, cls.backward = staticmethod(widened_forward), staticmethod(widened_backward)
        return cls

    return decorate


class Cast(Function):
    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        return x.astype(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.astype(ctx.dtype), None


def cast(x, dtype):
    """``x`` (a float Tensor) in ``dtype``, its gradient cast back; ``x`` itself if it is already."""
    dtype = as_dtype(dtype)
    if not isinstance(x, Tensor) or not is_float(x.dtype) or not is_float(dtype):
        raise TypeError(f"cast: needs a float Tensor and a float dtype, got {type(x).__name__} and {dtype}")
    return x if x.dtype == dtype else Cast.apply(x, dtype)
