"""Lesson 8: context parallelism (ring attention and Ulysses), checked against the single-device GPT.

    ./run_mpi.sh -n 8 lessons/08_context_parallel.py                      # CP=8, CP=4 x TP=2, a2a
    ./run_mpi.sh -n 8 lessons/08_context_parallel.py --cp 4 --tp 2 --cp-comm-type a2a
    ./run_mpi.sh -n 4 lessons/08_context_parallel.py --dtype float64

A long sequence's activations outgrow one device long before its weights do. Context parallelism
(CP) cuts every sequence across the ranks of a CP group: everything but attention works token by
token, so only attention must reach across. Three parts:

1. Attention alone, no MPI. A query's softmax over all keys can be built one block of keys at a
   time, keeping a running maximum, sum and output and rescaling them when the maximum grows (the
   online softmax of FlashAttention). Computed block by block, it equals the full softmax.
2. The whole GPT, with dropout, against one device. Ring attention (Liu et al. 2023, "p2p") sends
   each rank's keys and values around the ring and merges them block by block; Ulysses (Jacobs et
   al. 2023, "a2a") trades the sequence shard for a head shard by all-to-all and runs ordinary
   attention. Each rank holds chunks r and 2CP-1-r of 2CP chunks (Megatron-core's load balancing).
   Both train the same AdamW steps through the executor the trainer uses; gradients are summed over
   DP x CP, because every CP rank saw other tokens through the same weights.
3. What it costs: the bytes each rank sends per layer, beside the formulas; the activation each
   rank holds; the causal work per rank under the load-balanced and the contiguous split.

What to look at. The errors are rounding (float32 ~1e-7, float64 ~1e-15). p2p sends 2 (CP-1) K,V
blocks of T/CP tokens per layer forward and twice that backward, whatever the heads; a2a sends
4 (CP-1)/CP of the local qkv and output, which shrinks as CP grows, but needs the heads divisible
by CP x TP. Both make two tiny all-gathers per call to check that the ranks agree (counted apart).
A contiguous split leaves the last rank almost twice the mean's work; the load-balanced one, none.

Exercises.
  a. Predict the contiguous split's max/mean at CP=4 and T=64 from (T(2CP-1)+CP)/(CP(T+1)); then run
     -n 4 and read the work table's CP=4 row (the default T is 64).
  b. Run -n 4 --cp-comm-type a2a --n-head 2 and read the one-line error. Why must heads divide by CP?
  c. Compare the bytes of p2p and a2a at -n 2 and -n 8. At which CP does a2a send less? Which of the
     two can hide its transfer behind compute (look at ring_attention.py's loop)?
  d. --plant-bug removes the rescale from the online softmax: which parts fail, and why does a2a pass?
  e. A ring pass computes its chunk pairs as rectangles of scores, joined where they adjoin
     (blockwise.pairs): at CP=2 a balanced rank computes 3 a pass. Predict the count of each rank
     at CP=4, balanced and contiguous, then check by extending tests/test_context.py's
     test_a_balanced_rank_computes_three_rectangles_a_pass_at_cp_2 (pairs of Block(positions)).

Read next: minipar/parallel/context.py, ring_attention.py, ulysses.py, functional/blockwise.py,
docs/context_parallel.md.
"""

import time

import numpy as np

import lesson
import minipar
import minipar.functional as F
from minipar.backend import to_numpy, xp
from minipar.functional import blockwise
from minipar.mfu import measured_peak
from minipar.models import GPT, GPTConfig
from minipar.models.layers import Block
from minipar.parallel import ProcessGrid
from minipar.parallel.context import HEADER, causal_work, contiguous_positions, load_balanced_positions
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.tensor import local_shard
from minipar.parallel.validate import RunConfig, problems
from minipar.rng import rows_of
from minipar.verify import rel_err

FLAGS = {"cp": "--cp", "tp": "--tp", "cp_comm_type": "--cp-comm-type", "global_batch": "--batch-size",
         "n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd", "block_size": "--block-size",
         "dropout": "--dropout", "dtype": "--dtype"}


