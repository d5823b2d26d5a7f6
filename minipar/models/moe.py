"""A mixture-of-experts MLP: a router, E experts shaped like the GPT's MLP, the balancing losses.

Each token x goes to k of E experts (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch
Transformer, Fedus et al. 2021):

    p = softmax(x W_r^T)                      router probabilities, (N, E)
    top-k experts e_1..e_k of p               ties: the lowest expert index wins
    w_j = p[e_j]  (/ sum_i p[e_i] if normalize)
    y = sum_j w_j expert_{e_j}(x)

Capacity (GShard, Switch): with a capacity factor c, expert e takes at most ceil(c N k / E) of the
token-slots routed to it, those with the highest router probability p[e] (ties: token order); a
dropped slot adds 0, and the block's residual connection carries its token unchanged. Without c
the layer is dropless. ``groups`` G cuts the N tokens into G equal consecutive groups, each with
its own capacity ceil(c (N/G) k / E): what expert parallelism does when each of G ranks routes its
own tokens, so one device with ``groups=G`` drops exactly the slots the G ranks drop.

Two auxiliary losses (``functional.router_losses``: Switch/GShard's load balancing, E sum_e f_e
P_e, and ST-MoE's router z-loss), each kept with its coefficient applied, to add to the loss and
report.

Expert parallelism (``ep=``, a communicator): this rank builds only its experts, under their
global names, and the rows travel by ``parallel.experts.AllToAllDispatcher``.
"""

import math
from collections import namedtuple

import minipar.functional as F
from minipar.backend import to_numpy, xp
from minipar.functional.routing import sort_by_expert
from minipar.nn import Linear, Module, ModuleList, Parameter, normal_
from minipar.parallel import experts as ep_parallel

Routing = namedtuple("Routing", "indices weights probs logits")


def top_k(probs, k):
    """(N, k) expert indices of the k largest probabilities per row, largest first. A stable sort
    of -p keeps equal probabilities in expert order: the lowest index wins a tie."""
    return xp.argsort(-probs, axis=-1, kind="stable")[:, :k]


class Router(Module):
    """Logits x W_r^T (no bias), softmax over E, top-k, optionally renormalised weights.

    The softmax runs in the logits' dtype: float32 or float64, the only float dtypes of the
    engine; a narrower one is refused rather than rounded here (Switch computes the router in
    float32 for stability)."""

    def __init__(self, n_embd, n_experts, top_k, normalize=True):
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top-k must lie in [1, {n_experts}] (the number of experts), got {top_k}")
        self.n_experts, self.top_k, self.normalize = n_experts, top_k, normalize
        self.weight = Parameter(normal_((n_experts, n_embd), 0.02))

    def forward(self, x):
        """``x`` (N, h) -> Routing(indices (N, k) xp ints, weights (N, k) Tensor, probs (N, E)
        Tensor, logits (N, E) Tensor)."""
        logits = F.linear(x, self.weight)  # (N, E)
        if logits.dtype.itemsize < 4:
            raise TypeError(f"the router's softmax needs float32 or wider, got {logits.dtype}")
        probs = F.softmax(logits, axis=-1)  # (N, E)
        indices = top_k(probs.data, self.top_k)  # (N, k)
        weights = probs[xp.arange(len(indices))[:, None], indices]  # (N, k)
        if self.normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return Routing(indices, weights, probs, logits)


