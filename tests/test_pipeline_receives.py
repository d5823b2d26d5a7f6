"""The executor posts each receive ahead of the compute before it (``pipeline/receives.py``).

``PostedReceives`` alone is tested in test_pipeline.py; this drives the real ``PipelineExecutor``
on one stage of a 3-stage pipeline, one process, with a communicator that only records: when each
receive went up (``irecv``), when it was waited on, and where each compute instruction ran between
them. The data it hands back are arbitrary numbers of the agreed shape: only the order is tested.
An executor that posts each receive at its wait (``state.receives = None``) runs the same maths
and passes every numerical test; it fails here.
"""

import numpy as np
import pytest

import minipar
from minipar.models import GPT, GPTConfig
from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline.executor import PipelineExecutor

RECEIVES = (S.RECV_ACT, S.RECV_GRAD)


class Request:
    def __init__(self, log, out, done):
        self.log, self.out, self.done = log, out, done

    def test(self):
        if self.out is not None:  # a receive, tested between instructions (left unfinished here)
            self.log.append(("test", self))
            return False
        return True

    def wait(self):
        if self.out is not None:  # a receive: logged, and filled as the message would fill it
            self.log.append(("wait", self))
            self.out[...] = np.random.default_rng(len(self.log)).standard_normal(self.out.shape) * 0.1
        return self.out


class RecordingComm:
    """The pipeline group as the executor uses it: ``irecv``/``isend`` and their requests."""

    def __init__(self, log):
        self.log = log

    def irecv(self, out, source, tag=0):
        request = Request(self.log, out, False)
        self.log.append(("post", request, tag))
        return request

    def isend(self, x, dest, tag=0):
        return Request(self.log, None, True)


class Grid:
    """Stage ``pp_rank`` of ``pp``, no other parallelism; its pipeline group records."""

    tp_group = cp_group = dp_group = embedding_group = None
    tp = cp = dp = ep = 1
    tp_rank = cp_rank = dp_rank = 0

    def __init__(self, pp, pp_rank, comm):
        self.pp, self.pp_rank, self.pp_group = pp, pp_rank, comm
        self.layout = minipar.parallel.Layout(1, pp, 1)


def run_recorded(schedule, pp, rank, m):
    """One step of ``schedule`` on stage ``rank``: (its instructions, the log). The log holds
    ("post", request, tag), ("test", request), ("wait", request) and ("compute", instruction) in
    the order they ran."""
    log = []
    minipar.manual_seed(0)
    grid = Grid(pp, rank, RecordingComm(log))
    model = GPT(GPTConfig(n_layer=pp, n_head=2, n_embd=16, block_size=8, vocab_size=32), grid)
    run = PipelineExecutor(model, grid, schedule, micro_batches=m)
    for op in S.COMPUTE:  # the seam: one method per instruction kind
        if op in run._handlers:
            def logged(state, ins, handler=run._handlers[op]):
                log.append(("compute", ins))
                handler(state, ins)
            run._handlers[op] = logged
    x = np.random.default_rng(1).integers(0, 32, (2 * m, 8))
    run.step(x, x)
    return run, log


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_the_executor_posts_each_receive_ahead_of_the_compute_before_it(schedule, rank):
    m = 4
    run, log = run_recorded(schedule, 3, rank, m)
    wanted = [ins for ins in run.instructions if ins.op in RECEIVES]
    tag_of = {run._tag(ins): ins for ins in wanted}
    posted = {e[1]: (k, tag_of[e[2]]) for k, e in enumerate(log) if e[0] == "post"}
    waited = [(k, e[1]) for k, e in enumerate(log) if e[0] == "wait"]
    # every receive went up once, was waited on once, in the schedule's order, and was the message it is for
    assert len(posted) == len(wanted) and [posted[request][1] for _, request in waited] == wanted
    post_at = {posted[request][1]: posted[request][0] for _, request in waited}
    wait_at = {posted[request][1]: k for k, request in waited}
    compute_at = {e[1]: k for k, e in enumerate(log) if e[0] == "compute"}
    checked = 0
    for kind, work in ((S.RECV_ACT, S.FORWARD), (S.RECV_GRAD, S.BACKWARD)):
        mine = [ins for ins in wanted if ins.op == kind]
        for before, after in zip(mine, mine[1:]):
            # micro-batch i+1's message is up before micro-batch i's is waited on, so before the
            # forward (backward) of i runs: its message can arrive meanwhile, and is taken in at
            # the next MPI call (receives.py), not only at its own wait
            assert post_at[after] < wait_at[before], (rank, after, before)
            assert post_at[after] < compute_at[S.Instruction(work, before.mb, before.chunk)], (rank, after)
            checked += 1
        # and, more generally, before the last compute instruction that ran ahead of its wait
        for ins in mine[1:]:
            last_compute = max(k for k in compute_at.values() if k < wait_at[ins])
            assert post_at[ins] < last_compute, (rank, ins)
    # and never further ahead than one of its kind: two message buffers at most, whatever m is
    for ins in wanted:
        up = [r for r in wanted if r.op == ins.op and post_at[r] < wait_at[ins] and wait_at[r] > wait_at[ins]]
        assert len(up) <= 1, (rank, ins, up)
    # between instructions the executor tests the receives posted (the sends here finish at once,
    # so their tests would move nothing): each one ahead is tested after a compute, before its wait
    tested = {}
    for k, e in enumerate(log):
        if e[0] == "test":
            tested.setdefault(posted[e[1]][1], []).append(k)
    for kind in RECEIVES:
        for ins in [r for r in wanted if r.op == kind][1:]:
            first_compute = min(k for k in compute_at.values() if k > post_at[ins])
            assert any(first_compute < t < wait_at[ins] for t in tested.get(ins, [])), (rank, ins)
    # the first and last stages receive one kind, the middle both: m - 1 of each kind ahead
    assert checked == (m - 1) * (2 if rank == 1 else 1)
