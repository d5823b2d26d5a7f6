"""Every op's backward against central differences (float64, random upstream gradient), and
float32 in -> float32 out for every op, forward and backward."""

import numpy
import pytest

import minipar.functional as F
from minipar import Tensor
from minipar.autograd import Function
from minipar.gradcheck import gradcheck, op_cases

CASES = {name: (fn, inputs) for name, fn, inputs in op_cases()}


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_matches_central_differences(name):
    fn, inputs = CASES[name]
    reports = gradcheck(fn, inputs)
    for r in reports:
        assert r.checked > 0
        assert r.ok, f"{name}: {r}"


@pytest.mark.parametrize("name", list(CASES))
def test_float32_in_float32_out(name):
    fn, inputs = op_cases(seed=1)[list(CASES).index(name)][1:]
    inputs32 = [Tensor(t.data.astype(numpy.float32), requires_grad=True) for t in inputs]
    out = fn(*inputs32)
    assert out.dtype == numpy.float32, f"{name} forward returned {out.dtype}"
    out.backward(numpy.ones(out.shape, numpy.float32) * 0.5)
    for t in inputs32:
        assert t.grad is not None and t.grad.dtype == numpy.float32, name
        assert t.grad.shape == t.shape


class WrongGELU(Function):
    """GELU with a plausible-looking mistake: the derivative of tanh taken as 1 instead of 1 - t^2."""

    @staticmethod
    def forward(ctx, x):
        c, a = numpy.sqrt(2 / numpy.pi), 0.044715
        ctx.x, ctx.t = x, numpy.tanh(c * (x + a * x**3))
        return 0.5 * x * (1 + ctx.t)

    @staticmethod
    def backward(ctx, grad):
        x, t = ctx.x, ctx.t
        c, a = numpy.sqrt(2 / numpy.pi), 0.044715
        return grad * (0.5 * (1 + t) + 0.5 * x * c * (1 + 3 * a * x * x))


