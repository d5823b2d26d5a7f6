"""Lesson 6: 3D parallelism (TP x PP x DP, with ZeRO-1), checked against the single-device run.

    ./run_mpi.sh -n 8 lessons/06_3d_parallel.py                    # TP=2, PP=2, DP=2, ZeRO-1
    ./run_mpi.sh -n 8 lessons/06_3d_parallel.py --tp 1 --pp 4      # any layout of the ranks
    ./run_mpi.sh -n 8 lessons/06_3d_parallel.py --dtype float64
    ./run_mpi.sh -n 16 lessons/06_3d_parallel.py --tp 2 --pp 4     # PP=4 x TP=2 x DP=2 (the default too)
    ./run_mpi.sh -n 8 lessons/06_3d_parallel.py --schedule interleaved --n-layer 8

Every technique of lessons 2-5 at once, the way Megatron-LM and DeepSpeed run them:

* the ranks form a TP x DP x PP grid (tensor-parallel rank fastest);
* each pipeline stage holds its share of the blocks (the first also the embeddings, the last the head);
* within a stage, each TP rank holds its part of every matrix (attention heads, MLP columns, vocabulary);
* each (stage, TP shard) is replicated over DP ranks that split the batch, and ZeRO-1 splits
  the replicas' Adam state between them.

By default the ranks' factors of 2 go in turn to PP, TP and DP: 2 ranks are PP=2, 4 are PP=2 x
TP=2, 8 are PP=2 x TP=2 x DP=2 and 16 are PP=4 x TP=2 x DP=2 (any odd factor goes to DP); --tp and
--pp choose another layout.

The lesson first prints who holds what: the grid, each rank's blocks, its shard of the matrices
and its piece of the optimizer state. It then trains a few steps, with the same seed and batches
as one device, and compares:
* the loss of every step;
* every gradient of the first step;
* all parameters after the steps, gathered from the shards.

A step here is the trainer's step (minipar/trainer.py), written out:

    executor.step   --schedule (1F1B by default) over the micro-batches: forwards and backwards,
                    activations sent between stages
    finalize_grads  sequence-parallel sums, and the tied embedding's two parts (first + last stage)
    clip            by the whole model's gradient norm, summed over the TP, PP and DP pieces
    step            ZeRO-1: reduce-scatter the gradients over DP, update this rank's piece, all-gather

Read next: docs/3d_parallel.md.

What to look at: the grid and its groups, then "who holds what": each rank's blocks, its half (or
share) of the heads, MLP columns and vocabulary, and its piece of the Adam state; the error table
last, and under it the parallel steps' model FLOPs utilisation (MFU: the model's FLOPs per step
over the step time and the machine's measured peak, minipar/mfu.py; the first step, which also
compares the gradients, and the reference run are not timed). --schedule picks gpipe, 1f1b,
interleaved (--virtual-stages, default 2) or a zero-bubble schedule (zb-h1, zb-h2; zb-v, two
chunks per rank in a V: lesson 4 shows them), and --n-layer the depth, checked like the other flags.

Exercises (predict first, then run the command and read the row named):
1. A 16-GPU 3D layout, PP4 x TP2 x DP2. From rank = tp + 2 dp + 4 pp, find rank 13's
   coordinates, blocks, extra layers and shards before running, then check its row:
   ./run_mpi.sh -n 16 lessons/06_3d_parallel.py --tp 2 --pp 4
2. Interleaved, 8 blocks on 8 ranks (PP=2 x TP=2 x DP=2, v = 2): predict which blocks rank 0 holds:
   ./run_mpi.sh -n 8 lessons/06_3d_parallel.py --schedule interleaved --n-layer 8
3. --plant-bug skips finalize_grads. Predict that it fails on 4 ranks (PP=2 x TP=2), and whether it
   fails with no pipeline at all:
   ./run_mpi.sh -n 4 lessons/06_3d_parallel.py --plant-bug
   ./run_mpi.sh -n 2 lessons/06_3d_parallel.py --tp 2 --pp 1 --plant-bug
4. MFU on 2 ranks and on 8 (the same model and batch; check `nproc`). Predict which is higher when
   the ranks outnumber the cores, and whether a deeper model (--n-layer 8) raises it:
   ./run_mpi.sh -n 2 lessons/06_3d_parallel.py; ./run_mpi.sh -n 8 lessons/06_3d_parallel.py
"""

import time

import numpy as np

