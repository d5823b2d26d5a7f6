"""Lesson 10: mixed precision, bf16 and fp16 with fp32 master weights, on N data-parallel ranks.

    ./run_mpi.sh -n 4 lessons/10_mixed_precision.py
    ./run_mpi.sh -n 8 lessons/10_mixed_precision.py --zero-stage 3
    ./run_mpi.sh -n 2 lessons/10_mixed_precision.py --plant-bug  # each rank trusts its own overflow check: fails

Every real LLM trains in 16 bits. The weights, activations and gradients are bfloat16 or float16;
the optimizer keeps an fp32 master copy of every weight and Adam's m and v in fp32, updates the
master and rounds it into the 16-bit weight (a bfloat16 weight near 1 would not move: its
neighbours there are 2^-7 apart, and an update of lr = 1e-3 is below half of that, 2^-8 = 0.0039,
the unit roundoff, so it rounds back). LayerNorm, softmax, the loss and every
matrix product accumulate in fp32. float16 has 5 bits of exponent, so its small gradients vanish
below 6e-8: the loss is multiplied by a scale S before backward and the gradients divided by S in
fp32; an overflow (S too large) skips the step on every rank and halves S (Megatron's dynamic
scale). bfloat16 has float32's exponent and needs no scale.

The lesson, on N data-parallel ranks (ZeRO stage --zero-stage):

1. bytes per parameter each rank holds after a step, by ZeRO stage and precision, beside the
   formulas: fp32 16P, 8P + 8P/N, 4P + 12P/N, 16P/N; 16-bit (the ZeRO paper's 2 + 2 + 12 bytes)
   16P, 4P + 12P/N, 2P + 14P/N, 16P/N;
2. fp32, bf16 and fp16 loss curves side by side (a picture: --plot), and each step's time: on a
   CPU 16-bit arithmetic is emulated, so it is slower, not faster;
3. an overflow planted at step --overflow-step in the last rank's gradients (after the DP sum, so
   no other rank can see it) skips the step on every rank, the state bit-identical, the scale
   halved everywhere;
4. the precision machinery set to keep float64 everywhere (float64 "16-bit" weights, float64
   masters, a loss scale of 1) equals the plain float64 run bit for bit.

Read next: minipar/precision.py, minipar/parallel/mixed_precision.py, docs/mixed_precision.md.

Exercises (predict first, then run the command and read the table named):
1. Predict bf16's total bytes at stage 1 and 8 ranks for the P printed, then check "bytes held"
   at ./run_mpi.sh -n 8 lessons/10_mixed_precision.py. By how much does ZeRO-1 help more in 16 bits?
2. --fp16-initial-scale 4294967296 --steps 24 (Megatron's first scale, 2^32): each overflow
   skips the step and halves the scale. Predict how many of the first steps are skipped before
   the scaled gradients fit float16 (largest 65504; section 2's "skipped" column), and what fp16's
   last loss is then against float32's.
3. --plant-bug: each rank decides from its own gradients (at ZeRO-0: under ZeRO-1 the run would
   hang; why?). Predict which numbers of section 3 change.
"""

import hashlib
import os
import time

import numpy as np

import lesson
import minipar
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.data import scale_loss, split_batch, token_count
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.validate import RunConfig, problems
from minipar.plots import path_problem, plot_curves
from minipar.precision import ConstantLossScaler, DynamicLossScaler, Policy

N_HEAD = 4
FORMULA = {"float32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},  # bytes: a P + b P/N
           "16-bit": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}}  # the ZeRO paper's
OVERFLOW_STEP = 2  # section 3's planted overflow, unless --overflow-step says otherwise
FLAGS = {"global_batch": "--batch-size", "n_layer": "--n-layer", "n_embd": "--n-embd",
         "block_size": "--block-size", "zero_stage": "--zero-stage"}


def flags(p):
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--zero-stage", type=int, default=1, help="the stage of the training runs")
    p.add_argument("--overflow-step", type=int, help=f"the step whose gradients overflow (default {OVERFLOW_STEP})")
    p.add_argument("--fp16-initial-scale", type=float, default=2.0**16, help="fp16's first loss scale")
    p.add_argument("--plot", default="out/mixed_precision.png", help="the loss curves ('' for none)")


