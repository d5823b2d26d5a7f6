"""Causal self-attention as one op, from the fused qkv projection to the heads' concatenated output.

Per head, with q, k, v of shape (T, D) and M the causal mask (-inf above the diagonal):

    S = q k^T / sqrt(D) + M        P = softmax(S)        y = (P * R) v

where R is the dropout mask scaled by 1/(1-p) (all ones without dropout). Backward, with dy given:

    dv = (P * R)^T dy      dP = (dy v^T) * R      dS = P * (dP - rowsum(dP * P))
    dq = dS k / sqrt(D)    dk = dS^T q / sqrt(D)

This is exactly what the composed ops compute (``masked_fill``, ``softmax``, ``dropout`` and two
batched ``matmul``; the tests check the two agree). Doing it as one op buys three things:

* It walks the batch one sequence and one block of queries at a time, so those scores stay in the
  CPU cache while they are scaled, masked, normalised and multiplied.
* Queries q0..q1 attend only to keys 0..q1: the scores right of the diagonal block are all masked,
  so they are never computed (as FlashAttention skips masked tiles). With blocks of 64 queries this
  saves (n-1)/2n of the attention products for n blocks: 25% at T = 128, nearly half for long T.
* It decides what backward keeps: P and R for the keys each block sees, or nothing T x T at all
  (``recompute``: Korthikanti et al. 2022's selective recomputation, docs/activation_memory.md).
"""

import math
import numbers

from minipar.autograd import Function
from minipar.backend import dot_along, matmul, on_gpu, sum_along, xp
from minipar.functional.checks import floats, probability
from minipar.functional.elementwise import fresh_key
from minipar.functional.widen import in_float32
from minipar.rng import keep, scaled


