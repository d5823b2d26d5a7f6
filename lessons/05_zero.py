"""Lesson 5: ZeRO stages 0-3 side by side, each checked against the single-device run.

    ./run_mpi.sh -n 4 lessons/05_zero.py
    ./run_mpi.sh -n 8 lessons/05_zero.py --dtype float64
    ./run_mpi.sh -n 4 lessons/05_zero.py --plant-bug  # equal masks on all replicas: fails

minipar trains in fp32 and keeps no master copy: every parameter costs 16 bytes, 4 of weight, 4 of
gradient, 8 of Adam moments, on every data-parallel rank. ZeRO (Rajbhandari et al. 2020) shards
them over the N ranks: the optimizer state (stage 1), then the gradients (stage 2), then the
weights themselves (stage 3). minipar's fp32 count per rank:

    16P   ->   8P + 8P/N   ->   4P + 12P/N   ->   16P/N

The paper counts mixed precision instead, also 16 bytes: 2 of fp16 weight, 2 of fp16 gradient and
12 of fp32 optimizer state (master weight, m, v), so 16P -> 4P + 12P/N -> 2P + 14P/N -> 16P/N.

Each stage trains the same GPT for a few AdamW steps on the same batches (dropout on, gradients
clipped to norm 1) and is compared with the single-device run: loss, every gradient, all
parameters. Then the tables: the bytes each rank holds, measured, next to the fp32 formula, and
the bytes each rank sends per step next to theirs (stage 3 sends 1.5x: weights gathered for forward
and again for backward, but the embeddings': a lookup's backward reads no table). Every stage runs
a second time recomputing every unit in backward (activation checkpointing, which the paper pairs
with ZeRO), and the peaks are shown for both settings. Every stage is one object with the same
calls (``make_optimizer``, the step protocol of minipar/parallel/protocol.py): only what it holds
and sends differs. Read next: minipar/parallel/zero.py, zero3.py, docs/zero.md.

What to look at: the three error tables (every stage equal to one device), then "bytes held" (each
stage's total beside its formula), the peaks with and without recompute, and "bytes sent".

Exercises (predict first, then run the command and read the table named):
1. From P = 834,304, predict each stage's "total" bytes held at 8 ranks with minipar's fp32 formula
   (16P, 8P + 8P/N, 4P + 12P/N, 16P/N), then the paper's mixed-precision count for the same P and
   N (not printed: work it out): ./run_mpi.sh -n 8 lessons/05_zero.py ("bytes held per rank").
2. Predict stage 3's bytes sent per step against stage 0's at 8 ranks: 1.5x, plus the tied
   embedding's term, less the positions'. Check "bytes sent per rank per step" in the same run.
3. --plant-bug keys dropout by each rank's local rows. Predict which stages fail (one, or all)
   and which error row shows it most: ./run_mpi.sh -n 4 lessons/05_zero.py --plant-bug
"""

import contextlib
import tracemalloc

import numpy as np

import lesson
import minipar
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.data import scale_loss, split_batch, token_count
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.recompute import checkpoint
from minipar.parallel.validate import RunConfig, problems

N_HEAD = 4
FORMULA = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}  # fp32 bytes per parameter: a P + b P/N
PAPER = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}  # the paper's mixed precision: 2 + 2 + 12
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
    # checked as stage 3, the most demanding of the four runs (all plain data parallelism: no TP, PP or SP)
    run = RunConfig(world_size=ranks, global_batch=args.batch_size, micro_batches=args.micro_batches,
                    n_layer=args.n_layer, n_head=N_HEAD, n_embd=args.n_embd, block_size=args.block_size,
                    dropout=0.1, zero_stage=3, dtype=args.dtype)
    found = problems(run, FLAGS) or lesson.memory_problems(run, FLAGS, args.steps)
    if args.plant_bug and ranks < 2:  # one rank's local rows are the global ones: nothing to get wrong
        found.append("--plant-bug keys the dropout masks by each rank's local rows, and with one rank those are "
                     "the global rows: run it on 2 or more ranks (./run_mpi.sh -n 2)")
    return lesson.at_least_one(args, "--steps", "--bucket-kb") + found


