"""Causal self-attention as one op, from the fused qkv projection to the heads' concatenated output.

Per head, with q, k, v of shape (T, D) and M the causal mask (-inf above the diagonal):

    S = q k^T / sqrt(D) + M        P = softmax(S)        y = (P * R) v

where R is the dropout mask scaled by 1/(1-p) (all ones without dropout). Backward, with dy given:

    dv = (P * R)^T dy      dP = (dy v^T) * R      dS = P * (dP - rowsum(dP * P))
    dq = dS k / sqrt(D)    dk = dS^T q / sqrt(D)

This is exactly what the composed ops compute (``masked_fill``, ``softmax``, ``dropout`` and two
batched ``matmul``; the tests check the two agree). Doing it as one op lets us walk the batch one
sequence at a time: that sequence's (heads, T, T) scores stay in the CPU cache while they are
scaled, masked, normalised and multiplied, instead of streaming through memory once per op.
"""

import math

from minipar.autograd import Function
from minipar.backend import default_generator, xp
from minipar.functional.checks import floats, probability
from minipar.functional.elementwise import dropout_mask


def _heads(x, n_head):
    """(T, H*D) -> (H, T, D) as a view."""
    T, C = x.shape
    return x.reshape(T, n_head, C // n_head).transpose(1, 0, 2)


class CausalAttention(Function):
    """The scores are kept transposed, S^T (keys x queries) per head, so that the softmax over the
    keys reduces along the outer axis of each (T, T) block: NumPy vectorises that across the
    contiguous queries, ~3x faster than reducing along 128-long rows. BLAS reads the transposes."""

    @staticmethod
    def forward(ctx, qkv, n_head, dropout_p, generator):
        B, T, C3 = qkv.shape
        C = C3 // 3
        scale = 1.0 / math.sqrt(C // n_head)
        future = xp.tril(xp.ones((T, T), dtype=bool), k=-1)  # [key, query]: key after query
        ones = xp.ones(T, qkv.dtype)
        probs_t = xp.empty((B, n_head, T, T), qkv.dtype)
        keep_t = xp.empty_like(probs_t) if dropout_p > 0 else None
        out = xp.empty((B, T, C), qkv.dtype)
        for b in range(B):
            q, k, v = (_heads(qkv[b, :, i * C : (i + 1) * C], n_head) for i in range(3))
            pt = xp.matmul(k, q.transpose(0, 2, 1), out=probs_t[b])  # S^T = k q^T
            pt *= scale
            xp.copyto(pt, -xp.inf, where=future)
            pt -= pt.max(axis=1, keepdims=True)
            xp.exp(pt, out=pt)
            pt /= (ones @ pt)[:, None, :]  # column sums as one vector-matrix product
            if keep_t is not None:
                keep_t[b] = dropout_mask(generator, pt.shape, dropout_p, pt.dtype)
                pt = pt * keep_t[b]
            xp.matmul(pt.transpose(0, 2, 1), v, out=_heads(out[b], n_head))  # y = P v
        ctx.qkv, ctx.probs_t, ctx.keep_t, ctx.n_head, ctx.scale = qkv, probs_t, keep_t, n_head, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        qkv, probs_t, keep_t, n_head, scale = ctx.qkv, ctx.probs_t, ctx.keep_t, ctx.n_head, ctx.scale
        B, T, C3 = qkv.shape
        C = C3 // 3
        dqkv = xp.empty_like(qkv)
        for b in range(B):
            q, k, v = (_heads(qkv[b, :, i * C : (i + 1) * C], n_head) for i in range(3))
            dq, dk, dv = (_heads(dqkv[b, :, i * C : (i + 1) * C], n_head) for i in range(3))
            dy = _heads(grad[b], n_head)
            pt = probs_t[b]
            dropped_t = pt if keep_t is None else pt * keep_t[b]
            xp.matmul(dropped_t, dy, out=dv)  # dv = P^T dy
            dpt = v @ dy.transpose(0, 2, 1)  # dP^T = v dy^T
            if keep_t is not None:
                dpt *= keep_t[b]
            # softmax backward, in place: dS = P * (dP - rowsum(dP * P)), rows of P = columns here
            dpt -= xp.einsum("hkq,hkq->hq", dpt, pt)[:, None, :]
            dpt *= pt
            dpt *= scale
            xp.matmul(dpt.transpose(0, 2, 1), k, out=dq)  # dq = dS k
            xp.matmul(dpt, q, out=dk)  # dk = dS^T q
        return dqkv, None, None, None


def causal_attention(qkv, n_head, dropout_p=0.0, generator=None):
    """Multi-head causal self-attention of a fused projection ``qkv`` (B, T, 3C) -> (B, T, C):
    q, k and v are the three thirds of the last axis, each split into ``n_head`` heads; the output
    holds the heads side by side (head h in columns h*C/H ... (h+1)*C/H). ``dropout_p`` drops
    attention probabilities (pass 0 at evaluation)."""
    qkv = floats("causal_attention", qkv)
    if qkv.ndim != 3 or qkv.shape[-1] % 3:
        raise ValueError(f"causal_attention needs qkv of shape (B, T, 3C), got {qkv.shape}")
    if (qkv.shape[-1] // 3) % n_head:
        raise ValueError(f"causal_attention: C={qkv.shape[-1] // 3} is not divisible by {n_head} heads")
    p = probability(dropout_p)
    return CausalAttention.apply(qkv, int(n_head), p, generator or default_generator())
