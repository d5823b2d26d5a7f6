"""Lesson 2: data parallelism with gradient buckets, checked against the single-device run.

    ./run_mpi.sh -n 4 lessons/02_data_parallel.py
    ./run_mpi.sh -n 4 lessons/02_data_parallel.py --micro-batches 2 --bucket-kb 64
    ./run_mpi.sh -n 4 lessons/02_data_parallel.py --plant-bug  # equal masks on all replicas: fails

Every rank holds the whole GPT and takes 1/N of each global batch. Backward leaves each rank with
the gradient of its own slice; summing them over the ranks gives the gradient of the whole batch,
so every rank takes the same optimizer step and the replicas stay identical.

What makes it fast is how the sum is sent (minipar/parallel/data.py, ``DataParallelAdamW``, which
is also AdamW; ``all_reduce_bucket`` is its communication): gradients sit in a few flat buckets, and a bucket's all-reduce starts, non-blocking, as soon as backward has finished its last
gradient, while backward goes on with earlier layers. With --micro-batches k, each rank accumulates
k micro-batches inside ``no_sync()`` and sends only once.

What to look for: the same loss, gradients and parameters as one device (float32 rounding), buckets
started before backward ended, and 2 (N-1)/N x 4P bytes sent per rank per step, the ring
all-reduce's cost for P float32 gradients; last, the steps' model FLOPs utilisation (MFU,
docs/benchmarks.md). Read next: docs/data_parallel.md.

Exercises (predict first, then run the command and read the line named):
1. The lesson prints P = 834,304. Predict the bytes each rank sends per step at 8 ranks, and the
   bytes it holds: ./run_mpi.sh -n 8 lessons/02_data_parallel.py ("bytes sent", "bytes held").
2. Cut the buckets to a quarter (64 KiB) and accumulate 2 micro-batches. Predict whether the bytes sent change, and
   whether the number of buckets goes up fourfold:
   ./run_mpi.sh -n 4 lessons/02_data_parallel.py --micro-batches 2 --bucket-kb 64
   (a bucket holds whole tensors: look at minipar/parallel/data.py for how they are filled).
3. --plant-bug gives every replica the dropout masks of rows 0, 1, ... of its own slice. Predict
   which of the three error rows fail and whether the byte counts change:
   ./run_mpi.sh -n 4 lessons/02_data_parallel.py --plant-bug
"""

import contextlib
import time

import numpy as np

import lesson
import minipar
from minipar.mfu import measured_peak
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.data import DataParallelAdamW, scale_loss, token_count
from minipar.parallel.validate import RunConfig, problems

CONFIG = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.1)
FLAGS = {"global_batch": "--batch-size", "micro_batches": "--micro-batches", "dtype": "--dtype"}


def flags(p):
    p.add_argument("--batch-size", type=int, default=8, help="the global batch of a step")
    p.add_argument("--micro-batches", type=int, default=1, help="accumulated per step inside no_sync()")
    p.add_argument("--bucket-kb", type=int, default=256)


def check(args, ranks):
    run = RunConfig(world_size=ranks, global_batch=args.batch_size, micro_batches=args.micro_batches,
                    dtype=args.dtype, **CONFIG)
    found = problems(run, FLAGS) or lesson.memory_problems(run, FLAGS, args.steps)
    if args.plant_bug and ranks < 2:  # one replica's local rows are the global ones: nothing to get wrong
        found.append("--plant-bug gives every replica the dropout masks of rows 0, 1, ..., and with one rank "
                     "those are its rows: run it on 2 or more ranks (./run_mpi.sh -n 2)")
    return lesson.at_least_one(args, "--steps", "--bucket-kb") + found


