"""Zero-bubble schedules on paper (no MPI): ZB-H1 and ZB-H2 free of deadlock for every size, each
micro-batch's F, B and W once and in that order, the idle time exactly Qi et al.'s formulas for
equal and unequal F, B and W costs, and the activations held as the paper says; W in the
timelines' letters and colours."""

import json
from fractions import Fraction

import pytest

from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline import trace
from minipar.parallel.pipeline.simulate import simulate, zero_bubble_idle

COSTS = [(1, 1, 1), (2, 2, 1), (1, 2, 1), (3, 2, 2), (2, 3, 2), (2, 1, 1), (4, 3, 3), (1, 1, Fraction(1, 2))]
SIZES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 6, 7, 8, 12)]


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("p,m", SIZES)
def test_zero_bubble_schedules_run_to_the_end(name, p, m):
    plans = S.build(name, p, m)
    sim = simulate(plans, m, forward=1, backward=1, weight=1)  # raises on deadlock, unpaired messages, W before B
    assert sim.messages == 2 * m * (p - 1)
    for r, plan in plans.items():
        ops = [(i.op, i.mb) for i in plan if i.op in S.COMPUTE]
        for mb in range(m):  # F, then B, then W, once each
            assert [op for op, b in ops if b == mb] == [S.FORWARD, S.BACKWARD_INPUT, S.BACKWARD_WEIGHT]
    # activations held from F to W: 1F1B's first stage (p) on every rank for ZB-H1, 2p - 1 for ZB-H2
    most = p if name == "zb-h1" else 2 * p - 1
    assert sim.peak_alive == {r: min(most, m) for r in range(p)}


@pytest.mark.parametrize("f,b,w", COSTS)
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zb_h1_idles_the_formula(p, f, b, w):
    """Every rank idles (p - 1)(T_F + T_B - T_W) per step, against 1F1B's (p - 1)(T_F + T_B + T_W)
    with the same costs (1F1B's fused backward costs B + W)."""
    for m in (p, p + 1, 2 * p, 3 * p):
        zb = simulate(S.build("zb-h1", p, m), m, forward=f, backward=b, weight=w)
        work = m * (f + b + w)
        assert all(zb.busy[r] == work for r in range(p))
        assert zb.makespan - work == zero_bubble_idle("zb-h1", p, m, f, b, w) == (p - 1) * (f + b - w)
        plain = simulate(S.build("1f1b", p, m), m, forward=f, backward=b, weight=w)
        assert plain.makespan - work == (p - 1) * (f + b + w)


@pytest.mark.parametrize("f,b,w", COSTS)
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zb_h2_idles_the_formula_within_each_span(p, f, b, w):
    """Within the longest rank's span each rank idles (p - 1)(T_F + T_B - 2 T_W): none in steady
    state when T_F + T_B = 2 T_W; with the optimizer step synchronising the ranks the step is
    longer by the parallelogram's slant when that is more."""
    for m in (2 * p - 1, 2 * p, 3 * p + 1):
        sim = simulate(S.build("zb-h2", p, m), m, forward=f, backward=b, weight=w)
        work = m * (f + b + w)
        assert sim.period - work == zero_bubble_idle("zb-h2", p, m, f, b, w) == (p - 1) * (f + b - 2 * w)
        assert sim.makespan - work == (p - 1) * max(f, f + b - 2 * w)
    assert simulate(S.build("zb-h2", p, 2 * p), 2 * p, forward=1, backward=1, weight=1).period == 2 * p * 3


def test_the_formulas_refuse_what_they_do_not_cover():
    with pytest.raises(ValueError, match="T_W <= T_F"):
        zero_bubble_idle("zb-h1", 4, 8, 1, 2, 2)
    with pytest.raises(ValueError, match="m >= 7"):
        zero_bubble_idle("zb-h2", 4, 6, 1, 1, 1)
    # with fewer micro-batches the steady state is never reached: each idles more than its formula
    with pytest.raises(ValueError, match="m >= 4"):
        zero_bubble_idle("zb-h1", 4, 3, 1, 1, 1)
    with pytest.raises(ValueError, match="m >= 7"):
        zero_bubble_idle("zb-v", 4, 6, 1, 1, 1)
    with pytest.raises(ValueError, match="choose one of"):
        zero_bubble_idle("1f1b", 4, 8, 1, 1, 1)


def test_a_split_schedule_needs_the_cost_of_w():
    with pytest.raises(ValueError, match="weight="):
        simulate(S.build("zb-h1", 2, 2), 2)


