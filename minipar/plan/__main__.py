"""python -m minipar.plan: which parallelism, when. Every layout of a model on a machine, the
best few with their predicted memory, step time, MFU, bubble and bytes per group, why the rest fail,
and where the rules of thumb agree with the model.

    python -m minipar.plan --preset gpt3-6.7b --gpus 64
    python -m minipar.plan --preset megatron-1t --gpus 3072 --precision bf16 --accumulate-allreduce-grads-in-fp32 --top 3
    python -m minipar.plan --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --global-batch-size 16 --gpus 8 --gpus-per-node 8 --json
"""

import argparse
import json
import sys
from dataclasses import replace

from . import hetero
from .enumerate import as_json, plan
from .shapes import PRECISIONS, PRESETS, Machine, Model

MODEL_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
               "seq_length": "--seq-length", "vocab_size": "--vocab-size", "num_experts": "--num-experts",
               "moe_router_topk": "--moe-router-topk"}


def parser():
    p = argparse.ArgumentParser(prog="python -m minipar.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a published model's shape and global batch")
    for field, flag in MODEL_FLAGS.items():
        p.add_argument(flag, dest=field, type=int, help=f"{field} (overrides the preset)")
    p.add_argument("--global-batch-size", type=int, help="sequences per step")
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


def model_of(args, p):
    """The Model and global batch the flags give: a preset's, with any flag overriding it."""
    base, batch = PRESETS[args.preset] if args.preset else (None, None)
    given = {f: getattr(args, f) for f in MODEL_FLAGS if getattr(args, f) is not None}
    if base is None:
        missing = [MODEL_FLAGS[f] for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length") if f not in given]
        if missing:
            p.error(f"give --preset or {', '.join(missing)}")
        base = Model(**{f: given.pop(f) for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")})
    batch = args.global_batch_size or batch
    if batch is None:
        p.error("give --global-batch-size (or a --preset)")
    bad = [f"{MODEL_FLAGS.get(f, f)} {v}" for f, v in given.items() if v < (0 if f == "num_experts" else 1)]
    if bad or batch < 1 or args.gpus < 1:
        p.error(f"sizes must be positive: {', '.join(bad) or 'the batch or --gpus'}")
    return replace(base, **given), batch


def precision_of(args, p):
    """The PRECISIONS key the flags name: bf16, or bf16-fp32-grads with --accumulate-allreduce-grads-in-fp32."""
    if args.accumulate_allreduce_grads_in_fp32 and args.precision != "bf16":
        p.error("--accumulate-allreduce-grads-in-fp32 is for --precision bf16")
    return "bf16-fp32-grads" if args.accumulate_allreduce_grads_in_fp32 else args.precision


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
    kind = prediction.links.get("dp_cp" if best.cp > 1 else "dp")  # None: DP = 1 sends nothing
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
        lines.append("ZeRO before PP when memory allows: memory does not allow: no layout without a pipeline fits")
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
                    f"{100 * p.mfu:>6.1f}%{p.bubble:>8.3f}  {groups}")
    return "\n".join(rows)


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    model, batch = model_of(args, p)
    negative = [f for f in ("layer_overhead_us", "edge_overhead_us", "call_overhead_us", "cores_per_node") if getattr(args, f) < 0]
    if negative:
        p.error(f"must not be negative: {', '.join('--' + f.replace('_', '-') for f in negative)}")
    machine = Machine(args.gpus, args.gpus_per_node, args.gpu_memory_gb, args.peak_tflops, args.intra_node_gbps,
                      args.inter_node_gbps, efficiency=args.efficiency, layer_overhead_us=args.layer_overhead_us,
                      edge_overhead_us=args.edge_overhead_us, call_overhead_us=args.call_overhead_us,
                      cores_per_node=args.cores_per_node)
    precision = precision_of(args, p)
    result = plan(model, machine, batch, precision)
    if args.json:
        print(json.dumps([as_json(layout, prediction) for layout, prediction in result.plans[:args.top]], indent=1))
        return 0 if result.plans else 1
    tried = len(result.plans) + sum(result.failures.values())
    print(f"{model}\nglobal batch {batch}, {precision} ({PRECISIONS[precision]}); {machine}")
    print(f"\n{tried:,} layouts tried: {len(result.plans):,} fit; the best {min(args.top, len(result.plans))}:")
    print(table(result, args.top))
    print("\nwhy the rest fail (layouts, one example each):")
    for key, count in result.failures.most_common():
        print(f"  {count:>7,}  {result.examples[key]}")
    print("\nrules of thumb against the model:")
    for line in rules_of_thumb(result, machine):
        print(f"  {line}")
    if args.node_speeds:
        heterogeneous(result, machine, model, batch, args.node_speeds, p)
    return 0 if result.plans else 1


def heterogeneous(result, machine, model, batch, text, p):
    """The fastest pipelined plan's layers balanced over its stages' speeds, and the bubble saved."""
    try:
        speeds = [float(x) for x in text.split(",")]
    except ValueError:
        p.error(f"--node-speeds {text}: give numbers separated by commas")
    piped = [lp for lp in result.plans if lp[0].pp > 1]
    if not piped:
        print("\nheterogeneous GPUs: no plan has a pipeline to balance")
        return
    layout = piped[0][0]
    try:
        stage = hetero.stage_speeds(layout, machine.gpus_per_node, speeds)
    except ValueError as exc:
        p.error(f"--node-speeds: {exc}")
    m = batch // layout.dp // layout.micro_batch_size
    out = hetero.compare(model.num_layers, stage, m)
    print(f"\nheterogeneous GPUs: the fastest pipelined plan (PP={layout.pp}), stage speeds {stage}, {m} micro-batches, 1F1B")
    for name, (layers, makespan, bub) in out.items():
        print(f"  {name:<9} layers per stage {layers}: step {float(makespan):.4g} layer-forward units, bubble {float(bub):.3f}")
    saved = float(1 - out["balanced"][1] / out["even"][1])
    print(f"  balancing saves {saved:.1%} of the step (bubble {float(out['even'][2]):.3f} -> {float(out['balanced'][2]):.3f})")
    print(f"  to run it: python -m minipar.train --pp {len(out['balanced'][0])} --pipeline-layers "
          f"{','.join(map(str, out['balanced'][0]))} ...")


if __name__ == "__main__":
    sys.exit(main())