class SumOnlyMatMul(Function):
    """A matmul backward that is right only for an all-ones upstream gradient: it uses the row
    sums of the gradient instead of the gradient (a check with ``.sum()`` would pass it)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.a, ctx.b = a, b
        return a @ b

    @staticmethod
    def backward(ctx, grad):
        ones = numpy.ones_like(grad) * grad.mean()
        return ones @ ctx.b.T, ctx.a.T @ ones


def _t(*shape, seed=0):
    return Tensor(numpy.random.default_rng(seed).standard_normal(shape), requires_grad=True, dtype=numpy.float64)


def test_negative_control_wrong_backward_is_caught():
    reports = gradcheck(WrongGELU.apply, [_t(4, 5)])
    assert not reports[0].ok
    assert reports[0].rel_err > 1e-3


def test_random_upstream_gradient_catches_what_sum_would_not():
    a, b = _t(3, 4, seed=1), _t(4, 2, seed=2)
    # with an all-ones upstream gradient the wrong backward is right ...
    out = SumOnlyMatMul.apply(a, b)
    out.backward(numpy.ones(out.shape))
    a_ones = a.grad.copy()
    a.grad = None
    F.matmul(a, b).backward(numpy.ones(out.shape))
    numpy.testing.assert_allclose(a_ones, a.grad)
    # ... and the checker, which uses a random one, still catches it
    assert not all(r.ok for r in gradcheck(SumOnlyMatMul.apply, [a, b]))


def test_gradcheck_rejects_float32():
    with pytest.raises(TypeError, match="float64"):
        gradcheck(F.exp, [Tensor(numpy.ones(3, numpy.float32), requires_grad=True)])


def test_embedding_gradient_counts_every_occurrence():
    w = Tensor(numpy.zeros((4, 2)), requires_grad=True)
    ids = numpy.array([1, 1, 1, 3])
    F.embedding(ids, w).backward(numpy.ones((4, 2), numpy.float32))
    numpy.testing.assert_array_equal(w.grad[:, 0], [0, 3, 0, 1])


def test_softmax_is_stable_for_large_logits():
    x = Tensor(numpy.array([[1000.0, 1001.0, 999.0]]), requires_grad=True)
    for out in (F.softmax(x), F.exp(F.log_softmax(x))):
        assert numpy.all(numpy.isfinite(out.data))
        numpy.testing.assert_allclose(out.data.sum(), 1.0, rtol=1e-6)
    loss = F.cross_entropy(Tensor(numpy.array([[1e4, 0.0, -1e4]])), numpy.array([2]))
    assert numpy.isfinite(loss.item()) and loss.item() == pytest.approx(2e4, rel=1e-6)


def test_each_row_is_shifted_by_its_own_max():
    """Rows a thousand apart: a max taken over the whole batch would underflow the low row to 0/0."""
    x = Tensor(numpy.array([[0.0, 1.0], [-1000.0, -999.0]]), requires_grad=True)
    for out in (F.softmax(x), F.exp(F.log_softmax(x))):
        numpy.testing.assert_allclose(out.data[1], out.data[0], rtol=1e-12)
    loss = F.cross_entropy(x, numpy.array([1, 1]))
    loss.backward()
    assert loss.item() == pytest.approx(numpy.log1p(numpy.exp(-1.0)), rel=1e-6)  # float32
    assert numpy.all(numpy.isfinite(x.grad)) and numpy.allclose(x.grad[0], x.grad[1], rtol=1e-12)


def test_cross_entropy_means_over_non_ignored_targets_only():
    logits = numpy.random.default_rng(0).standard_normal((2, 3, 5)).astype(numpy.float32)
    targets = numpy.array([[1, -1, 2], [-1, -1, 4]])
    loss = F.cross_entropy(Tensor(logits), targets).item()
    logp = logits - numpy.log(numpy.exp(logits).sum(-1, keepdims=True))
    expected = -(logp[0, 0, 1] + logp[0, 2, 2] + logp[1, 2, 4]) / 3
    assert loss == pytest.approx(float(expected), rel=1e-6)


def test_cross_entropy_errors_name_the_problem():
    logits = Tensor(numpy.zeros((2, 4)))
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        F.cross_entropy(logits, numpy.array([1, 4]))
    with pytest.raises(ValueError, match="ignore_index"):
        F.cross_entropy(logits, numpy.array([-1, -1]))
    with pytest.raises(ValueError, match="do not match"):
        F.cross_entropy(logits, numpy.array([1, 2, 3]))


def test_dropout_is_identity_when_off_and_seeded_when_on():
    x = Tensor(numpy.ones((50, 40)), requires_grad=True)
    assert F.dropout(x, 0.0) is x
    assert F.dropout(x, 0.5, training=False) is x
    a = F.dropout(x, 0.25, key=(1, 0)).data
    b = F.dropout(x, 0.25, key=(1, 0)).data
    assert not numpy.array_equal(a, F.dropout(x, 0.25, key=(1, 1)).data)
    numpy.testing.assert_array_equal(a, b)
    kept = a != 0
    assert 0.7 < kept.mean() < 0.8  # 2000 draws with p = 0.25
    numpy.testing.assert_allclose(a[kept], 1 / 0.75, rtol=1e-6)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        F.dropout(x, 1.0)


def test_layer_norm_normalises():
    x = Tensor(numpy.random.default_rng(0).standard_normal((4, 64)) * 3 + 2)
    y = F.layer_norm(x, Tensor(numpy.ones(64)), Tensor(numpy.zeros(64))).data
    numpy.testing.assert_allclose(y.mean(-1), 0, atol=1e-6)
    numpy.testing.assert_allclose(y.var(-1), 1, rtol=1e-4)


@pytest.mark.parametrize("dtype,rtol,atol", [(numpy.float64, 1e-12, 1e-14), (numpy.float32, 2e-5, 1e-6)])
def test_gelu_in_place_chains_equal_the_plain_formula(dtype, rtol, atol):
    """GELU runs in place, block by block in cache, as x sigmoid(2z); ``gelu_reference`` is the tanh
    formula as it reads, evaluated in float64 at the same inputs. In float32 both ways round
    alike: the derivative is off by ~1e-6 near x = 6 (1 - t^2, or 1 - s, cancels), the value by ~5e-7."""
    from minipar.functional.gelu import gelu_backward_reference, gelu_reference

    x = numpy.linspace(-6, 6, 200_001)  # long enough to cross several blocks
    numpy.testing.assert_allclose(gelu_reference(x),
                                  0.5 * x * (1 + numpy.tanh(numpy.sqrt(2 / numpy.pi) * (x + 0.044715 * x**3))),
                                  rtol=1e-12, atol=1e-15)
    x = x.astype(dtype)
    rng = numpy.random.default_rng(1)
    far = numpy.array([-1e4, -40.0, -8.0, 8.0, 40.0, 1e4])  # exp(-2z) = inf and 0
    for data in (x, (rng.standard_normal((300, 500)) * 3).astype(dtype)[:, ::2], far.astype(dtype)):
        t = Tensor(data, requires_grad=True, dtype=dtype)
        y = F.gelu(t)
        upstream = rng.standard_normal(data.shape).astype(dtype)
        y.backward(upstream)
        assert y.data.dtype == t.grad.dtype == dtype
        wide = data.astype(numpy.float64)
        numpy.testing.assert_allclose(y.data, gelu_reference(wide), rtol=rtol, atol=atol)
        numpy.testing.assert_allclose(t.grad, gelu_backward_reference(wide, upstream.astype(numpy.float64)),
                                      rtol=rtol, atol=atol)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_blas_row_sums_equal_the_plain_formula(bias):
    from minipar.functional.reduction import layer_norm_reference

    rng = numpy.random.default_rng(2)
    x = rng.standard_normal((3, 5, 96)) * 3 + 2
    w, b, g = rng.standard_normal(96), rng.standard_normal(96), rng.standard_normal((3, 5, 96))
    tx, tw = Tensor(x, requires_grad=True, dtype=numpy.float64), Tensor(w, requires_grad=True, dtype=numpy.float64)
    tb = Tensor(b, requires_grad=True, dtype=numpy.float64) if bias else None
    y = F.layer_norm(tx, tw, tb)
    y.backward(g)
    out, dx, dw, db = layer_norm_reference(x, w, b if bias else None, 1e-5, g)
    for ours, plain in [(y.data, out), (tx.grad, dx), (tw.grad, dw)] + ([(tb.grad, db)] if bias else []):
        numpy.testing.assert_allclose(ours, plain, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("axis", [0, 1, -2])
@pytest.mark.parametrize("op", [F.softmax, F.log_softmax])
def test_softmax_gradients_along_any_axis(op, axis):
    """softmax and log_softmax normalise along the axis they are given, not only the last: their
    backward sums along that same axis (central differences, random upstream gradient)."""
    for r in gradcheck(lambda a: op(a, axis=axis), [_t(3, 4, 5, seed=3)]):
        assert r.ok, r


@pytest.mark.parametrize("which", ["x", "weight", "bias"])
def test_layer_norm_gradient_of_each_input_alone(which):
    """With only one of x, weight and bias requiring a gradient (the others frozen), that one still
    receives its full gradient."""
    inputs = [_t(2, 3, 6, seed=4), _t(6, seed=5), _t(6, seed=6)]
    for name, t in zip(["x", "weight", "bias"], inputs):
        t.requires_grad = name == which
    reports = gradcheck(F.layer_norm, inputs)
    assert len(reports) == 1 and reports[0].ok, reports


def test_attention_dropout_of_some_heads_and_sequences_is_their_part_of_the_whole_mask():
    """A rank holding heads 2..3 (head_offset=2) of sequence 1 (rows=[1]) of a 4-head batch draws
    exactly those heads' and that sequence's dropout masks: its output is the whole op's columns
    and row for them, forward and backward."""
    rng = numpy.random.default_rng(7)
    B, T, H, D, p, key = 2, 6, 4, 3, 0.5, (11, 4)
    qkv = rng.standard_normal((B, T, 3 * H * D))
    dy = rng.standard_normal((B, T, H * D))
    whole = Tensor(qkv, requires_grad=True, dtype=numpy.float64)
    (F.causal_attention(whole, H, p, key=key) * Tensor(dy, dtype=numpy.float64)).sum().backward()
    y_whole = F.causal_attention(Tensor(qkv, dtype=numpy.float64), H, p, key=key).data
    heads = slice(2 * D, 4 * D)  # heads 2 and 3 within each of q, k and v
    cols = numpy.concatenate([numpy.arange(3 * H * D)[i * H * D:(i + 1) * H * D][heads] for i in range(3)])
    part = Tensor(qkv[1:, :, cols], requires_grad=True, dtype=numpy.float64)
    y_part = F.causal_attention(part, 2, p, key=key, rows=[1], head_offset=2)
    (y_part * Tensor(dy[1:, :, heads], dtype=numpy.float64)).sum().backward()
    numpy.testing.assert_allclose(y_part.data, y_whole[1:, :, heads], rtol=1e-12, atol=1e-14)
    numpy.testing.assert_allclose(part.grad, whole.grad[1:, :, cols], rtol=1e-12, atol=1e-14)
    # heads 0..1 of that sequence draw other masks, or the check above could not fail
    assert not numpy.allclose(y_whole[1:, :, heads], F.causal_attention(part, 2, p, key=key, rows=[1]).data)