def check(args, ranks):
    run = RunConfig(world_size=ranks, global_batch=args.batch_size, n_layer=args.n_layer, n_head=N_HEAD,
                    n_embd=args.n_embd, block_size=args.block_size, zero_stage=args.zero_stage)
    out = problems(run, FLAGS) or lesson.memory_problems(run, FLAGS, args.steps, reference=False)
    out = lesson.at_least_one(args, "--steps") + out
    if args.overflow_step is None and not OVERFLOW_STEP < args.steps:  # named: the user gave --steps alone
        out.append(f"--steps {args.steps}: section 3 plants an overflow at step {OVERFLOW_STEP} (--overflow-step's "
                   f"default): give --steps {OVERFLOW_STEP + 1} or more, or an --overflow-step below {args.steps}")
    elif args.overflow_step is None:
        args.overflow_step = OVERFLOW_STEP
    elif not 0 <= args.overflow_step < args.steps:
        out.append(f"--overflow-step {args.overflow_step} is not one of the {args.steps} steps (--steps)")
    if args.plant_bug and ranks < 2:  # one rank's own check is everyone's
        out.append("--plant-bug lets each rank decide alone whether a step overflowed, and one rank's decision is "
                   "every rank's: run it on 2 or more ranks (./run_mpi.sh -n 2)")
    if not 1 <= args.fp16_initial_scale < float("inf"):  # the scaler's smallest scale is 1; nan fails too
        out.append(f"--fp16-initial-scale must be finite and >= 1, got {args.fp16_initial_scale}")
    if args.plot and path_problem(args.plot):
        out.append(f"--plot {args.plot}: {path_problem(args.plot)}")
    elif args.plot:
        out += lesson.output_problems("--plot", args.plot, os.path.dirname(os.path.abspath(args.plot)))
    return out


def build(args, config, grid, stage, dtype, policy=None, scaler=None, agree=True):
    minipar.set_default_dtype(dtype)
    minipar.manual_seed(args.seed)
    model = GPT(config, grid)
    opt = make_optimizer(model, grid, stage, policy=policy, scaler=scaler, **lesson.HYPER)
    if not agree:  # the planted bug: an overflow check that asks nobody else
        opt.world = None
    return model, opt


def train_step(model, opt, dp, step, x, y, plant=False, hold=False):
    """One step of data parallelism with a loss scale; returns (the global loss, skipped,
    overflowed): whether the optimizer skipped the step, and whether any rank's gradients really
    held an inf or NaN, seen here, not by the optimizer. ``hold``: compute the loss and gradients
    but leave the weights, as a skipped step does."""
    model.rng.iteration = step
    xs, ys = split_batch(x, y, dp)
    # fp16's loss scale overflows on purpose (the step is then skipped): NumPy's warnings say nothing more
    with model.rng.at(rows=np.array_split(np.arange(len(x)), dp.size)[dp.rank]), np.errstate(over="ignore",
                                                                                              invalid="ignore"):
        # L = (1/N) * sum over all ranks' tokens of l_i: this rank's l_i summed, over the global
        # batch's N (every rank holds it); then times the loss scale, which the optimizer divides out
        logits, _ = model(xs)
        loss = scale_loss(model.loss(logits, ys, reduction="sum"), token_count(y))
        (loss * opt.loss_scale).backward()
    opt.finish_gradients()
    if plant:  # after the sum over DP: only this rank holds it
        opt._gradients()[-1][0] = np.inf
    overflowed = any(not np.isfinite(g).all() for g in opt._gradients())
    overflowed = bool(dp.all_reduce(np.array([float(overflowed)]), op="max")[0])
    if not hold:
        opt.clip_grad_norm(1.0)
        opt.step()
    opt.zero_grad()
    return dp.all_reduce(np.array([loss.item()]))[0], opt.skipped_step, overflowed  # the shares add up to L


def digest(opt):
    h = hashlib.sha256()
    for kind, _, array, *_ in opt.state_arrays():
        h.update(kind.encode() + np.ascontiguousarray(array).tobytes())
    return np.frombuffer(h.digest()[:8], np.int64)


def formula(a, b):
    return f"{a}P + {b}P/N" if a and b else (f"{a}P" if a else f"{b}P/N")


