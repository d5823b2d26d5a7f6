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

An all-reduce is a reduce-scatter followed by an all-gather, which is why sequence parallelism
moves the same bytes as the all-reduce it replaces.
"""

from minipar.autograd import Function
from minipar.backend import xp


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


def _slice(comm, x, axis):
    """This rank's slice of x along ``axis`` (a copy, so the caller may keep it)."""
    if x.shape[axis] % comm.size:
        raise ValueError(f"axis {axis} of length {x.shape[axis]} does not split over {comm.size} ranks")
    return xp.split(x, comm.size, axis=axis)[comm.rank].copy()


def _all_reduced(comm, x):
    out = x.copy()  # never reduce in place into an array someone else holds
    return comm.all_reduce(out)


class CopyToRegion(Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view()  # the same values; a new array object, no copy

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(ctx.comm, grad), None


class ReduceFromRegion(Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduced(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromRegion(Function):
    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return _gather(comm, x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _slice(ctx.comm, grad, ctx.axis), None, None


class ScatterToRegion(Function):
    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return _slice(comm, x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _gather(ctx.comm, grad, ctx.axis), None, None


class ReduceScatterToRegion(Function):
    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return _reduce_scatter(comm, x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _gather(ctx.comm, grad, ctx.axis), None, None


class AllGatherToReduceScatter(Function):
    """All-gather forward, reduce-scatter backward (sequence parallelism's entry)."""

    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return _gather(comm, x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(ctx.comm, grad, ctx.axis), None, None


def copy_to_region(x, comm):
    """Megatron's f: x enters a tensor-parallel region."""
    return CopyToRegion.apply(x, comm)


def reduce_from_region(x, comm):
    """Megatron's g: partial results leave a tensor-parallel region, summed."""
    return ReduceFromRegion.apply(x, comm)


def gather_from_region(x, comm):
    """Concatenate the ranks' slices along the last axis."""
    return GatherFromRegion.apply(x, comm, x.ndim - 1)


def scatter_to_region(x, comm):
    """Keep this rank's slice of the last axis."""
    return ScatterToRegion.apply(x, comm, x.ndim - 1)


SEQUENCE_AXIS = 1  # activations are (batch, sequence, hidden)


def _sequence_input(x, what):
    if x.ndim != 3:
        raise ValueError(f"{what} works on (batch, sequence, hidden) activations, got shape {x.shape}")
    return x


def gather_from_sequence_region(x, comm):
    """Sequence-parallel shards (B, T/N, C) -> the full sequence (B, T, C) on every rank."""
    return AllGatherToReduceScatter.apply(_sequence_input(x, "gather_from_sequence_region"), comm, SEQUENCE_AXIS)


def reduce_scatter_to_sequence_region(x, comm):
    """Partial sums (B, T, C) on every rank -> this rank's shard (B, T/N, C) of their sum."""
    return ReduceScatterToRegion.apply(_sequence_input(x, "reduce_scatter_to_sequence_region"), comm,
                                       SEQUENCE_AXIS)


def scatter_to_sequence_region(x, comm):
    """The full sequence -> this rank's shard; the backward all-gathers."""
    return ScatterToRegion.apply(_sequence_input(x, "scatter_to_sequence_region"), comm, SEQUENCE_AXIS)
