"""PipeDream-2BW's order without MPI: 1F1B across batches with a step after each batch's last
backward, free of deadlock; the bubble amortised over the batches; the sizes it refuses."""

from fractions import Fraction
from types import SimpleNamespace

import pytest

from minipar.parallel import validate
from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline.pipedream import PipeDream2BW
from minipar.parallel.pipeline.simulate import simulate


def compute(plan):
    return [(i.op, i.mb) for i in plan if i.op in S.COMPUTE]


@pytest.mark.parametrize("p,m,batches", [(2, 2, 3), (4, 4, 4), (4, 3, 2), (8, 8, 3)])
def test_no_flush_is_1f1b_over_every_micro_batch_of_the_stream(p, m, batches):
    for r in range(p):
        plan = S.pipedream_2bw(p, m, r, batches)
        assert compute(plan) == compute(S.one_f_one_b(p, m * batches, r))
        steps = [k for k, i in enumerate(plan) if i.op == S.STEP]
        assert len(steps) == batches
        for b, at in enumerate(steps):  # each step right after its batch's last backward, before the next's
            done = [i.mb for i in plan[:at] if i.op == S.BACKWARD]
            assert max(done) == (b + 1) * m - 1 and len(done) == (b + 1) * m
            ahead = [i.mb for i in plan[:at] if i.op == S.FORWARD]
            assert max(ahead) < (b + 2) * m  # never a forward of the batch after next: two versions


@pytest.mark.parametrize("p,m,batches", [(2, 2, 3), (4, 4, 4), (8, 8, 3)])
def test_the_bubble_is_paid_once_per_stream(p, m, batches):
    """Unit costs (F 1, B 2): 1F1B's bubble (p - 1)/(m + p - 1) per step becomes (p - 1)/(k m + p - 1)
    over k batches without a flush."""
    sim = simulate({r: S.pipedream_2bw(p, m, r, batches) for r in range(p)}, m * batches)
    assert set(sim.bubble.values()) == {Fraction(p - 1, batches * m + p - 1)}
    flushed = simulate(S.build("1f1b", p, m), m)
    assert set(flushed.bubble.values()) == {Fraction(p - 1, m + p - 1)}


def test_fewer_micro_batches_than_stages_still_run():
    """m < p: the next batch's forwards cannot fill the whole warm-up, yet nothing deadlocks."""
    p, m = 4, 2
    sim = simulate({r: S.pipedream_2bw(p, m, r, 5) for r in range(p)}, m * 5)
    assert max(sim.bubble.values()) < Fraction(p - 1, m + p - 1)


def test_a_long_stream_reuses_two_bands_of_message_tags():
    """Batch t's messages are tagged in band 1 + t mod 2 (band 0: an evaluation's), so the two
    batches in flight never share a tag, and a stream of any length stays within the 6 m p tags
    checked against MPI's bound at the start."""
    p, m, batches = 2, 3, 6
    run = PipeDream2BW.__new__(PipeDream2BW)  # its tags alone: no model, no communicator
    run.m, run.pipe = m, S.Pipeline(p, m)
    for r in range(p):
        run.grid = SimpleNamespace(pp_rank=r)
        tags = {}
        for ins in S.pipedream_2bw(p, m, r, batches):
            if ins.op in (S.SEND_ACT, S.SEND_GRAD, S.RECV_ACT, S.RECV_GRAD):
                run._tag_batch, mb = divmod(ins.mb, m)
                tags.setdefault(run._tag_batch, set()).add(run._tag(S.Instruction(ins.op, mb, ins.chunk)))
        assert max(map(max, tags.values())) < 6 * m * p and min(map(min, tags.values())) >= 2 * m * p
        assert all(not tags[t] & tags[t + 1] for t in range(batches - 1))


@pytest.mark.parametrize("fields,message", [
    (dict(zero_stage=1), "needs zero_stage=0"),
    (dict(virtual_stages=2), "virtual_stages=2 needs schedule='interleaved'"),
])
def test_sizes_pipedream_2bw_cannot_take(fields, message):
    found = validate.problems(validate.RunConfig(pp=2, micro_batches=4, schedule="pipedream-2bw", **fields))
    assert len(found) == 1 and message in found[0], found
