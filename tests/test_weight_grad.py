"""The backward split into B (input gradients) and W (weight gradients, later): for every op with
weights and for whole models, B then W equals the fused backward bit for bit (float64); W's
memory is counted; gradient hooks of the weights fire in W, once."""

from types import SimpleNamespace

import numpy
import pytest

import minipar
import minipar.functional as F
from minipar import Tensor
from minipar.models import GPT, GPTConfig
from minipar.models.moe import MoEMLP
from minipar.weight_grad import backward_input


def leaf(*shape, seed=0):
    return Tensor(numpy.random.default_rng(seed).standard_normal(shape), requires_grad=True, dtype=numpy.float64)


def fused_and_split(build, leaves, weights, seed=9):
    """Gradients of every leaf after a fused backward and after B then W, from the same forward
    ``build()``; asserts that B leaves the weights untouched and W the rest."""
    out = build()
    grad = numpy.random.default_rng(seed).standard_normal(out.shape)
    out.backward(grad)
    fused = [None if t.grad is None else t.grad.copy() for t in leaves]
    for t in leaves:
        t.grad = None
    out = build()
    pending = backward_input(out, weights, grad)
    assert all(w.grad is None for w in weights), "B computed a weight's gradient"
    before_w = [None if t.grad is None else t.grad.copy() for t in leaves]
    pending.run()
    split = [None if t.grad is None else t.grad for t in leaves]
    for t, b, s in zip(leaves, before_w, split):
        if not any(t is w for w in weights):
            assert b is s or numpy.array_equal(b, s), "W changed a gradient that is not a weight's"
    return fused, split


def assert_bitwise(fused, split):
    for a, b in zip(fused, split):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype == numpy.float64
            assert numpy.array_equal(a, b), f"max difference {numpy.abs(a - b).max()}"


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    x, w, b = leaf(2, 3, 5), leaf(4, 5, seed=1), leaf(4, seed=2)
    weights = [w, b] if bias else [w]
    assert_bitwise(*fused_and_split(lambda: F.linear(x, w, b if bias else None), [x] + weights, weights))


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(bias):
    x, w, b = leaf(3, 2, 6), leaf(6, seed=1), leaf(6, seed=2)
    weights = [w, b] if bias else [w]
    assert_bitwise(*fused_and_split(lambda: F.layer_norm(x, w, b if bias else None) * x,
                                    [x] + weights, weights))


def test_embedding_with_repeated_ids():
    ids = numpy.array([[1, 3, 1], [0, 3, 3]])
    w = leaf(5, 4)
    assert_bitwise(*fused_and_split(lambda: F.embedding(ids, w) * 2.0, [w], [w]))


def test_matmul_with_a_shared_weight():
    x, w = leaf(2, 3, 4), leaf(4, 6, seed=1)
    assert_bitwise(*fused_and_split(lambda: F.tanh(F.matmul(x, w)), [x, w], [w]))


def test_a_weight_used_twice_accumulates_in_the_fused_order():
    x, w = leaf(3, 4), leaf(4, 4, seed=1)
    build = lambda: F.linear(F.tanh(F.linear(x, w)), w) + F.matmul(x, F.transpose(w))  # noqa: E731
    assert_bitwise(*fused_and_split(build, [x, w], [w]))


def test_moe_layer(float64):
    minipar.manual_seed(0)
    moe = MoEMLP(SimpleNamespace(n_embd=4, bias=True, n_layer=2, dropout=0.0), 3, 2,
                 aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = leaf(2, 5, 4)
    weights = moe.parameters()

    def build():
        y = moe(x)
        return (y * y).sum() + moe.aux_loss + moe.z_loss

    assert_bitwise(*fused_and_split(build, [x] + weights, weights))


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_gpt_full_backward_split_gives_identical_gradients(float64, recompute):
    minipar.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab_size=11, dropout=0.1),
                recompute_granularity=recompute)
    rng = numpy.random.default_rng(0)
    idx, targets = rng.integers(0, 11, (3, 6)), rng.integers(0, 11, (3, 6))
    start = model.rng.state()

    def loss():
        model.rng.set_state(start)  # the same dropout masks in both runs
        return model(idx, targets)[1]

    params = model.parameters()
    fused, split = fused_and_split(loss, params, params)
    assert_bitwise(fused, split)
    assert all(g is not None for g in split)


def test_w_memory_is_the_input_and_the_output_gradient():
    x, w, b = leaf(7, 5), leaf(4, 5, seed=1), leaf(4, seed=2)
    h = F.tanh(x)  # so that the linear's input is an activation, not a leaf
    out = F.linear(h, w, b)
    pending = backward_input(out, [w, b], numpy.ones(out.shape))
    assert len(pending) == 1
    # dW = g^T x needs the linear's input (7, 5) and its output gradient (7, 4); the weight is not counted
    assert pending.nbytes() == 8 * (7 * 5 + 7 * 4)
    pending.run()
    assert len(pending) == 0 and pending.nbytes() == 0
    numpy.testing.assert_array_equal(b.grad, numpy.full(4, 7.0))


def test_w_keeps_no_activation_input_alive():
    """A LayerNorm's W needs its normalised input and output gradient, not its input: parked with
    its input tensor, the residual stream (and through its node every array before it) would stay
    alive until W. After B and the graph dropped, nothing holds that input."""
    import gc
    import weakref
    x, g, b = leaf(6, 5), leaf(5, seed=1), leaf(5, seed=2)
    h = F.tanh(x)  # an activation, made by a node, as the residual stream is
    seen = weakref.ref(h)
    out = F.layer_norm(h, g, b)
    pending = backward_input(out, [g, b], numpy.ones(out.shape))
    del h, out
    gc.collect()
    assert seen() is None, "W's parked LayerNorm keeps its input alive"
    pending.run()
    assert g.grad is not None and b.grad is not None


def test_an_add_of_a_weight_splits_as_it_fuses():
    """x 2 + b, b a weight: Add's backward hands b's gradient out whatever it was asked, so B must
    drop it and W alone add it (else b's gradient counts twice)."""
    x, b = leaf(3), leaf(3, seed=1)
    assert_bitwise(*fused_and_split(lambda: (x * 2.0 + b) * (x * 2.0 + b), [x, b], [b]))


def test_w_memory_counts_two_views_of_one_input_once():
    """Two products read the same activation, one through a reshape (a view): the buffer W keeps
    is counted once, as is the one upstream gradient both read (the sum passes it to each)."""
    x, w1, w2 = leaf(7, 5), leaf(4, 5, seed=1), leaf(4, 5, seed=2)
    h = F.tanh(x)
    out = F.linear(h, w1) + F.linear(h.reshape(7, 1, 5), w2).reshape(7, 4)
    pending = backward_input(out, [w1, w2], numpy.ones(out.shape))
    assert len(pending) == 2 and pending.nbytes() == 8 * (7 * 5 + 7 * 4)


def test_hooks_of_weights_fire_once_in_w():
    x, w = leaf(3, 4), leaf(4, 4, seed=1)
    fired = []
    w.register_grad_hook(lambda t: fired.append(t.grad.copy()))
    out = F.linear(F.tanh(F.linear(x, w)), w)
    pending = backward_input(out, [w], numpy.ones(out.shape))
    assert fired == [] and x.grad is not None
    pending.run()
    assert len(fired) == 1 and numpy.array_equal(fired[0], w.grad)


def test_weights_must_be_leaves():
    w = leaf(2, 2)
    with pytest.raises(ValueError, match="leaves"):
        backward_input(F.tanh(w).sum(), [F.tanh(w)])
