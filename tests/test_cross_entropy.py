"""The vocabulary-parallel cross-entropy's edges on one rank (a world of 1: no MPI); across
ranks against the single-device loss: tests/mpi/tensor_parallel.py."""

import numpy as np
import pytest

import minipar.functional as F
from minipar import Tensor
from minipar.comm import world
from minipar.parallel.cross_entropy import vocab_parallel_cross_entropy


def test_sum_and_an_ignored_target_on_a_padding_column():
    """A vocabulary of 5 padded to 6 columns: an ignore_index of 5 names the padding column,
    whose logit is -inf; the ignored row must add nothing (it added inf * 0 = nan)."""
    rng = np.random.default_rng(0)
    logits, targets = rng.standard_normal((4, 6)), np.array([1, 5, 4, 0])
    for reduction in ("mean", "sum"):
        ours = Tensor(logits, requires_grad=True)
        loss = vocab_parallel_cross_entropy(ours, targets, world(), 0, 5, ignore_index=5, reduction=reduction)
        loss.backward()
        whole = Tensor(logits[:, :5], requires_grad=True)
        reference = F.cross_entropy(whole, targets, ignore_index=5, reduction=reduction)
        reference.backward()
        assert loss.item() == pytest.approx(reference.item(), rel=1e-14)
        np.testing.assert_allclose(ours.grad[:, :5], whole.grad, rtol=1e-13, atol=1e-15)
        assert not ours.grad[:, 5].any()


def test_a_share_with_every_target_ignored_sums_to_zero_and_bad_shapes_are_named():
    logits = Tensor(np.zeros((2, 4)), requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, np.array([-1, -1]), world(), 0, 4, reduction="sum")
    loss.backward()
    assert loss.item() == 0.0 and not logits.grad.any()
    with pytest.raises(ValueError, match="every target equals ignore_index, so the mean is undefined"):
        vocab_parallel_cross_entropy(logits, np.array([-1, -1]), world(), 0, 4)
    with pytest.raises(ValueError, match="1 ranks of 4 vocabulary columns do not hold a vocabulary of 10"):
        vocab_parallel_cross_entropy(logits, np.array([1, 8]), world(), 0, 10)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'max'"):
        vocab_parallel_cross_entropy(logits, np.array([1, 2]), world(), 0, 4, reduction="max")
