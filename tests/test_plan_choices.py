"""The planner's newer choices: the zero-bubble schedules ZB-H1 and ZB-H2 (their bubble and memory
from the simulator, in closed form past it) and selective recomputation (its activations and FLOPs)."""

from fractions import Fraction

import pytest

from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.simulate import simulate
from minipar.plan import activations, bubble, cost
from minipar.plan.enumerate import layouts, plan
from minipar.plan.shapes import Layout, Machine, Model

MODEL = Model(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=64, dropout=0.1)


@pytest.mark.parametrize("schedule,p,m", [("zb-h1", 8, 600), ("zb-h2", 8, 600), ("zb-h1", 64, 70)])
def test_the_zero_bubble_closed_forms_are_the_simulators(schedule, p, m):
    assert p * m > bubble.SIMULATE_UP_TO  # the planner takes the closed form here
    bub, alive, source = bubble.pipeline(schedule, p, m)
    sim = simulate(schedules.build(schedule, p, m), m, forward=1, backward=1, weight=1)
    assert source == "closed form" and bub == sum(sim.bubble.values()) / p == Fraction(p - 1, 3 * m + p - 1)
    assert alive == tuple(sim.peak_alive[r] for r in range(p))


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16), (3, 70)])
def test_zb_vs_closed_form_is_the_simulators_from_m_2p_on(p, m):
    """ZB-V: two half-size chunks per rank in a V; the planner takes its closed form past the
    simulator's limit. Its bytes, state and activations on ranks: tests/mpi/plan_counts.py,
    plan_activations.py."""
    sim = simulate(schedules.build("zb-v", p, m, 2), m, 2, forward=1, backward=1, weight=1, shape="v")
    assert sum(sim.bubble.values()) / p == Fraction(p - 1, 6 * m + p - 1) == bubble.pipeline("zb-v", p, m, 2)[0]
    assert tuple(sim.peak_alive[r] for r in range(p)) == (2 * p,) * p == bubble.pipeline("zb-v", p, m, 2)[1]
    assert bubble.pipeline("zb-v", 64, 200, 2)[2] == "closed form"
    with pytest.raises(bubble.NotPlanned, match="zb-v with m=100 < 2p"):
        bubble.pipeline("zb-v", 64, 100, 2)


def test_before_the_steady_state_zb_h2_is_simulated_or_not_planned():
    bub, _, source = bubble.pipeline("zb-h2", 32, 60)  # m < 2p - 1: the closed form does not hold
    assert source == "simulator" and bub > Fraction(31, 180 + 31)
    with pytest.raises(bubble.NotPlanned, match="zb-h2 with m=100 < 2p - 1"):
        bubble.pipeline("zb-h2", 64, 100)  # and 6400 chunk-passes are beyond the simulator


def test_zb_h1_has_a_third_of_1f1bs_bubble_and_holds_more():
    one, zb = bubble.pipeline("1f1b", 4, 16), bubble.pipeline("zb-h1", 4, 16)
    assert one[0] == Fraction(3, 16 + 3) and zb[0] == Fraction(3, 48 + 3)
    assert one[1] == (4, 3, 2, 1) and zb[1] == (4, 4, 4, 4)  # whole, or parked until their W runs


def test_the_enumerator_offers_zero_bubble_schedules_and_selective_recomputation():
    tried = [layout for layout, problem in layouts(MODEL, Machine(gpus=4, gpus_per_node=4), 16) if not problem]
    assert {l.schedule for l in tried if l.pp > 1 and l.vpp == 1} == {"1f1b", "zb-h1", "zb-h2"}
    assert {l.schedule for l in tried if l.vpp == 2} == {"interleaved", "zb-v"}
    assert any(l.selective_recompute and not l.recompute for l in tried)
    assert not any(l.selective_recompute and l.recompute for l in tried)
    # under ring attention selective recomputation drops nothing (Layout.selective): the same run as
    # none, so not offered twice; under Ulysses it does drop the T x T part
    assert not any(l.selective_recompute and l.ring_attention for l in tried)
    assert any(l.selective_recompute and l.cp > 1 and l.cp_comm_type == "a2a" for l in tried)
    # ZeRO shards over DP x CP: with one such rank, stages 1-3 are stage 0 with more buffers
    assert {l.zero_stage for l in tried if l.dp * l.cp == 1} == {0}
    assert {l.zero_stage for l in tried if l.dp * l.cp > 1} == {0, 1, 2, 3}
    ranked = plan(MODEL, Machine(gpus=4, gpus_per_node=4), 16).plans
    assert any(l.schedule == "zb-h1" for l, _ in ranked) and any(l.selective_recompute for l, _ in ranked)
    assert any(l.schedule == "zb-v" for l, _ in ranked)


def test_selective_recomputation_keeps_no_t_by_t_part():
    plain, selective = Layout(micro_batch_size=2), Layout(micro_batch_size=2, selective_recompute=True)
    s, b, h, a = 64, 2, 64, 4
    assert activations.layer_bytes(MODEL, selective, 4) == sum(activations.formula(s, b, h, a, 4, True, "selective").values())
    assert activations.layer_bytes(MODEL, plain, 4) - activations.layer_bytes(MODEL, selective, 4) > 2 * 4 * a * b * s * s / 2 * 0.9


