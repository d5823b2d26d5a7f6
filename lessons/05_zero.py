"""Lesson 5: ZeRO stages 0-3 side by side, each checked against the single-device run.

    ./run_mpi.sh -n 4 lessons/05_zero.py
    ./run_mpi.sh -n 8 lessons/05_zero.py --dtype float64

Data parallelism keeps on every rank 16 bytes per parameter: 4 of weight, 4 of gradient, 8 of
Adam moments. ZeRO (Rajbhandari et al. 2020) shards them over the N data-parallel ranks: the
optimizer state (stage 1), then the gradients (stage 2), then the weights themselves (stage 3):

    16P   ->   8P + 8P/N   ->   4P + 12P/N   ->   16P/N

Each stage trains the same GPT for a few AdamW steps on the same batches (dropout on, gradients
clipped to norm 1) and is compared with the single-device run: loss, every gradient, all
parameters. Then the tables: the bytes each rank holds, measured, next to the paper's formula, and
the bytes each rank sends per step next to theirs (stage 3 sends 1.5x: weights gathered for forward
and again for backward). Every stage is one object with the same calls (``make_optimizer``, the step
protocol of minipar/parallel/protocol.py): only what it holds and sends differs. Read next:
minipar/parallel/zero.py, zero3.py, docs/zero.md.
"""

import contextlib
import sys
import tracemalloc

import numpy as np

import lesson
import minipar
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.data import scale_loss, split_batch, token_count
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.validate import RunConfig, problems

N_HEAD = 4
FORMULA = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}  # bytes per parameter: a P + b P / N
FLAGS = {"global_batch": "--batch-size", "micro_batches": "--micro-batches", "n_layer": "--n-layer",
         "n_embd": "--n-embd", "block_size": "--block-size", "dtype": "--dtype"}


def flags(p):
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--bucket-kb", type=int, default=256, help="gradient bucket / ZeRO group size")
    p.add_argument("--micro-batches", type=int, default=1, help="accumulated per step")


def check(args, ranks):
    # stage 3 is the most demanding of the four runs (none has TP, PP or SP, which it refuses)
    run = RunConfig(world_size=ranks, global_batch=args.batch_size, micro_batches=args.micro_batches,
                    n_layer=args.n_layer, n_head=N_HEAD, n_embd=args.n_embd, block_size=args.block_size,
                    dropout=0.1, zero_stage=3, dtype=args.dtype)
    return lesson.at_least_one(args, "--steps", "--bucket-kb") + problems(run, FLAGS)


def parallel_run(stage, args, config, grid, batches, reference):
    """The same training under ZeRO ``stage``; errors, bytes held and sent, and the optimizer."""
    dp, k = grid.dp_group, args.micro_batches
    tracemalloc.start()
    minipar.manual_seed(args.seed)
    model = GPT(config, grid)
    opt = make_optimizer(model, grid, stage, bucket_bytes=args.bucket_kb << 10, **lesson.HYPER)
    compare, peak_numpy, sent = lesson.Comparison(reference), 0, []
    moved = ("all_reduce",) if stage == 0 else ("reduce_scatter", "all_gather")  # the step's traffic
    traffic = lambda: sum(t.bytes_sent for op, t in dp.stats.by_op.items() if op in moved)  # noqa: E731
    for step, (x, y) in enumerate(batches):
        model.rng.iteration = step
        dp.stats.reset()
        tracemalloc.reset_peak()
        total, losses = token_count(y), []  # every rank holds the global batch and can count it
        for i, rows in enumerate(np.array_split(np.arange(len(x)), k)):
            xs, ys = split_batch(x[rows], y[rows], dp)
            mine = np.array_split(rows, dp.size)[dp.rank]  # their global rows key the dropout masks
            with (opt.no_sync() if i < k - 1 else contextlib.nullcontext()), model.rng.at(rows=mine):
                _, loss = model(xs, ys)
                share = loss * (1.0 / k) if args.plant_bug else scale_loss(loss, ys, total=total)
                share.backward()
            losses.append(loss.item() * len(xs))
        opt.finish_gradients()
        if step == 0:  # the verification's own traffic and memory are not the step's
            step_bytes, peak_numpy = traffic(), tracemalloc.get_traced_memory()[1]
            full = opt.full_gradients()
            compare.gradients({n: full[id(p)] for n, p in model.named_parameters()})
            dp.stats.reset()
            tracemalloc.reset_peak()
        else:
            step_bytes = 0
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        sent.append(step_bytes + traffic())
        peak_numpy = max(peak_numpy, tracemalloc.get_traced_memory()[1])
        compare.loss(step, dp.all_reduce(np.array([sum(losses)]))[0] / len(x))
    compare.parameters(opt.full_state_dict())
    tracemalloc.stop()
    held, peak_state = opt.state_bytes(), opt.peak_state_bytes()
    padding = opt.padding()
    return compare.errors, held, peak_state, peak_numpy, sent, padding


