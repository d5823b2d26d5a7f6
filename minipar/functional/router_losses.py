"""The auxiliary losses of a mixture-of-experts router, compositions of the ops (no new backward).

    load balancing (Switch, Fedus et al. 2021; GShard, Lepikhin et al. 2020)

        L_aux = E sum_e f_e P_e

    f_e: the fraction of the N k token-slots the router sent to expert e (before any capacity
    dropping); a count, with no gradient. P_e: the mean over tokens of the router probability
    p[:, e]; differentiable. With both uniform (f_e = P_e = 1/E) L_aux = 1; the gradient lowers the
    probability of the experts that get more than their share.

    router z-loss (ST-MoE, Zoph et al. 2022)

        L_z = mean over tokens of (log sum_e exp(logit_e))^2

    which keeps the logits small, where the float32 softmax and its exp stay accurate.

Routing groups. Under data, context or sequence parallelism each rank routes only its own tokens,
so f and P are its group's, and the step's balancing loss is the mean over the G equal groups,
(1/G) sum_g E sum_e f_ge P_ge: not the formula over the union, since the product is not linear.
``group_ids`` (N,) names each token's group so that one device computes exactly that. Written per
token, with the counts as constants, it is one weighted sum of the probabilities:

    (1/G) sum_g E sum_e f_ge P_ge = (E / G) sum_n sum_e p[n, e] f_{g(n) e} / N_g

``attach_loss`` adds an auxiliary loss to the training loss where it is made (Megatron-core's
auxiliary-loss scaler): the identity on an activation forward, and in backward the loss receives
the gradient ``scale`` (its share of the step's loss), so a pipeline stage without the training
loss still backpropagates its layers' auxiliary losses.
"""

from minipar.autograd import Function
from minipar.backend import xp
from minipar.functional.elementwise import exp, log
from minipar.functional.reduction import mean, sum


def equal_groups(group_ids, n):
    """(ids (n,), G, tokens per group) for ``group_ids`` (None: one group), refusing unequal ones."""
    ids = xp.zeros(n, xp.int64) if group_ids is None else xp.asarray(group_ids)
    sizes = xp.bincount(ids)
    if len(ids) != n or not bool((sizes == sizes[0]).all()):
        raise ValueError(f"routing groups must be equal: got sizes {sizes.tolist()} for {n} tokens")
    return ids, len(sizes), n // len(sizes)


def load_balancing_loss(probs, indices, coeff=1.0, group_ids=None):
    """coeff L_aux for ``probs`` (N, E) Tensor and the chosen ``indices`` (N, k) xp integers, the
    mean of the groups' losses if ``group_ids`` (N,) is given."""
    (n, k), n_experts = indices.shape, probs.shape[-1]
    ids, n_groups, per_group = equal_groups(group_ids, n)
    slots = xp.repeat(ids, k) * n_experts + indices.reshape(-1)  # (N k,) (group, expert) of each slot
    f = xp.bincount(slots, minlength=n_groups * n_experts).reshape(n_groups, n_experts) / (per_group * k)
    weight = (f[ids] / per_group).astype(probs.dtype)  # (N, E): f of the token's group, / N_g
    return sum(probs * weight) * (coeff * n_experts / n_groups)


def z_loss(logits, coeff=1.0):
    """coeff L_z for ``logits`` (N, E). The shift m (each row's maximum, a constant) keeps exp from
    overflowing; logsumexp's value, and so its gradient softmax(logits), do not depend on it."""
    m = logits.data.max(axis=-1, keepdims=True)  # (N, 1)
    lse = log(sum(exp(logits - m), axis=-1)) + m[:, 0]  # (N,)
    return mean(lse * lse) * coeff


class AttachLoss(Function):
    @staticmethod
    def forward(ctx, y, loss, scale):
        ctx.shape, ctx.dtype, ctx.scale = loss.shape, loss.dtype, scale
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, xp.full(ctx.shape, ctx.scale, ctx.dtype), None


def attach_loss(y, loss, scale=1.0):
    """``y`` unchanged; backward gives ``loss`` the gradient ``scale`` (see the module docstring)."""
    return AttachLoss.apply(y, loss, float(scale))
