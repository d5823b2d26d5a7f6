"""The Communicator over mpi4py's buffer interface (the uppercase methods: arrays go to MPI as raw
memory, never through pickle).

How a rank waits depends on whether it has a core to itself. MPICH's blocking calls spin while
they wait: harmless when every rank has its own core, and the fastest way to wait. With more ranks
than cores (8 ranks on a 2-core laptop) a spinning rank steals the core from the rank it waits
for, so there every collective is started non-blocking and waited on politely
(``base.wait_without_spinning``). Point-to-point receives, which can wait for a whole pipeline
stage, are always polite. ``MINIPAR_WAIT=polite`` or ``=blocking`` overrides the choice.

``world()`` works without any launcher: a script started as plain ``python`` is a world of 1.
"""

import math
import os
import sys

import numpy
from mpi4py import MPI

from minipar.backend import xp
from minipar.comm.base import CommStats, Communicator, Request, ring_bytes

_OPS = {"sum": MPI.SUM, "max": MPI.MAX}


def _buffer(x, what):
    if not isinstance(x, numpy.ndarray):
        raise TypeError(f"{what}: the MPI communicator moves NumPy arrays, got {type(x).__name__}")
    if x.dtype == bool:
        raise ValueError(f"{what}: MPI has no portable boolean type; send x.astype('int8')")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: MPI needs a C-contiguous array; pass xp.ascontiguousarray(x)")
    return x


def _mpi_op(op):
    if op not in _OPS:
        raise ValueError(f"reduction op must be one of {sorted(_OPS)}, got {op!r}")
    return _OPS[op]


def _done():
    return True


def _nothing():
    return None


class MPICommunicator(Communicator):
    def __init__(self, comm, name, polite):
        self.comm, self.name, self.polite = comm, name, polite
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stats = CommStats()

    def _run(self, op, nbytes, result, blocking_call, start_call, wait, root=None):
        """Charge ``op`` to the byte account and run it: to completion if ``wait`` (blocking in MPI
        unless this rank must be polite), else return a Request."""
        is_root, is_last = root == self.rank, root is not None and (root - 1) % self.size == self.rank
        self.stats.record(op, *ring_bytes(op, nbytes, self.size, is_root, is_last))
        if self.size == 1:
            return result if wait else Request(_done, result)
        if wait and not self.polite:
            blocking_call()
            return result
        request = Request(start_call().Test, result, keep=start_call)  # its closure holds the buffers
        return request.wait() if wait else request

    # Each operation below is written once; the blocking form is the non-blocking one with wait=True.
    def _all_reduce(self, x, op, wait):
        mpi_op = _mpi_op(op)
        _buffer(x, "all_reduce")
        return self._run("all_reduce", x.nbytes, x,
                         lambda: self.comm.Allreduce(MPI.IN_PLACE, x, op=mpi_op),
                         lambda: self.comm.Iallreduce(MPI.IN_PLACE, x, op=mpi_op), wait)

    def _out(self, out, shape, dtype, what):
        if out is None:
            return xp.empty(shape, dtype)
        if out.shape != shape or out.dtype != dtype:
            raise ValueError(f"{what}: out must be {shape} {dtype}, got {out.shape} {out.dtype}")
        return _buffer(out, what)

    def _reduce_scatter(self, x, op, out, wait):
        mpi_op = _mpi_op(op)
        _buffer(x, "reduce_scatter")
        if x.shape[0] % self.size:
            raise ValueError(
                f"reduce_scatter: axis 0 of length {x.shape[0]} does not split into {self.size} chunks"
            )
        out = self._out(out, (x.shape[0] // self.size,) + x.shape[1:], x.dtype, "reduce_scatter")
        if self.size == 1:
            out[...] = x
        return self._run("reduce_scatter", x.nbytes, out,
                         lambda: self.comm.Reduce_scatter_block(x, out, op=mpi_op),
                         lambda: self.comm.Ireduce_scatter_block(x, out, op=mpi_op), wait)

    def _all_gather(self, x, out, wait):
        _buffer(x, "all_gather")
        out = self._out(out, (self.size,) + x.shape, x.dtype, "all_gather")
        if self.size == 1:
            out[0] = x
        return self._run("all_gather", out.nbytes, out, lambda: self.comm.Allgather(x, out),
                         lambda: self.comm.Iallgather(x, out), wait)

    def _broadcast(self, x, root, wait):
        _buffer(x, "broadcast")
        return self._run("broadcast", x.nbytes, x, lambda: self.comm.Bcast(x, root=root),
                         lambda: self.comm.Ibcast(x, root=root), wait, root=root)

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

    def broadcast(self, x, root=0):
        """Every rank's ``x`` becomes root's, in place."""
        return self._broadcast(x, root, wait=True)

    def ibroadcast(self, x, root=0):
        return self._broadcast(x, root, wait=False)

    def barrier(self):
        self._run("barrier", 0, None, self.comm.Barrier, self.comm.Ibarrier, wait=True)

    def ibarrier(self):
        return self._run("barrier", 0, None, _nothing, self.comm.Ibarrier, wait=False)

    def isend(self, x, dest, tag=0):
        _buffer(x, "send")
        self.stats.record("send", x.nbytes, 0)
        return Request(self.comm.Isend(x, dest, tag).Test, keep=x)  # holds x until the send completes

    def irecv(self, out, source, tag=0):
        """Receive into ``out``, which must be exactly as large as the message (a larger buffer
        would keep stale values in its tail, so that is an error too). Peers agree on shapes and
        dtypes beforehand: MPI moves bytes and cannot tell float32 from float64 of the same size."""
        _buffer(out, "recv")
        request, status = self.comm.Irecv(out, source, tag), MPI.Status()

        def test():
            if not request.Test(status):
                return False
            got = status.Get_count(MPI.BYTE)
            self.stats.record("recv", 0, got)
            if got != out.nbytes:
                raise ValueError(
                    f"recv from rank {status.Get_source()} (tag {status.Get_tag()}) got {got} bytes "
                    f"into a buffer of {out.nbytes} ({out.shape} {out.dtype}): the peers disagree "
                    "on the message's shape or dtype"
                )
            return True

        return Request(test, out)

    def split(self, color, key, name):
        """Sub-groups of the ranks that pass the same ``color`` (None: in no group, gets None),
        ordered by ``key``. Collective: every rank of this group must call it."""
        sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else MPICommunicator(sub, name, self.polite)

    def abort(self, code=1):
        """End every rank of the job now (a failed check on one rank must not leave others waiting)."""
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
    """True when this node runs more ranks than this process may use cores."""
    choice = os.environ.get("MINIPAR_WAIT", "auto")
    if choice not in ("auto", "polite", "blocking"):
        raise ValueError(f"MINIPAR_WAIT={choice!r}: use auto, polite or blocking")
    if choice != "auto":
        return choice == "polite"
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = node.Get_size()
    node.Free()
    return ranks_here > usable_cores()


def _abort_on_uncaught_exception():
    """An exception that ends one rank ends the job, even when the script was started with a
    plain ``mpirun python script.py`` rather than ``python -m mpi4py``: otherwise the other
    ranks would wait forever for the rank that is gone."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


_world = None


def world():
    """The communicator of all ranks of this job (a world of 1 without a launcher)."""
    global _world
    if _world is None:
        _world = MPICommunicator(MPI.COMM_WORLD, "world", _must_be_polite(MPI.COMM_WORLD))
        if _world.size > 1:
            _abort_on_uncaught_exception()
    return _world
