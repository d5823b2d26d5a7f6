"""Lesson 4: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B), checked against one device.

    ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py              # PP = 4
    ./run_mpi.sh -n 8 lessons/04_pipeline_parallel.py              # PP = 4 x DP = 2
    ./run_mpi.sh -n 8 lessons/04_pipeline_parallel.py --pp 2       # PP = 2 x DP = 4
    ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py --dtype float64
    ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py --schedule 1f1b   # one schedule, not all three
    ./run_mpi.sh -n 2 lessons/04_pipeline_parallel.py --show-schedules   # a core per rank

The GPT's 8 blocks are cut into stages: on 4 ranks, rank r runs blocks 2r and 2r+1, the first rank
also the embeddings, the last the final LayerNorm and the loss (with 2 virtual stages, rank r holds
blocks r and 4 + r: a micro-batch passes every rank twice). By default the pipeline is as long as
the flags allow (every rank a stage on 2 or 4 ranks; on 8, 16 chunks of 8 blocks cannot be, so
PP = 4 and the rest is data parallelism). The step's batch is cut into m micro-batches
that follow each other through the stages, each rank forwarding one while its neighbours work on
others. Activations go forward and their gradients back as point-to-point messages.

Each schedule trains a few AdamW steps from the same seed as the single-device run, with dropout,
with and without activation recompute, and we compare the loss, every gradient and the parameters.
Then the costs, each next to its formula:

* the bubble: the fraction of a step a rank waits, (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved:
  exact in a simulation with unit costs, simulated with each stage's costs measured in this run,
  and measured (near that when each rank has a core; stuck well above when ranks share cores);
* memory: how many micro-batches' activations a rank holds at once (m for GPipe, p - rank for
  1F1B), and the bytes measured with and without recompute;
* the bytes each rank sends per step.

The timelines are drawn in --out: one Gantt picture per schedule as measured, one simulated, and a
Chrome trace (open it in Perfetto or chrome://tracing). Read next: docs/pipeline_parallel.md.

What to look at: the bubble table (theory = "sim, unit"; "sim, costs" and measured are this
machine), the costs (backward is not 2 forwards here), the activations held (m for GPipe, p - rank
for 1F1B) and the bytes sent. With --show-schedules each rank's instructions are printed in
order: F3 is the forward of micro-batch 3, B3 its backward, and in the interleaved table F3.1 is
the forward of micro-batch 3 on the rank's chunk 1.

Exercises (predict first, then run the command and read the table named):
1. Micro-batches against the bubble on 4 stages: predict the "theory" column of gpipe/1f1b and of
   interleaved (v = 2) for m = 4, 8 and 16, then run
   ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py --micro-batches 4   (then 8, then 16)
   and see whether "measured" follows it (on 2 cores it hardly moves: see the note). Then with
   a core per rank, -n 2 --schedule 1f1b --micro-batches 2 (4, 8, 16): does it follow "sim, costs"?
2. Predict the "activations held" rows for --micro-batches 16 on 4 ranks, GPipe and 1F1B, and why
   only one of them grows with m. The bytes table below it shows the same in megabytes.
3. Write down 1F1B's order for 2 stages and 4 micro-batches (rank 0 runs two forwards before its
   first backward; rank 1, the last stage, alternates at once), then check it:
   ./run_mpi.sh -n 2 lessons/04_pipeline_parallel.py --schedule 1f1b --micro-batches 4 --show-schedules
4. --plant-bug never adds the tied embedding's two gradient parts (first and last stage). Predict
   which error rows fail, and whether step 1's loss could still match:
   ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py --schedule 1f1b --plant-bug
"""

import os
import sys
import tracemalloc
from types import SimpleNamespace

import numpy as np

import lesson
import minipar
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline import schedules, trace
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.pipeline.simulate import simulate, theoretical_bubble
from minipar.parallel.validate import RunConfig, problems

N_HEAD, N_EMBD = 4, 128  # the GPT's width; its depth and context are flags
# the RunConfig field each flag sets, so that a problem names the flag
FLAGS = {"pp": "--pp", "micro_batches": "--micro-batches", "virtual_stages": "--virtual-stages",
         "n_layer": "--n-layer", "global_batch": "--batch-size", "block_size": "--block-size",
         "schedule": "--schedule"}
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def run_config(n, args, pp):
    """The runs this lesson makes on n ranks with pp stages, as plain numbers: with every schedule,
    the interleaved schedule's rules hold for GPipe and 1F1B too (they run with one chunk per rank)."""
    return RunConfig(world_size=n, pp=pp, virtual_stages=args.virtual_stages, schedule=args.schedule or "interleaved",
                     global_batch=args.batch_size, micro_batches=args.micro_batches, n_layer=args.n_layer,
                     n_head=N_HEAD, n_embd=N_EMBD, block_size=args.block_size, dtype=args.dtype)


