"""The communicators' checks and choices in one process, before any message: reductions the
wire format must get right, counts refused before they are sent, how a rank waits, and how a
process knows a launcher started it (the same code under mpiexec: test_mpi.py)."""

import pytest


def test_a_bfloat16_max_is_a_max_and_its_sum_a_sum():
    """bfloat16 travels as uint16 with a reduction of our own, which must apply the op asked for:
    a max all-reduce (the vocab-parallel loss's row maxima) computed as a sum is no maximum.
    Reduce_local applies the MPI reduction in this one process, as a peer's partial would."""
    import numpy

    from minipar.comm.buffers import reduction_op, wire
    from minipar.dtypes import bfloat16

    a, b = numpy.array([1, -2, 3.5], bfloat16), numpy.array([0.5, 4, -1], bfloat16)
    for op, expected in (("max", numpy.maximum(a, b)), ("sum", a + b)):
        into = b.copy()
        reduction_op(op, into.dtype).Reduce_local(wire(a), wire(into))
        assert numpy.array_equal(into, expected), (op, into, expected)


def test_an_unknown_reduction_is_refused_by_name():
    """A reduction op other than sum or max is a ValueError that lists the ops, not a KeyError."""
    import numpy

    from minipar.comm.mpi import world
    from minipar.dtypes import as_dtype

    for dtype in ("float32", "bfloat16"):
        with pytest.raises(ValueError, match=r"reduction op must be one of \['max', 'sum'\], got 'mean'"):
            world().all_reduce(numpy.ones(4, as_dtype(dtype)), op="mean")


def test_uneven_all_to_all_counts_are_checked_before_anything_is_sent():
    """all_to_all_v's counts are refused on the rank that holds them, before MPI sees them: a
    negative count, or a rank that sends itself other than it expects from itself (which MPI
    would not notice, or would notice only as a truncated message)."""
    import numpy

    from minipar.comm.base import all_to_all_v_plan

    x = numpy.zeros((3, 2))
    (sc, sd, rc, rd), shape, charged = all_to_all_v_plan(x, [1, 2], [1, 4], 0, 2)
    assert (sc.tolist(), sd.tolist(), rc.tolist(), rd.tolist()) == ([2, 4], [0, 2], [2, 8], [0, 2])
    assert shape == (5, 2) and charged == (2 * 16, 4 * 16)  # only the rows that cross to the other rank
    with pytest.raises(ValueError, match="non-negative send and receive counts"):
        all_to_all_v_plan(x, [4, -1], [4, 0], 0, 2)
    with pytest.raises(ValueError, match="non-negative send and receive counts"):
        all_to_all_v_plan(x, [1, 2], [1, -1], 0, 2)
    with pytest.raises(ValueError, match="rank 1 sends itself 2 rows but expects 1"):
        all_to_all_v_plan(x, [1, 2], [3, 1], 1, 2)


def test_ranks_wait_politely_only_when_they_outnumber_the_cores(monkeypatch):
    """A rank with a core to itself waits in MPI's blocking calls (the fastest way); only more
    ranks on a node than cores makes them wait politely, and then every rank of the job, since
    MPI never matches a blocking collective with a non-blocking one."""
    from minipar.comm import mpi

    class Node:
        def __init__(self, size):
            self.size = size

        def Get_size(self):
            return self.size

        def Free(self):
            pass

    class Comm:
        """This rank's node holds ``ranks_here`` ranks; the other ranks' choices all-reduce to ``others``."""

        def __init__(self, ranks_here, others=0):
            self.ranks_here, self.others = ranks_here, others

        def Split_type(self, kind):
            return Node(self.ranks_here)

        def Allreduce(self, _, buffer, op):
            assert op == mpi.MPI.MAX
            buffer[0] = max(buffer[0], self.others)

    monkeypatch.delenv("MINIPAR_WAIT", raising=False)
    monkeypatch.setattr(mpi, "usable_cores", lambda: 2)
    assert [mpi._must_be_polite(Comm(n)) for n in (1, 2, 3, 8)] == [False, False, True, True]
    assert mpi._must_be_polite(Comm(2, others=1))  # another node (or a pinned rank) must be polite
    monkeypatch.setenv("MINIPAR_WAIT", "polite")
    assert mpi._must_be_polite(Comm(1))
    monkeypatch.setenv("MINIPAR_WAIT", "blocking")
    assert not mpi._must_be_polite(Comm(8)) and mpi._must_be_polite(Comm(1, others=1))
    with pytest.raises(ValueError, match="MINIPAR_WAIT on another rank is not a way to wait"):
        mpi._must_be_polite(Comm(1, others=2))
    monkeypatch.setenv("MINIPAR_WAIT", "spin")
    with pytest.raises(ValueError, match="MINIPAR_WAIT='spin' is not a way to wait: use auto, polite or blocking"):
        mpi._must_be_polite(Comm(1))


def test_every_launchers_variable_marks_a_process_as_a_rank(monkeypatch):
    """MPICH's, Open MPI's and PMIx launchers each say so by a variable of their own: a rank that
    misses it would not start MPI first, and could hang the job by failing before MPI_Init."""
    from minipar import start

    for name in start.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not start.launched_by_mpi()
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.setenv(name, "0")
        assert start.launched_by_mpi(), name
        monkeypatch.delenv(name)
