"""Lesson 4: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, the zero-bubble ZB-H1, ZB-H2 and
ZB-V, and PipeDream-2BW's asynchronous pipeline), checked against one device.

    ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py              # PP = 4
    ./run_mpi.sh -n 8 lessons/04_pipeline_parallel.py              # PP = 4 x DP = 2
    ./run_mpi.sh -n 8 lessons/04_pipeline_parallel.py --pp 2 --micro-batches 4   # PP = 2 x DP = 4
    ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py --dtype float64
    ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py --schedule zb-v   # one schedule, not all of them
    ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py --schedule pipedream-2bw --steps 30  # its loss curve
    ./run_mpi.sh -n 2 lessons/04_pipeline_parallel.py --show-schedules   # a core per rank
    ./run_mpi.sh -n 2 lessons/04_pipeline_parallel.py --schedule 1f1b --defer-embedding-wgrad-compute

The GPT's 8 blocks are cut into stages: on 4 ranks, rank r runs blocks 2r and 2r+1, the first rank
also the embeddings, the last the final LayerNorm and the loss (with 2 virtual stages, rank r holds
blocks r and 4 + r: a micro-batch passes every rank twice). By default the pipeline is as long as
the flags allow (every rank a stage on 2 or 4 ranks; on 8, 16 chunks of 8 blocks cannot be, so
PP = 4 and the rest is data parallelism). The step's batch is cut into m micro-batches
that follow each other through the stages, each rank forwarding one while its neighbours work on
others. Activations go forward and their gradients back as point-to-point messages.

Each schedule trains a few AdamW steps from the same seed as the single-device run, with dropout
(GPipe, 1F1B and interleaved also with activation recompute), and we compare the loss, every
gradient and the parameters. The zero-bubble schedules (Qi et al. 2024) split each backward into B,
the input's gradient, which the previous stage waits for, and W, the weights' gradients, which
nobody waits for: W fills what was the bubble. Then the costs, each next to its formula
(pipeline_formulas.py; unit costs F = B = W = 1, a fused backward B + W):

* the bubble: the fraction of a step a rank waits, (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved,
  (p-1)/(3m+p-1) for ZB-H1 and ZB-H2, (p-1)/(6m+p-1) for ZB-V: exact in a simulation with unit
  costs, simulated with each stage's costs measured in this run, and measured (near that when each
  rank has a core; stuck well above when ranks share cores);
* memory: how many micro-batches' activations a rank holds at once (m for GPipe, p - rank for
  1F1B, until W for the zero-bubble ones), and the bytes measured with and without recompute;
* the bytes each rank sends per step.

Last, PipeDream-2BW (Narayanan et al. 2021): no flush at all, the next batch's forwards run during
this one's backwards, so a stage updates weights that micro-batches in flight still need. Each
micro-batch runs forward and backward on one stashed version (two versions alive), and the update
is one step late: W(t+1) = W(t) - lr grad f(W(t-1)). Its run equals a single-device run of that
delayed rule, not synchronous training; the two loss curves are drawn in --out.

The timelines are drawn in --out: one Gantt picture per schedule as measured, one simulated, and a
Chrome trace (open it in Perfetto or chrome://tracing). Read next: docs/pipeline_parallel.md.

What to look at: the bubble table (theory = "sim, unit"; "sim, step" and measured are this
machine), the costs (backward is not 2 forwards here), the activations held (m for GPipe, p - rank
for 1F1B) and the bytes sent. With --show-schedules each rank's instructions are printed in
order: F3 is the forward of micro-batch 3, B3 its backward, and in the interleaved table F3.1 is
the forward of micro-batch 3 on the rank's chunk 1.

Exercises (predict first, then run the command and read the table named):
1. Micro-batches against the bubble on 4 stages: predict the "theory" column of gpipe/1f1b and of
   interleaved (v = 2) for m = 4, 8 and 16, then run
   ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py --micro-batches 4   (then 8, then 16)
   and see whether "measured" follows it (on 2 cores it hardly moves: see the note). Then with
   a core per rank, -n 2 --schedule 1f1b --micro-batches 2 (4, 8, 16): does it follow "sim, step"?
2. Predict the "activations held" rows for --micro-batches 16 on 4 ranks, GPipe and 1F1B, and why
   only one of them grows with m. In the bytes table below it the global batch stays 16, so a
   micro-batch of m = 16 is half one of m = 8: there GPipe's megabytes stay flat, 1F1B's halve.
3. Write down 1F1B's order for 2 stages and 4 micro-batches (rank 0 runs two forwards before its
   first backward; rank 1, the last stage, alternates at once), then check it:
   ./run_mpi.sh -n 2 lessons/04_pipeline_parallel.py --schedule 1f1b --micro-batches 4 --show-schedules
4. --plant-bug never adds the tied embedding's two gradient parts (first and last stage). Predict
   which error rows fail; the "loss" row is the worst step's: could the first step's loss (step 0)
   still match, and why does the row fail anyway?
   ./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py --schedule 1f1b --plant-bug
5. Predict ZB-H1's bubble for p = 2, m = 4 with unit costs, and with a core per rank check the
   measured one against 1F1B's: ./run_mpi.sh -n 2 lessons/04_pipeline_parallel.py --micro-batches 4
6. PipeDream-2BW's step 1 uses the gradient at W(0) again: predict whether its loss at step 1 is
   above or below synchronous training's, then look at out/pipeline/pipedream_2bw_loss.png after
   --schedule pipedream-2bw --steps 30. (--plant-bug there updates the weights in place: the
   in-flight micro-batches' backwards then use the next version.)
7. 1F1B-slack runs one more warm-up forward than 1F1B on every rank but the last. Predict its
   "theory" bubble and its "activations held" row for p = 2, m = 8, then run it and 1F1B a few
   times each with a core per rank and compare "sim, step" (docs/pipeline_parallel.md, "Slack"):
   ./run_mpi.sh -n 2 lessons/04_pipeline_parallel.py --schedule 1f1b-slack   (then --schedule 1f1b)
8. The last stage also runs the tied head, so 1F1B's steady state runs at its pace. Megatron-LM's
   --defer-embedding-wgrad-compute leaves the head's weight gradient (H: dlogits^T x, 2 V h FLOPs a
   token) out of each of the last stage's backwards and runs them all at the flush. Predict where
   the H's go in the schedule table, and what share of the last stage's work moves (its 4 blocks
   cost 72 h^2 + 12 T h a token each; h 128, T 64, V 256), then run it with and without the flag:
   ./run_mpi.sh -n 2 lessons/04_pipeline_parallel.py --schedule 1f1b --defer-embedding-wgrad-compute
   --show-schedules. Is the change in "sim, step" above this machine's noise? GPT-2's head is worth
   4.5 blocks (docs/pipeline_parallel.md, "The head's weight gradient at the flush"). The
   "activations held" row does not count what the H's park (each waiting H keeps its head input
   and logits' gradient, up to m of them on the last rank); the planner counts them. Then add
   --defer-wgrad-linears 1 (and 2): the last block's MLP products' weight gradients join the H's.
   Which K makes the two stages' steady cycles equal on paper (each product's dW is 8 h^2 FLOPs a
   token), and past which K does the drain grow instead?
"""

