"""Tensor parallelism at its edges (odd sizes, padding, ignored -inf rows, rank-ordered sequence
parallelism) against one device, on 2 and 4 ranks: tests/mpi/tensor_parallel_edges.py."""

import pytest

from mpi_run import check_mpi


@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_edges_match_one_device(n):
    assert f"tensor parallel edges OK on {n} ranks" in check_mpi(n, "tensor_parallel_edges.py", timeout=180)
