"""Lesson 3: tensor parallelism (Megatron-LM), checked against the single-device GPT.

    ./run_mpi.sh -n 8 lessons/03_tensor_parallel.py              # TP = 8
    ./run_mpi.sh -n 8 lessons/03_tensor_parallel.py --tp 4       # TP = 4 x DP = 2
    ./run_mpi.sh -n 8 lessons/03_tensor_parallel.py --dtype float64

Every rank builds two models from the same seed: the single-device GPT (the reference; small enough
to run on every rank) and the same GPT split across a tensor-parallel group. Each attention layer
keeps whole heads per rank, each MLP a slice of its 4x hidden columns, the embedding a slice of the
vocabulary. Both train a few AdamW steps on the same batches, with dropout, and we compare the
logits, the loss, every gradient and every parameter, gathered from the shards. A second pass adds
sequence parallelism, which also splits LayerNorm and dropout along the sequence.

What to look for: the errors are rounding (float32: ~1e-7 relative, float64: ~1e-15), and every
layer moves exactly 2 all-reduces forward and 2 backward, or, with sequence parallelism, the same
bytes as all-gathers and reduce-scatters. The lesson checks those counts too.

Two details of the comparison. Errors are relative in the 2-norm of each tensor, ||a - b|| / ||b||,
worst tensor shown. AdamW runs with eps = 1e-5: Adam divides by sqrt(v), so an entry whose gradient
is at the rounding level (~1e-9) would take a step as large as any other, in a direction set by
rounding, which differs between any two summation orders (any two layouts); eps sets the level
below which a gradient counts as zero.

Read next: minipar/parallel/tensor.py, docs/tensor_parallel.md.
"""

import argparse
import sys

import numpy as np

import minipar
from minipar.comm import world
from minipar.data import Dataset, load_corpus
from minipar.models import GPT, GPTConfig
from minipar.models.gpt import Block
from minipar.optim import AdamW
from minipar.parallel import ProcessGrid
from minipar.parallel.tensor import full_parameters

TOLERANCE = {"float32": 1e-5, "float64": 1e-10}


