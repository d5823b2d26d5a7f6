"""Ops that compute in float32 when their inputs are 16-bit (mixed precision's rule).

A bfloat16 has 8 bits of mantissa, a float16 11: a mean over 768 features, the sum of a softmax's
exponentials, the log-sum-exp of a loss over 50k logits would each lose most of their digits, and
float16 cannot even hold exp(12). So, as Megatron does, LayerNorm, softmax, the loss, attention
and GELU take their 16-bit inputs, widen them to float32, run the same code as in float32, and
narrow the outputs (and in backward the gradients) to the input dtype again. The cross-entropy
keeps its loss in float32 (``keep_output``): it is the number the loss scale multiplies and the
one the logs print. Matrix products need no widening here: ``backend.matmul`` accumulates 16-bit
inputs in float32 itself. float32 and float64 inputs run the op unchanged.

What a widened forward saves for backward is held in 16 bits (``hold_16bit``), so a bf16 model's
activations take half a float32 model's bytes: an input saved as it is becomes the 16-bit input
itself (exact, and no copy: the graph holds that tensor anyway), an output the narrowed output,
and an array the forward computed is rounded to 16 bits, except the per-row statistics an op names
in ``float32_saved`` (LayerNorm's 1/sigma, attention's log-sum-exp): an error there scales a whole
row, and they are a hidden size (or a head size) smaller than the activations. Backward widens
what it finds on ``ctx`` again, and puts the 16-bit arrays back after (a split backward calls it
twice on one ``ctx``).

``cast`` is the one explicit change of dtype in a graph (Megatron's router runs in float32 on a
bf16 model): forward to the new dtype, backward to the input's.
"""

import functools

from minipar.autograd import Function, Tensor
from minipar.dtypes import as_dtype, is_16bit, is_float
from minipar.engine import _unbroadcast

FLOAT32 = "float32"
BOOKKEEPING = ("narrow", "input_shapes", "needs_input_grad", "by_reference")  # kept on ctx, not saved arrays


def _widen(a):
    return a.astype(FLOAT32) if hasattr(a, "dtype") and is_16bit(a.dtype) else a


def _narrow(a, dtype):
    return a.astype(dtype) if a is not None and hasattr(a, "dtype") and a.dtype != dtype else a


def _root(a):
    """The array owning the memory the view ``a`` looks into."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "dtype"):
        a = a.base
    return a


def _as_held(a, pairs, dtype):
    """What to hold instead of the float32 array ``a`` a widened forward saved. ``pairs``: (the
    array the forward saw, the one the caller gave or receives) for each input and output."""
    for seen, given in pairs:
        if a is seen:
            return given
        if _root(a) is _root(seen):
            if seen is given:  # a view of an input that was not widened (a float32 one): as it is
                return a
            if a.size == seen.size and a.flags.c_contiguous and given.flags.c_contiguous:
                return given.reshape(a.shape)  # the same values, a view of the 16-bit array
            break  # a part of a widened input: its own 16-bit copy below (exact)
    return a.astype(dtype) if a.dtype == FLOAT32 else a


def _map_arrays(value, fn):
    """``value`` with ``fn`` applied to every array in it, opening lists and tuples."""
    if isinstance(value, (list, tuple)):
        return type(value)(_map_arrays(v, fn) for v in value)
    return fn(value) if hasattr(value, "dtype") and hasattr(value, "shape") else value


def hold_16bit(ctx, pairs, dtype, float32_saved):
    """Replace what a widened forward saved on ``ctx`` by its 16-bit form (see the module doc)."""
    for name, value in list(vars(ctx).items()):
        if name not in BOOKKEEPING and name not in float32_saved:
            setattr(ctx, name, _map_arrays(value, lambda a: _as_held(a, pairs, dtype)))


def in_float32(keep_output=False, float32_saved=()):
    """Class decorator for a Function: with a 16-bit float input, forward and backward run in
    float32 and hand back the input's dtype (but the output stays float32 if ``keep_output``);
    what forward saves is held in 16 bits, but for the ``ctx`` attributes named in
    ``float32_saved``."""

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
            wide = [_widen(a) for a in args]
            out = forward(ctx, *wide, **kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            given = outs if keep_output else tuple(_narrow(o, narrow) for o in outs)
            arrays = [(w, a) for w, a in zip(wide, args) if hasattr(a, "dtype")]
            hold_16bit(ctx, arrays + list(zip(outs, given)), narrow, float32_saved)
            return given if isinstance(out, tuple) else given[0]

        @functools.wraps(backward)
        def widened_backward(ctx, *grads):
            if ctx.narrow is None:
                return backward(ctx, *grads)
            held = {name: value for name, value in vars(ctx).items() if name not in BOOKKEEPING}
            for name, value in held.items():
                setattr(ctx, name, _map_arrays(value, _widen))
            try:
                out = backward(ctx, *(_widen(g) for g in grads))
            finally:
                for name, value in held.items():
                    setattr(ctx, name, value)
            if not isinstance(out, tuple):
                return _narrow(_unbroadcast(out, ctx.input_shapes[0]), ctx.narrow)
            # an argument that is no array (a Python number) has no shape and takes no gradient
            return tuple(None if g is None or shape is None else _narrow(_unbroadcast(g, shape), ctx.narrow)
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