def choose_pipeline(n, args):
    """(--pp, problems). By default the most stages among the divisors of the ranks for which the
    run has no problem; if none fits, the problems every choice shares, or a line saying so."""
    if args.pp is not None:
        return args.pp, problems(run_config(n, args, args.pp), FLAGS)
    tried = {pp: problems(run_config(n, args, pp), FLAGS) for pp in range(1, n + 1) if n % pp == 0}
    fits = [pp for pp, found in tried.items() if not found]
    if fits:
        return max(fits), []
    common = set.intersection(*map(set, tried.values()))  # problems that no --pp would mend
    return None, [f for f in tried[1] if f in common] or [
        f"no pipeline fits {n} rank(s) with {'--schedule ' + args.schedule + ', ' if args.schedule else ''}--micro-batches {args.micro_batches}, --virtual-stages "
        f"{args.virtual_stages}, --n-layer {args.n_layer} and --batch-size {args.batch_size}: change "
        "those flags or the number of ranks (the defaults fit 2, 4 and 8)"]


def flags(p):
    p.add_argument("--pp", type=int, help="pipeline stages (DP = ranks / PP); default: the most the "
                   "other flags allow")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--schedule", help="run only this one: gpipe, 1f1b or interleaved (default: all three)")
    p.add_argument("--virtual-stages", type=int, help="chunks per rank, interleaved schedule (default 2)")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16, help="the global batch of a step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--out", default="out/pipeline", help="where the timeline pictures and traces go")
    p.add_argument("--show-schedules", action="store_true", help="print each schedule as a table first")


def check(args, ranks):
    if args.virtual_stages is None:  # 2 for the interleaved run; GPipe and 1F1B alone need 1
        args.virtual_stages = 2 if args.schedule in (None, "interleaved") else 1
    args.pp, found = choose_pipeline(ranks, args)
    if args.steps < 2:
        found.insert(0, "--steps must be >= 2 (memory is measured in the first step, time in the last)")
    return found


def pipeline_run(comm, name, v, recompute, args, config, grid, batches, reference):
    """Train with one schedule; the errors against the reference (the worst over the ranks), and
    what the step cost, gathered from every rank."""
    minipar.manual_seed(args.seed)
    model = GPT(config, grid, virtual_stages=v)
    opt = make_optimizer(model, grid, 0, **lesson.HYPER)  # data parallelism + AdamW (DP = 1: nothing sent)
    if args.plant_bug:  # the tied embedding's parts on the first and last stage are never added
        model.finalize_grads = lambda: None
    run = PipelineExecutor(model, grid, name, args.micro_batches, optimizer=opt, recompute=recompute)
    compare, costs = lesson.Comparison(reference), {}
    for step, (x, y) in enumerate(batches):
        model.rng.iteration = step  # keys the dropout masks (with each token's place)
        if step == 0:
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
        if grid.pp_group is not None:
            grid.pp_group.stats.reset()

        def optimizer_step():
            opt.finish_gradients()  # the DP all-reduce, then model.finalize_grads()
            if step == 0:
                costs["activation bytes"] = tracemalloc.get_traced_memory()[1] - before
                tracemalloc.stop()
                compare.gradients({n: p.grad for n, p in model.named_parameters()})  # this stage's
            opt.step()

        record = run.step(x, y, optimizer_step)
        if grid.is_last_stage:
            loss = record.loss if grid.dp == 1 else grid.dp_group.all_reduce(np.array([record.loss]))[0]
            compare.loss(step, loss)
        opt.zero_grad()
    # parameters as one vector over all ranks: sums of squares, added up over the world
    sq = np.zeros(2)
    for n, p in model.named_parameters():
        a, b = np.asarray(p.data, np.float64), np.asarray(reference.params[n], np.float64)
        sq += [((a - b) ** 2).sum(), (b ** 2).sum()]
    sq = comm.all_reduce(sq)
    compare.record("parameters", float(np.sqrt(sq[0] / sq[1])))
    costs.update(timelines=gather_timelines(comm, grid, name, args.micro_batches, v, record.timeline),
                 peak_alive=comm.all_gather(np.array([record.peak_alive]))[:, 0],
                 sent=grid.pp_group.stats.total().bytes_sent if grid.pp_group is not None else 0)
    costs["activation bytes"] = comm.all_gather(np.array([costs["activation bytes"]]))[:, 0]
    return compare.worst_over(comm), costs


