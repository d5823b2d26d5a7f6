"""Attention one block of keys at a time, merged exactly by the online softmax: the arithmetic of
FlashAttention (Milakov & Gimelshein 2018; Dao et al. 2022) that ring attention (Liu et al. 2023)
spreads over ranks, one block of keys per ring step.

Per head, with s the scaled scores q k^T / sqrt(D) of a query against one block of keys (-inf
where the key's global position is after the query's), each query keeps a running maximum m, a
running sum l of exponentials and a running unnormalised output acc. A new block folds in as

    m' = max(m, rowmax(s))          alpha = exp(m - m')        (the old terms, rescaled to m')
    l' = alpha l + rowsum(exp(s - m'))
    acc' = alpha acc + (exp(s - m') * R) v

and after the last block y = acc / l and the log-sum-exp lse = m + log l. Dropout's R (0 or
1/(1-p)) multiplies the probabilities after normalisation, so it enters acc and not l. Every step
is exact, so the result is the softmax over all keys whatever the blocks and their order.

Backward (FlashAttention's) needs only y and lse: per block the probabilities come back as
P = exp(s - lse), and with D = rowsum(dy * y), which equals rowsum(dP * P) over all keys because
y = (P * R) v,

    dv = (P * R)^T dy       dP = (dy v^T) * R       dS = P * (dP - D)
    dq += dS k / sqrt(D)    dk = dS^T q / sqrt(D)

so each block's gradients need that block's keys and values and nothing of the others.

A block's keys come as runs of consecutive positions (a load-balanced rank holds two chunks). A
pair (run of queries, run of keys) entirely in the future is skipped; one entirely in the past
needs no mask. Arrays are (B, H, T, D) per head; positions are host integer arrays.
"""

import math
from dataclasses import dataclass

import numpy

from minipar.autograd import Function
from minipar.backend import dot_along, matmul, sum_along, xp
from minipar.functional.attention import attention_arguments
from minipar.functional.widen import in_float32
from minipar.rng import keep, scaled