def test_zb_h1_order_of_the_paper():
    """p = 4, m = 6: the last stage runs F B pairs with W held back three steps; the first stage
    runs 1F1B's warm-up and then F B W."""
    plans = S.build("zb-h1", 4, 6)
    col = {r: [S.LETTERS[i.op] + str(i.mb) for i in plans[r] if i.op in S.COMPUTE] for r in (0, 3)}
    assert col[0][:9] == ["F0", "F1", "F2", "F3", "B0", "W0", "F4", "B1", "W1"]
    assert col[3][:10] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "W0", "F4"]
    assert "W5" in S.table(plans)


def test_the_simulator_catches_broken_split_schedules():
    good = S.build("zb-h1", 2, 2)
    w_first = {**good, 1: [i for i in good[1] if i.op != S.BACKWARD_WEIGHT]}
    w_first[1] = [S.Instruction(S.BACKWARD_WEIGHT, 0, 0)] + w_first[1] + [S.Instruction(S.BACKWARD_WEIGHT, 1, 0)]
    with pytest.raises(RuntimeError, match="before its forward"):
        simulate(w_first, 2, forward=1, backward=1, weight=1)
    no_w = {**good, 0: [i for i in good[0] if not (i.op == S.BACKWARD_WEIGHT and i.mb == 1)]}
    with pytest.raises(RuntimeError, match="whose W never ran"):
        simulate(no_w, 2, forward=1, backward=1, weight=1)


def test_w_has_its_letter_and_colour(tmp_path):
    sim = simulate(S.build("zb-h1", 3, 4), 4, forward=1, backward=1, weight=1)
    assert trace.COLORS[S.BACKWARD_WEIGHT] not in (trace.COLORS[S.FORWARD], trace.COLORS[S.BACKWARD_INPUT])
    assert trace.bubble(sim.timeline) == {r: Fraction(2, 14) for r in range(3)}  # (p-1)(1+1-1) / (4*3 + 2)
    trace.chrome_trace(sim.timeline, tmp_path / "t.json")
    names = {e["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"}
    assert {"F0", "B0", "W0", "W3"} <= names
    trace.gantt(sim.timeline, tmp_path / "g.png", "zb-h1", unit="units")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert set(trace.op_costs(sim.timeline)) == {S.FORWARD, S.BACKWARD_INPUT, S.BACKWARD_WEIGHT}


@pytest.mark.parametrize("schedule,recompute", [("zb-h1", False), ("zb-h2", True)])
def test_executor_on_one_stage_splits_the_backward_bit_for_bit(schedule, recompute):
    """PP = 1: a zero-bubble schedule is F, B, W per micro-batch, the same gradients as 1F1B's F,
    backward, bit for bit (W adds each micro-batch's weight gradients in the same order); W's
    memory is counted while it waits."""
    import numpy as np

    import minipar
    from minipar.models import GPT, GPTConfig
    from minipar.parallel import ProcessGrid
    from minipar.parallel.pipeline.executor import PipelineExecutor

    minipar.set_default_dtype("float64")
    try:
        config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.2)
        x = np.random.default_rng(1).integers(0, 32, (6, 8))
        grads, records = [], []
        for name in ("1f1b", schedule):
            minipar.manual_seed(0)
            model = GPT(config, ProcessGrid(1, 1))
            run = PipelineExecutor(model, ProcessGrid(1, 1), name, micro_batches=3, recompute=recompute)
            records.append(run.step(x, x))
            grads.append([p.grad for p in model.parameters()])
        for a, b in zip(*grads):
            assert np.array_equal(a, b)
        assert records[0].loss == records[1].loss
        assert records[0].peak_weight_bytes == 0 and records[1].peak_weight_bytes > 0
        assert records[1].peak_alive == 1
        ops = [t[0] for t in records[1].timeline]
        assert ops.count(S.BACKWARD_WEIGHT) == 3 and S.BACKWARD not in ops
    finally:
        minipar.set_default_dtype("float32")


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_v_runs_to_the_end_in_a_v(p, m):
    """ZB-V: rank r holds chunks r and 2p - 1 - r; every micro-batch's F, B, W once per chunk and
    in that order, messages both ways (an activation and a gradient per chunk boundary, rank p - 1
    handing its own chunk 1 its chunk 0's output), at most 2p half-size chunk activations (1F1B's
    memory), for equal and unequal costs."""
    plans = S.build("zb-v", p, m, 2)
    pipe = S.Pipeline(p, m, 2, "v")
    assert [pipe.global_chunk(r, c) for r in range(p) for c in (0, 1)] == [g for r in range(p) for g in (r, 2 * p - 1 - r)]
    for f, b, w in [(1, 1, 1)] + COSTS[1:4]:
        sim = simulate(plans, m, 2, forward=f, backward=b, weight=w, shape="v")
        assert sim.messages == 2 * m * (2 * p - 1)
        assert all(n <= 2 * p for n in sim.peak_alive.values())
        if m >= 2 * p - 1:
            assert sim.peak_alive == {r: 2 * p for r in range(p)}
    for r, plan in plans.items():
        for c in (0, 1):
            for mb in range(m):
                assert [i.op for i in plan if i.op in S.COMPUTE and (i.mb, i.chunk) == (mb, c)] == \
                    [S.FORWARD, S.BACKWARD_INPUT, S.BACKWARD_WEIGHT]
        peers = {S.Pipeline(p, m, 2, "v").place(pipe.global_chunk(r, i.chunk) + 1)[0]
                 for i in plan if i.op == S.SEND_ACT}
        assert peers == ({r + 1, r - 1} & set(range(p)) if r < p - 1 else {r, r - 1} & set(range(p)))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("t", [1, 2, Fraction(1, 3)])
