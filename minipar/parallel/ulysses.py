"""DeepSpeed-Ulysses (Jacobs et al. 2023): context parallelism by trading a shard of the sequence
for a shard of the heads.

Attention mixes tokens but not heads. So one all-to-all turns each rank's T/N tokens of all H
heads into all T tokens of H/N heads; every rank then runs ordinary causal attention on its heads
over the whole sequence (the single-device fused op), and a second all-to-all turns the heads'
outputs back into the rank's tokens. The all-to-all is its own inverse, so backward is the same two
exchanges in reverse order (``collectives.all_to_all``).

Bytes sent per rank per forward: (N-1)/N of the local qkv (B, T/N, 3C) and of the local output
(B, T/N, C), 4 (N-1)/N B (T/N) C elements, which falls as 1/N for a fixed sequence, where the
ring's (N-1) K,V blocks, 2 (N-1) B (T/N) C elements, do not. The price: N must divide the number
of heads, and each rank holds the whole sequence of its heads.
"""

import numpy

import minipar.functional as F
from minipar.autograd import Function
from minipar.backend import xp
from minipar.parallel.collectives import all_to_all


class Reorder(Function):
    """x[:, order], the tokens of (B, T, W) permuted; the gradient goes back by the inverse
    permutation (a gather, where indexing's backward would scatter-add)."""

    @staticmethod
    def forward(ctx, x, order):
        ctx.inverse = xp.asarray(numpy.argsort(order))
        return x[:, xp.asarray(order)]

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.inverse], None


def ulysses(qkv, n_head, group, positions, dropout_p, key, rows, head_offset, recompute=False):
    """``qkv`` (B, T_local, 3C) of this rank's tokens -> their output (B, T_local, C).
    ``positions``: (N, T_local) host integers, every rank's positions in group rank order.
    ``recompute``: selective recomputation in the attention on this rank's heads (its T x T part)."""
    N, r = group.size, group.rank
    B, T_local, width = qkv.shape
    heads = n_head // N  # this rank's heads: r*heads ... (r+1)*heads - 1
    piece = width // 3 // N  # their columns in each of q, k, v
    # chunk i of axis 0 holds rank i's heads of q, k and v: (N, B, T_local, 3, piece)
    x = qkv.reshape(B, T_local, 3, N, piece).transpose(3, 0, 1, 2, 4)
    x = all_to_all(x, group)  # chunk j: rank j's tokens, this rank's heads
    x = x.transpose(1, 0, 2, 3, 4).reshape(B, N * T_local, 3 * piece)  # (B, T, 3C/N), in rank order
    gathered = positions.reshape(-1)  # the global position of each token of x
    x = Reorder.apply(x, numpy.argsort(gathered))  # global order 0..T-1
    y = F.causal_attention(x, heads, dropout_p, key, rows, None, head_offset + r * heads,
                           recompute=recompute)  # (B, T, C/N)
    y = Reorder.apply(y, gathered)  # back to rank order
    y = y.reshape(B, N, T_local, piece).transpose(1, 0, 2, 3)  # chunk j: rank j's tokens
    y = all_to_all(y, group)  # chunk i: rank i's heads of this rank's tokens
    return y.transpose(1, 2, 0, 3).reshape(B, T_local, N * piece)
