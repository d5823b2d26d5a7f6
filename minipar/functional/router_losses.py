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
"""

from minipar.backend import xp
from minipar.functional.elementwise import exp, log
from minipar.functional.reduction import mean, sum


def load_balancing_loss(probs, indices, coeff=1.0):
    """coeff L_aux for ``probs`` (N, E) Tensor and the chosen ``indices`` (N, k) xp integers."""
    n_experts = probs.shape[-1]
    f = xp.bincount(indices.reshape(-1), minlength=n_experts) / indices.size  # (E,)
    return sum(mean(probs, axis=0) * f.astype(probs.dtype)) * (coeff * n_experts)


def z_loss(logits, coeff=1.0):
    """coeff L_z for ``logits`` (N, E). The shift m (each row's maximum, a constant) keeps exp from
    overflowing; logsumexp's value, and so its gradient softmax(logits), do not depend on it."""
    m = logits.data.max(axis=-1, keepdims=True)  # (N, 1)
    lse = log(sum(exp(logits - m), axis=-1)) + m[:, 0]  # (N,)
    return mean(lse * lse) * coeff
