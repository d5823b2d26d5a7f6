"""Lesson 2: data parallelism with gradient buckets, checked against the single-device run.

    ./run_mpi.sh -n 4 lessons/02_data_parallel.py
    ./run_mpi.sh -n 4 lessons/02_data_parallel.py --micro-batches 2 --bucket-kb 64

Every rank holds the whole GPT and takes 1/N of each global batch. Backward leaves each rank with
the gradient of its own slice; summing them over the ranks gives the gradient of the whole batch,
so every rank takes the same optimizer step and the replicas stay identical.

What makes it fast is how the sum is sent (minipar/parallel/data.py, ``DataParallelAdamW``, which
is also AdamW; ``all_reduce_bucket`` is its communication): gradients sit in a few flat buckets, and a bucket's all-reduce starts, non-blocking, as soon as backward has finished its last
gradient, while backward goes on with earlier layers. With --micro-batches k, each rank accumulates
k micro-batches inside ``no_sync()`` and sends only once.

What to look for: the same loss, gradients and parameters as one device (float32 rounding), buckets
started before backward ended, and 2 (N-1)/N x 4P bytes sent per rank per step, the ring
all-reduce's cost for P float32 gradients. Read next: docs/data_parallel.md.
"""

import contextlib
import sys

import numpy as np

import minipar
from minipar.backend import add_device_flag, use_device
from minipar.cli import Parser, parse
from minipar.comm import world
from minipar.data import Dataset, load_corpus
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.data import DataParallelAdamW, token_count
from minipar.parallel.validate import RunConfig, problems
from minipar.verify import as_one_vector, rel_err, worst_tensor

TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)


CONFIG = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.1)
FLAGS = {"global_batch": "--batch-size", "micro_batches": "--micro-batches", "dtype": "--dtype"}


def parse_args(comm):
    """The same flags and problems on every rank: on any, one rank prints them, one line each, and
    every rank exits with status 2 before any message (minipar.cli)."""
    p = Parser(description="Data parallelism against the single-device run.")
    p.add_argument("--dtype", choices=TOLERANCE, default="float32")
    add_device_flag(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch of a step")
    p.add_argument("--micro-batches", type=int, default=1, help="accumulated per step inside no_sync()")
    p.add_argument("--bucket-kb", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plant-bug", action="store_true",
                   help="average the ranks' means instead of summing shares of the global mean: N times too big")

    def check(args):
        run = RunConfig(world_size=comm.size, global_batch=args.batch_size, micro_batches=args.micro_batches,
                        dtype=args.dtype, **CONFIG)
        found = [f"{flag} must be >= 1" for flag, value in (("--steps", args.steps), ("--bucket-kb", args.bucket_kb))
                 if value < 1]
        return found + problems(run, FLAGS)

    return parse(p, comm, check)


def main():
    comm = world()
    args = parse_args(comm)
    minipar.set_default_dtype(args.dtype)
    use_device(args.device)
    comm = world()  # on GPUs, NCCL's
    grid = ProcessGrid(tp=1, pp=1)
    dp, N = grid.dp_group, grid.dp
    config = GPTConfig(**CONFIG)
    data = Dataset(load_corpus())
    minipar.manual_seed(args.seed)
    serial = GPT(config)
    minipar.manual_seed(args.seed)
    model = GPT(config, grid)
    opt = DataParallelAdamW(model, dp, bucket_bytes=args.bucket_kb << 10, **HYPER)
    opt_s = AdamW(serial.parameters(), **HYPER)
    errors, overlap, sent = {"loss": 0.0}, [], []
    k = args.micro_batches
    for step in range(args.steps):
        x, y = data.batch("train", step, args.batch_size, config.block_size, args.seed)
        serial.rng.iteration = model.rng.iteration = step  # dropout masks: keyed by step and position
        _, loss_s = serial(x, y)  # the whole batch at once on one device
        loss_s.backward()
        dp.stats.reset()
        losses, total = [], token_count(y)  # every rank has the global batch: it can count it
        for i, rows in enumerate(np.array_split(np.arange(len(x)), k)):  # micro-batches
            xs, ys = opt.split_batch(x[rows], y[rows])
            mine = np.array_split(rows, N)[dp.rank]  # their global rows, which key the dropout masks
            with opt.no_sync() if i < k - 1 else contextlib.nullcontext(), model.rng.at(rows=mine):
                _, loss = model(xs, ys)
                # each micro-batch mean times (its tokens / the step's): its share of the global mean
                share = loss * (1.0 / k) if args.plant_bug else opt.scale_loss(loss, ys, total=total)
                share.backward()
            losses.append(loss.item())
        overlap.append((opt.started_in_backward, len(opt.buckets)))
        opt.finish_gradients()  # the buckets' all-reduces waited for, then model.finalize_grads()
        sent.append(dp.stats.by_op["all_reduce"].bytes_sent)
        if step == 0:
            errors["gradients (worst tensor)"] = worst_tensor({n: p.grad for n, p in model.named_parameters()},
                                                              {n: p.grad for n, p in serial.named_parameters()})
        loss_all = dp.all_reduce(np.array([np.mean(losses)]))[0] / N
        errors["loss"] = max(errors["loss"], rel_err(loss_all, loss_s.item()))
        clip_grad_norm(serial.parameters(), 1.0)
        opt_s.step()
        opt_s.zero_grad()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
    errors[f"parameters after {args.steps} steps"] = as_one_vector(model.state_dict(), serial.state_dict())
    opt.check_replicas()  # every rank holds bit-identical weights

    tol = TOLERANCE[args.dtype]
    P = serial.num_parameters()
    item = np.dtype(args.dtype).itemsize
    held = opt.state_bytes()
    formula_sent = 2 * (N - 1) * item * P // N
    agrees = all(abs(s - formula_sent) < len(opt.buckets) for s in sent)  # (ring bytes round per call)
    agrees &= sum(held.values()) == 4 * item * P
    failed = int(any(e > tol for e in errors.values()) or not agrees)
    failed = comm.all_reduce(np.array([failed]), op="max")[0]
    if comm.rank == 0:
        print(f"{N} data-parallel ranks; GPT of P = {P:,} parameters ({args.dtype}); global batch "
              f"{args.batch_size} = {N} ranks x {k} micro-batch(es) x {args.batch_size // N // k}")
        print(f"\nrelative error against the single-device run (tolerance {tol:g})")
        for name, e in errors.items():
            print(f"  {name:<28}{e:>10.1e}")
        print(f"\ngradient buckets of {args.bucket_kb} KiB: {len(opt.buckets)}; all-reduces started by the "
              f"gradient hooks during backward, per step: {', '.join(f'{s}/{b}' for s, b in overlap)}")
        print(f"bytes sent per rank per step (ring model): {sent[0]:,}; 2 (N-1)/N x {item}P = {formula_sent:,}")
        print(f"bytes held per rank: parameters {held['parameters']:,} + gradients {held['gradients']:,} + "
              f"optimizer {held['optimizer']:,} = {sum(held.values()):,} = {4 * item}P "
              f"(every rank holds everything: ZeRO, lesson 5, shards it)")
        print("\nMISMATCH: see the rows above" if failed else
              "\nThe data-parallel run equals the single-device run, and holds and sends what the formulas say.")
    comm.barrier()  # a rank's non-zero exit ends the job: not before rank 0 has printed
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