def parse_args(world_size):
    p = argparse.ArgumentParser(description="Tensor parallelism checked against one device.")
    p.add_argument("--tp", type=int, default=world_size, help="tensor-parallel size (DP = ranks / TP)")
    p.add_argument("--dtype", choices=TOLERANCE, default="float32")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps compared")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plant-bug", action="store_true",
                   help="skip finalize_grads, so sequence parallelism's partial gradients are never summed: must fail")
    args = p.parse_args()
    if args.tp < 1 or world_size % args.tp:  # every rank sees the same numbers: all stop here
        p.error(f"--tp {args.tp} does not divide the {world_size} ranks")
    if args.batch_size % (world_size // args.tp):
        p.error(f"--batch-size {args.batch_size} does not split over DP = {world_size // args.tp}")
    return args


def rel_err(a, b):
    """||a - b|| / ||b||, the relative error of a whole tensor (2-norm over all its entries)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def count_per_layer(grid):
    """Wrap Block.forward to record what each block moves on the TP group in forward."""
    per_block = []
    original = Block.forward

    def counted(block, x):
        before = {op: (t.calls, t.bytes_sent) for op, t in grid.tp_group.stats.by_op.items()}
        y = original(block, x)
        after = grid.tp_group.stats.by_op
        per_block.append({op: (t.calls - before.get(op, (0, 0))[0], t.bytes_sent - before.get(op, (0, 0))[1])
                          for op, t in after.items() if t.calls > before.get(op, (0, 0))[0]})
        return y

    Block.forward = counted
    return per_block, lambda: setattr(Block, "forward", original)


def run(args, grid, data, sp):
    """Train the serial and the parallel model side by side; returns errors and traffic."""
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       block_size=args.block_size, dropout=args.dropout)
    minipar.manual_seed(args.seed)
    serial = GPT(config)
    minipar.manual_seed(args.seed)
    model = GPT(config, grid, sequence_parallel=sp)
    opts = [AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1) for m in (serial, model)]
    dp, tp = grid.dp_group, grid.tp_group
    rows = slice(grid.dp_rank * args.batch_size // dp.size, (grid.dp_rank + 1) * args.batch_size // dp.size)
    errors, traffic = {}, {}
    for step in range(args.steps):
        x, y = data.batch("train", step, args.batch_size, args.block_size, args.seed)
        logits_s, loss_s = serial(x, y)
        loss_s.backward()
        serial.finalize_grads()
        tp.stats.reset()
        per_block, restore = count_per_layer(grid)
        logits, loss = model(x[rows], y[rows])
        restore()
        forward_total = {op: (t.calls, t.bytes_sent) for op, t in tp.stats.by_op.items()}
        tp.stats.reset()
        loss.backward()
        backward_total = {op: (t.calls, t.bytes_sent) for op, t in tp.stats.by_op.items()}
        if not args.plant_bug:  # planted bug: LayerNorm gradients stay partial under SP
            model.finalize_grads()
        for p in model.parameters():  # data parallel: average the replicas' gradients
            dp.all_reduce(p.grad)
            p.grad *= 1.0 / dp.size
        loss_all = dp.all_reduce(np.array([loss.item()]))[0] / dp.size
        if step == 0:
            errors["logits"] = rel_err(model.gather_logits(logits).data, logits_s.data[rows])
            grads = full_parameters(model, "grad")
            errors["gradients"] = max(rel_err(grads[n], p.grad) for n, p in serial.named_parameters())
            traffic = dict(per_block=per_block, forward=forward_total, backward=backward_total)
        errors["loss"] = max(errors.get("loss", 0.0), rel_err(loss_all, loss_s.item()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    state = model.full_state_dict()
    errors[f"parameters after {args.steps} steps"] = max(rel_err(state[n], v) for n, v in serial.state_dict().items())
    return errors, traffic


def expected_traffic(sp, n_layer):
    """Collective calls Megatron's design makes on the TP group: per block, and for the whole model.
    Outside the blocks: the embedding's sum over vocabulary shards, the output head's input
    (f, or the sequence all-gather) and the loss's two all-reduces over tokens."""
    L = n_layer
    if not sp:
        return ({"all_reduce": 2}, {"all_reduce": 2 * L + 3}, {"all_reduce": 2 * L + 1})
    both = {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1}
    return ({"all_gather": 2, "reduce_scatter": 2}, {**both, "all_reduce": 2}, both)


def check_traffic(traffic, sp, n_layer, activation_bytes, tp):
    """Measured calls equal the expected ones, and a block moves 2 all-reduces' worth of bytes."""
    block, forward, backward = expected_traffic(sp, n_layer)
    calls = lambda measured: {op: c for op, (c, _) in measured.items()}  # noqa: E731
    ok = all(calls(b) == block for b in traffic["per_block"])
    ok &= calls(traffic["forward"]) == forward and calls(traffic["backward"]) == backward
    sent = sum(b for _, b in traffic["per_block"][0].values())
    return ok and sent == 2 * (2 * (tp - 1) * activation_bytes // tp)


def print_traffic(sp, traffic, n_layer, activation_bytes, tp):
    block, forward, backward = expected_traffic(sp, n_layer)
    show = lambda ops: " + ".join(f"{n} {op}" for op, n in sorted(ops.items()))  # noqa: E731
    measured = lambda m: {op: c for op, (c, _) in m.items()}  # noqa: E731
    sent = sum(b for _, b in traffic["per_block"][0].values())
    print(f"\nsequence parallelism {'on' if sp else 'off'}: collectives on the TP group, first step "
          "(measured | expected)")
    print(f"  each block, forward    {show(measured(traffic['per_block'][0])):<34} | {show(block)}")
    print(f"  whole model, forward   {show(measured(traffic['forward'])):<34} | {show(forward)}")
    print(f"  whole model, backward  {show(measured(traffic['backward'])):<34} | {show(backward)}")
    print(f"  bytes sent per block forward: {sent:,} | 2 all-reduces of {activation_bytes:,} bytes, "
          f"2 x 2 (N-1)/N x S = {2 * (2 * (tp - 1) * activation_bytes // tp):,}")


def main():
    comm = world()
    args = parse_args(comm.size)
    minipar.set_default_dtype(args.dtype)
    grid = ProcessGrid(tp=args.tp, pp=1)
    data = Dataset(load_corpus())
    variants = [False] + ([True] if args.tp > 1 else [])
    results = {sp: run(args, grid, data, sp) for sp in variants}
    tol = TOLERANCE[args.dtype]
    B, T, C = args.batch_size // grid.dp, args.block_size, args.n_embd
    activation = B * T * C * np.dtype(args.dtype).itemsize  # one block's (B, T, C) activation
    failed = any(e > tol for errors, _ in results.values() for e in errors.values())
    failed |= not all(check_traffic(results[sp][1], sp, args.n_layer, activation, grid.tp) for sp in variants)
    failed = comm.all_reduce(np.array([int(failed)]), op="max")[0]  # every rank agrees
    if comm.rank == 0:
        print(f"{comm.size} ranks: TP={grid.tp} x DP={grid.dp}; GPT {args.n_layer} layers, "
              f"{args.n_head} heads, hidden {args.n_embd}, {args.dtype}, dropout {args.dropout}")
        print(f"\nrelative error against the single-device run (tolerance {tol:g})")
        names = list(results[False][0])
        header = "".join(f"{'SP ' + ('on' if sp else 'off'):>12}" for sp in variants)
        print(f"  {'':<28}{header}")
        for name in names:
            cells = "".join(f"{results[sp][0][name]:>12.1e}" for sp in variants)
            print(f"  {name:<28}{cells}")
        for sp in variants:
            print_traffic(sp, results[sp][1], args.n_layer, activation, grid.tp)
        if any(sp for sp in variants):
            print(f"  with sequence parallelism, LayerNorm and dropout hold (B, T/{grid.tp}, C) per rank "
                  f"instead of (B, T, C): {activation // grid.tp:,} bytes instead of {activation:,}")
        print("\nMISMATCH: see the rows above" if failed
              else "\nThe tensor-parallel GPT equals the single-device GPT, and moves what Megatron's design says.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
