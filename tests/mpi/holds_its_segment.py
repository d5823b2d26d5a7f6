"""Stays in MPI, its shared-memory segment mapped, until the file named by argv[2] appears;
announces that it is up by creating argv[1]. For the test that a live job's segment is kept."""

import os
import sys
import time

from mpi4py import MPI

MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.rank == 0:
    open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)  # not MPI's blocking wait, which spins on a shared core
MPI.COMM_WORLD.Barrier()
