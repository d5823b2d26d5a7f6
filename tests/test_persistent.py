"""Planned (persistent) collectives: their life (start, run, free, a wait interrupted, a plan
dropped) on a stand-in for MPI's request, the NCCL communicator's choice of form, and the MPI
script that runs them against the plain collectives on several ranks."""

import numpy as np
import pytest

from minipar.comm.base import Persistent, running_plans
from minipar.comm.mpi import MPICommunicator
from minipar.comm.persistent import MPIPersistent, _free
from mpi_run import check_mpi


class FakeRequest:
    """MPI's persistent request as the plan uses it: Start, Wait, Test, Free; ``finishes``: whether
    a started operation has finished by the next Test; ``interrupt``: raised once, by the next
    Wait or Test (a signal's handler)."""

    def __init__(self, finishes=True):
        self.calls, self.active, self.finishes, self.interrupt = [], False, finishes, None

    def _interrupted(self):
        interrupt, self.interrupt = self.interrupt, None
        if interrupt is not None:
            raise interrupt

    def Start(self):
        assert not self.active, "MPI: a persistent request started while active"
        self.calls.append("Start")
        self.active = True

    def Wait(self):
        self.calls.append("Wait")
        self._interrupted()
        self.active = False

    def Test(self):
        self.calls.append("Test")
        self._interrupted()
        if self.finishes:
            self.active = False
        return not self.active

    def Free(self):
        assert not self.active, "MPI: a running collective freed"
        self.calls.append("Free")

    def __ne__(self, other):  # never MPI.REQUEST_NULL
        return True


class Interrupted(BaseException):
    """What a signal's handler raises (KeyboardInterrupt itself would end pytest's session)."""


class FakeComm:
    def __init__(self, polite):
        from minipar.comm.stats import CommStats

        self.stats, self.polite = CommStats(2), polite


@pytest.mark.parametrize("polite", [False, True])
def test_a_plan_runs_one_start_at_a_time_and_none_after_free(polite):
    request, x = FakeRequest(), np.ones(4)
    plan = MPIPersistent(FakeComm(polite), "all_reduce", x.nbytes, x, request)
    assert plan.run() is x
    ran = list(request.calls)
    assert plan.start().wait() is x
    # a rank sharing its core polls (Test) and yields it; one with a core to itself waits in MPI's
    # Wait, which spins: in run() and in a started plan's wait() alike
    assert ("Wait" in ran) != polite and ("Wait" in request.calls[len(ran):]) != polite
    started = plan.start()
    with pytest.raises(RuntimeError, match="planned all_reduce: started again before its last start finished"):
        plan.run()
    with pytest.raises(RuntimeError, match="free\\(\\) while a start is running; wait for it first"):
        plan.free()
    assert plan in running_plans  # dropped by the caller, it would still be written into
    started.wait()
    assert plan not in running_plans and not plan.running
    assert plan._tally.calls == 3 and plan._tally.nbytes == 3 * x.nbytes  # each start counted once
    plan.free()
    assert request.calls[-2:] == ["Test", "Free"]
    with pytest.raises(RuntimeError, match="planned all_reduce: started after free\\(\\)"):
        plan.start()
    plan.free()  # a second free does nothing
    assert request.calls.count("Free") == 1


def test_a_blocking_wait_ends_its_request_without_asking_mpi_again():
    """A rank with a core to itself waits in MPI's Wait; once it returns the start is over: no Test
    after it, none at a later test() or wait() of the same Request (which, on a plan started
    again since, would ask about the new start), ``then`` run once, the buffers let go."""
    from minipar.comm.base import Request

    request, x = FakeRequest(), np.ones(4)
    plan = MPIPersistent(FakeComm(False), "all_reduce", x.nbytes, x, request)
    started = plan.start()
    assert started.wait() is x and request.calls == ["Start", "Wait"] and not plan.running
    assert started.test() and started.wait() is x and request.calls == ["Start", "Wait"]
    ran, kept = [], np.ones(2)
    done = Request(request.Test, x, keep=kept, then=lambda: ran.append(1), block=lambda: None)
    assert done.wait() is x and done.wait() is x and done.test() and ran == [1]
    assert done._keep is None and request.calls == ["Start", "Wait"]


@pytest.mark.parametrize("polite", [False, True])
def test_an_interrupted_run_leaves_the_start_running_until_the_plan_is_waited_on(polite):
    """It was marked running with nothing left to wait on: never to start or be freed again."""
    request, x = FakeRequest(finishes=False), np.ones(4)
    plan = MPIPersistent(FakeComm(polite), "all_gather", x.nbytes, x, request)
    request.interrupt = Interrupted()  # as it waits in MPI's Wait, or as it polls
    with pytest.raises(Interrupted):
        plan.run()
    assert plan.running and plan in running_plans  # MPI may still write into x
    with pytest.raises(RuntimeError, match=r"started again before its last start finished; wait for it first"):
        plan.run()
    request.finishes = True
    assert plan.wait() is x and not plan.running and plan not in running_plans
    assert plan.run() is x and plan.wait() is x  # nothing running: wait() returns at once


