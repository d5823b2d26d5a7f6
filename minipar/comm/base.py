"""What every communicator offers, and how waits avoid spinning.

A ``Communicator`` is a group of ranks (the whole world, or a tensor-, pipeline- or data-parallel
group) with the operations parallel training needs, on contiguous xp arrays:

    all_reduce(x, op)     every rank ends with the elementwise sum (or max) of all ranks' x, in place
                          (MPI's max may drop a NaN: all-reduce a finiteness flag to find one)
    reduce_scatter(x)     x is split in ``size`` chunks along axis 0; rank r gets the sum of chunk r
    all_gather(x)         every rank gets all ranks' x stacked along a new axis 0
    all_to_all(x)         x is split in ``size`` chunks along axis 0; chunk i goes to rank i, and
                          rank r's result holds, as its chunk j, rank j's chunk r (a transpose of
                          the ranks x chunks matrix, so it is its own inverse)
    all_to_all_v(x, s, r) the same with uneven chunks (MPI's Alltoallv): the first s[0] rows of x
                          go to rank 0, the next s[1] to rank 1, ...; r[j] rows arrive from rank j,
                          in rank order (every rank's r[j] equals rank j's s[rank]; any may be 0)
    broadcast(x, root)    every rank ends with root's x, in place
    send / recv           point to point; the i- forms return a Request
    barrier()

The sums and gathers repeated on the same arrays (a data-parallel bucket, every step) can also be
planned once and started many times: ``all_reduce_init`` and kin return a ``Persistent``.

Every call is counted, and charged bytes by a model: ``stats.py``.
"""

import os
import time

import numpy

from minipar.backend import xp
from minipar.comm.stats import CommStats

# How a rank waits. MPICH's blocking calls spin at 100% CPU; with 8 ranks on 2 cores a spinning
# rank takes the core from the rank it is waiting for. But MPI only makes progress inside MPI
# calls, so a rank that sleeps long between polls stalls every multi-step protocol (a 1 MiB
# all-reduce took 10x longer with naps growing to 1 ms). So a wait first polls and *yields* the
# core between polls for up to YIELD_SECONDS: with a core to itself a rank keeps polling at full
# speed, and with others waiting for the core it hands it over at once. A wait that lasts longer
# (a pipeline stage waiting for its neighbour's forward) then sleeps, doubling the nap up to MAX_NAP.
YIELD_SECONDS = 5e-3
FIRST_NAP, MAX_NAP = 50e-6, 1e-3


def wait_without_spinning(test):
    """Call ``test()`` until it returns True, yielding the core and then sleeping between calls."""
    if test():
        return
    deadline = time.perf_counter() + YIELD_SECONDS
    while time.perf_counter() < deadline:
        os.sched_yield()
        if test():
            return
    nap = FIRST_NAP
    while not test():
        time.sleep(nap)
        nap = min(2 * nap, MAX_NAP)


class Request:
    """A pending non-blocking operation. ``wait()`` returns its result (the received or reduced
    array) without spinning, or, given ``block`` (a rank with a core to itself), by calling it:
    MPI's own blocking wait, which polls at full speed and so moves a multi-step protocol along
    fastest. ``test()`` says whether it has finished. ``keep`` holds whatever
    references the operation's buffers (MPI reads and writes them until it is done: a send buffer
    the caller drops must not be freed under it). ``then`` runs once when it is done (a GPU array
    staged through host memory is copied back then). One that failed raises the same error at every
    later test or wait: MPI's request is null once complete, and asked again would report success."""

    def __init__(self, test, result=None, keep=None, then=None, block=None):
        self._test, self._result, self._keep, self._then, self._done = test, result, keep, then, False
        self._block = block

    def test(self):
        try:
            if not self._done and self._test():
                self._done, self._keep = True, None
                if self._then is not None:
                    self._then()
        except Exception as exc:
            if not self._done:
                self._failed(exc)
            raise
        return self._done

    def wait(self):
        if self._done:
            return self._result
        if self._block is None:
            wait_without_spinning(self.test)
            return self._result
        try:
            self._block()
        except Exception as exc:
            self._failed(exc)
            raise
        # a blocking wait that returned has finished it: no test to ask MPI again (a planned
        # bucket's start and wait cost a third more with one)
        self._done, self._keep = True, None
        if self._then is not None:
            self._then()
        return self._result

    def _failed(self, error):
        def again():  # in place of MPI's test and wait: no flag for every call to check
            raise error

        self._test = self._block = again


def wait_all(requests):
    """Wait for every request; returns their results in order."""
    return [r.wait() for r in requests]


