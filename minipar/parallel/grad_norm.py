"""The gradient norm of a model split across ranks (``DataParallelAdamW.clip_grad_norm`` clips by it).

Clipping scales every gradient by min(1, max_norm / ||g||), where ||g||^2 is the sum of the squared
gradients of every parameter of the single-device model. A rank holds only some of them, so each
rank adds up the squares of the copies it holds that are counted here (``placement.is_primary``,
the rule checkpoints write by), and the sums are added over the groups that hold different
parameters:

* data and context parallelism: after the all-reduce over DP x CP every rank holds the same dense
  gradients and adds up their whole norm itself; nothing to add.
* expert parallelism: an expert's gradient is summed over the ranks holding the same experts (the
  edp group), after which every one of them holds it whole and counts it; the ranks of an EP group
  hold different experts. The experts' squares are summed over the EP group, then added to the
  dense ones.
* tensor parallelism: a split weight adds its part's squares on every TP rank; a weight every TP
  rank holds whole (LayerNorm, a row-parallel bias, an expert: "tp" in its copies) is counted on
  TP rank 0 only. Sum over the TP group.
* pipeline parallelism: each stage holds different blocks. Sum over the PP group. The tied
  embedding's copy on the last stage ("embedding" in its copies) is the first stage's parameter
  again: not counted.

Every rank then has the same norm, and takes the same step as one device would.
"""

import math

from minipar.backend import sum_of_squares, xp
from minipar.placement import is_primary


def grad_norm(params, grid=None):
    """||g|| of the whole model from this rank's ``params`` (a collective over EP, TP and PP)."""
    return start_grad_norm(params, grid).wait()


def start_grad_norm(params, grid=None, grads=None):
    """``grad_norm``, its sum over the pipeline's stages started and not waited for: ``.wait()``
    returns the norm. The sums over EP and TP are taken at once (those ranks run the same stage in
    step); only the stages finish their backwards at different times. PipeDream-2BW starts this
    at the end of a batch and takes the norm when it updates, a batch later (``weight_stash.py``),
    so that no stage waits for another here. ``grads``: the gradients of ``params``, if not their
    ``.grad`` (2BW's copy of a batch's)."""
    # each DP x CP rank counts the dense weights, each edp rank its experts: all hold the sums
    ranks = dict(grid.ranks(), dp=0, cp=0, edp=0) if grid is not None else {}
    pairs = zip(params, grads if grads is not None else [p.grad for p in params])
    counted = [(p, g) for p, g in pairs if g is not None and is_primary(p.placement, ranks)]
    experts = xp.asarray([sum_of_squares([g for p, g in counted if "edp" in p.placement.grad_sum])])
    if grid is not None and grid.ep_group.size > 1:
        grid.ep_group.all_reduce(experts)
    dense = sum_of_squares([g for p, g in counted if "edp" not in p.placement.grad_sum])
    return _PendingNorm(dense + float(experts[0]), grid)


def norm_over_groups(local, grid, first=()):
    """The square root of ``local`` (this rank's sum of counted squares) summed over the groups
    ``first`` (ZeRO: the DP group, whose ranks hold different pieces), then over the grid's TP and
    PP groups: the norm every rank of the model then shares."""
    return _PendingNorm(local, grid, first).wait()


class _PendingNorm:
    """``local`` summed over ``first`` and TP at once, its sum over PP started: the same additions
    in the same order as summing all three at once."""

    def __init__(self, local, grid, first=()):
        self.total = xp.asarray([local])
        for group in tuple(first) + ((grid.tp_group,) if grid is not None else ()):
            if group is not None and group.size > 1:
                group.all_reduce(self.total)
        pp = grid.pp_group if grid is not None else None
        self.request = pp.iall_reduce(self.total) if pp is not None and pp.size > 1 else None

    def wait(self):
        if self.request is not None:
            self.total, self.request = self.request.wait(), None
        return math.sqrt(float(self.total[0]))
