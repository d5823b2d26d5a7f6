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


def replayed(k, schedule="1f1b", vpp=1, layers=(2, 2)):
    """The bubble of bench/scaling.py's ``1f1b+defer+k``, replayed here by hand: two blocks a stage,
    the head's 6 V h on the last; deferred, the head's W (2 V h) and the last k of the MLP's c_proj
    (8 h^2), c_fc (8 h^2), attention's c_proj (2 h^2) and c_attn (6 h^2) W's. ``layers``: each
    global chunk's blocks, chunk c of rank r the (c p + r)-th (the round-robin placement)."""
    h, T, V, p = 128, 128, 256, 2
    block, last = flops_per_token(1, h, T, 0), p * vpp - 1
    chunk = {(r, c): layers[c * p + r] * block + 6 * V * h * (c * p + r == last) for r in range(p) for c in range(vpp)}
    head = 2 * V * h + sum((8, 8, 2, 6)[:k]) * h * h
    sim = simulate(schedules.build(schedule, p, 8, vpp, defer_head=True), 8, vpp, forward=chunk,
                   backward={key: 2 * f for key, f in chunk.items()},
                   head={(r, c): 3 * head * (c * p + r == last) for r, c in chunk})
    return sum(sim.bubble.values()) / p


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_deferring_layouts_bubble_is_its_schedule_replayed_with_the_ws_at_the_flush(k):
    p = predict(BENCH, deferring(k), Machine(gpus=2), 16)
    assert p.bubble == pytest.approx(float(replayed(k)), rel=1e-12)
    assert "flush" in p.bubble_source


@pytest.mark.parametrize("k", [0, 2])
def test_an_interleaved_pipelines_bubble_is_its_replay_over_the_ranks(k):
    layout = replace(deferring(k), schedule="interleaved", vpp=2)  # one block a chunk
    p = predict(BENCH, layout, Machine(gpus=2), 16)
    assert p.bubble == pytest.approx(float(replayed(k, "interleaved", 2, (1, 1, 1, 1))), rel=1e-12)


@pytest.mark.parametrize("k", [0, 2])
def test_an_uneven_splits_bubble_is_its_replay_with_its_own_blocks(k):
    layout = replace(deferring(k), pipeline_layers=(1, 3))
    p = predict(BENCH, layout, Machine(gpus=2), 16)
    assert p.bubble == pytest.approx(float(replayed(k, layers=(1, 3))), rel=1e-12)
    assert p.bubble != pytest.approx(float(replayed(k)), rel=1e-6)  # (an even split's replay differs)


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
