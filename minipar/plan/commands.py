"""The trainer's command for a plan (``train_flags``), and the planner's heterogeneous-GPU section,
which prints one: the fastest plan with a pipeline, its layers balanced over its stages' speeds
(``hetero.balance``, the head counted), what balancing saves by the schedule simulator, and the
``python -m minipar.train`` flags that run it."""

from dataclasses import replace

from minipar.parallel import validate

from . import hetero
from .cost import predict
from .enumerate import FLAGS
from .shapes import run_config


def heterogeneous(result, machine, model, batch, speeds, precision="float32"):
    """The fastest plan with one chunk per pipeline stage, its layers balanced over its stages'
    speeds, the bubble saved, and the trainer's command that runs it."""
    piped = [lp[0] for lp in result.plans if lp[0].pp > 1 and lp[0].vpp == 1]
    if not piped:
        print("\nheterogeneous GPUs: no plan has a pipeline of one chunk per stage to balance")
        return
    # the plans leave out MPI's tag limit (enumerate.py); the trainer, and the schedules simulated here, do not
    why = {layout: validate.problems(run_config(model, layout, batch), FLAGS) for layout in piped}
    runnable = [layout for layout in piped if not why[layout]]
    if not runnable:
        print(f"\nheterogeneous GPUs: no plan with a pipeline of one chunk per stage that the trainer can run: "
              f"the fastest, PP={piped[0].pp}: {why[piped[0]][0]}")
        return
    layout = runnable[0]
    stage = hetero.stage_speeds(layout, machine.gpus_per_node, speeds)  # (a speed per node: checked)
    m = batch // layout.dp // layout.micro_batch_size
    head = hetero.head_in_blocks(model, layout.recompute)
    out = hetero.compare(model.num_layers, stage, m, layout.schedule, head)  # the head too: the last stage's extra
    print(f"\nheterogeneous GPUs: the fastest plan with a pipeline of one chunk per stage (PP={layout.pp}), "
          f"stage speeds {stage}, {m} micro-batches, {layout.schedule}")
    for name, (layers, makespan, bub) in out.items():
        print(f"  {name:<9} layers per stage {layers}: step {float(makespan):.4g} layer-forward units, bubble {float(bub):.3f}")
    saved = float(1 - out["balanced"][1] / out["even"][1])
    print(f"  balancing saves {saved:.1%} of the step (bubble {float(out['even'][2]):.3f} -> {float(out['balanced'][2]):.3f})")
    # the fuller stages hold more layers' state and activations than the plan counted for the even split
    memory = predict(model, replace(layout, pipeline_layers=tuple(out["balanced"][0])), machine, batch, precision).memory_gb
    if memory > machine.gpu_memory_gb:
        print(f"  but the balanced split needs {memory:.3g} GB on its fullest GPU, more than its {machine.gpu_memory_gb:g} "
              "GB: it needs recomputation, ZeRO or a longer pipeline first")
        return
    print(f"  memory {memory:.3g} GB on the fullest GPU (of {machine.gpu_memory_gb:g}); to run it on "
          f"{layout.world_size} ranks: ./run_mpi.sh -n {layout.world_size} -m minipar.train "
          f"{train_flags(model, layout, batch, out['balanced'][0], precision)}")


# the trainer's flags that run a plan's precision (shapes.PRECISIONS' keys)
PRECISION_FLAGS = {"float32": "", "float64": "--dtype float64", "bf16": "--bf16",
                   "bf16-fp32-grads": "--bf16 --accumulate-allreduce-grads-in-fp32"}


def train_flags(model, layout, batch, layers, precision="float32"):
    """The trainer's flags for ``model`` on ``layout`` with ``layers`` per pipeline stage, in
    ``precision`` (DP is what the ranks leave)."""
    flags = [f"--n-layer {model.num_layers} --n-embd {model.hidden_size} --n-head {model.num_attention_heads} "
             f"--block-size {model.seq_length} --vocab-size {model.vocab_size} --dropout {model.dropout}"]
    if model.num_experts:
        flags.append(f"--num-experts {model.num_experts} --moe-router-topk {model.moe_router_topk} "
                     f"--moe-layer-freq {model.moe_layer_freq}")
        if model.moe_expert_capacity_factor is not None:
            flags.append(f"--moe-expert-capacity-factor {model.moe_expert_capacity_factor}")
    flags += [f"--{name} {value}" for name, value in (("tp", layout.tp), ("cp", layout.cp), ("ep", layout.ep)) if value > 1]
    flags.append(f"--pp {layout.pp} --pipeline-layers {','.join(map(str, layers))} --schedule {layout.schedule} "
                 f"--global-batch-size {batch} --micro-batch-size {layout.micro_batch_size}")
    if layout.cp > 1:
        flags.append(f"--cp-comm-type {layout.cp_comm_type}")
    if layout.zero_stage:
        flags.append(f"--zero-stage {layout.zero_stage}")
    if layout.sequence_parallel:
        flags.append("--sequence-parallel")
    if layout.recompute or layout.selective_recompute:
        flags.append(f"--recompute-granularity {'full' if layout.recompute else 'selective'}")
    if layout.defer_embedding_wgrad:
        flags.append("--defer-embedding-wgrad-compute")
    if layout.defer_wgrad_linears:
        flags.append(f"--defer-wgrad-linears {layout.defer_wgrad_linears}")
    return " ".join(flags + [PRECISION_FLAGS[precision]] * bool(PRECISION_FLAGS[precision]))
