"""Pipeline schedules on paper (no MPI): every schedule free of deadlock, with sends and receives
paired, each backward after its forward, the bubble exactly the formula and the activations held
as the papers say; the simulator catches broken schedules; the executor on a 1-stage grid equals
plain gradient accumulation; timelines are written as Chrome traces and pictures."""

import json
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest

import minipar
from minipar.models import GPT, GPTConfig
from minipar.nn import Linear, ModuleList
from minipar.parallel import ProcessGrid
from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline import trace
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.pipeline.simulate import simulate, theoretical_bubble
from minipar.parallel.zero2 import ZeRO2
from minipar.parallel.zero3 import ZeRO3

CASES = [(name, p, m, v) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 6, 8, 12)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("1f1b-slack", 1), ("interleaved", 2), ("interleaved", 3))
         if name != "interleaved" or m % p == 0]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_schedule_runs_to_the_end_with_the_formula_bubble(name, p, m, v):
    sim = simulate(S.build(name, p, m, v), m, v)  # raises on deadlock or unpaired messages
    assert all(b == theoretical_bubble(p, m, v) for b in sim.bubble.values())
    assert sim.makespan == 3 * (v * m + p - 1)  # forward 1 + backward 2 per chunk-time
    assert sim.messages == 2 * m * (p * v - 1)  # an activation and a gradient per chunk boundary
    expected = {"gpipe": [m] * p, "1f1b": [min(p - r, m) for r in range(p)],
                "1f1b-slack": [min(p - r + (r < p - 1), m) for r in range(p)]}.get(
        name, [min((p - r - 1) * 2 + (v - 1) * p + 1, v * m) for r in range(p)])
    assert [sim.peak_alive[r] for r in range(p)] == expected


@pytest.mark.parametrize("p", [2, 4])
def test_slack_absorbs_a_late_instruction_that_stalls_1f1b(p):
    """In 1F1B's steady state every message arrives just in time, so one late instruction there
    on the first rank lengthens the whole step; 1F1B-slack's extra forward in flight takes it up
    (its first forward and last backward delay both, as docs/pipeline_parallel.md says). Over many steps
    whose every forward and backward runs up to 20% long or short (a shared machine), its bubble
    stays near the formula where 1F1B's grows."""
    m = 8
    steady = 3 * (m + p - 1)  # F = 1, B = 2
    for late in [(0, S.FORWARD, 4, 0), (0, S.BACKWARD, 3, 0)]:
        durations = {late: (1 if late[1] == S.FORWARD else 2) + 1}
        spans = [simulate(S.build(name, p, m), m, durations=durations).makespan for name in ("1f1b", "1f1b-slack")]
        assert spans == [steady + 1, steady], (late, spans)
    rng = np.random.default_rng(0)
    mean = {"1f1b": 0.0, "1f1b-slack": 0.0}
    for _ in range(50):
        took = {(r, op, mb, 0): Fraction(round(1000 * cost * rng.uniform(0.8, 1.2)), 1000)
                for r in range(p) for op, cost in ((S.FORWARD, 1), (S.BACKWARD, 2)) for mb in range(m)}
        for name in mean:
            mean[name] += float(sum(simulate(S.build(name, p, m), m, durations=took).bubble.values())) / p / 50
    formula = float(theoretical_bubble(p, m, 1))
    assert mean["1f1b-slack"] < 1.03 * formula and mean["1f1b"] > 1.05 * mean["1f1b-slack"], (mean, formula)


@pytest.mark.parametrize("p,m,v", [(1, 3, 1), (2, 4, 1), (4, 8, 2), (3, 6, 3)])
def test_forward_only_schedules_run_every_micro_batch_through_every_chunk(p, m, v):
    plans = {r: S.forward_only(p, m, v, r) for r in range(p)}
    sim = simulate(plans, m, v, forward_only=True)
    assert all(i.op != S.BACKWARD for s in plans.values() for i in s)
    assert sim.messages == m * (p * v - 1) and sim.makespan == v * m + p - 1


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 3, 6, 1), ("interleaved", 4, 8, 2)])
def test_the_costs_are_inputs_and_the_unit_costs_the_default(name, p, m, v):
    plans = S.build(name, p, m, v)
    unit = simulate(plans, m, v)
    assert simulate(plans, m, v, forward=1, backward=2, recompute=0).timeline == unit.timeline
    every = [(r, c) for r in range(p) for c in range(v)]
    as_dicts = simulate(plans, m, v, forward=dict.fromkeys(every, 1), backward=dict.fromkeys(every, 2))
    assert as_dicts.timeline == unit.timeline
    # backward = forward (about what this engine measures): the same fraction, a shorter step
    equal = simulate(plans, m, v, forward=1, backward=1)
    assert all(b == theoretical_bubble(p, m, v) for b in equal.bubble.values())
    assert equal.makespan == 2 * (v * m + p - 1)
    # recompute: one more forward in each backward, a third more time, the same fraction
    again = simulate(plans, m, v, recompute=1)
    assert all(b == theoretical_bubble(p, m, v) for b in again.bubble.values())
    assert again.makespan == 4 * (v * m + p - 1)
    # measured costs come back from a timeline exactly
    odd = {k: Fraction(3 + k[0], 2 + k[1]) for k in every}
    sim = simulate(plans, m, v, forward=odd, backward={k: 2 * c for k, c in odd.items()}, recompute=Fraction(1, 7))
    costs = trace.op_costs(sim.timeline)
    assert costs[S.FORWARD] == odd and costs[S.BACKWARD] == {k: 2 * c + Fraction(1, 7) for k, c in odd.items()}


