"""Expert parallelism: the experts spread over an EP group, tokens sent to them and back.

Rank r of an EP group of size EP holds experts r E/EP ... (r+1) E/EP - 1, whole. Each rank routes
its own tokens and permutes them by expert (``functional.routing``); since a rank's experts are
consecutive, sorted by expert is sorted by destination rank. Megatron-core's all-to-all token
dispatcher then:

    dispatch   1. all-to-all of the counts: every rank learns how many rows each rank sends to
                  each of its experts, (EP, E/EP) numbers
               2. all-to-all-v of the rows (uneven sizes; any may be 0); they arrive by source
                  rank, then by local expert
               3. sort the chunks by local expert, so each local expert's rows are one run
    combine    the inverse of 3, then the inverse all-to-all-v: every output row back to the rank
               and the place its token-slot came from; the router's weights are applied there,
               on the token's home rank (``functional.routing.unpermute``)

The all-to-all-v is an autograd op whose backward is the exchange with the counts swapped, so
the gradients travel the same paths in reverse. Bytes sent per rank and layer, forward: the rows
it routes to experts on other ranks, h x itemsize each, once in dispatch; in combine it sends back
the rows it received; backward the same again.

Where the experts' parameters live (``EXPERT_PLACEMENT``): each is a whole tensor under its own
global name (``experts.<e>.c_fc.weight``), so it is *not* a ``Split`` of one stacked tensor. Its
copies are on the ranks that hold the same experts: the expert-data-parallel group "edp" (the DP x
CP ranks with the same EP index; EP is carved out of DP x CP, Megatron-core's rule, so the CP ranks
of a sequence may hold other experts and "cp" is not among the copies), and its gradient is summed
over "edp" alone, where a dense parameter's is summed over all of "dp": an expert on one EP rank
already received the rows of every rank of its EP group. The optimizers read that from the
placement (``protocol.gradient_group``): the sums, broadcasts and ZeRO-1's shards of experts are
over the edp group.
"""

import numpy

import minipar.functional as F
from minipar.autograd import Function
from minipar.backend import to_numpy, xp
from minipar.placement import Placement

EXPERT_PLACEMENT = Placement(copies=("tp", "edp"), grad_sum=("edp",))


def local_experts(n_experts, group):
    """The experts rank ``group.rank`` holds: a range of E/EP consecutive expert indices."""
    if n_experts % group.size:
        raise ValueError(f"{n_experts} experts do not split evenly over an expert-parallel group of {group.size}")
    n = n_experts // group.size
    return range(group.rank * n, (group.rank + 1) * n)


class AllToAllV(Function):
    """Rows in runs of ``send`` counts to each rank; ``recv`` counts arrive. Backward: the same
    exchange with the counts swapped."""

    @staticmethod
    def forward(ctx, x, group, send, recv):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return group.all_to_all_v(xp.ascontiguousarray(x), send, recv)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_to_all_v(xp.ascontiguousarray(grad), ctx.recv, ctx.send), None, None, None


def all_to_all_v(x, group, send_counts, recv_counts):
    return AllToAllV.apply(x, group, [int(c) for c in send_counts], [int(c) for c in recv_counts])


def expert_major(counts):
    """Row order that turns runs of (source rank s, local expert j), s-major, into j-major:
    ``counts`` (EP, E_local) host integers -> (R,) indices into the received rows."""
    starts = (numpy.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(counts.shape)  # (EP, E_local)
    runs = [numpy.arange(starts[s, j], starts[s, j] + counts[s, j])
            for j in range(counts.shape[1]) for s in range(counts.shape[0])]
    return numpy.concatenate(runs).astype(numpy.int64) if runs else numpy.zeros(0, numpy.int64)


def inverse(order):
    """The permutation that undoes ``order``: inverse[order[i]] = i."""
    out = numpy.empty_like(order)
    out[order] = numpy.arange(len(order))
    return out


class AllToAllDispatcher:
    """Dispatch and combine over the EP communicator ``group`` for ``n_experts`` experts (see the
    module docstring). ``dispatch`` keeps what ``combine`` needs to send every row back."""

    def __init__(self, group, n_experts):
        self.group, self.n_experts = group, n_experts
        self.n_local = len(local_experts(n_experts, group))

    def dispatch(self, x, tokens_per_expert):
        """``x`` (S, h): this rank's token-slots sorted by expert, ``tokens_per_expert`` (E,) of
        them per expert -> (this rank's experts' rows (R, h) in one run per local expert, the
        runs' lengths (E_local,) as host integers)."""
        to_each = to_numpy(tokens_per_expert).astype(numpy.int64).reshape(self.group.size, self.n_local)
        # row s of ``from_each``: how many rows rank s sends to each of this rank's experts
        from_each = self.group.all_to_all(numpy.ascontiguousarray(to_each))  # (EP, E_local)
        self.send, self.recv = to_each.sum(axis=1), from_each.sum(axis=1)  # (EP,) rows per peer
        received = all_to_all_v(x, self.group, self.send, self.recv)  # (R, h) by source, then expert
        self.order = expert_major(from_each)
        return F.permute(received, self.order), from_each.sum(axis=0)

    def combine(self, y):
        """The local experts' outputs ``y`` (R, h), in dispatch's order, back to the ranks and the
        places their slots came from -> (S, h) in the order ``dispatch`` was given."""
        by_source = F.permute(y, inverse(self.order))  # (R, h) by source rank, then expert
        return all_to_all_v(by_source, self.group, self.recv, self.send)


__all__ = ["EXPERT_PLACEMENT", "local_experts", "all_to_all_v", "AllToAllDispatcher"]
