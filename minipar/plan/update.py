"""What a step does after its backward: the gradient norm for clipping and AdamW's update.

Every step of the trainer clips (``--grad-clip``, 1.0 by default) and then steps, and both walk
every gradient the rank holds:

  norm    ``grad_norm.start_grad_norm`` (ZeRO: ``ShardedAdamW.grad_norm``) hands the counted
          gradients to ``backend.sum_of_squares``: a few NumPy calls per array (ravel, square,
          a float64 sum) whatever its size, and one read of each element.
  update  ``AdamW.step`` loops over its parameters (ZeRO: the segments of the rank's pieces, a
          parameter's part in each group's 1/N piece) and runs ~14 in-place ufuncs per cache
          block: a fixed cost per array and a cost per element.

So each is priced as arrays x a per-array cost + elements x a per-element cost, the four figures
measured on this CPU by timing minipar's own AdamW step and norm on arrays of two sizes and two
counts (``lessons/cpu_calibration.py``). The per-element cost holds for arrays up to one cache
block (``backend.blocks``, 65,536 elements); a larger array pays the per-array part again per
block, a few microseconds per 65,536 elements, which this leaves out.

What a rank holds (``state.rank_parameters`` for the elements, ``zero12.parameter_list`` for the
arrays): its stage's blocks, TP's parts, its E/EP experts, the edges' embeddings. Without ZeRO it
updates all of it; ZeRO updates its 1/N piece of each flat group: the parts of the parameters in
it (for stages 1 and 2 replayed over ``zero12.rank_groups``, exactly; for ZeRO-3, whose groups are
counted as sums, the ranks' mean: a group's parameters over N plus one cut by each piece's edge).
The norm counts what the update reads but the last stage's copy of the tied embedding (the first
stage's parameter again, ``grad_norm.py``); on TP rank 0, the busier, every other copy counts.
The clipping's scaling pass (only when the norm exceeds the bound) is not counted.

On a GPU the update and the norm are a few fused memory-bound kernels per step: the Machine's
fields default to 0, nothing charged.
"""

from dataclasses import dataclass
from functools import lru_cache

from . import state, zero3, zero12


@dataclass(frozen=True)
class Walk:
    """Arrays and elements a pass over a rank's gradients touches."""

    arrays: float
    elements: float


def tied_copy(layout, stage):
    """Whether a rank of ``stage`` holds the last stage's copy of the tied embedding (a pipeline's
    last chunk without its first): held and updated, not counted in the norm."""
    first, last = state.edges(layout, stage)
    return last and not first


def rank_walks(model, layout, stage=0):
    """((update, norm), ...): the Walks of AdamW's update and of the gradient norm on the ranks of
    pipeline stage ``stage`` (the module docstring's counts), one pair per DP x CP rank under ZeRO-1
    and 2, whose pieces differ, one pair otherwise (every rank alike; ZeRO-3: their mean)."""
    return _rank_walks(model, layout, stage)


@lru_cache(maxsize=4096)
def _rank_walks(model, layout, stage):
    params = zero12.parameter_list(model, layout, stage)
    tied = state.token_embedding(model, layout) if tied_copy(layout, stage) else 0  # (index 0: wte first)
    if layout.zero_stage == 0:
        update = Walk(len(params), sum(state.rank_parameters(model, layout, stage)))
        return ((update, Walk(update.arrays - bool(tied), update.elements - tied)),)
    if layout.zero_stage == 3:
        return _zero3(model, layout, stage, len(params), tied)
    return _pieces(model, layout, stage, params, tied)


def _pieces(model, layout, stage, params, tied):
    """ZeRO-1 and 2: each DP x CP rank's segments of every group."""
    n = layout.dp * layout.cp
    out = []
    for r in range(n):
        walks = [0, 0, 0, 0]  # update arrays, elements; norm arrays, elements
        for values, over, _, members in zero12.rank_groups(model, layout, stage, members=True):
            piece = -(-values // over)
            lo = r // (n // over) * piece  # an edp group's ranks are EP apart among the DP x CP ranks
            start = 0
            for i in members:
                size = params[i][0]
                part = max(0, min(start + size, lo + piece) - max(start, lo))
                start += size
                if part:
                    counted = not (tied and i == 0)
                    walks[0], walks[1] = walks[0] + 1, walks[1] + part
                    walks[2], walks[3] = walks[2] + counted, walks[3] + part * counted
        out.append((Walk(walks[0], walks[1]), Walk(walks[2], walks[3])))
    return tuple(out)


def _zero3(model, layout, stage, count, tied):
    """ZeRO-3: the groups' pieces (full ones: rank 0's), the arrays the ranks' mean."""
    n = layout.dp * layout.cp
    groups = zero3.rank_units(model, state.sharded(layout), stage)[0]
    elements = sum(-(-values // over) for values, over, _ in groups)
    arrays = count / n + len(groups)
    return ((Walk(arrays, elements), Walk(arrays - bool(tied) / n, elements - tied / n)),)


def update_seconds(model, layout, machine, stage=0):
    """The norm and update in a step of the slowest rank of ``stage``: arrays and elements x the
    Machine's calibrated costs; 0 where it sets none (a GPU)."""
    if not (machine.update_array_us or machine.update_element_ns or machine.norm_array_us
            or machine.norm_element_ns):
        return 0.0
    return max(update.arrays * machine.update_array_us * 1e-6 + update.elements * machine.update_element_ns * 1e-9
               + norm.arrays * machine.norm_array_us * 1e-6 + norm.elements * machine.norm_element_ns * 1e-9
               for update, norm in rank_walks(model, layout, stage))
