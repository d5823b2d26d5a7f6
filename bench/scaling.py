"""Parallel speed-up: the same training step on 1 rank and on N, every technique side by side.

    python bench/scaling.py                      # N = 2, every layout, 3 rounds
    python bench/scaling.py --ranks 4 --only dp,tp,1f1b
    python bench/scaling.py --markdown           # the table for docs/benchmarks.md

Each layout is one ``python -m minipar.train`` launch through ``run_mpi.sh``, with the same model,
global batch, seed and data as the one-rank run it is compared with; a layout's step time is the
median of its logged per-step times (``--log-json``'s ``ms``) after the first few, which build
caches and warm BLAS. Layouts alternate in rounds, so a slow spell of this shared machine hits
each alike, and the figure kept is the median over rounds.

    speed-up   = t(1 rank) / t(N ranks)
    ideal      = N, and for a pipeline N (1 - b): the schedule's own bubble b, from the simulator
                 with the textbook unit costs, is idle time no implementation can remove. b is
                 idle over the makespan, (p - 1)/(m + p - 1) for GPipe and 1F1B, so N (1 - b) =
                 N / (1 + (p - 1)/m): the issue's 1/(1 + bubble) with Megatron's bubble, idle
                 over the busy time (p - 1)/m
    efficiency = speed-up / ideal

For a pipeline four bubbles stand side by side: the schedule's with equal stages (the formula's);
its bubble with each chunk costing its training FLOPs (``minipar.mfu``'s count: the last chunk's
head makes it the longest), which no implementation can go below without moving work between
stages; the one the step's own compute leaves with messages free (the trainer's
``bubble_expected``: the simulator replaying the schedule with every forward, backward and W as
long as it took); and the one measured. The third's excess over the second is the micro-batches'
unevenness (on a shared machine some run slower) and the work the FLOPs leave out (LayerNorms, the
loss); the fourth's over the third is what messages and the executor's own work cost.
PipeDream-2BW never flushes, so its formula's bubble is none and its FLOPs' only the stages'
imbalance; its stream of batches is not replayed ("-"). ``1f1b+defer`` is 1F1B with the head's
weight gradients run at the flush (``--defer-embedding-wgrad-compute``), ``1f1b-slack+defer``
1F1B-slack with them: the FLOPs' bubble counts them there. ``1f1b+defer+1`` and ``+2`` also defer
the weight gradients of the last stage's last one or two linear layers (``--defer-wgrad-linears``),
taking from its steady cycles the time by which the head makes them longer than the others'.

Every layout is compared with the one-rank run of its own model: the MoE layouts (expert
parallelism) with a one-rank MoE run. Its ideal N assumes a router that gives every rank as many
token-slots; the router of a run does not, and each MoE layer's all-to-all waits for the rank
whose experts took the most. So beside EP stands the share of the slots the busiest rank
computed (the sum over layers of each layer's largest, from the run's logged routing; 1/N when
balanced) and the speed-up that routing allows with each part costing its training FLOPs:
1 / ((1 - f) / N + f x share), f the experts' share of the FLOPs.

The pipelines run m = 8 micro-batches of 2 sequences; the plain one-rank step runs the whole
batch of 16 at once, which is what a pipeline has to beat.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from fractions import Fraction

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from minipar.mfu import flops_per_token  # noqa: E402
from minipar.parallel.pipeline import schedules  # noqa: E402
from minipar.parallel.pipeline.instructions import Pipeline  # noqa: E402
from minipar.parallel.pipeline.simulate import simulate  # noqa: E402
from minipar.plan.deferred import deferred_w_flops  # noqa: E402
from minipar.cli import Parser, non_negative_int, parse, positive_int  # noqa: E402

from flags import run_problems  # noqa: E402 (a script beside this one)

BATCH, MICRO = 16, 2  # the global batch, and a pipeline's micro-batch: m = BATCH / MICRO
MODEL = ["--n-head", "4", "--block-size", "128", "--global-batch-size", str(BATCH), "--seed", "0"]
EXPERTS, TOP_K = 4, 2  # the MoE layouts' experts per layer and experts per token
MOE = ["--num-experts", str(EXPERTS), "--moe-router-topk", str(TOP_K)]
PIPE = ["--pp", "{n}", "--micro-batch-size", str(MICRO)]
DEFER, LINEARS = "--defer-embedding-wgrad-compute", "--defer-wgrad-linears"

# name: (extra flags, "dense" or "moe" model, pipeline schedule or None); {n} is the rank count
LAYOUTS = {
    "dp": (["--dp", "{n}"], "dense", None),
    "zero1": (["--zero-stage", "1"], "dense", None),
    "zero2": (["--zero-stage", "2"], "dense", None),
    "dp+recompute": (["--dp", "{n}", "--recompute"], "dense", None),  # what ZeRO-3 cost when it recomputed
    "zero3": (["--zero-stage", "3"], "dense", None),
    "tp": (["--tp", "{n}"], "dense", None),
    "tp+sp": (["--tp", "{n}", "--sequence-parallel"], "dense", None),
    "gpipe": (PIPE + ["--schedule", "gpipe"], "dense", "gpipe"),
    "1f1b": (PIPE + ["--schedule", "1f1b"], "dense", "1f1b"),
    "1f1b-slack": (PIPE + ["--schedule", "1f1b-slack"], "dense", "1f1b-slack"),
    # the head's weight gradients at the flush (Megatron-LM's deferred embedding wgrad)
    "1f1b+defer": (PIPE + ["--schedule", "1f1b", DEFER], "dense", "1f1b"),
    "1f1b-slack+defer": (PIPE + ["--schedule", "1f1b-slack", DEFER], "dense", "1f1b-slack"),
    # and the last linear layers' (the last block's MLP products: c_proj's, then c_fc's)
    "1f1b+defer+1": (PIPE + ["--schedule", "1f1b", DEFER, LINEARS, "1"], "dense", "1f1b"),
    "1f1b+defer+2": (PIPE + ["--schedule", "1f1b", DEFER, LINEARS, "2"], "dense", "1f1b"),
    "interleaved": (PIPE + ["--schedule", "interleaved", "--vpp", "2"], "dense", "interleaved"),
    "zb-h1": (PIPE + ["--schedule", "zb-h1"], "dense", "zb-h1"),
    "zb-h2": (PIPE + ["--schedule", "zb-h2"], "dense", "zb-h2"),
    "zb-v": (PIPE + ["--schedule", "zb-v", "--vpp", "2"], "dense", "zb-v"),
    "pipedream-2bw": (PIPE + ["--schedule", "pipedream-2bw"], "dense", "pipedream-2bw"),
    "cp-ring": (["--cp", "{n}", "--cp-comm-type", "p2p"], "dense", None),
    "cp-ulysses": (["--cp", "{n}", "--cp-comm-type", "a2a"], "dense", None),
    "ep": (["--ep", "{n}"], "moe", None),
}


BUBBLES = "bubble: equal stages, its FLOPs, its compute, measured; EP: the routing's bound"


def busiest_share(tokens_per_expert, ranks):
    """Of a step's expert token-slots ((layers, experts), rank r holding the r-th run of E/N
    experts), the share its busiest rank computes, layer by layer."""
    loads = numpy.asarray(tokens_per_expert)
    loads = loads.reshape(loads.shape[0], ranks, -1).sum(axis=2)  # (layers, ranks)
    return float(loads.max(axis=1).sum() / loads.sum())


def routing_bound(share, n, n_layer, n_embd):
    """The speed-up on ``n`` ranks when the dense part splits evenly and the busiest rank computes
    ``share`` of the expert slots, each part costing its training FLOPs (``minipar.mfu``)."""
    total = flops_per_token(n_layer, n_embd, 128, 256, n_layer, TOP_K, EXPERTS)
    f = n_layer * TOP_K * 48 * n_embd**2 / total  # each slot's expert MLP: 48 h^2 (72 h^2 a block less attention's 24)
    return 1 / ((1 - f) / n + f * share)


def ideal(layout, n, n_layer, n_embd):
    """(ideal speed-up, the schedule's bubble with equal stages, its bubble with each chunk costing
    its FLOPs) of ``layout`` on ``n`` ranks; both bubbles None without a pipeline."""
    flags, _, schedule = LAYOUTS[layout]
    if schedule is None:
        return n, None, None
    defer = DEFER in flags
    linears = int(flags[flags.index(LINEARS) + 1]) if LINEARS in flags else 0
    m = BATCH // MICRO  # micro-batches of the one DP replica
    v = 2 if schedule in ("interleaved", "zb-v") else 1
    shape = schedules.shape_of(schedule)
    # training FLOPs per token of one block, and of the last chunk's head (minipar.mfu's count)
    block, head = flops_per_token(1, n_embd, 128, 0), flops_per_token(0, n_embd, 128, 256)
    pipe = Pipeline(n, m, v, shape)
    flops = {(r, c): Fraction(n_layer, n * v) * block + head * (pipe.global_chunk(r, c) == n * v - 1)
             for r in range(n) for c in range(v)}

    def bubble(cost, head=0):  # forward a third of a chunk's cost, backward two (split: B and W one each)
        split = schedule.startswith("zb")
        third = {k: x / 3 for k, x in cost.items()}
        sim = simulate(schedules.build(schedule, n, m, v, defer), m, v, forward=third,
                       backward=third if split else {k: 2 * x for k, x in third.items()},
                       weight=third if split else None, shape=shape, head=head)
        return sum(sim.bubble.values()) / n

    if schedule == "pipedream-2bw":
        # no flush: batch t+1's forwards fill batch t's drain, so in a long stream a stage idles
        # only while the slowest stage works (none with equal stages)
        loads = [sum(flops[r, c] for c in range(v)) for r in range(n)]
        return n, Fraction(0), 1 - Fraction(sum(loads), n * max(loads))
    equal = bubble(dict.fromkeys(flops, 1))
    # deferred, the head's W (a third of the head's FLOPs) and the last linear layers' leave the
    # last chunk's backward
    head_w = deferred_w_flops(n_embd, 256, linears)
    head_w = {k: head_w * (pipe.global_chunk(*k) == n * v - 1) for k in flops}
    return n * (1 - equal), equal, bubble(flops, head_w)


def step_ms(ranks, flags, steps, skip):
    """Median step time (ms), measured bubble, the bubble of the step's compute alone (None
    without a pipeline) and the busiest rank's share of the expert slots (None without experts)
    of one launch, from its --log-json rows after the first ``skip``."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [os.path.join(ROOT, "run_mpi.sh"), "-n", str(ranks), "-m", "minipar.train", *flags,
               "--max-iters", str(steps), "--log-json", log, "--eval-interval", str(10 * steps),
               "--eval-iters", "1", "--sample", "0", "--plot", "", "--log-interval", str(10 * steps)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        with open(log) as fh:
            rows = [json.loads(line) for line in fh]
    rows = rows[skip:]
    expected = statistics.median(r["bubble_expected"] for r in rows) if "bubble_expected" in rows[0] else None
    share = (statistics.median(busiest_share(r["tokens_per_expert"], ranks) for r in rows)
             if "tokens_per_expert" in rows[0] else None)
    return statistics.median(r["ms"] for r in rows), statistics.median(r["bubble"] for r in rows), expected, share