import os
import tracemalloc
from types import SimpleNamespace

import numpy as np

import lesson
import minipar
import pipeline_formulas as formulas
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.pipeline.pipedream import PipeDream2BW
from minipar.parallel.pipeline.weight_stash import WeightStash
from minipar.parallel.validate import DEFERS_HEAD, RunConfig, problems
from minipar.plots import plot_curves
from pipeline_report import print_schedules, report

N_HEAD, N_EMBD = 4, 128  # the GPT's width; its depth and context are flags
# the RunConfig field each flag sets, so that a problem names the flag
FLAGS = {"pp": "--pp", "micro_batches": "--micro-batches", "virtual_stages": "--virtual-stages",
         "n_layer": "--n-layer", "global_batch": "--batch-size", "block_size": "--block-size",
         "schedule": "--schedule", "defer_embedding_wgrad": "--defer-embedding-wgrad-compute",
         "defer_wgrad_linears": "--defer-wgrad-linears"}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")  # then PipeDream-2BW
ON_REQUEST = ("1f1b-slack",)  # run only when named with --schedule: 1F1B's twin on unit costs
RECOMPUTED = ("gpipe", "1f1b", "interleaved")  # also run with activation recompute
TWO_BW = "pipedream-2bw"
SHORT = {"interleaved": "interl"}  # the error table's column heading, where the name is too wide


