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


def test_a_gradient_hook_fires_once_after_every_use_even_two_by_one_op():
    """Data parallelism starts a bucket's sum from the hook: it must see the whole gradient. w feeds
    w * w (both inputs of one node, which backward reaches first) and w * 3."""
    w, x = leaf(3), leaf(3, seed=1)
    seen = []
    w.register_grad_hook(lambda t: seen.append(t.grad.copy()))
    ((w * 3.0).sum() + (w * w * x).sum()).backward()
    assert len(seen) == 1
    numpy.testing.assert_array_equal(seen[0], w.grad)
    numpy.testing.assert_allclose(w.grad, 3.0 + 2 * w.data * x.data, rtol=1e-12)


@pytest.mark.parametrize("through_an_op", [False, True])
def test_backward_never_keeps_the_callers_upstream_array(through_an_op):
    """x.grad is the engine's own array: changing the gradient handed to backward() afterwards, as
    a loop reusing its buffer does, leaves it alone (a leaf's backward, and x + 1's, which passes
    its upstream gradient straight on)."""
    x = leaf(3)
    g = numpy.full(3, 0.5)
    (x + 1.0 if through_an_op else x).backward(g)
    g[...] = 9.0
    numpy.testing.assert_array_equal(x.grad, numpy.full(3, 0.5))


class _NoGradient(Function):
    """Passes its input on and sends no gradient back (as integer inputs get)."""

    @staticmethod
    def forward(ctx, a):
        return a.copy()

    @staticmethod
    def backward(ctx, grad):
        return (None,)


def test_a_branch_no_gradient_flows_through_is_freed_too():
    x = leaf(3)
    h = x * 2.0
    node = h._node
    (_NoGradient.apply(h) + x).sum().backward()
    assert node.ctx is None, "the graph behind a branch that received no gradient was kept"
    numpy.testing.assert_array_equal(x.grad, numpy.ones(3))


def test_no_grad_nests_and_detach_leaves_the_graph():
    from minipar.autograd import is_grad_enabled

    with no_grad():
        with no_grad():
            pass
        assert not is_grad_enabled(), "leaving the inner no_grad turned recording back on"
    assert is_grad_enabled()
    x = leaf(2)
    assert not x.detach().requires_grad and x.detach()._node is None


def test_reverse_subtraction_subtracts_the_tensor_from_the_number():
    x = Tensor(numpy.array([1.0, 5.0]), requires_grad=True, dtype=numpy.float64)
    y = 2.0 - x
    numpy.testing.assert_array_equal(y.data, [1.0, -3.0])
    y.backward(numpy.ones(2))
    numpy.testing.assert_array_equal(x.grad, [-1.0, -1.0])


def test_a_parameter_shared_by_two_modules_is_listed_once():
    """A tied weight (GPT-2's embedding and head) is one parameter: listed twice, an optimizer would
    step it twice and a norm count it twice."""
    from minipar import nn

    m = nn.Module()
    m.a, m.b = nn.Linear(2, 2), nn.Linear(2, 2)
    m.b.weight = m.a.weight
    assert [name for name, _ in m.named_parameters()] == ["a.weight", "a.bias", "b.bias"]


def test_a_second_backward_into_a_freed_graph_changes_no_gradient_before_it_raises():
    """b shares y with a, whose backward freed y's node: b's backward must refuse before its own
    nodes have handed u any gradient (it refused only on reaching y, with u.grad already set)."""
    x, u = leaf(3), leaf(3, seed=1)
    y = x * 2.0
    (y * 3.0).sum().backward()
    with pytest.raises(RuntimeError, match="freed by an earlier backward"):
        (y * u).sum().backward()
    assert u.grad is None