def gather_timelines(comm, grid, name, m, v, timeline):
    """Every rank's (start, end) per instruction, on every rank; kept: the pipeline of replica 0."""
    plans = schedules.build(name, grid.pp, m, v)
    n = max(len(s) for s in plans.values())
    mine = np.full((n, 2), np.nan)
    mine[: len(timeline)] = [(start, end) for *_, start, end in timeline]
    everyone = comm.all_gather(mine)
    out = {}
    for r, plan in plans.items():
        times = everyone[grid.layout.rank(pp=r)]
        out[r] = [(i.op, i.mb, i.chunk, s, e) for i, (s, e) in zip(plan, times)]
    return out


def main():
    args, comm = lesson.start("Pipeline parallelism against the single-device run.", flags, check,
                              plant_bug="skip adding the tied embedding's two gradient parts (first and last stage)")
    grid = ProcessGrid(tp=1, pp=args.pp)
    p, m, v = grid.pp, args.micro_batches, args.virtual_stages
    config = GPTConfig(n_layer=args.n_layer, n_head=N_HEAD, n_embd=N_EMBD, block_size=args.block_size, dropout=0.1)
    batches = lesson.batches(args, config.block_size)
    reference = lesson.reference_run(config, batches, args.seed)
    runs = [(name, v if name == "interleaved" else 1) for name in SCHEDULES if args.schedule in (None, name)]
    if args.show_schedules and comm.rank == 0:
        print("Each rank's instructions in order, one row per time slot. F3: the forward of micro-batch 3,\n"
              "B3 its backward; interleaved, F3.1: the forward of micro-batch 3 on the rank's chunk 1.\n")
        for name, vv in runs:
            print(f"{name} (compute order per rank)\n{schedules.table(schedules.build(name, p, m, vv))}\n")
    results = {(name, recompute): pipeline_run(comm, name, vv, recompute, args, config, grid, batches, reference)
               for name, vv in runs for recompute in (False, True)}
    tol = lesson.TOLERANCE[args.dtype]
    lines, costs_ok = costs_beside_formulas(comm, args, grid, results, runs)
    ok = lesson.within(tol, *(errors for errors, _ in results.values())) and costs_ok
    return lesson.finish(comm, not ok, lambda: report(args, grid, results, runs, lines, tol),
                         "Every schedule, with and without recompute, equals the single-device run;\nthe bubble, "
                         "the activations held and the bytes sent are what the formulas say.")


