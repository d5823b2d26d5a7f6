"""The worked memory and communication budget of docs/3d_parallel.md: python docs/worked_budget.py

A GPT of minipar's architecture at GPT-3 6.7B's shape (32 layers, hidden 4096, 32 heads, context
2048, GPT-2's vocabulary) on 64 GPUs (8 nodes of 8), as TP=8 x PP=4 x DP=2 with ZeRO-1, micro-batches
of one sequence, a global batch of 256 sequences, fp32 values and AdamW (minipar's precision).
"""

L, h, a, s, V = 32, 4096, 32, 2048, 50257
t, p, d = 8, 4, 2
global_batch, b = 256, 1
BYTES = 4

P = V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h
m = global_batch // d // b  # micro-batches per pipeline per step
S = b * s * h * BYTES  # one micro-batch's activation at a stage boundary
per_gpu = P / (t * p)  # parameters a GPU holds (blocks split by PP, matrices by TP)


def gb(x):
    return f"{x / 1e9:,.2f} GB"


print(f"P = {P / 1e9:.2f} B parameters; {P / (t * p) / 1e6:,.0f} M of them on each GPU; m = {m} micro-batches")
print("\nmemory per GPU")
print(f"  weights + gradients + Adam m, v, no ZeRO   16 x P/(t p)           = {gb(16 * per_gpu)}")
print(f"  with ZeRO-1 over DP={d}                     (8 + 8/d) x P/(t p)    = {gb((8 + 8 / d) * per_gpu)}")
act_16bit = s * b * h * (34 + 5 * a * s / h)  # Korthikanti et al. 2022, per layer, 16-bit values
held = p  # 1F1B: the first stage holds p micro-batches
layers = L // p
print(f"  activations, 1F1B on the first stage: {held} micro-batches x {layers} layers x sbh(34 + 5as/h)/t (TP + SP)")
print(f"    with the paper's 16-bit count                                   = {gb(held * layers * act_16bit / t)}")
print(f"    minipar keeps values in 4 bytes (dropout masks 1): about 2x     ~ {gb(2 * held * layers * act_16bit / t)}")
print(f"    with full recompute, only each layer's input, sbh x 4 / t       = {gb(held * layers * S / t)}")
print("\nbytes each GPU sends per step")
tp_bytes = 4 * 2 * (t - 1) / t * S * layers * m  # 4 all-reduces of S per layer per micro-batch
pp_bytes = 2 * S * m  # one activation forward and one gradient back per micro-batch (a middle stage)
dp_bytes = 2 * (d - 1) / d * BYTES * per_gpu  # ZeRO-1: reduce-scatter + all-gather of the gradients
print(f"  TP: 4 all-reduces per layer per micro-batch, 8(t-1)/t S each layer  = {gb(tp_bytes)}  (NVLink, in a node)")
print(f"  PP: an activation and a gradient per micro-batch, 2 S m            = {gb(pp_bytes)}  (network, between nodes)")
print(f"  DP: ZeRO-1 reduce-scatter + all-gather, 2(d-1)/d x 4P/(t p)        = {gb(dp_bytes)}  (network, once per step)")
flops = 6 * P * global_batch * s / (t * p * d)
print(f"\ncompute per GPU per step: 6 P tokens / GPUs = {flops / 1e12:,.0f} TFLOP")
for name, nbytes, bandwidth in (("TP on NVLink (300 GB/s, assumed)", tp_bytes, 300e9),
                                ("TP if it crossed nodes (25 GB/s)", tp_bytes, 25e9),
                                ("PP between nodes (25 GB/s, assumed)", pp_bytes, 25e9),
                                ("DP between nodes (25 GB/s, assumed)", dp_bytes, 25e9)):
    print(f"  {name:<38} {nbytes / bandwidth:6.2f} s")
print(f"bubble (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f}")
