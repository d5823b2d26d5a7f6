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
at planning. Only NumPy arrays are planned in MPI. Any other array (CuPy's) is checked here too,
then takes the general form (``base.Persistent``), which runs the i-form at every start: MPI may
have to receive it through a host copy made at each start.
"""

import time
import weakref

import numpy
from mpi4py import MPI

from minipar.comm.base import Persistent, Request, chunk_shape, wait_without_spinning
from minipar.comm.buffers import check_buffer, reduction_op, wire


class PersistentCollectives:
    """The planned forms of a communicator's sums and gathers, in MPI (a mixin of
    ``mpi.MPICommunicator``: it uses the communicator's ``comm``, ``polite``, ``stats`` and
    ``_out``). Every check of the plain form is made here, for any array, before anything is
    planned or sent."""

    def all_reduce_init(self, x, op="sum"):
        check_buffer(x, "all_reduce")
        mpi_op = reduction_op(op, x.dtype)
        if not isinstance(x, numpy.ndarray):
            return super().all_reduce_init(x, op)
        return MPIPersistent(self, "all_reduce", x.nbytes, x, self.comm.Allreduce_init(MPI.IN_PLACE, wire(x), mpi_op))

    def reduce_scatter_init(self, x, op="sum", out=None):
        check_buffer(x, "reduce_scatter")
        mpi_op = reduction_op(op, x.dtype)
        out = self._out(out, chunk_shape(x, self.size, "reduce_scatter"), x.dtype, "reduce_scatter", x)
        if not (isinstance(x, numpy.ndarray) and isinstance(out, numpy.ndarray)):
            return super().reduce_scatter_init(x, op, out)
        request = self.comm.Reduce_scatter_block_init(wire(x), wire(out), mpi_op)
        return MPIPersistent(self, "reduce_scatter", x.nbytes, out, request)

    def all_gather_init(self, x, out=None):
        check_buffer(x, "all_gather")
        out = self._out(out, (self.size,) + x.shape, x.dtype, "all_gather", x)
        if not (isinstance(x, numpy.ndarray) and isinstance(out, numpy.ndarray)):
            return super().all_gather_init(x, out)
        request = self.comm.Allgather_init(wire(x), wire(out))
        return MPIPersistent(self, "all_gather", out.nbytes, out, request)


def _free(request):
    """Free MPI's request of a plan that is gone, or at exit, before MPI is finalized (weakref's
    finalizers run then, and mpi4py finalizes MPI after them). MPI forbids freeing a running
    collective: a start nobody waited on, at exit, is given 0.1 s to finish (its peers may have
    started theirs later), and else left to MPI, which names it as it finalizes."""
    if request == MPI.REQUEST_NULL or MPI.Is_finalized():
        return
    deadline = time.monotonic() + 0.1
    while not request.Test():
        if time.monotonic() > deadline:
            return
        time.sleep(1e-3)
    request.Free()


class MPIPersistent(Persistent):
    """A collective planned in MPI, whose ``request`` reads and writes the plan's arrays at every
    start (mpi4py's request holds them, views and all). A rank that waits politely (more ranks
    than cores) polls MPI's request and yields between polls; one with a core to itself waits in
    MPI's Wait. Each start is counted in the communicator's stats, as a call of the plain form on
    the same arrays."""

    def __init__(self, comm, op, nbytes, result, request):
        super().__init__(op, None, result)
        self._request = request
        self._tally, self._nbytes, self._polite = comm.stats.tallies[op], nbytes, comm.polite
        self._release = weakref.finalize(self, _free, request)
        # what each start's Request calls, looked up once (MPI's request is the same every start)
        self._test, self._block = request.Test, None if comm.polite else request.Wait

    def start(self):  # (run() writes the same out: keep the two in step)
        if self.running or self.freed:
            self._refuse()
        self._request.Start()
        tally = self._tally
        tally.calls += 1
        tally.nbytes += self._nbytes
        self._began(self._pending_request())
        return self._pending

    def _pending_request(self):
        return Request(self._test, self.result, then=self._ended, block=self._block)

    def run(self):
        # start() and its wait written out (keep the two in step): this is the whole of every
        # start of a small collective, and a Request and its method calls cost about 1 us
        if self.running or self.freed:
            self._refuse()
        request, tally = self._request, self._tally
        request.Start()
        tally.calls += 1
        tally.nbytes += self._nbytes
        self.running = True
        try:
            if self._polite:
                wait_without_spinning(request.Test)
            else:
                request.Wait()
        except BaseException:  # interrupted (a signal's exception): the start may still run; wait() ends it
            self._began(self._pending_request())
            raise
        self.running = False
        return self.result

    def free(self):
        super().free()
        self._release()
