"""Ops that reduce over axes: sum, mean, softmax, log_softmax and the fused LayerNorm."""

from minipar.autograd import Function
from minipar.backend import dot_along, sum_along, xp
from minipar.functional.checks import axes, floats
from minipar.functional.widen import in_float32


@in_float32()
class Sum(Function):
    @staticmethod
    def forward(ctx, x, axes, keepdims):
        ctx.shape, ctx.axes, ctx.keepdims = x.shape, axes, keepdims
        return xp.asarray(x.sum(axis=axes, keepdims=keepdims))

    @staticmethod
    def backward(ctx, grad):
        if not ctx.keepdims:
            grad = xp.expand_dims(grad, ctx.axes)
        return xp.broadcast_to(grad, ctx.shape), None, None


def sum(x, axis=None, keepdims=False):
    x = floats("sum", x)
    return Sum.apply(x, axes("sum", axis, x.ndim), bool(keepdims))


def mean(x, axis=None, keepdims=False):
    x = floats("mean", x)
    reduced = axes("mean", axis, x.ndim)
    count = 1
    for a in reduced:
        count *= x.shape[a]
    if count == 0:
        raise ValueError(f"mean over an empty axis of a tensor of shape {x.shape} is undefined")
    return Sum.apply(x, reduced, bool(keepdims)) * (1.0 / count)


def _shift(x, axis):
    """Each row's maximum, or 0 for a row that is -inf everywhere (every entry masked): -inf - -inf
    would make the row nan, and nan reaches every gradient through the products that follow
    (nan * 0 is nan). With 0 the row's exponentials are all 0, and ``_nonzero`` takes their sum
    as 1, so softmax gives it no probability anywhere (log_softmax -inf) and no gradient."""
    m = x.max(axis=axis, keepdims=True)
    xp.copyto(m, 0, where=m == -xp.inf)  # no branch: a GPU need not wait to know
    return m


def _nonzero(total):
    """A row's sum of exponentials, 1 where it is 0: only a row of -inf sums to 0 (its maximum
    contributes exp(0) = 1 otherwise)."""
    xp.copyto(total, 1, where=total == 0)
    return total


@in_float32()
class Softmax(Function):
    """y = exp(x - max) / sum(exp(x - max)); subtracting the max keeps exp from overflowing.
    Backward: dx = y * (g - sum(g * y)). A row that is -inf everywhere (masked entirely) is 0
    (see ``_shift``)."""

    @staticmethod
    def forward(ctx, x, axis):
        y = x - _shift(x, axis)
        xp.exp(y, out=y)
        y /= _nonzero(y.sum(axis=axis, keepdims=True))
        ctx.y, ctx.axis = y, axis
        return y

    @staticmethod
    def backward(ctx, grad):
        y = ctx.y
        dx = grad * y
        dx -= y * dx.sum(axis=ctx.axis, keepdims=True)
        return dx, None


@in_float32()
class LogSoftmax(Function):
    """y = x - max - log(sum(exp(x - max))). Backward: dx = g - exp(y) * sum(g). A row that is
    -inf everywhere stays -inf (see ``_shift``)."""

    @staticmethod
    def forward(ctx, x, axis):
        shifted = x - _shift(x, axis)
        y = shifted - xp.log(_nonzero(xp.exp(shifted).sum(axis=axis, keepdims=True)))
        ctx.y, ctx.axis = y, axis
        return y

    @staticmethod
    def backward(ctx, grad):
        dx = xp.exp(ctx.y)
        dx *= grad.sum(axis=ctx.axis, keepdims=True)
        return grad - dx, None


def softmax(x, axis=-1):
    x = floats("softmax", x)
    return Softmax.apply(x, axes("softmax", axis, x.ndim)[0])


def log_softmax(x, axis=-1):
    x = floats("log_softmax", x)
    return LogSoftmax.apply(x, axes("log_softmax", axis, x.ndim)[0])


def _row_means(a):
    return sum_along(a, -1) * (1.0 / a.shape[1])


def _row_dots(a, b):
    """sum_j a[i, j] b[i, j] for each row i."""
    return dot_along(a, b, 1)


@in_float32(float32_saved=("rstd",))  # 1/sigma scales a whole row: one float32 per row
class LayerNorm(Function):
    """One node for the whole normalisation over the last axis (Ba et al. 2016):

        xhat = (x - mean) * rstd,   rstd = 1 / sqrt(var + eps),   y = xhat * w + b

    With dxhat = g * w, the input gradient is

        dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))

    so backward needs only xhat and rstd, and no graph of a dozen small ops is kept.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        C = x.shape[-1]
        xhat = x.reshape(-1, C) - _row_means(x.reshape(-1, C))[:, None]
        var = _row_dots(xhat, xhat) * (1.0 / C)
        var += eps
        rstd = (1.0 / xp.sqrt(var))[:, None]
        xhat *= rstd
        out = xhat * weight
        if bias is not None:
            out += bias
        ctx.xhat, ctx.rstd, ctx.weight, ctx.has_bias = xhat, rstd, weight, bias is not None
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd = ctx.xhat, ctx.rstd
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        g = grad.reshape(xhat.shape)
        grad_w = dot_along(g, xhat, 0) if need_w else None
        grad_b = g.sum(axis=0) if need_b else None
        if not need_x:
            return None, grad_w, grad_b, None
        dx = g * ctx.weight  # dxhat, turned into dx in place
        proj = (_row_dots(dx, xhat) * (1.0 / xhat.shape[1]))[:, None]
        dx -= _row_means(dx)[:, None]
        dx -= xhat * proj
        dx *= rstd
        return dx.reshape(grad.shape), grad_w, grad_b, None


def layer_norm_reference(x, weight, bias, eps, grad):
    """LayerNorm's output and its gradients (x, weight, bias) for upstream ``grad``, with plain
    means and sums along the rows: what ``LayerNorm``'s BLAS row sums must equal."""
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    out = xhat * weight + (0.0 if bias is None else bias)
    dxhat = grad * weight
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    rows = tuple(range(x.ndim - 1))
    return out, dx, (grad * xhat).sum(axis=rows), None if bias is None else grad.sum(axis=rows)


def layer_norm(x, weight, bias=None, eps=1e-5):
    """LayerNorm over the last axis with a learned scale ``weight`` and optional shift ``bias``."""
    x, weight, bias = floats("layer_norm", x, weight, bias)
    C = x.shape[-1]
    if weight.shape != (C,) or (bias is not None and bias.shape != (C,)):
        raise ValueError(f"layer_norm: weight and bias must have shape ({C},) for input {x.shape}")
    return LayerNorm.apply(x, weight, bias, float(eps))
