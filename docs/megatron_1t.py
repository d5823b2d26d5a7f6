"""The planner on Megatron-LM's 1T model (Narayanan et al. 2021, Table 1): python docs/megatron_1t.py

128 layers, hidden 25600, 160 heads, sequence 2048, vocabulary 51200, global batch 3072, on 3072
A100s (80 GB, 312 TFLOP/s bf16, 8 per node, NVLink inside, 8 x 200 Gb/s InfiniBand per node).
The paper ran TP 8 x PP 64 x DP 6, micro-batch 1, the interleaved schedule, full recomputation, and
reached 163 TFLOP/s per GPU, 52% of peak, counting its FLOPs as 96 B s l h^2 (1 + s/6h + V/16lh).
"""

from fractions import Fraction

from minipar.plan.cost import flops_per_iteration, predict
from minipar.plan.__main__ import granularity
from minipar.plan.enumerate import plan
from minipar.plan.shapes import PRESETS, Layout, Machine

model, B = PRESETS["megatron-1t"]
l, h, s, V = model.num_layers, model.hidden_size, model.seq_length, model.vocab_size
paper = 96 * B * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(V, 16 * l * h))
model_flops, hardware = flops_per_iteration(model, B, recompute=True)
print(f"FLOPs per iteration: planner {hardware:.6e}, paper's 96 B s l h^2 (1 + s/6h + V/16lh) {float(paper):.6e}, "
      f"equal: {hardware == paper}")
print(f"  (without the recomputed forward: {model_flops:.6e}, the model FLOPs MFU counts)")
machine = Machine(gpus=3072)
papers = Layout(tp=8, pp=64, dp=6, vpp=2, schedule="interleaved", micro_batch_size=1, recompute=True)
p = predict(model, papers, machine, B, "bf16-fp32-grads")
achieved = hardware / p.step_time_s / machine.gpus / 1e12


def row(name, layout, p):
    hw = flops_per_iteration(model, B, layout.recompute, layout.selective)[1]
    per_gpu = hw / p.step_time_s / machine.gpus / 1e12
    print(f"{name:<16} TP {layout.tp} CP {layout.cp} PP {layout.pp} (v {layout.vpp}) DP {layout.dp}, ZeRO {layout.zero_stage}, "
          f"mbs {layout.micro_batch_size}, recompute {granularity(layout)}, SP {layout.sequence_parallel}, {layout.schedule}: "
          f"{p.memory_gb:.1f} GB, step {p.step_time_s:.1f} s, bubble {p.bubble:.3f}, "
          f"{per_gpu:.0f} TFLOP/s per GPU = {per_gpu / machine.peak_tflops:.0%} of peak (MFU {p.mfu:.0%})")
    print(f"{'':<16} exposed communication (s): " + ", ".join(f"{g} {t:.2f}" for g, t in p.comm_s.items()))


print(f"\nat efficiency {machine.efficiency} (the share of peak a GEMM reaches), {machine.inter_node_gbps:g} Gb/s per GPU between nodes:")
row("paper's layout", papers, p)
best = plan(model, machine, B, "bf16-fp32-grads")
row("planner's choice", *best.plans[0])
# the compute efficiency at which the paper's layout would reach the paper's 52%
need = 0.52 * machine.peak_tflops * 1e12
lo, hi = 0.3, 1.0
for _ in range(40):
    mid = (lo + hi) / 2
    q = predict(model, papers, Machine(gpus=3072, efficiency=mid), B, "bf16-fp32-grads")
    lo, hi = (mid, hi) if hardware / q.step_time_s / machine.gpus < need else (lo, mid)
print(f"\nthe paper's 52% needs a GEMM efficiency of {hi:.2f} in this model (at "
      f"{machine.efficiency} it predicts {achieved / machine.peak_tflops:.0%})")
