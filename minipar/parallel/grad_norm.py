"""The gradient norm of a model split across ranks, and clipping by it.

Clipping scales every gradient by min(1, max_norm / ||g||), where ||g||^2 is the sum of the squared
gradients of every parameter of the single-device model. A rank holds only some of them, so each
rank adds up the squares it holds that no other rank of its model copy counts, and the sums are
added over the groups that hold different parameters:

* tensor parallelism: a split weight (one with a ``partition``) adds its shard's squares on every
  TP rank; a weight every TP rank holds whole (LayerNorm, a row-parallel bias) is counted on TP
  rank 0 only. Sum over the TP group.
* pipeline parallelism: each stage holds different blocks. Sum over the PP group. The tied
  embedding's second copy on the last stage (``pipeline_copy``) is the first stage's parameter
  again: not counted.
* data parallelism: after the all-reduce every replica holds the same gradients; nothing to add.

Every rank then has the same norm, and takes the same step as one device would.
"""

import math

from minipar import optim
from minipar.backend import sum_of_squares, xp


def grad_norm(params, grid=None):
    """||g|| of the whole model from this rank's ``params`` (a collective over TP and PP)."""
    tp_rank = grid.tp_rank if grid is not None else 0
    local = sum_of_squares([p.grad for p in params if p.grad is not None and not getattr(p, "pipeline_copy", False)
                            and (tp_rank == 0 or hasattr(p, "partition"))])
    total = xp.asarray([local])
    for group in (grid.tp_group, grid.pp_group) if grid is not None else ():
        if group is not None and group.size > 1:
            group.all_reduce(total)
    return math.sqrt(float(total[0]))


def clip_grad_norm(params, max_norm, grid=None):
    """Clip by the whole model's gradient norm; returns the norm before clipping."""
    return optim.clip_grad_norm(params, max_norm, norm=grad_norm(params, grid))