def _heads(x, n_head, parts, copy):
    """(S, T, parts*H*D) -> (parts, S, H, T, D): a view, or with ``copy`` a contiguous copy (the
    GPU kernel steps through a batch of S x H matrices with one stride: they must be evenly spaced)."""
    S, T, width = x.shape
    view = x.reshape(S, T, parts, n_head, width // parts // n_head).transpose(2, 0, 3, 1, 4)
    return xp.ascontiguousarray(view) if copy else view


def _merge(heads):
    """(parts, S, H, T, D) -> (S, T, parts*H*D), the inverse of ``_heads``."""
    parts, S, H, T, D = heads.shape
    return heads.transpose(1, 3, 0, 2, 4).reshape(S, T, parts * H * D)


def _mT(x):
    return x.swapaxes(-1, -2)


# On the CPU a block's scores (sequences x heads x keys x queries) are kept within this many bytes,
# half the L2 cache of one core of a recent x86 (512 KiB-2 MiB), beside the q, k and v they read.
_CACHED_SCORES = 1 << 18


def _sequence_groups(B, H, T, block, itemsize):
    """The sequences taken together: on the CPU as many as keep a block's scores in cache (each
    group is a few more Python calls of NumPy per block, each ~1-2 us, ~10% of the op at T = 128
    one sequence at a time); all of them on the GPU, where every launch costs and one batched
    product is best."""
    size = max(B, 1) if on_gpu() else max(1, _CACHED_SCORES // (H * T * block * itemsize))
    return [(b, min(b + size, B)) for b in range(0, B, size)]


def _query_blocks(T, size):
    """[(q0, q1, future)]: the blocks of queries, with future[key, query] True where key > query.
    Made once by forward and once by backward, and dropped after: nothing is held between them."""
    out = []
    for q0 in range(0, T, size):
        q1 = min(q0 + size, T)
        out.append((q0, q1, xp.arange(q1)[:, None] > xp.arange(q0, q1)[None, :]))
    return out


def _probs_t(q, k, q0, q1, future, scale):
    """P^T of queries q0..q1 over keys 0..q1: (S, H, q1, q1 - q0). Forward and a recomputing
    backward both call this, so the two runs do the same arithmetic and agree bit for bit."""
    pt = matmul(k[..., :q1, :], _mT(q[..., q0:q1, :]))  # S^T = k q^T
    pt *= scale
    xp.copyto(pt, -xp.inf, where=future)
    pt -= pt.max(axis=-2, keepdims=True)
    xp.exp(pt, out=pt)
    pt *= (1.0 / sum_along(pt, -2))[..., None, :]  # a product per score, a division per query
    return pt


def _keep_t(key, p, where, b0, b1, q0, q1, dtype):
    """R^T of sequences b0..b1 and queries q0..q1 over keys 0..q1, scaled: element (row, head,
    query, key) is kept by the hash of its global place alone (``minipar.rng``), so drawing one
    block at a time, here or again in backward, gives the single-device mask's elements."""
    rows, heads, positions = where
    return _mT(scaled(keep(key, p, rows[b0:b1], heads, positions[q0:q1], positions[:q1]), p, dtype))


@in_float32()
class CausalAttention(Function):
    """The scores are kept transposed, S^T (keys x queries) per head, so that the softmax over the
    keys reduces along the outer axis of each block: NumPy vectorises that across the contiguous
    queries, ~3x faster than reducing along rows of 128. BLAS (or our kernel) reads the transposes
    for free. Arrays below are (sequences, heads, ...).

    Per query block q0..q1 backward needs P and R over keys 0..q1 only (the rest is masked): held,
    that is sum over blocks of q1 (q1 - q0) elements of each per sequence and head, s^2 for one
    block, s^2 (n+1)/2n for n equal ones. With ``recompute`` (Korthikanti et al.'s selective
    recomputation) none of it is held: backward rebuilds each block's P from q and k and its R
    from the mask's key, one more QK^T and softmax per block."""

    @staticmethod
    def forward(ctx, qkv, n_head, dropout_p, key, where, query_block, recompute):
        B, T, C3 = qkv.shape
        C = C3 // 3
        scale = 1.0 / math.sqrt(C // n_head)
        ctx.block = max(T, 1) if on_gpu() else query_block
        ctx.groups, ctx.copy = _sequence_groups(B, n_head, T, ctx.block, qkv.dtype.itemsize), on_gpu()
        probs_t, keep_t = [], []  # per (sequence group, query block): (S, H, keys q1, queries q1 - q0)
        out = xp.empty((B, T, C), qkv.dtype)
        blocks = _query_blocks(T, ctx.block)
        for b0, b1 in ctx.groups:
            q, k, v = _heads(qkv[b0:b1], n_head, 3, ctx.copy)
            y = _heads(out[b0:b1], n_head, 1, ctx.copy)[0]
            for q0, q1, future in blocks:
                pt = _probs_t(q, k, q0, q1, future, scale)
                mask = _keep_t(key, dropout_p, where, b0, b1, q0, q1, qkv.dtype) if dropout_p > 0 else None
                if not recompute:
                    probs_t.append(pt)
                    keep_t.append(mask)
                if mask is not None:
                    pt = pt * mask
                matmul(_mT(pt), v[..., :q1, :], out=y[..., q0:q1, :])  # y = (P * R) v
            if ctx.copy:
                out[b0:b1] = _merge(y[None])
        ctx.qkv, ctx.probs_t, ctx.keep_t, ctx.n_head, ctx.scale = qkv, probs_t, keep_t, n_head, scale
        ctx.recompute, ctx.dropout = recompute, (key, dropout_p, where) if dropout_p > 0 and recompute else None
        ctx.p = dropout_p
        return out

    @staticmethod
    def backward(ctx, grad):
        qkv, n_head, scale = ctx.qkv, ctx.n_head, ctx.scale
        blocks = _query_blocks(qkv.shape[1], ctx.block)
        # dk and dv sum over the query blocks that see each key. The last block sees every key,
        # so going through the blocks last to first, it writes them and the others add to them:
        # nothing is zeroed first.
        dqkv = xp.empty_like(qkv)
        for group, (b0, b1) in enumerate(ctx.groups):
            q, k, v = _heads(qkv[b0:b1], n_head, 3, ctx.copy)
            dq, dk, dv = dheads = _heads(dqkv[b0:b1], n_head, 3, ctx.copy)
            dy = _heads(grad[b0:b1], n_head, 1, ctx.copy)[0]
            for index in reversed(range(len(blocks))):
                q0, q1, future = blocks[index]
                if ctx.recompute:
                    pt = _probs_t(q, k, q0, q1, future, scale)
                    mask = _keep_t(*ctx.dropout, b0, b1, q0, q1, qkv.dtype) if ctx.dropout else None
                else:
                    held = group * len(blocks) + index  # forward's order: group by group, block by block
                    pt, mask = ctx.probs_t[held], ctx.keep_t[held]
                    if mask is not None and ctx.narrow is not None:
                        # held in 16 bits, 1/(1-p) was rounded (1/0.9 to 1.109 in bf16), a bias
                        # on every gradient through the mask: rebuild it from the survivors
                        mask = scaled(mask != 0, ctx.p, mask.dtype)
                first = q1 == qkv.shape[1]  # the last block: the first to reach dk and dv
                dy_block = dy[..., q0:q1, :]
                dv_block = matmul(pt if mask is None else pt * mask, dy_block,  # dv = (P * R)^T dy
                                  out=dv[..., :q1, :] if first else None)
                if not first:
                    dv[..., :q1, :] += dv_block
                dpt = matmul(v[..., :q1, :], _mT(dy_block))  # dP^T = v dy^T
                if mask is not None:
                    dpt *= mask
                # softmax backward, in place: dS = P * (dP - rowsum(dP * P)), rows of P = columns here
                dpt -= dot_along(dpt, pt, -2)[..., None, :]
                dpt *= pt
                dpt *= scale
                matmul(_mT(dpt), k[..., :q1, :], out=dq[..., q0:q1, :])  # dq = dS k
                dk_block = matmul(dpt, q[..., q0:q1, :], out=dk[..., :q1, :] if first else None)  # dk = dS^T q
                if not first:
                    dk[..., :q1, :] += dk_block
            if ctx.copy:
                dqkv[b0:b1] = _merge(dheads)
        return dqkv, None, None, None, None, None, None


def causal_attention(qkv, n_head, dropout_p=0.0, key=None, rows=None, positions=None, head_offset=0,
                     query_block=64, recompute=False):
    """Multi-head causal self-attention of a fused projection ``qkv`` (B, T, 3C) -> (B, T, C):
    q, k and v are the three thirds of the last axis, each split into ``n_head`` heads; the output
    holds the heads side by side (head h in columns h*C/H ... (h+1)*C/H). ``dropout_p`` drops
    attention probabilities (pass 0 at evaluation): the probability of query i attending to key j
    in head h of sequence b is kept by the hash of ``key`` and (rows[b], head_offset + h,
    positions[i], positions[j]) (see ``minipar.rng``), the sequences' global rows (default 0..B-1)
    and the tokens' global positions (default 0..T-1): a rank holding some heads or sequences of a
    bigger batch draws exactly their masks. Queries are processed ``query_block`` at a time; the
    result does not depend on it beyond rounding. ``recompute``: hold no probabilities or dropout
    mask for backward, which recomputes them (selective recomputation); the result and the
    gradients are the same bit for bit."""
    qkv, p, key, where = attention_arguments("causal_attention", qkv, n_head, dropout_p, key, rows, positions,
                                             head_offset)
    if int(query_block) < 1:
        raise ValueError(f"causal_attention: query_block must be >= 1, got {query_block}")
    return CausalAttention.apply(qkv, int(n_head), p, key, where, int(query_block), bool(recompute))


def attention_arguments(op, qkv, n_head, dropout_p, key, rows, positions, head_offset):
    """(qkv, p, key, where) checked: where = (rows, heads, positions) of the dropout mask, None
    without dropout (``op`` names the caller in the errors)."""
    qkv = floats(op, qkv)
    # checked first: C % n_head would fail with a bare ZeroDivisionError (0) or accept 1.5 heads
    if isinstance(n_head, bool) or not isinstance(n_head, numbers.Integral) or n_head < 1:
        raise ValueError(f"{op}: n_head must be a positive integer, got {n_head!r}")
    if qkv.ndim != 3 or qkv.shape[-1] % 3:
        raise ValueError(f"{op} needs qkv of shape (B, T, 3C), got {qkv.shape}")
    if (qkv.shape[-1] // 3) % n_head:
        raise ValueError(f"{op}: C={qkv.shape[-1] // 3} is not divisible by {n_head} heads")
    p = probability(dropout_p)
    B, T = qkv.shape[:2]
    where = None
    if p > 0:
        key = key or fresh_key()
        rows = xp.arange(B) if rows is None else xp.asarray(rows)
        positions = xp.arange(T) if positions is None else xp.asarray(positions)
        if rows.shape != (B,) or positions.shape != (T,):
            raise ValueError(f"{op}: rows {rows.shape} and positions {positions.shape} must "
                             f"number the batch's {B} sequences and {T} tokens")
        where = (rows, xp.arange(head_offset, head_offset + n_head), positions)
    return qkv, p, key, where
