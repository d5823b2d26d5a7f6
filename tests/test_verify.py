"""The yardsticks the lessons and MPI tests compare parallel runs with (``minipar/verify.py``),
against values worked out by hand: a yardstick that reads too low passes every layout."""

import numpy
import pytest

from minipar.verify import as_one_vector, rel_err, worst_tensor


def test_rel_err_is_relative_to_the_reference_and_absolute_where_the_reference_is_zero():
    assert rel_err(numpy.array([3.0, 4.0]), numpy.array([0.0, 8.0])) == pytest.approx(5 / 8)  # ||(3, -4)|| / ||b||
    assert rel_err(numpy.array([0.0, 8.0]), numpy.array([3.0, 4.0])) == pytest.approx(5 / 5)  # not symmetric
    assert rel_err(numpy.array([0.0, 3.0, 4.0]), numpy.zeros(3)) == pytest.approx(5.0)  # nothing to divide by
    assert rel_err(numpy.arange(6.0), numpy.arange(6.0).reshape(2, 3)) == 0.0  # a flat copy of the reference


def test_worst_tensor_is_the_largest_error_of_any_tensor():
    reference = {"a": numpy.ones(4), "b": numpy.ones(4), "c": numpy.ones(4)}
    values = {"a": numpy.ones(4), "b": numpy.array([1.0, 1.0, 1.0, 3.0]), "c": numpy.full(4, 1.5)}
    assert worst_tensor(values, reference) == pytest.approx(1.0)  # b: ||(0, 0, 0, 2)|| / 2, not a's 0


def test_as_one_vector_pairs_each_tensor_with_its_reference_by_name_and_skips_none():
    reference = {"a": numpy.array([3.0]), "b": numpy.array([4.0, 0.0])}
    values = {"b": numpy.array([4.0, 0.0]), "a": numpy.array([3.0])}  # the same tensors, in another order
    assert as_one_vector(values, reference) == 0.0
    values["b"] = numpy.array([4.0, 10.0])
    assert as_one_vector(values, reference) == pytest.approx(10 / 5)  # one vector: ||(0, 0, 10)|| / ||(3, 4, 0)||
    with pytest.raises(KeyError):  # every tensor of the reference is compared: a missing one is not skipped
        as_one_vector({"a": numpy.array([3.0])}, reference)