def flags(p):
    # none of the three: up to three layouts from the rank count; any of them: that one layout
    p.add_argument("--cp", type=int, help="context-parallel size (default: ranks / TP)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default 1; DP = ranks / CP / TP)")
    p.add_argument("--cp-comm-type", help="p2p (ring attention, the default) or a2a (Ulysses)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="the global batch")
    p.add_argument("--dropout", type=float, default=0.1)


def layouts(args, ranks):
    """(CP, TP, comm type) of each run: the one asked for, or the ring over every rank, the ring on
    half of them with TP=2, and Ulysses over every rank, each where the heads split."""
    if (args.cp, args.tp, args.cp_comm_type) != (None, None, None):  # (0 and '' go on to be refused)
        tp = 1 if args.tp is None else args.tp
        return [(max(ranks // max(tp, 1), 1) if args.cp is None else args.cp, tp,
                 "p2p" if args.cp_comm_type is None else args.cp_comm_type)]
    runs = [(ranks, 1, "p2p")] + [(ranks // 2, 2, "p2p")] * (ranks >= 4 and ranks % 2 == 0 and args.n_head % 2 == 0)
    return runs + [(ranks, 1, "a2a")] * (ranks > 1 and args.n_head % ranks == 0)


def check(args, ranks):
    found = lesson.at_least_one(args, "--steps")
    for cp, tp, comm_type in layouts(args, ranks):
        run = RunConfig(world_size=ranks, tp=tp, cp=cp, cp_comm_type=comm_type, global_batch=args.batch_size,
                        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                        dropout=args.dropout, dtype=args.dtype)
        found += [line for line in problems(run, FLAGS) if line not in found]
        if args.cp_comm_type and cp == 1:  # once run as "CP1 a2a", sending nothing on the CP group
            found.append(f"--cp-comm-type {args.cp_comm_type} is how context-parallel ranks communicate, and CP is 1 "
                         f"here ({ranks} rank{'s' * (ranks > 1)}, TP={tp}): give --cp > 1, or drop it")
    return found or lesson.memory_problems(run, FLAGS, args.steps)  # (the same model in every layout)


def attention_alone(args, cp):
    """Part 1: causal attention over one sequence, its keys taken one ring block at a time (chunks
    r and 2CP-1-r) in the order rank 1 meets them, merged by the online softmax, against the full
    softmax: the output and the gradient of q, k, v."""
    T, H = args.block_size, args.n_head
    rng, dtype = np.random.default_rng(args.seed), minipar.get_default_dtype()
    qkv = minipar.Tensor(xp.asarray(rng.standard_normal((2, T, 3 * args.n_embd)), dtype), requires_grad=True)
    grad = xp.asarray(rng.standard_normal((2, T, args.n_embd)), dtype)
    chunks = np.array_split(np.arange(T), 2 * cp)
    blocks = [np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]) for r in ((1 - t) % cp for t in range(cp))]
    results = {}
    for name, attend in (("full", lambda: F.causal_attention(qkv, H)),
                         ("blocks", lambda: F.blockwise_attention(qkv, H, blocks))):
        qkv.grad = None
        y = attend()
        y.backward(grad)
        results[name] = (y.data, qkv.grad.copy())
    (y, dy), (y_full, dy_full) = results["blocks"], results["full"]
    return {"output": rel_err(y, y_full), "gradient of qkv": rel_err(dy, dy_full)}


def count_blocks():
    """Wrap Block.forward to record the bytes of each block's input on this rank."""
    inputs, original = [], Block.forward

    def counted(block, x):
        inputs.append(x.data.nbytes)
        return original(block, x)

    Block.forward = counted
    return inputs, lambda: setattr(Block, "forward", original)


def traffic(group):
    """{op: (calls, bytes sent)} on ``group`` since its last reset."""
    return {op: (t.calls, t.bytes_sent) for op, t in group.stats.by_op.items()}


def run(args, config, layout, batches, reference, peak):
    """Train the GPT on a grid with CP (and TP) through the executor; its errors and its costs
    (``peak``: the machine's FLOP/s, for the steps' MFU)."""
    cp, tp, comm_type = layout
    minipar.manual_seed(args.seed)
    grid = ProcessGrid(tp=tp, pp=1, cp=cp)
    model = GPT(config, grid, cp_comm_type=comm_type)
    opt = make_optimizer(model, grid, 0, **lesson.HYPER)  # sums gradients over DP x CP
    executor = PipelineExecutor(model, grid, "1f1b", micro_batches=1, optimizer=opt)
    named = dict(model.named_parameters())
    compare = lesson.Comparison(reference, order=("logits", "gradients", "loss", "parameters"))
    T, cp_group = config.block_size, grid.cp_group if cp > 1 else None

    # the first step's logits: this rank's rows and positions, the whole vocabulary
    model.rng.iteration = 0
    rows = rows_of(args.batch_size, (0, 1), (grid.dp_rank, grid.dp))
    inputs, restore = count_blocks()
    if cp_group:
        cp_group.stats.reset()
    with model.rng.at(rows=rows):
        logits, _ = model(batches[0][0][to_numpy(rows)])  # the batches stay on the host
    restore()
    forward = traffic(cp_group) if cp_group else {}
    positions = model.context_positions(T)
    compare.record("logits", rel_err(model.gather_logits(logits).data, reference.logits[rows][:, positions]))

    seconds = []
    for step, (x, y) in enumerate(batches):
        start = time.perf_counter()
        model.rng.iteration = step  # keys the dropout masks (with each token's global place)

        def update():
            opt.finish_gradients()
            if step == 0:  # this rank's shard of every gradient, summed over DP x CP
                compare.gradients({n: p.grad for n, p in named.items()},
                                  {n: local_shard(p, reference.grads[n], grid) for n, p in named.items()})
            opt.step()

        if cp_group:
            cp_group.stats.reset()
        record = executor.step(x, y, optimizer_step=update)
        if step == 0 and cp_group:  # forward and backward; the forward was measured alone above
            backward = {op: (c - forward.get(op, (0, 0))[0], b - forward.get(op, (0, 0))[1])
                        for op, (c, b) in traffic(cp_group).items()}
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
        share = record.loss if grid.tp_rank == 0 else 0.0  # each DP x CP rank's share of the mean
        compare.loss(step, grid.world.all_reduce(np.array([share]))[0])
    compare.parameters(model.full_state_dict())
    costs = dict(forward=forward, backward=backward if cp_group else {}, block_input=inputs[0],
                 local_tokens=len(positions), rows=len(rows),
                 mfu=lesson.mfu(grid.world, config, args.batch_size * T, seconds, peak))
    return compare.worst_over(grid.world), costs


def expected_bytes(layout, B, T, C, itemsize):
    """Per layer, per rank: (forward, backward) bytes of attention's own messages, and the bytes of
    the two all-gathers each call makes to check its arguments ([HEADER] int64s, T/CP positions)."""
    cp, tp, comm_type = layout
    L, width = T // cp, C // tp
    if comm_type == "p2p":  # (CP-1) K,V blocks around the ring; backward: K,V again and dK,dV
        kv = 2 * B * L * width * itemsize
        attention = ((cp - 1) * kv, 2 * (cp - 1) * kv)
    else:  # all-to-all of qkv (3 widths) in and of the output (1 width) back: (CP-1)/CP of each
        a2a = (cp - 1) * 4 * B * L * width * itemsize // cp
        attention = (a2a, a2a)
    checks = (cp - 1) * (HEADER + L) * 8
    return attention, checks


def measured_bytes(costs, layers):
    """Per layer: (forward, backward) bytes of attention's messages, and the check all-gathers'."""
    mover = lambda t: sum(b for op, (_, b) in t.items() if op in ("send", "all_to_all"))  # noqa: E731
    gathers = costs["forward"].get("all_gather", (0, 0))[1]
    return (mover(costs["forward"]) / layers, mover(costs["backward"]) / layers), gathers / layers


def work_table(T, cps):
    """Max/mean of the causal (query, key) pairs per rank: measured, and the contiguous formula."""
    lines = []
    for cp in cps:
        split = {name: causal_work([rule(T, cp, r) for r in range(cp)])
                 for name, rule in (("balanced", load_balanced_positions), ("contiguous", contiguous_positions))}
        ratio = {name: max(w) / np.mean(w) for name, w in split.items()}
        formula = (T * (2 * cp - 1) + cp) / (cp * (T + 1))
        lines.append(f"  CP={cp:<2} T={T:<7,} {ratio['balanced']:>9.4f} {ratio['contiguous']:>11.4f} "
                     f"{formula:>9.4f}   {min(split['contiguous']):,}..{max(split['contiguous']):,}")
    return lines


def main():
    args, comm = lesson.start("Context parallelism checked against one device.", flags, check, steps=2,
                              plant_bug="the online softmax forgets to rescale: alpha = 1 instead of "
                              "exp(m - m'): must fail")
    if args.plant_bug:  # the terms gathered so far keep their old maximum when a larger one arrives
        blockwise.rescale = lambda m, shift: xp.where(xp.isneginf(m), 0.0, 1.0).astype(m.dtype)
    ring = max(layouts(args, comm.size)[0][0], 2)  # the first layout's CP
    alone = attention_alone(args, ring)
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       block_size=args.block_size, dropout=args.dropout)
    batches = lesson.batches(args, config.block_size)
    reference = lesson.reference_run(comm, config, batches, args.seed)
    peak = measured_peak(comm, minipar.get_default_dtype())  # all ranks at once (a collective)
    results = {layout: run(args, config, layout, batches, reference, peak) for layout in layouts(args, comm.size)}

    tol = lesson.TOLERANCE[args.dtype]
    itemsize = np.dtype(args.dtype).itemsize
    name = lambda cp, tp, c: f"CP{cp}" + f"xTP{tp}" * (tp > 1) + f" {c}"  # noqa: E731
    columns = {name(*layout): errors for layout, (errors, _) in results.items()}
    failed = lesson.failed_rows(tol, {None: alone}, where=" (1. attention)") + lesson.failed_rows(
        tol, columns, where=" (2. the GPT)")
    shown = {}
    for layout, (_, costs) in results.items():
        expected = expected_bytes(layout, costs["rows"], args.block_size, args.n_embd, itemsize)
        measured = measured_bytes(costs, args.n_layer)
        block = costs["rows"] * costs["local_tokens"] * args.n_embd * itemsize
        if measured != expected:
            failed.append(f"{name(*layout)}: the bytes sent on the CP group differ from the formula (3.)")
        if costs["block_input"] != block:
            failed.append(f"{name(*layout)}: a block's input is {costs['block_input']:,} bytes, not {block:,}")
        shown[layout] = expected, measured, block

    def report():
        print(f"{comm.size} ranks; GPT {args.n_layer} layers, {args.n_head} heads, hidden {args.n_embd}, "
              f"T={args.block_size}, batch {args.batch_size}, {args.dtype}, dropout {args.dropout}")
        if args.plant_bug:
            print("PLANTED BUG: the online softmax's merge skips its rescale (alpha = 1)")
        lesson.print_errors({None: alone}, tol, title=f"1. attention, keys in {ring} ring blocks merged by the online "
                            "softmax, vs all at once")
        lesson.print_errors(columns, tol, width=14,
                            title=f"2. the GPT, {args.steps} AdamW steps through the executor")
        print("\n3. bytes each rank sends on the CP group per layer (measured | formula)")
        print(f"  {'layout':<12} {'forward':>23} {'backward':>23}   {'check all-gathers':>17}")
        for layout, ((attention, checks), (moved, gathered), _) in shown.items():
            print(f"  {name(*layout):<12} {moved[0]:>11,.0f} | {attention[0]:>9,} {moved[1]:>11,.0f} | "
                  f"{attention[1]:>9,}   {gathered:>7,.0f} | {checks:>7,}")
        print("  p2p: (CP-1) x 2 B (T/CP) (C/TP) itemsize forward, twice that backward (K,V again + dK,dV)")
        print(f"  a2a: 4 (CP-1)/CP B (T/CP) (C/TP) itemsize each way; checks: (CP-1)({HEADER} + T/CP) x 8 bytes")
        single = (args.batch_size * args.block_size * args.n_embd * itemsize)
        print(f"\n  a block's input on each rank (one device, whole batch: {single:,} bytes; DP splits rows)")
        for layout, (_, _, block) in shown.items():
            cp, tp, _ = layout
            print(f"  {name(*layout):<12} {block:>9,} bytes = 1/{single // block} of it "
                  f"= 1/(CP x DP) = 1/({cp} x {comm.size // cp // tp})")
        cps = sorted(c for c in {2, 4, 8} | {layout[0] for layout in results} if args.block_size % (2 * c) == 0
                     and c > 1)
        print(f"\n  causal (query, key) pairs per rank, max/mean\n  {'':<15}{'balanced':>9} {'contiguous':>11} "
              f"{'formula':>9}   contiguous: fewest..most")
        print("\n".join(work_table(args.block_size, cps) + work_table(1 << 17, [4])))
        print("  formula (contiguous): (T(2CP-1) + CP) / (CP(T+1)) -> (2CP-1)/CP; balanced: exactly 1")
        print("\n4. model FLOPs utilisation of the parallel steps (the first one, which compares, left out)")
        for layout, (_, costs) in results.items():
            print(f"  {name(*layout):<12} {costs['mfu']}")

    return lesson.finish(comm, failed, report, "Context parallelism equals the single-device run, and "
                         "sends what the formulas say.")


if __name__ == "__main__":
    lesson.end(main())
