"""The trainer's pipeline bubble from per-stage summaries (``stage_times``): on a simulated step
it is the simulator's own bubble, the formula's for equal stages, never a rank's idle share of its
own span; the replay with the stages' costs gives back the simulated step's bubble."""

from fractions import Fraction

import numpy as np
import pytest

from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline import stage_times
from minipar.parallel.pipeline.simulate import simulate, theoretical_bubble


def table_of(sim, v):
    """What the trainer's all-reduce holds after a step that ran like ``sim``: one summary per stage.
    The executor's timeline starts with the step's first instruction, on a later stage a receive
    posted at the start; the simulator's lists only forwards and backwards."""
    start = [(S.RECV_ACT, 0, 0, 0.0, 0.0)]
    return np.stack([stage_times.summary(start + [(op, mb, c, float(s), float(e)) for op, mb, c, s, e in sim.timeline[r]], v)
                     for r in sorted(sim.timeline)])


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 2, 8, 1), ("1f1b", 2, 8, 1), ("1f1b", 4, 8, 1),
                                        ("interleaved", 2, 4, 2)])
def test_equal_stages_measure_the_formula(name, p, m, v):
    sim = simulate(S.build(name, p, m, v), m, v)
    table = table_of(sim, v)
    assert stage_times.bubble(table) == pytest.approx(float(theoretical_bubble(p, m, v)), rel=1e-12)
    # each rank against its own span would read less: the last stage starts waiting, ends early
    own = np.mean(1 - table[:, 0] / table[:, 1])
    assert own < 0.8 * float(theoretical_bubble(p, m, v))
    assert stage_times.expected(name, m, v, table, split=False) == pytest.approx(float(theoretical_bubble(p, m, v)))


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)])
def test_the_replay_with_measured_costs_gives_back_the_step(name, v):
    """Stages of unequal cost (the last slower, as when it runs the head and the loss): the table
    holds each one's median costs, and replaying them gives the step's bubble, above the formula."""
    p, m = 2, 8
    split = name in ("zb-h1", "zb-v")
    slow = {(r, c): Fraction(3 + r, 2) for r in range(p) for c in range(v)}
    sim = simulate(S.build(name, p, m, v), m, v, forward=slow, backward=slow, weight=slow if split else None,
                   shape=S.shape_of(name))
    table = table_of(sim, v)
    costs = stage_times.costs_ms(table, v)
    assert costs["forward"] == [[1500.0] * v, [2000.0] * v] and costs["backward"] == costs["forward"]
    assert costs["weight"] == (costs["forward"] if split else [[0.0] * v] * p)
    measured = stage_times.bubble(table)
    assert measured == pytest.approx(float(sum(sim.bubble.values()) / p), rel=1e-12)
    assert stage_times.expected(name, m, v, table, split) == pytest.approx(measured, rel=1e-9)
    if not split:
        assert measured > float(theoretical_bubble(p, m, v))


def test_no_replay_without_a_pipeline_or_past_the_limit():
    one = np.array([[1.0, 1.0, 0.5, 0.5, 0.0]])
    assert stage_times.bubble(one) == 0.0 and stage_times.expected("1f1b", 4, 1, one, split=False) is None
    many = np.ones((64, 5))
    assert stage_times.expected("1f1b", stage_times.SIMULATE_UP_TO, 1, many, split=False) is None
