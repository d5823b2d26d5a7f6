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

The peak is measured, not looked up: every rank times the same matrix product with the kernel the
model uses (``backend.matmul``: BLAS, or minipar's GEMM on a GPU), all ranks at once, so ranks
that share cores share them here too; the machine's peak is the sum. MFU is then
(FLOPs per token x tokens per second) / that sum.
"""

import time

import numpy

from minipar.backend import matmul, on_gpu, xp


def flops_per_token(n_layer, n_embd, block_size, vocab_size):
    """Training FLOPs (forward and backward) per token of the GPT's shape; see the module docstring."""
    L, h, T, V = n_layer, n_embd, block_size, vocab_size
    return 72 * L * h * h + 12 * L * T * h + 6 * V * h


def _synchronize():
    if on_gpu():
        xp.cuda.get_current_stream().synchronize()


def measured_peak(world, dtype, n=None, repeats=5):
    """FLOP/s of this machine's matrix products, the sum over ``world``'s ranks of each one's best
    of ``repeats`` n x n x n products, timed together (a collective). ``n``: 512 on a CPU core,
    which that size already keeps busy; 4096 on a GPU, where a 512 product fills few of the SMs
    and would understate the peak (and so overstate MFU) about twentyfold."""
    n = n or (4096 if on_gpu() else 512)
    a = xp.asarray(numpy.random.default_rng(0).standard_normal((n, n)), dtype)
    out = xp.empty_like(a)
    matmul(a, a, out=out)  # the first call compiles or warms up
    world.barrier()
    best = float("inf")
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        matmul(a, a, out=out)
        _synchronize()
        best = min(best, time.perf_counter() - start)
    return float(world.all_reduce(numpy.array([2.0 * n**3 / best]))[0])
