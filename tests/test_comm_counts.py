"""What the byte account counts when a call fails: a receive is counted once, however often it is
waited on, and a call refused before anything is sent counts nothing, on every path (plain,
non-blocking, planned, point to point, NCCL's launch). In one process (a world of 1, messages to
itself), and on two ranks (``tests/mpi/comm_counts.py``)."""

import sys
import types

import numpy as np
import pytest

from mpi_run import check_mpi

MODES = ["polite", "blocking"]  # the two ways a rank waits: Test polled, or MPI's Wait


def communicator(mode):
    from minipar.comm.mpi import MPICommunicator, world

    return MPICommunicator(world().comm, mode, polite=mode == "polite")


def counted(comm):
    return {op: (t.calls, t.bytes_sent, t.bytes_received) for op, t in comm.stats.by_op.items()}


def failure(call):
    with pytest.raises(Exception) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_message_is_counted_once_and_refused_again_by_every_wait(mode):
    """A message shorter than its buffer: the first wait's error, the same error object from every
    later wait or test, and its bytes counted once. Waiting on MPI's request again reported an
    empty message from rank -2 (counting another call), or passed the short message on as data."""
    c = communicator(mode)
    request = c.irecv(np.full(8, -1.0), 0, tag=3)  # posted first: a send to itself waits for it
    c.isend(np.arange(4.0), 0, tag=3).wait()
    first = failure(request.wait)
    assert isinstance(first, ValueError) and "recv from rank 0 (tag 3) got 32 bytes into a buffer of 64" in str(first)
    assert failure(request.wait) is first and failure(request.test) is first and failure(request.wait) is first
    assert counted(c) == {"send": (1, 32, 0), "recv": (1, 0, 32)}


@pytest.mark.parametrize("mode", MODES)
def test_a_message_larger_than_its_buffer_is_named_and_counted_once(mode):
    """MPI's own truncation error becomes ours, naming the sender, the tag and the buffer, and
    stays the answer of every later wait (MPI reports it once)."""
    c = communicator(mode)
    request = c.irecv(np.full(4, -1.0), 0, tag=4)
    c.isend(np.arange(8.0), 0, tag=4).wait()
    first = failure(request.wait)
    assert isinstance(first, ValueError) and "recv from rank 0 (tag 4) got a message larger than its buffer of 32 bytes" in str(first)
    assert "the peers disagree on the message's shape or dtype" in str(first)
    assert failure(request.wait) is first and failure(request.test) is first
    assert counted(c)["recv"] == (1, 0, 32)  # what landed in the buffer, once


@pytest.mark.parametrize("mode", MODES)
def test_a_message_waited_on_twice_is_counted_once(mode):
    c = communicator(mode)
    out = np.zeros(4)
    request = c.irecv(out, 0, tag=5)
    c.isend(np.arange(4.0), 0, tag=5).wait()
    assert request.wait() is out and request.test() and request.wait() is out
    assert np.array_equal(out, np.arange(4.0)) and counted(c) == {"send": (1, 32, 0), "recv": (1, 0, 32)}


@pytest.mark.parametrize("blocks", [False, True])
def test_any_failed_request_fails_again_and_never_reports_success(blocks):
    """A collective's Request too: MPI reports an error once, and its null request then tests
    done, so a second wait returned the result as if the operation had succeeded."""
    from minipar.comm.base import Request

    class Mpi:  # MPI's request: its error once, then done (null)
        failed = False

        def check(self):
            if not self.failed:
                self.failed = True
                raise RuntimeError("MPI error: the operation failed")
            return True

    mpi, ran = Mpi(), []
    request = Request(mpi.check, "result", then=lambda: ran.append(1), block=mpi.check if blocks else None)
    first = failure(request.wait)
    assert failure(request.wait) is first and failure(request.test) is first and not ran


def refused_calls(c):
    """(what, call) for calls a check refuses before anything is sent: ours, mpi4py's or MPI's."""
    objects, stamps = np.array([1, 2], object), np.zeros(2, "datetime64[s]")
    complexes = np.ones(2, np.complex64)
    return [("sum of objects", lambda: c.all_reduce(objects)), ("sum of objects, started", lambda: c.iall_reduce(objects)),
            ("sum of objects, planned", lambda: c.all_reduce_init(objects)),
            ("max of complex", lambda: c.all_reduce(complexes, op="max")),
            ("max of complex, planned", lambda: c.all_reduce_init(complexes, op="max")),
            ("sum of strings", lambda: c.all_reduce(np.array(["a", "b"]))),
            ("gather of datetimes", lambda: c.all_gather(stamps)),
            ("gather of datetimes, planned", lambda: c.all_gather_init(stamps)),
            ("broadcast from no rank", lambda: c.broadcast(np.ones(2), root=c.size)),
            ("send to no rank", lambda: c.isend(np.ones(2), c.size)),
            ("receive from no rank", lambda: c.irecv(np.ones(2), c.size))]


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_call_counts_nothing_on_any_path_and_is_refused_on_one_rank_too(mode):
    """Before, the plain and non-blocking forms and sends counted what MPI then refused (the
    planned forms and receives did not), and a world of 1, which sends nothing, took sums of
    objects or a broadcast from rank 5 that two ranks refuse."""
    c = communicator(mode)
    for what, call in refused_calls(c):
        error = failure(call)
        assert "error stack" not in str(error) or what.endswith("no rank"), f"{what}: MPI's raw error {error}"
    assert counted(c) == {}
    messages = {what: str(failure(call)) for what, call in refused_calls(c)}
    assert "MPI cannot move datetime64[s] arrays" in messages["gather of datetimes"]
    assert messages["gather of datetimes"] == messages["gather of datetimes, planned"]
    assert "complex numbers have no max" in messages["max of complex"]
    assert messages["max of complex"] == messages["max of complex, planned"]
    assert "broadcast: root 1 is not a rank of this group of 1" in messages["broadcast from no rank"]


def test_an_nccl_launch_that_fails_counts_nothing(monkeypatch):
    """NCCL's launch counts its call once NCCL has taken it, as the MPI paths count theirs."""
    from minipar.comm import nccl
    from minipar.comm.stats import CommStats

    class Stream:
        ptr = 0

        def wait_event(self, event):
            pass

        def record(self):
            return types.SimpleNamespace(done=True)

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(get_current_stream=Stream)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    comm = object.__new__(nccl.NCCLCommunicator)
    comm.rank, comm.size, comm.stats, comm.stream = 0, 2, CommStats(2), Stream()

    def refused(stream):
        raise RuntimeError("NCCL error: invalid argument")

    with pytest.raises(RuntimeError, match="invalid argument"):
        comm._launch("all_reduce", 64, "x", refused, None, wait=True)
    assert counted(comm) == {}
    assert comm._launch("all_reduce", 64, "x", lambda stream: None, None, wait=True) == "x"
    assert counted(comm) == {"all_reduce": (1, 64, 64)}


def test_counts_on_failed_calls_on_two_ranks():
    assert "comm counts OK on 2 ranks" in check_mpi(2, "comm_counts.py")
