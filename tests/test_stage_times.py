"""The trainer's pipeline bubble from per-stage summaries (``stage_times``): on a simulated step it
is the simulator's own bubble, the formula's for equal stages, never a rank's idle share of its own
span; replaying the summaries' durations gives back the step, a slow micro-batch included."""

from fractions import Fraction

import numpy as np
import pytest

from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline import stage_times, trace
from minipar.parallel.pipeline.simulate import simulate, theoretical_bubble


def table_of(sim, p, v, m):
    """What the trainer's all-reduce holds after a step that ran like ``sim``: one summary per stage.
    The executor's timeline starts with the step's first instruction, on a later stage a receive
    posted at the start; the simulator's lists only forwards and backwards."""
    start = [(S.RECV_ACT, 0, 0, 0.0, 0.0)]
    timelines = [start + [(op, mb, c, float(s), float(e)) for op, mb, c, s, e in sim.timeline[r]] for r in range(p)]
    return np.stack([stage_times.summary(timeline, p, v, m) for timeline in timelines])


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 2, 8, 1), ("1f1b", 2, 8, 1), ("1f1b", 4, 8, 1),
                                        ("interleaved", 2, 4, 2)])
def test_equal_stages_measure_the_formula(name, p, m, v):
    sim = simulate(S.build(name, p, m, v), m, v)
    table = table_of(sim, p, v, m)
    formula = float(theoretical_bubble(p, m, v))
    assert stage_times.bubble(table) == pytest.approx(formula, rel=1e-12)
    # each rank against its own span would read less: the last stage starts waiting, ends early
    assert np.mean(1 - table[:, 0] / table[:, 1]) < 0.8 * formula
    assert stage_times.expected(name, v, m, table) == pytest.approx(formula)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)])
def test_the_replay_gives_back_the_step_a_slow_micro_batch_included(name, v):
    """A slower last stage (as when it runs the head and the loss) and one forward that took five
    times its usual time (the core lent to another process): the replay of the summaries'
    durations is the step exactly; the logged medians do not see the slow one."""
    p, m = 2, 8
    split = name in ("zb-h1", "zb-v")
    slow = {(r, c): Fraction(3 + r, 2) for r in range(p) for c in range(v)}
    late = {(0, S.FORWARD, 3, 0): Fraction(15, 2)}
    sim = simulate(S.build(name, p, m, v), m, v, forward=slow, backward=slow, weight=slow if split else None,
                   shape=S.shape_of(name), durations=late)
    steady = simulate(S.build(name, p, m, v), m, v, forward=slow, backward=slow, weight=slow if split else None,
                      shape=S.shape_of(name))
    table = table_of(sim, p, v, m)
    costs = stage_times.costs_ms(table, v, m)
    assert costs["forward"] == [[1500.0] * v, [2000.0] * v] and costs["backward"] == costs["forward"]
    assert trace.op_costs(sim.timeline)[S.FORWARD] == slow  # op_costs' medians leave it out too
    assert costs["weight"] == (costs["forward"] if split else [[0.0] * v] * p)
    measured = stage_times.bubble(table)
    assert measured == pytest.approx(float(sum(sim.bubble.values()) / p), rel=1e-12)
    assert stage_times.expected(name, v, m, table) == pytest.approx(measured, rel=1e-9)
    # the medians' replay is the steady step: the slow forward moved the bubble (in 1F1B up; a
    # zero-bubble schedule partly fills its idle time with it)
    assert measured != pytest.approx(float(sum(steady.bubble.values()) / p), rel=1e-3)
    assert name != "1f1b" or measured > float(sum(steady.bubble.values()) / p)


def test_no_durations_without_a_pipeline_past_the_limit_or_for_pipedream():
    timeline = [(S.FORWARD, 0, 0, 0.0, 1.0), (S.BACKWARD, 0, 0, 1.0, 3.0)]
    one = stage_times.summary(timeline, 1, 1, 1)[None]
    assert one.shape == (1, 2) and stage_times.bubble(one) == 0.0
    assert stage_times.expected("1f1b", 1, 1, one) is None
    m = stage_times.SIMULATE_UP_TO // 2 + 1
    assert stage_times.width(2, 1, m) == 2 and stage_times.width(2, 1, None) == 2
    assert stage_times.width(2, 1, m - 1) == 2 + 3 * (m - 1)  # at the limit itself durations still travel
    assert stage_times.expected("1f1b", 1, m, np.ones((2, 2))) is None


@pytest.mark.parametrize("name,p,m,v", [("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("zb-v", 2, 8, 2),
                                        ("zb-h2", 3, 6, 1)])
def test_random_durations_come_back_through_the_table(name, p, m, v):
    """Every instruction its own random duration: the table keeps each in its (kind, chunk,
    micro-batch) place, so the replay is the step to rounding."""
    rng = np.random.default_rng(7)
    split = name.startswith("zb")
    plan = S.build(name, p, m, v)
    durations = {(r, ins.op, ins.mb, ins.chunk): Fraction(int(rng.integers(500, 3000)), 1000)
                 for r, s in plan.items() for ins in s if ins.op in S.COMPUTE}
    sim = simulate(plan, m, v, weight=1 if split else None, shape=S.shape_of(name), durations=durations)
    table = table_of(sim, p, v, m)
    assert stage_times.expected(name, v, m, table) == pytest.approx(stage_times.bubble(table), rel=1e-9)