def test_selective_recomputation_costs_one_more_q_k_transpose():
    model_flops, plain = cost.flops_per_iteration(MODEL, 16)
    _, selective = cost.flops_per_iteration(MODEL, 16, selective=True)
    assert plain == model_flops and selective - plain == 16 * 64 * 2 * 8 * 64 * 64  # tokens x 2 L T h


def _block_graph_bytes(num_experts, k, capacity=None, dtype="float32"):
    """The bytes one block's graph keeps (bench/activation_memory.py's walk), on 2 x 32 tokens."""
    import importlib.util
    import os

    import numpy

    import minipar
    from minipar.autograd import Tensor
    from minipar.models import GPT, GPTConfig

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "activation_memory.py")
    spec = importlib.util.spec_from_file_location("activation_memory_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    minipar.set_default_dtype(dtype)
    minipar.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=32, dropout=0.1, num_experts=num_experts,
                        moe_router_topk=k, moe_expert_capacity_factor=capacity))
    block = gpt.transformer.h[0]
    x = Tensor(numpy.random.default_rng(0).standard_normal((2, 32, 32)).astype(numpy.float32), requires_grad=True)
    x = minipar.functional.cast(x, dtype) if dtype != "float32" else x
    return bench.graph_bytes(block(x), x, block.parameters())  # (conftest restores the default dtype)


@pytest.mark.parametrize("experts,k,capacity,dtype", [(4, 2, None, "float32"), (8, 1, None, "bfloat16"),
                                                      (8, 4, 0.5, "float32")])
def test_an_moe_blocks_activations_beyond_a_dense_ones_are_counted_exactly_on_one_device(experts, k, capacity, dtype):
    """Router, permuted rows, experts and unpermute (a capacity of 0.5 keeps exactly half the slots
    here, as a uniform router would); expert-parallel runs: tests/mpi/plan_activations.py."""
    model = Model(1, 32, 4, 32, num_experts=experts, moe_router_topk=k, moe_expert_capacity_factor=capacity, dropout=0.1)
    measured = _block_graph_bytes(experts, k, capacity, dtype) - _block_graph_bytes(0, 2, None, dtype)
    assert activations.moe_bytes(model, Layout(micro_batch_size=2), 2 if dtype == "bfloat16" else 4) == measured


@pytest.mark.parametrize("experts,capacity,dtype", [(0, None, "float32"), (0, None, "bfloat16"), (4, None, "float32"),
                                                   (4, None, "bfloat16"), (8, 0.5, "float32")])
def test_what_a_split_backward_parks_for_w_is_counted_exactly_on_one_device(experts, capacity, dtype):
    """After B, a micro-batch holds only what its W needs (``weight_grad.WeightGradients``): the
    planner's count for one micro-batch waiting for W on a one-chunk model (both edges, one or two
    blocks, dense or MoE, float32 or bfloat16) is WeightGradients.nbytes to the byte. Under TP, SP,
    PP and EP: tests/mpi/plan_activations.py's ZB rows."""
    import numpy

    import minipar
    from minipar.models import GPT, GPTConfig
    from minipar.weight_grad import backward_input

    minipar.set_default_dtype(dtype)  # (conftest restores the default dtype)
    for layers in (1, 2):
        minipar.manual_seed(0)
        gpt = GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=32, block_size=32, vocab_size=96, dropout=0.1,
                            num_experts=experts, moe_router_topk=2, moe_expert_capacity_factor=capacity))
        ids = numpy.random.default_rng(0).integers(0, 96, (2, 32))
        parked = backward_input(gpt.chunk_forward(0, ids, ids, reduction="sum"), gpt.parameters()).nbytes()
        model = Model(layers, 32, 4, 32, vocab_size=96, num_experts=experts, moe_router_topk=2,
                      moe_expert_capacity_factor=capacity, dropout=0.1)
        one_waiting = ((0, 1, 0),)  # no micro-batch whole, one waiting for its W, no output unsent
        planned = activations.rank_bytes(model, Layout(schedule="zb-h1", micro_batch_size=2), 0, one_waiting,
                                         2 if dtype == "bfloat16" else 4, transient=False)
        assert planned == parked, (layers, planned, parked)


def test_a_dp_size_that_does_not_divide_the_batch_is_tried_and_refused_with_its_reason():
    """3 GPUs, a global batch of 4: DP = 3 is a layout the enumerator tries, and the plan refuses it
    saying why (a generator's truth value once made it skip the grid without a word)."""
    grids = {(lay.tp, lay.cp, lay.pp, lay.dp) for lay, _ in layouts(Model(4, 64, 4, 64), Machine(3), 4)}
    assert (1, 1, 1, 3) in grids
    examples = plan(Model(4, 64, 4, 64), Machine(3), 4).examples.values()
    assert any("--global-batch-size 4 does not split over DP=3 ranks" in why for why in examples), examples
