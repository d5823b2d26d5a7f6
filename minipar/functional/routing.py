"""Moving token-slots to their experts and back: sort_by_expert, permute and unpermute.

A router sends each of N tokens to k experts: N k *token-slots*, numbered s = n k + j (token n's
j-th choice), with ``indices`` (N, k) naming each slot's expert. Megatron-core's vocabulary:

    permute     gather the kept slots' token rows into one array sorted by expert (stable: within
                an expert, slots keep token order), so each expert's tokens are one contiguous run
    unpermute   scatter the experts' output rows back to their slots and combine each token's k
                slots weighted by the router: out[n] = sum_j w[n, j] y[slot n k + j]

A dropped slot (over an expert's capacity) is in no run: it contributes 0 to its token, whose
residual connection carries it on. ``permute`` with k = 1 and a permutation of the rows is a plain
reordering; its backward is a gather too, never a scatter-add.
"""

from minipar.autograd import Function
from minipar.backend import xp
from minipar.functional.checks import floats
from minipar.functional.widen import in_float32


def sort_by_expert(indices, n_experts, keep=None):
    """(slots (S,), tokens per expert (E,)): the kept token-slots ordered by expert, stably, and
    how many fall to each expert. ``indices`` (N, k) xp integers; ``keep`` (N, k) bool or None."""
    experts = indices.reshape(-1)  # (N k,) by slot number
    slots = xp.argsort(experts, kind="stable")  # (N k,): by expert, token order within each
    if keep is not None:
        slots = slots[keep.reshape(-1)[slots]]  # (S,) keeps the order of what remains
    counts = xp.bincount(experts[slots], minlength=n_experts)  # (E,)
    return slots, counts


@in_float32()
class Permute(Function):
    """y[i] = x[slots[i] // k]: the token row of each listed slot. Backward: each slot's gradient
    goes to its own place among the N k slots (a permutation, no collisions) and each token sums
    its k places: dx[n] = sum_j g_slot(n k + j)."""

    @staticmethod
    def forward(ctx, x, slots, k):
        ctx.slots, ctx.k, ctx.n = slots, k, x.shape[0]
        return x[slots // k]

    @staticmethod
    def backward(ctx, grad):
        by_slot = xp.zeros((ctx.n * ctx.k,) + grad.shape[1:], grad.dtype)  # (N k, h)
        by_slot[ctx.slots] = grad
        return by_slot.reshape((ctx.n, ctx.k) + grad.shape[1:]).sum(axis=1), None, None


@in_float32()
class Unpermute(Function):
    """out[n] = sum_j w[n, j] Y[n, j], where Y (N, k, h) holds row i of y at slot slots[i] and 0
    at the slots not listed (dropped). Backward:

        dy[i] = w(slot i) g[token of slot i],    dw[n, j] = <g[n], Y[n, j]>

    so a dropped slot's weight receives no gradient from the output.
    """

    @staticmethod
    def forward(ctx, y, weights, slots):
        n, k = weights.shape
        placed = xp.zeros((n * k,) + y.shape[1:], y.dtype)  # (N k, h)
        placed[slots] = y
        placed = placed.reshape((n, k) + y.shape[1:])  # (N, k, h)
        ctx.placed, ctx.weights, ctx.slots = placed, weights, slots
        return (placed * weights[..., None]).sum(axis=1)  # (N, h)

    @staticmethod
    def backward(ctx, grad):
        need_y, need_w = ctx.needs_input_grad[:2]
        n, k = ctx.weights.shape
        grad_y = grad_w = None
        if need_y:
            spread = grad[:, None] * ctx.weights[..., None]  # (N, k, h)
            grad_y = spread.reshape((n * k,) + grad.shape[1:])[ctx.slots]
        if need_w:
            grad_w = (ctx.placed * grad[:, None]).sum(axis=-1)  # (N, k)
        return grad_y, grad_w, None


def permute(x, slots, k=1):
    """Rows of ``x`` (N, h) for the token-slots ``slots`` (S,) of k slots per token -> (S, h)."""
    return Permute.apply(floats("permute", x), xp.asarray(slots), int(k))


def unpermute(y, weights, slots):
    """Expert outputs ``y`` (S, h) of ``slots`` back to their tokens, each token's k slots summed
    weighted by ``weights`` (N, k) -> (N, h)."""
    y, weights = floats("unpermute", y, weights)
    if y.ndim != 2 or weights.ndim != 2 or y.shape[0] != len(slots):
        raise ValueError(f"unpermute: y must be (slots, h) with one row per slot and weights (N, k), got "
                         f"{y.shape}, {weights.shape} and {len(slots)} slots")
    return Unpermute.apply(y, weights, xp.asarray(slots))
