"""Collectives that autograd can differentiate: the entry and exit of model-parallel regions.

Megatron-LM (Shoeybi et al. 2019) splits a layer's matrices across a tensor-parallel group. Where
the replicated activation enters the split region and where partial results leave it, it puts a
pair of conjugate ops, each the other's backward:

    copy_to_region       f: identity forward,  all-reduce backward
    reduce_from_region   g: all-reduce forward, identity backward

because if y = f(x) is used by every rank, dL/dx is the sum over ranks of each rank's dL/dy, and
if y = g(x) = sum of the ranks' x, each rank's dL/dx is dL/dy itself. The same reasoning pairs

    gather_from_region   all-gather along the last axis / keep this rank's slice of the gradient
    scatter_to_region    keep this rank's slice / all-gather the gradient

and, for sequence parallelism (Korthikanti et al. 2022), along the sequence axis of (B, T, C):

    gather_from_sequence_region          all-gather / reduce-scatter
    reduce_scatter_to_sequence_region    reduce-scatter / all-gather
    scatter_to_sequence_region           keep this rank's slice / all-gather

Our activations are (B, T, C), so a sequence shard, positions r T/N .. (r+1) T/N of every
sequence, is not one block of the whole: an all-gather leaves the shards stacked, (N, B, T/N, C),
and putting them in sequence order is a copy of the whole activation, as is cutting a whole one
into the stack a reduce-scatter takes (Megatron's activations are [s, b, h], so its shards are
blocks and neither copy exists). Between the MLP's two linear layers nothing cares where a token
sits (two products and GELU, each token alone), nor in the embedding's lookup (whose ids can be
put in the stack's order instead), so there the tokens stay in the stack's order:

    gather_tokens_from_sequence_region        all-gather / reduce-scatter, in rank order
    reduce_scatter_tokens_to_sequence_region  reduce-scatter / all-gather, in rank order

An all-reduce is a reduce-scatter followed by an all-gather, which is why sequence parallelism
moves the same bytes as the all-reduce it replaces.

DeepSpeed-Ulysses (Jacobs et al. 2023) trades a sequence shard for a head shard with

    all_to_all           all-to-all along axis 0 / all-to-all

its own conjugate: rank r's chunk j becomes rank j's chunk r, a transpose of the (rank, chunk)
matrix, so sending the gradients back the same way undoes it.
"""

from minipar.autograd import Function
from minipar.backend import xp


def _identity(comm, x, axis):
    return x.view()  # the same values in a new array object: no copy


def _all_reduce(comm, x, axis):
    return comm.all_reduce(x.copy())  # never reduce in place into an array someone else holds


def _all_reduce_in_place(comm, x, axis):
    return comm.all_reduce(x)


def _gather(comm, x, axis):
    """All ranks' x concatenated along ``axis`` in rank order."""
    stacked = comm.all_gather(xp.ascontiguousarray(x))  # (N, *x.shape)
    return xp.concatenate(list(stacked), axis=axis)


def _reduce_scatter(comm, x, axis):
    """The sum over ranks of x, keeping this rank's slice along ``axis``."""
    if x.shape[axis] % comm.size:
        raise ValueError(f"axis {axis} of length {x.shape[axis]} does not split over {comm.size} ranks")
    chunks = xp.stack(xp.split(x, comm.size, axis=axis))  # chunk r goes to rank r
    return comm.reduce_scatter(chunks)[0]


def _gather_ranks(comm, x, axis):
    """All ranks' x stacked along a new axis 0 in rank order: the all-gather's own layout."""
    return comm.all_gather(xp.ascontiguousarray(x))


def _reduce_scatter_ranks(comm, x, axis):
    """For rank r, the sum over ranks of x[r] (x stacked by rank along axis 0)."""
    return comm.reduce_scatter(xp.ascontiguousarray(x))[0]


def _slice(comm, x, axis):
    """This rank's slice of x along ``axis`` (a copy, so the caller may keep it)."""
    if x.shape[axis] % comm.size:
        raise ValueError(f"axis {axis} of length {x.shape[axis]} does not split over {comm.size} ranks")
    return xp.split(x, comm.size, axis=axis)[comm.rank].copy()


def _all_to_all(comm, x, axis):
    return comm.all_to_all(xp.ascontiguousarray(x))


