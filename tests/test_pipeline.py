"""Pipeline schedules on paper (no MPI): every schedule free of deadlock, with sends and receives
paired, each backward after its forward, the bubble exactly the formula and the activations held
as the papers say; the simulator catches broken schedules; timelines are written as Chrome traces
and pictures; each receive is posted ahead. The executor on one process: test_pipeline_executor.py."""

import json
from fractions import Fraction

import numpy as np
import pytest

from minipar.models import GPT, GPTConfig
from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline import trace
from minipar.parallel.pipeline.simulate import simulate, theoretical_bubble

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
