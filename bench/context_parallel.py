"""Context parallelism's two ways of attending across ranks, timed side by side in one run.

    ./run_mpi.sh -n 4 bench/context_parallel.py
    ./run_mpi.sh -n 4 bench/context_parallel.py --block-size 512 --n-head 8

Every layout trains the same GPT on the same batches through the executor the trainer uses; they
differ only in how the world's ranks split the work: CP = N by ring attention (p2p), CP = N by
DeepSpeed-Ulysses (a2a), and DP = N (no context parallelism: each rank a whole sequence of fewer
rows, the reference for the compute). Layouts alternate in rounds, so a slow spell of the shared
machine hits each alike. Reported: the median step time, its ratio to DP, and the bytes each rank
sent per step on the CP group (measured by the group's counters).
"""

import statistics
import time

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.cli import Parser, parse, positive_int

from flags import run_problems  # a script beside this one

FLAGS = {"n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd", "block_size": "--block-size",
         "global_batch": "--batch-size"}


def layout(comm, cp, comm_type, args):
    """A training step on a grid of CP = ``cp`` (DP = the rest), ready to time."""
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       block_size=args.block_size, dropout=0.1)
    minipar.manual_seed(0)
    grid = ProcessGrid(cp=cp, world=comm)
    model = GPT(config, grid, cp_comm_type=comm_type)
    opt = make_optimizer(model, grid, lr=1e-3)
    executor = PipelineExecutor(model, grid, optimizer=opt)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (args.batch_size, args.block_size))

    def step(it):
        model.rng.iteration = it
        grid.cp_group.stats.reset()

        def update():
            opt.finish_gradients()
            opt.step()

        executor.step(x, x, optimizer_step=update)
        opt.zero_grad()
        return grid.cp_group.stats.total().bytes_sent

    return step


def main():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=positive_int, default=2)
    p.add_argument("--n-head", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=128)
    p.add_argument("--block-size", type=positive_int, default=256)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--rounds", type=positive_int, default=3)
    comm = world()
    n = comm.size

    def check(a):  # the three runs: CP = n by ring and by all-to-all, and DP = n
        size = dict(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size,
                    global_batch=a.batch_size, world_size=n)
        found = [] if n > 1 else ["run on 2 or more ranks: ./run_mpi.sh -n 4 bench/context_parallel.py"]
        for cp, kind in ((n, "p2p"), (n, "a2a"), (1, "p2p")):
            found += [line for line in run_problems(FLAGS, cp=cp, cp_comm_type=kind, **size) if line not in found]
        return found

    args = parse(p, comm, check)
    runs = {f"CP={n} p2p (ring)": layout(comm, n, "p2p", args), f"CP={n} a2a (Ulysses)": layout(comm, n, "a2a", args),
            f"DP={n} (no CP)": layout(comm, 1, "p2p", args)}
    times, sent = {name: [] for name in runs}, {}
    for it in range(args.rounds + 1):  # the first round warms up
        for name, step in runs.items():
            comm.barrier()
            start = time.perf_counter()
            sent[name] = step(it)
            comm.barrier()
            if it:
                times[name].append(time.perf_counter() - start)
    if comm.rank == 0:
        print(f"{n} ranks; GPT {args.n_layer} layers, hidden {args.n_embd}, {args.n_head} heads, T {args.block_size}, "
              f"batch {args.batch_size}; median of {args.rounds} steps")
        base = statistics.median(times[f"DP={n} (no CP)"])
        for name in runs:
            t = statistics.median(times[name])
            print(f"  {name:<20} {1e3 * t:8.1f} ms/step  x{t / base:5.2f} of DP   {sent[name]:>12,} bytes sent on CP")


if __name__ == "__main__":
    main()