import lesson
import minipar
from minipar.checkpoint.full import gather_full_state
from minipar.mfu import measured_peak
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.tensor import local_shard
from minipar.parallel.validate import RunConfig, problems
from minipar.parallel.zero1 import ZeRO1
from minipar.train_report import gather_text

MAX_NORM = 1.0
N_HEAD, N_EMBD, BLOCK_SIZE = 4, 64, 32  # the GPT's width and context; its depth is --n-layer
FLAGS = {"tp": "--tp", "pp": "--pp", "micro_batches": "--micro-batches", "global_batch": "--batch-size",
         "schedule": "--schedule", "n_layer": "--n-layer", "virtual_stages": "--virtual-stages"}
# every synchronous schedule: PipeDream-2BW's updates lag a step, so no single-device run equals it here
SCHEDULES = tuple(name for name in schedules.SCHEDULES if name != "pipedream-2bw")


def default_layout(n):
    """(TP, PP) for n ranks: its factors of 2 dealt in turn to PP, TP and DP (the rest is DP)."""
    sizes, turn = {"pp": 1, "tp": 1, "dp": 1}, 0
    while n % 2 == 0:
        sizes[("pp", "tp", "dp")[turn % 3]] *= 2
        n, turn = n // 2, turn + 1
    return sizes["tp"], sizes["pp"]


def flags(p):
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: from the number of ranks)")
    p.add_argument("--pp", type=int, help="pipeline stages (default: from the number of ranks)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="the global batch of a step")
    p.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (PipeDream-2BW's "
                   "asynchronous pipeline: lesson 4)")
    p.add_argument("--virtual-stages", type=int, help="chunks per rank, interleaved and zb-v (default 2, else 1)")
    p.add_argument("--n-layer", type=int, default=4, help="the GPT's blocks")


def check(args, ranks):
    if args.schedule == "pipedream-2bw":  # (validate would ask for ZeRO stage 0, a flag this lesson has not)
        return ["--schedule pipedream-2bw updates the weights from gradients one step old, so no single-device "
                "run of this lesson's equals it: lesson 4 runs it against its delayed rule "
                "(./run_mpi.sh -n 4 lessons/04_pipeline_parallel.py --schedule pipedream-2bw)"]
    if args.schedule not in SCHEDULES:
        return [f"--schedule {args.schedule} is not a schedule this lesson runs: choose one of "
                f"{', '.join(SCHEDULES)}"]
    tp, pp = default_layout(ranks)
    args.tp = tp if args.tp is None else args.tp
    args.pp = pp if args.pp is None else args.pp
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule in ("interleaved", "zb-v") else 1
    # the run below: ZeRO-1, this model (whole heads per TP rank, whole blocks per stage)
    run = RunConfig(world_size=ranks, tp=args.tp, pp=args.pp, schedule=args.schedule, global_batch=args.batch_size,
                    micro_batches=args.micro_batches, n_layer=args.n_layer, n_head=N_HEAD, n_embd=N_EMBD,
                    virtual_stages=args.virtual_stages, block_size=BLOCK_SIZE, dropout=0.1, zero_stage=1,
                    dtype=args.dtype)
    found = problems(run, FLAGS) or lesson.memory_problems(run, FLAGS, args.steps)
    return lesson.at_least_one(args, "--steps") + found


def blocks(layers):
    """h.2-3 for a run of blocks, h.1,5 for an interleaved rank's chunks."""
    if layers == list(range(layers[0], layers[-1] + 1)):
        return "h." + "-".join(dict.fromkeys(map(str, (layers[0], layers[-1]))))
    return "h." + ",".join(map(str, layers))


def who_holds_what(grid, model, opt):
    """One line per rank: its coordinates, blocks, extra layers, matrix shards and optimizer piece."""
    layers = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if ".h." in n})
    ends = [name for name, there in (("wte+wpe", grid.is_first_stage), ("ln_f+head", grid.is_last_stage)) if there]
    attn = model.transformer.h[0].attn  # this rank's first block
    heads = f"heads {attn.head_offset}-{attn.head_offset + attn.n_head - 1}"
    fc = model.transformer.h[0].mlp.c_fc.weight.shape[0]
    cols = f"cols {grid.tp_rank * fc}-{(grid.tp_rank + 1) * fc - 1}"
    vocab = ""
    if model.transformer.wte is not None:
        wte = model.transformer.wte
        start = getattr(wte, "start", 0)  # a plain Embedding (TP = 1) holds the whole vocabulary
        vocab = f", vocab {start}-{start + wte.weight.shape[0] - 1}"
    mine = sum(g.piece for g in opt.groups)
    shard = f"{heads}, {cols}{vocab}"
    return (f"{grid.rank:>4} {grid.tp_rank:>3} {grid.dp_rank:>3} {grid.pp_rank:>3}  "
            f"{blocks(layers):<8} {' '.join(ends):<10} "
            f"{shard:<38} {grid.dp_rank}/{grid.dp}: {mine:,}")


