"""The Communicator over mpi4py's buffer interface (the uppercase methods: arrays go to MPI as raw
memory, never through pickle).

How a rank waits depends on whether it has a core to itself. MPICH's blocking calls spin while
they wait: harmless when every rank has its own core, and the fastest way to wait. With more ranks
than cores (8 ranks on a 2-core laptop) a spinning rank steals the core from the rank it waits
for, so there every collective is started non-blocking and waited on politely
(``base.wait_without_spinning``). With a core each, every wait is MPI's blocking Wait, those of
non-blocking collectives (data parallelism's buckets, ZeRO-3's prefetched gathers) and of
point-to-point messages (the pipeline's) too: a polite wait's naps, up to a millisecond each,
would stall a protocol between the two ranks' polls and add to a pipeline's bubble.
``MINIPAR_WAIT=polite`` or ``=blocking`` overrides the choice.

``world()`` works without any launcher: a script started as plain ``python`` is a world of 1.
"""

import math
import os

import numpy
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from minipar.comm.base import Communicator, Request, all_to_all_v_plan, chunk_shape, empty_like_device
from minipar.comm.buffers import REFUSED, check_buffer, check_root, reduction_op, stage
from minipar.comm.persistent import PersistentCollectives
from minipar.comm.stats import CommStats
from minipar.start import abort_on_uncaught_exception, let_output_through


IN_PLACE, SUM, ndarray = MPI.IN_PLACE, MPI.SUM, numpy.ndarray


def _done():
    return True


def _nothing():
    return None


