"""Elementwise ops: arithmetic, exp/log/tanh, GELU, masked fill and dropout.

Binary ops broadcast like NumPy; the engine sums gradients back to each input's shape, so the
backwards here are written as if no broadcasting had happened. Scalars stay Python numbers, which
NumPy treats as "weak" (float32 * 0.5 stays float32); see ``checks`` for the dtype rules.
"""

import math

import numpy

from minipar.autograd import Function, Tensor
from minipar.backend import blocks, xp
from minipar.functional.checks import floats, probability, scalar
from minipar.functional.widen import in_float32
from minipar.random import default_generator
from minipar.rng import keep, scaled


def _binary(fn, a, b):
    a, b = floats(fn.__name__.lower(), scalar(a), scalar(b))
    return fn.apply(a, b)


@in_float32()
class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


@in_float32()
class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        return a - b

    @staticmethod
    def backward(ctx, grad):
        return grad, (-grad if ctx.needs_input_grad[1] else None)


@in_float32()
class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.a, ctx.b = a, b
        return a * b

    @staticmethod
    def backward(ctx, grad):
        need_a, need_b = ctx.needs_input_grad
        return (grad * ctx.b if need_a else None), (grad * ctx.a if need_b else None)


@in_float32()
class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        out = a / b
        ctx.b, ctx.out = b, out
        return out

    @staticmethod
    def backward(ctx, grad):
        need_a, need_b = ctx.needs_input_grad
        grad_a = grad / ctx.b
        # d(a/b)/db = -a/b^2 = -(a/b)/b
        grad_b = -(grad_a * ctx.out) if need_b else None
        return (grad_a if need_a else None), grad_b


@in_float32()
class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, grad):
        return -grad


@in_float32()
class Pow(Function):
    @staticmethod
    def forward(ctx, a, exponent):
        ctx.a, ctx.exponent = a, exponent
        return a**exponent

    @staticmethod
    def backward(ctx, grad):
        p = ctx.exponent
        if p == 0:  # x^0 = 1 is constant; p x^(p-1) would be 0 * inf = nan at x = 0
            return xp.zeros_like(grad), None
        return grad * (p * ctx.a ** (p - 1)), None


@in_float32()
class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.out = xp.exp(a)
        return ctx.out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.out


@in_float32()
class Log(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.a = a
        return xp.log(a)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.a


@in_float32()
class Tanh(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.out = xp.tanh(a)
        return ctx.out

    @staticmethod
    def backward(ctx, grad):
        return grad * (1.0 - ctx.out * ctx.out)


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


@in_float32()
class GELU(Function):
    """GPT-2's tanh approximation: 0.5 x (1 + tanh(z)), z = c (x + a x^3), c = sqrt(2/pi), a = 0.044715.

    Since 0.5 (1 + tanh(z)) = sigmoid(2z) = s = 1 / (1 + exp(-2z)), it is computed as x s: one exp,
    where NumPy's tanh costs twice as much, and no cancellation in 1 + tanh(z) for negative x.
    With s' = s (1 - s),

        d/dx = s + 2 c x (1 + 3 a x^2) s (1 - s)

    Forward keeps x and s (s in [0, 1]: a 16-bit model holds it in 16 bits as it held tanh(z)).
    exp(-2z) = inf for x below about -9.3 gives s = 0: GELU there is below float32's smallest
    normal number anyway.
    These are the largest activations of the model (4x the hidden size), so the ufunc chains run
    in place, block by block: a block's three arrays (3 x 64 KiB) stay in the core's L2 cache for
    the whole chain (``backend.blocks``).
    """

    BLOCK = 1 << 14

    @staticmethod
    def forward(ctx, x):
        flat = xp.ascontiguousarray(x).reshape(-1)
        s, out = xp.empty_like(flat), xp.empty_like(flat)
        with numpy.errstate(over="ignore"):  # exp(-2z) = inf is s = 0; CuPy never warns
            for b in blocks(flat.size, GELU.BLOCK):
                xb, sb, o = flat[b], s[b], out[b]
                xp.multiply(xb, xb, out=sb)
                sb *= -2.0 * _GELU_C * _GELU_A
                sb -= 2.0 * _GELU_C
                sb *= xb  # -2z
                xp.exp(sb, out=sb)
                sb += 1.0
                xp.reciprocal(sb, out=sb)
                xp.multiply(xb, sb, out=o)
        ctx.x, ctx.s = flat, s
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, s = ctx.x, ctx.s
        g = xp.ascontiguousarray(grad).reshape(-1)
        dx, u = xp.empty_like(x), xp.empty(min(x.size, GELU.BLOCK), x.dtype)
        for b in blocks(x.size, GELU.BLOCK):
            xb, sb, d = x[b], s[b], dx[b]
            ub = u[:d.size]
            xp.subtract(1.0, sb, out=ub)
            ub *= sb  # s (1 - s)
            xp.multiply(xb, xb, out=d)
            d *= 6.0 * _GELU_A * _GELU_C
            d += 2.0 * _GELU_C
            d *= xb  # 2 c x (1 + 3 a x^2)
            d *= ub
            d += sb
            d *= g[b]
        return dx.reshape(grad.shape)


def gelu_reference(x):
    """GELU as its formula reads, a temporary per operation: what ``GELU.forward`` must equal."""
    return 0.5 * x * (1.0 + xp.tanh(_GELU_C * (x + _GELU_A * x**3)))


def gelu_backward_reference(x, grad):
    """grad * dGELU/dx as the formula reads: what ``GELU.backward`` must equal."""
    t = xp.tanh(_GELU_C * (x + _GELU_A * x**3))
    return grad * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * x * x))