def test_zb_v_has_no_bubble_in_steady_state_with_equal_costs(p, t):
    for m in (2 * p - 1, 2 * p, 3 * p + 1):
        sim = simulate(S.build("zb-v", p, m, 2), m, 2, forward=t, backward=t, weight=t, shape="v")
        work = 2 * m * 3 * t
        assert all(sim.busy[r] == work for r in range(p))
        assert sim.period - work == zero_bubble_idle("zb-v", p, m, t, t, t) == 0
        assert sim.makespan - work == (p - 1) * t  # the slant, with the step synchronised
    with pytest.raises(ValueError, match="T_F = T_B = T_W"):
        zero_bubble_idle("zb-v", p, 2 * p, 2, 1, 1)


def test_zb_v_needs_two_chunks_per_rank():
    for v in (1, 3):
        with pytest.raises(ValueError, match="places two chunks per rank in a V"):
            S.build("zb-v", 2, 4, v)
    assert "F0.1" in S.table(S.build("zb-v", 2, 4, 2)) and "W3.0" in S.table(S.build("zb-v", 2, 4, 2))
    plans = {r: S.forward_only(3, 4, 2, r, shape="v") for r in range(3)}
    sim = simulate(plans, 4, 2, forward_only=True, shape="v")
    # all of chunk 0, then all of chunk 1: the way down and back up is filled once, 2 (p - 1) idle
    assert sim.messages == 4 * 5 and sim.makespan == 2 * 4 + 2 * (3 - 1)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("bf16", [False, True])
def test_zero_3_with_a_split_backward_gives_1f1bs_gradients_bit_for_bit(schedule, bf16):
    """ZeRO-3 releases a unit's parameters after each use; W, which reads none of them (dW = g^T x),
    comes after the unit's backward, perhaps after the group's buffer went out with an earlier W:
    its gradients then get a buffer of their own. On one rank (a DP group of 1) the sharded
    gradients, and the parameters after a step, are those of ZeRO-3 under 1F1B bit for bit: in
    float64, and with bf16 weights and fp32 gradients, where W's gradients made before their
    group's buffer are summed in fp32 too (the tied embedding's two parts, the head's and the
    lookup's, were added in bf16 first, 1e-3 apart)."""
    import numpy as np

    import minipar
    from minipar.models import GPT, GPTConfig
    from minipar.parallel import ProcessGrid
    from minipar.parallel.optimizers import make_optimizer
    from minipar.parallel.pipeline.executor import PipelineExecutor
    from minipar.precision import from_flags

    dtype, policy, scaler = from_flags("float32" if bf16 else "float64", bf16=bf16,
                                       accumulate_allreduce_grads_in_fp32=bf16)
    minipar.set_default_dtype(dtype)
    try:
        config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.2)
        x = np.random.default_rng(1).integers(0, 32, (6, 8))
        grads, params = [], []
        for name in ("1f1b", schedule):
            minipar.manual_seed(0)
            grid = ProcessGrid(1, 1)
            model = GPT(config, grid)
            opt = make_optimizer(model, grid, 3, policy=policy, scaler=scaler, lr=1e-2)
            PipelineExecutor(model, grid, name, micro_batches=3, optimizer=opt).step(x, x)
            whole = getattr(opt, "inner", opt).full_gradients()  # {id(parameter): its gradient, as summed}
            grads.append([whole[id(p)] for p in model.parameters()])
            opt.step()
            params.append(opt.full_state_dict())
        for a, b in zip(*grads, strict=True):
            assert a.dtype == (np.float32 if bf16 else np.float64) and np.array_equal(a, b)
        for n in params[0]:
            assert np.array_equal(params[0][n], params[1][n]), n
    finally:
        minipar.set_default_dtype("float32")
