"""Rank 1 fails while importing minipar, before the script ever asks for MPI (as a rank missing a
package would): the whole job must end, not wait in MPI_Init."""

import os
import sys

if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
    sys.modules["minipar.autograd"] = None  # what Python does with a module it cannot import

import minipar  # noqa: E402,F401  (rank 1 fails here)
from minipar.comm import world  # noqa: E402

world().barrier()