def main():
    args, comm = lesson.start("ZeRO stages 0-3 against the single-device run.", flags, check,
                              plant_bug="backward on each rank's mean loss instead of its share of the global mean")
    grid = ProcessGrid(tp=1, pp=1)
    N = grid.dp
    config = GPTConfig(n_layer=args.n_layer, n_head=N_HEAD, n_embd=args.n_embd, block_size=args.block_size, dropout=0.1)
    batches = lesson.batches(args, config.block_size)
    reference = lesson.reference_run(config, batches, args.seed, max_norm=1.0)
    results = {stage: parallel_run(stage, args, config, grid, batches, reference) for stage in range(4)}

    # what each stage holds and sends, beside the paper's formulas
    tol = lesson.TOLERANCE[args.dtype]
    P = sum(v.size for v in reference.params.values())
    item = np.dtype(args.dtype).itemsize
    wte = config.vocab_size * config.n_embd
    rows, ok = [], lesson.within(tol, *(r[0] for r in results.values()))
    for s, (errors, held, peak_state, peak_numpy, sent, padding) in results.items():
        a, b = FORMULA[s]
        memory = item * (a * P + b * P // N) // 4
        # passes over the model per step: stages 0-1 send the accumulated gradients once; stage 2
        # reduce-scatters every micro-batch's; stage 3 also gathers the weights twice per micro-batch
        k = args.micro_batches
        passes = {0: 2, 1: 2, 2: k + 1, 3: 3 * k}[s]
        traffic = passes * (N - 1) * item * P // N + (3 * k * (N - 1) * item * wte // N if s == 3 else 0)
        # agreement: the formulas plus padding (each padded entry can be held 4 times and sent
        # 3 times), and a byte of rounding per collective call in the ring-model count
        held_ok = 0 <= sum(held.values()) - memory <= 4 * item * padding
        sent_ok = all(abs(x - traffic) <= 3 * item * padding + 100 for x in sent)
        ok &= held_ok and sent_ok
        rows.append((s, held, memory, peak_state, peak_numpy, sent[-1], traffic, padding, passes))

    def report():
        print(f"{N} data-parallel ranks; GPT of P = {P:,} parameters ({args.dtype}), {args.steps} AdamW "
              f"steps of {args.micro_batches} micro-batch(es), dropout 0.1")
        lesson.print_errors({f"stage {s}": results[s][0] for s in results}, tol, width=11)
        print(f"\nbytes held per rank: training state after a step next to the ZeRO paper's formula "
              f"({item}-byte values), and the peaks during a step")
        print(f"  {'stage':<7}{'parameters':>12}{'gradients':>12}{'optimizer':>12}{'total':>13}"
              f"{'formula':>13}  {'':<11}{'padding':>8}{'peak, state':>13}{'peak, all arrays':>18}")
        for s, held, memory, peak_state, peak_numpy, *_, padding, passes in rows:
            a, b = (x * item // 4 for x in FORMULA[s])  # the paper counts 4-byte values
            text = f"{a}P + {b}P/N" if a and b else (f"{a}P" if a else f"{b}P/N")
            print(f"  {s:<7}{held['parameters']:>12,}{held['gradients']:>12,}{held['optimizer']:>12,}"
                  f"{sum(held.values()):>13,}{memory:>13,}  {text:<11}{padding:>8,}{peak_state:>13,}{peak_numpy:>18,}")
        print("\nbytes sent per rank per step on the data-parallel group (ring model | formula)")
        for s, *_, sent, traffic, padding, passes in rows:
            tied = f" + {passes} (N-1)/N x the tied embedding (used by two units)" if s == 3 else ""
            print(f"  stage {s}  {sent:>13,} | {traffic:>13,}   {passes} (N-1)/N x {item}P{tied}")

    return lesson.finish(comm, not ok, report, "Every stage equals the single-device run and holds and sends "
                         "what the formulas say (plus padding).")


if __name__ == "__main__":
    sys.exit(main())
