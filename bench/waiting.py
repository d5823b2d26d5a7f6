"""What waiting costs the rank being waited for, with more ranks than cores.

    ./run_mpi.sh -n 8 bench/waiting.py        # on a 2-core machine: 4 ranks per core
    ./run_mpi.sh -n 8 bench/waiting.py --seconds 3

Rank 0 does a fixed amount of matrix multiplication while every other rank waits for it inside an
all-reduce. Three ways to wait are timed by the compute time of rank 0, the one doing the work:

    alone      the other ranks sleep (the reference)
    blocking   MPICH's blocking all-reduce: the waiters spin at 100% CPU
    polite     minipar's wait: poll, yield the core, then sleep (``comm.base.wait_without_spinning``)
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from minipar.comm.mpi import MPICommunicator

from minipar.cli import Parser, parse, positive_float


def work(seconds_hint=1.0):
    """About ``seconds_hint`` of matmuls on an idle core; returns the seconds it took here."""
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    start = time.perf_counter()
    for _ in range(int(2400 * seconds_hint)):
        a = np.tanh(a @ a * 0.01)
    return time.perf_counter() - start


def main():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=positive_float, default=1.0, help="rank 0's work per way of waiting, on an idle core")
    raw = MPI.COMM_WORLD
    args = parse(p, MPICommunicator(raw, "world", polite=True), lambda a: [] if raw.Get_size() > 1 else [
        "run on more ranks than cores, to see the waits compete: ./run_mpi.sh -n 8 bench/waiting.py"])
    rank, size = raw.Get_rank(), raw.Get_size()
    results = {}
    work(0.05)  # warm up BLAS and the allocator on every rank before anything is timed
    raw.Barrier()
    if rank == 0:
        results["alone"] = work(args.seconds)
    request = raw.Ibarrier()  # rank 0 joins it after working: the others doze until then
    while not request.Test():
        time.sleep(0.05)
    for mode in ("blocking", "polite"):
        comm = MPICommunicator(raw, "world", polite=mode == "polite")
        comm.barrier()
        seconds = work(args.seconds) if rank == 0 else 0.0
        comm.all_reduce(np.zeros(1))  # everyone else waits here for rank 0
        results[mode] = seconds
    if rank == 0:
        print(f"{size} ranks; rank 0 computes while the others wait in an all-reduce\n")
        for mode, seconds in results.items():
            print(f"  {mode:<9} {seconds:6.2f} s   {seconds / results['alone']:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
