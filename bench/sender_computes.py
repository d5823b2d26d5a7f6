"""Does a message move while its sender computes? What a pipeline's next stage waits for.

    ./run_mpi.sh -n 2 bench/sender_computes.py
    MPIR_CVAR_CH4_CMA_ENABLE=0 ./run_mpi.sh -n 2 bench/sender_computes.py   # MPICH's single copy off

Rank 1 starts a non-blocking send (minipar's ``isend``, as a pipeline stage sends its activation)
and then computes for ``--compute-ms`` without calling MPI; rank 0 has posted the receive and waits
for it. A message MPI may move only while the sender is inside an MPI call (a rendezvous that needs
the sender's progress) arrives after the compute: the receiver waits the whole of it. MPICH copies
across processes of one node in one step with cross-memory attach (``process_vm_readv``, "CMA"),
which the receiver runs by itself, so the message arrives at once. Where a system forbids it (its
ptrace rules), the pipeline's receiver idles for the sender's whole next instruction.
"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

from minipar.comm.mpi import MPICommunicator
from minipar.cli import Parser, parse, positive_float, positive_int

from flags import sizes_arg  # a script beside this one


def main():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--compute-ms", type=positive_float, default=50.0, help="how long the sender computes after sending")
    p.add_argument("--sizes", type=sizes_arg, default="16K,128K,1M", help="message sizes, comma-separated")
    p.add_argument("--repeats", type=positive_int, default=3, help="the median of this many for each size")
    raw = MPI.COMM_WORLD
    comm = MPICommunicator(raw, "world", polite=False)
    args = parse(p, comm)
    if raw.Get_size() != 2:
        print("sender_computes.py runs on 2 ranks: ./run_mpi.sh -n 2 bench/sender_computes.py", file=sys.stderr)
        return 2
    rows = []
    for nbytes in args.sizes:
        waits = []
        for repeat in range(args.repeats):
            buf = np.ones(nbytes // 8)
            tag = len(rows) * args.repeats + repeat
            request = comm.irecv(np.empty_like(buf), 1, tag) if comm.rank == 0 else None
            comm.barrier()
            if comm.rank == 1:
                sent = comm.isend(buf, 0, tag)
                start = time.perf_counter()
                while time.perf_counter() - start < args.compute_ms / 1e3:  # compute, no MPI calls
                    pass
                sent.wait()
            else:
                start = time.perf_counter()
                request.wait()
                waits.append(time.perf_counter() - start)
        rows.append((nbytes, float(np.median(waits)) if waits else 0.0))
    if comm.rank == 0:
        cma = os.environ.get("MPIR_CVAR_CH4_CMA_ENABLE", "unset: MPICH's default")
        print(f"the sender computes {args.compute_ms:.0f} ms after its isend; MPIR_CVAR_CH4_CMA_ENABLE={cma}\n")
        print(f"  {'message':>9}  {'receiver waited':>16}")
        for nbytes, wait in rows:
            print(f"  {nbytes >> 10:>6} KiB  {wait * 1e3:>13.2f} ms")
        late = sum(wait > 0.5 * args.compute_ms / 1e3 for _, wait in rows)
        print(f"\n{late} of {len(rows)} sizes waited for the sender's compute")
    return 0


if __name__ == "__main__":
    sys.exit(main())
