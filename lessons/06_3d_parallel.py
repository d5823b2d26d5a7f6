"""Lesson 6: 3D parallelism (TP x PP x DP, with ZeRO-1), checked against the single-device run.

    ./run_mpi.sh -n 8 lessons/06_3d_parallel.py                    # TP=2, PP=2, DP=2, ZeRO-1
    ./run_mpi.sh -n 8 lessons/06_3d_parallel.py --tp 1 --pp 4      # any layout of the ranks
    ./run_mpi.sh -n 8 lessons/06_3d_parallel.py --dtype float64
    ./run_mpi.sh -n 16 lessons/06_3d_parallel.py                   # TP=2, PP=4, DP=2

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

    executor.step   1F1B over the micro-batches: forwards and backwards, activations sent between stages
    finalize_grads  sequence-parallel sums, and the tied embedding's two parts (first + last stage)
    clip            by the whole model's gradient norm, summed over the TP, PP and DP pieces
    step            ZeRO-1: reduce-scatter the gradients over DP, update this rank's piece, all-gather

Read next: docs/3d_parallel.md.
"""

import sys

import numpy as np

import minipar
from minipar.backend import add_device_flag, use_device
from minipar.cli import Parser, parse
from minipar.checkpoint.full import gather_full_state
from minipar.comm import world
from minipar.data import Dataset, load_corpus
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.tensor import local_shard
from minipar.parallel.validate import RunConfig, problems
from minipar.parallel.zero import ZeRO1
from minipar.trainer import gather_text
from minipar.verify import as_one_vector, rel_err

TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
MAX_NORM = 1.0


CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, dropout=0.1)


def default_layout(n):
    """(TP, PP) for n ranks: its factors of 2 dealt in turn to PP, TP and DP (the rest is DP)."""
    sizes, turn = {"pp": 1, "tp": 1, "dp": 1}, 0
    while n % 2 == 0:
        sizes[("pp", "tp", "dp")[turn % 3]] *= 2
        n, turn = n // 2, turn + 1
    return sizes["tp"], sizes["pp"]


FLAGS = {"tp": "--tp", "pp": "--pp", "micro_batches": "--micro-batches", "global_batch": "--batch-size"}


def parse_args(comm):
    """Every rank parses the same flags and finds the same problems before any message: one rank
    prints them, one line each, and every rank exits with status 2 (minipar.cli)."""
    n = comm.size
    p = Parser(description="3D parallelism against the single-device run.")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: from the number of ranks)")
    p.add_argument("--pp", type=int, help="pipeline stages (default: from the number of ranks)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="the global batch of a step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dtype", choices=TOLERANCE, default="float32")
    add_device_flag(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plant-bug", action="store_true",
                   help="skip finalize_grads: the tied embedding's parts on the first and last stage are never added")

    def check(args):
        tp, pp = default_layout(n)
        args.tp = tp if args.tp is None else args.tp
        args.pp = pp if args.pp is None else args.pp
        c = CONFIG  # the run below: 1F1B, ZeRO-1, this model (whole heads per TP rank, whole blocks per stage)
        run = RunConfig(world_size=n, tp=args.tp, pp=args.pp, schedule="1f1b", global_batch=args.batch_size,
                        micro_batches=args.micro_batches, n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd,
                        block_size=c.block_size, dropout=c.dropout, zero_stage=1, dtype=args.dtype)
        return ([] if args.steps >= 1 else ["--steps must be >= 1"]) + problems(run, FLAGS)

    return parse(p, comm, check)


def who_holds_what(grid, model, opt):
    """One line per rank: its coordinates, blocks, extra layers, matrix shards and optimizer piece."""
    layers = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if ".h." in n})
    ends = [name for name, there in (("wte+wpe", grid.is_first_stage), ("ln_f+head", grid.is_last_stage)) if there]
    attn = model.transformer.h[0].attn
    heads = f"heads {attn.head_offset}-{attn.head_offset + attn.n_head - 1}"
    fc = model.transformer.h[0].mlp.c_fc.weight.shape[0]
    cols = f"MLP cols {grid.tp_rank * fc}-{(grid.tp_rank + 1) * fc - 1}"
    vocab = ""
    if model.transformer.wte is not None:
        wte = model.transformer.wte
        start = getattr(wte, "start", 0)  # a plain Embedding (TP = 1) holds the whole vocabulary
        vocab = f", vocab {start}-{start + wte.weight.shape[0] - 1}"
    mine = sum(g.piece for g in opt.groups)
    shard = f"{heads}, {cols}{vocab}"
    return (f"{grid.rank:>4} {grid.tp_rank:>3} {grid.dp_rank:>3} {grid.pp_rank:>3}  "
            f"{'h.' + '-'.join(dict.fromkeys(map(str, (layers[0], layers[-1])))):<8} {' '.join(ends):<10} "
            f"{shard:<46}  Adam m, v: piece {grid.dp_rank} of {grid.dp} ({mine:,} values)")


