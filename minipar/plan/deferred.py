"""The bubble of a pipeline whose last stage leaves weight gradients for the flush, by replaying the
schedule's own instruction lists with each chunk costing its training FLOPs.

``--defer-embedding-wgrad-compute`` takes the head's weight gradient out of each of the last
stage's backwards and runs them all at the flush (``schedules.defer_head_weight``);
``--defer-wgrad-linears K`` takes the W's of its last K linear layers there too. The last stage is
the heavy one (it runs the head), so its steady state sets the pipeline's pace; its backwards
shortened, the others wait less, and the W's it left run while the last gradients travel down the
other stages. The unit model (``bubble.pipeline``: every chunk alike) cannot see any of this, and
``cost.stage_imbalance``'s busiest-over-mean is the wrong correction once work has moved out of
the steady state, so a deferring layout is replayed with its chunks' own costs, the imbalance
inside the replay: (makespan - a rank's work) / makespan, averaged over the ranks as ever.

The costs, per token: a chunk's forward a third of its training FLOPs (its blocks', the last
chunk's head's 6 V h), its backward two thirds, plus a block's forward under full recomputation
(not the head's: it is not recomputed); deferred, the head's W (2 V h) and each deferred linear
layer's (2 x its weights) leave the last chunk's backward for its ``head_weight`` instructions.
Counted in thirds of a FLOP, every cost is an integer, which the replay adds fast.
"""

from fractions import Fraction
from functools import lru_cache

from minipar.mfu import flops_per_token
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.instructions import Pipeline
from minipar.parallel.pipeline.simulate import simulate

W_FLOPS = (8, 8, 2, 6)  # a token's weight-gradient FLOPs / h^2 of a block's linear layers, from the MLP's c_proj back


def deferred_w_flops(h, vocab_size, k):
    """A token's FLOPs that a deferred head leaves for the flush: the head's W (2 V h, a third of its
    6 V h) and the W's of the last k linear layers (2 x each one's weights)."""
    return 2 * vocab_size * h + sum(W_FLOPS[i % 4] for i in range(k)) * h * h


def chunk_costs(model, pp, m, schedule="1f1b", vpp=1, layers=None, recompute=False):
    """(forward, backward, last): {(rank, local chunk): cost in thirds of a FLOP a token} and
    {(rank, local chunk): whether it is the model's last chunk}. ``layers``: each global chunk's
    (an even split when None)."""
    h, T, n = model.hidden_size, model.seq_length, pp * vpp
    counts = list(layers) if layers else [model.num_layers // n] * n
    ends = [sum(counts[:g + 1]) for g in range(n)]
    blocks = [sum(flops_per_token(1, h, T, 0, int(model.is_moe(i)), model.moe_router_topk, model.num_experts)
                  for i in range(end - c, end)) for end, c in zip(ends, counts)]  # each chunk's, a token
    head = flops_per_token(0, h, T, model.vocab_size)
    pipe = Pipeline(pp, m, vpp, schedules.shape_of(schedule))
    last = {(r, c): pipe.global_chunk(r, c) == n - 1 for r in range(pp) for c in range(vpp)}
    forward = {k: blocks[pipe.global_chunk(*k)] + head * is_last for k, is_last in last.items()}
    backward = {k: 2 * f + recompute * blocks[pipe.global_chunk(*k)] for k, f in forward.items()}
    return forward, backward, last


@lru_cache(maxsize=1024)  # (a layout's and its ZeRO stages' and DP sizes' predictions ask the same)
def bubble(model, pp, m, schedule="1f1b", vpp=1, layers=None, recompute=False, k=0):
    """The mean idle fraction of the ranks when the last chunk's head W and its last ``k`` linear
    layers' W's run at the flush (module docstring); raises as ``schedules.build`` does for a
    schedule that cannot defer them."""
    plans, (forward, backward, last) = _replayed(model, pp, m, schedule, vpp, layers, recompute)
    deferred = 3 * deferred_w_flops(model.hidden_size, model.vocab_size, k)
    sim = simulate(plans, m, vpp, forward=forward, backward=backward, shape=schedules.shape_of(schedule),
                   head={key: deferred * is_last for key, is_last in last.items()})
    return Fraction(sum(sim.bubble.values()), pp)


@lru_cache(maxsize=64)  # the same for every K (``hetero.balanced_linears`` tries up to 17); read, not changed
def _replayed(model, pp, m, schedule, vpp, layers, recompute):
    """(the schedule's instruction lists with the head's W's at the flush, ``chunk_costs``)."""
    return (schedules.build(schedule, pp, m, vpp, defer_head=True),
            chunk_costs(model, pp, m, schedule, vpp, layers, recompute))
