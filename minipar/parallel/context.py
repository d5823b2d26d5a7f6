"""Context parallelism: the sequence cut across the ranks of a CP group, and attention across them.

Everything but attention works token by token, so a rank can hold any T/N of the T positions. Two
ways to let its queries see every earlier key:

    ring_attention     keys and values travel around the ring, point to point, while each rank
                       computes against the block it holds (``ring_attention.py``, Liu et al. 2023)
    ulysses_attention  two all-to-alls trade the sequence shard for a head shard; each rank runs
                       ordinary attention on H/N heads (``ulysses.py``, Jacobs et al. 2023)

Which positions a rank holds. With causal attention the query at position i sees i+1 keys, so
contiguous shards give the last rank the most work: with L = T/N tokens each, rank r computes
L rL + L(L+1)/2 (query, key) pairs, and the busiest over the mean is

    (T (2N-1) + N) / (N (T+1))      -> (2N-1)/N for long sequences (1.75 at N = 4)

The load-balanced ("zigzag") split of Megatron-core's context parallelism and Llama 3 cuts the
sequence into 2N chunks of c = T/2N and gives rank r chunks r and 2N-1-r: an early chunk and its
mirror image, so every rank has c^2 (2N-1) + c (c+1) pairs, the same for all. Ring attention
computes them chunk pair by chunk pair: against another rank's keys 2 of the 4 pairs of c x c
scores are in the past and 2 wholly in the future (skipped), against its own 3 (two of them
diagonal, half masked), (2N+1) c^2 scores on every rank.
"""

import numbers

import numpy

from minipar.backend import to_numpy
from minipar.functional.attention import attention_arguments
from minipar.functional.blockwise import DropoutSite
from minipar.parallel.ring_attention import RingAttention
from minipar.parallel.ulysses import ulysses
from minipar.rng import context_positions, stream


def _check_rank(T, cp, rank):
    if int(cp) < 1 or not 0 <= int(rank) < int(cp) or int(T) < 1:
        raise ValueError(f"context parallel rank {rank} of {cp} with T={T}: need cp >= 1, 0 <= rank < cp, T >= 1")