def costs_beside_formulas(comm, args, grid, results, runs):
    """Each cost next to its formula (rank r of the table is pipeline rank r of replica 0), whether
    all agree, and the timelines drawn."""
    p, m = grid.pp, args.micro_batches
    act_bytes = (args.batch_size // m // grid.dp) * args.block_size * N_EMBD * np.dtype(args.dtype).itemsize
    stage_ranks = [grid.layout.rank(pp=r) for r in range(p)]
    lines, ok = [], True
    for name, vv in runs:
        plan = schedules.build(name, p, m, vv)
        theory, units = theoretical_bubble(p, m, vv), [simulate(plan, m, vv), simulate(plan, m, vv, recompute=1)]
        ok &= all(b == theory for sim in units for b in sim.bubble.values())
        costs, costs_r = results[name, False][1], results[name, True][1]
        alive = [int(costs["peak_alive"][g]) for g in stage_ranks]
        ok &= alive == [units[0].peak_alive[r] for r in range(p)]
        ok &= list(costs_r["peak_alive"]) == list(costs["peak_alive"])  # recompute holds as many
        formula = {"gpipe": [m] * p, "1f1b": [min(p - r, m) for r in range(p)]}.get(
            name, [min((p - r - 1) * 2 + (vv - 1) * p + 1, vv * m) for r in range(p)])
        ok &= alive == formula
        # messages: an activation per micro-batch for each chunk but the last global one, and a
        # gradient for each but the first
        n_chunks = p * vv
        per_rank = [sum((g < n_chunks - 1) + (g > 0) for g in range(r, n_chunks, p)) * m * act_bytes for r in range(p)]
        ok &= costs["sent"] == per_rank[grid.pp_rank]  # every rank checks its own
        # the schedule again with this run's costs: each chunk's median forward and backward on
        # each rank, and with recompute what its backward took beyond the plain run's
        op, op_r = trace.op_costs(costs["timelines"]), trace.op_costs(costs_r["timelines"])
        fwd, bwd = op[schedules.FORWARD], op[schedules.BACKWARD]
        extra = {k: max(b - bwd[k], 0.0) for k, b in op_r[schedules.BACKWARD].items()}  # noise: >= 0
        on_costs = [simulate(plan, m, vv, forward=fwd, backward=bwd),
                    simulate(plan, m, vv, forward=op_r[schedules.FORWARD], backward=bwd, recompute=extra)]
        measured = [trace.bubble(costs["timelines"]), trace.bubble(costs_r["timelines"])]
        mem, mem_r = ([int(c["activation bytes"][g]) for g in stage_ranks] for c in (costs, costs_r))
        ok &= all(b < a for a, b in zip(mem, mem_r))
        lines.append(SimpleNamespace(name=name, v=vv, theory=theory, units=units, on_costs=on_costs, measured=measured,
                                     alive=alive, mem=mem, mem_r=mem_r, per_rank=per_rank,
                                     stage_costs={k: (fwd[k], bwd[k], extra[k]) for k in sorted(fwd)}))
        if comm.rank == 0:
            tag = f"{name}, p={p}, m={m}" + (f", v={vv}" if vv > 1 else "")
            trace.gantt(units[0].timeline, os.path.join(args.out, f"{name}_simulated.png"),
                        f"{tag}: unit costs, bubble {float(theory):.3f}", chunks=vv, unit="units")
            trace.gantt(costs["timelines"], os.path.join(args.out, f"{name}_measured.png"),
                        f"{tag}: measured on this machine", chunks=vv)
            trace.chrome_trace(costs["timelines"], os.path.join(args.out, f"{name}_trace.json"), chunks=vv)
    return lines, ok


def report(args, grid, results, runs, lines, tol):
    p, m = grid.pp, args.micro_batches
    print(f"PP={p} x DP={grid.dp}; GPT of {args.n_layer} blocks; global batch {args.batch_size} in {m} "
          f"micro-batches;\n{args.dtype}, dropout 0.1, {args.steps} AdamW steps")
    short = {"interleaved": "interl"}
    lesson.print_errors({short.get(n, n) + ("+r" if r else ""): errors for (n, r), (errors, _) in results.items()},
                        tol, width=11, note=";\n+r: with recompute, interl: interleaved")
    print("\nbubble: the idle fraction of a step (convention: idle time / makespan), mean over the ranks\n"
          f"  {'schedule':<15}{'formula':<17}{'theory':>6}{'sim, unit':>11}{'sim, costs':>12}{'measured':>10}"
          "   measured per rank")
    for ln in lines:
        formula = f"(p-1)/({'v*' if ln.v > 1 else ''}m+p-1)"
        for tag, unit, sim, bubbles in zip(("", "+r"), ln.units, ln.on_costs, ln.measured):
            b = list(bubbles.values())
            print(f"  {ln.name + tag:<15}{formula:<17}{float(ln.theory):>6.3f}{float(unit.bubble[0]):>11.3f}"
                  f"{float(np.mean(list(sim.bubble.values()))):>12.3f}{np.mean(b):>10.3f}   "
                  + (" ".join(f"{x:.2f}" for x in b) if p <= 4 else f"{min(b):.2f} to {max(b):.2f}"))
    print("  +r: with recompute. sim, unit: forward 1, backward 2 (+1 recompute) on equal stages, the\n"
          "  formula (as any costs equal on every stage give); sim, costs: each stage's, measured in\n"
          "  the run (below). Neither counts the messages. measured: the last step.")
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
              f'"sim, costs" (-n {cores} here; the table in docs/pipeline_parallel.md).')
    print("\nactivations held: the most micro-batches a rank had run forward but not yet backward")
    print(f"  {'schedule':<13}" + "".join(f"{'rank ' + str(r):>9}" for r in range(p)) + "   formula")
    for ln in lines:
        formula = {"gpipe": "m", "1f1b": "p - rank"}.get(ln.name, f"(p-rank-1)*2+(v-1)*p+1 chunks of 1/{ln.v} stage")
        print(f"  {ln.name:<13}" + "".join(f"{a:>9}" for a in ln.alive) + f"   {formula}")
    print("\npeak bytes of the step's arrays per rank (activations and temporaries), without | with recompute")
    print(f"  {'schedule':<13}" + "".join(f"{'rank ' + str(r):>17}" for r in range(p)))
    for ln in lines:
        print(f"  {ln.name:<13}" + "".join(f"{a / 1e6:>7.1f} |{b / 1e6:>5.1f} MB " for a, b in zip(ln.mem, ln.mem_r)))
    print("\nbytes sent per rank per step (activations forward, gradients back): measured = formula")
    for ln in lines:
        print(f"  {ln.name:<13}" + "".join(f"{b:>12,}" for b in ln.per_rank))
    print(f"\ntimelines: {args.out}/<schedule>_measured.png, _simulated.png, _trace.json")


if __name__ == "__main__":
    sys.exit(main())
