"""The grid's rank arithmetic (no MPI needed), and the 1 x 1 x 1 grid without a launcher."""

import numpy
import pytest

from minipar import Tensor
from minipar.parallel import Layout, ProcessGrid
from minipar.parallel import collectives as C


def test_sixteen_ranks_tp2_pp4_as_megatron_lays_them_out():
    lay = Layout(tp=2, pp=4, dp=2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lay.groups("embedding") == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert lay.embedding_group(6) is None
    table = lay.table()
    assert "tp groups        [0, 1] [2, 3]" in table and "pp groups        [0, 4, 8, 12]" in table


def test_coordinates_round_trip():
    lay = Layout(tp=2, pp=3, dp=4, cp=3)
    for r in range(lay.world_size):
        t, c, d, p = lay.coords(r)
        assert lay.rank(tp=t, cp=c, dp=d, pp=p) == r
        assert r == t + c * 2 + d * 2 * 3 + p * 2 * 3 * 4  # Megatron-core: TP fastest, then CP, DP, PP


def test_context_parallel_ranks_sit_between_tensor_and_data_parallel_ones():
    lay = Layout(tp=2, pp=1, dp=2, cp=2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # the ranks that sum one weight's gradient
    assert lay.ranks(6) == {"tp": 0, "cp": 1, "dp": 1, "pp": 0, "dp_cp": 3, "ep": 0, "edp": 3, "embedding": 0}
    assert "cp groups        [0, 2] [1, 3]" in lay.table()


def test_layout_sizes_are_checked():  # a model on a grid: tests/test_validate.py
    with pytest.raises(ValueError, match="TP size must be an integer >= 1"):
        Layout(0, 1, 1)


def test_single_device_grid_needs_no_launcher():
    grid = ProcessGrid()
    assert (grid.tp, grid.pp, grid.dp) == (1, 1, 1)
    assert grid.tp_group.size == grid.dp_group.size == grid.pp_group.size == 1
    assert grid.is_first_stage and grid.is_last_stage and grid.next_stage is None
    with pytest.raises(ValueError, match="launch with -n 2"):
        ProcessGrid(tp=2, pp=1, dp=1)
    with pytest.raises(ValueError, match="1 ranks do not split into TP x PP = 2 x 1 groups"):
        ProcessGrid(tp=2, pp=1)


def test_region_collectives_on_one_rank_are_identities():
    comm = ProcessGrid().tp_group
    x = Tensor(numpy.arange(12.0).reshape(1, 4, 3), requires_grad=True)
    for op in (C.copy_to_region, C.reduce_from_region, C.gather_from_region, C.scatter_to_region,
               C.gather_from_sequence_region, C.reduce_scatter_to_sequence_region,
               C.scatter_to_sequence_region):
        x.grad = None
        y = op(x, comm)
        y.backward(numpy.ones(y.shape, numpy.float32))
        numpy.testing.assert_array_equal(y.data, x.data)
        numpy.testing.assert_array_equal(x.grad, numpy.ones(x.shape))


def test_a_scattered_slice_is_a_copy_the_caller_may_keep():
    comm = ProcessGrid().tp_group
    x = numpy.arange(12.0, dtype=numpy.float32).reshape(1, 4, 3)
    for op in (C.scatter_to_region, C.scatter_to_sequence_region):
        whole = x.copy()
        y = op(Tensor(whole), comm)
        whole[...] = -1  # the caller reuses its array (one rank's slice is all of it)
        numpy.testing.assert_array_equal(y.data, x)


def test_polite_wait_yields_then_sleeps_with_growing_naps(monkeypatch):
    from minipar.comm import base

    clock = [0.0]
    yields, naps = [], []
    monkeypatch.setattr(base.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(base.os, "sched_yield", lambda: (yields.append(1), clock.__setitem__(0, clock[0] + 1e-3)))
    monkeypatch.setattr(base.time, "sleep", naps.append)
    polls = iter([False] * 20 + [True])
    base.wait_without_spinning(lambda: next(polls))
    assert len(yields) == 5  # 5 ms of yielding at 1 ms per yield on this fake clock
    assert naps[0] == base.FIRST_NAP and max(naps) == base.MAX_NAP
    assert all(b >= a for a, b in zip(naps, naps[1:]))


def test_sequence_collectives_need_batch_sequence_hidden():
    comm = ProcessGrid().tp_group
    with pytest.raises(ValueError, match=r"\(batch, sequence, hidden\)"):
        C.gather_from_sequence_region(Tensor(numpy.ones((4, 3))), comm)
    with pytest.raises(ValueError, match=r"\(batch, sequence, hidden\)"):
        C.gather_tokens_from_sequence_region(Tensor(numpy.ones((4, 3))), comm)
    with pytest.raises(ValueError, match=r"in rank order, N = 1, got shape \(2, 1, 4, 3\)"):
        C.reduce_scatter_tokens_to_sequence_region(Tensor(numpy.ones((2, 1, 4, 3))), comm)


def test_the_mlp_keeps_sequence_parallel_tokens_in_rank_order():
    """On one rank the rank-order pair only adds and drops the leading axis of one rank; rank_order
    needs sequence parallelism."""
    from minipar.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    comm = ProcessGrid().tp_group
    x = Tensor(numpy.arange(12.0).reshape(1, 4, 3), requires_grad=True)
    stacked = C.gather_tokens_from_sequence_region(x, comm)
    y = C.reduce_scatter_tokens_to_sequence_region(stacked * 2.0, comm)
    y.backward(numpy.ones(y.shape, numpy.float32))
    assert stacked.shape == (1, 1, 4, 3) and y.shape == x.shape
    numpy.testing.assert_array_equal(y.data, 2 * x.data)
    numpy.testing.assert_array_equal(x.grad, numpy.full(x.shape, 2.0))
    for make in (lambda: ColumnParallelLinear(3, 4, comm, rank_order=True),
                 lambda: RowParallelLinear(4, 3, comm, rank_order=True),
                 lambda: ColumnParallelLinear(3, 4, comm, sequence_parallel=True, gather_output=True, rank_order=True)):
        with pytest.raises(ValueError, match="rank_order keeps a sequence-parallel layer's gathered tokens"):
            make()


def test_a_sequence_parallel_embedding_needs_a_sequence_that_splits_over_its_ranks():
    """Every rank holds the same ids, so every rank raises before the reduce-scatter."""
    import types

    from minipar.parallel.tensor import VocabParallelEmbedding

    embedding = VocabParallelEmbedding(64, 8, types.SimpleNamespace(rank=0, size=2), sequence_parallel=True)
    with pytest.raises(ValueError, match="a sequence of 5 tokens does not split over 2 sequence-parallel ranks"):
        embedding(numpy.zeros((2, 5), numpy.int64))
    with pytest.raises(ValueError, match=r"takes \(batch, sequence\) ids, got shape \(8,\)"):
        embedding(numpy.zeros(8, numpy.int64))


def test_grid_sizes_are_checked_for_type():
    with pytest.raises(ValueError, match="ProcessGrid: TP must be a positive integer, got '1'"):
        ProcessGrid(tp="1", pp=1)


def test_expert_parallel_groups_are_carved_out_of_data_and_context_parallel_ones():
    """EP fastest within DP x CP (Megatron-core): an EP group is EP consecutive DP x CP ranks, CP
    first, and the ranks with the same EP rank across DP x CP hold the same experts (the edp group)."""
    lay = Layout(tp=2, pp=1, dp=4, ep=2)
    assert lay.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.ranks(6)["ep"] == 1 and lay.ranks(6)["edp"] == 1
    with_cp = Layout(tp=1, pp=1, dp=4, cp=2, ep=2)  # the two halves of a sequence hold other experts
    assert with_cp.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert with_cp.groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    across = Layout(tp=2, pp=1, dp=2, cp=2, ep=4)  # EP over all of DP x CP: every expert once per TP rank
    assert across.groups("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]] and across.groups("edp") == [[r] for r in range(8)]
    for lay in (with_cp, across, Layout(tp=1, pp=1, dp=2, cp=4, ep=2)):
        for r in range(lay.world_size):  # every rank's index in its groups is its place in the group's list
            for kind in ("ep", "edp"):
                assert getattr(lay, f"{kind}_group")(r).index(r) == lay.ranks(r)[kind]
        for r in range(lay.world_size):  # the EP groups and the edp groups cut each DP x CP group
            assert sorted(a for e in lay.ep_group(r) for a in lay.edp_group(e)) == lay.dp_cp_group(r)
    assert Layout(1, 1, 4).groups("edp") == Layout(1, 1, 4).groups("dp_cp")
    with pytest.raises(ValueError, match=r"EP=3 does not divide DP x CP = 4 x 1"):
        Layout(1, 1, 4, ep=3)
    with pytest.raises(ValueError, match=r"EP=4 does not divide DP x CP = 1 x 2"):
        Layout(1, 1, 1, cp=2, ep=4)


def test_comm_stats_tally_ring_collectives_and_charge_them_when_read():
    from minipar.comm.stats import CommStats, ring_bytes

    stats = CommStats(3)
    held = stats.tallies["all_reduce"]  # what a communicator's direct path adds to
    held.calls += 1
    held.nbytes += 10
    stats.count("all_reduce", 11)
    stats.count("broadcast", 8, rank=0, root=0)  # the root of 3: it sends, receives nothing
    stats.record("send", 5, 0)
    by_op = stats.by_op
    # the model charges the calls' bytes together: 2 (N-1)/N of 21, rounded down once (28, where
    # two calls rounded apart would be 13 + 14 = 27)
    assert (by_op["all_reduce"].calls, by_op["all_reduce"].bytes_sent, by_op["all_reduce"].bytes_received) == (2, 28, 28)
    assert ring_bytes("all_gather", 10, 4) == (7, 7)  # (N-1) S / N rounded once, not (N-1) (S // N) = 6
    assert (by_op["broadcast"].bytes_sent, by_op["broadcast"].bytes_received) == ring_bytes("broadcast", 8, 3, True) == (8, 0)
    assert (by_op["send"].calls, by_op["send"].bytes_sent) == (1, 5)
    assert set(by_op) == {"all_reduce", "broadcast", "send"} and by_op["all_gather"].calls == 0
    by_op["all_reduce"].calls = 99  # a copy: reading cannot change the count
    assert stats.by_op["all_reduce"].calls == 2 and stats.total().bytes_sent == 28 + 8 + 5
    assert stats.total().bytes_received == 28 + 0 + 0  # the root receives nothing, a send nothing back
    stats.reset()
    assert not stats.by_op and stats.total().calls == 0
    assert stats.tallies["all_reduce"] is held and held.calls == held.nbytes == 0  # zeroed where it is held
    held.calls += 1
    held.nbytes += 6
    assert stats.by_op["all_reduce"].bytes_sent == 8


def test_a_broadcast_is_charged_rank_by_rank_along_the_chain_from_its_root():
    """Root 1 of 4: every rank but the root receives S, every rank but the root's left neighbour
    (rank 0, the chain's end) passes it on; at 4 ranks no two of them coincide."""
    from minipar.comm.stats import CommStats

    charged = []
    for rank in range(4):
        stats = CommStats(4)
        stats.count("broadcast", 800, rank=rank, root=1)
        charged.append((stats.by_op["broadcast"].bytes_sent, stats.by_op["broadcast"].bytes_received))
    assert charged == [(0, 800), (800, 0), (800, 800), (800, 800)]
