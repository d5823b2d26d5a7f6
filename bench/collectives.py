"""Collective throughput through minipar's Communicator against raw mpi4py, on the same buffers.

    ./run_mpi.sh -n 2 bench/collectives.py
    ./run_mpi.sh -n 4 bench/collectives.py --max-size 16M
    ./run_mpi.sh -n 2 bench/collectives.py --wrappers --rounds 61   # what a little Python costs

For each size, each operation runs five ways:

    plain          minipar's call (its checks and byte accounting, then MPI's blocking call on ranks
                   with a core each, or a non-blocking start and a polite wait on an oversubscribed
                   node), against
    raw            mpi4py's blocking call;
    planned        minipar's persistent form (``all_reduce_init`` and kin: checked and planned
                   once, then each call a start, a count and a wait), against
    raw planned    mpi4py's own persistent request (``Allreduce_init``; Start, then Wait);
    started        the planned form started and its Request waited on (``plan.start().wait()``):
                   the path data parallelism's buckets take, whose start returns at once and whose
                   wait comes after the backward has run on, against raw planned too.

Each round times all five back to back, in an order that rotates from round to round, so that a
slow spell of a shared machine hits all. Reported: the median time of each, the median over
rounds of the round's throughput ratios (plain / raw, planned / raw planned and started / raw
planned: 1.00 means no overhead; and planned / raw, what planning gains over the plain call in all), and the bus
bandwidth of the planned form, NCCL's measure that makes sizes and rank counts comparable:
busbw = S / t times 2 (N-1)/N for all-reduce and (N-1)/N for reduce-scatter and all-gather (S = the
full buffer). The load average is printed before and after: below 256 KiB a ratio moves by 0.1
with the load of other processes (MPICH yields the core while it waits).
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


def operations(comm, op, nbytes):
    """{way: call} for ``op`` on float32 buffers of ``nbytes`` in all (the ways of the module
    docstring), and a function that frees the two persistent requests once they are timed."""
    raw, n = comm.comm, comm.size
    count = max(n, nbytes // 4 // n * n)
    full = np.ones(count, np.float32)
    chunk = np.ones(count // n, np.float32)
    gathered = np.empty((n, count // n), np.float32)
    if op == "all_reduce":
        ours, theirs = comm.all_reduce_init(full), raw.Allreduce_init(MPI.IN_PLACE, full)
        ways = {"plain": lambda: comm.all_reduce(full), "raw": lambda: raw.Allreduce(MPI.IN_PLACE, full)}
    elif op == "reduce_scatter":
        ours, theirs = comm.reduce_scatter_init(full, out=chunk), raw.Reduce_scatter_block_init(full, chunk)
        ways = {"plain": lambda: comm.reduce_scatter(full, out=chunk),
                "raw": lambda: raw.Reduce_scatter_block(full, chunk)}
    else:
        ours, theirs = comm.all_gather_init(chunk, out=gathered), raw.Allgather_init(chunk, gathered)
        ways = {"plain": lambda: comm.all_gather(chunk, out=gathered), "raw": lambda: raw.Allgather(chunk, gathered)}

    def raw_planned():
        theirs.Start()
        theirs.Wait()

    def free():
        ours.free()
        theirs.Free()

    def started():
        ours.start().wait()

    return full.nbytes, dict(ways, planned=ours.run, **{"raw planned": raw_planned}, started=started), free


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

    Reduce_scatter_block = Allgather = Start = Wait = Free = Allreduce

    def Allreduce_init(self, *args):
        return self  # its own persistent request

    def Test(self):
        return True


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
    started = comm.all_reduce_init(x)
    return {"raw mpi4py": lambda: call(in_place, x, total), "in a function": lambda: function(x),
            "in a method": lambda: w.method(x), "a method with a 3-step loop": lambda: w.looping(x),
            "minipar": lambda: comm.all_reduce(x), "minipar planned": comm.all_reduce_init(x).run,
            "minipar planned, started": lambda: started.start().wait()}


def wrappers(comm, rounds):
    """What a little Python costs a small all-reduce on the clock: raw mpi4py against the same call
    inside a function, a method, a method that first runs a 3-step loop, and minipar's, plain and
    planned (whose MPI call is a persistent request's start and wait; run, or started and its
    Request waited on), at 4 KiB, the calls
    alternating in rounds (median over rounds of raw's throughput over each's). Beside each: its
    Python alone, the same calls on an mpi4py side that does nothing, in a loop."""
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
        print(f"{'':24}{'plain':>9}{'raw':>9}{'':>7}{'planned':>9}{'raw planned':>12}{'':>7}{'started':>9}{'':>7}"
              f"{'planned':>9}\n"
              f"{'op':<15}{'size':>9}{'us':>9}{'us':>9}{'ratio':>7}{'us':>9}{'us':>12}{'ratio':>7}{'us':>9}{'ratio':>7}"
              f"{'/ raw':>9}{'busbw GB/s':>12}")
    worst = {"plain": 1.0, "planned": 1.0, "started": 1.0}
    for op in BUS_FACTOR:
        size = args.min_size
        while size <= args.max_size:
            nbytes, ways, free = operations(comm, op, size)
            reps = max(2, min(200, (32 << 20) // nbytes))
            for way in ways.values():  # warm up every path
                way()
            samples = {name: [] for name in ways}
            names = list(ways)
            for r in range(args.rounds):  # the order rotates: the later ones find warm caches
                for name in names[r % len(names):] + names[: r % len(names)]:
                    samples[name].append(timed(comm, ways[name], reps))
            free()
            t = {name: float(np.median(times)) for name, times in samples.items()}

            def ratio(ours, theirs):  # throughput of ours relative to theirs, each round's pair under the same load
                return float(np.median(np.array(samples[theirs]) / np.array(samples[ours])))

            plain, planned, gain = ratio("plain", "raw"), ratio("planned", "raw planned"), ratio("planned", "raw")
            started = ratio("started", "raw planned")
            worst = {way: min(worst[way], new) for way, new in
                     (("plain", plain), ("planned", planned), ("started", started))}
            if comm.rank == 0:
                busbw = nbytes / t["planned"] * BUS_FACTOR[op](n) / 1e9
                label = f"{nbytes // 1024}K" if nbytes < 1 << 20 else f"{nbytes >> 20}M"
                print(f"{op:<15}{label:>9}{t['plain'] * 1e6:>9.1f}{t['raw'] * 1e6:>9.1f}{plain:>7.2f}"
                      f"{t['planned'] * 1e6:>9.1f}{t['raw planned'] * 1e6:>12.1f}{planned:>7.2f}"
                      f"{t['started'] * 1e6:>9.1f}{started:>7.2f}{gain:>9.2f}"
                      f"{busbw:>12.2f}")
            size *= 4
    if comm.rank == 0:
        print(f"\nlowest throughput ratio minipar / raw mpi4py: plain {worst['plain']:.2f}, planned "
              f"{worst['planned']:.2f}, started {worst['started']:.2f} (target >= 0.95); load average "
              f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