class MPICommunicator(PersistentCollectives, Communicator):
    def __init__(self, comm, name, polite):
        self.comm, self.name, self.polite = comm, name, polite
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stats = CommStats(self.size)
        self._direct = not polite and self.size > 1
        # what the direct paths below use, looked up once (each lookup costs 20-50 ns): mpi4py's
        # bound methods and the tallies they count into
        self._mpi_allreduce, self._mpi_reduce_scatter, self._mpi_allgather = (
            comm.Allreduce, comm.Reduce_scatter_block, comm.Allgather)
        self._tally_all_reduce, self._tally_reduce_scatter, self._tally_all_gather = (
            self.stats.tallies[op] for op in ("all_reduce", "reduce_scatter", "all_gather"))

    # The sums of all_reduce and reduce_scatter and the all_gather of host arrays, on a rank that
    # waits in MPI's blocking calls, go straight to MPI: the common case, and the one where Python
    # costs most. A small collective takes a few microseconds, and Python between two of them
    # costs 2-4 times what it costs in a loop of its own (docs/benchmarks.md, small collectives).
    # So these paths check only what mpi4py does not: that x is a host array (mpi4py would hand a
    # GPU array's address to an MPI that may not read GPU memory), the shapes and layouts it does
    # not see (it reads any contiguous buffer, Fortran order too, and does not compare an
    # all-gather's two buffers), no booleans, and sums of numbers only (the general path refuses
    # the rest with errors of its own; MPI's are raw, or for booleans made only while its argument
    # checks are on). mpi4py checks the rest in C as it parses the buffers, before MPI is called:
    # contiguity, a dtype MPI has (bfloat16 has none; its sums take the general path at once),
    # matching counts and dtypes. What it refuses takes the general path, which checks, stages
    # and explains. A call MPI has run counts itself in its tally: two additions, written out in
    # each path, since a helper's call would cost about as much as the rest of the path's Python.
    def all_reduce(self, x, op="sum"):
        if (op == "sum" and self._direct and type(x) is ndarray and x.dtype.kind in "fciu"
                and (x.ndim == 1 or x.flags.c_contiguous)):
            try:
                self._mpi_allreduce(IN_PLACE, x, SUM)
            except REFUSED:
                return self._all_reduce(x, op, wait=True)
            tally = self._tally_all_reduce
            tally.calls += 1
            tally.nbytes += x.nbytes
            return x
        return self._all_reduce(x, op, wait=True)

    def reduce_scatter(self, x, op="sum", out=None):
        if op == "sum" and self._direct and type(x) is ndarray and x.ndim == 1 and x.dtype.kind in "fciu":
            into = numpy.empty(len(x) // self.size, x.dtype) if out is None else out
            if type(into) is ndarray and into.ndim == 1:
                try:
                    self._mpi_reduce_scatter(x, into, SUM)
                except REFUSED:
                    return self._reduce_scatter(x, op, out, wait=True)
                tally = self._tally_reduce_scatter
                tally.calls += 1
                tally.nbytes += x.nbytes
                return into
        return self._reduce_scatter(x, op, out, wait=True)

    def all_gather(self, x, out=None):
        n = self.size
        if self._direct and type(x) is ndarray and x.ndim == 1 and x.dtype.kind != "b":
            into = numpy.empty((n, len(x)), x.dtype) if out is None else out
            if (type(into) is ndarray and into.ndim == 2 and len(into) == n and into.size == x.size * n
                    and into.dtype is x.dtype and into.flags.c_contiguous):
                try:
                    self._mpi_allgather(x, into)
                except REFUSED:
                    return self._all_gather(x, out, wait=True)
                tally = self._tally_all_gather
                tally.calls += 1
                tally.nbytes += into.nbytes
                return into
        return self._all_gather(x, out, wait=True)

    def _run(self, op, nbytes, result, blocking_call, start_call, wait, root=None, then=None, charged=None):
        """Run ``op``: to completion if ``wait`` (blocking in MPI unless this rank must be polite),
        else return a Request. ``then``: run once it is done. It is charged to the byte account
        (the ring model's bytes for ``nbytes``, or ``charged``, the (sent, received) of an uneven
        exchange) once MPI has taken it, as the direct paths and planned starts are: a call that
        mpi4py or MPI refuses, like one our checks refuse, sent nothing and counts nothing."""
        if self.size == 1:
            self._charge(op, nbytes, root, charged)
            return result if wait else Request(_done, result)
        if wait and not self.polite:
            blocking_call()
            self._charge(op, nbytes, root, charged)
            if then is not None:
                then()
            return result
        started = start_call()  # keep: the buffers; block: a rank with a core to itself waits in MPI's Wait
        self._charge(op, nbytes, root, charged)
        request = Request(started.Test, result, keep=start_call, then=then, block=self._block(started))
        return request.wait() if wait else request

    # Each collective is written once, as _op(..., wait); the base class names its two forms.
    def _all_reduce(self, x, op, wait):
        buf, then = stage(x, "all_reduce", copy_back=True)  # first: it refuses what is no array
        mpi_op = reduction_op(op, x.dtype)
        return self._run("all_reduce", x.nbytes, x,
                         lambda: self.comm.Allreduce(MPI.IN_PLACE, buf, mpi_op),
                         lambda: self.comm.Iallreduce(MPI.IN_PLACE, buf, mpi_op), wait, then=then)

    def _out(self, out, shape, dtype, what, like):
        if out is None:  # on the device of the input
            return empty_like_device(like, shape)
        check_buffer(out, what)
        if out.shape != shape or out.dtype != dtype:
            raise ValueError(f"{what}: out must be {shape} {dtype}, got {out.shape} {out.dtype}")
        return out

    def _reduce_scatter(self, x, op, out, wait):
        x_buf, _ = stage(x, "reduce_scatter", copy_back=False)
        mpi_op = reduction_op(op, x.dtype)
        out = self._out(out, chunk_shape(x, self.size, "reduce_scatter"), x.dtype, "reduce_scatter", x)
        if self.size == 1:
            out[...] = x
        buf, then = stage(out, "reduce_scatter", copy_back=True)
        return self._run("reduce_scatter", x.nbytes, out,
                         lambda: self.comm.Reduce_scatter_block(x_buf, buf, mpi_op),
                         lambda: self.comm.Ireduce_scatter_block(x_buf, buf, mpi_op), wait, then=then)

    def _all_gather(self, x, out, wait):
        x_buf, _ = stage(x, "all_gather", copy_back=False)
        out = self._out(out, (self.size,) + x.shape, x.dtype, "all_gather", x)
        if self.size == 1:
            out[0] = x
        buf, then = stage(out, "all_gather", copy_back=True)
        return self._run("all_gather", out.nbytes, out, lambda: self.comm.Allgather(x_buf, buf),
                         lambda: self.comm.Iallgather(x_buf, buf), wait, then=then)

    def _all_to_all(self, x, out, wait):
        x_buf, _ = stage(x, "all_to_all", copy_back=False)
        chunk_shape(x, self.size, "all_to_all")
        out = self._out(out, x.shape, x.dtype, "all_to_all", x)
        if self.size == 1:
            out[...] = x
        buf, then = stage(out, "all_to_all", copy_back=True)
        return self._run("all_to_all", x.nbytes, out, lambda: self.comm.Alltoall(x_buf, buf),
                         lambda: self.comm.Ialltoall(x_buf, buf), wait, then=then)

    def _all_to_all_v(self, x, send_counts, recv_counts, wait):
        x_buf, _ = stage(x, "all_to_all_v", copy_back=False)
        (sc, sd, rc, rd), shape, charged = all_to_all_v_plan(x, send_counts, recv_counts, self.rank, self.size)
        out = self._out(None, shape, x.dtype, "all_to_all_v", x)
        if self.size == 1:
            out[...] = x
        buf, then = stage(out, "all_to_all_v", copy_back=True)
        kind = from_numpy_dtype(x_buf.dtype)  # Alltoallv's counts are in elements of this type
        send, recv = [x_buf, (sc.tolist(), sd.tolist()), kind], [buf, (rc.tolist(), rd.tolist()), kind]
        return self._run("all_to_all_v", x.nbytes, out, lambda: self.comm.Alltoallv(send, recv),
                         lambda: self.comm.Ialltoallv(send, recv), wait, then=then, charged=charged)

    def _broadcast(self, x, root, wait):
        check_root(root, self.size)
        buf, then = stage(x, "broadcast", copy_back=True)
        return self._run("broadcast", x.nbytes, x, lambda: self.comm.Bcast(buf, root=root),
                         lambda: self.comm.Ibcast(buf, root=root), wait, root=root, then=then)

    def barrier(self):
        self._run("barrier", 0, None, self.comm.Barrier, self.comm.Ibarrier, wait=True)

    def ibarrier(self):
        return self._run("barrier", 0, None, _nothing, self.comm.Ibarrier, wait=False)

    def isend(self, x, dest, tag=0):
        buf, _ = stage(x, "send", copy_back=False)
        request = self.comm.Isend(buf, dest, tag)
        self.stats.record("send", x.nbytes, 0)  # once MPI has taken it (not to a rank that is none)
        return Request(request.Test, keep=buf, block=self._block(request))  # keep: until the send completes

    def irecv(self, out, source, tag=0):
        """Receive into ``out``, which must be exactly as large as the message (a larger buffer
        would keep stale values in its tail, so that is an error too). Peers agree on shapes and
        dtypes beforehand: MPI moves bytes and cannot tell float32 from float64 of the same size."""
        buf, then = stage(out, "recv", copy_back=True)
        request, status = self.comm.Irecv(buf, source, tag), MPI.Status()
        arrived = []  # once it has, MPI's request is null: testing it again would find an empty message

        def settle(finish):  # finish(status): MPI's Test or Wait (True once done); count and check once
            if arrived:
                return True
            try:
                if not finish(status):
                    return False
                got = status.Get_count(MPI.BYTE)
                wrong = got != out.nbytes and f"got {got} bytes into a buffer of {out.nbytes}"
            except MPI.Exception as exc:  # the one size error MPI finds itself: too long a message
                if exc.Get_error_class() != MPI.ERR_TRUNCATE:
                    raise
                got, wrong = status.Get_count(MPI.BYTE), f"got a message larger than its buffer of {out.nbytes} bytes"
            arrived.append(True)
            self.stats.record("recv", 0, got)  # what arrived, fitting or not: its sender counted it too
            if wrong:
                raise ValueError(f"recv from rank {status.Get_source()} (tag {status.Get_tag()}) {wrong} "
                                 f"({out.shape} {out.dtype}): the peers disagree on the message's shape or "
                                 "dtype; receive into a buffer of the shape and dtype sent")
            return True

        return Request(lambda: settle(request.Test), out, keep=buf, then=then,
                       block=None if self.polite else lambda: settle(request.Wait))

    def _block(self, request):
        """What a Request of this rank waits with: MPI's Wait with a core to itself, else None
        (a polite wait)."""
        return None if self.polite else request.Wait

    def split(self, color, key, name):
        """Sub-groups of the ranks that pass the same ``color`` (None: in no group, gets None),
        ordered by ``key``. Collective: every rank of this group must call it."""
        sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else MPICommunicator(sub, name, self.polite)

    def abort(self, code=1):
        """End every rank of the job now (a failed check on one rank must not leave others
        waiting), once the launcher has this rank's last words."""
        try:
            let_output_through()
        finally:
            self.comm.Abort(code)


def usable_cores():
    """Cores this process may run on: its CPU affinity, capped by a cgroup (container) quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as fh:
            quota, period = fh.read().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def _must_be_polite(comm):
    """True when some node runs more ranks than a rank there may use cores, on every rank alike.

    A polite rank starts each collective non-blocking and polls it, a blocking rank calls MPI's
    blocking form, and MPI never matches the two: ranks that chose differently (hosts with other
    core counts, ranks pinned to fewer cores, a MINIPAR_WAIT not passed to every host) would hang
    in their first collective. So each rank's choice is all-reduced, and one rank that must be
    polite makes them all polite."""
    choice = os.environ.get("MINIPAR_WAIT", "auto")
    # Split_type is a collective: every rank calls it, whatever its own MINIPAR_WAIT (a rank that
    # skipped it for its setting would be in the all-reduce while the others wait in the split)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    outnumbered = node.Get_size() > usable_cores()
    node.Free()
    mine = int(outnumbered) if choice == "auto" else {"blocking": 0, "polite": 1}.get(choice, 2)  # 2: refused
    every = numpy.array([mine], numpy.int64)
    comm.Allreduce(MPI.IN_PLACE, every, MPI.MAX)
    if every[0] == 2:
        whose = f"MINIPAR_WAIT={choice!r}" if mine == 2 else "MINIPAR_WAIT on another rank"
        raise ValueError(f"{whose} is not a way to wait: use auto, polite or blocking")
    return bool(every[0])


_world = None


def world():
    """The communicator of all ranks of this job (a world of 1 without a launcher)."""
    global _world
    if _world is None:
        _world = MPICommunicator(MPI.COMM_WORLD, "world", _must_be_polite(MPI.COMM_WORLD))
        if _world.size > 1:
            abort_on_uncaught_exception()
    return _world
