"""Communicators: groups of ranks and the collectives parallel training needs, with byte counts.

``world()`` imports mpi4py (and so initialises MPI) only when called: single-device code never
touches MPI.
"""

from minipar.comm.base import CommStats, Communicator, Request, ring_bytes, wait_all


def world():
    from minipar.comm.mpi import world as mpi_world

    return mpi_world()


__all__ = ["Communicator", "CommStats", "Request", "ring_bytes", "wait_all", "world"]