def split_heads(x, n_head, parts):
    """(B, T, parts*H*D) -> contiguous (parts, B, H, T, D)."""
    B, T, width = x.shape
    return xp.ascontiguousarray(x.reshape(B, T, parts, n_head, width // parts // n_head).transpose(2, 0, 3, 1, 4))


def merge_heads(heads):
    """(parts, B, H, T, D) -> contiguous (B, T, parts*H*D), the inverse of ``split_heads``."""
    parts, B, H, T, D = heads.shape
    return xp.ascontiguousarray(heads.transpose(1, 3, 0, 2, 4).reshape(B, T, parts * H * D))


def _mT(x):
    return x.swapaxes(-1, -2)


def runs(positions):
    """[(start, stop, first, last)]: the index ranges of ``positions`` whose positions go up by one,
    with their first and last position."""
    positions = numpy.asarray(positions)
    cuts = [0, *(numpy.flatnonzero(numpy.diff(positions) != 1) + 1).tolist(), len(positions)]
    return [(a, b, int(positions[a]), int(positions[b - 1])) for a, b in zip(cuts[:-1], cuts[1:])]


@dataclass
class DropoutSite:
    """Which dropout mask: its key and probability, the batch's global rows, the heads' global numbers."""

    key: tuple
    p: float
    rows: object
    heads: object

    def mask(self, q_positions, k_positions, dtype):
        """R for these queries and keys: (B, H, Tq, Tk), 0 or 1/(1-p), the single-device draw."""
        return scaled(keep(self.key, self.p, self.rows, self.heads, q_positions, k_positions), self.p, dtype)


class Block:
    """The queries or keys of one attention block: their positions, cut into ``pieces`` equal
    parts (a load-balanced rank's two chunks, which may adjoin), each into runs of consecutive
    positions. Finer parts let more of a diagonal pair be skipped."""

    def __init__(self, positions, pieces=2):
        self.positions = numpy.asarray(positions, dtype=numpy.int64)
        n = len(self.positions)
        cuts = sorted({n * i // pieces for i in range(pieces + 1)})
        self.runs = [(a + start, a + stop, first, last) for a, b in zip(cuts[:-1], cuts[1:])
                     for start, stop, first, last in runs(self.positions[a:b])]


def pairs(queries, keys):
    """(query slice, key slice, query positions, key positions, masked): rectangles covering every
    pair of runs with a key at or before a query, and nothing else; ``masked`` when some key of the
    rectangle is after some query.

    Each rectangle costs a dozen array operations whatever its size, and with short chunks those
    cost more than its arithmetic (a balanced rank's step against another rank: 2 products of
    c x c scores, or one of c x 2c). So a run of queries takes the runs of keys it sees that adjoin
    in the block as one slice, and adjoining runs of queries that see the same slice alike share a
    rectangle: at CP 2, 5 rectangles a rank per pass become 3, the same scores computed."""
    seen = []  # [query start, query stop, key start, key stop, masked]
    for qa, qb, q_first, q_last in queries.runs:
        row = []
        for ka, kb, k_first, k_last in keys.runs:
            if k_first > q_last:
                continue  # every key is in every query's future
            if row and row[-1][3] == ka:
                row[-1][3], row[-1][4] = kb, row[-1][4] or k_last > q_first
            else:
                row.append([qa, qb, ka, kb, k_last > q_first])
        for rect in row:
            if seen and seen[-1][1] == qa and seen[-1][2:] == rect[2:]:
                seen[-1][1] = qb
            else:
                seen.append(rect)
    for qa, qb, ka, kb, masked in seen:
        yield slice(qa, qb), slice(ka, kb), queries.positions[qa:qb], keys.positions[ka:kb], masked


def scores(q, k, q_positions, k_positions, masked, scale):
    """s = q k^T / sqrt(D), -inf where a key comes after the query: (B, H, Tq, Tk)."""
    s = matmul(q, _mT(k))
    s *= scale
    if masked:
        future = xp.asarray(k_positions)[None, :] > xp.asarray(q_positions)[:, None]
        xp.copyto(s, -xp.inf, where=future)
    return s


def rescale(m, shift):
    """alpha = exp(m - m'): how much the terms gathered so far shrink when the maximum grows."""
    return xp.exp(m - shift)


class OnlineSoftmax:
    """The running maximum m, sum l (B, H, Tq) and output acc (B, H, Tq, D) of every query."""

    def __init__(self, q):
        self.m = xp.full(q.shape[:-1], -xp.inf, q.dtype)
        self.l = xp.zeros(q.shape[:-1], q.dtype)
        self.acc = xp.zeros_like(q)

    def update(self, rows, s, v, mask):
        """Fold in the scores s (B, H, tq, tk) of queries ``rows`` against values v (B, H, tk, D)."""
        m, l, acc = self.m[..., rows], self.l[..., rows], self.acc[..., rows, :]  # views: updated in place
        m_new = xp.maximum(m, s.max(axis=-1))
        shift = xp.where(xp.isneginf(m_new), 0, m_new)  # a query with no visible key yet: exp(-inf) = 0
        alpha = rescale(m, shift)
        p = xp.exp(s - shift[..., None])
        l *= alpha
        l += sum_along(p, -1)
        acc *= alpha[..., None]
        acc += matmul(p if mask is None else p * mask, v)
        m[...] = m_new

    def result(self):
        """(y (B, H, Tq, D), lse (B, H, Tq)); every query must have seen a key."""
        return self.acc / self.l[..., None], self.m + xp.log(self.l)


def attend(state, q, k, v, queries, keys, scale, dropout):
    """Fold the key block (k, v) at ``keys`` into the state of the queries q at ``queries``."""
    for rows, cols, q_pos, k_pos, masked in pairs(queries, keys):
        s = scores(q[..., rows, :], k[..., cols, :], q_pos, k_pos, masked, scale)
        mask = None if dropout is None else dropout.mask(q_pos, k_pos, q.dtype)
        state.update(rows, s, v[..., cols, :], mask)


def attend_backward(q, k, v, dy, lse, delta, queries, keys, scale, dropout, dq, dkv):
    """One key block's share of the backward: adds into dq (B, H, Tq, D) and dkv = (dk, dv)
    (2, B, H, Tk, D). ``delta`` = rowsum(dy * y) (B, H, Tq)."""
    for rows, cols, q_pos, k_pos, masked in pairs(queries, keys):
        qs, ks, dys = q[..., rows, :], k[..., cols, :], dy[..., rows, :]
        p = xp.exp(scores(qs, ks, q_pos, k_pos, masked, scale) - lse[..., rows, None])  # P, normalised
        mask = None if dropout is None else dropout.mask(q_pos, k_pos, q.dtype)
        dkv[1][..., cols, :] += matmul(_mT(p if mask is None else p * mask), dys)  # dv = (P*R)^T dy
        ds = matmul(dys, _mT(v[..., cols, :]))  # dP = dy v^T
        if mask is not None:
            ds *= mask
        ds -= delta[..., rows, None]
        ds *= p  # dS = P * (dP - D)
        ds *= scale
        dq[..., rows, :] += matmul(ds, ks)
        dkv[0][..., cols, :] += matmul(_mT(ds), qs)


@in_float32(float32_saved=("lse",))  # the log-sum-exp rebuilds P = exp(S - lse): one float32 per row
class BlockwiseAttention(Function):
    """Causal attention over one device's whole sequence, its keys taken block by block in a given
    order: what ring attention computes, without the ring (to test the merge and the backward)."""

    @staticmethod
    def forward(ctx, qkv, n_head, key_blocks, dropout):
        q, k, v = split_heads(qkv, n_head, 3)  # (B, H, T, D) each
        scale = 1.0 / math.sqrt(q.shape[-1])
        queries = Block(numpy.arange(qkv.shape[1]))
        state = OnlineSoftmax(q)
        for index in key_blocks:
            attend(state, q, k[..., index, :], v[..., index, :], queries, Block(index), scale, dropout)
        y, lse = state.result()
        ctx.saved, ctx.lse = (qkv, y, n_head, key_blocks, dropout, queries, scale), lse
        return merge_heads(y[None])

    @staticmethod
    def backward(ctx, grad):
        (qkv, y, n_head, key_blocks, dropout, queries, scale), lse = ctx.saved, ctx.lse
        q, k, v = split_heads(qkv, n_head, 3)
        dy = split_heads(grad, n_head, 1)[0]
        delta = dot_along(dy, y, -1)  # D = rowsum(dy * y)
        dqkv = xp.zeros((3,) + q.shape, q.dtype)
        for index in key_blocks:
            dkv = xp.zeros((2,) + q.shape[:2] + (len(index), q.shape[-1]), q.dtype)
            attend_backward(q, k[..., index, :], v[..., index, :], dy, lse, delta, queries, Block(index),
                            scale, dropout, dqkv[0], dkv)
            dqkv[1:, ..., index, :] += dkv
        return merge_heads(dqkv), None, None, None


def blockwise_attention(qkv, n_head, key_blocks, dropout_p=0.0, key=None, rows=None, head_offset=0):
    """``causal_attention(qkv, n_head, dropout_p, key, rows, head_offset=head_offset)`` on positions
    0..T-1, computed one block of keys at a time in the order of ``key_blocks`` (index arrays that
    together hold 0..T-1 once each), merged by the online softmax."""
    T = qkv.shape[1]
    blocks = [numpy.asarray(b, dtype=numpy.int64) for b in key_blocks]
    if not blocks or not numpy.array_equal(numpy.sort(numpy.concatenate(blocks)), numpy.arange(T)):
        raise ValueError(f"blockwise_attention: key_blocks must hold the positions 0..{T - 1} once each")
    qkv, p, key, where = attention_arguments("blockwise_attention", qkv, n_head, dropout_p, key, rows, None,
                                             head_offset)
    dropout = None if where is None else DropoutSite(key, p, where[0], where[1])
    return BlockwiseAttention.apply(qkv, int(n_head), blocks, dropout)
