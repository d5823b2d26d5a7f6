"""Communicators: groups of ranks and the collectives parallel training needs, with byte counts.

``world()`` imports mpi4py (and so initialises MPI) only when called: single-device code never
touches MPI. On GPUs (``--device cuda``) it is an NCCL communicator where NCCL can be used.
"""

import sys

from minipar.comm.base import Communicator, Request, wait_all
from minipar.comm.stats import CommStats, ring_bytes


_gpu_world = None


def world():
    """The communicator of all ranks: MPI on the CPU; on GPUs, NCCL for the GPU arrays'
    collectives (``nccl.py``). A collective the first time it is called on a GPU, so every rank
    must call it after choosing the device."""
    global _gpu_world
    from minipar import backend
    from minipar.comm.mpi import world as mpi_world

    if not backend.on_gpu():
        return mpi_world()
    if _gpu_world is None:
        from minipar.comm import nccl

        _gpu_world = nccl.world(mpi_world())
    return _gpu_world


def end_job(status):
    """Exit with ``status`` where every rank of the job ends alike, at a point they all reach (flags
    every rank refused, a lesson's agreed verdict). A running MPI is finalized first: a non-zero
    exit with MPI running makes ``python -m mpi4py`` abort the job, which MPICH reports in a line of
    its own from every rank ("Abort(2) on node 0 ..."), and an aborted job leaves its shared memory
    in /dev/shm (``shm_orphans``). Only where all ranks end here: finalizing waits for the others."""
    if "mpi4py.MPI" in sys.modules:  # imported: MPI may be running (never started here otherwise)
        from mpi4py import MPI

        # (one process alone has no job to abort, and may go on using MPI: a test in pytest's process)
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            MPI.Finalize()
    sys.exit(status)


__all__ = ["Communicator", "CommStats", "Request", "end_job", "ring_bytes", "wait_all", "world"]
