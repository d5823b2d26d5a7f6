"""Lesson 9: a mixture of experts with expert parallelism, checked against the single-device MoE GPT.

    ./run_mpi.sh -n 8 lessons/09_mixture_of_experts.py                  # EP = 2, 4, 8 over DP = 8
    ./run_mpi.sh -n 4 lessons/09_mixture_of_experts.py --capacity-factor 1.0
    ./run_mpi.sh -n 4 lessons/09_mixture_of_experts.py --dtype float64

A mixture of experts (MoE) gives a block E MLPs ("experts") and a router that sends each token to
k of them: E times the MLP's parameters for k times its FLOPs per token. Expert parallelism (EP)
spreads the experts over EP ranks carved out of DP x CP (here DP): rank r of an EP group holds
experts r E/EP ... (r+1) E/EP - 1, every token travels to its experts' ranks by all-to-all and
back, and an expert's gradient is summed only over the ranks that hold it (DP x CP / EP of them),
where a dense weight's is summed over all of DP.

1. Routing: each MoE layer's token-slots per expert in the first step, the slots over capacity
   (with a capacity factor: the most probable keep their place), the balancing and z-losses.
2. The MoE GPT on EP = 2, 4, 8 (as the ranks allow) against one device, through the executor and
   optimizer the trainer uses: loss, auxiliary losses, slots per expert, gradients, parameters.
   Each rank routes its own tokens, so the single-device model routes the same groups of tokens
   (``RoutingGroups``): dropless, that changes nothing but the balancing loss, a mean over the
   groups; with a capacity factor each group has its own capacity, and one device drops exactly
   the slots the ranks drop.
3. What it costs: the bytes each rank sends by all-to-all-v, measured beside the exact count from
   the routing, and the estimate for a uniform router; the expert parameters each rank holds.

What to look at. Errors are rounding (float32 below 1e-6, float64 ~1e-15) and the slot counts are
equal.
Each rank sends 2 (out + in) rows of h values per MoE layer, forward and backward together: out,
its slots routed to other ranks' experts; in, the slots others route to its experts. A uniform
router makes out = in = N k (EP-1)/EP. Expert bytes per rank fall as 1/EP; the dense ones do not.

Exercises.
  a. Run with --capacity-factor 0.5 and read how many slots are dropped. What does a dropped slot
     add to its token, and what carries the token on?
  b. Raise --aux-loss-coeff to 1 and run --steps 20: does the busiest expert's load come nearer the
     mean from the first step to the last ("busiest expert / mean"), more than with the default?
  c. Predict the bytes of EP=8 from the uniform formula before running -n 8; why is the measured
     number not exactly it?
  d. --plant-bug combines with the wrong permutation (the rows come back in the order they arrived,
     not the order of their tokens): which rows fail first, and why does EP=1 not notice? At -n 8
     EP=8 passes too: how many experts does each rank hold there?

Read next: minipar/models/moe.py, minipar/parallel/experts.py, minipar/functional/routing.py,
functional/router_losses.py, docs/moe.md.
"""

import time

import numpy as np

import lesson
import minipar
from minipar.mfu import measured_peak
from minipar.models import GPT, GPTConfig
from minipar.models.moe import MoEMLP, RoutingGroups, step_statistics
from minipar.parallel import ProcessGrid
from minipar.parallel import experts as ep_module
from minipar.parallel.memory import mlp_parameters
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.validate import RunConfig, problems

FLAGS = {"ep": "--ep", "num_experts": "--num-experts", "moe_router_topk": "--topk", "global_batch": "--batch-size",
         "n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd", "block_size": "--block-size",
         "moe_expert_capacity_factor": "--capacity-factor", "dropout": "--dropout", "dtype": "--dtype"}