def formula(a, b):
    return f"{a}P + {b}P/N" if a and b else (f"{a}P" if a else f"{b}P/N")


def parallel_run(stage, args, config, grid, batches, reference, recompute=False):
    """The same training under ZeRO ``stage``; errors, bytes held and sent, and the optimizer.
    ``recompute``: run every unit of the model (embeddings, each block, the head) again in
    backward, keeping only its input (stage 3 then gathers around each recomputation)."""
    dp, k = grid.dp_group, args.micro_batches
    tracemalloc.start()
    minipar.manual_seed(args.seed)
    model = GPT(config, grid)
    if recompute:  # before the optimizer: stage 3 wraps its gathers around these
        used = dict(model.units())
        model.wrap_units(lambda name, run, x: checkpoint(run, x, used[name], rng=model.rng))
    opt = make_optimizer(model, grid, stage, bucket_bytes=args.bucket_kb << 10, **lesson.HYPER)
    compare, peak_numpy, sent = lesson.Comparison(reference), 0, []
    moved = ("all_reduce",) if stage == 0 else ("reduce_scatter", "all_gather")  # the step's traffic
    traffic = lambda: sum(t.bytes_sent for op, t in dp.stats.by_op.items() if op in moved)  # noqa: E731
    for step, (x, y) in enumerate(batches):
        model.rng.iteration = step
        dp.stats.reset()
        tracemalloc.reset_peak()
        # L = (1/N) * sum over all ranks' tokens of l_i, N here the step's counted targets (total,
        # not the ranks); every rank holds the global batch and counts them itself
        total, share = token_count(y), 0.0
        for i, rows in enumerate(np.array_split(np.arange(len(x)), k)):
            xs, ys = split_batch(x[rows], y[rows], dp)
            mine = np.array_split(rows, dp.size)[dp.rank]  # their global rows key the dropout masks
            if args.plant_bug:  # local row numbers: every rank draws the masks of rows 0, 1, ...
                mine = np.arange(len(mine))
            with (opt.no_sync() if i < k - 1 else contextlib.nullcontext()), model.rng.at(rows=mine):
                logits, _ = model(xs)
                # its tokens' l_i summed, over N: its share of L, whose gradients the stage then
                # sums (all-reduce) or sums into shards (reduce-scatter)
                loss = scale_loss(model.loss(logits, ys, reduction="sum"), total)
                loss.backward()
            share += loss.item()
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
        compare.loss(step, dp.all_reduce(np.array([share]))[0])  # the ranks' shares add up to L
    compare.parameters(opt.full_state_dict())
    tracemalloc.stop()
    held, peak_state = opt.state_bytes(), opt.peak_state_bytes()
    padding = opt.padding()
    return compare.errors, held, peak_state, peak_numpy, sent, padding


