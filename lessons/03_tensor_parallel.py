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

What to look for: the errors are rounding (float32: ~1e-7 for logits and gradients, below that
for the parameters; float64: 1e-16 to 1e-15), and every layer makes exactly 2 all-reduces forward (2 backward for
the model's blocks), or, with sequence parallelism, all-gathers and reduce-scatters of the same
size while LayerNorm and dropout work on 1/TP of the activation. The lesson checks those too.

How the comparison is made. Errors are relative in the 2-norm, ||a - b|| / ||b||: per tensor for
logits and gradients (the worst tensor is shown), over all parameters as one vector after the
optimizer steps. Adam makes the per-tensor view of parameters meaningless in float32: it divides
by sqrt(v), so an entry whose gradient nearly cancels (its rounding is large relative to it) moves
by a step of ordinary size in a direction set by rounding, which differs between any two summation
orders, and a bias that starts at zero is only three such steps large. For the same reason AdamW
runs with eps = 1e-5: gradients below eps count as nearly zero instead of as full-sized steps.

Read next: minipar/parallel/tensor.py, docs/tensor_parallel.md.

Exercises (predict first, then run the command and read the line named):
1. With --tp 4 on 8 ranks each TP group gets half of the batch of 8: S = 4 sequences x 64 tokens x
   128 x 4 bytes. Predict "bytes per block forward" and, with sequence parallelism on, "a block's
   input on this rank": ./run_mpi.sh -n 8 lessons/03_tensor_parallel.py --tp 4
2. The default 4 layers make 11 all-reduces forward without SP ("whole model, forward", AR).
   Predict the count for 6 layers: ./run_mpi.sh -n 2 lessons/03_tensor_parallel.py --n-layer 6
3. Predict the errors in float64: ./run_mpi.sh -n 4 lessons/03_tensor_parallel.py --dtype float64
4. --plant-bug skips finalize_grads. Predict which column (SP off or SP on) fails and which rows:
   ./run_mpi.sh -n 2 lessons/03_tensor_parallel.py --plant-bug
"""

import time

import numpy as np

import lesson
import minipar
from minipar.mfu import measured_peak
from minipar.models import GPT, GPTConfig
from minipar.models.layers import Block
from minipar.optim import AdamW
from minipar.parallel import ProcessGrid
from minipar.parallel.tensor import full_parameters
from minipar.parallel.validate import RunConfig, problems

FLAGS = {"tp": "--tp", "global_batch": "--batch-size", "n_layer": "--n-layer", "n_head": "--n-head",
         "n_embd": "--n-embd", "block_size": "--block-size", "dropout": "--dropout", "dtype": "--dtype",
         "sequence_parallel": "the sequence-parallel pass"}


def flags(p):
    p.add_argument("--tp", type=int, help="tensor-parallel size (DP = ranks / TP; default: every rank)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--dropout", type=float, default=0.1)


def check(args, ranks):
    args.tp = ranks if args.tp is None else args.tp
    # the second pass (TP > 1) adds sequence parallelism: the more demanding of the two runs
    run = RunConfig(world_size=ranks, tp=args.tp, global_batch=args.batch_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size, dropout=args.dropout,
                    sequence_parallel=args.tp > 1, dtype=args.dtype)
    found = problems(run, FLAGS) or lesson.memory_problems(run, FLAGS, args.steps)
    if args.plant_bug and args.tp == 1:  # no sequence-parallel pass: no partial gradient to leave unsummed
        found.append("--plant-bug leaves sequence parallelism's partial gradients unsummed, and TP=1 runs no "
                     "sequence parallelism: give --tp 2 or more (on 2 or more ranks)")
    return lesson.at_least_one(args, "--steps") + found


def count_per_layer(grid):
    """Wrap Block.forward to record what each block moves on the TP group in forward, and how
    big its input (the activation LayerNorm and dropout work on) is on this rank."""
    per_block, inputs = [], []
    original = Block.forward

    def counted(block, x):
        before = {op: (t.calls, t.bytes_sent) for op, t in grid.tp_group.stats.by_op.items()}
        inputs.append(x.data.nbytes)
        y = original(block, x)
        after = grid.tp_group.stats.by_op
        per_block.append({op: (t.calls - before.get(op, (0, 0))[0], t.bytes_sent - before.get(op, (0, 0))[1])
                          for op, t in after.items() if t.calls > before.get(op, (0, 0))[0]})
        return y

    Block.forward = counted
    return per_block, inputs, lambda: setattr(Block, "forward", original)


def run(args, config, grid, batches, reference, sp, peak):
    """Train the tensor-parallel GPT (with sequence parallelism if ``sp``) on the reference's
    batches; its errors against the reference, its traffic and its MFU (``peak``: the machine's)."""
    minipar.manual_seed(args.seed)
    model = GPT(config, grid, sequence_parallel=sp)
    opt = AdamW(model.parameters(), **lesson.HYPER)
    dp, tp = grid.dp_group, grid.tp_group
    rows = slice(grid.dp_rank * args.batch_size // dp.size, (grid.dp_rank + 1) * args.batch_size // dp.size)
    compare = lesson.Comparison(reference, order=("logits", "gradients", "loss", "parameters"))
    seconds = []
    for step, (x, y) in enumerate(batches):
        start = time.perf_counter()
        model.rng.iteration = step  # keys the dropout masks
        tp.stats.reset()
        per_block, block_inputs, restore = count_per_layer(grid)
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
        if step == 0:
            compare.logits(model.gather_logits(logits).data, rows)
            compare.gradients(full_parameters(model, "grad"))
            traffic = dict(per_block=per_block, forward=forward_total, backward=backward_total,
                           block_input=block_inputs[0])
        compare.loss(step, dp.all_reduce(np.array([loss.item()]))[0] / dp.size)
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
    compare.parameters(model.full_state_dict())
    traffic["mfu"] = lesson.mfu(grid.world, config, args.batch_size * config.block_size, seconds, peak)
    return compare.errors, traffic


def expected_traffic(sp, n_layer, tp):
    """Collective calls Megatron's design makes on the TP group: per block, and for the whole model.
    Outside the blocks: the embedding's sum over vocabulary shards, the output head's input
    (f, or the sequence all-gather) and the loss's two all-reduces over tokens."""
    L = n_layer
    if tp == 1:
        return {}, {}, {}  # a group of one rank communicates nothing
    if not sp:
        return ({"all_reduce": 2}, {"all_reduce": 2 * L + 3}, {"all_reduce": 2 * L + 1})
    both = {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1}
    return ({"all_gather": 2, "reduce_scatter": 2}, {**both, "all_reduce": 2}, both)


def check_traffic(traffic, sp, n_layer, activation_bytes, tp):
    """Measured calls equal the expected ones, and a block moves 2 all-reduces' worth of bytes."""
    block, forward, backward = expected_traffic(sp, n_layer, tp)
    calls = lambda measured: {op: c for op, (c, _) in measured.items()}  # noqa: E731
    ok = all(calls(b) == block for b in traffic["per_block"])
    ok &= calls(traffic["forward"]) == forward and calls(traffic["backward"]) == backward
    sent = sum(b for _, b in traffic["per_block"][0].values())
    expected_input = activation_bytes // tp if sp else activation_bytes
    return ok and sent == 2 * (2 * (tp - 1) * activation_bytes // tp) and traffic["block_input"] == expected_input


def print_traffic(sp, traffic, n_layer, activation_bytes, tp):
    block, forward, backward = expected_traffic(sp, n_layer, tp)
    short = {"all_gather": "AG", "all_reduce": "AR", "reduce_scatter": "RS"}
    show = lambda ops: " + ".join(f"{n} {short.get(op, op)}" for op, n in sorted(ops.items())) or "none"  # noqa: E731
    measured = lambda m: {op: c for op, (c, _) in m.items()}  # noqa: E731
    sent = sum(b for _, b in traffic["per_block"][0].values())
    print(f"\nsequence parallelism {'on' if sp else 'off'}: collectives on the TP group, first step "
          "(measured | expected;\n  AR all-reduce, AG all-gather, RS reduce-scatter)")
    print(f"  each block, forward    {show(measured(traffic['per_block'][0])):<20} | {show(block)}")
    print(f"  whole model, forward   {show(measured(traffic['forward'])):<20} | {show(forward)}")
    print(f"  whole model, backward  {show(measured(traffic['backward'])):<20} | {show(backward)}")
    print(f"  bytes per block forward (ring model): {sent:,} | 2 all-reduces of S = {activation_bytes:,} bytes,")
    print(f"  {'':<38}  2 x 2 (N-1)/N x S = {2 * (2 * (tp - 1) * activation_bytes // tp):,}")
    print(f"  a block's input on this rank (what LayerNorm and dropout work on): "
          f"{traffic['block_input']:,} bytes")


def main():
    args, comm = lesson.start("Tensor parallelism checked against one device.", flags, check,
                              plant_bug="skip finalize_grads, so sequence parallelism's partial gradients are "
                              "never summed: must fail")
    grid = ProcessGrid(tp=args.tp, pp=1)
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       block_size=args.block_size, dropout=args.dropout)
    batches = lesson.batches(args, config.block_size)
    reference = lesson.reference_run(comm, config, batches, args.seed)
    variants = [False] + ([True] if args.tp > 1 else [])
    peak = measured_peak(comm, minipar.get_default_dtype())  # all ranks at once (a collective)
    results = {sp: run(args, config, grid, batches, reference, sp, peak) for sp in variants}

    tol = lesson.TOLERANCE[args.dtype]
    B, T, C = args.batch_size // grid.dp, args.block_size, args.n_embd
    activation = B * T * C * np.dtype(args.dtype).itemsize  # one block's (B, T, C) activation
    columns = {f"SP {'on' if sp else 'off'}": results[sp][0] for sp in variants}
    failed = lesson.failed_rows(tol, columns) + [
        f"the collectives on the TP group with SP {'on' if sp else 'off'} differ from Megatron's design (above)"
        for sp in variants if not check_traffic(results[sp][1], sp, args.n_layer, activation, grid.tp)]

    def report():
        print(f"{comm.size} ranks: TP={grid.tp} x DP={grid.dp}; GPT {args.n_layer} layers, "
              f"{args.n_head} heads, hidden {args.n_embd}, {args.dtype}, dropout {args.dropout}")
        lesson.print_errors(columns, tol, width=12)
        for sp in variants:
            print_traffic(sp, results[sp][1], args.n_layer, activation, grid.tp)
        print("\nmodel FLOPs utilisation of the tensor-parallel steps (the first, which compares, left out)")
        for sp in variants:
            print(f"  SP {'on ' if sp else 'off'}  {results[sp][1]['mfu']}")

    return lesson.finish(comm, failed, report,
                         "The tensor-parallel GPT equals the single-device GPT, and moves what Megatron's design says.")


if __name__ == "__main__":
    lesson.end(main())