def test_a_slower_last_stage_makes_the_bubble_larger_than_the_formula():
    # GPipe, 2 stages, 2 micro-batches; rank 1's chunk costs twice rank 0's. By hand: rank 0 runs
    # F0 0-1, F1 1-2; rank 1 F0 1-3, F1 3-5, B0 5-9, B1 9-13; rank 0 B0 9-11, B1 13-15.
    sim = simulate(S.build("gpipe", 2, 2), 2, forward={(0, 0): 1, (1, 0): 2}, backward={(0, 0): 2, (1, 0): 4})
    assert sim.makespan == 15
    assert sim.bubble == {0: Fraction(9, 15), 1: Fraction(3, 15)}
    assert sum(sim.bubble.values()) / 2 == Fraction(2, 5) > theoretical_bubble(2, 2) == Fraction(1, 3)
    with pytest.raises(ValueError, match="no cost given"):
        simulate(S.build("gpipe", 2, 2), 2, forward={(0, 0): 1})
    with pytest.raises(ValueError, match=">= 0"):
        simulate(S.build("gpipe", 2, 2), 2, recompute=-1)


def test_bubble_formulas_by_hand():
    assert theoretical_bubble(4, 8) == Fraction(3, 11)
    assert theoretical_bubble(4, 8, 2) == Fraction(3, 19)


def test_one_f_one_b_order_of_the_papers():
    s = S.one_f_one_b(4, 6, 1)
    compute = [str(i) for i in s if i.op in (S.FORWARD, S.BACKWARD)]
    assert compute[:5] == ["forward(0,0)", "forward(1,0)", "forward(2,0)", "backward(0,0)", "forward(3,0)"]
    assert s[-1].op == S.STEP
    assert str(s[0]) == "recv_act(0,0)" and str(s[2]) == "send_act(0,0)"  # rank 1: receive, run, send


def test_interleaved_places_chunks_round_robin():
    s = S.interleaved_one_f_one_b(4, 8, 2, 0)
    forwards = [(i.mb, i.chunk) for i in s if i.op == S.FORWARD]
    # micro-batches in groups of p through chunk 0, then the same group through chunk 1
    assert forwards[:8] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)]
    pipe = S.Pipeline(4, 8, 2)
    assert [pipe.global_chunk(0, c) for c in range(2)] == [0, 4] and pipe.place(5) == (1, 1)
    assert "F0.1" in S.table({0: s}) and "rank 0" in S.table({0: s})


def test_the_simulator_catches_broken_schedules():
    good = S.build("1f1b", 2, 2)
    backward_first = {**good, 1: [S.Instruction(S.BACKWARD, 0, 0)] + good[1]}  # the last stage
    with pytest.raises(RuntimeError, match="backward .* before its forward"):
        simulate(backward_first, 2)
    waits_forever = {**good, 0: [S.Instruction(S.RECV_GRAD, 0, 0)] + good[0]}
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(waits_forever, 2)
    unsent = {**good, 1: [i for i in good[1] if i.op != S.SEND_GRAD]}
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(unsent, 2)
    sent_twice = {**good, 0: [good[0][0], good[0][1]] + good[0]}  # forward(0) and its send, again
    with pytest.raises(RuntimeError, match="twice"):
        simulate(sent_twice, 2)
    unreceived = {**good, 1: [i for i in good[1] if not (i.op == S.RECV_ACT and i.mb == 1)]}
    with pytest.raises(RuntimeError, match="pair up"):
        simulate(unreceived, 2)
    one_stage = S.build("1f1b", 1, 2)
    with pytest.raises(RuntimeError, match="does not run every micro-batch once"):
        simulate({0: [i for i in one_stage[0] if i.mb != 1]}, 2)  # micro-batch 1 left out
    split = S.build("zb-h1", 2, 2)
    first_b = next(n for n, i in enumerate(split[0]) if i.op == S.BACKWARD_INPUT)
    b_twice = {**split, 0: split[0][: first_b + 1] + split[0][first_b:]}
    with pytest.raises(RuntimeError, match="twice"):
        simulate(b_twice, 2, weight=1)


