"""Collective throughput through minipar's Communicator against raw mpi4py, on the same buffers.

    ./run_mpi.sh -n 2 bench/collectives.py
    ./run_mpi.sh -n 4 bench/collectives.py --max-size 16M
    ./run_mpi.sh -n 2 bench/collectives.py --wrappers --rounds 61   # what a little Python costs

For each size, the same operation runs through ``Communicator`` (its checks and byte accounting,
then MPI's blocking call on ranks with a core each, or a non-blocking start and a polite wait on
an oversubscribed node) and through mpi4py's blocking call. Each round times both, back to back,
who goes first alternating, so that a slow spell of a shared machine hits both. Reported: the
median time of each, the median over rounds of the round's throughput ratio (minipar / raw: 1.00
means no overhead), and the bus bandwidth, NCCL's measure that makes sizes and rank counts
comparable: busbw = S / t times 2 (N-1)/N for all-reduce and (N-1)/N for reduce-scatter and
all-gather (S = the full buffer). The load average is printed before and after: below 256 KiB a
ratio moves by 0.1 with the load of other processes (MPICH yields the core while it waits).
"""

import os
import sys
import time
import timeit

import numpy as np
from mpi4py import MPI

from minipar.comm import world
from minipar.comm.mpi import MPICommunicator
from minipar.cli import Parser, parse, positive_int

from flags import size_arg  # a script beside this one

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}


def operations(comm, nbytes):
    """{op: (minipar call, raw mpi4py call)} on float32 buffers of ``nbytes`` in all."""
    raw, n = comm.comm, comm.size
    count = max(n, nbytes // 4 // n * n)
    full = np.ones(count, np.float32)
    chunk = np.ones(count // n, np.float32)
    gathered = np.empty((n, count // n), np.float32)
    return full.nbytes, {
        "all_reduce": (lambda: comm.all_reduce(full), lambda: raw.Allreduce(MPI.IN_PLACE, full)),
        "reduce_scatter": (lambda: comm.reduce_scatter(full, out=chunk),
                           lambda: raw.Reduce_scatter_block(full, chunk)),
        "all_gather": (lambda: comm.all_gather(chunk, out=gathered),
                       lambda: raw.Allgather(chunk, gathered)),
    }


def timed(comm, fn, reps):
    """Seconds per call, the slowest rank's (a collective is as slow as its last rank)."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = np.array([(time.perf_counter() - start) / reps])
    return float(comm.all_reduce(elapsed, op="max")[0])


class _NoMPI:
    """A communicator's mpi4py side that does nothing: what a way's Python costs on its own."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Allreduce(self, *args):
        pass

    Reduce_scatter_block = Allgather = Allreduce


def _ways(mpi, comm, x):
    """{name: call}: one 4 KiB all-reduce of ``x`` through ``mpi`` (mpi4py's communicator), bare
    and wrapped in a little Python, and through minipar's ``comm`` over it."""
    call, in_place, total = mpi.Allreduce, MPI.IN_PLACE, MPI.SUM

    def function(buf):
        call(in_place, buf, total)

    class Wrapper:
        def method(self, buf):
            call(in_place, buf, total)

        def looping(self, buf):
            for _ in range(3):
                pass
            call(in_place, buf, total)

    w = Wrapper()
    return {"raw mpi4py": lambda: call(in_place, x, total), "in a function": lambda: function(x),
            "in a method": lambda: w.method(x), "a method with a 3-step loop": lambda: w.looping(x),
            "minipar": lambda: comm.all_reduce(x)}


def wrappers(comm, rounds):
    """What a little Python costs a small all-reduce on the clock: raw mpi4py against the same call
    inside a function, a method, a method that first runs a 3-step loop, and minipar's, at 4 KiB,
    the calls alternating in rounds (median over rounds of raw's throughput over each's). Beside
    each: its Python alone, the same calls on an mpi4py side that does nothing, in a loop."""
    x = np.ones(1024, np.float32)
    ways = _ways(comm.comm, comm, x)
    alone = _ways(_NoMPI(), MPICommunicator(_NoMPI(), "no MPI", polite=False), x)
    samples = {name: [] for name in ways}
    for r in range(rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            samples[name].append(timed(comm, ways[name], 200))
    if comm.rank == 0:
        print(f"all_reduce of 4 KiB, {rounds} rounds: the same call wrapped in a little Python\n")
        print(f"  {'way':<30}{'us':>7}{'ratio':>7}{'its Python alone, us':>22}")
        for name, times in samples.items():
            ratio = float(np.median(np.array(samples["raw mpi4py"]) / np.array(times)))
            python = min(timeit.repeat(alone[name], number=200000, repeat=5)) / 200000
            print(f"  {name:<30}{np.median(times) * 1e6:>7.2f}{ratio:>7.3f}{python * 1e6:>22.3f}")


def main():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--min-size", type=size_arg, default="4K")
    p.add_argument("--max-size", type=size_arg, default="64M")
    p.add_argument("--rounds", type=positive_int, default=15)
    p.add_argument("--wrappers", action="store_true", help="only the cost of wrapping a 4 KiB all-reduce in Python")
    comm = world()
    args = parse(p, comm, lambda a: [f"--min-size {a.min_size:,} is above --max-size {a.max_size:,} bytes"]
                 * (a.min_size > a.max_size))
    n = comm.size
    if n < 2:
        print("run on 2 or more ranks: ./run_mpi.sh -n 2 bench/collectives.py")
        return 2
    if args.wrappers:
        wrappers(comm, args.rounds)
        return 0
    if comm.rank == 0:
        print(f"{n} ranks; median of {args.rounds} rounds; float32 buffers; load average {os.getloadavg()[0]:.1f}\n")
        print(f"{'op':<15}{'size':>9}{'minipar us':>12}{'raw us':>10}{'ratio':>7}{'busbw GB/s':>12}")
    worst = 1.0
    for op in BUS_FACTOR:
        size = args.min_size
        while size <= args.max_size:
            nbytes, ops = operations(comm, size)
            ours, raw = ops[op]
            reps = max(2, min(200, (32 << 20) // nbytes))
            ours(), raw()  # warm up both paths
            samples = {"ours": [], "raw": []}
            for r in range(args.rounds):  # who goes first alternates: the second finds warm caches
                for name in (("ours", "raw") if r % 2 == 0 else ("raw", "ours")):
                    samples[name].append(timed(comm, ours if name == "ours" else raw, reps))
            t_ours, t_raw = (float(np.median(samples[k])) for k in ("ours", "raw"))
            # throughput of ours relative to raw, each round's pair measured under the same load
            ratio = float(np.median(np.array(samples["raw"]) / np.array(samples["ours"])))
            worst = min(worst, ratio)
            if comm.rank == 0:
                busbw = nbytes / t_ours * BUS_FACTOR[op](n) / 1e9
                label = f"{nbytes // 1024}K" if nbytes < 1 << 20 else f"{nbytes >> 20}M"
                print(f"{op:<15}{label:>9}{t_ours * 1e6:>12.1f}{t_raw * 1e6:>10.1f}"
                      f"{ratio:>7.2f}{busbw:>12.2f}")
            size *= 4
    if comm.rank == 0:
        print(f"\nlowest throughput ratio minipar / raw mpi4py: {worst:.2f} (target >= 0.95); "
              f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
