"""Communicators: groups of ranks and the collectives parallel training needs, with byte counts.

``world()`` imports mpi4py (and so initialises MPI) only when called: single-device code never
touches MPI. On GPUs (``--device cuda``) it is an NCCL communicator where NCCL can be used.
"""

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


__all__ = ["Communicator", "CommStats", "Request", "ring_bytes", "wait_all", "world"]
