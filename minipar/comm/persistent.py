"""Persistent collectives: a collective on fixed arrays, planned once and started many times.

A data-parallel bucket is summed every step: the same array, the same group, the same sum. MPI-4
lets such a call be planned once (MPI_Allreduce_init, MPI_Reduce_scatter_block_init,
MPI_Allgather_init: the arguments read, an algorithm and its schedule chosen) and then started
any number of times (MPI_Start, then a wait). Our own checks run once too, at planning: shapes,
layouts and dtypes, the reduction, the result's array. A start then costs MPI's start and a count,
where a plain call pays for the checks and for MPI's setting up every time
(``bench/collectives.py`` times both against mpi4py's own calls).

The rules are MPI's. Every rank of the group plans its collectives in the same order and starts
them in the same order, as with non-blocking collectives. A plan starts again only once its last
start has finished. Its arrays stay where they are: a start reads and writes them, not copies made
at planning. Only host arrays are planned in MPI: a GPU array that MPI cannot read is copied
through host memory at every start, so it takes the general form (``base.Persistent``), which
checks and plans at every start.
"""

import weakref

import numpy
from mpi4py import MPI

from minipar.comm.base import Persistent, Request, chunk_shape, wait_without_spinning
from minipar.comm.buffers import check_buffer, reduction_op, wire


class PersistentCollectives:
    """The planned forms of a communicator's sums and gathers, in MPI (a mixin of
    ``mpi.MPICommunicator``: it uses the communicator's ``comm``, ``polite``, ``stats`` and
    ``_out``). Arrays MPI cannot plan on (GPU arrays) get the general form."""

    def all_reduce_init(self, x, op="sum"):
        if not _on_host(x):
            return super().all_reduce_init(x, op)
        mpi_op, buf = reduction_op(op, x.dtype), wire(check_buffer(x, "all_reduce"))
        return MPIPersistent(self, "all_reduce", x.nbytes, x, self.comm.Allreduce_init(MPI.IN_PLACE, buf, mpi_op))

    def reduce_scatter_init(self, x, op="sum", out=None):
        if not _on_host(x, out):
            return super().reduce_scatter_init(x, op, out)
        mpi_op, x_buf = reduction_op(op, x.dtype), wire(check_buffer(x, "reduce_scatter"))
        out = self._out(out, chunk_shape(x, self.size, "reduce_scatter"), x.dtype, "reduce_scatter", x)
        request = self.comm.Reduce_scatter_block_init(x_buf, wire(out), mpi_op)
        return MPIPersistent(self, "reduce_scatter", x.nbytes, out, request)

    def all_gather_init(self, x, out=None):
        if not _on_host(x, out):
            return super().all_gather_init(x, out)
        x_buf = wire(check_buffer(x, "all_gather"))
        out = self._out(out, (self.size,) + x.shape, x.dtype, "all_gather", x)
        return MPIPersistent(self, "all_gather", out.nbytes, out, self.comm.Allgather_init(x_buf, wire(out)))


def _on_host(*arrays):
    return all(a is None or isinstance(a, numpy.ndarray) for a in arrays)


class _Handle:
    """MPI's persistent request, and why it may not start now (``refusal``: None when it may).
    Freed once: by the plan's ``free()``, when the plan is dropped, or at exit before MPI is
    finalized (``weakref.finalize`` runs at exit, and mpi4py finalizes MPI after it), unless a
    start is running: MPI forbids freeing a running collective, and a job that ends in one is
    being aborted anyway."""

    def __init__(self, op, request):
        self.op, self.request, self.refusal, self.running = op, request, None, False

    def free(self):
        if not self.running and self.request != MPI.REQUEST_NULL and not MPI.Is_finalized():
            self.request.Free()
        self.refusal = f"planned {self.op}: started after free()"


class MPIPersistent(Persistent):
    """A collective planned in MPI: ``start()`` and ``run()`` as ``Persistent``'s. A rank that
    waits politely (more ranks than cores) polls MPI's request and yields between polls; one with a
    core to itself waits in MPI's Wait. Each start is counted in the communicator's stats, as a
    call of the plain form on the same arrays."""

    def __init__(self, comm, op, nbytes, result, request):
        self.op, self.result = op, result
        self._tally, self._nbytes, self._polite = comm.stats.tallies[op], nbytes, comm.polite
        self._handle = _Handle(op, request)
        self._release = weakref.finalize(self, self._handle.free)
        self.run = self._runner()

    def _runner(self):
        """``run``: start, count, wait, as a closure over what it uses. It is every start of a
        small collective, so it holds them itself rather than looking each up on the plan (that
        cost 60 ns of its 150). Nothing else runs between its start and the end of its wait, so it
        never marks the plan running."""
        handle, result, tally, nbytes, polite = self._handle, self.result, self._tally, self._nbytes, self._polite
        start, wait, test = handle.request.Start, handle.request.Wait, handle.request.Test

        def run():
            if handle.refusal is not None:
                raise RuntimeError(handle.refusal)
            start()
            tally.calls += 1
            tally.nbytes += nbytes
            if polite:
                wait_without_spinning(test)
            else:
                wait()
            return result

        return run

    def start(self):
        handle = self._handle
        if handle.refusal is not None:
            raise RuntimeError(handle.refusal)
        handle.request.Start()
        self._tally.calls += 1
        self._tally.nbytes += self._nbytes
        handle.running = True
        handle.refusal = (f"planned {self.op}: started again before its last start finished; wait on the "
                          "Request start() returned first")
        return Request(handle.request.Test, self.result, keep=self, then=self._ended,
                       block=None if self._polite else handle.request.Wait)

    def _ended(self):
        self._handle.running, self._handle.refusal = False, None

    def free(self):
        if self._handle.running:
            raise RuntimeError(f"planned {self.op}: free() while a start is running; wait on it first")
        self._release()
