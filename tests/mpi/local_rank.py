"""The launcher's local rank (node.local_rank, which picks a rank's GPU) and its count of ranks on
the node (node.local_size) against MPI's own view of the node: the communicator of the ranks
that share memory with this one (Split_type COMM_TYPE_SHARED, which decides the wait mode in
comm/mpi.py). Prints each rank's host and where its local rank came from."""

import os
import socket
import sys

from mpi4py import MPI

from minipar import node as launcher

node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
source = next((name for name in launcher._LOCAL_RANK_VARIABLES if os.environ.get(name, "").isdigit()), "none")
print(f"rank {MPI.COMM_WORLD.rank} on {socket.gethostname()}: local rank {launcher.local_rank()} of "
      f"{launcher.local_size()} ({source}); shared-memory communicator rank {node.rank} of {node.size}", flush=True)
if (launcher.local_rank(), launcher.local_size()) != (node.rank, node.size):
    sys.exit(f"rank {MPI.COMM_WORLD.rank}: the launcher's local rank and count differ from the shared-memory communicator's")
