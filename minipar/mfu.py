"""Model FLOPs utilisation (MFU): the share of the machine's arithmetic a training run turns into
the model's own FLOPs (Chowdhery et al. 2022, PaLM, appendix B).

The model's FLOPs per token come from its shape alone. A forward pass multiplies every token by
each weight matrix once, 2 FLOPs per weight: 24 L h^2 for the blocks' four attention and two MLP
matrices and 2 V h for the tied output head. Attention adds q k^T and P v, 2 x 2 T h per layer
(counted for the whole T x T square, as Megatron-LM counts it, though the causal half is
skipped). Backward costs twice the forward, so per token of training

    6 (12 L h^2 + V h) + 12 L T h  =  72 L h^2 (1 + T/(6h) + V/(12 L h))

which is Narayanan et al. (2021)'s formula without recomputation (with it, 96 instead of 72: the
recomputed forward is hardware work, not model work, so it raises HFU but not MFU).

A mixture-of-experts block runs each token through k experts shaped like the MLP (2 x 8 h^2 FLOPs
each forward) and its router (2 h E): per MoE layer 48 (k - 1) h^2 + 6 E h more than a dense block
in training. The experts a token skips are not its FLOPs: MFU counts the active parameters.

The peak is measured, not looked up: every rank runs the same matrix products with the kernel the
model uses (``backend.matmul``: BLAS, or minipar's GEMM on a GPU), all ranks at once between two
barriers, and the peak is all of that work over the time it took. Timing the block as a whole
matters when ranks share cores: a rank's fastest single product comes when the others happen to
be idle, so adding each rank's best would count a shared core once per rank (8 ranks on 2 cores
measured four times the cores' rate that way). MFU is then (FLOPs per token x tokens per second)
/ that peak. The trainer measures it again at each evaluation and before each progress line, and
keeps the highest: other work on the machine only slows a measurement, and a peak taken while the
machine was busy once gave an MFU of 252%.
"""

import time

import numpy

from minipar.backend import matmul, on_gpu, xp


def flops_per_token(n_layer, n_embd, block_size, vocab_size, moe_layers=0, top_k=1, n_experts=0):
    """Training FLOPs (forward and backward) per token of the GPT's shape; see the module docstring."""
    L, h, T, V = n_layer, n_embd, block_size, vocab_size
    experts = moe_layers * (48 * (top_k - 1) * h * h + 6 * n_experts * h)
    return 72 * L * h * h + 12 * L * T * h + 6 * V * h + experts


def model_flops_per_token(config):
    """``flops_per_token`` of a GPTConfig (its mixture-of-experts blocks included)."""
    moe_layers = sum(config.is_moe(i) for i in range(config.n_layer))
    return flops_per_token(config.n_layer, config.n_embd, config.block_size, config.vocab_size, moe_layers,
                           config.moe_router_topk, config.num_experts)


def _synchronize():
    if on_gpu():
        xp.cuda.get_current_stream().synchronize()


def measured_peak(world, dtype, n=None, repeats=3, rounds=3):
    """FLOP/s of this machine's matrix products: every rank of ``world`` runs ``repeats`` n x n x n
    products between two barriers, and the fastest of ``rounds`` such blocks (by its slowest
    rank) gives world.size x repeats x 2 n^3 FLOPs over its time (a collective). ``n``: 512 on a
    CPU core, which that size already keeps busy; 4096 on a GPU, where a 512 product fills few of
    the SMs and would understate the peak (and so overstate MFU) about twentyfold."""
    n = n or (4096 if on_gpu() else 512)
    a = xp.asarray(numpy.random.default_rng(0).standard_normal((n, n)), dtype)
    out = xp.empty_like(a)
    matmul(a, a, out=out)  # the first call compiles or warms up
    best = float("inf")
    for _ in range(rounds):
        world.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            matmul(a, a, out=out)
        _synchronize()
        world.barrier()  # the block ends when the last rank is done
        best = min(best, time.perf_counter() - start)
    slowest = float(world.all_reduce(numpy.array([best]), op="max")[0])
    return world.size * repeats * 2.0 * n**3 / slowest
