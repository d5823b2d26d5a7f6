"""Tensor-parallel layers (Shoeybi et al. 2019, Megatron-LM) and how their weights are split.

A linear layer Y = X A (our weights are stored transposed, W = A^T, shape (out, in)) can be split
two ways across the N ranks of a tensor-parallel group:

* ColumnParallelLinear splits A by columns (W by rows): rank r computes Y_r = X A_r, its own slice
  of the output features, from the whole input. Nothing to sum; the input must be the same on
  every rank, which f (``copy_to_region``) states: identity forward, all-reduce of dX backward.
* RowParallelLinear splits A by rows (W by columns): rank r multiplies its slice of the input
  features, X_r A_r, and the output is the *sum* over ranks, which g (``reduce_from_region``)
  computes: all-reduce forward, identity backward. The bias is added once, after the sum.

Column followed by row (attention: qkv then the output projection; the MLP: c_fc then c_proj) keeps
everything in between local, GeLU and attention included, so each pair costs one all-reduce forward
and one backward. With sequence parallelism (Korthikanti et al. 2022) f becomes an all-gather of
the sequence shards and g a reduce-scatter back into them.

Weights are initialised whole, from the same generator calls as the single-device model, and each
rank keeps its part, so a model built on any grid starts from the very same numbers.
"""


import minipar.functional as F
from minipar.backend import xp
from minipar.dtypes import get_default_dtype
from minipar.nn import Module, Parameter, normal_
from minipar.parallel.collectives import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    gather_tokens_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    reduce_scatter_tokens_to_sequence_region,
    scatter_to_region,
)
from minipar.placement import split_over


def sharded_parameter(full, comm, axis, chunks=1, padded=None):
    """A parameter holding this rank's part of ``full``, cut over the TP group ``comm``; its
    placement says how, for everything that later needs the whole tensor back."""
    placement = split_over("tp", axis, full.shape[axis], chunks, padded)
    return Parameter(placement.split.shard(full, comm.rank, comm.size), placement)


def _check_split(what, n, comm):
    if n % comm.size:  # every rank builds the same layer, so every rank raises, before any message
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {comm.size}: make it a "
                         f"multiple of {comm.size} or choose a tensor-parallel size that divides {n}")


def _check_rank_order(rank_order, sequence_parallel, gather_output=False):
    if rank_order and (not sequence_parallel or gather_output):
        raise ValueError("rank_order keeps a sequence-parallel layer's gathered tokens in rank order: it "
                         "needs sequence_parallel=True (and no gather_output)")


class ColumnParallelLinear(Module):
    """y = x W_r^T + b_r on every rank r: the output features split across ``comm``.

    ``chunks`` > 1 splits each of that many blocks of output rows separately: for the fused qkv
    projection (chunks=3) rank r holds q, k and v of the same heads. ``gather_output`` concatenates
    the slices (rarely wanted: the next layer is usually row-parallel). ``sequence_parallel``: the
    input is this rank's sequence shard, all-gathered on the way in; with ``rank_order`` the
    gathered tokens stay in rank order, (N, B, T/N, .), not sequence order: no copy, for a
    consumer that treats each token alone (the MLP, whose RowParallelLinear takes them so).
    """

    def __init__(self, in_features, out_features, comm, bias=True, std=0.02, chunks=1,
                 gather_output=False, sequence_parallel=False, rank_order=False):
        if out_features % chunks:
            raise ValueError(f"{out_features} output features do not form {chunks} equal blocks")
        _check_split("output features per chunk", out_features // chunks, comm)
        _check_rank_order(rank_order, sequence_parallel, gather_output)
        self.comm, self.gather_output, self.sequence_parallel = comm, gather_output, sequence_parallel
        self.rank_order = rank_order
        self.weight = sharded_parameter(normal_((out_features, in_features), std), comm, 0, chunks)
        self.bias = sharded_parameter(xp.zeros(out_features, get_default_dtype()), comm, 0, chunks) if bias else None

    def forward(self, x):
        if not self.sequence_parallel:
            x = copy_to_region(x, self.comm)
        else:
            x = (gather_tokens_from_sequence_region if self.rank_order else gather_from_sequence_region)(x, self.comm)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_region(y, self.comm) if self.gather_output else y


class RowParallelLinear(Module):
    """y = sum over ranks of x_r W_r^T, plus b once: the input features split across ``comm``.

    ``input_is_parallel=False`` slices a whole input first. With ``sequence_parallel`` the sum is
    reduce-scattered into sequence shards, and the bias (added to a shard) is one of the
    parameters whose gradient ``finalize_grads`` sums over the group; ``rank_order``: the input's
    tokens are in rank order, as ``ColumnParallelLinear(rank_order=True)`` leaves them.
    """

    def __init__(self, in_features, out_features, comm, bias=True, std=0.02, input_is_parallel=True,
                 sequence_parallel=False, rank_order=False):
        _check_split("input features", in_features, comm)
        _check_rank_order(rank_order, sequence_parallel)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("a sequence-parallel RowParallelLinear takes its input already split by "
                             "features (input_is_parallel=True), as the column-parallel layer leaves it")
        self.comm, self.input_is_parallel, self.sequence_parallel = comm, input_is_parallel, sequence_parallel
        self.rank_order = rank_order
        self.weight = sharded_parameter(normal_((out_features, in_features), std), comm, axis=1)
        self.bias = Parameter(xp.zeros(out_features, get_default_dtype())) if bias else None
        if bias and sequence_parallel:  # each rank adds it to its own positions only
            self.bias.placement = self.bias.placement.also(grad_sum="tp")

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.comm)
        partial = F.linear(x, self.weight)  # this op's own: summed in place (backward reads none of it)
        if not self.sequence_parallel:
            y = reduce_from_region(partial, self.comm, in_place=True)
        else:
            y = (reduce_scatter_tokens_to_sequence_region if self.rank_order
                 else reduce_scatter_to_sequence_region)(partial, self.comm)
        return y + self.bias if self.bias is not None else y