def model_flags(kind, size):
    """The model of a ``kind`` ("dense" or "moe") of ``size`` (its --n-layer and --n-embd flags)."""
    return MODEL + size + (MOE if kind == "moe" else [])


def flags_of(layout, n, size):
    extra, kind, _ = LAYOUTS[layout]
    return model_flags(kind, size) + [f.format(n=n) for f in extra]


def layout_problems(names, a):
    """The trainer's own refusals of each layout's flags on ``a.ranks`` ranks (``--ranks 4`` leaves
    the 4 layers too few for interleaved's 4 x 2 chunks), found before the first launch, not after
    a dozen."""
    from minipar.cli import FlagError
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    size = ["--n-layer", str(a.n_layer), "--n-embd", str(a.n_embd)]
    found = []
    for name in names:
        try:
            check_args(build_parser().parse_args(flags_of(name, a.ranks, size)), a.ranks)
        except FlagError as exc:
            found += [f"--only {name} on --ranks {a.ranks}: {line}" for line in exc.lines]
    return found


def main():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=positive_int, default=2, help="N: ranks of each parallel run (default 2)")
    p.add_argument("--only", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--steps", type=positive_int, default=12, help="training steps per launch")
    p.add_argument("--skip", type=non_negative_int, default=4, help="first steps left out of the median")
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=128)
    p.add_argument("--markdown", action="store_true", help="print a markdown table")

    def check(a):
        names = [name for name in a.only.split(",") if name]
        unknown = sorted(set(names) - set(LAYOUTS))
        found = [f"--only: unknown {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}"] if unknown else []
        found += ["--only '': name at least one layout"] * (not names)
        found += [f"--ranks must be 2 to 1,000,000 (run_mpi.sh's limit), got {a.ranks}"] * (not 2 <= a.ranks <= 10**6)
        found += [f"--steps {a.steps} must exceed --skip {a.skip}: no step would be timed"] * (a.steps <= a.skip)
        found += run_problems({"n_layer": "--n-layer", "n_embd": "--n-embd"}, n_layer=a.n_layer,
                              n_head=4, n_embd=a.n_embd, block_size=128)  # (MODEL's heads and T)
        return found or layout_problems([n for n in names if n in LAYOUTS], a)

    args = parse(p, None, check)
    layouts = [name for name in args.only.split(",") if name]
    models = sorted({LAYOUTS[name][1] for name in layouts})
    size = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]
    times = {key: [] for key in [("one", m) for m in models] + layouts}
    measured = {name: [] for name in layouts}  # the pipelines' idle share, as the trainer logs it
    expected = {name: [] for name in layouts}  # the bubble of the step's compute alone
    shares = {name: [] for name in layouts}  # the busiest rank's share of the expert slots
    for _ in range(args.rounds):
        for model in models:
            times[("one", model)].append(step_ms(1, model_flags(model, size), args.steps, args.skip)[0])
        for name in layouts:
            ms, bubble, of_costs, share = step_ms(args.ranks, flags_of(name, args.ranks, size), args.steps, args.skip)
            times[name].append(ms)
            measured[name].append(bubble)
            expected[name].append(of_costs)
            shares[name].append(share)
    one = {m: statistics.median(times[("one", m)]) for m in models}
    n = args.ranks
    rows = []
    for name in layouts:
        t = statistics.median(times[name])
        base = one[LAYOUTS[name][1]]
        best, bubble, of_flops = ideal(name, n, args.n_layer, args.n_embd)
        speedup = base / t
        idle = ""
        if LAYOUTS[name][2]:
            replayed = [b for b in expected[name] if b is not None]  # PipeDream-2BW's stream is not replayed
            idle = (f"{float(bubble):.3f}, {float(of_flops):.3f}, "
                    f"{f'{statistics.median(replayed):.3f}' if replayed else '-'}, {statistics.median(measured[name]):.3f}")
        elif shares[name][0] is not None:
            share = statistics.median(shares[name])
            idle = (f"busiest rank {share:.3f} of the slots: "
                    f"{routing_bound(share, n, args.n_layer, args.n_embd):.2f}x")
        rows.append((name, base, t, speedup, float(best), speedup / float(best), idle))
    print(f"{n} ranks against 1, median of {args.rounds} rounds, {args.steps - args.skip} steps each; "
          f"GPT of {args.n_layer} layers, hidden {args.n_embd}, 4 heads, T 128, batch {BATCH}")
    if args.markdown:
        print(f"\n| layout | 1 rank ms | N ranks ms | speed-up | ideal | efficiency | {BUBBLES} |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")
        for name, base, t, s, best, eff, idle in rows:
            print(f"| {name} | {base:.1f} | {t:.1f} | {s:.2f}x | {best:.2f}x | {eff:.2f} | {idle} |")
    else:
        width = max(len("layout"), *(len(name) for name, *_ in rows))
        print(f"\n{'layout':<{width}} {'1 rank ms':>10} {f'{n} ranks ms':>11} {'speed-up':>9} {'ideal':>6} "
              f"{'efficiency':>10}  {BUBBLES}")
        for name, base, t, s, best, eff, idle in rows:
            print(f"{name:<{width}} {base:>10.1f} {t:>11.1f} {s:>8.2f}x {best:>5.2f}x {eff:>10.2f}  {idle}")


if __name__ == "__main__":
    main()