def main():
    comm = world()
    args = parse_args(comm)
    minipar.set_default_dtype(args.dtype)
    use_device(args.device)
    comm = world()  # on GPUs, NCCL's
    config = CONFIG
    grid = ProcessGrid(tp=args.tp, pp=args.pp)
    data = Dataset(load_corpus())
    batches = [data.batch("train", s, args.batch_size, config.block_size, args.seed) for s in range(args.steps)]

    # the single-device run, on every rank (it is small)
    minipar.manual_seed(args.seed)
    serial = GPT(config)
    opt_s = AdamW(serial.parameters(), **HYPER)
    losses_s = []
    for step, (x, y) in enumerate(batches):
        serial.rng.iteration = step  # keys the dropout masks (with each token's place)
        _, loss = serial(x, y)
        loss.backward()
        if step == 0:
            grads_s = {n: p.grad.copy() for n, p in serial.named_parameters()}
        clip_grad_norm(serial.parameters(), MAX_NORM)
        opt_s.step()
        opt_s.zero_grad()
        losses_s.append(loss.item())

    # the same on the grid
    minipar.manual_seed(args.seed)
    model = GPT(config, grid)
    opt = ZeRO1(model, grid.dp_group, **HYPER)
    if args.plant_bug:  # the tied embedding's parts on the first and last stage are never added
        model.finalize_grads = lambda: None
    run = PipelineExecutor(model, grid, "1f1b", args.micro_batches, optimizer=opt)
    lines = gather_text(comm, who_holds_what(grid, model, opt))
    errors = {"loss (worst step)": 0.0, "gradients (worst tensor)": 0.0}
    for step, (x, y) in enumerate(batches):
        model.rng.iteration = step  # keys the dropout masks (with each token's place)

        def update():
            # ZeRO-1 adds the tied embedding's parts (model.finalize_grads) while every rank still
            # holds its whole wte gradient, then reduce-scatters the buffers over DP (both are sums,
            # in either order, but after the reduce-scatter only this rank's piece is summed).
            opt.finish_gradients()
            if step == 0:
                whole = opt.full_gradients()
                for name, p in model.named_parameters():
                    ref = local_shard(p, grads_s[name], grid)
                    errors["gradients (worst tensor)"] = max(errors["gradients (worst tensor)"],
                                                             rel_err(whole[id(p)], ref))
            opt.clip_grad_norm(MAX_NORM)
            opt.step()

        record = run.step(x, y, optimizer_step=update)
        opt.zero_grad()
        share = record.loss if record.loss is not None and grid.tp_rank == 0 else 0.0
        loss = comm.all_reduce(np.array([share]))[0]  # the shares of the DP ranks' last stages
        errors["loss (worst step)"] = max(errors["loss (worst step)"], rel_err(loss, losses_s[step]))
    state = gather_full_state(model, opt, grid)  # on rank 0
    after = f"parameters after {args.steps} steps"
    errors[after] = as_one_vector(state, serial.state_dict()) if comm.rank == 0 else 0.0
    errors = {k: comm.all_reduce(np.array([e]), op="max")[0] for k, e in errors.items()}
    tol = TOLERANCE[args.dtype]
    failed = any(e > tol for e in errors.values())
    if comm.rank == 0:
        print(grid.describe())
        print("\nwho holds what (block 0's shards shown; every block is split the same way)")
        print(f"{'rank':>4} {'tp':>3} {'dp':>3} {'pp':>3}  {'blocks':<8} {'also':<10} {'tensor-parallel shard':<46}  ZeRO-1")
        print("\n".join(lines))
        print(f"\n{args.steps} AdamW steps (ZeRO-1, clipped at {MAX_NORM}), {args.micro_batches} micro-batches "
              f"per step, {args.dtype}, dropout 0.1; relative error against one device (tolerance {tol:g})")
        for name, e in errors.items():
            print(f"  {name:<28}{e:>10.1e}")
        print("\nMISMATCH: see the rows above" if failed else
              "\nThe 3D-parallel run equals the single-device run.")
    comm.barrier()  # a rank's non-zero exit ends the job: not before rank 0 has printed
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
