"""Start MPI before anything else when an MPI launcher started this process.

A rank that fails before ``MPI_Init`` (a package missing on one node, no GPU visible to one rank)
cannot abort the job: MPI does not know it yet, and the other ranks wait in ``MPI_Init`` for it
forever (seen with MPICH's launcher). So ``import minipar`` initialises MPI first whenever a
launcher's variables say this process is a rank, and installs a hook that turns an uncaught
exception into an abort of every rank. A plain ``python script.py`` never touches MPI.
"""

import os
import sys

# What MPICH's (and Intel's) launcher, Open MPI's and PMIx-based launchers set in every rank.
LAUNCHER_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_hooked = False


def launched_by_mpi():
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def abort_on_uncaught_exception():
    """An exception that ends one rank ends the job, even when the script was started with a
    plain ``mpirun python script.py`` rather than ``python -m mpi4py``: otherwise the other
    ranks would wait forever for the rank that is gone."""
    global _hooked
    if _hooked:
        return
    from mpi4py import MPI

    previous = sys.excepthook

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook, _hooked = hook, True


def start_mpi_first():
    if not launched_by_mpi():
        return
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        abort_on_uncaught_exception()