def capacity(capacity_factor, n_tokens, top_k, n_experts):
    """Token-slots each expert may take from ``n_tokens`` tokens: ceil(c N k / E)."""
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def capacity_keep(indices, slot_probs, n_experts, capacity_factor, groups=1):
    """(N, k) bool: which token-slots their experts take. Within each group of N/G consecutive
    tokens, expert e keeps its ``capacity`` slots of highest ``slot_probs`` (the router's p[e],
    not the renormalised weight); equal probabilities go by token order."""
    n, k = indices.shape
    if n % groups:
        raise ValueError(f"{n} tokens do not form {groups} equal capacity groups")
    limit = capacity(capacity_factor, n // groups, k, n_experts)
    expert, prob = indices.reshape(-1), slot_probs.reshape(-1)  # (N k,) by slot, token-major
    group = xp.arange(n * k) // (k * (n // groups))
    # stable sorts from the last key to the first: (group, expert, -probability, slot)
    order = xp.argsort(-prob, kind="stable")
    order = order[xp.argsort(expert[order], kind="stable")]
    order = order[xp.argsort(group[order], kind="stable")]
    run = group[order] * n_experts + expert[order]  # (N k,) one run per (group, expert)
    sizes = xp.bincount(run, minlength=groups * n_experts)
    place = xp.arange(n * k) - (xp.cumsum(sizes) - sizes)[run]  # rank of the slot within its run
    keep = xp.zeros(n * k, bool)
    keep[order] = place < limit
    return keep.reshape(n, k)


class Expert(Module):
    """One expert, the GPT's MLP: c_proj(gelu(c_fc(x))), c_fc (4h x h), c_proj (h x 4h)."""

    def __init__(self, n_embd, bias, proj_std):
        self.c_fc = Linear(n_embd, 4 * n_embd, bias)
        self.c_proj = Linear(4 * n_embd, n_embd, bias, std=proj_std)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class MoEMLP(Module):
    """The MoE layer in the place of a GPT block's MLP. ``config`` needs n_embd, bias, n_layer.

    After each forward: ``aux_loss`` and ``z_loss`` (Tensors, coefficients applied),
    ``tokens_per_expert`` (E,) host ints of the slots each expert took from this forward's tokens,
    and ``dropped``, the slots over capacity."""

    def __init__(self, config, n_experts, top_k, capacity_factor=None, normalize=True,
                 aux_loss_coeff=0.0, z_loss_coeff=0.0, groups=1, ep=None):
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"the capacity factor must be positive (or None: dropless), got {capacity_factor}")
        self.n_experts, self.top_k, self.capacity_factor, self.groups = n_experts, top_k, capacity_factor, groups
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.router = Router(config.n_embd, n_experts, top_k, normalize)
        mine = range(n_experts) if ep is None else ep_parallel.local_experts(n_experts, ep)
        std = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2's scaled init of residual projections
        # every expert drawn as on one device, the others' then dropped: the same generator calls
        # as the single-device model (as the TP layers cut whole weights), E/EP experts kept
        every = [Expert(config.n_embd, config.bias, std) for _ in range(n_experts)]
        self.experts = ModuleList([every[e] for e in mine], names=list(mine))
        self.dispatcher = None if ep is None else ep_parallel.AllToAllDispatcher(ep, n_experts)
        if ep is not None:
            for p in self.experts.parameters():
                p.placement = ep_parallel.EXPERT_PLACEMENT

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, h)
        route = self.router(x)
        keep = None
        if self.capacity_factor is not None:
            slot_probs = xp.take_along_axis(route.probs.data, route.indices, axis=-1)  # (N, k)
            keep = capacity_keep(route.indices, slot_probs, self.n_experts, self.capacity_factor, self.groups)
        slots, counts = sort_by_expert(route.indices, self.n_experts, keep)  # (S,), (E,)
        rows = F.permute(x, slots, self.top_k)  # (S, h) in one run per expert
        if self.dispatcher is None:
            out = self.apply_experts(rows, to_numpy(counts))
        else:
            local, local_counts = self.dispatcher.dispatch(rows, counts)
            out = self.dispatcher.combine(self.apply_experts(local, local_counts))
        y = F.unpermute(out, route.weights, slots)  # (N, h)
        self.tokens_per_expert = to_numpy(counts)
        self.dropped = int(route.indices.size - len(slots))
        self.aux_loss = F.load_balancing_loss(route.probs, route.indices, self.aux_loss_coeff)
        self.z_loss = F.z_loss(route.logits, self.z_loss_coeff)
        return y.reshape(shape)

    def apply_experts(self, rows, counts):
        """This rank's experts on ``rows`` (R, h), in consecutive runs of ``counts`` (host ints,
        one per local expert, any of them 0) -> (R, h)."""
        pieces = F.split(rows, [int(c) for c in counts], axis=0)
        return F.concat([expert(piece) for expert, piece in zip(self.experts, pieces)], axis=0)