@pytest.mark.parametrize("call,message", [
    (lambda: S.build("interleaved", 4, 6, 2), "not divisible by p=4"),
    (lambda: S.build("1f1b", 4, 8, 2), "v=2 needs schedule='interleaved'"),
    (lambda: S.build("zigzag", 4, 8), "unknown pipeline schedule"),
    (lambda: S.check(4, 8, 2, n_layer=12, interleaved=True), "n_layer=12 is not divisible by p x v"),
    (lambda: S.check(0, 8), "p must be a positive integer, got 0"),
])
def test_requirements_are_checked_up_front(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_every_dropout_of_the_model_has_its_own_key():
    """A mask is keyed by (layer, site): two dropouts with the same pair would drop alike."""
    from minipar.models.layers import CausalSelfAttention, Site
    from minipar.nn import Dropout

    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.1))
    keys = [(m.layer, m.site) for _, m in model.named_modules() if isinstance(m, Dropout)]
    keys += [(m.layer, Site.ATTENTION_PROBS) for _, m in model.named_modules() if isinstance(m, CausalSelfAttention)]
    assert len(keys) == 1 + 3 * 3 and len(set(keys)) == len(keys)


@pytest.mark.parametrize("schedule,recompute", [("gpipe", False), ("1f1b", True)])
def test_executor_on_one_stage_equals_the_whole_batch(schedule, recompute):
    """PP = 1: the schedule is plain gradient accumulation over micro-batches, with loss shares
    by token count (micro-batches of unequal counts) and dropout masks of the whole batch."""
    minipar.set_default_dtype("float64")
    try:
        config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.2)
        rng = np.random.default_rng(1)
        x, y = rng.integers(0, 32, (6, 8)), rng.integers(0, 32, (6, 8))
        y[0, :5] = -1
        minipar.manual_seed(0)
        serial = GPT(config)
        _, loss = serial(x, y)
        loss.backward()
        minipar.manual_seed(0)
        model = GPT(config, ProcessGrid(1, 1))
        run = PipelineExecutor(model, ProcessGrid(1, 1), schedule, micro_batches=3, recompute=recompute)
        record = run.step(x, y)
        assert abs(record.loss - loss.item()) < 1e-12
        for (n, p), q in zip(model.named_parameters(), serial.parameters()):
            np.testing.assert_allclose(p.grad, q.grad, rtol=1e-10, atol=1e-13, err_msg=n)
        assert record.peak_alive == (3 if schedule == "gpipe" else 1)
        serial.eval(), model.eval()
        with minipar.no_grad():
            assert abs(run.evaluate(x, y).loss - serial(x, y)[1].item()) < 1e-12
        bad_targets = y.copy()
        bad_targets[1, 1] = 32
        for xb, yb, message in ((x[:4], y[:4], "does not split into micro_batches=3"),
                                (x + 32, y, r"token ids must lie in \[0, 32\)"),
                                (x, bad_targets, "or be -1"),
                                (np.zeros((3, 9), np.int64), np.zeros((3, 9), np.int64), "exceeds block_size")):
            with pytest.raises(ValueError, match=message):
                run.step(xb, yb)
    finally:
        minipar.set_default_dtype("float32")


def test_an_instruction_without_a_method_is_refused_before_any_message(monkeypatch):
    """The executor dispatches by instruction kind, one method each: a schedule naming a kind it
    has no method for (a kind a schedule might add before its method exists) is refused at construction."""
    minipar.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32), ProcessGrid(1, 1))
    plain = S.build("1f1b", 1, 2)
    ahead = {0: plain[0][:-1] + [S.Instruction("forward_backward", 1, 0), plain[0][-1]]}
    monkeypatch.setattr(S, "build", lambda *args: ahead)
    with pytest.raises(ValueError, match=r"instructions \['forward_backward'\] that the executor has no method"):
        PipelineExecutor(model, ProcessGrid(1, 1), "1f1b", micro_batches=2)


class FakeGrid:
    """One stage of a pipeline as GPT and the executor see it at construction (no communicator:
    no embedding group, so nothing is broadcast)."""

    tp_group = cp_group = dp_group = embedding_group = None
    pp_group = object()
    tp = cp = dp = ep = 1
    tp_rank = cp_rank = dp_rank = 0

    def __init__(self, pp, pp_rank):
        self.pp, self.pp_rank, self.layout = pp, pp_rank, minipar.parallel.Layout(1, pp, 1)