class RegionCollective(Function):
    """A collective whose backward is its conjugate: ``forward(comm, x, axis)`` on the way in,
    ``backward(comm, grad, axis)`` on the way back. Every op of this module is one such pair."""

    @staticmethod
    def forward(ctx, x, comm, axis, forward, backward):
        ctx.comm, ctx.axis, ctx.conjugate = comm, axis, backward
        return forward(comm, x, axis)

    @staticmethod
    def backward(ctx, grad):
        return ctx.conjugate(ctx.comm, grad, ctx.axis), None, None, None, None


def copy_to_region(x, comm):
    """Megatron's f: x enters a tensor-parallel region (identity / all-reduce)."""
    return RegionCollective.apply(x, comm, None, _identity, _all_reduce)


def reduce_from_region(x, comm, in_place=False):
    """Megatron's g: partial results leave a tensor-parallel region, summed (all-reduce / identity).
    ``in_place``: x is the caller's own, read by nothing after this (its backward does not read
    it): the sum overwrites it where the communicator can, and the graph keeps one array."""
    return RegionCollective.apply(x, comm, None, _all_reduce_in_place if in_place else _all_reduce, _identity)


def gather_from_region(x, comm):
    """Concatenate the ranks' slices along the last axis (all-gather / keep own slice)."""
    return RegionCollective.apply(x, comm, x.ndim - 1, _gather, _slice)


def scatter_to_region(x, comm):
    """Keep this rank's slice of the last axis (keep own slice / all-gather)."""
    return RegionCollective.apply(x, comm, x.ndim - 1, _slice, _gather)


SEQUENCE_AXIS = 1  # activations are (batch, sequence, hidden)


def _sequence_input(x, what):
    if x.ndim != 3:
        raise ValueError(f"{what} works on (batch, sequence, hidden) activations, got shape {x.shape}")
    return x


def gather_from_sequence_region(x, comm):
    """Sequence-parallel shards (B, T/N, C) -> the full sequence (B, T, C) on every rank."""
    x = _sequence_input(x, "gather_from_sequence_region")
    return RegionCollective.apply(x, comm, SEQUENCE_AXIS, _gather, _reduce_scatter)


def reduce_scatter_to_sequence_region(x, comm):
    """Partial sums (B, T, C) on every rank -> this rank's shard (B, T/N, C) of their sum."""
    x = _sequence_input(x, "reduce_scatter_to_sequence_region")
    return RegionCollective.apply(x, comm, SEQUENCE_AXIS, _reduce_scatter, _gather)


def scatter_to_sequence_region(x, comm):
    """The full sequence -> this rank's shard; the backward all-gathers."""
    x = _sequence_input(x, "scatter_to_sequence_region")
    return RegionCollective.apply(x, comm, SEQUENCE_AXIS, _slice, _gather)


def gather_tokens_from_sequence_region(x, comm):
    """Sequence-parallel shards (B, T/N, C) -> every rank's tokens, (N, B, T/N, C) in rank order,
    for ops that treat each token alone: ``gather_from_sequence_region`` without its copy."""
    x = _sequence_input(x, "gather_tokens_from_sequence_region")
    return RegionCollective.apply(x, comm, 0, _gather_ranks, _reduce_scatter_ranks)


def reduce_scatter_tokens_to_sequence_region(x, comm):
    """Partial sums (N, B, T/N, C) in rank order, as ``gather_tokens_from_sequence_region``
    leaves the tokens -> this rank's shard (B, T/N, C) of their sum."""
    if x.ndim != 4 or x.shape[0] != comm.size:
        raise ValueError(f"reduce_scatter_tokens_to_sequence_region takes (N, batch, sequence / N, hidden) "
                         f"in rank order, N = {comm.size}, got shape {x.shape}")
    return RegionCollective.apply(x, comm, 0, _reduce_scatter_ranks, _gather_ranks)


def all_to_all(x, comm):
    """Chunk i of axis 0 goes to rank i, and this rank's chunk j comes from rank j (all-to-all /
    all-to-all)."""
    if x.ndim == 0 or x.shape[0] % comm.size:
        raise ValueError(f"all_to_all: axis 0 of shape {x.shape} does not split over {comm.size} ranks")
    return RegionCollective.apply(x, comm, 0, _all_to_all, _all_to_all)
