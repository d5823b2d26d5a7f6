"""Context parallelism: the online-softmax merge on one device, the chunking arithmetic, and ring
attention and Ulysses on 2 and 4 ranks against single-device attention (tests/mpi/context.py)."""

from types import SimpleNamespace

import numpy
import pytest

import minipar.functional as F
from minipar import Tensor, backend
from minipar.functional import blockwise
from minipar.functional.blockwise import Block, blockwise_attention, pairs, runs
from minipar.gradcheck import gradcheck
from minipar.kernels import emulator, gemm
from minipar.parallel import ulysses
from minipar.parallel.context import (causal_work, contiguous_positions, load_balanced_positions, ring_attention,
                                      ulysses_attention)
from mpi_run import check_mpi, run_mpi

B, T, H, D = 2, 12, 3, 4
BLOCKS = {
    "one block": [numpy.arange(T)],
    "later half first": [numpy.r_[6:12], numpy.r_[0:6]],
    "zigzag chunks": [numpy.r_[0:3, 9:12], numpy.r_[3:6, 6:9]],
    "scattered, first block mostly future": [numpy.array([5, 1, 7]), numpy.r_[0, 2:5, 6, 8:12]],
}


def _pair(p, blocks, dtype="float64"):
    rng = numpy.random.default_rng(1)
    x, upstream = rng.standard_normal((B, T, 3 * H * D)), rng.standard_normal((B, T, H * D))
    whole, split = Tensor(x, requires_grad=True, dtype=dtype), Tensor(x, requires_grad=True, dtype=dtype)
    y_whole = F.causal_attention(whole, H, p, key=(5, 1), rows=[3, 8], head_offset=2)
    y_split = blockwise_attention(split, H, blocks, p, key=(5, 1), rows=[3, 8], head_offset=2)
    y_whole.backward(upstream.astype(dtype))
    y_split.backward(upstream.astype(dtype))
    return y_split.data, y_whole.data, split.grad, whole.grad


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("blocks", list(BLOCKS))
def test_merged_blocks_equal_the_softmax_over_all_keys(blocks, p):
    y, y_ref, g, g_ref = _pair(p, BLOCKS[blocks])
    assert numpy.abs(y - y_ref).max() < 1e-14 and numpy.abs(g - g_ref).max() < 1e-14


def test_merge_without_the_rescale_is_wrong(monkeypatch):
    monkeypatch.setattr(blockwise, "rescale", lambda m, shift: blockwise.xp.ones_like(m))
    y, y_ref, _, _ = _pair(0.0, BLOCKS["later half first"])
    assert numpy.abs(y - y_ref).max() > 1e-2


def test_blockwise_gradient_matches_central_differences():
    qkv = Tensor(numpy.random.default_rng(2).standard_normal((2, 8, 12)), requires_grad=True, dtype="float64")
    zigzag = [numpy.r_[2:4, 4:6], numpy.r_[0:2, 6:8]]  # rank 1's chunks of 2 ranks, then rank 0's
    for p in (0.0, 0.3):
        (report,) = gradcheck(lambda x: blockwise_attention(x, 2, zigzag, p, key=(1, 1)), [qkv])
        assert report.ok, report


@pytest.mark.parametrize("name", ["balanced", "unsorted"])
def test_ulysses_reorders_match_indexing_and_central_differences(name):
    """The all-to-all's chunks (N, B, T/N, W) as one sequence in position order and back, one
    slice copy a run: equal to indexing by the positions, inverse to each other, and their
    gradients by central differences."""
    N, T_local = 2, 6
    if name == "balanced":
        positions = numpy.stack([load_balanced_positions(N * T_local, N, r) for r in range(N)])
    else:
        positions = numpy.random.default_rng(4).permutation(N * T_local).reshape(N, T_local)
    spans = ulysses._spans(positions)
    chunks = numpy.random.default_rng(5).standard_normal((N, 2, T_local, 3))
    sequence = numpy.empty((2, N * T_local, 3))
    sequence[:, positions.reshape(-1)] = chunks.transpose(1, 0, 2, 3).reshape(2, N * T_local, 3)
    x = Tensor(chunks, requires_grad=True, dtype="float64")
    assert numpy.array_equal(ulysses.ChunksToSequence.apply(x, spans).data, sequence)
    assert numpy.array_equal(ulysses.SequenceToChunks.apply(Tensor(sequence, dtype="float64"), spans, N).data, chunks)
    (report,) = gradcheck(lambda c: ulysses.ChunksToSequence.apply(c, spans), [x])
    assert report.ok, report
    seq = Tensor(sequence, requires_grad=True, dtype="float64")
    (report,) = gradcheck(lambda q: ulysses.SequenceToChunks.apply(q, spans, N), [seq])
    assert report.ok, report


