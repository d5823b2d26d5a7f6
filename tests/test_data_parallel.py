"""Data parallelism's loss: L = (1/N) * sum over all ranks' tokens of l_i, N the step's counted
targets. Each rank sums its own (``reduction="sum"``) and ``scale_loss`` divides by the global N,
so a rank whose targets are all ignored adds a zero, and a step with none counted is an error on
every rank alike.

On ranks against the single-device run: tests/mpi/data_parallel_ignored.py.
"""

import numpy as np
import pytest

from minipar.autograd import Tensor
from minipar.parallel.data import scale_loss, token_count


class Summing:
    """What token_count asks of a communicator: an all-reduce, here over ranks holding ``counts``."""

    def __init__(self, *others):
        self.others = others

    def all_reduce(self, array, op="sum"):
        return array + sum(self.others)


def test_a_share_is_the_sum_over_the_global_count():
    loss_sum = Tensor(np.array(6.0), requires_grad=True)
    share = scale_loss(loss_sum, 4)
    share.backward()
    assert share.item() == 1.5 and loss_sum.grad == 0.25


def test_the_count_is_of_targets_not_ignored_over_the_ranks():
    ys = np.array([[1, -1, 2], [-1, -1, 0]])
    assert token_count(ys) == 3 and token_count(ys, ignore_index=0) == 5
    assert token_count(ys, comm=Summing(4, 2)) == 9
    assert token_count(np.full((2, 3), -1), comm=Summing(0)) == 0


def test_a_step_with_no_counted_target_is_an_error():
    with pytest.raises(ValueError, match="all equal ignore_index"):
        scale_loss(Tensor(np.array(0.0)), 0)


def test_a_rank_whose_targets_are_all_ignored_adds_zero_on_two_ranks():
    from mpi_run import check_mpi

    assert "ignored-rank data parallel OK on 2 ranks" in check_mpi(2, "data_parallel_ignored.py", timeout=120)
