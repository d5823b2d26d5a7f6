"""Lesson 4's report: the errors, then each cost beside its formula (printed by rank 0)."""

import os

import numpy as np

import lesson
from minipar.parallel.pipeline import schedules


def print_schedules(args, p, runs):
    """--show-schedules: each run's instructions per rank, in order (printed before the runs)."""
    print("Each rank's instructions in order, one row per time slot. F3: the forward of micro-batch 3,\n"
          "B3 its backward (split: its input half), W3 the weights' half; interleaved and ZB-V, F3.1:\n"
          "the forward of micro-batch 3 on the rank's chunk 1.\n")
    for name, vv in runs:
        plan = schedules.build(name, p, args.micro_batches, vv, args.defer_embedding_wgrad)
        print(f"{name} (compute order per rank)\n{schedules.table(plan)}\n")


def report(args, grid, columns, lines, tol, two_bw=None):
    """``columns``: the error table, {schedule (+r: with recompute): {row: error}}."""
    p, m = grid.pp, args.micro_batches
    print(f"PP={p} x DP={grid.dp}; GPT of {args.n_layer} blocks; global batch {args.batch_size} in {m} "
          f"micro-batches;\n{args.dtype}, dropout 0.1, {args.steps} AdamW steps"
          + ("; the head's weight gradients at the flush (H)" if args.defer_embedding_wgrad else "")
          + (f";\nwith them the weight gradients of the last {args.defer_wgrad_linears} linear "
             f"layer{'s' * (args.defer_wgrad_linears > 1)}" if args.defer_wgrad_linears else ""))
    for i in range(0, len(columns), 6):  # six columns fit a line
        lesson.print_errors(dict(list(columns.items())[i:i + 6]), tol, width=10,
                            note=";\n+r: with recompute, interl: interleaved" if i == 0 else "")
    if lines:
        print_costs(args, grid, lines)
    if two_bw is not None:
        print_two_bw(args, two_bw, tol)


def print_costs(args, grid, lines):
    p = grid.pp
    print("\nbubble: the idle fraction of a step (convention: idle time / makespan), mean over the ranks\n"
          f"  {'schedule':<15}{'formula':<17}{'theory':>6}{'sim, unit':>11}{'sim, step':>12}{'measured':>10}"
          "   measured per rank")
    for ln in lines:
        for tag, unit, replayed, bubbles in zip(("", "+r"), ln.units, ln.replayed, ln.measured):
            b = list(bubbles.values())
            theory = "-" if ln.theory is None else f"{float(ln.theory):.3f}"
            print(f"  {ln.name + tag:<15}{ln.text:<17}{theory:>6}{float(unit.bubble[0]):>11.3f}"
                  f"{replayed:>12.3f}{np.mean(b):>10.3f}   "
                  + (" ".join(f"{x:.2f}" for x in b) if p <= 4 else f"{min(b):.2f} to {max(b):.2f}"))
    print("  +r: with recompute. sim, unit: F 1, B 1, W 1 (a fused backward 2; +1 recompute) on equal\n"
          "  stages, the formula (-: none, too few micro-batches for the zero-bubble steady state); sim,\n"
          "  step: the last step replayed with each forward and backward as long as it took (costs\n"
          "  below), messages free. measured: the last step; minus sim, step: what the messages cost.")
    vv = lines[0].v
    print(f"\nmeasured costs of a {'chunk' if vv > 1 else 'stage'} (ms, median over the micro-batches of "
          f"{lines[0].name}'s last step)\n  {'rank' + ('.chunk' if vv > 1 else ''):<12}{'forward':>9}"
          f"{'backward':>10}{'recompute':>11}{'backward/forward':>18}")
    for (r, c), (f, b, extra) in lines[0].stage_costs.items():
        print(f"  {str(r) + (f'.{c}' if vv > 1 else ''):<12}{f * 1e3:>9.2f}{b * 1e3:>10.2f}{extra * 1e3:>11.2f}"
              f"{b / f:>18.2f}")
    print("  (the unit model: backward 2, recompute 1. Here products are under half of a forward, and\n"
          "  backward skips much of the rest: masks, checks. Measured why: docs/pipeline_parallel.md)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if grid.layout.world_size > cores:
        print(f"\n{grid.layout.world_size} ranks on {cores} cores: ranks that compute at once share a core (the costs\n"
              "above stretch), and a waiting rank lends its core to the others, so the measured bubble\n"
              "hardly moves with m here (try --micro-batches 4 and 16). With a core per rank it follows\n"
              f'"sim, step" (-n {cores} here; the table in docs/pipeline_parallel.md).')
    print("\nactivations held: the most micro-batches a rank had run forward but not yet backward (or W)")
    print(f"  {'schedule':<13}" + "".join(f"{'rank ' + str(r):>9}" for r in range(p)) + "   formula")
    for ln in lines:
        print(f"  {ln.name:<13}" + "".join(f"{a:>9}" for a in ln.alive) + f"   {ln.held}")
    print("\npeak bytes of the step's arrays per rank (activations and temporaries), without | with recompute")
    print(f"  {'schedule':<13}" + "".join(f"{'rank ' + str(r):>17}" for r in range(p)))
    for ln in lines:
        with_r = ln.mem_r or [None] * p
        print(f"  {ln.name:<13}" + "".join(f"{a / 1e6:>7.1f} |" + (f"{b / 1e6:>5.1f} MB " if b else "    - MB ")
                                          for a, b in zip(ln.mem, with_r)))
    print("\nbytes sent per rank per step (activations forward, gradients back): measured = formula")
    for ln in lines:
        print(f"  {ln.name:<13}" + "".join(f"{b:>12,}" for b in ln.per_rank))
    print(f"\ntimelines: {args.out}/<schedule>_measured.png, _simulated.png, _trace.json")


def print_two_bw(args, run, tol):
    lesson.print_errors({None: run.errors}, tol, title="PipeDream-2BW against one device running "
                        "W(t+1) = W(t) - lr grad f(W(t-1))")
    print("\nloss per step   " + " ".join(f"{t:>7}" for t in range(min(len(run.losses), 8)))
          + ("  ..." if len(run.losses) > 8 else ""))
    for label, losses in (("synchronous", run.synchronous), ("PipeDream-2BW", run.losses)):
        print(f"  {label:<14}" + " ".join(f"{x:>7.4f}" for x in losses[:8]))
    print(f"  apart by up to {run.apart:.2e}: asynchrony changes the maths (step 1 reuses grad f(W(0)))")
    print("stash per rank (one more copy of its parameters, and one of a batch's gradients), bytes:\n  "
          + ", ".join(f"{b:,}" for b in run.stash))
    print(f"loss curves: {args.out}/pipedream_2bw_loss.png")
