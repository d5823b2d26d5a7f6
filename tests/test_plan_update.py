"""The planner's update term (minipar/plan/update.py): the arrays and elements a rank's gradient
norm and AdamW step walk, and the seconds ``cost.predict`` adds for them. The counts were held to
the optimizers of lesson 11's trainers at 2 ranks (``len(opt._adamw.params)`` and their sizes:
equal for DP, ZeRO-1, TP and PP; ZeRO-3's arrays are the ranks' mean, 33 planned against 39 and 19)."""

import math
import os
from itertools import accumulate

import numpy as np
import pytest

from minipar.plan import cost, state, update, zero3, zero12
from minipar.plan.shapes import Layout, Machine, Model

MODEL = Model(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32)
MOE = Model(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, num_experts=4)
PER_BLOCK = 12  # ln_1 (2), c_attn (2), c_proj (2), ln_2 (2), c_fc (2), the MLP's c_proj (2)
COSTS = dict(update_array_us=5.0, update_element_ns=1.0, norm_array_us=2.0, norm_element_ns=0.5)


def walks(model, layout, stage=0):
    return update.rank_walks(model, layout, stage)


def test_data_parallelism_updates_every_tensor_of_the_model():
    (adamw, norm), = walks(MODEL, Layout(dp=2))
    assert adamw.arrays == 4 * PER_BLOCK + 2 + 2  # the blocks, wte and wpe, ln_f
    assert adamw.elements == sum(state.rank_parameters(MODEL, Layout(dp=2)))
    assert norm == adamw  # one stage: its tied embedding is its own


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_updates_half_the_elements_at_dp2(stage):
    whole = walks(MODEL, Layout(dp=2))[0][0]
    ranks = walks(MODEL, Layout(dp=2, zero_stage=stage))
    assert len(ranks) == 2
    assert [a.elements for a, _ in ranks] == [whole.elements // 2] * 2
    # one flat group (under 4 MB): one tensor cut by the pieces' edge, in both ranks' segments
    assert sum(a.arrays for a, _ in ranks) == whole.arrays + 1


def test_zero3_updates_its_pieces():
    (adamw, _), = walks(MODEL, Layout(dp=2, zero_stage=3))
    assert adamw.elements == walks(MODEL, Layout(dp=2))[0][0].elements // 2
    assert walks(MODEL, Layout(dp=2))[0][0].arrays / 2 < adamw.arrays < walks(MODEL, Layout(dp=2))[0][0].arrays


def test_a_pipeline_stage_updates_its_own_tensors():
    layout = Layout(pp=2)
    (first, first_norm), = walks(MODEL, layout, 0)
    (last, last_norm), = walks(MODEL, layout, 1)
    assert (first.arrays, last.arrays) == (2 * PER_BLOCK + 2, 2 * PER_BLOCK + 1 + 2)  # wte, wpe; its wte copy, ln_f
    assert (first.elements, last.elements) == (state.rank_parameters(MODEL, layout, 0)[0],
                                                state.rank_parameters(MODEL, layout, 1)[0])
    assert first_norm == first
    # the tied embedding's copy on the last stage is updated, not counted in the norm
    tied = state.token_embedding(MODEL, layout)
    assert (last_norm.arrays, last_norm.elements) == (last.arrays - 1, last.elements - tied)


def test_tensor_parallelism_splits_the_elements_not_the_tensors():
    one, two = walks(MODEL, Layout(dp=2))[0][0], walks(MODEL, Layout(tp=2, sequence_parallel=True))[0][0]
    assert two.arrays == one.arrays
    h = MODEL.hidden_size
    # whole on each TP rank: per block two LayerNorms and two row-parallel biases; ln_f; the positions
    whole = 4 * (4 * h + 2 * h) + 2 * h + MODEL.seq_length * h
    assert two.elements == (one.elements - whole) // 2 + whole


def test_experts_split_over_ep_and_zero_over_their_group():
    dense, experts = state.rank_parameters(MOE, Layout(dp=4, ep=2))
    ranks = walks(MOE, Layout(dp=4, ep=2, zero_stage=1))
    assert max(a.elements for a, _ in ranks) == dense // 4 + experts // 2
    assert sum(a.elements for a, _ in ranks) == dense + 2 * experts  # each expert on the 2 ranks of its edp group


def test_predict_adds_the_term_exactly_and_nothing_by_default():
    for layout in (Layout(dp=2, zero_stage=1), Layout(pp=2, micro_batch_size=4), Layout(tp=2, sequence_parallel=True)):
        bare = cost.predict(MODEL, layout, Machine(gpus=2), 16)
        assert bare.update_s == 0.0
        paid = cost.predict(MODEL, layout, Machine(gpus=2, **COSTS), 16)
        seconds = max(update.update_seconds(MODEL, layout, Machine(gpus=2, **COSTS), s) for s in range(layout.pp))
        assert seconds > 0 and paid.update_s == seconds
        # after the flush: not stretched by the pipeline's bubble
        assert paid.step_time_s - bare.step_time_s == pytest.approx(seconds, rel=1e-12)


def test_the_seconds_are_arrays_and_elements_times_the_costs():
    (adamw, norm), = walks(MODEL, Layout(dp=2))
    expected = (adamw.arrays * 5e-6 + adamw.elements * 1e-9 + norm.arrays * 2e-6 + norm.elements * 0.5e-9)
    assert update.update_seconds(MODEL, Layout(dp=2), Machine(gpus=2, **COSTS)) == pytest.approx(expected)


def test_shared_cores_share_the_update_too():
    layout, machine = Layout(dp=4, zero_stage=1), Machine(gpus=4, gpus_per_node=4, cores_per_node=2)
    bare = cost.predict(MODEL, layout, machine, 16)
    paid = cost.predict(MODEL, layout, Machine(**{**machine.__dict__, **COSTS}), 16)
    assert paid.step_time_s - bare.step_time_s == pytest.approx(2 * paid.update_s)


def test_the_calibration_fits_both_costs(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lessons"))
    from cpu_calibration import update_costs

    costs = update_costs(repeats=2)
    assert len(costs) == 4 and all(c >= 0 for c in costs)
    assert costs[0] > 0 and costs[2] > 0  # every array costs some NumPy calls, whatever its size


def replayed_pieces(model, layout, stage=0):
    """Each DP x CP rank's (update, norm) Walk under ZeRO-1/2, replayed by hand: a group over all
    the DP x CP ranks gives rank i its i-th 1/N piece; an expert group ("edp") its piece by the
    rank's index in its edp group as the runtime's topology numbers it."""
    from minipar.parallel.topology import Layout as Grid

    grid = Grid(tp=1, pp=1, dp=layout.dp, cp=layout.cp, ep=layout.ep)
    sizes = [values for values, _, _ in zero12.parameter_list(model, layout, stage)]
    tied = update.tied_copy(layout, stage)
    out = []
    for r in range(layout.dp * layout.cp):
        mine = [0, 0, 0, 0]
        for values, over, _, members in zero12.rank_groups(model, layout, stage, members=True):
            index = grid.ranks(r)["dp_cp" if over == layout.dp * layout.cp else "edp"]
            piece = -(-values // over)
            lo, hi = index * piece, (index + 1) * piece
            offsets = [0, *accumulate(sizes[i] for i in members)]
            for i, start, end in zip(members, offsets, offsets[1:]):
                part = min(end, hi) - max(start, lo)
                if part > 0:
                    norm = not (tied and i == 0)
                    mine = [mine[0] + 1, mine[1] + part, mine[2] + norm, mine[3] + part * norm]
        out.append((update.Walk(*mine[:2]), update.Walk(*mine[2:])))
    return tuple(out)


@pytest.mark.parametrize("model, layout", [
    (MOE, Layout(dp=6, ep=2, zero_stage=1)),  # 2 experts over 3 pieces, the dense groups' uneven too
    (Model(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, num_experts=6),
     Layout(dp=4, ep=2, zero_stage=2))])  # 3 experts over 2 pieces: one cut inside an expert
def test_zero12_walks_each_ranks_own_pieces_and_the_slowest_sets_the_time(model, layout):
    ranks = walks(model, layout)
    assert ranks == replayed_pieces(model, layout)
    costs = [a.arrays * 5e-6 + a.elements * 1e-9 + n.arrays * 2e-6 + n.elements * 0.5e-9 for a, n in ranks]
    assert min(costs) < max(costs)  # the ranks differ: the slowest one is the step's
    seconds = update.update_seconds(model, layout, Machine(gpus=layout.dp, **COSTS))
    assert seconds == pytest.approx(max(costs), rel=1e-12)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero12_leaves_the_last_stages_tied_copy_out_of_the_norm(zero_stage):
    layout = Layout(pp=2, dp=2, zero_stage=zero_stage)
    ranks = walks(MODEL, layout, 1)  # the last stage: it holds the tied embedding's copy
    tied = state.token_embedding(MODEL, layout)
    assert sum(a.elements for a, _ in ranks) == sum(state.rank_parameters(MODEL, layout, 1))
    assert sum(n.elements for _, n in ranks) == sum(a.elements for a, _ in ranks) - tied
    # the copy is one array, in the segments of the ranks whose piece holds a part of it
    holding = sum(a.elements != n.elements for a, n in ranks)
    assert holding >= 1 and sum(n.arrays for _, n in ranks) == sum(a.arrays for a, _ in ranks) - holding
    # the first stage's embedding is its own: counted
    assert all(a == n for a, n in walks(MODEL, layout, 0))


def test_zero3_leaves_its_share_of_the_tied_copy_out_of_the_norm():
    layout = Layout(pp=2, dp=2, zero_stage=3)
    (adamw, norm), = walks(MODEL, layout, 1)
    tied = state.token_embedding(MODEL, layout)
    assert (norm.arrays, norm.elements) == (adamw.arrays - 1 / 2, adamw.elements - tied / 2)  # the ranks' mean
    (first, first_norm), = walks(MODEL, layout, 0)
    assert first_norm == first


def test_zero3_counts_full_pieces_where_a_group_does_not_divide():
    layout = Layout(dp=3, zero_stage=3)
    (adamw, _), = walks(MODEL, layout)
    groups = zero3.rank_units(MODEL, state.sharded(layout), 0)[0]
    assert sum(values for values, _, _ in groups) == sum(state.rank_parameters(MODEL, layout))
    assert any(values % 3 for values, _, _ in groups)  # (else a floor would count the same)
    assert adamw.elements == sum(math.ceil(values / 3) for values, _, _ in groups)
    assert adamw.elements > sum(state.rank_parameters(MODEL, layout)) / 3  # rank 0's pieces are full


def test_the_seconds_price_the_norms_walk_and_the_updates_apart():
    layout = Layout(pp=2)
    (adamw, norm), = walks(MODEL, layout, 1)
    assert norm.arrays < adamw.arrays and norm.elements < adamw.elements  # the tied copy: updated only
    machine = Machine(gpus=2, update_array_us=7.0, update_element_ns=3.0, norm_array_us=11.0, norm_element_ns=0.25)
    expected = (adamw.arrays * 7e-6 + adamw.elements * 3e-9 + norm.arrays * 11e-6 + norm.elements * 0.25e-9)
    assert update.update_seconds(MODEL, layout, machine, 1) == pytest.approx(expected, rel=1e-12)


def test_predict_takes_the_busiest_stages_update():
    layout = Layout(pp=2, pipeline_layers=(1, 3))  # the last stage holds three blocks and ln_f
    machine = Machine(gpus=2, **COSTS)
    first, last = (update.update_seconds(MODEL, layout, machine, s) for s in (0, 1))
    assert first < last
    assert cost.predict(MODEL, layout, machine, 16).update_s == last


def test_the_calibration_fits_each_pass_on_its_own_arrays_and_elements(monkeypatch):
    """Given times exactly a x arrays + b x elements for AdamW's runs and c x arrays + d x elements
    for the norm's, ``update_costs`` returns (a, b, c, d): the design matrix is each run's arrays and
    elements, the AdamW fit first."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lessons"))
    import cpu_calibration
    from minipar.optim import AdamW

    a, b, c, d = 3e-6, 2e-9, 7e-7, 5e-10
    seen = []

    def exact(fns, repeats, comm=None):
        assert len(fns) % 2 == 0
        times = []
        for step, norm in zip(fns[0::2], fns[1::2]):  # each AdamW step, then the norm of its parameters
            assert isinstance(step.__self__, AdamW)
            params = step.__self__.params
            arrays, elements = len(params), sum(p.data.size for p in params)
            assert float(norm()) == pytest.approx(float(np.sqrt(sum((p.grad.astype(np.float64) ** 2).sum()
                                                                     for p in params))), rel=1e-5)
            seen.append((arrays, elements))
            times += [arrays * a + elements * b, arrays * c + elements * d]
        return times

    monkeypatch.setattr(cpu_calibration, "median_times", exact)
    costs = cpu_calibration.update_costs(repeats=1)
    assert sorted(seen) == sorted((n, n * size) for n in (8, 32) for size in (64, 4096))  # the defaults' runs
    assert costs == pytest.approx((a, b, c, d), rel=1e-9)
