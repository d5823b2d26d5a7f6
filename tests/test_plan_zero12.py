"""ZeRO-1's and ZeRO-2's planned peaks (``plan.zero12``): the groups as ``shards.group_parameters``
cuts the model's parameters, the closed forms of the fullest moment, and the replay against the
real ZeRO-2's ledger on one rank for models the 4 MiB buckets cut between a weight and its bias.
Against the real optimizer's ledger on 4 ranks: tests/mpi/plan_counts.py."""

from types import SimpleNamespace

import numpy as np
import pytest

import minipar
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.shards import group_parameters
from minipar.parallel.zero2 import ZeRO2
from minipar.plan import state, zero12
from minipar.plan.shapes import PRECISIONS, Layout, Model
from minipar.plan.traffic import BUCKET

from late_sends import LateSends


def test_groups_are_the_optimizers_groups_also_when_buckets_cut_the_model():
    """h = 256: 3.2M parameters, 12.6 MB of float32 weights, cut into groups of 4 MiB and more
    (a group closes at the parameter that fills it)."""
    for n in (2, 4):
        comm = SimpleNamespace(size=n, rank=0)
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab_size=256))
        real = [g.size for g in group_parameters(model.parameters(), lambda p: comm, BUCKET)]
        planned = zero12.rank_groups(Model(4, 256, 4, 128), Layout(dp=n, zero_stage=1), 0)
        assert len(real) > 2 and [values for values, _, _ in planned] == real
        assert {ranks for _, ranks, _ in planned} == {n}


def test_one_group_closed_forms():
    """A model within one bucket is one group of P values, padded to N pieces of P' = ceil(P/N):
    ZeRO-1 adds one piece to its state; ZeRO-2 the whole gradients, their flat copy and the piece
    it receives, and with m > 1 the previous micro-batch's send (buffer and piece) still pending."""
    for h, n, dtype in ((16, 2, "float32"), (16, 4, "float32"), (24, 4, "bf16"), (24, 3, "bf16-fp32-grads")):
        model, g = Model(4, h, 4, 16), PRECISIONS[dtype].grad
        values = sum(state.rank_parameters(model, Layout(), 0))
        piece = -(-values // n)
        for z, m, extra in ((1, 1, piece), (1, 4, piece), (2, 1, values + piece * n + piece),
                            (2, 2, values + 2 * (piece * n + piece))):
            layout = Layout(dp=n, zero_stage=z)
            after = sum(state.state_bytes(model, layout, 0, dtype).values())
            assert state.stage_peak_bytes(model, layout, 0, dtype, m) == after + g * extra, (h, n, dtype, z, m)
        assert state.stage_peak_bytes(model, Layout(dp=n), 0, dtype) == sum(
            state.state_bytes(model, Layout(dp=n), 0, dtype).values())  # plain DP: nothing more


def test_held_gradients_count_until_the_flush():
    """On a pipeline's end ZeRO-2 holds the tied embedding's whole gradient (V h) from the
    backward that makes it until finalize_grads has summed it over the two ends: the fullest
    moment is a backward send beside it; with DP alone it is not held."""
    model, n = Model(4, 16, 4, 16), 2
    piped = Layout(pp=2, dp=n, zero_stage=2)
    groups = zero12.rank_groups(model, piped, 0)
    assert [held for _, _, held in groups] == [False, True] and groups[1][0] == 256 * 16
    dense = groups[0][0]
    p = -(-dense // n)
    after = sum(state.state_bytes(model, piped, 0, "float32").values())
    expected = after + 4 * (256 * 16 + dense + 2 * (p * n + p))
    assert state.stage_peak_bytes(model, piped, 0, "float32", 4) == expected
    assert all(not held for _, _, held in zero12.rank_groups(model, Layout(dp=n, zero_stage=2), 0))


@pytest.mark.parametrize("experts,m", [(0, 1), (0, 3), (4, 2)])
def test_zero2s_replay_is_its_ledger_when_groups_cut_a_weight_from_its_bias(experts, m):
    """h = 256: the first group ends at h.1.attn.c_attn.weight, whose bias opens the next one; that
    weight's gradient is whole while the bias completes the group before it (a plan counting only
    each group's own gradients at its send was 786,432 bytes short). With experts, the router's
    gradient comes before its experts'."""
    minipar.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=16, vocab_size=256, num_experts=experts))
    zero = ZeRO2(model, LateSends(ProcessGrid(1, 1).dp_group), lr=1e-3)
    assert len(zero.groups) > 2
    data = np.random.default_rng(1).integers(0, 256, (m, 2, 16))
    for idx in data:
        out = model(idx, idx)
        (out[1] if isinstance(out, tuple) else out).backward()
    zero.finish_gradients()
    planned = state.stage_peak_bytes(Model(4, 256, 4, 16, num_experts=experts), Layout(zero_stage=2), 0, "float32", m)
    assert zero.ledger.peak_total == planned