def test_a_dropped_plan_frees_its_request_once_it_has_finished():
    done, busy = FakeRequest(), FakeRequest(finishes=False)
    busy.active = True  # a start nobody waited on, at exit: tested for 0.1 s, then left to MPI
    _free(done), _free(busy)
    assert done.calls == ["Test", "Free"] and "Free" not in busy.calls and len(busy.calls) > 10
    x = np.ones(2)
    request = FakeRequest()
    plan = MPIPersistent(FakeComm(False), "all_reduce", x.nbytes, x, request)
    del plan
    assert request.calls == ["Test", "Free"]


class FakeMPIComm:
    """mpi4py's communicator as ``MPICommunicator`` plans with it: every plan one FakeRequest."""

    def __init__(self):
        self.requests = []

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def _plan(self, *args):
        self.requests.append(FakeRequest())
        return self.requests[-1]

    Allreduce_init = Reduce_scatter_block_init = Allgather_init = _plan
    Allreduce = Reduce_scatter_block = Allgather = None  # (looked up by the plain forms' fast path)


@pytest.mark.parametrize("polite", [False, True])
def test_a_plan_checks_its_arrays_once_not_at_each_start(monkeypatch, polite):
    """Checks and staging belong to planning: each start is MPI's start, a count and a wait. With
    every check made to fail after planning, the plans still run, started or run, and count."""
    import minipar.comm.buffers as buffers
    import minipar.comm.mpi as mpi
    import minipar.comm.persistent as persistent

    comm, x = MPICommunicator(FakeMPIComm(), "fake", polite), np.ones(8, np.float32)
    plans = [comm.all_reduce_init(x), comm.reduce_scatter_init(x), comm.all_gather_init(x[:4])]

    def checked(*args, **kwargs):
        raise AssertionError("checked again at a start")

    for module in (buffers, mpi, persistent):
        for name in ("check_buffer", "check_root", "reduction_op", "stage", "wire", "chunk_shape"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, checked)
    monkeypatch.setattr(MPICommunicator, "_out", checked)
    for plan in plans:
        assert plan.run() is plan.result and plan.start().wait() is plan.result
    assert [comm.stats.tallies[op].calls for op in ("all_reduce", "reduce_scatter", "all_gather")] == [2, 2, 2]


def test_the_general_form_keeps_the_same_rules():
    from minipar.comm.base import Request

    starts = []
    plan = Persistent("reduce_scatter", lambda: starts.append(1) or Request(lambda: len(starts) > 0, "r"), "r")
    assert plan.run() == "r"
    request = plan.start()
    with pytest.raises(RuntimeError, match="started again"):
        plan.start()
    assert request.wait() == "r" and not plan.running
    plan.free()
    with pytest.raises(RuntimeError, match="started after free"):
        plan.run()


def test_nccl_plans_host_arrays_in_mpi_and_checks_gpu_arrays_when_planning(monkeypatch):
    """The NCCL communicator without a GPU: its host arrays go to its MPI group's planned forms,
    and a GPU array's problems are said at planning, not at the first start."""
    from minipar.comm import nccl

    class FakeNCCLModule:
        NCCL_FLOAT32, NCCL_FLOAT64, NCCL_SUM, NCCL_MAX = 7, 8, 0, 2

    class GPUArray:  # what the checks read of a CuPy array
        def __init__(self, shape, contiguous=True):
            self.shape, self.ndim, self.dtype = shape, len(shape), np.dtype(np.float32)
            self.flags = type("Flags", (), {"c_contiguous": contiguous})()

    monkeypatch.setattr(nccl, "_nccl", lambda: FakeNCCLModule)
    monkeypatch.setattr(nccl, "_types", None)
    comm = object.__new__(nccl.NCCLCommunicator)
    comm.mpi, comm.size, comm.rank = MPICommunicator.__new__(MPICommunicator), 2, 0
    planned = []
    comm.mpi.all_reduce_init = lambda x, op="sum": planned.append(("mpi", op)) or "planned in MPI"
    assert comm.all_reduce_init(np.ones(4), "max") == "planned in MPI" and planned == [("mpi", "max")]
    plan = comm.all_gather_init(GPUArray((3,)), out=GPUArray((2, 3)))
    assert type(plan) is Persistent and plan.op == "all_gather"
    for call, message in [(lambda: comm.all_reduce_init(GPUArray((4,)), "mean"), "reduction op must be one of"),
                          (lambda: comm.all_reduce_init(GPUArray((4,), contiguous=False)), "C-contiguous"),
                          (lambda: comm.reduce_scatter_init(GPUArray((3,))), "does not split into 2 chunks"),
                          (lambda: comm.all_gather_init(GPUArray((3,)), out=GPUArray((3, 3))),
                           r"out must be \(2, 3\) float32, got \(3, 3\)")]:
        with pytest.raises((ValueError, TypeError), match=message):
            call()


@pytest.mark.parametrize("n", [1, 3])
def test_planned_collectives_match_the_plain_ones(n):
    out = check_mpi(n, "persistent.py")
    assert f"planned collectives OK on {n} ranks" in out and "MPICH" not in out  # no request left at exit
