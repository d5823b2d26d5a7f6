"""A mixture-of-experts MLP: a router, E experts shaped like the GPT's MLP, the balancing losses.

Each token x goes to k of E experts (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch
Transformer, Fedus et al. 2021):

    p = softmax(x W_r^T)                      router probabilities, (N, E)
    top-k experts e_1..e_k of p               ties: the lowest expert index wins
    w_j = p[e_j]  (/ sum_i p[e_i] if normalize)
    y = sum_j w_j expert_{e_j}(x)

The weights are renormalised over the k chosen experts by default when k > 1 (Megatron-core's
softmax over the top-k, Mixtral); with k = 1 that weight would always be 1 and the router would
learn from the balancing loss alone, so k = 1 keeps p[e_1] (Switch). ``normalize=False`` keeps p[e_j]
for any k (Megatron-core's ``--moe-router-pre-softmax``).

Capacity (GShard, Switch): with a capacity factor c, expert e takes at most ceil(c N k / E) of the
token-slots routed to it, those with the highest router probability p[e] (ties: token order); a
dropped slot adds 0, and the block's residual connection carries its token unchanged. Without c
the layer is dropless.

Routing groups. A parallel run routes each rank's tokens of each micro-batch on their own: each
such group has its own capacity ceil(c N_g k / E) and its own balancing loss (the step's is their
mean). ``RoutingGroups`` tells a single-device model which tokens a parallel layout routes
together, so that one device drops exactly the slots the ranks drop and computes their loss.

Two auxiliary losses (``functional.router_losses``: Switch/GShard's load balancing, E sum_e f_e
P_e, and ST-MoE's router z-loss), each with its coefficient applied, join the training loss by
``attach_loss`` (each forward's share of the step's: its tokens / the step's tokens, as the
training loss's micro-batch shares) and are reported through ``MoEStep``.

Expert parallelism (``ep=``, a communicator): this rank builds only its experts, under their
global names, and the rows travel by ``parallel.experts.AllToAllDispatcher``.
"""

import math
from collections import namedtuple
from dataclasses import dataclass

import numpy

import minipar.functional as F
from minipar.backend import to_numpy, xp
from minipar.dtypes import is_16bit
from minipar.functional.router_losses import equal_groups
from minipar.functional.routing import sort_by_expert
from minipar.nn import Linear, Module, ModuleList, Parameter, normal_
from minipar.parallel import experts as ep_parallel
from minipar.parallel.recompute import recomputing

Routing = namedtuple("Routing", "indices weights probs logits")


def top_k(probs, k):
    """(N, k) expert indices of the k largest probabilities per row, largest first. A stable sort
    of -p keeps equal probabilities in expert order: the lowest index wins a tie."""
    return xp.argsort(-probs, axis=-1, kind="stable")[:, :k]


class Router(Module):
    """Logits x W_r^T (no bias), softmax over E, top-k, optionally renormalised weights.

    The router runs in float32 or wider: a 16-bit model's tokens and router weight are cast to
    float32 first (Switch and Megatron compute the router in float32: a softmax over experts and
    a top-k of bf16 probabilities would tie and flip on rounding)."""

    def __init__(self, n_embd, n_experts, top_k, normalize=None):
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top-k must lie in [1, {n_experts}] (the number of experts), got {top_k}")
        self.n_experts, self.top_k = n_experts, top_k
        self.normalize = top_k > 1 if normalize is None else bool(normalize)
        self.weight = Parameter(normal_((n_experts, n_embd), 0.02))

    def forward(self, x):
        """``x`` (N, h) -> Routing(indices (N, k) xp ints, weights (N, k) Tensor, probs (N, E)
        Tensor, logits (N, E) Tensor)."""
        if is_16bit(x.dtype):
            x, weight = F.cast(x, "float32"), F.cast(self.weight, "float32")
        else:
            weight = self.weight
        logits = F.linear(x, weight)  # (N, E)
        probs = F.softmax(logits, axis=-1)  # (N, E)
        indices = top_k(probs.data, self.top_k)  # (N, k)
        weights = probs[xp.arange(len(indices))[:, None], indices]  # (N, k)
        if self.normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return Routing(indices, weights, probs, logits)


def capacity(capacity_factor, n_tokens, top_k, n_experts):
    """Token-slots each expert may take from ``n_tokens`` tokens: ceil(c N k / E). A factor such as
    1.1 is no binary fraction, and c N k / E a hair above a whole number (1.1 x 100 / 10 is
    11.000000000000002) would take one slot more: the quotient is rounded to 9 decimals first."""
    return math.ceil(round(capacity_factor * n_tokens * top_k / n_experts, 9))


