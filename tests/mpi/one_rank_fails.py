"""Rank 1 fails while the others wait on it: the whole job must end, with a non-zero exit."""

import numpy as np

from minipar.comm import world

comm = world()
if comm.rank == 1:
    raise RuntimeError("rank 1 fails on purpose")
comm.recv(np.empty(1), source=1)  # never satisfied