# Plans with a start running, kept alive until it has been waited on: MPI reads and writes a
# plan's arrays until then, even if the caller has dropped the plan and its Request.
running_plans = set()


class Persistent:
    """One collective on fixed arrays, planned once and started any number of times, as MPI-4's
    persistent collectives are (MPI_Allreduce_init, then MPI_Start and a wait each time).
    ``start()`` begins it and returns a Request; ``run()`` runs it to completion; either way the
    answer is in ``result``. A plan runs one start at a time and none after ``free()``.

    This general form (GPU arrays; NCCL) calls the i-form at every start, whose checks the
    communicator has already made once, at planning; ``persistent.MPIPersistent`` plans host
    arrays in MPI."""

    def __init__(self, op, start, result):
        self.op, self.result, self._start = op, result, start
        self.running = self.freed = False
        self._pending = None  # the running start's Request

    def _refuse(self):
        """Raise if this plan may not start now."""
        if self.running:
            raise RuntimeError(f"planned {self.op}: started again before its last start finished; wait for "
                               "it first (plan.wait())")
        if self.freed:
            raise RuntimeError(f"planned {self.op}: started after free()")

    def _began(self, pending):
        self.running, self._pending = True, pending
        running_plans.add(self)

    def _ended(self):
        self.running, self._pending = False, None
        running_plans.discard(self)

    def start(self):
        self._refuse()
        inner = self._start()
        pending = Request(inner.test, self.result, keep=inner, then=self._ended, block=inner.wait)
        self._began(pending)
        return pending

    def run(self):
        return self.start().wait()

    def wait(self):
        """Wait for the start that is running, if one is (its Request dropped, or a ``run()``
        interrupted by an exception); returns ``result``."""
        return self.result if self._pending is None else self._pending.wait()

    def free(self):
        """Release what the plan holds (MPI's request in ``MPIPersistent``); it may not start again."""
        if self.running:
            raise RuntimeError(f"planned {self.op}: free() while a start is running; wait for it first "
                               "(plan.wait())")
        self.freed = True