def padded_vocab(vocab_size, tp):
    """The vocabulary rounded up to a multiple of the TP size: GPT-2's 50257 = 29 x 1733 is odd, so a
    TP of 2, 4 or 8 does not divide it (Megatron pads it to a multiple of 128 x TP)."""
    return -(-vocab_size // tp) * tp


class VocabParallelEmbedding(Module):
    """The token embedding with its rows (the vocabulary) split across ``comm``.

    Rank r holds rows [r V/N, (r+1) V/N) of the padded table. It looks up the ids that fall in its
    range, writes zeros for the others, and the ranks' outputs are summed (all-reduce; with
    sequence parallelism, reduce-scatter into sequence shards): every id is found on exactly one
    rank. Padding rows are zeros that no id reaches and no logit uses.
    """

    def __init__(self, num_embeddings, dim, comm, std=0.02, sequence_parallel=False):
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.num_embeddings = num_embeddings
        padded = padded_vocab(num_embeddings, comm.size)
        self.per_rank = padded // comm.size
        self.start = comm.rank * self.per_rank
        self.weight = sharded_parameter(normal_((num_embeddings, dim), std), comm, 0, padded=padded)

    def forward(self, ids):
        ids = xp.asarray(ids)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            # every rank holds the same ids, so every rank raises here, before communicating
            raise IndexError(f"embedding ids must lie in [0, {self.num_embeddings}), "
                             f"got [{int(ids.min())}, {int(ids.max())}]")
        if self.sequence_parallel:
            # the ids in the reduce-scatter's rank order, (N, B, T/N): the rows are looked up where
            # it reads them, and the ids are copied instead of stacking a (B, T, C) activation
            if ids.ndim != 2:
                raise ValueError(f"a sequence-parallel embedding takes (batch, sequence) ids, got shape {ids.shape}")
            B, T = ids.shape
            if T % self.comm.size:
                raise ValueError(f"a sequence of {T} tokens does not split over {self.comm.size} "
                                 "sequence-parallel ranks: make the sequence length a multiple of the TP size")
            ids = ids.reshape(B, self.comm.size, T // self.comm.size).transpose(1, 0, 2)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        # the rows outside the slice zeroed in the lookup and the sum taken in place, as Megatron
        # does: the graph keeps one (B, T, C) array here, not the lookup, its masked copy and the sum
        out = F.embedding(xp.where(outside, 0, local), self.weight, skip=outside)
        if self.sequence_parallel:
            return reduce_scatter_tokens_to_sequence_region(out, self.comm)
        return reduce_from_region(out, self.comm, in_place=True)

    def logits(self, x):
        """The tied output head: this rank's vocabulary slice of x @ wte^T, (B, T, V/N)."""
        x = gather_from_sequence_region(x, self.comm) if self.sequence_parallel else copy_to_region(x, self.comm)
        return F.linear(x, self.weight)


def finalize_grads(model, comm):
    """Sum over ``comm`` the gradients that sequence parallelism leaves partial on each rank
    (LayerNorm weights and biases, row-parallel biases, position embeddings: each rank saw only its
    sequence shard: the parameters whose placement sums the gradient over "tp"), packed in one
    buffer so that it takes one all-reduce."""
    params = [p for p in model.parameters() if "tp" in p.placement.grad_sum and p.grad is not None]
    if not params or comm.size == 1:
        return
    if not hasattr(model, "_partial_grads_summed"):  # any backward makes the gradients partial again
        params[0].register_grad_hook(lambda _: setattr(model, "_partial_grads_summed", False))
    elif model._partial_grads_summed:
        raise RuntimeError("finalize_grads was already called since the last backward: call it once, "
                           "after the last backward of a step (summing twice makes them N times too big)")
    model._partial_grads_summed = True
    grads = [p.grad for p in params]
    flat = comm.all_reduce(xp.concatenate([g.reshape(-1) for g in grads]))
    offset = 0
    for g in grads:
        g[...] = flat[offset : offset + g.size].reshape(g.shape)
        offset += g.size


def local_shard(param, whole, grid):
    """This rank's part of ``whole``, the whole array of ``param`` (``whole`` itself if the
    parameter is not split)."""
    split = param.placement.split
    if split is None:
        return whole
    comm = grid.group(split.group)
    return split.shard(whole, comm.rank, comm.size)


def full_parameters(model, which="data"):
    """``{name: whole array}`` of every parameter (``which="grad"``: of every gradient), gathered
    from the parts (``model.grid`` names the groups); padding removed. A collective: every rank of
    the model must call it."""
    out = {}
    for name, p in model.named_parameters():
        value = p.data if which == "data" else p.grad
        if value is None:
            value = xp.zeros_like(p.data)
        split = p.placement.split
        if split is None:
            out[name] = value.copy()
        else:
            out[name] = split.unshard(model.grid.group(split.group).all_gather(xp.ascontiguousarray(value)))
    return out


def load_full_parameters(model, state):
    """Load a single-device state dict into a model on any grid: each rank keeps its part."""
    sharded = dict(state)
    for name, p in model.named_parameters():
        split = p.placement.split
        if split is None or name not in state:
            continue
        value = xp.asarray(getattr(state[name], "data", state[name]))  # an array or a Tensor, either device
        if value.shape != split.whole_shape(p.shape):
            raise ValueError(f"{name}: shape {value.shape}, the whole model has {split.whole_shape(p.shape)}")
        sharded[name] = local_shard(p, value, model.grid)
    model.load_state_dict(sharded)
