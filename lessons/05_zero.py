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

import minipar
from minipar.backend import add_device_flag, use_device
from minipar.cli import Parser, parse
from minipar.comm import world
from minipar.data import Dataset, load_corpus
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.data import scale_loss, split_batch, token_count
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.validate import RunConfig, problems
from minipar.verify import as_one_vector, rel_err, worst_tensor

TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
N_HEAD = 4
FORMULA = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}  # bytes per parameter: a P + b P / N


FLAGS = {"global_batch": "--batch-size", "micro_batches": "--micro-batches", "n_layer": "--n-layer",
         "n_embd": "--n-embd", "block_size": "--block-size", "dtype": "--dtype"}


def parse_args(comm):
    """The same flags and problems on every rank: on any, one rank prints them, one line each, and
    every rank exits with status 2 before any message (minipar.cli)."""
    p = Parser(description="ZeRO stages 0-3 against the single-device run.")
    p.add_argument("--dtype", choices=TOLERANCE, default="float32")
    add_device_flag(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--bucket-kb", type=int, default=256, help="gradient bucket / ZeRO group size")
    p.add_argument("--micro-batches", type=int, default=1, help="accumulated per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plant-bug", action="store_true",
                   help="backward on each rank's mean loss instead of its share of the global mean")

    def check(args):
        # stage 3 is the most demanding of the four runs (none has TP, PP or SP, which it refuses)
        run = RunConfig(world_size=comm.size, global_batch=args.batch_size, micro_batches=args.micro_batches,
                        n_layer=args.n_layer, n_head=N_HEAD, n_embd=args.n_embd, block_size=args.block_size,
                        dropout=0.1, zero_stage=3, dtype=args.dtype)
        found = [f"{flag} must be >= 1" for flag, value in (("--steps", args.steps), ("--bucket-kb", args.bucket_kb))
                 if value < 1]
        return found + problems(run, FLAGS)

    return parse(p, comm, check)


def reference_run(args, config, batches):
    """The single-device run: per step its loss, and its gradients of the first step."""
    minipar.manual_seed(args.seed)
    model = GPT(config)
    opt = AdamW(model.parameters(), **HYPER)
    losses = []
    for step, (x, y) in enumerate(batches):
        model.rng.iteration = step  # dropout masks: keyed by the step and the tokens' places
        _, loss = model(x, y)  # the whole batch at once
        loss.backward()
        if step == 0:
            grads = {n: p.grad.copy() for n, p in model.named_parameters()}
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, model.state_dict()


def parallel_run(stage, args, config, grid, batches, reference):
    """The same training under ZeRO ``stage``; errors, bytes held and sent, and the optimizer."""
    losses_s, grads_s, params_s = reference
    dp, k = grid.dp_group, args.micro_batches
    tracemalloc.start()
    minipar.manual_seed(args.seed)
    model = GPT(config, grid)
    opt = make_optimizer(model, grid, stage, bucket_bytes=args.bucket_kb << 10, **HYPER)
    errors, peak_numpy, sent = {"loss": 0.0}, 0, []
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
            errors["gradients (worst tensor)"] = worst_tensor({n: full[id(p)] for n, p in model.named_parameters()}, grads_s)
            dp.stats.reset()
            tracemalloc.reset_peak()
        else:
            step_bytes = 0
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        sent.append(step_bytes + traffic())
        peak_numpy = max(peak_numpy, tracemalloc.get_traced_memory()[1])
        loss_all = dp.all_reduce(np.array([sum(losses)]))[0] / len(x)
        errors["loss"] = max(errors["loss"], rel_err(loss_all, losses_s[step]))
    params = opt.full_state_dict()
    errors[f"parameters after {args.steps} steps"] = as_one_vector(params, params_s)
    tracemalloc.stop()
    held, peak_state = opt.state_bytes(), opt.peak_state_bytes()
    padding = opt.padding()
    return errors, held, peak_state, peak_numpy, sent, padding


def main():
    comm = world()
    args = parse_args(comm)
    minipar.set_default_dtype(args.dtype)
    use_device(args.device)
    comm = world()  # on GPUs, NCCL's
    grid = ProcessGrid(tp=1, pp=1)
    N = grid.dp
    config = GPTConfig(n_layer=args.n_layer, n_head=N_HEAD, n_embd=args.n_embd, block_size=args.block_size, dropout=0.1)
    data = Dataset(load_corpus())
    batches = [data.batch("train", s, args.batch_size, args.block_size, args.seed) for s in range(args.steps)]
    reference = reference_run(args, config, batches)
    results = {stage: parallel_run(stage, args, config, grid, batches, reference) for stage in range(4)}
    tol = TOLERANCE[args.dtype]
    P = sum(v.size for v in reference[2].values())
    item = np.dtype(args.dtype).itemsize
    wte = config.vocab_size * config.n_embd
    rows, failed = [], any(e > tol for r in results.values() for e in r[0].values())
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
        failed |= not (held_ok and sent_ok)
        rows.append((s, held, memory, peak_state, peak_numpy, sent[-1], traffic, padding, passes))
    failed = comm.all_reduce(np.array([int(failed)]), op="max")[0]
    if comm.rank == 0:
        print(f"{N} data-parallel ranks; GPT of P = {P:,} parameters ({args.dtype}), {args.steps} AdamW "
              f"steps of {args.micro_batches} micro-batch(es), dropout 0.1\n")
        print(f"relative error against the single-device run (tolerance {tol:g})")
        print(f"  {'':<28}" + "".join(f"{'stage ' + str(s):>11}" for s in results))
        for name in results[0][0]:
            print(f"  {name:<28}" + "".join(f"{results[s][0][name]:>11.1e}" for s in results))
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
        print("\nMISMATCH: see the rows above" if failed else
              "\nEvery stage equals the single-device run and holds and sends what the formulas say (plus padding).")
    comm.barrier()  # a rank's non-zero exit ends the job: not before rank 0 has printed
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