def chunk_shape(x, size, what):
    """The shape of one of ``size`` equal chunks of ``x`` along axis 0 (a ValueError if none)."""
    if x.ndim == 0 or x.shape[0] % size:
        raise ValueError(f"{what}: axis 0 of shape {x.shape} does not split into {size} chunks")
    return (x.shape[0] // size,) + x.shape[1:]


def empty_like_device(x, shape):
    """An empty array of ``shape`` and x's dtype, on x's device."""
    return (numpy if isinstance(x, numpy.ndarray) else xp).empty(shape, x.dtype)


def all_to_all_v_plan(x, send_counts, recv_counts, rank, size):
    """(send counts, send offsets, receive counts, receive offsets) in elements, the shape of
    the result, and the (sent, received) bytes charged: only rows that cross to another rank."""
    send, recv = numpy.asarray(send_counts, numpy.int64), numpy.asarray(recv_counts, numpy.int64)
    if send.shape != (size,) or recv.shape != (size,) or (send < 0).any() or (recv < 0).any():
        raise ValueError(f"all_to_all_v: need {size} non-negative send and receive counts, got "
                         f"{send.tolist()} and {recv.tolist()}")
    if x.ndim == 0 or int(send.sum()) != x.shape[0]:
        raise ValueError(f"all_to_all_v: send counts {send.tolist()} do not add up to axis 0 of shape {x.shape}")
    if send[rank] != recv[rank]:
        raise ValueError(f"all_to_all_v: rank {rank} sends itself {send[rank]} rows but expects {recv[rank]}")
    row = int(numpy.prod(x.shape[1:], dtype=numpy.int64))  # elements per row

    def offsets(counts):
        return numpy.concatenate([[0], numpy.cumsum(counts)[:-1]]).astype(numpy.int64) * row

    shape = (int(recv.sum()),) + x.shape[1:]
    row_bytes = row * x.itemsize
    charged = (int(send.sum() - send[rank]) * row_bytes, int(recv.sum() - recv[rank]) * row_bytes)
    return (send * row, offsets(send), recv * row, offsets(recv)), shape, charged


class Communicator:
    """The interface; ``mpi.MPICommunicator`` implements it over mpi4py, ``nccl.NCCLCommunicator``
    over NCCL. The i- forms start the operation and return a ``Request``; the plain forms return
    when it is done."""

    name: str
    rank: int
    size: int
    stats: CommStats

    def _charge(self, op, nbytes, root=None, charged=None):
        """Count one call of ``op`` in ``stats``: ``charged``, the (sent, received) of an uneven
        exchange, as it is; else the byte model's charge for a buffer of ``nbytes`` (from ``root``)."""
        if charged is None:
            self.stats.count(op, nbytes, self.rank, root)
        else:
            self.stats.record(op, *charged)

    # Each implementation writes a collective once, as _op(..., wait): it runs to completion when
    # ``wait``, and else returns a Request. The two public forms of each are named here.
    def all_reduce(self, x, op="sum"):
        """Sum (or max) ``x`` over the group, in place; returns x."""
        return self._all_reduce(x, op, wait=True)

    def iall_reduce(self, x, op="sum"):
        return self._all_reduce(x, op, wait=False)

    def reduce_scatter(self, x, op="sum", out=None):
        """Rank r receives the sum of every rank's chunk r, chunks taken along axis 0 (into
        ``out`` if given)."""
        return self._reduce_scatter(x, op, out, wait=True)

    def ireduce_scatter(self, x, op="sum", out=None):
        return self._reduce_scatter(x, op, out, wait=False)

    def all_gather(self, x, out=None):
        """Every rank receives all ranks' ``x``, stacked along a new axis 0 in rank order (into
        ``out`` if given)."""
        return self._all_gather(x, out, wait=True)

    def iall_gather(self, x, out=None):
        return self._all_gather(x, out, wait=False)

    def all_to_all(self, x, out=None):
        """Chunk i of ``x`` along axis 0 goes to rank i; rank r receives every rank's chunk r,
        in rank order along axis 0 of the result (same shape as x; into ``out`` if given)."""
        return self._all_to_all(x, out, wait=True)

    def iall_to_all(self, x, out=None):
        return self._all_to_all(x, out, wait=False)

    def all_to_all_v(self, x, send_counts, recv_counts):
        """Rows of ``x`` (axis 0) in consecutive runs of ``send_counts[i]`` go to rank i; the
        result holds ``recv_counts[j]`` rows from each rank j, in rank order. The counts are host
        integer sequences that the peers agreed on beforehand (exchange them with all_to_all)."""
        return self._all_to_all_v(x, send_counts, recv_counts, wait=True)

    def iall_to_all_v(self, x, send_counts, recv_counts):
        return self._all_to_all_v(x, send_counts, recv_counts, wait=False)

    def broadcast(self, x, root=0):
        """Every rank's ``x`` becomes root's, in place."""
        return self._broadcast(x, root, wait=True)

    def ibroadcast(self, x, root=0):
        return self._broadcast(x, root, wait=False)

    # Planned forms: the same collective on the same arrays, started many times (``Persistent``).
    # An implementation checks the arrays once, when planning, then plans in its library where it
    # can (MPI: ``persistent.py``) and else hands the checked arrays to these: each start then
    # runs the i-form.
    def all_reduce_init(self, x, op="sum"):
        """``all_reduce(x, op)``, planned to run many times on this same ``x``."""
        return Persistent("all_reduce", lambda: self.iall_reduce(x, op), x)

    def reduce_scatter_init(self, x, op="sum", out=None):
        """``reduce_scatter(x, op, out)``, planned to run many times on these arrays."""
        out = empty_like_device(x, chunk_shape(x, self.size, "reduce_scatter")) if out is None else out
        return Persistent("reduce_scatter", lambda: self.ireduce_scatter(x, op, out), out)

    def all_gather_init(self, x, out=None):
        """``all_gather(x, out)``, planned to run many times on these arrays."""
        out = empty_like_device(x, (self.size,) + x.shape) if out is None else out
        return Persistent("all_gather", lambda: self.iall_gather(x, out), out)

    def send(self, x, dest, tag=0):
        self.isend(x, dest, tag).wait()

    def recv(self, out, source, tag=0):
        return self.irecv(out, source, tag).wait()

    def gather_to_root(self, x, tag, root=0):
        """Every rank's 1-D ``x`` (any length, one dtype for all) on ``root``, in rank order; None
        on the others. Point to point: each rank sends its length, then its data."""
        if self.rank != root:
            self.send(numpy.array([x.size], numpy.int64), root, tag)
            self.send(numpy.ascontiguousarray(x), root, tag + 1)
            return None
        out = []
        for r in range(self.size):
            if r == root:
                out.append(x)
                continue
            n = int(self.recv(numpy.zeros(1, numpy.int64), r, tag)[0])
            out.append(self.recv(numpy.zeros(n, x.dtype), r, tag + 1))
        return out

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r} rank {self.rank} of {self.size}>"
