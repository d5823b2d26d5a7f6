"""The engine itself: accumulation, broadcasting, deep graphs, no_grad, freeing, dtype guards."""

import sys

import numpy
import pytest

import minipar.functional as F
from minipar import Tensor, no_grad
from minipar.autograd import Function


def leaf(*shape, seed=0, dtype=numpy.float64):
    data = numpy.random.default_rng(seed).standard_normal(shape)
    return Tensor(data, requires_grad=True, dtype=dtype)


def test_gradients_accumulate_when_a_tensor_is_used_twice():
    w = leaf(3, 3)
    x = leaf(2, 3, seed=1)
    out = F.linear(x, w) + F.matmul(x, F.transpose(w))  # w used twice, as in a tied weight
    g = numpy.random.default_rng(2).standard_normal(out.shape)
    out.backward(g)
    # d/dw of x w^T is g^T x; of x w^T again (transposed use, same thing) is g^T x
    numpy.testing.assert_allclose(w.grad, g.T @ x.data + (x.data.T @ g).T, rtol=1e-12)


def test_backward_twice_accumulates_into_grad():
    x = leaf(4)
    (x * 2.0).sum().backward()
    (x * 3.0).sum().backward()
    numpy.testing.assert_allclose(x.grad, numpy.full(4, 5.0))


def test_broadcast_gradients_are_summed_to_the_input_shape():
    a, b, c = leaf(2, 3, 4), leaf(3, 1, seed=1), leaf(4, seed=2)
    out = a * b + c
    out.backward(numpy.ones(out.shape))
    assert b.grad.shape == (3, 1) and c.grad.shape == (4,)
    numpy.testing.assert_allclose(b.grad[:, 0], a.data.sum(axis=(0, 2)), rtol=1e-12)
    numpy.testing.assert_allclose(c.grad, numpy.full(4, 6.0))


def test_deep_graph_needs_no_recursion():
    x = leaf(3)
    y = x
    for _ in range(3 * sys.getrecursionlimit()):
        y = y * 1.0001
    y.sum().backward()
    numpy.testing.assert_allclose(x.grad, numpy.full(3, 1.0001 ** (3 * sys.getrecursionlimit())), rtol=1e-9)


def test_shared_gradients_are_never_aliased():
    # a + b hands the same gradient array to a and b; scaling a.grad in place must not touch b.grad
    a, b = leaf(5), leaf(5, seed=1)
    (a + b).backward(numpy.ones(5))
    a.grad *= 10.0
    numpy.testing.assert_array_equal(b.grad, numpy.ones(5))


def test_no_grad_records_nothing():
    x = leaf(3)
    with no_grad():
        y = x * 2.0
    assert not y.requires_grad and y._node is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()


def test_graph_is_freed_after_backward():
    x = leaf(3)
    y = F.exp(x)
    node = y._node
    z = y.sum()
    z.backward()
    assert node.ctx is None and node.inputs == ()
    with pytest.raises(RuntimeError, match="earlier backward"):
        z.backward()


def test_non_scalar_backward_needs_an_upstream_gradient():
    with pytest.raises(RuntimeError, match="needs grad="):
        (leaf(3) * 2.0).backward()
    with pytest.raises(ValueError, match="shape"):
        (leaf(3) * 2.0).backward(numpy.ones(4))


def test_unused_outputs_of_a_multi_output_op_get_zero_gradient():
    x = leaf(2, 6)
    _, middle, _ = F.split(x, 3, axis=1)
    middle.backward(numpy.ones((2, 2)))
    numpy.testing.assert_array_equal(x.grad, [[0, 0, 1, 1, 0, 0]] * 2)


def test_mixed_float_dtypes_are_refused():
    with pytest.raises(TypeError, match="float32 and float64"):
        leaf(3, dtype=numpy.float32) + leaf(3)


def test_numpy_float64_scalars_do_not_upcast_float32():
    x = leaf(3, dtype=numpy.float32)
    for y in (x * numpy.float64(0.5), numpy.float64(2.0) + x, x / numpy.float64(3.0), x - 1.5):
        assert y.dtype == numpy.float32


def test_a_backward_that_upcasts_is_caught():
    class Upcasting(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad.astype(numpy.float64) * 2

    x = leaf(3, dtype=numpy.float32)
    with pytest.raises(TypeError, match="silent upcast"):
        Upcasting.apply(x).sum().backward()


def test_a_backward_with_the_wrong_number_of_gradients_is_caught():
    class TwoForOne(Function):
        @staticmethod
        def forward(ctx, x):
            return x.copy()

        @staticmethod
        def backward(ctx, grad):
            return grad, grad

    with pytest.raises(RuntimeError, match="2 gradients for 1 inputs"):
        TwoForOne.apply(leaf(3)).sum().backward()


def test_tensor_construction_dtypes():
    assert Tensor([1.0, 2.0]).dtype == numpy.float32
    assert Tensor(numpy.arange(3)).dtype.kind == "i"  # ids stay integers
    with pytest.raises(TypeError, match="float"):
        Tensor(numpy.arange(3), requires_grad=True, dtype=numpy.int64)


def test_operators_and_reverse_operators():
    x = leaf(3)
    y = 2.0 - x
    y = 1.0 / (y * y + 1.0)
    y = -(y**2).reshape(1, 3) @ numpy.ones((3, 1))
    y.sum().backward()
    d = 2.0 - x.data
    r = 1.0 / (d * d + 1.0)
    # y = -r^2, dr/dx = 2 d / (d^2+1)^2 (the two minus signs cancel), so dy/dx = -2 r * dr/dx
    numpy.testing.assert_allclose(x.grad, -2 * r * (2 * d * r * r), rtol=1e-12)