@in_float32()
class MaskedFill(Function):
    @staticmethod
    def forward(ctx, x, mask, value):
        ctx.mask = mask
        return xp.where(mask, value, x)

    @staticmethod
    def backward(ctx, grad):
        return xp.where(ctx.mask, 0, grad), None, None


@in_float32()
class Dropout(Function):
    """x times a given mask (0 or 1/(1-p), see ``minipar.rng.scaled``)."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.mask = mask
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.mask, None


def add(a, b):
    return _binary(Add, a, b)


def sub(a, b):
    return _binary(Sub, a, b)


def mul(a, b):
    return _binary(Mul, a, b)


def div(a, b):
    return _binary(Div, a, b)


def neg(a):
    return Neg.apply(floats("neg", a))


def pow(a, exponent):
    exponent = scalar(exponent)  # a NumPy float64 exponent would upcast a float32 base
    if not isinstance(exponent, (int, float)):
        raise TypeError(f"pow: the exponent must be a Python number, got {type(exponent).__name__}")
    return Pow.apply(floats("pow", a), exponent)


def exp(a):
    return Exp.apply(floats("exp", a))


def log(a):
    return Log.apply(floats("log", a))


def tanh(a):
    return Tanh.apply(floats("tanh", a))


def gelu(x):
    return GELU.apply(floats("gelu", x))


def masked_fill(x, mask, value):
    """``value`` where the boolean array ``mask`` (broadcast against x) is True, x elsewhere."""
    mask = mask.data if isinstance(mask, Tensor) else xp.asarray(mask)
    if mask.dtype != bool:
        raise TypeError(f"masked_fill: mask must be boolean, got {mask.dtype}")
    return MaskedFill.apply(floats("masked_fill", x), mask, float(value))


def dropout(x, p, training=True, key=None):
    """Zero each element with probability p and scale the rest by 1/(1-p). Identity when p == 0 or
    not training. Element i (in row-major order) is kept by the hash of ``key`` (a tuple of
    integers) and i (see ``minipar.rng``); without a key, one is taken from the process-wide
    generator of ``minipar.manual_seed``."""
    p = probability(p)
    if not training or p == 0.0:
        return x
    x = floats("dropout", x)
    survive = keep(key or fresh_key(), p, xp.arange(x.size)).reshape(x.shape)
    return apply_mask(x, scaled(survive, p, x.dtype))


def apply_mask(x, mask):
    """x * mask, differentiable in x: dropout with a mask the caller drew (e.g. a shard's part of
    a bigger mask)."""
    return Dropout.apply(floats("dropout", x), mask)


def fresh_key():
    """A dropout key from the process-wide generator, for calls that bring none."""
    return tuple(int(k) for k in default_generator().integers(0, 2**62, size=2))
