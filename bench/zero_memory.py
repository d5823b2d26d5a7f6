"""How deep a GPT fits in a per-rank memory budget under ZeRO stages 0-3, from measured bytes.

    ./run_mpi.sh -n 8 bench/zero_memory.py                 # 256 MiB per rank, width 256
    ./run_mpi.sh -n 8 bench/zero_memory.py --budget-mb 1024 --n-embd 512

For each stage, the training state a rank holds (parameters, gradients, optimizer; the peak during
a step, measured by the stage's own accounting) is measured for a 3-layer and a 4-layer GPT of the
given width, over two steps: stage 3 prefetches only from the second on (it follows the order the
first recorded), so the fit uses the worse step, and a second table shows both with the bytes the
prefetch held. Their difference is the cost of one more layer; the rest is the embeddings, the
final LayerNorm and a step's transient buffers (gradient groups in flight, stage 3's gathered unit
and the next one prefetched), which stop growing after three layers (stage 3's second step: its
gathers, prefetched, no longer line the ranks up, so one more send may be in flight, which
``ZeRO3.IN_FLIGHT`` allows; with two layers its peak falls at the smaller embeddings or head).
The budget then gives the deepest model that fits.
Activations are not part of the budget: they depend on batch and sequence, not on ZeRO. Nor is
construction: to start from the single-device weights, every rank draws the whole model once and
keeps its shards (a system for models bigger than one rank would draw each shard directly).
"""

import sys

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.data import scale_loss, split_batch, token_count
from minipar.parallel.optimizers import make_optimizer
from minipar.cli import Parser, parse, positive_float, positive_int

from flags import run_problems  # a script beside this one


def state_peaks(stage, n_layer, args, grid):
    """Peak bytes of training state on this rank during each of two steps of a GPT with
    ``n_layer``, the most bytes prefetched at once in the second (stage 3: what its prefetch
    adds; the first step records the order of the units and prefetches nothing), and the
    number of parameters."""
    config = GPTConfig(n_layer=n_layer, n_head=4, n_embd=args.n_embd, block_size=16)
    minipar.manual_seed(0)
    model = GPT(config, grid)
    dp = grid.dp_group
    opt = make_optimizer(model, grid, stage, bucket_bytes=args.bucket_kb << 10)
    rng = np.random.default_rng(0)
    x, y = split_batch(rng.integers(0, 256, (dp.size, 16)), rng.integers(0, 256, (dp.size, 16)), dp)
    peaks = []
    for _ in range(2):
        logits, _ = model(x)
        scale_loss(model.loss(logits, y, reduction="sum"), token_count(y, comm=dp)).backward()
        opt.step()
        peaks.append(opt.peak_state_bytes())
        opt.zero_grad()
        if hasattr(opt, "ledger"):  # the next step's peak alone (stage 0 counts no transients)
            opt.ledger.restart_peak()
    # stage 3 alone prefetches, and only from the second step on: its most is the second step's
    return peaks, getattr(opt, "prefetch_peak", 0), model.num_parameters()


def main():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-mb", type=positive_float, default=256, help="per-rank budget for training state, MiB")
    p.add_argument("--n-embd", type=positive_int, default=256)
    p.add_argument("--bucket-kb", type=positive_int, default=256, help="gradient bucket (stage 0) / ZeRO group size (stages 1-2)")
    comm = world()
    args = parse(p, comm, lambda a: run_problems({"n_embd": "--n-embd"}, n_layer=3, n_head=4, n_embd=a.n_embd,
                                                 block_size=16))  # state_peaks' model
    grid = ProcessGrid(tp=1, pp=1)
    budget = args.budget_mb * 2**20
    rows, steps = [], []
    for stage in range(4):
        (three, prefetched, p3), (four, _, p4) = state_peaks(stage, 3, args, grid), state_peaks(stage, 4, args, grid)
        steps.append((stage, *three, prefetched))
        three, four = max(three), max(four)  # what must fit: the worse step
        per_layer, base = four - three, three - 3 * (four - three)
        depth = int((budget - base) // per_layer) if budget > base else 0
        params = p3 + (depth - 3) * (p4 - p3)
        rows.append((stage, per_layer, base, depth, params, per_layer / (p4 - p3)))
    if comm.rank == 0:
        print(f"{comm.size} data-parallel ranks, float32, width {args.n_embd}, budget {args.budget_mb:g} MiB "
              "of training state per rank\n")
        print(f"  {'stage':<7}{'bytes/layer':>13}{'bytes/param':>13}{'rest':>13}{'deepest GPT':>13}{'parameters':>16}")
        print(f"  {'':<7}{'':>13}{'(per layer)':>13}{'':>13}{'(n_layer)':>13}")
        for stage, per_layer, base, depth, params, per_param in rows:
            print(f"  {stage:<7}{per_layer:>13,}{per_param:>13.2f}{base:>13,}{depth:>13}{params:>16,}")
        n = comm.size
        print(f"\n  minipar's fp32 bytes per parameter (4 weight + 4 gradient + 8 Adam moments) for N={n}:"
              f"\n  16, 8 + 8/N = {8 + 8 / n:.2f}, 4 + 12/N = {4 + 12 / n:.2f}, 16/N = {16 / n:.2f}"
              " (the peaks add a step's transient buffers)")
        print("\n  peak state bytes per rank, 3-layer GPT: the first step (no prefetch: it records the units' order)"
              "\n  and the second (stage 3 prefetches by that record); prefetched: the most held at once")
        print(f"  {'stage':<7}{'step 1':>13}{'step 2':>13}{'prefetched':>13}")
        for stage, first, second, prefetched in steps:
            print(f"  {stage:<7}{first:>13,}{second:>13,}{prefetched:>13,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
