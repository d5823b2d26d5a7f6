"""Cross-entropy fused with softmax: one node, and the gradient in one line.

With p = softmax(logits) and one-hot target y, d loss / d logits = p - y (times the upstream grad
and 1/count for the mean). Keeping it as one op avoids storing log-probabilities and a gather node.
"""

import numpy

from minipar.autograd import Function, Tensor
from minipar.backend import xp
from minipar.functional.checks import floats, loss_targets
from minipar.functional.widen import in_float32


@in_float32(keep_output=True)  # the loss itself stays float32
class CrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction):
        vocab = logits.shape[-1]
        x = logits.reshape(-1, vocab)
        t = targets.reshape(-1)
        valid = t != ignore_index
        safe_t = xp.where(valid, t, 0)
        rows = xp.arange(x.shape[0])

        with numpy.errstate(invalid="ignore", divide="ignore"):  # a row of -inf: -inf - -inf (CuPy never warns)
            row_max = x.max(axis=1, keepdims=True)
            probs = x - row_max
            xp.exp(probs, out=probs)
            sum_exp = probs.sum(axis=1, keepdims=True)
            probs /= sum_exp
            # log p_target = x_target - max - log(sum exp(x - max)): exact even when p_target underflows
            logp_target = x[rows, safe_t] - row_max[:, 0] - xp.log(sum_exp[:, 0])
        # an ignored row adds nothing whatever its logits: zeroed, not multiplied by 0, which
        # turns the -inf of a masked column 0 (where safe_t reads it) or a row of -inf into nan
        logp_target[~valid] = 0.0
        total = -logp_target.sum()
        count = int(valid.sum()) if reduction == "mean" else 1
        ctx.probs, ctx.rows, ctx.safe_t, ctx.valid = probs, rows, safe_t, valid
        ctx.count, ctx.shape = count, logits.shape
        return xp.asarray(total / count, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        dx = ctx.probs  # owned by this node, which backward consumes exactly once
        dx[ctx.rows, ctx.safe_t] -= 1.0
        dx *= (ctx.valid * (grad / ctx.count))[:, None]
        if not ctx.valid.all():  # an ignored row of -inf has nan probabilities, and nan * 0 is nan
            dx[~ctx.valid] = 0.0
        return dx.reshape(ctx.shape), None, None, None


def cross_entropy(logits, targets, ignore_index=-1, reduction="mean"):
    """Cross-entropy of ``logits`` (..., V) against integer ``targets`` (...).

    Targets equal to ``ignore_index`` contribute nothing. ``reduction="mean"`` divides by the number
    of non-ignored targets; ``"sum"`` leaves the normalisation to the caller (data parallelism divides
    by the global token count instead of averaging per-rank means).
    """
    logits = floats("cross_entropy", logits)
    targets = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
    loss_targets("cross_entropy", logits, targets, logits.shape[-1], ignore_index, reduction)
    return CrossEntropy.apply(logits, targets, int(ignore_index), reduction)