def runs_of(args):
    """(schedule, chunks per rank) of each run: interleaved with --virtual-stages, ZB-V's V two."""
    chunks = {"interleaved": args.virtual_stages, "zb-v": 2}
    names = SCHEDULES if args.schedule is None else [n for n in SCHEDULES + ON_REQUEST if n == args.schedule]
    return [(name, chunks.get(name, 1)) for name in names]


def run_config(n, args, pp, schedule, v):
    """A run this lesson makes on n ranks with pp stages, as plain numbers."""
    return RunConfig(world_size=n, pp=pp, virtual_stages=v, schedule=schedule,
                     global_batch=args.batch_size, micro_batches=args.micro_batches, n_layer=args.n_layer,
                     n_head=N_HEAD, n_embd=N_EMBD, block_size=args.block_size, dtype=args.dtype,
                     defer_embedding_wgrad=args.defer_embedding_wgrad, defer_wgrad_linears=args.defer_wgrad_linears)


def all_problems(n, args, pp):
    """Every run's problems with pp stages, each once (GPipe's are 1F1B's and often ZB-H1's)."""
    found = [f for name, v in runs_of(args) + [(TWO_BW, 1)] * (args.schedule in (None, TWO_BW))
             for f in problems(run_config(n, args, pp, name, v), FLAGS)]
    return list(dict.fromkeys(found))


def choose_pipeline(n, args):
    """(--pp, problems). By default the most stages among the divisors of the ranks for which the
    runs have no problem (2 or more: one stage is no pipeline, and ``check`` refused one rank); if
    none fits, the problems every divisor shares, or a line saying so."""
    if args.pp is not None:
        return args.pp, all_problems(n, args, args.pp)
    tried = {pp: all_problems(n, args, pp) for pp in range(2, n + 1) if n % pp == 0}
    fits = [pp for pp, found in tried.items() if not found]
    if fits:
        return max(fits), []
    common = set.intersection(*map(set, tried.values()))  # problems that no --pp would mend
    return None, [f for f in tried[min(tried)] if f in common] or [
        f"no pipeline fits {n} rank(s) with {'--schedule ' + args.schedule + ', ' if args.schedule else ''}--micro-batches {args.micro_batches}, --virtual-stages "
        f"{args.virtual_stages}, --n-layer {args.n_layer} and --batch-size {args.batch_size}: change "
        "those flags or the number of ranks (the defaults fit 2, 4 and 8)"]


def flags(p):
    p.add_argument("--pp", type=int, help="pipeline stages (DP = ranks / PP); default: the most the "
                   "other flags allow")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--schedule", help=f"run only this one: {', '.join(SCHEDULES + ON_REQUEST + (TWO_BW,))} "
                   f"(default: all but {', '.join(ON_REQUEST)})")
    p.add_argument("--virtual-stages", type=int, help="chunks per rank, interleaved schedule (default 2)")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16, help="the global batch of a step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--out", default="out/pipeline", help="where the timeline pictures and traces go")
    p.add_argument("--show-schedules", action="store_true", help="print each schedule as a table first")
    p.add_argument("--defer-embedding-wgrad-compute", dest="defer_embedding_wgrad", action="store_true",
                   help=f"the head's weight gradients at the flush (with --schedule {', '.join(DEFERS_HEAD)})")
    p.add_argument("--defer-wgrad-linears", type=int, default=0, metavar="K",
                   help="with it, the last K linear layers' weight gradients too (the last block's MLP c_proj first)")


