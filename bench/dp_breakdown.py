"""Where data parallelism's speed-up goes: 2 ranks against 1, taken apart step by step.

    ./run_mpi.sh -n 2 bench/dp_breakdown.py
    ./run_mpi.sh -n 2 bench/dp_breakdown.py --buckets 4M,1M,256K --rounds 5

The same training step (forward, backward, AdamW) of the trainer's default GPT on a global batch
of 16, timed five ways in one job, in alternating rounds so that a slow spell of the machine hits
each alike:

    full, alone     rank 0 runs the whole batch while rank 1 sleeps: the one-rank step
    half, alone     rank 0 runs half the batch while rank 1 sleeps: what halving the products costs
    half, both      both ranks run their halves at once, sending nothing: what sharing the
                    machine (cores, caches, memory bandwidth) costs
    DP, bucket B    both ranks, gradients all-reduced in buckets of B bytes, each started by the
                    backward hooks as its last gradient comes in (``parallel/data.py``)

so the speed-up t(full, alone) / t(DP) splits into factors, each a ratio of two adjacent lines.
With one bucket (the trainer's default 4 MiB holds this whole model's 3.4 MB of gradients) the
all-reduce starts only when backward has ended: nothing overlaps, and its wait is the last
bucket's. Smaller buckets start earlier and overlap more, but each is one more call (a few
microseconds of Python and MPI latency); the table shows how many buckets started while backward
still ran, and how long the step then waited for the sums after its backward (the last bucket's
wait: ``finish_gradients``).
"""

import statistics
import time

import numpy as np

import minipar
from minipar.comm import world
from minipar.comm.base import wait_without_spinning
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.cli import Parser, parse, positive_int

from flags import run_problems, sizes_arg  # a script beside this one


def main():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--buckets", type=sizes_arg, default="4M,1M,256K,64K", help="bucket sizes to try (4M: the default)")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--steps", type=positive_int, default=4, help="timed steps per way per round")
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=128)
    comm = world()
    args = parse(p, comm, lambda a: run_problems({"n_embd": "--n-embd"}, n_layer=a.n_layer, n_head=4,
                                                 n_embd=a.n_embd, block_size=128))
    if comm.size != 2:
        raise SystemExit("run on 2 ranks: ./run_mpi.sh -n 2 bench/dp_breakdown.py")
    buckets = args.buckets
    config = GPTConfig(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=128)
    grid = ProcessGrid(world=comm)
    minipar.manual_seed(0)
    plain = GPT(config)  # the one-rank model: no hooks, nothing to send
    plain_opt = AdamW(plain.parameters(), lr=1e-4)
    replicas = {}  # one DP model per bucket size: each optimizer hooks its model's gradients
    for b in buckets:
        minipar.manual_seed(0)
        model = GPT(config, grid)
        replicas[b] = model, make_optimizer(model, grid, bucket_bytes=b, lr=1e-4)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (16, 128))
    halves = x[:8] if comm.rank == 0 else x[8:]

    def local(batch):  # the whole step on this rank, nothing sent
        plain(batch, batch)[1].backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def parallel(bucket):
        model, opt = replicas[bucket]
        model(halves, halves)[1].backward()
        waited = time.perf_counter()
        opt.finish_gradients()
        waited = time.perf_counter() - waited
        opt.step()
        started = opt.started_in_backward
        opt.zero_grad()
        return started, waited

    def timed(work, who=(0, 1)):
        wait_without_spinning(comm.ibarrier().test)  # a rank that sits out sleeps instead of spinning
        start = time.perf_counter()
        outs = []
        for _ in range(args.steps):
            if comm.rank in who:
                outs.append(work())
        wait_without_spinning(comm.ibarrier().test)
        return (time.perf_counter() - start) / args.steps * 1e3, outs

    ways = {"full, alone": (lambda: local(x), (0,)), "half, alone": (lambda: local(halves), (0,)),
            "half, both": (lambda: local(halves), (0, 1))}
    ways.update({f"DP, bucket {b:,}": ((lambda b=b: parallel(b)), (0, 1)) for b in buckets})
    times, started, waits = {w: [] for w in ways}, {}, {w: [] for w in ways}
    for r in range(args.rounds + 1):  # the first round warms up and is left out
        for name, (work, who) in ways.items():
            ms, outs = timed(work, who)
            times[name].append(ms)
            if name.startswith("DP"):
                started[name] = outs[-1][0]
                waits[name] += [1e3 * waited for _, waited in outs] * (r > 0)
    if comm.rank != 0:
        return
    ms = {w: statistics.median(t[1:]) for w, t in times.items()}
    one = ms["full, alone"]
    print(f"GPT {args.n_layer} layers, hidden {args.n_embd}, batch 16 (8 per rank); median of {args.rounds} "
          f"rounds of {args.steps} steps\n")
    print(f"{'way':<22}{'ms/step':>9}{'speed-up':>10}{'factor':>9}  buckets started in backward; wait after it, ms")
    for i, name in enumerate(ways):
        # each line's factor: the line above over it, and for DP, "half, both" (no sending) over it
        before = "half, both" if name.startswith("DP") else list(ways)[i - 1] if i else None
        factor = f"{ms[before] / ms[name]:>8.3f}x" if before else ""
        bucket = int(name.split()[-1].replace(",", "")) if name.startswith("DP") else None
        during = (f"  {started[name]} of {len(replicas[bucket][1].buckets)}; "
                  f"{statistics.median(waits[name]):.2f}" if bucket else "")
        print(f"{name:<22}{ms[name]:>9.1f}{one / ms[name]:>9.2f}x{factor:>9}{during}")
    best = min((n for n in ways if n.startswith("DP")), key=ms.get)
    print(f"\nbest: {best}: {one / ms[best]:.2f}x; ideal 2x = halving ({one / 2 / ms['half, alone']:.3f})"
          f" x sharing ({ms['half, alone'] / ms['half, both']:.3f}) x communication ({ms['half, both'] / ms[best]:.3f})")


if __name__ == "__main__":
    main()