def flags(p):
    p.add_argument("--ep", type=int, help="one expert-parallel size (default: 2, 4, 8 as the ranks allow)")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2, help="experts per token")
    p.add_argument("--capacity-factor", type=float, help="token-slots per expert: factor x N k / E (default: dropless)")
    p.add_argument("--aux-loss-coeff", type=float, default=0.01)
    p.add_argument("--z-loss-coeff", type=float, default=0.001)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--dropout", type=float, default=0.1)


def expert_sizes(args, ranks):
    """The EP sizes to run: the one asked for, or 2, 4 and 8 where they divide DP (= the ranks)."""
    if args.ep is not None:
        return [args.ep]
    return [ep for ep in (2, 4, 8) if ranks % ep == 0 and args.num_experts % ep == 0] or [1]


def check(args, ranks):
    found = lesson.at_least_one(args, "--steps")
    if not all(0 <= c < float("inf") for c in (args.aux_loss_coeff, args.z_loss_coeff)):  # nan too
        found.append("--aux-loss-coeff and --z-loss-coeff must be finite and >= 0")
    for ep in expert_sizes(args, ranks):
        run = RunConfig(world_size=ranks, ep=ep, num_experts=args.num_experts, moe_router_topk=args.topk,
                        moe_expert_capacity_factor=args.capacity_factor, global_batch=args.batch_size,
                        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                        dropout=args.dropout, dtype=args.dtype)
        found += [line for line in problems(run, FLAGS) if line not in found]
    sizes = expert_sizes(args, ranks)
    if args.plant_bug and not found and all(ep == 1 or ep >= args.num_experts for ep in sizes):
        # EP=1 sends nothing and sorts nothing; a rank of one expert gets its rows in token order anyway
        found.append(f"--plant-bug skips putting the rows combine returns back in token order, which only an "
                     f"expert-parallel rank holding 2 or more experts gets wrong, and EP={', '.join(map(str, sizes))} "
                     f"with {args.num_experts} experts gives no such rank: " +
                     (f"run on 2 or more ranks, with an --ep between 2 and {args.num_experts // 2}"
                      if args.num_experts >= 4 else "give --num-experts 4 or more (2 or more a rank at --ep 2)"))
    return found or lesson.memory_problems(run, FLAGS, args.steps)  # (the same model in every layout)


def uneven_split():
    """all_to_all_v's bookkeeping with an expert that gets nothing: the rows that come back to each
    slot are the rows that left it (no MPI: the permutations alone, as one rank sees them)."""
    counts = np.array([[3, 0], [1, 2]])  # rows from source rank s for local expert j; expert 1 of rank 0 gets none
    order = ep_module.expert_major(counts)  # by source, then expert -> by expert, then source
    back = ep_module.inverse(order)
    rows = np.arange(counts.sum())
    return bool((rows[order][back] == rows).all()) and order.tolist() == [0, 1, 2, 3, 4, 5]