def check(args, ranks):
    if args.schedule not in (None, *SCHEDULES, *ON_REQUEST, TWO_BW):  # validate's line, naming every schedule
        return problems(RunConfig(schedule=args.schedule), FLAGS)
    if args.defer_embedding_wgrad and args.schedule is None:  # (validate's lines name a given schedule)
        return [f"--defer-embedding-wgrad-compute applies to one schedule at a time: add --schedule with one "
                f"of {', '.join(DEFERS_HEAD)}"]
    ignored = []  # (--virtual-stages 1, or 2 for zb-v, says what the schedule does anyway)
    if args.virtual_stages is not None and args.schedule not in (None, "interleaved") and \
            args.virtual_stages != (2 if args.schedule == "zb-v" else 1):
        fixed = "two in a V" if args.schedule == "zb-v" else "one"
        ignored.append(f"--virtual-stages {args.virtual_stages} is the interleaved schedule's chunks per rank, and "
                       f"--schedule {args.schedule} places {fixed}: drop it, or give --schedule interleaved")
    if args.virtual_stages is None:  # 2 for the interleaved run; GPipe and 1F1B alone need 1
        args.virtual_stages = 2 if args.schedule in (None, "interleaved") else 1
    if ranks < 2:  # one stage: no bubble, no messages between stages, no tied parts to add
        found = [f"a pipeline needs 2 or more stages, a rank each, and {ranks} rank was started: run it on 2 or "
                 "more (./run_mpi.sh -n 2)"]
    elif args.pp == 1:
        found = ["--pp 1 is one stage, not a pipeline (no bubble, nothing sent between stages): give --pp 2 or "
                 "more, or leave --pp out for the most stages the ranks allow"]
    else:
        args.pp, found = choose_pipeline(ranks, args)
    if not found:  # (every schedule's run holds the same model)
        found = lesson.memory_problems(run_config(ranks, args, args.pp, "1f1b", 1), FLAGS, args.steps)
    found = ignored + found
    if args.steps < 2:
        found.insert(0, "--steps must be >= 2 (memory is measured in the first step, time in the last)")
    if not args.out:
        found.append("--out '': name the folder for the pictures and traces (. for this one)")
    else:
        found += lesson.output_problems("--out", args.out, args.out)
    return found


def pipeline_run(comm, name, v, recompute, args, config, grid, batches, reference):
    """Train with one schedule; the errors against the reference (the worst over the ranks), and
    what the step cost, gathered from every rank."""
    minipar.manual_seed(args.seed)
    model = GPT(config, grid, virtual_stages=v, pipeline_shape=schedules.shape_of(name))
    opt = make_optimizer(model, grid, 0, **lesson.HYPER)  # data parallelism + AdamW (DP = 1: nothing sent)
    if args.plant_bug:  # the tied embedding's parts on the first and last stage are never added
        model.finalize_grads = lambda: None
    run = PipelineExecutor(model, grid, name, args.micro_batches, optimizer=opt, recompute=recompute,
                           defer_embedding_wgrad=args.defer_embedding_wgrad,
                           defer_wgrad_linears=args.defer_wgrad_linears)
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
        # the rank holding the last chunk (pipeline rank 0 in ZB-V's V) of each replica: its rows' share
        compare.loss(step, comm.all_reduce(np.array([0.0 if record.loss is None else record.loss]))[0])
        opt.zero_grad()
    compare.stage_parameters(comm, model)  # each rank holds its stage's: one vector over all ranks
    costs.update(timelines=formulas.gather_timelines(comm, grid, name, args.micro_batches, v, record.timeline,
                                                     args.defer_embedding_wgrad),
                 peak_alive=comm.all_gather(np.array([record.peak_alive]))[:, 0],
                 sent=grid.pp_group.stats.total().bytes_sent if grid.pp_group is not None else 0)
    costs["activation bytes"] = comm.all_gather(np.array([costs["activation bytes"]]))[:, 0]
    return compare.worst_over(comm), costs


