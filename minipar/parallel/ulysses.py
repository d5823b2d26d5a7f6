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

import minipar.functional as F
from minipar.autograd import Function
from minipar.backend import xp
from minipar.functional.blockwise import runs
from minipar.parallel.collectives import all_to_all


def _spans(positions):
    """[(chunk, start, stop, first)]: the runs of consecutive positions in each rank's tokens, row
    ``chunk`` of ``positions`` (N, T_local): tokens start:stop of that chunk are at first, first+1..."""
    return [(j, a, b, first) for j, row in enumerate(positions) for a, b, first, _ in runs(row)]


def _chunks_to_sequence(chunks, spans):
    """(N, B, T_local, W), chunk j holding rank j's tokens -> (B, T, W) in position order."""
    N, B, T_local, W = chunks.shape
    out = xp.empty((B, N * T_local, W), chunks.dtype)
    for j, a, b, first in spans:
        out[:, first:first + b - a] = chunks[j, :, a:b]
    return out


def _sequence_to_chunks(x, spans, N):
    """The inverse of ``_chunks_to_sequence``: (B, T, W) -> (N, B, T/N, W), contiguous."""
    B, T, W = x.shape
    out = xp.empty((N, B, T // N, W), x.dtype)
    for j, a, b, first in spans:
        out[j, :, a:b] = x[:, first:first + b - a]
    return out


class ChunksToSequence(Function):
    """What the all-to-all delivers, every rank's tokens of this rank's heads, laid out as one
    sequence in position order: each run of consecutive positions is one slice copy (at most 2
    per rank when load-balanced), where transposing the chunks into rank order and then
    permuting the tokens copied everything twice. Backward slices the gradient back into chunks."""

    @staticmethod
    def forward(ctx, chunks, spans):
        ctx.spans, ctx.N = spans, chunks.shape[0]
        return _chunks_to_sequence(chunks, spans)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_chunks(grad, ctx.spans, ctx.N), None


class SequenceToChunks(Function):
    """The inverse: the heads' output in position order, cut into the chunks the all-to-all sends
    (chunk j: rank j's tokens), contiguous as it must send them."""

    @staticmethod
    def forward(ctx, x, spans, N):
        ctx.spans = spans
        return _sequence_to_chunks(x, spans, N)

    @staticmethod
    def backward(ctx, grad):
        return _chunks_to_sequence(grad, ctx.spans), None, None


def ulysses(qkv, n_head, group, positions, dropout_p, key, rows, head_offset, recompute=False):
    """``qkv`` (B, T_local, 3C) of this rank's tokens -> their output (B, T_local, C).
    ``positions``: (N, T_local) host integers, every rank's positions in group rank order.
    ``recompute``: selective recomputation in the attention on this rank's heads (its T x T part)."""
    N, r = group.size, group.rank
    B, T_local, width = qkv.shape
    heads = n_head // N  # this rank's heads: r*heads ... (r+1)*heads - 1
    piece = width // 3 // N  # their columns in each of q, k, v
    spans = _spans(positions)
    # chunk i of axis 0 holds rank i's heads of q, k and v: (N, B, T_local, 3, piece)
    x = qkv.reshape(B, T_local, 3, N, piece).transpose(3, 0, 1, 2, 4)
    x = all_to_all(x, group)  # chunk j: rank j's tokens, this rank's heads
    x = ChunksToSequence.apply(x.reshape(N, B, T_local, 3 * piece), spans)  # (B, T, 3C/N), positions 0..T-1
    y = F.causal_attention(x, heads, dropout_p, key, rows, None, head_offset + r * heads,
                           recompute=recompute)  # (B, T, C/N)
    y = all_to_all(SequenceToChunks.apply(y, spans, N), group)  # chunk i: rank i's heads of this rank's tokens
    return y.transpose(1, 2, 0, 3).reshape(B, T_local, N * piece)