def load_balanced_positions(T, cp, rank):
    """The global positions rank ``rank`` of ``cp`` holds: chunk r, then chunk 2cp-1-r, of 2cp
    equal chunks of the T tokens (int64, T/cp of them)."""
    _check_rank(T, cp, rank)
    if T % (2 * cp):
        raise ValueError(f"a sequence of {T} tokens does not cut into 2 x {cp} equal chunks for load-balanced "
                         f"context parallelism: make the sequence length a multiple of {2 * cp}")
    return to_numpy(context_positions(T // cp, (rank, cp))).astype(numpy.int64)  # the rule dropout keys by too


def contiguous_positions(T, cp, rank):
    """Chunk ``rank`` of ``cp`` equal consecutive chunks (unbalanced under a causal mask)."""
    _check_rank(T, cp, rank)
    if T % cp:
        raise ValueError(f"a sequence of {T} tokens does not cut into {cp} equal chunks: make the sequence "
                         f"length a multiple of {cp}")
    L = T // cp
    return numpy.arange(rank * L, (rank + 1) * L)


def causal_work(positions_per_rank):
    """For each rank, the (query, key) pairs with key position <= query position its queries
    have, the keys being every rank's positions."""
    keys = numpy.sort(numpy.concatenate([numpy.asarray(p) for p in positions_per_rank]))
    return [int(numpy.searchsorted(keys, numpy.asarray(p), side="right").sum()) for p in positions_per_rank]


OPS = ("ring_attention", "ulysses_attention")  # numbered in the ranks' agreement (_arguments)
HEADER = 9  # int64s in that agreement: the op, B, T_local, 3C, n_head, head_offset, itemsize, p, key


def _arguments(op, qkv, n_head, group, positions, dropout_p, key, rows, head_offset):
    """Checks that need no communication (so every rank called alike raises alike), then one
    all-gather of what the ranks must agree on and one of their positions: (qkv, every rank's
    positions (N, T_local), p, key, where)."""
    given = key
    qkv, p, key, where = attention_arguments(op, qkv, n_head, dropout_p, key, rows, None, head_offset)
    if p > 0 and given is None:
        raise ValueError(f"{op}: dropout needs the same key on every rank of the group: pass key=")
    mine = to_numpy(positions)
    B, T_local, width = qkv.shape
    if mine.shape != (T_local,) or mine.dtype.kind not in "iu":
        raise ValueError(f"{op}: positions must be {T_local} integers, one per token of qkv, got "
                         f"{mine.dtype} {mine.shape}")
    dropout = None if where is None else (*key, *where[0].tolist())
    # the op too: a ring's messages and Ulysses' all-to-alls would not match, and would hang
    header = numpy.array([OPS.index(op), B, T_local, width, n_head, int(head_offset), qkv.dtype.itemsize,
                          round(p * 2**32), 0 if dropout is None else stream(dropout) >> 2], numpy.int64)
    assert header.size == HEADER  # the planner and lesson 8 count its bytes
    every = group.all_gather(header)  # (N, HEADER)
    if (every != every[0]).any():
        raise ValueError(f"{op}: the ranks of the group were called differently; [op ({', '.join(OPS)}), B, "
                         f"T_local, 3C, n_head, head_offset, itemsize, dropout, key and rows] per rank: "
                         f"{every.tolist()}; call the same op on every rank, with the same batch, heads, dropout "
                         "and key, and as many tokens")
    positions = group.all_gather(mine.astype(numpy.int64))  # (N, T_local)
    T = positions.size
    if not numpy.array_equal(numpy.sort(positions.reshape(-1)), numpy.arange(T)):
        raise ValueError(f"{op}: the ranks' positions must hold 0..{T - 1} once each; give rank r "
                         "load_balanced_positions(T, cp, r) or contiguous_positions(T, cp, r)")
    return qkv, positions, p, key, where


def ring_attention(qkv, n_head, group, positions, dropout_p=0.0, key=None, rows=None, head_offset=0,
                   recompute=False):
    """Rows ``positions`` of ``causal_attention`` on the whole sequence, by ring attention.

    ``qkv`` (B, T_local, 3C_local): the fused projection of this rank's tokens, at the global
    ``positions`` (1-D, T_local integers); ``group``: the CP communicator (ring order = rank order),
    every rank with the same rows and heads. Dropout keeps exactly the single-device elements
    (rows, head_offset + head, query position, key position). Returns (B, T_local, C_local).
    ``recompute`` (selective recomputation) changes nothing: ring attention holds no T x T
    probabilities, its backward rebuilds them from the saved log-sum-exp anyway."""
    qkv, positions, p, key, where = _arguments("ring_attention", qkv, n_head, group, positions, dropout_p, key,
                                               rows, head_offset)
    dropout = None if where is None else DropoutSite(key, p, where[0], where[1])
    return RingAttention.apply(qkv, int(n_head), group, positions, dropout)


def ulysses_attention(qkv, n_head, group, positions, dropout_p=0.0, key=None, rows=None, head_offset=0,
                      recompute=False):
    """The same result as ``ring_attention`` by DeepSpeed-Ulysses' two all-to-alls; ``n_head`` must
    be a multiple of the group's size. ``recompute``: hold no T x T probabilities of this rank's
    heads (selective recomputation, ``causal_attention``'s)."""
    # (an n_head that is no positive integer: _arguments names it)
    if isinstance(n_head, numbers.Integral) and n_head >= 1 and n_head % group.size:
        raise ValueError(f"ulysses_attention: {n_head} heads do not split over {group.size} ranks: make the "
                         f"number of heads a multiple of the context-parallel size, or use ring_attention")
    qkv, positions, p, key, where = _arguments("ulysses_attention", qkv, n_head, group, positions, dropout_p,
                                               key, rows, head_offset)
    rows = None if where is None else where[0]
    return ulysses(qkv, int(n_head), group, positions, p, key, rows, head_offset, recompute)
