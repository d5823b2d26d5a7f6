"""python -m minipar.plan: which parallelism, when. Every layout of a model on a machine, the
best few with their predicted memory, step time, MFU, bubble and bytes per group, why the rest fail,
and where the rules of thumb agree with the model.

    python -m minipar.plan --preset gpt3-6.7b --gpus 64
    python -m minipar.plan --preset megatron-1t --gpus 3072 --precision bf16 --accumulate-allreduce-grads-in-fp32 --top 3
    python -m minipar.plan --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --global-batch-size 16 --gpus 8 --gpus-per-node 8 --json
"""

import json
import math
import sys
from dataclasses import replace

from minipar.cli import Parser, parse
from minipar.parallel import validate

from .commands import heterogeneous
from .enumerate import FLAGS, as_json, plan
from .shapes import PRECISIONS, PRESETS, Machine, Model, run_config

MODEL_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
               "seq_length": "--seq-length", "vocab_size": "--vocab-size", "num_experts": "--num-experts",
               "moe_router_topk": "--moe-router-topk"}


def parser():
    p = Parser(prog="python -m minipar.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a published model's shape and global batch")
    for field, flag in MODEL_FLAGS.items():
        p.add_argument(flag, dest=field, type=int, help=f"{field} (overrides the preset)")
    p.add_argument("--global-batch-size", type=int, help="sequences per step")
    p.add_argument("--dropout", type=float, help="dropout probability, as the trainer's --dropout (Megatron's "
                   "--hidden-dropout and --attention-dropout at once; default: the preset's, else 0): its masks and "
                   "outputs are activations")
    p.add_argument("--precision", choices=("float32", "float64", "bf16"), default="float32",
                   help="float32/float64: one dtype; bf16: mixed precision as minipar's --bf16 (2 + 2 + 12 bytes "
                   "of state per parameter)")
    p.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="with bf16: fp32 gradients (2 + 4 + 12 bytes per parameter), as the trainer's flag and Megatron's")
    p.add_argument("--gpus", type=int, required=True)
    defaults = Machine(gpus=1)
    for flag, field in (("--gpus-per-node", "gpus_per_node"), ("--gpu-memory-gb", "gpu_memory_gb"),
                        ("--peak-tflops", "peak_tflops"), ("--intra-node-gbps", "intra_node_gbps"),
                        ("--inter-node-gbps", "inter_node_gbps"), ("--efficiency", "efficiency"),
                        ("--layer-overhead-us", "layer_overhead_us"), ("--edge-overhead-us", "edge_overhead_us"),
                        ("--call-overhead-us", "call_overhead_us"), ("--ring-pass-overhead-us", "ring_pass_overhead_us"),
                        ("--cores-per-node", "cores_per_node")):
        kind = int if field in ("gpus_per_node", "cores_per_node") else float
        p.add_argument(flag, dest=field, type=kind, default=getattr(defaults, field), help="default %(default)s")
    p.add_argument("--node-speeds", help="each node's relative speed, comma-separated (heterogeneous GPUs): "
                   "balance the fastest pipelined plan's layers over its stages")
    p.add_argument("--top", type=int, default=5, help="plans to print")
    p.add_argument("--json", action="store_true", help="print the ranked plans as JSON")
    return p


# the most the planner takes: it counts every block of every layout it tries (1,024 blocks: ~5 s)
# and every expert of a block (8 layers of 4,096 experts on 8 GPUs: ~30 s, 310 s before the layouts
# shared their counts; 10^20 raised an OverflowError), and walks a long pipeline's schedule
# micro-batch by micro-batch (a global batch of 10^6: ~50 s and 1.1 GB; 65,536: 4.3-4.9 s on a small model, 8 GPUs); run_mpi.sh's
# limit on ranks
MAX_LAYERS, MAX_EXPERT_BLOCKS, MAX_BATCH, MAX_GPUS = 1024, 16_384, 65_536, 1_000_000
MAX_SPEED_RATIO = 1e6
MAX_OVERHEAD_US = 1e9  # 1,000 s per layer, message or call: beyond any measured overhead, and
# far enough below the float range that the step times built from it stay finite
POSITIVE = ("gpu_memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps")
NOT_NEGATIVE = ("layer_overhead_us", "edge_overhead_us", "call_overhead_us", "ring_pass_overhead_us")


def flag(field):
    return "--" + field.replace("_", "-")


