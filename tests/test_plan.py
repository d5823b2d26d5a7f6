"""The planner (minipar/plan): its formulas against minipar's own counts, and the enumerator (its
command line: test_plan_cli.py; balanced pipelines: test_plan_balance.py). The bytes and state of
real runs: tests/mpi/plan_counts.py."""

import os
import re
from dataclasses import replace
from fractions import Fraction

import pytest

from minipar.comm.stats import ring_bytes
from minipar.models import GPT, GPTConfig
from minipar.parallel import memory, validate
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.simulate import chunk_peaks, theoretical_bubble
from minipar.plan import activations, bubble, cost, state, traffic, zero3_peak
from minipar.plan.enumerate import plan
from minipar.plan.shapes import PRECISIONS, PRESETS, Layout, Machine, Model, run_config
from mpi_run import check_mpi, run_mpi

SMALL = Model(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=16)


def test_one_rank_holds_the_whole_model_as_the_gpt_counts_it():
    for experts in (0, 4):
        model = Model(4, 16, 4, 16, num_experts=experts, moe_layer_freq=2)
        gpt = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=16, block_size=16, num_experts=experts, moe_layer_freq=2))
        assert sum(state.rank_parameters(model, Layout())) == gpt.num_parameters()
        cfg = validate.RunConfig(n_layer=4, n_embd=16, block_size=16, vocab_size=256, num_experts=experts or None,
                                 moe_layer_freq=2)
        assert sum(state.rank_parameters(model, Layout())) == memory.total_parameters(cfg)


def test_stages_and_tp_ranks_add_up_to_the_model_and_its_tied_copy():
    whole = sum(state.rank_parameters(SMALL, Layout()))
    # PP: the last stage's copy of the tied embedding is held twice
    pp = sum(sum(state.rank_parameters(SMALL, Layout(pp=4), s)) for s in range(4))
    assert pp == whole + 256 * 16
    # TP 2: the split matrices halve, LayerNorms, row-parallel biases and positions stay whole
    tp = sum(state.rank_parameters(SMALL, Layout(tp=2)))
    h, L = 16, 4
    whole_on_each = L * 6 * h + 16 * h + 2 * h
    assert 2 * tp - whole_on_each == whole