def capacity_keep(indices, slot_probs, n_experts, capacity_factor, group_ids=None):
    """(N, k) bool: which token-slots their experts take. Within each routing group (``group_ids``
    (N,), equal groups; None: one), expert e keeps its ``capacity`` slots of highest ``slot_probs``
    (the router's p[e], not the renormalised weight); equal probabilities go by token order."""
    n, k = indices.shape
    ids, groups, per_group = equal_groups(group_ids, n)
    limit = capacity(capacity_factor, per_group, k, n_experts)
    expert, prob = indices.reshape(-1), slot_probs.reshape(-1)  # (N k,) by slot, token-major
    group = xp.repeat(ids, k)
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


@dataclass(frozen=True)
class RoutingGroups:
    """The tokens a parallel run routes together, for a single-device model to route the same:
    ``rows`` sequences per forward on one rank (a micro-batch's rows / DP); ``cp`` context-parallel
    ranks, rank r holding chunks r and 2CP-1-r of every sequence; ``sp`` sequence-parallel ranks,
    each holding a consecutive part of those positions."""

    rows: int
    cp: int = 1
    sp: int = 1

    def ids(self, rows, positions):
        """(B T,) group of each token of global ``rows`` (B,) x ``positions`` (T,), row-major,
        numbered 0..G-1 in order of appearance."""
        rows, positions = xp.asarray(rows), xp.asarray(positions)
        per_position = xp.zeros(len(positions), xp.int64)
        if self.cp * self.sp > 1:
            # a CP rank's positions: chunks r and 2CP-1-r of 2CP; without CP the whole sequence (not
            # cut in two chunks, so SP alone accepts any length SP divides, odd ones too)
            chunks = 2 * self.cp if self.cp > 1 else 1
            chunk_len = len(positions) // chunks
            if chunk_len * chunks != len(positions) or (len(positions) // self.cp) % self.sp:
                raise ValueError(f"{len(positions)} positions do not cut into CP={self.cp} x SP={self.sp} parts")
            chunk = positions // chunk_len
            second = chunk >= self.cp  # the rank's later chunk, 2CP-1-r (never without CP)
            cp_rank = xp.where(second, 2 * self.cp - 1 - chunk, chunk)
            local = positions - chunk * chunk_len + second * chunk_len  # index among the rank's positions
            per_position = cp_rank * self.sp + local // (len(positions) // self.cp // self.sp)
        ids = (rows // self.rows)[:, None] * (self.cp * self.sp) + per_position[None, :]
        return xp.unique(ids.reshape(-1), return_inverse=True)[1].reshape(-1)


class MoEStep:
    """What a model's MoE layers share over a training step: the step's token count (each
    forward's auxiliary losses count as its share of them: its tokens / ``tokens``; None: every
    forward is a whole step) and what routing did, per layer, summed over the step's forwards:
    ``loads`` slots each expert took, ``dropped`` slots, ``aux`` and ``z`` the losses (scaled by
    their shares). A recomputed forward (in backward) is not counted again. ``loss_scale``: what
    the step's loss is multiplied by before backward (fp16's loss scale, set by the trainer; 1
    otherwise), which the auxiliary losses' gradients must carry too (Megatron's
    ``MoEAuxLossAutoScaler.set_loss_scale``).

    A forward counts to the step of its dropout iteration: PipeDream-2BW runs the next batch's
    first forwards during this step, and what they route is held ``ahead`` until that step starts."""

    def __init__(self):
        self.tokens, self.loss_scale = None, 1.0
        self.ahead = {}  # dropout iteration -> its (loads, dropped, aux, z), recorded before its step
        self.reset()

    def reset(self, iteration=None):
        """Start the step of dropout iteration ``iteration`` (None: count every forward to it), with
        what its forwards recorded ahead."""
        self.iteration = iteration
        early = self.ahead.pop(iteration, None) if iteration is not None else None
        self.ahead = {i: tables for i, tables in self.ahead.items() if iteration is not None and i > iteration}
        self.loads, self.dropped, self.aux, self.z = early or ({}, {}, {}, {})

    def share(self, n_tokens):
        return 1.0 if self.tokens is None else n_tokens / self.tokens

    def record(self, layer, loads, dropped, aux, z, iteration=None):
        """Add a forward's routing of ``layer``, made in dropout iteration ``iteration``."""
        if iteration is None or self.iteration is None or iteration == self.iteration:
            tables = self.loads, self.dropped, self.aux, self.z
        else:
            tables = self.ahead.setdefault(iteration, ({}, {}, {}, {}))
        for table, value in zip(tables, (loads, dropped, aux, z)):
            table[layer] = table.get(layer, 0) + value


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
    and ``dropped``, the slots over capacity. ``routing``: a ``RoutingGroups`` (a single-device
    reference of a parallel run), whose rows and positions come from ``rng`` (the model's
    DropoutRNG; without one, the input's own). ``step``: the model's ``MoEStep``; ``layer`` the
    key this layer's statistics are recorded under; ``dropout``: a module run on the output."""

    def __init__(self, config, n_experts, top_k, capacity_factor=None, normalize=None, aux_loss_coeff=0.0,
                 z_loss_coeff=0.0, routing=None, ep=None, rng=None, step=None, layer=0, dropout=None):
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"the capacity factor must be positive (or None: dropless), got {capacity_factor}")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.routing, self.rng, self.step, self.layer, self.dropout = routing, rng, step, layer, dropout
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

    def group_ids(self, shape):
        """The routing group of each of the input's tokens (None: they are one group)."""
        if self.routing is None:
            return None
        batch, length = shape[0], (shape[1] if len(shape) > 2 else 1)
        rows, positions = self.rng.where(batch, length) if self.rng is not None else (xp.arange(batch), xp.arange(length))
        return self.routing.ids(rows, positions)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, h)
        route = self.router(x)
        keep, ids = None, self.group_ids(shape)
        if self.capacity_factor is not None:
            slot_probs = xp.take_along_axis(route.probs.data, route.indices, axis=-1)  # (N, k)
            keep = capacity_keep(route.indices, slot_probs, self.n_experts, self.capacity_factor, ids)
        slots, counts = sort_by_expert(route.indices, self.n_experts, keep)  # (S,), (E,)
        self.tokens_per_expert = to_numpy(counts)  # on the host once: the runs' lengths, the counts sent
        rows = F.permute(x, slots, self.top_k)  # (S, h) in one run per expert
        if self.dispatcher is None:
            out = self.apply_experts(rows, self.tokens_per_expert)
        else:
            local, local_counts = self.dispatcher.dispatch(rows, self.tokens_per_expert)
            out = self.dispatcher.combine(self.apply_experts(local, local_counts))
        y = F.unpermute(out, F.cast(route.weights, out.dtype), slots)  # (N, h), in the model's dtype
        self.dropped = int(route.indices.size - len(slots))
        self.aux_loss = F.load_balancing_loss(route.probs, route.indices, self.aux_loss_coeff, ids)
        self.z_loss = F.z_loss(route.logits, self.z_loss_coeff)
        share = self.step.share(len(x)) if self.step is not None else 1.0
        if self.aux_loss_coeff or self.z_loss_coeff:  # the training loss's gradient reaches them
            scale = share * (self.step.loss_scale if self.step is not None else 1.0)
            y = F.attach_loss(y, self.aux_loss + self.z_loss, scale)
        if self.step is not None and self.training and not recomputing():
            self.step.record(self.layer, self.tokens_per_expert.astype(numpy.int64), self.dropped,
                             share * self.aux_loss.item(), share * self.z_loss.item(),
                             self.rng.iteration if self.rng is not None else None)
        y = y.reshape(shape)
        return self.dropout(y) if self.dropout is not None else y

    def apply_experts(self, rows, counts):
        """This rank's experts on ``rows`` (R, h), in consecutive runs of ``counts`` (host ints,
        one per local expert, any of them 0) -> (R, h)."""
        pieces = F.split(rows, [int(c) for c in counts], axis=0)
        return F.concat([expert(piece) for expert, piece in zip(self.experts, pieces)], axis=0)


def step_statistics(model, world=None):
    """The routing of the step just run, over every rank of ``world`` (a collective; None: this
    model alone): {"layers"
    (the MoE blocks), "tokens_per_expert" (L, E), "dropped" (L,) slots, "aux_loss" and "z_loss"
    (their sums over the layers, as the step's loss holds them)}. Ranks that route the same tokens
    (TP ranks without sequence parallelism) are counted once."""
    config, step = model.config, model.moe
    layers = [i for i in range(config.n_layer) if config.is_moe(i)]
    E = config.num_experts
    table = numpy.zeros((len(layers), E + 3))  # per layer: loads, dropped, aux, z
    for row, layer in enumerate(layers):
        if layer in step.loads:
            table[row] = [*step.loads[layer], step.dropped[layer], step.aux[layer], step.z[layer]]
    repeated = model.tp is not None and not model.sequence_parallel and model.tp.rank > 0
    table *= 0.0 if repeated else 1.0
    total = world.all_reduce(table) if world is not None else table
    return {"layers": layers, "tokens_per_expert": total[:, :E].round().astype(numpy.int64),
            "dropped": total[:, E].round().astype(numpy.int64),
            "aux_loss": float(total[:, E + 1].sum()), "z_loss": float(total[:, E + 2].sum())}