def test_runs_are_the_stretches_of_consecutive_positions():
    assert runs(numpy.r_[0:3, 9:12]) == [(0, 3, 0, 2), (3, 6, 9, 11)]
    assert runs(numpy.array([4, 2, 3])) == [(0, 1, 4, 4), (1, 3, 2, 3)]


@pytest.mark.parametrize("T,cp", [(8, 1), (16, 2), (24, 4), (64, 8)])
def test_load_balanced_positions_cover_the_sequence_once_with_equal_work(T, cp):
    every = [load_balanced_positions(T, cp, r) for r in range(cp)]
    assert all(p.dtype == numpy.int64 and len(p) == T // cp for p in every)
    assert numpy.array_equal(numpy.sort(numpy.concatenate(every)), numpy.arange(T))
    c = T // (2 * cp)
    assert numpy.array_equal(every[0], numpy.r_[0:c, T - c : T])  # the first chunk and the last
    work = causal_work(every)
    assert work == [c * c * (2 * cp - 1) + c * (c + 1)] * cp and sum(work) == T * (T + 1) // 2


@pytest.mark.parametrize("T,cp", [(16, 2), (24, 4), (64, 8), (4096, 4)])
def test_contiguous_split_loads_the_last_rank_most(T, cp):
    work = causal_work([contiguous_positions(T, cp, r) for r in range(cp)])
    assert work == sorted(work) and sum(work) == T * (T + 1) // 2
    imbalance = max(work) / (sum(work) / cp)
    assert imbalance == pytest.approx((T * (2 * cp - 1) + cp) / (cp * (T + 1)), rel=1e-12)
    assert imbalance < (2 * cp - 1) / cp


def _ring_scores(positions_per_rank):
    """Per rank, the scores ring attention computes: its queries against every rank's keys, less
    the pairs of chunks entirely in the future."""
    blocks = [Block(p) for p in positions_per_rank]
    return [sum((rows.stop - rows.start) * (cols.stop - cols.start) for keys in blocks
                for rows, cols, *_ in pairs(queries, keys)) for queries in blocks]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_attention_skips_future_chunks_and_balances_what_it_computes(cp):
    T = 4 * cp * 3
    c = T // (2 * cp)
    # chunks c x c: 2 of the 4 pairs against every other rank's keys, 3 against its own
    assert _ring_scores([load_balanced_positions(T, cp, r) for r in range(cp)]) == [(2 * cp + 1) * c * c] * cp
    # halves c x c of L = 2c: all 4 pairs against each earlier rank, 3 against its own
    assert _ring_scores([contiguous_positions(T, cp, r) for r in range(cp)]) == [(4 * r + 3) * c * c
                                                                                 for r in range(cp)]


@pytest.mark.parametrize("name", ["balanced", "contiguous", "scattered", "shuffled runs"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_rectangles_cover_each_visible_pair_once_and_mask_what_they_must(name, cp):
    T = 8 * cp
    rng = numpy.random.default_rng(cp)
    if name == "scattered":
        order = rng.permutation(T)
        positions = [order[r::cp] for r in range(cp)]  # unsorted: runs of one position or two
    elif name == "shuffled runs":  # runs of 2 to 4 positions in any order: a masked run then a seen one
        cuts = numpy.cumsum(rng.integers(2, 5, T))
        pieces = numpy.split(numpy.arange(T), cuts[cuts < T])
        order = numpy.concatenate([pieces[i] for i in rng.permutation(len(pieces))])
        positions = numpy.split(order, cp)
    else:
        split = load_balanced_positions if name == "balanced" else contiguous_positions
        positions = [split(T, cp, r) for r in range(cp)]
    blocks = [Block(p) for p in positions]
    for queries in blocks:
        for keys in blocks:
            covered = numpy.zeros((T, T), int)
            for rows, cols, q_pos, k_pos, masked in pairs(queries, keys):
                assert (q_pos == queries.positions[rows]).all() and (k_pos == keys.positions[cols]).all()
                covered[numpy.ix_(q_pos, k_pos)] += 1
                assert masked == bool((k_pos[None, :] > q_pos[:, None]).any())
            expected = numpy.zeros((T, T), int)  # the pairs of runs not wholly in the future
            for qa, qb, _, q_last in queries.runs:
                for ka, kb, k_first, _ in keys.runs:
                    if k_first <= q_last:
                        expected[numpy.ix_(queries.positions[qa:qb], keys.positions[ka:kb])] = 1
            assert (covered == expected).all()


def test_a_rectangle_that_joins_a_diagonal_run_to_a_past_one_is_masked():
    """Queries 2, 3 against keys 2, 3, 0, 1: one rectangle, masked for key 3 against query 2,
    though its second run of keys is wholly in the past."""
    block = Block(numpy.array([2, 3, 0, 1]))
    rectangles = [(rows, cols, masked) for rows, cols, _, _, masked in pairs(block, block)]
    assert rectangles == [(slice(0, 2), slice(0, 4), True), (slice(2, 4), slice(2, 4), True)]
    # queries 10, 11 then 4, 5 see the same keys 0..5, past for the first run and not the second:
    # two rectangles, not one that leaves key 5 visible to query 4
    rectangles = [(rows, masked) for rows, _, _, _, masked in pairs(Block(numpy.array([10, 11, 4, 5])),
                                                                     Block(numpy.arange(6)))]
    assert rectangles == [(slice(0, 2), False), (slice(2, 4), True)]


def test_a_balanced_rank_computes_three_rectangles_a_pass_at_cp_2():
    """2 against its own block (the early chunk's diagonal; the late chunk against both, masked),
    1 against the other rank's: the late chunk against both of its chunks, or both against one."""
    blocks = [Block(load_balanced_positions(16, 2, r)) for r in range(2)]
    for r in range(2):
        assert [len(list(pairs(blocks[r], keys))) for keys in (blocks[r], blocks[1 - r])] == [2, 1]


@pytest.mark.parametrize("T,cp,rank", [(12, 4, 0), (10, 2, 1), (16, 2, 2), (16, 0, 0), (0, 2, 0)])
def test_bad_sizes_raise(T, cp, rank):
    with pytest.raises(ValueError, match="multiple of|need cp"):
        load_balanced_positions(T, cp, rank)


@pytest.mark.parametrize("op", ["causal", "blockwise", "ring", "ulysses"])
@pytest.mark.parametrize("n_head", [0, -2, 1.5])
def test_a_bad_number_of_heads_is_named_before_any_message(op, n_head):
    """Not a ZeroDivisionError from ``C % n_head``; ring and Ulysses raise before they touch the
    group (a stand-in with a size and nothing else)."""
    qkv, positions, group = Tensor(numpy.zeros((1, 4, 12))), numpy.arange(4), SimpleNamespace(size=2)
    calls = {"causal": lambda: F.causal_attention(qkv, n_head),
             "blockwise": lambda: blockwise_attention(qkv, n_head, [positions]),
             "ring": lambda: ring_attention(qkv, n_head, group, positions),
             "ulysses": lambda: ulysses_attention(qkv, n_head, group, positions)}
    with pytest.raises(ValueError, match=f"n_head must be a positive integer, got {n_head}"):
        calls[op]()


def test_contiguous_positions_need_equal_chunks():
    with pytest.raises(ValueError, match="multiple of 4"):
        contiguous_positions(10, 4, 0)


@pytest.mark.parametrize("n", [2, 4])
def test_ring_and_ulysses_match_single_device_attention(n):
    out = check_mpi(n, "context.py")
    # float64, float32 and bfloat16 (whose ring blocks travel in 16 bits: context.py checks the bytes)
    assert f"context parallel attention OK on {n} ranks" in out and out.count(" p=") == 24
    assert out.count(" bfloat16 p=") == 8


@pytest.mark.parametrize("n", [2, 4])
def test_ring_and_ulysses_gradients_match_central_differences_across_ranks(n):
    """Every entry of the whole projection perturbed on its rank, every rank running the forward;
    and ring attention's backward holding one dK,dV accumulator in flight, not all N-1 it sends."""
    out = check_mpi(n, "context_checks.py", timeout=180)
    assert f"context parallel checks OK on {n} ranks" in out and out.count("central differences") == 4


@pytest.mark.parametrize("bug", ["rescale", "owner"])
def test_ring_attention_fails_on_a_planted_bug(bug):
    code, out, _ = run_mpi(4, "context.py", "--plant-bug", bug, timeout=60)  # on 2, r+1 == r-1
    assert code != 0 and "context parallel attention FAILED" in out
    assert all("MISMATCH" in line for line in out.splitlines() if line.startswith("ring ") and " p=" in line)


@pytest.mark.skipif(emulator.compiler() is None, reason="no C++ compiler for the emulator")
def test_blockwise_attention_on_the_gpu_branches(monkeypatch):
    """The products of the merge and of its backward (query rows of a block, transposed keys)
    through the GPU kernel's plan, run by its CPU emulator, with the GPU's plain reductions."""
    expected = _pair(0.2, BLOCKS["zigzag chunks"])
    products = []

    def kernel(a, b, out=None):
        products.append(gemm.plan(a, b, numpy))
        return emulator.matmul(a, b, out=out)

    monkeypatch.setattr(backend, "DEVICE", "cuda")  # the GPU's branches, on NumPy arrays
    monkeypatch.setattr(gemm, "matmul", kernel)
    for got, want in zip(_pair(0.2, BLOCKS["zigzag chunks"]), expected):
        assert numpy.abs(got - want).max() < 1e-13
    assert len(products) > 10 and any(p.b.trans for p in products)
