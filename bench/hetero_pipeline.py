"""A slow pipeline stage, or a heavy head, measured: the even split of the layers against
``plan.hetero.balance``'s.

    ./run_mpi.sh -n 2 bench/hetero_pipeline.py                 # the last stage 3x slower
    ./run_mpi.sh -n 4 bench/hetero_pipeline.py --slowdown 2 --n-layer 8
    ./run_mpi.sh -n 2 bench/hetero_pipeline.py --slowdown 1 --n-layer 12 --vocab-size 4096   # GPT-2's head

A pipeline of PP = ranks stages (1F1B) trains a GPT whose last stage plays a GPU ``--slowdown``
times slower than the others. How it is slowed: after each of its layers' forward it sleeps
(k - 1) times what that forward took, and in backward (k - 1) times twice that (a backward is
about two forwards' FLOPs). Sleeping, not repeating the work, is what a slower accelerator does to
the host: its rank waits longer, and the core is free for the other ranks (on a machine with fewer
cores than ranks, repeated compute would slow the fast stages too). The embedding and the head run
at full speed, and the balancer and the simulator count the head as the blocks' worth of FLOPs it
is (``plan.hetero.head_in_blocks``): with ``--slowdown 1`` only the head is uneven, and a vocabulary
of 4096 at h 64 and T 32 makes it 4.9 blocks, about GPT-2's 4.5 (``--pipeline-layers balanced``).

The even split (n_layer / PP each) and the balancer's (layers in proportion to speed, min-max)
each run ``--steps`` steps, the two alternating in ``--rounds`` rounds so that a slow spell of a
shared machine hits both; the median step of each is compared, beside the schedule simulator's
prediction (``plan.hetero.compare``). Exit status 1 if the balanced split is not faster: with the
default 3x slowdown the simulator predicts a step about half as long, a margin no scheduling noise
of a shared machine closes (a 2x slowdown on 2 stages of 8 layers predicts 25%). Where the two
splits are the same there is nothing to measure, and it says so.
"""

import statistics
import sys
import time
from functools import partial

import numpy as np

from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.zero3_units import UnitBackward
from minipar.plan import hetero
from minipar.plan.shapes import Model
from minipar.cli import Parser, parse, positive_float, positive_int

from flags import run_problems  # a script beside this one


def slow_runner(k):
    """A ``GPT.wrap_units`` runner that makes each layer ("h.i") k times slower, as above."""
    def run(name, unit, x):
        start = time.perf_counter()
        y = unit(x)
        took = time.perf_counter() - start
        if not name.startswith("h."):
            return y
        time.sleep((k - 1) * took)
        # the identity on the unit's output (ZeRO-3's boundary op), whose backward runs before the
        # unit's: it sleeps k - 1 times a backward, taken as two forwards
        return UnitBackward.apply(y, partial(time.sleep, 2 * (k - 1) * took))
    return run


def parse_args(comm):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--slowdown", type=positive_float, default=3.0, help="how many times slower the last stage is")
    p.add_argument("--n-layer", type=positive_int, default=8)
    p.add_argument("--n-embd", type=positive_int, default=64)
    p.add_argument("--block-size", type=positive_int, default=32)
    p.add_argument("--vocab-size", type=positive_int, default=256)
    p.add_argument("--micro-batches", type=positive_int, default=8)
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per split per round")
    p.add_argument("--rounds", type=positive_int, default=3)

    def check(a):
        found = [] if comm.size > 1 else ["run on 2 or more ranks, one stage each: ./run_mpi.sh -n 2 "
                                          "bench/hetero_pipeline.py"]
        found += [f"--slowdown {a.slowdown}: the last stage is that many times slower, at least 1"] * (a.slowdown < 1)
        return found + run_problems({"n_layer": "--n-layer", "n_embd": "--n-embd", "micro_batches": "--micro-batches",
                                     "vocab_size": "--vocab-size"},
                                    world_size=comm.size, pp=comm.size, n_layer=a.n_layer, n_head=4, n_embd=a.n_embd,
                                    block_size=a.block_size, vocab_size=a.vocab_size, global_batch=2 * a.micro_batches,
                                    micro_batches=a.micro_batches)

    return parse(p, comm, check)


def main():
    comm = world()
    args, p = parse_args(comm), comm.size
    speeds = [1.0] * (p - 1) + [1 / args.slowdown]
    head = hetero.head_in_blocks(Model(args.n_layer, args.n_embd, 4, args.block_size, args.vocab_size))
    predicted = hetero.compare(args.n_layer, speeds, args.micro_batches, last=head)
    if predicted["even"][0] == predicted["balanced"][0]:
        if comm.rank == 0:
            print(f"the balanced split is the even one, {predicted['even'][0]}: nothing to gain, nothing to measure")
        return 0
    grid = ProcessGrid(pp=p)
    config = GPTConfig(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=args.block_size,
                       vocab_size=args.vocab_size)
    runs = {}
    for name, (layers, _, _) in predicted.items():
        model = GPT(config, grid, layers_per_stage=layers)
        if grid.pp_rank == p - 1 and args.slowdown > 1:
            model.wrap_units(slow_runner(args.slowdown))
        opt = make_optimizer(model, grid, 0, lr=1e-3)
        runs[name] = (PipelineExecutor(model, grid, "1f1b", args.micro_batches, optimizer=opt), opt)
    data = np.random.default_rng(0)
    x = data.integers(0, args.vocab_size, (2 * args.micro_batches, args.block_size))
    seconds = {name: [] for name in runs}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (run, opt) in runs.items():
            for _ in range(args.steps):
                comm.barrier()
                start = time.perf_counter()
                run.step(x, x, optimizer_step=lambda: (opt.finish_gradients(), opt.step()))
                took = float(comm.all_reduce(np.array([time.perf_counter() - start]), op="max")[0])
                if round_:
                    seconds[name].append(took)
    measured = {name: statistics.median(s) for name, s in seconds.items()}
    won = measured["balanced"] < measured["even"]
    if comm.rank == 0:
        print(f"GPT {args.n_layer} layers, h {args.n_embd}, T {args.block_size}, vocabulary {args.vocab_size} (the head "
              f"{float(head):.2f} blocks' FLOPs); {p} stages, 1F1B, {args.micro_batches} micro-batches; the last stage "
              f"{args.slowdown:g}x slower (speeds {speeds})")
        for name, (layers, makespan, bubble) in predicted.items():
            print(f"{name:<9} layers {layers}: measured {1e3 * measured[name]:8.1f} ms per step (median of "
                  f"{len(seconds[name])}); simulated {float(makespan):7.1f} units, bubble {float(bubble):.3f}")
        saved = 1 - measured["balanced"] / measured["even"]
        simulated = 1 - predicted["balanced"][1] / predicted["even"][1]
        print(f"the balanced split saves {saved:.0%} of the step (the simulator: {float(simulated):.0%})")
        print("OK: the balanced split is faster" if won else "MISMATCH: the balanced split is not faster")
    return 0 if won else 1


if __name__ == "__main__":
    sys.exit(main())
