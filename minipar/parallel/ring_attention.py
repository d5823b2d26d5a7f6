"""Ring attention (Liu, Zaharia & Abbeel 2023): causal attention over a sequence spread across the
ranks of a context-parallel group, with the keys and values travelling around the ring.

Each rank keeps its queries. Its keys and values (one block) go round the ring, rank r sending
to r+1 and receiving from r-1, so that at step t rank r holds the block of rank r-t. Every step
first starts the transfer of the next block (isend/irecv) and then computes attention against the
current one, so the transfer hides behind the compute; after N-1 transfers every query has met
every key. The partial results of the blocks are merged exactly by the online softmax
(``functional/blockwise.py``: running max, running sum, rescale), and pairs of chunks entirely in
a query's future are skipped, which is where the load-balanced chunking pays
(``context.load_balanced_positions``).

Backward runs the ring again, from the saved output and log-sum-exp (FlashAttention's backward):
the keys and values go round a second time, and each rank adds its share of every block's dK, dV.
Those gradients travel with the ring too, one step behind the keys: block s's accumulator starts
at rank s+1, gathers the share of each rank it passes and arrives home at rank s after N-1 hops,
where the owner adds its own share. Sending each share straight to its owner instead would move
as many bytes, but over links between any two ranks rather than only ring neighbours, and the
owner would sum N-1 messages in arrival order; the travelling accumulator uses only the ring's
links, sends one dK,dV block per step like the K,V it follows, and sums in a fixed order.

A block's positions do not travel with it: every rank's positions are all-gathered once, when
the arguments are checked (``context.py``), so each ring message is one K,V (or dK,dV) array.
Forward saves this rank's qkv, its output and its log-sum-exp: no other rank's keys or values.
Bytes sent per rank: (N-1) K,V blocks forward; (N-1) K,V blocks and (N-1) dK,dV blocks backward.

In a 16-bit model the blocks travel in 16 bits, as Megatron's do: K,V exactly (they were 16-bit
before ``in_float32`` widened them), dK,dV rounded once per hop, like a 16-bit ring all-reduce.
Each rank widens what arrives and computes, and adds its share, in float32.
"""

import math

from minipar.autograd import Function
from minipar.backend import dot_along, xp
from minipar.comm import wait_all
from minipar.functional.blockwise import (Block, OnlineSoftmax, attend, attend_backward, merge_heads,
                                          split_heads)
from minipar.functional.widen import in_float32

KV_TAG, KV_BACK_TAG, DKV_TAG = 7101, 7102, 7103  # one tag per kind of ring message


class _Ring:
    """This rank's place on the ring: its neighbours, and whose block it holds at each step."""

    def __init__(self, group):
        self.group, self.size, self.rank = group, group.size, group.rank
        self.next, self.previous = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def owner(self, step):
        return (self.rank - step) % self.size

    def pass_on(self, block, spare, tag):
        """Start sending ``block`` to the next rank and receiving the previous rank's into ``spare``."""
        return [self.group.isend(block, self.next, tag), self.group.irecv(spare, self.previous, tag)]


@in_float32(float32_saved=("lse",))  # 16-bit qkv: merged in float32, the blocks travel in 16 bits
class RingAttention(Function):
    """``positions``: (N, T_local) host integers, every rank's positions in group rank order."""

    @staticmethod
    def forward(ctx, qkv, n_head, group, positions, dropout):
        ring = _Ring(group)
        q, k, v = split_heads(qkv, n_head, 3)  # (B, H, T_local, D) each
        blocks = [Block(p) for p in positions]
        scale = 1.0 / math.sqrt(q.shape[-1])
        state = OnlineSoftmax(q)
        wire = ctx.narrow or q.dtype  # the model's dtype: 16 bits for a bf16 or fp16 model
        kv = xp.stack([k, v]).astype(wire, copy=False)  # (2, B, H, T_local, D): one message per step
        spare = xp.empty_like(kv)
        for step in range(ring.size):
            last = step == ring.size - 1
            transfers = [] if last else ring.pass_on(kv, spare, KV_TAG)
            block = kv.astype(q.dtype, copy=False)  # widened: the scores and sums run in float32
            attend(state, q, block[0], block[1], blocks[ring.rank], blocks[ring.owner(step)], scale, dropout)
            wait_all(transfers)
            if not last:
                kv, spare = spare, kv
        y, lse = state.result()  # (B, H, T_local, D), (B, H, T_local)
        out = merge_heads(y[None])  # (B, T_local, C)
        ctx.saved, ctx.lse = (qkv, out, n_head, ring, blocks, dropout, scale), lse
        return out

    @staticmethod
    def backward(ctx, grad):
        (qkv, out, n_head, ring, blocks, dropout, scale), lse = ctx.saved, ctx.lse
        q, k, v = split_heads(qkv, n_head, 3)
        y = split_heads(out, n_head, 1)[0]
        dy = split_heads(grad, n_head, 1)[0]
        delta = dot_along(dy, y, -1)  # D = rowsum(dy * y): (B, H, T_local)
        dq = xp.zeros_like(q)
        wire = ctx.narrow or q.dtype
        kv = xp.stack([k, v]).astype(wire, copy=False)
        spare = xp.empty_like(kv)
        own = xp.zeros(kv.shape, q.dtype)  # this rank's share of its own block's dK, dV
        sending = None  # the accumulator sent last step, held (by its request) until delivered
        for step in range(ring.size):
            last = step == ring.size - 1
            transfers = [] if last else ring.pass_on(kv, spare, KV_BACK_TAG)
            # the accumulator of the block held now, from the ranks it visited since its owner's
            # successor started it (step 1); it arrives while this rank computes its share
            incoming = ring.group.irecv(xp.empty_like(kv), ring.previous, DKV_TAG) if step >= 2 else None
            share = own if step == 0 else xp.zeros(kv.shape, q.dtype)
            block = kv.astype(q.dtype, copy=False)
            attend_backward(q, block[0], block[1], dy, lse, delta, blocks[ring.rank], blocks[ring.owner(step)],
                            scale, dropout, dq, share)
            if step >= 1:
                if incoming is not None:
                    share += incoming.wait().astype(q.dtype, copy=False)
                # one accumulator in flight at a time: kept until the end, the N-1 sent would
                # hold as much as the whole sequence's K,V. The next rank posts the receive of
                # the last one as its step starts, so this wait is short.
                if sending is not None:
                    sending.wait()
                sending = ring.group.isend(share.astype(wire, copy=False), ring.next, DKV_TAG)
            wait_all(transfers)
            if not last:
                kv, spare = spare, kv
        if ring.size > 1:  # this rank's block, home after visiting every other rank
            own += ring.group.irecv(xp.empty_like(kv), ring.previous, DKV_TAG).wait().astype(q.dtype, copy=False)
        if sending is not None:
            sending.wait()
        return merge_heads(xp.concatenate([dq[None], own])), None, None, None, None