def test_zero_shards_each_kind_of_state_stage_by_stage():
    P = memory.parameter_count(4, 16, 16)
    base = state.state_bytes(SMALL, Layout(dp=4))
    assert base == {"parameters": 4 * P, "gradients": 4 * P, "optimizer": 8 * P}
    for z, sharded in ((1, {"optimizer"}), (2, {"optimizer", "gradients"}), (3, {"optimizer", "gradients", "parameters"})):
        got = state.state_bytes(SMALL, Layout(dp=4, zero_stage=z))
        assert got == {k: v // 4 if k in sharded else v for k, v in base.items()}
    mixed = state.state_bytes(SMALL, Layout(dp=4, zero_stage=1), dtype="bf16-fp32-grads")
    assert mixed == {"parameters": 2 * P, "gradients": 4 * P, "optimizer": 12 * P // 4}
    minipars = state.state_bytes(SMALL, Layout(dp=4, zero_stage=1), dtype="bf16")  # --bf16's bf16 gradients
    assert minipars == {"parameters": 2 * P, "gradients": 2 * P, "optimizer": 12 * P // 4}
    # PipeDream-2BW's stash, the weights again and a batch's gradients (tests/mpi/pipedream.py measures
    # it as twice the stage's weights); the trainer's memory check counts it with the rest
    last = state.state_bytes(SMALL, Layout(pp=2, dp=2, schedule="pipedream-2bw"), 1)
    assert last["stash"] == last["parameters"] + last["gradients"] > 0


def test_zero3s_peak_with_dp_alone_is_two_units_whole_two_buffers_a_piece_and_the_tied_embeddings_buffer():
    """During a block's backward ZeRO-3 holds that block whole, the unit before it prefetched (the
    block before, or before block 0 the next micro-batch's embeddings), its gradient buffer, the
    block after's buffer and received piece still in flight, and the tied embedding's buffer from
    the head's backward on (its weights only for the head's backward):
    g V h + (p + g (2 + 1/N)) B + p max(B, (V + T) h) over its shards (B alone with one
    micro-batch; tests/mpi/plan_counts.py measures it); stage 0 plans what it holds after a step.
    The trainer's memory check planned ZeRO-3's shards alone: 44-70% of these peaks."""
    for h, n, dtype in ((16, 2, "float32"), (16, 4, "float32"), (32, 4, "bf16"), (32, 2, "bf16-fp32-grads")):
        model, d = Model(4, h, 4, 16), PRECISIONS[dtype]
        shards = sum(state.state_bytes(model, Layout(dp=n, zero_stage=3), 0, dtype).values())
        block, tied, positions = memory.parameter_count(1, h, 0, 0) - 2 * h, 256 * h, 16 * h
        for m in (1, 2, 5, None):  # None: m not known, the most
            before = block if m == 1 else max(block, tied + positions)
            most = shards + d.grad * tied + (d.param + d.grad * (2 + Fraction(1, n))) * block + d.param * before
            assert state.peak_state_bytes(model, Layout(dp=n, zero_stage=3), dtype, m) == most, (h, n, dtype, m)
        layout = Layout(dp=n)  # plain data parallelism allocates nothing during a step (ZeRO-1 and 2: test_plan_zero12.py)
        assert state.peak_state_bytes(model, layout, dtype) == sum(state.state_bytes(model, layout, 0, dtype).values())


def test_zero3s_peak_grows_with_the_micro_batches_up_to_3p_and_stays():
    """Beyond m = 3p micro-batches a rank's schedule only repeats its steady state, so ZeRO-3's
    peak is that of 3p; below, no more: ``peak_bytes`` walks min(m, 3p) (3p when m is not known,
    as in the trainer's memory check). Interleaved, the first stage's fullest moment (a backward of
    its first chunk with the next forward's embeddings prefetched) first comes at m = 3p; ZB-H2's
    and ZB-V's at 2p + 1. The least (every send done at once) is below the most. The walk's order
    is the trainer's (``schedules.build``'s compute and step), taken without messages."""
    for schedule, v, sp, defer in (("1f1b", 1, False, False), ("1f1b", 1, True, True), ("interleaved", 2, False, False),
                                   ("zb-h1", 1, True, False), ("zb-h2", 1, False, False), ("zb-v", 2, False, False)):
        for p in (2, 3):
            model = Model(2 * p * v, 16, 4, 16)
            layout = Layout(pp=p, dp=2, tp=1 + sp, sequence_parallel=sp, vpp=v, schedule=schedule, zero_stage=3,
                            defer_embedding_wgrad=defer)
            ms = [m for m in range(1, 4 * p + 2) if not validate.problems(validate.RunConfig(
                pp=p, micro_batches=m, virtual_stages=v, schedule=schedule, n_layer=model.num_layers,
                defer_embedding_wgrad=defer))]
            for m in ms:
                built = schedules.build(schedule, p, m, v, defer)
                for stage in range(p):
                    order = tuple((i.op, i.chunk) for i in built[stage] if i.op in schedules.COMPUTE + (schedules.STEP,))
                    assert zero3_peak.rank_passes(schedule, p, m, v, defer, stage) == order, (schedule, p, m, stage)
            for stage in range(p):
                most = zero3_peak.replay(model, layout, 3 * p, stage)
                assert zero3_peak.peak_bytes(model, layout, None, stage) == most
                for m in ms:
                    got = zero3_peak.replay(model, layout, m, stage)
                    assert got == most if m >= 3 * p else all(got[k] <= most[k] for k in most), (schedule, p, m, stage)
                    assert zero3_peak.replay(model, layout, m, stage, in_flight=0)["total"] <= got["total"]


def test_mixed_precision_state_equals_a_bf16_zero1_steps_on_2_ranks():
    """minipar's --bf16, with and without --accumulate-allreduce-grads-in-fp32 (tests/mpi/plan_bf16_state.py)."""
    assert "plan bf16 state OK on 2 ranks" in check_mpi(2, "plan_bf16_state.py", timeout=120)


def test_data_parallel_bytes_are_the_ring_all_reduce_of_the_gradients():
    P = sum(state.rank_parameters(SMALL, Layout()))
    for n in (2, 4, 8):
        assert traffic.group_bytes(SMALL, Layout(dp=n), 8 * n) == {"dp": 2 * (n - 1) * 4 * P // n}
        zero1 = traffic.group_bytes(SMALL, Layout(dp=n, zero_stage=1), 8 * n)["dp"]
        assert zero1 == 2 * ring_bytes("reduce_scatter", 4 * P, n)[0] + ring_bytes("all_reduce", 8, n)[0]


def test_tensor_parallel_bytes_follow_megatrons_count_and_sequence_parallelism_moves_the_same():
    b, s, h, t, L = 2, 16, 16, 2, 4
    S = b * s * h * 4
    plain = traffic.group_bytes(SMALL, Layout(tp=t, micro_batch_size=b), b)["tp"]
    # 4 all-reduces per block, the embedding and the head, the cross-entropy's 3 b s values, the norm
    assert plain == (4 * L + 2) * S + 3 * b * s * 4 + 8
    sp = traffic.group_bytes(SMALL, Layout(tp=t, micro_batch_size=b, sequence_parallel=True), b)["tp"]
    assert sp - plain == 4 * (6 * h * L + s * h + 2 * h)  # only the partial gradients' all-reduce is new


def test_pipeline_messages_per_chunk_and_micro_batch():
    b, m = 1, 8
    S = b * 16 * 16 * 4
    for p, v in ((2, 1), (4, 1), (2, 2)):
        lay = Layout(pp=p, vpp=v, micro_batch_size=b, schedule="interleaved" if v > 1 else "1f1b")
        sent = [traffic.group_bytes(SMALL, lay, m, stage)["pp"] - ring_bytes("all_reduce", 8, p)[0] for stage in range(p)]
        assert sum(sent) == 2 * m * (p * v - 1) * S  # every boundary carries an activation and a gradient


def test_bubble_and_in_flight_come_from_the_simulator_and_equal_the_closed_forms():
    """Bubble, the total in flight per rank and its split over each rank's chunks at its peaks:
    the closed forms (the planner's beyond SIMULATE_UP_TO) give what the instruction lists give."""
    for schedule, p, m, v in (("1f1b", 4, 8, 1), ("1f1b-slack", 4, 8, 1), ("1f1b-slack", 3, 2, 1), ("gpipe", 2, 6, 1),
                              ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 4), ("interleaved", 3, 9, 3),
                              ("zb-v", 3, 6, 2), ("zb-v", 4, 12, 2), ("zb-h2", 3, 5, 1), ("zb-h1", 4, 8, 1)):
        simulated, alive, source = bubble.pipeline(schedule, p, m, v)
        peaks = [bubble.in_flight(schedule, p, m, v, r) for r in range(p)]
        # (each vector's last v counts: the chunk whose forward has just run, its output not yet sent)
        assert source == "simulator" and (v > 1 or schedule.startswith("zb") or peaks == [((n, 1),) for n in alive])
        assert [max(sum(c[:-v]) for c in peak) for peak in peaks] == list(alive)
        if not schedule.startswith("zb"):
            assert simulated == theoretical_bubble(p, m, v)
        bubble.pipeline.cache_clear()
        bubble.in_flight.cache_clear()
        old, bubble.SIMULATE_UP_TO = bubble.SIMULATE_UP_TO, 0
        try:
            closed, closed_alive, source = bubble.pipeline(schedule, p, m, v)
            closed_peaks = [bubble.in_flight(schedule, p, m, v, r) for r in range(p)]
        finally:
            bubble.SIMULATE_UP_TO = old
            bubble.pipeline.cache_clear()
            bubble.in_flight.cache_clear()
        assert source == "closed form" and (closed, closed_alive, closed_peaks) == (simulated, alive, peaks)
    # ZB-V's first rank holds the V's first chunk (the embeddings) far fuller than its last (the
    # logits); (whole in chunk 0, in chunk 1, waiting for W in chunk 0, in chunk 1, just run in
    # chunk 0, in chunk 1)
    assert bubble.in_flight("zb-v", 2, 4, 2, 0) == (
        (3, 0, 0, 1, 0, 0), (3, 0, 1, 0, 0, 0), (3, 1, 0, 0, 0, 1), (4, 0, 0, 0, 1, 0))
    # ZB-H1's rank r holds p - r micro-batches whole and r waiting for W, ZB-H2's 2p - 1 - 2r and 2r
    for schedule, p, m, whole in (("zb-h1", 4, 8, lambda r: 4 - r), ("zb-h2", 4, 8, lambda r: 7 - 2 * r)):
        for r in range(p):
            held = whole(r) + (r if schedule == "zb-h1" else 2 * r)
            assert bubble.in_flight(schedule, p, m, 1, r) == ((whole(r) - 1, held - whole(r) + 1, 0),
                                                              (whole(r), held - whole(r), 1))
    assert bubble.pipeline("1f1b", 1, 8) == (Fraction(0), (1,), "no pipeline")


def test_deferred_head_weights_are_one_count_more_on_the_last_rank(monkeypatch):
    """--defer-embedding-wgrad-compute: a backward of the last chunk frees its activations and parks
    the head's input and logits' gradient until the flush, so 1F1B's last rank (PP 2, m 4) peaks
    with 1 in flight and 3 parked, or 4 parked; the closed forms give what the instruction lists give."""
    order = [(i.op, i.chunk) for i in schedules.build("1f1b", 2, 4, 1, defer_head=True)[1]]
    assert chunk_peaks(order, 1) == ((0, 4, 0), (1, 3, 1))
    assert chunk_peaks([o for o in order if o[0] != schedules.HEAD_WEIGHT], 1) == ((1, 1),)
    cases = (("1f1b", 4, 8, 1), ("1f1b-slack", 3, 5, 1), ("gpipe", 2, 6, 1), ("interleaved", 2, 4, 2),
             ("interleaved", 3, 9, 3))
    simulated = [[bubble.in_flight(s, p, m, v, r, True) for r in range(p)] for s, p, m, v in cases]
    for (s, p, m, v), peaks in zip(cases, simulated):
        assert peaks[:-1] == [bubble.in_flight(s, p, m, v, r) for r in range(p - 1)]
        assert {len(c) for c in peaks[-1]} == {2 * v + 1} and max(c[v] for c in peaks[-1]) == m
    bubble.in_flight.cache_clear()
    monkeypatch.setattr(bubble, "SIMULATE_UP_TO", 0)
    try:
        assert [[bubble.in_flight(s, p, m, v, r, True) for r in range(p)] for s, p, m, v in cases] == simulated
        with pytest.raises(ValueError, match="drop defer_embedding_wgrad"):
            bubble.in_flight("zb-h1", 2, 4, 1, 1, True)
    finally:  # no closed form left cached for the tests that want the simulator's
        bubble.pipeline.cache_clear()
        bubble.in_flight.cache_clear()


def test_the_activation_formula_lives_in_minipar_and_the_benchmark_uses_it():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "activation_memory.py")
    spec = importlib.util.spec_from_file_location("activation_memory_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.formula is activations.formula
    one = sum(activations.formula(16, 2, 16, 4, 4, False).values())
    assert activations.layer_bytes(SMALL, Layout(micro_batch_size=2), 4) == one
    halved = activations.layer_bytes(SMALL, Layout(tp=2, micro_batch_size=2, sequence_parallel=True), 4)
    assert one // 2 < halved < one  # the LayerNorm outputs stay whole under SP


def test_a_plan_asks_validate_why_a_layout_fails():
    problems = validate.problems(run_config(Model(4, 16, 3, 16), Layout(tp=2, dp=2), 8))
    assert any("not divisible by TP=2" in p for p in problems)


def test_planned_bytes_and_state_equal_a_real_step_on_4_ranks():
    assert "plan counts OK on 4 ranks" in check_mpi(4, "plan_counts.py", timeout=120)


# ---- the enumerator and the step-time model (the command line: test_plan_cli.py) ----------------------------------


def test_every_plan_is_valid_fits_and_is_ranked_and_every_other_layout_has_a_reason():
    model = Model(4, 16, 4, 16)
    machine = Machine(gpus=6, gpus_per_node=3, gpu_memory_gb=2e-4)
    result = plan(model, machine, 12)
    assert result.plans, "some layout fits"
    for layout, prediction in result.plans:
        assert validate.problems(run_config(model, layout, 12)) == []
        assert layout.world_size == 6 and layout.tp <= 3 and prediction.memory_gb <= 2e-4
    times = [p.step_time_s for _, p in result.plans]
    assert times == sorted(times)
    reasons = " | ".join(result.examples.values())
    for words in ("not divisible by --tensor-model-parallel-size 3", "spans nodes of 3 GPUs", "does not fit"):
        assert words in reasons, words
    bigger = plan(model, replace(machine, gpu_memory_gb=1.0), 12)
    assert len(bigger.plans) > len(result.plans)  # more memory, more layouts fit
    assert len(bigger.plans) + sum(bigger.failures.values()) == len(result.plans) + sum(result.failures.values())


def test_a_groups_link_follows_megatrons_rank_order():
    machine = Machine(gpus=16, gpus_per_node=8)
    layout = Layout(tp=8, pp=2)
    assert cost.link(layout, machine, "tp") == "intra" and cost.link(layout, machine, "pp") == "inter"
    layout = Layout(tp=2, dp=4, pp=2)
    assert cost.link(layout, machine, "dp") == "intra" and cost.link(layout, machine, "embedding") == "inter"
    assert cost.link(Layout(tp=2, dp=8), machine, "dp") == "inter"
    # the first stage and the last, PP - 1 stages apart: on one node of 8 for PP 4 x DP 2 (it was
    # called inter-node, from starts past the first stage that begin no group), across two for PP 8 x DP 2
    assert cost.link(Layout(pp=4, dp=2), Machine(gpus=8, gpus_per_node=8), "embedding") == "intra"
    assert cost.link(Layout(pp=8, dp=2), machine, "embedding") == "inter"
    assert cost.link(Layout(pp=4, dp=4), machine, "embedding") == "inter"


def test_more_bandwidth_or_peak_predicts_a_faster_step():
    model, batch = PRESETS["gpt2"]
    layout = Layout(tp=2, pp=2, dp=2, micro_batch_size=4)
    base = cost.predict(model, layout, Machine(gpus=8, gpus_per_node=4), batch)  # PP across the two nodes
    for change in (dict(inter_node_gbps=400.0), dict(intra_node_gbps=4800.0), dict(peak_tflops=624.0)):
        faster = cost.predict(model, layout, Machine(gpus=8, gpus_per_node=4, **change), batch)
        assert faster.step_time_s < base.step_time_s, change


def test_megatrons_flops_per_iteration_with_recomputation():
    """Narayanan et al. 2021, eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh), with full recomputation."""
    for name in ("megatron-1t", "gpt3-175b", "gpt2"):
        model, B = PRESETS[name]
        l, h, s, V = model.num_layers, model.hidden_size, model.seq_length, model.vocab_size
        paper = 96 * B * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(V, 16 * l * h))
        model_flops, hardware = cost.flops_per_iteration(model, B, recompute=True)
        assert hardware == paper, name
        assert model_flops * 4 == 3 * 96 * B * s * l * h * h + 4 * 12 * B * s * s * l * h + 4 * 6 * B * s * h * V


def test_planned_activations_are_within_each_rows_tolerance_of_the_measured_peaks_on_4_ranks():
    """1% where the formula counts what the graphs keep, 10% where it approximates (the tolerances
    and their reasons: tests/mpi/plan_activations.py)."""
    assert "plan activations within tolerance on 4 ranks" in check_mpi(4, "plan_activations.py", timeout=120)


# ---- lesson 11 --------------------------------------------------------------------------------

LESSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lessons", "11_which_parallelism.py")


@pytest.mark.parametrize("n,layouts", [(2, 5), (4, 11)])  # 2 ranks: one pair, calibrated its own way
def test_lesson_11_finds_every_layouts_bytes_and_state_as_planned(n, layouts):
    out = check_mpi(n, LESSON, "--steps", "2", "--require-spearman", "-1", timeout=120)  # no timed assertion
    assert "Every layout sent exactly the bytes, in exactly the calls, and held exactly the state the planner predicts." in out
    assert out.count(" ok ") == layouts and "Spearman's rank correlation" in out
    call = float(re.search(r"a call (\d+) us", out).group(1))
    assert call > 0, out  # a collective made through autograd is never free


def test_lesson_11_fails_with_a_planner_that_forgets_sequence_parallelisms_sums():
    code, out, _ = run_mpi(4, LESSON, "--steps", "1", "--plant-bug", "--require-spearman", "-1", timeout=120)
    assert code == 1 and "MISMATCH: see the rows above" in out
    assert "TP2 DP2 SP Z1     MISMATCH" in out and "DP4 Z1            ok" in out


def test_the_pairs_attention_keeps_are_the_sum_over_its_query_blocks():
    """kept_pairs in closed form (it was this sum, 36 s of the planner at a sequence of 2^20)."""
    from minipar.plan.activations import kept_pairs

    for s in (0, 1, 63, 64, 65, 128, 200, 1000):
        for q in (1, 7, 64, 128):
            blocks = sum(min(q0 + q, s) * (min(q0 + q, s) - q0) for q0 in range(0, s, q))
            assert kept_pairs(s, q) == blocks, (s, q)
    assert kept_pairs(128, 128) == 128 * 128  # one block: every pair, the masked ones too


def test_a_run_the_trainer_resolved_plans_as_the_same_model_and_layout():
    """``from_run_config`` is ``run_config``'s inverse, so the memory check at the trainer's start
    counts the activations of the run it was given, an uneven --pipeline-layers included."""
    from minipar.parallel.validate import resolve
    from minipar.plan.shapes import from_run_config

    model = Model(6, 64, 8, 32, 300, num_experts=4, moe_router_topk=1, moe_layer_freq=2, dropout=0.1)
    layout = Layout(tp=2, pp=2, dp=2, ep=2, vpp=2, zero_stage=1, micro_batch_size=2, recompute=True,
                    sequence_parallel=True, schedule="interleaved", pipeline_layers=(1, 2, 2, 1),
                    defer_embedding_wgrad=True)
    run, problems = resolve(run_config(model, layout, 16, "bfloat16"))
    assert problems == []
    back, again, m = from_run_config(run)
    assert (back, again, m) == (replace(model, dropout=0.0), layout, 4)  # RunConfig keeps no dropout
    assert activations.peak_bytes(back, again, m, 2) == max(
        activations.rank_bytes(back, again, s, bubble.in_flight("interleaved", 2, 4, 2, s, True), 2) for s in (0, 1))
    assert [list(state.chunk_layers(back, again, g)) for g in range(4)] == [[0], [1, 2], [3, 4], [5]]
    assert state.stage_layers(back, again, 0) == [0, 3, 4] and state.stage_layers(back, again, 1) == [1, 2, 5]