def main():
    args, comm = lesson.start("3D parallelism against the single-device run.", flags, check, steps=4,
                              plant_bug="skip finalize_grads: the tied embedding's parts on the first and last "
                              "stage are never added")
    config = GPTConfig(n_layer=args.n_layer, n_head=N_HEAD, n_embd=N_EMBD, block_size=BLOCK_SIZE, dropout=0.1)
    grid = ProcessGrid(tp=args.tp, pp=args.pp)
    batches = lesson.batches(args, config.block_size)
    reference = lesson.reference_run(comm, config, batches, args.seed, max_norm=MAX_NORM)

    # the same on the grid
    minipar.manual_seed(args.seed)
    model = GPT(config, grid, virtual_stages=args.virtual_stages, pipeline_shape=schedules.shape_of(args.schedule))
    opt = ZeRO1(model, grid.dp_group, **lesson.HYPER)
    if args.plant_bug:  # the tied embedding's parts on the first and last stage are never added
        model.finalize_grads = lambda: None
    run = PipelineExecutor(model, grid, args.schedule, args.micro_batches, optimizer=opt)
    lines = gather_text(comm, who_holds_what(grid, model, opt))
    compare = lesson.Comparison(reference, loss="loss (worst step)")
    # MFU of the parallel steps alone: the reference run above (on rank 0, the others waiting) is
    # not timed; the peak is timed by all ranks at once (a collective)
    peak, seconds = measured_peak(comm, model.parameters()[0].dtype), []
    for step, (x, y) in enumerate(batches):
        start = time.perf_counter()
        model.rng.iteration = step  # keys the dropout masks (with each token's place)

        def update():
            # ZeRO-1 adds the tied embedding's parts (model.finalize_grads) while every rank still
            # holds its whole wte gradient, then reduce-scatters the buffers over DP (both are sums,
            # in either order, but after the reduce-scatter only this rank's piece is summed).
            opt.finish_gradients()
            if step == 0:  # this rank's shard of every gradient it holds, whole over DP
                whole, mine = opt.full_gradients(), list(model.named_parameters())
                compare.gradients({n: whole[id(p)] for n, p in mine},
                                  {n: local_shard(p, reference.grads[n], grid) for n, p in mine})
            opt.clip_grad_norm(MAX_NORM)
            opt.step()

        record = run.step(x, y, optimizer_step=update)
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
        share = record.loss if record.loss is not None and grid.tp_rank == 0 else 0.0
        compare.loss(step, comm.all_reduce(np.array([share]))[0])  # the shares of the DP ranks' last stages
    state = gather_full_state(model, opt, grid)  # on rank 0
    if comm.rank == 0:
        compare.parameters(state)
    errors = compare.worst_over(comm)
    tol = lesson.TOLERANCE[args.dtype]
    mfu = lesson.mfu(comm, config, args.batch_size * BLOCK_SIZE, seconds, peak)

    def report():
        print(grid.describe())
        print("\nwho holds what (the shards of the rank's first block; every block is split the same way)")
        print("(cols: the MLP's hidden columns; last column: this rank's piece of the DP group's Adam m, v")
        print(" and the values in it)")
        print(f"{'rank':>4} {'tp':>3} {'dp':>3} {'pp':>3}  {'blocks':<8} {'also':<10} {'tensor-parallel shard':<38} ZeRO-1")
        print("\n".join(lines))
        print(f"\n{args.steps} AdamW steps (ZeRO-1, clipped at {MAX_NORM}), {args.schedule}, {args.micro_batches} "
              f"micro-batches per step, {args.dtype}, dropout 0.1")
        lesson.print_errors({None: errors}, tol)
        print(f"\n{mfu}")

    return lesson.finish(comm, lesson.failed_rows(tol, {None: errors}), report,
                         "The 3D-parallel run equals the single-device run.")


if __name__ == "__main__":
    lesson.end(main())
