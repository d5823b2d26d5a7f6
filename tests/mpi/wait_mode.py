"""Prints how this job's ranks wait: polite (more ranks than cores) or blocking.

    --pin-rank-0   rank 0 keeps one core before MPI starts: it alone outnumbers its cores, and
                   every rank must wait politely with it (an all-reduce then completes)
"""

import os
import sys

import numpy as np

if "--pin-rank-0" in sys.argv and os.environ.get("PMI_RANK") == "0":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

from minipar.comm import world  # noqa: E402

comm = world()
every = comm.all_reduce(np.eye(comm.size)[comm.rank] * comm.polite)  # each rank's choice, summed in an all-reduce
if comm.rank == 0:
    print(f"polite={comm.polite} size={comm.size} every rank polite: {every.tolist()}")
