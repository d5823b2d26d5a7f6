"""Cross-entropy over a vocabulary split across ranks, without ever gathering the logits.

Rank r holds logits z[:, v] for its vocabulary slice only. For each token the loss is

    loss = log sum_v exp(z_v - m) - (z_target - m),   m = max_v z_v,

and each of its three pieces is a sum (or max) over the vocabulary, so each is computed locally and
combined over the ranks with an all-reduce of one number per token: the max, then the sum of
exponentials together with the target's logit (which exactly one rank holds; the others add 0).
That is 3 numbers per token on the wire instead of the whole (tokens x vocabulary) logits.

The gradient, softmax(z) - onehot(target), needs only this rank's columns of the softmax and
whether the target is among them: no communication in backward. Columns past the true vocabulary
(padding up to a multiple of the TP size) are set to -inf, so padding never changes the loss.
"""

import numpy

from minipar.autograd import Function
from minipar.backend import array_of, xp
from minipar.functional.checks import floats, loss_targets
from minipar.functional.widen import in_float32


@in_float32(keep_output=True)  # 16-bit logits: the sums over the vocabulary, and the loss, in float32
class VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, comm, vocab_start, vocab_size, ignore_index, reduction):
        per_rank = logits.shape[-1]
        z = logits.reshape(-1, per_rank).copy()
        t = targets.reshape(-1)
        padding = xp.arange(vocab_start, vocab_start + per_rank) >= vocab_size
        if padding.any():
            z[:, padding] = -xp.inf
        row_max = comm.all_reduce(z.max(axis=1), op="max")
        with numpy.errstate(invalid="ignore"):  # a row of -inf (ignored, see below): -inf - -inf
            z -= row_max[:, None]
        local = t - vocab_start
        valid = t != ignore_index
        mine = (local >= 0) & (local < per_rank) & valid  # an ignored target's logit is nobody's (it may be padding's -inf)
        rows = xp.arange(z.shape[0])
        sums = xp.zeros((2, z.shape[0]), z.dtype)  # [sum of exp(z), target's z]: one all-reduce
        sums[1] = xp.where(mine, z[rows, xp.where(mine, local, 0)], 0.0)
        xp.exp(z, out=z)
        sums[0] = z.sum(axis=1)
        comm.all_reduce(sums)
        count = int(valid.sum()) if reduction == "mean" else 1
        with numpy.errstate(invalid="ignore", divide="ignore"):
            losses = xp.log(sums[0]) - sums[1]
            z /= sums[0][:, None]  # this rank's columns of the softmax
        losses[~valid] = 0.0  # an ignored row adds nothing, even a row of -inf (nan * 0 would be nan)
        total = losses.sum()
        ctx.probs, ctx.rows, ctx.local, ctx.mine, ctx.valid = z, rows, local, mine, valid
        ctx.count, ctx.shape = count, logits.shape
        return xp.asarray(total / count, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        dz = ctx.probs
        hit = ctx.mine
        dz[ctx.rows[hit], ctx.local[hit]] -= 1.0
        dz *= (ctx.valid * (grad / ctx.count))[:, None]
        if not ctx.valid.all():  # an ignored row of -inf has nan probabilities, and nan * 0 is nan
            dz[~ctx.valid] = 0.0
        return dz.reshape(ctx.shape), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, comm, vocab_start, vocab_size, ignore_index=-1, reduction="mean"):
    """Cross-entropy of ``logits`` (..., V/N), this rank's vocabulary columns starting at
    ``vocab_start``, against integer ``targets`` (...) in the whole vocabulary of ``vocab_size``:
    the mean over the targets not ``ignore_index``, or with ``reduction="sum"`` their sum. Every
    rank of ``comm`` gets the same loss."""
    logits = floats("vocab_parallel_cross_entropy", logits)
    targets = xp.asarray(array_of(targets))
    if logits.shape[-1] * comm.size < vocab_size:
        raise ValueError(f"vocab_parallel_cross_entropy: {comm.size} ranks of {logits.shape[-1]} vocabulary "
                         f"columns do not hold a vocabulary of {vocab_size}")
    loss_targets("vocab_parallel_cross_entropy", logits, targets, vocab_size, ignore_index, reduction)
    return VocabParallelCrossEntropy.apply(logits, targets, comm, int(vocab_start), int(vocab_size),
                                           int(ignore_index), reduction)
