"""Elementwise ops: arithmetic, exp/log/tanh, masked fill and dropout (GELU: ``gelu.py``).

Binary ops broadcast like NumPy; the engine sums gradients back to each input's shape, so the
backwards here are written as if no broadcasting had happened. Scalars stay Python numbers, which
NumPy treats as "weak" (float32 * 0.5 stays float32); see ``checks`` for the dtype rules.
"""

from minipar.autograd import Function, Tensor
from minipar.backend import xp
from minipar.functional.checks import floats, probability, scalar
from minipar.functional.widen import in_float32
from minipar.random import default_generator
from minipar.rng import keep


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
    """Inverted dropout with the survivors given: x * keep / (1 - p), so that E[out] = x and
    evaluation needs no rescaling. The survivors are held as booleans and 1/(1-p) as a number:
    a 16-bit model computes in float32 and rounds each product once, where a 16-bit mask of
    1/(1-p) (1/0.9 is 1.109 in bfloat16) would scale every survivor low, forward and backward."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.keep, ctx.scale = keep, scale
        out = x * keep
        out *= scale
        return out

    @staticmethod
    def backward(ctx, grad):
        dx = grad * ctx.keep
        dx *= ctx.scale
        return dx, None, None


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
    return apply_mask(x, survive, p)


def apply_mask(x, survive, p):
    """x where ``survive`` (booleans of x's shape), scaled by 1/(1-p); differentiable in x: dropout
    with survivors the caller drew (e.g. a shard's part of a bigger mask)."""
    return Dropout.apply(floats("dropout", x), survive, 1.0 / (1.0 - probability(p)))


def fresh_key():
    """A dropout key from the process-wide generator, for calls that bring none."""
    return tuple(int(k) for k in default_generator().integers(0, 2**62, size=2))