def pipedream_run(comm, args, config, grid, batches, delayed):
    """PipeDream-2BW over the batches, each call handed the next batch too (no flush): its losses,
    and its errors against the single-device run of the delayed rule (the worst over the ranks)."""
    minipar.manual_seed(args.seed)
    model = GPT(config, grid)
    opt = WeightStash(make_optimizer(model, grid, 0, **lesson.HYPER), plant_bug=args.plant_bug)
    run = PipeDream2BW(model, grid, args.micro_batches, opt)
    compare, losses = lesson.Comparison(delayed, order=("loss", "parameters")), []
    for step, (x, y) in enumerate(batches):
        model.rng.iteration = step
        following = batches[step + 1] if step + 1 < len(batches) else None
        record = run.step(x, y, opt.step, following=following)
        opt.zero_grad()
        share = 0.0 if record.loss is None else record.loss  # each replica's last stage: its rows' share
        losses.append(float(comm.all_reduce(np.array([share]))[0]))
        compare.loss(step, losses[-1])
    compare.stage_parameters(comm, model)
    return compare.worst_over(comm), losses, opt.stash_bytes()


def main():
    args, comm = lesson.start("Pipeline parallelism against the single-device run.", flags, check,
                              plant_bug="skip adding the tied embedding's two gradient parts (first and last "
                              "stage); PipeDream-2BW: update the weights in flight in place")
    grid = ProcessGrid(tp=1, pp=args.pp)
    p, m = grid.pp, args.micro_batches
    config = GPTConfig(n_layer=args.n_layer, n_head=N_HEAD, n_embd=N_EMBD, block_size=args.block_size, dropout=0.1)
    batches = lesson.batches(args, config.block_size)
    reference = lesson.reference_run(comm, config, batches, args.seed)
    runs = runs_of(args)
    if args.show_schedules and comm.rank == 0:
        print_schedules(args, p, runs)
    results = {(name, recompute): pipeline_run(comm, name, vv, recompute, args, config, grid, batches, reference)
               for name, vv in runs for recompute in (False, True)[: 1 + (name in RECOMPUTED)]}
    tol = lesson.TOLERANCE[args.dtype]
    lines, costs_failed = formulas.costs_beside_formulas(comm, args, grid, results, runs, N_EMBD)
    columns = {(SHORT.get(n, n) + ("+r" if r else "")): errors for (n, r), (errors, _) in results.items()}
    failed = lesson.failed_rows(tol, columns) + costs_failed
    two_bw = None
    if args.schedule in (None, TWO_BW):
        # on the last rank, while rank 0 draws the timelines (costs_beside_formulas, no collective after)
        delayed = lesson.reference_run(comm, config, batches, args.seed, delay=1, root=comm.size - 1)
        errors, losses, stash = pipedream_run(comm, args, config, grid, batches, delayed)
        apart = max(abs(a - b) for a, b in zip(losses, reference.losses))
        failed += lesson.failed_rows(tol, {None: errors}, where=" (PipeDream-2BW)")
        if len(batches) >= 2 and not apart > tol:
            failed.append(f"PipeDream-2BW's losses are within {tol:g} of synchronous training's: the delay did "
                          "not change them")
        two_bw = SimpleNamespace(errors=errors, losses=losses, synchronous=reference.losses, apart=apart,
                                 stash=comm.all_gather(np.array([stash]))[:, 0])
        if comm.rank == 0:
            plot_curves({"synchronous (1F1B = one device)": reference.losses, "PipeDream-2BW": losses,
                         "one device, delayed rule": delayed.losses},
                        os.path.join(args.out, "pipedream_2bw_loss.png"), title=f"PipeDream-2BW, p={p}, m={m}")
    ran = {None: "Every schedule equals the single-device run, PipeDream-2BW its delayed rule",
           TWO_BW: "PipeDream-2BW equals the single-device run of its delayed rule"}
    tables = "" if args.schedule == TWO_BW else (";\nthe bubble, the activations held and the bytes sent are "
                                                  "what the formulas say")  # (2BW alone prints none of them)
    return lesson.finish(comm, failed, lambda: report(args, grid, columns, lines, tol, two_bw),
                         ran.get(args.schedule, f"{args.schedule} equals the single-device run") + tables + ".")


if __name__ == "__main__":
    lesson.end(main())