def main():
    args, comm = lesson.start("Mixed precision: bf16 and fp16 with fp32 master weights.", flags, check,
                              plant_bug="let each rank decide from its own gradients whether the step "
                              "overflowed (no all-reduce)", steps=12, dtypes=("float32",),
                              dtype_help="float32 only: the lesson trains in float32, bf16 and fp16 itself "
                              "(over float32 masters), and checks float64 in section 4")
    grid = ProcessGrid(tp=1, pp=1)
    dp, N, failed = grid.dp_group, grid.dp, []
    config = GPTConfig(n_layer=args.n_layer, n_head=N_HEAD, n_embd=args.n_embd, block_size=args.block_size,
                       dropout=0.1)
    batches = lesson.batches(args, config.block_size)
    precisions = {"float32": ("float32", None, None), "bf16": ("bfloat16", Policy.of("bfloat16"), None),
                  "fp16": ("float16", Policy.of("float16"), lambda: DynamicLossScaler(
                      args.fp16_initial_scale, growth_interval=5, hysteresis=1))}

    # 1. bytes held per rank after one step, by stage and precision
    minipar.manual_seed(args.seed)
    P, memory = sum(p.size for p in GPT(config).parameters()), {}
    for name, (dtype, policy, scaler) in precisions.items():
        for stage in range(4):
            model, opt = build(args, config, grid, stage, dtype, policy, scaler and scaler())
            train_step(model, opt, dp, 0, *batches[0])
            padded = P + opt.padding()
            a, b = FORMULA["float32" if policy is None else "16-bit"][stage]
            expected = a * padded + b * padded // N if stage else a * P
            held = sum(opt.state_bytes().values())
            if held != expected:
                failed.append(f"{name} at stage {stage} holds {held:,} bytes, not the formula's {expected:,} (1.)")
            memory[name, stage] = (held, expected, padded)

    # 2. the three precisions trained side by side. A step is skipped exactly when its gradients
    # overflowed (seen by the lesson itself). fp16's skips (a loss scale too large for float16 at
    # first) leave its weights behind float32's, so its curve is held to a float32 run that holds
    # its weights at the steps that overflowed
    curves, times, skipped, overflowed = {}, {}, {}, {}
    for name, (dtype, policy, scaler) in precisions.items():
        model, opt = build(args, config, grid, args.zero_stage, dtype, policy, scaler and scaler())
        curves[name], times[name], skipped[name], overflowed[name] = [], [], [], []
        for step, (x, y) in enumerate(batches):
            start = time.perf_counter()
            loss, skip, inf = train_step(model, opt, dp, step, x, y)
            times[name].append(time.perf_counter() - start)
            curves[name].append(loss)
            skipped[name] += [step] * skip
            overflowed[name] += [step] * inf
    failed += [f"{n} skipped steps {skipped[n]}, but its gradients overflowed at {overflowed[n]} (2.)"
               for n in precisions if skipped[n] != overflowed[n]]
    failed += ["fp16 skipped every step (2.)"] * (len(skipped["fp16"]) == len(batches))
    reference = {"bf16": curves["float32"], "fp16": curves["float32"]}
    if overflowed["fp16"]:
        model, opt = build(args, config, grid, args.zero_stage, "float32")
        reference["fp16"] = [train_step(model, opt, dp, step, x, y, hold=step in overflowed["fp16"])[0]
                             for step, (x, y) in enumerate(batches)]
    gap = {n: max(abs(a - b) for a, b in zip(curves[n], reference[n])) for n in ("bf16", "fp16")}
    failed += [f"{n}'s loss strays {gap[n]:.3f} from float32's, above 0.1 (2.)" for n in gap if not gap[n] < 0.1]

    # 3. an overflow on one rank skips the step on every rank. The planted bug runs at stage 0:
    # under ZeRO the ranks that step would wait forever in an all-gather the skipping rank never
    # enters; at stage 0 nothing waits, and the replicas silently drift apart
    overflow_stage = 0 if args.plant_bug else args.zero_stage
    model, opt = build(args, config, grid, overflow_stage, "float16", Policy.of("float16"),
                       DynamicLossScaler(args.fp16_initial_scale, hysteresis=1), agree=not args.plant_bug)
    for step, (x, y) in enumerate(batches[: args.overflow_step + 1]):
        before, scale = digest(opt), opt.loss_scale
        _, skip, _ = train_step(model, opt, dp, step, x, y, plant=step == args.overflow_step and dp.rank == N - 1)
    every = comm.all_gather(np.array([int(skip), int((digest(opt) == before).all()), opt.loss_scale]))
    backed_off = max(scale / 2, 1.0)  # halved, never below the scaler's floor of 1 (--fp16-initial-scale 1.5: 1)
    overflow_ok = (every[:, 0] == 1).all() and (every[:, 1] == 1).all() and (every[:, 2] == backed_off).all()
    failed += [f"the overflow on rank {N - 1} was not handled alike on every rank (each should skip the step, "
               f"keep its state and halve its scale) (3.)"] * (not overflow_ok)

    # 4. the machinery in float64 everywhere is the float64 run
    runs = [build(args, config, grid, args.zero_stage, "float64"),
            build(args, config, grid, args.zero_stage, "float64", Policy.of("float64", main="float64"),
                  ConstantLossScaler(1.0))]
    for step, (x, y) in enumerate(batches):
        for model, opt in runs:
            train_step(model, opt, dp, step, x, y)
    plain, mixed = (opt.full_state_dict() for _, opt in runs)
    differing = sum(not np.array_equal(plain[n], mixed[n]) for n in plain)
    failed += [f"the float64 policy differs from the float64 run in {differing} tensors (4.)"] * (differing != 0)
    if args.plot and comm.rank == 0:
        plot_curves(curves, args.plot, title=f"GPT on {N} ranks, ZeRO-{args.zero_stage}: fp32, bf16, fp16")

    def report():
        print(f"{N} data-parallel ranks; GPT of {args.n_layer} layers, width {args.n_embd}; {args.steps} steps")
        print("\n1. bytes held per rank after a step (P counts the padding of ZeRO's flat buffers)")
        print(f"  {'stage':<7}{'float32':>12}{'formula':>13}{'bf16':>12}{'fp16':>12}{'formula':>18}")
        for s in range(4):
            f32, f32_expected, _ = memory["float32", s]
            print(f"  {s:<7}{f32:>12,}{formula(*FORMULA['float32'][s]):>13}{memory['bf16', s][0]:>12,}"
                  f"{memory['fp16', s][0]:>12,}{formula(*FORMULA['16-bit'][s]):>18}")
        per = {s: memory["bf16", s][0] / memory["bf16", s][2] for s in range(4)}
        print("  bf16 bytes per (padded) parameter: " + ", ".join(f"stage {s} {v:.2f}" for s, v in per.items()))
        print(f"\n2. training with ZeRO-{args.zero_stage} (largest loss gap to float32: tolerance 0.1)")
        print(f"  {'':<9}{'first loss':>11}{'last loss':>11}{'gap':>8}{'skipped':>9}{'ms/step':>9}")
        for name in curves:
            ms = 1e3 * np.median(times[name][1:] or times[name])
            print(f"  {name:<9}{curves[name][0]:>11.4f}{curves[name][-1]:>11.4f}{gap.get(name, 0.0):>8.4f}"
                  f"{len(skipped[name]):>9}{ms:>9.1f}")
        for name in curves:
            if skipped[name] != overflowed[name]:
                print(f"  {name} skipped steps {skipped[name]}, but its gradients overflowed at {overflowed[name]}")
        if overflowed["fp16"]:
            steps, many = overflowed["fp16"], len(overflowed["fp16"]) > 1
            print(f"  (fp16's gradients overflowed at step{'s' * many} {', '.join(map(str, steps))}:\n"
                  f"  its gap is to a float32 run that held its weights at {'those steps' if many else 'that step'})")
        if len(skipped["fp16"]) == len(batches):
            print("  fp16 skipped every step, so its curve shows nothing: lower --fp16-initial-scale or raise --steps")
        print("  (a CPU emulates 16-bit arithmetic: expect no speed-up here, and with more ranks than cores\n"
              "  the times are mostly waiting; docs/mixed_precision.md measures one process)")
        if args.plot:
            print(f"  loss curves written to {args.plot}")
        print(f"\n3. overflow planted at step {args.overflow_step} on rank {N - 1} only (ZeRO-{overflow_stage})")
        print(f"  skipped on {int(every[:, 0].sum())} of {N} ranks; state unchanged on {int(every[:, 1].sum())};"
              f" scale {scale:g} -> {sorted(set(every[:, 2].tolist()))}")
        print(f"\n4. float64 policy against the float64 run: {differing} of {len(plain)} tensors differ (0 expected)")

    return lesson.finish(comm, failed, report, "16-bit training holds the ZeRO paper's bytes, follows the "
                         "float32 curve, skips overflowed steps on every rank, and is exact in float64.")


if __name__ == "__main__":
    lesson.end(main())
