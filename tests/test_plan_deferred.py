"""The planner's step time for a pipeline that runs weight gradients at the flush
(--defer-embedding-wgrad-compute, --defer-wgrad-linears K): the schedule's own instruction lists
replayed with each chunk's FLOPs (``plan.deferred``), the deferred W's at the flush."""

from dataclasses import replace
from fractions import Fraction

import pytest

from minipar.mfu import flops_per_token
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.simulate import simulate, theoretical_bubble
from minipar.plan.cost import predict
from minipar.plan.shapes import Layout, Machine, Model

BENCH = Model(4, 128, 4, 128, 256)  # bench/scaling.py's dense model: 2 stages, 8 micro-batches of 2
PLAIN = Layout(pp=2, micro_batch_size=2, schedule="1f1b")


def deferring(k):
    return replace(PLAIN, defer_embedding_wgrad=True, defer_wgrad_linears=k)


def replayed(k):
    """The bubble of bench/scaling.py's ``1f1b+defer+k``, replayed here by hand: two blocks a stage,
    the head's 6 V h on the last; deferred, the head's W (2 V h) and the last k of the MLP's c_proj
    (8 h^2), c_fc (8 h^2), attention's c_proj (2 h^2) and c_attn (6 h^2) W's."""
    h, T, V = 128, 128, 256
    stage = [2 * flops_per_token(1, h, T, 0), 2 * flops_per_token(1, h, T, 0) + 6 * V * h]
    head = 2 * V * h + sum((8, 8, 2, 6)[:k]) * h * h
    sim = simulate(schedules.build("1f1b", 2, 8, 1, defer_head=True), 8, forward={(r, 0): stage[r] for r in (0, 1)},
                   backward={(r, 0): 2 * stage[r] for r in (0, 1)}, head={(0, 0): 0, (1, 0): 3 * head})
    return sum(sim.bubble.values()) / 2


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_deferring_layouts_bubble_is_its_schedule_replayed_with_the_ws_at_the_flush(k):
    p = predict(BENCH, deferring(k), Machine(gpus=2), 16)
    assert p.bubble == pytest.approx(float(replayed(k)), rel=1e-12)
    assert "flush" in p.bubble_source


def test_deferring_shortens_the_predicted_step_as_measured():
    """docs/benchmarks.md, bench/scaling.py on 2 ranks: plain 1F1B's bubble 0.133 measured (its
    head makes the last stage the slow one), with the head's W at the flush 0.127, with one or two
    linear layers' W's too 0.110 and 0.109, against the equal-stage formula's 0.111; steps 55.2,
    54.3, 53.5 and 54.4 ms. The replay: 0.117, 0.079, 0.098 (bench/scaling.py's "its FLOPs"
    column); the planner gave every one of them plain 1F1B's step before it read the flags."""
    machine = Machine(gpus=2)
    plain = predict(BENCH, PLAIN, machine, 16)
    head, one, two = (predict(BENCH, deferring(k), machine, 16) for k in (0, 1, 2))
    assert plain.bubble == float(theoretical_bubble(2, 8))  # (its imbalance multiplied in apart)
    assert [round(p.bubble, 3) for p in (head, one, two)] == [0.117, 0.079, 0.098]
    assert one.bubble < two.bubble < float(Fraction(1, 9)) < head.bubble
    assert one.step_time_s < two.step_time_s < head.step_time_s < plain.step_time_s
    assert one.step_time_s / plain.step_time_s == pytest.approx(0.956, abs=1e-3)  # measured 53.5 / 55.2 = 0.969


def test_gpt2s_heavy_head_left_at_the_flush_shortens_every_flushing_schedule():
    """GPT-2 on two stages: the head is 4.5 blocks, so its W (a third of it) at the flush takes 1.5
    blocks' work out of the slow stage's steady state, whatever the order of the flushed schedule."""
    gpt2, machine = Model(12, 768, 12, 1024, 50257), Machine(gpus=2)
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("1f1b-slack", 1), ("interleaved", 2)):
        plain = Layout(pp=2, vpp=v, schedule=schedule)
        before, after = (predict(gpt2, layout, machine, 8)
                         for layout in (plain, replace(plain, defer_embedding_wgrad=True)))
        assert after.step_time_s < before.step_time_s, schedule
