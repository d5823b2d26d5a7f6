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
and again for backward). Read next: minipar/parallel/zero.py, zero3.py, docs/zero.md.
"""

import argparse
import sys
import tracemalloc

import numpy as np

import minipar
from minipar.comm import world
from minipar.data import Dataset, load_corpus
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.data import DataParallel, scale_loss, split_batch
from minipar.parallel.zero import ZeroAdamW
from minipar.parallel.zero3 import Zero3
from minipar.verify import as_one_vector, rel_err, worst_tensor

TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
FORMULA = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}  # bytes per parameter: a P + b P / N


def parse_args(n):
    p = argparse.ArgumentParser(description="ZeRO stages 0-3 against the single-device run.")
    p.add_argument("--dtype", choices=TOLERANCE, default="float32")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--bucket-kb", type=int, default=256, help="gradient bucket / ZeRO group size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plant-bug", action="store_true",
                   help="backward on each rank's mean loss instead of its share of the global mean")
    args = p.parse_args()
    if args.steps < 1 or args.batch_size % n:
        p.error(f"--steps must be >= 1 and --batch-size a multiple of the {n} ranks")
    return args


def reference_run(args, config, batches):
    """The single-device run: per step its loss, and its gradients of the first step."""
    minipar.manual_seed(args.seed)
    model = GPT(config)
    opt = AdamW(model.parameters(), **HYPER)
    losses, rng_states = [], []
    for step, (x, y) in enumerate(batches):
        rng_states.append(model.rng.state())
        _, loss = model(x, y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.copy() for n, p in model.named_parameters()}
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, model.state_dict(), rng_states


def parallel_run(stage, args, config, grid, batches, reference):
    """The same training under ZeRO ``stage``; errors, bytes held and bytes sent."""
    losses_s, grads_s, params_s, rng_states = reference
    dp = grid.dp_group
    tracemalloc.start()
    minipar.manual_seed(args.seed)
    model = GPT(config, grid)
    if stage == 0:
        ddp, opt = DataParallel(model, dp, args.bucket_kb << 10), AdamW(model.parameters(), **HYPER)
    else:
        opt = Zero3(model, dp, **HYPER) if stage == 3 else ZeroAdamW(model, dp, stage, bucket_bytes=args.bucket_kb << 10, **HYPER)
    tracemalloc.reset_peak()
    errors = {"loss": 0.0}
    for step, (x, y) in enumerate(batches):
        model.rng.set_state(rng_states[step])
        dp.stats.reset()
        xs, ys = split_batch(x, y, dp)
        _, loss = model(xs, ys)
        scaled = loss if args.plant_bug else scale_loss(loss, ys, dp)  # bug: N times too big
        count = dp.stats.by_op["all_reduce"].bytes_sent  # the token count's: not a gradient
        scaled.backward()
        if stage == 0:
            ddp.finish_gradients()
            grads = {n: p.grad.copy() for n, p in model.named_parameters()}
            clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            ddp.zero_grad()
        else:
            if step == 0:
                full = opt.full_gradients()
                grads = {n: full[id(p)] for n, p in model.named_parameters()}
            opt.clip_grad_norm(1.0)
            opt.step()
            opt.zero_grad()
        if stage == 0:
            sent = dp.stats.by_op["all_reduce"].bytes_sent - count
        else:  # ZeRO's all-reduces carry only the token count and the gradient norm
            sent = sum(t.bytes_sent for op, t in dp.stats.by_op.items() if op in ("reduce_scatter", "all_gather"))
        if step == 0:
            errors["gradients (worst tensor)"] = worst_tensor(grads, grads_s)
        loss_all = dp.all_reduce(np.array([loss.item() * len(xs)]))[0] / len(x)
        errors["loss"] = max(errors["loss"], rel_err(loss_all, losses_s[step]))
    params = opt.full_state_dict(model.named_parameters()) if stage == 3 else model.state_dict()
    errors[f"parameters after {args.steps} steps"] = as_one_vector(params, params_s)
    peak_numpy = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    held = ddp.state_bytes(opt) if stage == 0 else dict(opt.ledger.now)
    peak_state = sum(held.values()) if stage == 0 else opt.ledger.peak_total
    return errors, held, peak_state, peak_numpy, sent


def main():
    comm = world()
    args = parse_args(comm.size)
    minipar.set_default_dtype(args.dtype)
    grid = ProcessGrid(tp=1, pp=1)
    N = grid.dp
    config = GPTConfig(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=args.block_size, dropout=0.1)
    data = Dataset(load_corpus())
    batches = [data.batch("train", s, args.batch_size, args.block_size, args.seed) for s in range(args.steps)]
    reference = reference_run(args, config, batches)
    results = {stage: parallel_run(stage, args, config, grid, batches, reference) for stage in range(4)}
    tol = TOLERANCE[args.dtype]
    failed = int(any(e > tol for r in results.values() for e in r[0].values()))
    P = sum(v.size for v in reference[2].values())
    item = np.dtype(args.dtype).itemsize
    wte = config.vocab_size * config.n_embd
    failed = comm.all_reduce(np.array([failed]), op="max")[0]
    if comm.rank == 0:
        print(f"{N} data-parallel ranks; GPT of P = {P:,} parameters ({args.dtype}), "
              f"{args.steps} AdamW steps, dropout 0.1\n")
        print(f"relative error against the single-device run (tolerance {tol:g})")
        print(f"  {'':<28}" + "".join(f"{'stage ' + str(s):>11}" for s in results))
        for name in results[0][0]:
            print(f"  {name:<28}" + "".join(f"{results[s][0][name]:>11.1e}" for s in results))
        print(f"\nbytes held per rank: training state after a step, the ZeRO paper's formula "
              f"({item}-byte values), and the peaks during a step")
        print(f"  {'stage':<7}{'parameters':>12}{'gradients':>12}{'optimizer':>12}{'total':>13}"
              f"{'formula':>13}  {'':<11}{'peak, state':>13}{'peak, all arrays':>18}")
        for s, (_, held, peak_state, peak_numpy, _) in results.items():
            a, b = FORMULA[s]
            formula = item * (a * P + b * P // N) // 4
            a_, b_ = a * item // 4, b * item // 4  # the paper counts 4-byte values
            text = f"{a_}P + {b_}P/N" if a_ and b_ else (f"{a_}P" if a_ else f"{b_}P/N")
            print(f"  {s:<7}{held['parameters']:>12,}{held['gradients']:>12,}{held['optimizer']:>12,}"
                  f"{sum(held.values()):>13,}{formula:>13,}  {text:<11}{peak_state:>13,}{peak_numpy:>18,}")
        print(f"\nbytes sent per rank per step on the data-parallel group (ring model | formula)")
        for s, (*_, sent) in results.items():
            k = "3" if s == 3 else "2"
            formula = (3 if s == 3 else 2) * (N - 1) * item * P // N + (3 * (N - 1) * item * wte // N if s == 3 else 0)
            extra = " + 3 (N-1)/N x the tied embedding (used by two units)" if s == 3 else ""
            print(f"  stage {s}  {sent:>13,} | {formula:>13,}   {k} (N-1)/N x {item}P{extra}")
        print("\nMISMATCH: see the rows above" if failed else "\nEvery stage equals the single-device run.")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