def run(args, config, ep, batches, reference, peak):
    """Train the MoE GPT on DP = ranks with EP = ``ep``; its errors, routing and costs."""
    minipar.manual_seed(args.seed)
    grid = ProcessGrid(tp=1, pp=1, ep=ep)
    model = GPT(config, grid)
    opt = make_optimizer(model, grid, 0, **lesson.HYPER)  # dense over DP, experts over DP / EP
    executor = PipelineExecutor(model, grid, "1f1b", micro_batches=1, optimizer=opt)
    named = dict(model.named_parameters())
    compare = lesson.Comparison(reference, order=("loss", "aux", "routing", "gradients", "parameters"))
    layers = [b.mlp for b in model.transformer.h if isinstance(b.mlp, MoEMLP)]
    seconds = []
    for step, (x, y) in enumerate(batches):
        start = time.perf_counter()
        model.rng.iteration = step
        model.moe.reset()

        def update():
            opt.finish_gradients()
            if step == 0:  # the experts this rank holds, summed over the ranks that hold them
                compare.gradients({n: p.grad for n, p in named.items()})
            opt.step()

        if step == 0 and ep > 1:
            grid.ep_group.stats.reset()
        record = executor.step(x, y, optimizer_step=update)
        if step == 0:
            sent = grid.ep_group.stats.by_op["all_to_all_v"].bytes_sent if ep > 1 else 0
            counts = [m.tokens_per_expert for m in layers]  # this rank's slots per expert, per layer
            routing = step_statistics(model, grid.world)
            ref = reference.routing
            compare.record("aux", abs(routing["aux_loss"] + routing["z_loss"] - ref["aux_loss"] - ref["z_loss"])
                           / (ref["aux_loss"] + ref["z_loss"]))
            compare.record("routing", float(np.abs(routing["tokens_per_expert"] - ref["tokens_per_expert"]).max()
                                            + np.abs(routing["dropped"] - ref["dropped"]).max()))
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
        compare.loss(step, grid.world.all_reduce(np.array([record.loss]))[0])
    compare.parameters(model.state_dict(), some=True)  # this rank's experts and every dense one (TP = 1)
    expert_bytes = sum(p.data.nbytes for n, p in model.named_parameters() if ".mlp.experts." in n)  # (EP = 1 too)
    every = grid.ep_group.all_gather(np.stack(counts)) if ep > 1 else np.stack(counts)[None]  # (EP, L, E)
    r, per = grid.ep_rank, args.num_experts // ep
    mine = slice(r * per, (r + 1) * per)
    out = sum(int(c.sum() - c[mine].sum()) for c in every[r])  # slots this rank sends away, all layers
    into = sum(int(every[s, layer, mine].sum()) for s in range(ep) if s != r for layer in range(len(layers)))
    costs = dict(sent=sent, exact=2 * (out + into) * args.n_embd * np.dtype(args.dtype).itemsize,
                 expert_bytes=expert_bytes)
    worst = {k: grid.world.all_reduce(np.array([v]), op="max")[0] for k, v in costs.items()}
    wrong = grid.world.all_reduce(np.array([int(costs["sent"] != costs["exact"])]), op="max")[0]
    mfu = lesson.mfu(grid.world, config, args.batch_size * args.block_size, seconds, peak)
    return compare.worst_over(grid.world), dict(worst, ok=not wrong, rows=args.batch_size // grid.dp, mfu=mfu)


def main():
    args, comm = lesson.start("A mixture of experts with expert parallelism, checked against one device.", flags,
                              check, steps=3, plant_bug="combine sends the rows back in the order they arrived "
                              "(no inverse of the sort by local expert): must fail")
    if args.plant_bug:
        ep_module.inverse = lambda order: np.arange(len(order))
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                       dropout=args.dropout, num_experts=args.num_experts, moe_router_topk=args.topk,
                       moe_expert_capacity_factor=args.capacity_factor, moe_aux_loss_coeff=args.aux_loss_coeff,
                       moe_z_loss_coeff=args.z_loss_coeff)
    batches = lesson.batches(args, config.block_size)
    # every rank routes its batch / DP rows: the reference routes those groups (DP = the ranks)
    reference = lesson.reference_run(comm, config, batches, args.seed,
                                     routing=RoutingGroups(rows=args.batch_size // comm.size))
    peak = measured_peak(comm, minipar.get_default_dtype())  # all ranks at once (a collective)
    results = {ep: run(args, config, ep, batches, reference, peak) for ep in expert_sizes(args, comm.size)}
    split_ok = uneven_split()

    tol = lesson.TOLERANCE[args.dtype]
    columns = {f"EP={ep}": errors for ep, (errors, _) in results.items()}
    failed = lesson.failed_rows(tol, columns) + [
        "an expert with no rows and an uneven all-to-all-v: slots did not come back to their places"] * (not split_ok)
    h, itemsize, k, E = args.n_embd, np.dtype(args.dtype).itemsize, args.topk, args.num_experts
    expert_whole = args.n_layer * E * mlp_parameters(h) * itemsize
    failed += [f"EP={ep}: the all-to-all-v bytes differ from the routing's" for ep, (_, c) in results.items() if not c["ok"]]
    failed += [f"EP={ep}: a rank holds {c['expert_bytes']:,} expert bytes, not 1/EP of {expert_whole:,}"
               for ep, (_, c) in results.items() if c["expert_bytes"] * ep != expert_whole]

    def report():
        print(f"{comm.size} ranks (DP = {comm.size}); MoE GPT {args.n_layer} layers, {E} experts, top-{k}, "
              + (f"capacity factor {args.capacity_factor}" if args.capacity_factor else "dropless")
              + f", hidden {h}, T={args.block_size}, batch {args.batch_size}, {args.dtype}, dropout {args.dropout}")
        if args.plant_bug:
            print("PLANTED BUG: combine skips the inverse of the sort by local expert")
        ref = reference.routing
        groups = comm.size
        print(f"\n1. routing in the first step (one device, {groups} routing group(s) of {args.batch_size // groups} "
              f"rows x {args.block_size} tokens, as the {groups} ranks route them)")
        for layer, loads, dropped in zip(ref["layers"], ref["tokens_per_expert"], ref["dropped"]):
            print(f"  layer {layer}: slots per expert {' '.join(f'{n:>4}' for n in loads)}   dropped {dropped} of "
                  f"{args.batch_size * args.block_size * k}")
        spread = {name: [max(loads) / np.mean(loads) for loads in r["tokens_per_expert"]]
                  for name, r in (("first", ref), ("last", reference.last_routing))}
        print(f"  busiest expert / mean of the slots kept, per layer: first step {' '.join(f'{x:.2f}' for x in spread['first'])}, "
              f"step {args.steps - 1} {' '.join(f'{x:.2f}' for x in spread['last'])} (1.00: even)")
        print(f"  balancing loss (x {args.aux_loss_coeff}) {ref['aux_loss']:.6f}: an even load gives 1 x the coefficient "
              f"per layer, {args.n_layer * args.aux_loss_coeff:g}")
        print(f"  z-loss (x {args.z_loss_coeff}) {ref['z_loss']:.6f}: equal logits give (ln E)^2 x the coefficient per "
              f"layer, {args.n_layer * np.log(E) ** 2 * args.z_loss_coeff:.6f}")
        print(f"  an expert with no rows and an uneven all-to-all-v: slots come back to their places: "
              f"{'yes' if split_ok else 'NO'}")
        lesson.print_errors(columns, tol,
                            title=f"2. the MoE GPT, {args.steps} AdamW steps through the executor")
        print("\n3. all-to-all-v bytes per rank in the first step, forward + backward, all MoE layers "
              "(worst rank: measured | exact from the routing | uniform router)")
        for ep, (_, costs) in results.items():
            n_local = costs["rows"] * args.block_size
            uniform = args.n_layer * 4 * n_local * k * (ep - 1) / ep * h * itemsize
            print(f"  EP={ep:<2} {costs['sent']:>10,.0f} | {costs['exact']:>10,.0f} | {uniform:>10,.0f}")
        print("  exact: 2 (out + in) h itemsize per layer; uniform: 4 N k (EP-1)/EP h itemsize, N = tokens per rank")
        print(f"\n  expert parameters per rank (all {E} experts: {expert_whole:,} bytes)")
        for ep, (_, costs) in results.items():
            print(f"  EP={ep:<2} {costs['expert_bytes']:>10,.0f} bytes = 1/{expert_whole / costs['expert_bytes']:.0f} "
                  f"of them (1/EP)")
        print(f"\n4. model FLOPs utilisation of the parallel steps (k = {k} experts' FLOPs per token; the first step, "
              "which compares, left out)")
        for ep, (_, costs) in results.items():
            print(f"  EP={ep:<2} {costs['mfu']}")

    return lesson.finish(comm, failed, report, "Expert parallelism equals the single-device mixture of experts, "
                         "and sends what the routing says.")


if __name__ == "__main__":
    lesson.end(main())