def main():
    args, comm = lesson.start("Data parallelism against the single-device run.", flags, check,
                              plant_bug="every replica draws the dropout masks of rows 0, 1, ... (as "
                              "replicas seeded alike would)")
    grid = ProcessGrid(tp=1, pp=1)
    dp, N, k = grid.dp_group, grid.dp, args.micro_batches
    config = GPTConfig(**CONFIG)
    batches = lesson.batches(args, config.block_size)
    reference = lesson.reference_run(comm, config, batches, args.seed, max_norm=1.0)

    # the same steps on N ranks, each on 1/N of every batch
    minipar.manual_seed(args.seed)
    model = GPT(config, grid)
    opt = DataParallelAdamW(model, dp, bucket_bytes=args.bucket_kb << 10, **lesson.HYPER)
    compare = lesson.Comparison(reference)
    overlap, sent = [], []
    # MFU of these steps alone (not of the reference run above, on rank 0 while the others waited)
    peak, seconds = measured_peak(comm, model.parameters()[0].dtype), []
    for step, (x, y) in enumerate(batches):
        start = time.perf_counter()
        model.rng.iteration = step  # dropout masks: keyed by step and position
        dp.stats.reset()
        # the step's loss: L = (1/N) * sum over all ranks' tokens of l_i, with N here its counted
        # targets (total, not the ranks), which every rank counts itself: each holds the global batch
        share, total = 0.0, token_count(y)
        for i, rows in enumerate(np.array_split(np.arange(len(x)), k)):  # micro-batches
            xs, ys = opt.split_batch(x[rows], y[rows])
            mine = np.array_split(rows, N)[dp.rank]  # their global rows, which key the dropout masks
            if args.plant_bug:  # local row numbers: the replicas' masks repeat one another's
                mine = np.arange(len(mine))
            with opt.no_sync() if i < k - 1 else contextlib.nullcontext(), model.rng.at(rows=mine):
                logits, _ = model(xs)
                # this micro-batch's l_i summed, over N: its share of L. The all-reduce sums the
                # shares' gradients into dL/dw, however unevenly ignored targets fall
                loss = scale_loss(model.loss(logits, ys, reduction="sum"), total)
                loss.backward()
            share += loss.item()
        overlap.append((opt.started_in_backward, len(opt.buckets)))
        opt.finish_gradients()  # the buckets' all-reduces waited for, then model.finalize_grads()
        sent.append(dp.stats.by_op["all_reduce"].bytes_sent)
        compare.loss(step, dp.all_reduce(np.array([share]))[0])  # the ranks' shares add up to L
        if step == 0:
            compare.gradients({n: p.grad for n, p in model.named_parameters()})
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
    compare.parameters(model.state_dict())
    opt.check_replicas()  # every rank holds bit-identical weights

    # what it sends and holds, beside the formulas
    tol = lesson.TOLERANCE[args.dtype]
    mfu = lesson.mfu(comm, config, args.batch_size * config.block_size, seconds, peak)
    P = sum(v.size for v in reference.params.values())
    item = np.dtype(args.dtype).itemsize
    held = opt.state_bytes()
    formula_sent = 2 * (N - 1) * item * P // N
    failed = lesson.failed_rows(tol, {None: compare.errors})
    if not all(abs(s - formula_sent) < len(opt.buckets) for s in sent):  # (ring bytes round per call)
        failed.append(f"bytes sent per step {sent} differ from 2 (N-1)/N x {item}P = {formula_sent:,}")
    if sum(held.values()) != 4 * item * P:
        failed.append(f"bytes held {sum(held.values()):,} differ from {4 * item}P = {4 * item * P:,}")

    def report():
        print(f"{N} data-parallel ranks; GPT of P = {P:,} parameters ({args.dtype});\nglobal batch "
              f"{args.batch_size} = {N} ranks x {k} micro-batch(es) x {args.batch_size // N // k}")
        lesson.print_errors({None: compare.errors}, tol)
        print(f"\ngradient buckets of {args.bucket_kb} KiB: {len(opt.buckets)}; all-reduces started by the "
              f"gradient hooks\nduring backward, per step: {', '.join(f'{s}/{b}' for s, b in overlap)}")
        print(f"bytes sent per rank per step (ring model): {sent[0]:,}; 2 (N-1)/N x {item}P = {formula_sent:,}")
        print(f"bytes held per rank: parameters {held['parameters']:,} + gradients {held['gradients']:,} "
              f"+ optimizer {held['optimizer']:,}\n  = {sum(held.values()):,} = {4 * item}P "
              f"(every rank holds everything: ZeRO, lesson 5, shards it)")
        print(mfu)

    return lesson.finish(comm, failed, report,
                         "The data-parallel run equals the single-device run, and holds and sends what the "
                         "formulas say.")


if __name__ == "__main__":
    lesson.end(main())