def test_stages_hold_their_chunks_round_robin():
    config = GPTConfig(n_layer=16, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.1)
    held = {}
    for r in range(4):
        model = GPT(config, FakeGrid(4, r), virtual_stages=2)
        held[r] = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if ".h." in n})
        if r == 0:  # chunk 1 of rank 0 is global chunk 4: blocks 8, 9, which key their masks so
            assert [b.attn.layer for b in model.transformer.h] == [0, 1, 8, 9]
            assert "transformer.wpe.weight" in dict(model.named_parameters())
    assert held == {0: [0, 1, 8, 9], 1: [2, 3, 10, 11], 2: [4, 5, 12, 13], 3: [6, 7, 14, 15]}
    with pytest.raises(ValueError, match="message tags"):
        PipelineExecutor(model, FakeGrid(4, 3), "interleaved", micro_batches=4096)


def test_one_f_one_b_memory_does_not_grow_with_the_micro_batches():
    """1F1B on one stage holds one micro-batch at a time: quadrupling m (micro-batches of the same
    size) must not grow the step's peak memory, dropout masks included (each micro-batch draws
    only its own rows)."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=64, dropout=0.1)
    peaks = []
    for m in (2, 8):
        minipar.manual_seed(0)
        model = GPT(config, ProcessGrid(1, 1))
        for p in model.parameters():
            p.grad = np.zeros_like(p.data)
        x = np.random.default_rng(0).integers(0, 64, (2 * m, 32))
        run = PipelineExecutor(model, ProcessGrid(1, 1), "1f1b", micro_batches=m)
        tracemalloc.start()
        run.step(x, x)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.2 * peaks[0], f"peak bytes {peaks[0]:,} at m=2, {peaks[1]:,} at m=8"


def test_a_pipelined_model_refuses_whole_model_calls():
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32), FakeGrid(2, 1))
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.h.2.attn.c_attn.weight" in names and not any(".h.0." in n for n in names)
    assert "transformer.wte.weight" in names and "transformer.wpe.weight" not in names  # the tied head
    with pytest.raises(RuntimeError, match="pipeline stages"):
        model(np.zeros((1, 8), np.int64))
    for make in (lambda: ZeRO2(model, None), lambda: ZeRO3(model, None)):
        with pytest.raises(ValueError, match="with pipeline parallelism use stage=1"):
            make()  # refused before it touches a communicator
    with pytest.raises(ValueError, match="not divisible by PP x virtual_stages"):
        GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16), FakeGrid(2, 1))


def test_module_list_names_are_distinct():
    with pytest.raises(ValueError, match="distinct name"):
        ModuleList([Linear(2, 2), Linear(2, 2)], names=[8, 8])


def test_traces_and_pictures(tmp_path):
    sim = simulate(S.build("1f1b", 3, 4), 4)
    assert trace.bubble(sim.timeline) == {r: theoretical_bubble(3, 4) for r in range(3)}
    sim.timeline[0].append((S.STEP, -1, 0, sim.makespan, sim.makespan + 5))  # not pipeline idle
    assert trace.bubble(sim.timeline) == {r: theoretical_bubble(3, 4) for r in range(3)}
    trace.chrome_trace(sim.timeline, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 3 * 2 * 4 + 1 and {e["tid"] for e in slices} == {0, 1, 2}
    assert {e["name"] for e in slices if e["tid"] == 0} >= {"F0", "B3"}
    trace.gantt(sim.timeline, tmp_path / "g.png", "1f1b", unit="units")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_each_receive_is_posted_before_the_compute_ahead_of_it(name, v):
    from minipar.parallel.pipeline.receives import PostedReceives

    class Request:
        def __init__(self, ins, events):
            self.ins, self.events = ins, events

        def wait(self):
            self.events.append(("wait", self.ins))

    for rank, plan in S.build(name, 3, 6, v).items():
        events, posted_at = [], {}  # posted_at: the instruction index each receive went up before

        def post(ins):
            events.append(("post", ins))
            posted_at[ins] = k
            return Request(ins, events)

        k = 0
        receives = PostedReceives(plan, post)
        for k, ins in enumerate(plan):
            if ins.op in (S.RECV_ACT, S.RECV_GRAD):
                receives.take(ins)
        assert receives.pending() == 0
        wanted = [ins for ins in plan if ins.op in (S.RECV_ACT, S.RECV_GRAD)]
        assert [i for kind, i in events if kind == "wait"] == wanted  # each awaited once, in order
        for j, ins in enumerate(wanted):  # the next of its kind is up before this one is waited on
            following = [i for i in wanted[j + 1:] if i.op == ins.op][:1]
            assert all(events.index(("post", i)) < events.index(("wait", ins)) for i in following)
        # so every receive but the first of each kind went up with compute still to run before it
        for ins in wanted:
            if posted_at[ins] > 0:
                assert any(plan[t].op in S.COMPUTE for t in range(posted_at[ins], plan.index(ins))), (rank, ins)
    last = [ins for ins in plan if ins.op == S.RECV_ACT]
    with pytest.raises(RuntimeError, match="out of the schedule's order"):
        PostedReceives(plan, post).take(last[-1])