def model_of(args):
    """(problems, Model, global batch): a preset's, with any flag overriding it."""
    base, batch = PRESETS[args.preset] if args.preset else (None, None)
    given = {f: getattr(args, f) for f in MODEL_FLAGS if getattr(args, f) is not None}
    found = [f"{MODEL_FLAGS[f]} must be >= {low}, got {given[f]}" for f in given
             for low in [0 if f == "num_experts" else 1] if given[f] < low]
    if given.get("num_layers", 0) > MAX_LAYERS:
        found.append(f"--num-layers {given['num_layers']}: the planner takes at most {MAX_LAYERS:,} blocks")
    experts = given.get("num_experts", base.num_experts if base else 0)
    layers = given.get("num_layers", base.num_layers if base else 1)
    if layers * experts > MAX_EXPERT_BLOCKS and layers <= MAX_LAYERS:
        found.append(f"--num-experts {experts} in each of {layers} layers: the planner counts at most "
                     f"{MAX_EXPERT_BLOCKS:,} experts in all (layers x experts)")
    topk = given.get("moe_router_topk", base.moe_router_topk if base else 2)
    if "moe_router_topk" in given and not experts:
        found.append(f"--moe-router-topk {topk} routes to experts, and this model has none: "
                     "give --num-experts, or drop it")
    if base is None:
        missing = [MODEL_FLAGS[f] for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length") if f not in given]
        if missing:
            return found + [f"give --preset or {', '.join(missing)}"], None, None
        base = Model(**{f: given.pop(f) for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")})
    if args.global_batch_size is not None:
        batch = args.global_batch_size
        if batch < 1:
            found.append(f"--global-batch-size must be >= 1, got {batch}")
        elif batch > MAX_BATCH:
            found.append(f"--global-batch-size {batch}: the planner takes at most {MAX_BATCH:,} sequences a step")
    if batch is None:
        found.append("give --global-batch-size (or a --preset)")
    if args.dropout is not None:  # checked below, by the trainer's rule
        given["dropout"] = args.dropout
    model = replace(base, **given)
    if not found:  # the model's own rules (heads that split it, top-k of the experts), as the trainer words them
        found = validate.problems(model_config(model), FLAGS)
    return found, model, batch


def model_config(model):
    """The ``validate.RunConfig`` of the model alone: what no layout can change."""
    experts = model.num_experts or None
    return validate.RunConfig(n_layer=model.num_layers, n_head=model.num_attention_heads, n_embd=model.hidden_size,
                              block_size=model.seq_length, vocab_size=model.vocab_size, dropout=model.dropout,
                              num_experts=experts,
                              moe_router_topk=model.moe_router_topk if experts else None,
                              moe_layer_freq=model.moe_layer_freq if experts else None)


def machine_of(args):
    """(problems, Machine): every figure of the machine a number the cost model can divide by."""
    found = [] if 1 <= args.gpus <= MAX_GPUS else [f"--gpus must be 1 to {MAX_GPUS:,}, got {args.gpus}"]
    found += [f"--gpus-per-node must be >= 1, got {args.gpus_per_node}"] * (args.gpus_per_node < 1)
    found += [f"--cores-per-node must be >= 0 (0: a core per rank), got {args.cores_per_node}"] * (args.cores_per_node < 0)
    found += [f"{flag(f)} must be a finite number > 0, got {getattr(args, f)}" for f in POSITIVE
              if not 0 < getattr(args, f) < math.inf]
    found += [f"{flag(f)} must be a finite number >= 0, got {getattr(args, f)}" for f in NOT_NEGATIVE
              if not 0 <= getattr(args, f) < math.inf]
    found += [f"{flag(f)} {getattr(args, f):g} is more than {MAX_OVERHEAD_US:g} us ({MAX_OVERHEAD_US / 1e6:,.0f} s): give "
              "a measured overhead, in microseconds" for f in NOT_NEGATIVE if MAX_OVERHEAD_US < getattr(args, f) < math.inf]
    if not 0 < args.efficiency <= 1:
        found.append(f"--efficiency is the share of the peak the kernels reach: in (0, 1], got {args.efficiency}")
    elif not found and args.peak_tflops * 1e12 * args.efficiency < 1:  # a step of the cost model's would be inf s
        found.append(f"--peak-tflops {args.peak_tflops} x --efficiency {args.efficiency} is less than 1 FLOP/s: "
                     "give a GPU's figures")
    found += [f"{flag(f)} {getattr(args, f)} is less than 1 byte/s: give a link's figure"
              for f in ("intra_node_gbps", "inter_node_gbps") if 0 < getattr(args, f) * 1e9 / 8 < 1]
    fields = ("gpus_per_node", "gpu_memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps", "efficiency",
              "cores_per_node") + NOT_NEGATIVE
    return found, (None if found else Machine(args.gpus, **{f: getattr(args, f) for f in fields}))


def speeds_of(args):
    """(problems, each node's relative speed or None): checked before anything is planned."""
    if not args.node_speeds:  # ('' too: not given, as the trainer's empty paths)
        return [], None
    if args.json:
        return ["--node-speeds adds a table to the printed plans, and --json prints them as JSON: give one"], None
    try:
        speeds = [float(x) for x in args.node_speeds.split(",")]
    except ValueError:
        return [f"--node-speeds {args.node_speeds!r}: give numbers separated by commas"], None
    if not all(0 < x < math.inf for x in speeds):
        return [f"--node-speeds {args.node_speeds}: each speed must be a finite number > 0"], None
    if max(speeds) > MAX_SPEED_RATIO * min(speeds):  # (1e-320 made a step of 6e+320 units: no float)
        return [f"--node-speeds {args.node_speeds}: the fastest node is more than {MAX_SPEED_RATIO:.0e} times "
                "the slowest; give relative speeds (1,0.5 for a node half as fast)"], None
    if args.gpus < 1 or args.gpus_per_node < 1:  # refused already: no count of nodes to hold them to
        return [], None
    nodes = -(-args.gpus // args.gpus_per_node)
    if len(speeds) != nodes:
        return [f"--node-speeds gives {len(speeds)} speed{'s' * (len(speeds) > 1)}, and --gpus {args.gpus} at "
                f"--gpus-per-node {args.gpus_per_node} make {nodes} node{'s' * (nodes > 1)}: give one speed per node"], None
    return [], speeds


def problems(args):
    """Every problem of the flags, one line each; fills in args.model, args.batch, args.machine,
    args.speeds and args.precision_key for ``main``."""
    found, args.model, args.batch = model_of(args)
    wrong, args.machine = machine_of(args)
    more, args.speeds = speeds_of(args)
    found += wrong + more
    if args.top < 1:
        found.append(f"--top must be >= 1, got {args.top}")
    if args.accumulate_allreduce_grads_in_fp32 and args.precision != "bf16":
        found.append("--accumulate-allreduce-grads-in-fp32 is for --precision bf16")
    # the PRECISIONS key: bf16, or bf16-fp32-grads with --accumulate-allreduce-grads-in-fp32
    args.precision_key = "bf16-fp32-grads" if args.accumulate_allreduce_grads_in_fp32 else args.precision
    return found


def rules_of_thumb(result, machine):
    """Each rule of thumb beside what the model chose, one line each."""
    if not result.plans:
        return []
    best, prediction = result.plans[0]
    lines = [f"TP inside a node: {'agrees' if best.tp <= machine.gpus_per_node else 'disagrees'} "
             f"(TP={best.tp}, {machine.gpus_per_node} GPUs per node; the planner refuses TP across nodes)"]
    if best.pp > 1:
        kind = prediction.links.get("pp", "inter")
        lines.append(f"PP across nodes: {'agrees' if kind == 'inter' else 'the pipeline fits in a node here'} (PP={best.pp}, {kind}-node)")
    else:
        lines.append("PP across nodes: no pipeline needed: the model fits without one")
    # DP's gradients go over DP x CP ("dp_cp" when CP > 1); with DP = 1 that group is CP's alone
    kind = prediction.links.get("dp_cp" if best.cp > 1 else "dp") if best.dp > 1 else None
    if kind is None:
        lines.append(f"DP outermost (DP scales out across nodes): no data parallelism here (DP={best.dp})")
    else:
        verdict = "agrees" if kind == "inter" or machine.gpus <= machine.gpus_per_node else (
            "disagrees: the model keeps DP inside a node and lets the pipeline cross nodes")
        lines.append(f"DP outermost (DP scales out across nodes): DP={best.dp}, its group {kind}-node: {verdict}")
    zero = [p for p in result.plans if p[0].pp == 1 and p[0].zero_stage > 0]
    piped = [p for p in result.plans if p[0].pp > 1]
    if zero and piped:
        z, pp = zero[0], piped[0]
        faster = "ZeRO" if z[1].step_time_s <= pp[1].step_time_s else "PP"
        lines.append(f"ZeRO before PP when memory allows: the model {'agrees' if faster == 'ZeRO' else 'disagrees'}: fastest "
                     f"ZeRO-{z[0].zero_stage} without a pipeline {z[1].step_time_s:.3g} s, fastest with PP={pp[0].pp} "
                     f"{pp[1].step_time_s:.3g} s")
    elif piped and not zero:
        lines.append("ZeRO before PP when memory allows: nothing to compare: no ZeRO layout without a pipeline is "
                     "both valid and within memory (the reasons above say which)")
    return lines


def granularity(layout):
    """Megatron's --recompute-granularity of a layout, or none."""
    return "full" if layout.recompute else "selective" if layout.selective_recompute else "none"


def table(result, top):
    rows = [f"{'TP':>3}{'CP':>3}{'PP':>4}{'v':>3}{'DP':>5}{'EP':>3} {'ZeRO':>4}{'mbs':>4} {'recompute':>9} {'SP':>3}"
            f" {'schedule':<11}{'GB':>8}{'step s':>10}{'MFU':>7}{'bubble':>8}  bytes per group (GB)"]
    for layout, p in result.plans[:top]:
        groups = ", ".join(f"{g} {b / 1e9:.3g} ({p.links[g]})" for g, b in p.bytes_per_group.items())
        rows.append(f"{layout.tp:>3}{layout.cp:>3}{layout.pp:>4}{layout.vpp:>3}{layout.dp:>5}{layout.ep:>3} "
                    f"{layout.zero_stage:>4}{layout.micro_batch_size:>4} {granularity(layout):>9} "
                    f"{'yes' if layout.sequence_parallel else 'no':>3} {layout.schedule if layout.pp > 1 else '-':<11}{p.memory_gb:>8.2f}{p.step_time_s:>10.4g}"
                    f"{100 * p.mfu:>6.1f}%{p.bubble:>8.3f}  {groups}"
                    + (f"; --pipeline-layers {','.join(map(str, layout.pipeline_layers))}" if layout.pipeline_layers else ""))
    return "\n".join(rows)


def main(argv=None):
    args = parse(parser(), None, problems, argv)  # a problem: one line each, exit status 2
    model, batch, machine, precision = args.model, args.batch, args.machine, args.precision_key
    result = plan(model, machine, batch, precision)
    tried = len(result.plans) + sum(result.failures.values())
    if args.json:
        print(json.dumps([as_json(layout, prediction) for layout, prediction in result.plans[:args.top]], indent=1))
        if not result.plans:  # the JSON is an empty list: the reasons go where a person reads them
            print(f"python -m minipar.plan: no layout fits: {tried:,} tried; why (layouts, one example each):",
                  *failures(result), sep="\n", file=sys.stderr)
        return 0 if result.plans else 1
    print(f"{model}\nglobal batch {batch}, {precision} ({PRECISIONS[precision]}); {machine}")
    print(f"\n{tried:,} layouts tried: {len(result.plans):,} fit; the best {min(args.top, len(result.plans))}:")
    print(table(result, args.top))
    untagged = [i + 1 for i, (layout, _) in enumerate(result.plans[:args.top]) if tags_refused(model, layout, batch)]
    if untagged:  # planned all the same (enumerate.plan's docstring): minipar's bound, not the layout's
        print(f"  minipar's trainer refuses plan{'s' * (len(untagged) > 1)} {', '.join(map(str, untagged))} as listed: "
              "its pipeline tags each message by micro-batch and chunk, more tags than MPI promises; a larger "
              f"micro-batch (fewer of them) runs {'them' if len(untagged) > 1 else 'it'}")
    print("\nwhy the rest fail (layouts, one example each):", *failures(result), sep="\n")
    print("\nrules of thumb against the model:")
    for line in rules_of_thumb(result, machine):
        print(f"  {line}")
    if args.speeds:
        heterogeneous(result, machine, model, batch, args.speeds, precision)
    return 0 if result.plans else 1


def tags_refused(model, layout, batch):
    """Whether ``python -m minipar.train`` refuses ``layout`` for its pipeline's message tags alone."""
    return any("message tags" in p for p in validate.problems(run_config(model, layout, batch), FLAGS))


def failures(result):
    """A line per reason layouts failed for, the most common first: how many, and one example."""
    return [f"  {count:>7,}  {result.examples[key]}" for key, count in result.failures.most_common()]


if __name__ == "__main__":
    sys.exit(main())
