"""``python -m minipar.train`` with each rank's own flags, as an MPMD launch gives them: every
argument's ``{rank}`` becomes the rank's number (e.g. ``--init-weights DIR/w{rank}.safetensors``)."""

import sys

from mpi4py import MPI

from minipar.train import main

rank = MPI.COMM_WORLD.Get_rank()
sys.exit(main([arg.replace("{rank}", str(rank)) for arg in sys.argv[1:]]))