def main():
    args, comm = lesson.start("ZeRO stages 0-3 against the single-device run.", flags, check,
                              plant_bug="key the dropout masks by each rank's local rows, not the "
                              "global ones")
    grid = ProcessGrid(tp=1, pp=1)
    N = grid.dp
    config = GPTConfig(n_layer=args.n_layer, n_head=N_HEAD, n_embd=args.n_embd, block_size=args.block_size,
                       dropout=0.1)
    batches = lesson.batches(args, config.block_size)
    reference = lesson.reference_run(comm, config, batches, args.seed, max_norm=1.0)
    results = {stage: parallel_run(stage, args, config, grid, batches, reference) for stage in range(4)}
    recomputed = {stage: parallel_run(stage, args, config, grid, batches, reference, recompute=True)
                  for stage in range(4)}

    # what each stage holds and sends, beside the formulas
    tol = lesson.TOLERANCE[args.dtype]
    P = sum(v.size for v in reference.params.values())
    item = np.dtype(args.dtype).itemsize
    wte, wpe = config.vocab_size * config.n_embd, config.block_size * config.n_embd
    k = args.micro_batches
    columns = {f"stage {s}": results[s][0] for s in results}
    columns_r = {f"stage {s}": recomputed[s][0] for s in recomputed}
    rows = []
    failed = lesson.failed_rows(tol, columns) + lesson.failed_rows(tol, columns_r, where=" (recomputed)")
    for s, (errors, held, peak_state, peak_numpy, sent, padding) in results.items():
        # the fp32 formula over the padded parameters: every buffer is cut from the padded layout
        a, b = FORMULA[s]
        padded = P + padding
        memory = item * (a * padded + b * padded // N) // 4
        # passes over the model per step: stages 0-1 send the accumulated gradients once; stage 2
        # reduce-scatters every micro-batch's; stage 3 also gathers the weights twice per micro-batch,
        # the tied embedding a third time (for each of its units' forwards and the head's backward),
        # the positions once (their lookup's backward reads no table)
        passes = {0: 2, 1: 2, 2: k + 1, 3: 3 * k}[s]
        traffic = passes * (N - 1) * item * P // N + (k * (N - 1) * item * (wte - wpe) // N if s == 3 else 0)
        # the padded entries travel in every pass (the formula counts P), and a byte is rounded per
        # collective call (a bound of 3 passes failed stage 3 with --micro-batches 4 on 3 ranks)
        sent_ok = all(abs(x - traffic) <= passes * item * padding + 100 for x in sent)
        if sum(held.values()) != memory:
            failed.append(f"stage {s} holds {sum(held.values()):,} bytes, not the formula's {memory:,}")
        if not sent_ok:
            failed.append(f"stage {s} sent {sent} bytes per step, not the formula's {traffic:,} (within padding)")
        rows.append((s, held, memory, sent[-1], traffic, padding, passes))

    def report():
        print(f"{N} data-parallel ranks; GPT of P = {P:,} parameters ({args.dtype});\n"
              f"{args.steps} AdamW steps of {k} micro-batch(es), dropout 0.1")
        lesson.print_errors(columns, tol, width=11)
        lesson.print_errors(columns_r, tol, width=11,
                            title="the same, every unit recomputed in backward")
        scale = item // 4  # the formulas count 4-byte values
        print(f"\nbytes held per rank after a step, and minipar's formula ({args.dtype}: {item} bytes each"
              f" of\nweight, gradient, m and v; no master copy); P in the formula counts the padding")
        print(f"  {'stage':<7}{'parameters':>12}{'gradients':>12}{'optimizer':>12}{'total':>13}"
              f"{'formula':>13}  {'':<12}{'padding':>8}")
        for s, held, memory, *_, padding, passes in rows:
            text = formula(*(x * scale for x in FORMULA[s]))
            print(f"  {s:<7}{held['parameters']:>12,}{held['gradients']:>12,}{held['optimizer']:>12,}"
                  f"{sum(held.values()):>13,}{memory:>13,}  {text:<12}{padding:>8,}")
        paper = ", ".join(formula(*PAPER[s]) for s in range(4))
        print(f"  (the paper's count, mixed precision, 2 + 2 + 12 bytes: {paper})")
        print("\npeak bytes per rank during a step: training state, and every NumPy array (activations"
              "\nincluded)")
        print(f"  {'stage':<7}{'state':>15}{'state':>15}{'all arrays':>17}{'all arrays':>17}")
        print(f"  {'':<7}{'no recompute':>15}{'recompute':>15}{'no recompute':>17}{'recompute':>17}")
        for s in range(4):
            print(f"  {s:<7}{results[s][2]:>15,}{recomputed[s][2]:>15,}{results[s][3]:>17,}{recomputed[s][3]:>17,}")
        print("\nbytes sent per rank per step on the data-parallel group (ring model | formula)")
        for s, *_, sent, traffic, padding, passes in rows:
            tied = f" + {k} (N-1)/N x {item}(V-T)C" if s == 3 else ""
            print(f"  stage {s}  {sent:>13,} | {traffic:>13,}   {passes} (N-1)/N x {item}P{tied}")
        print("  (VC: the tied embedding, used by two units of stage 3: gathered for each forward and the head's"
              "\n  backward; TC: the positions, gathered for their forward alone: a lookup's backward reads no table)")

    return lesson.finish(comm, failed, report, "Every stage equals the single-device run and holds and sends "
                         "what the formulas say (plus padding).")


if __name__ == "__main__":
    lesson.end(main())
