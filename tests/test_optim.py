"""AdamW, SGD and clipping against the textbook formulas (and PyTorch's AdamW when installed)."""

import math

import numpy
import pytest

from minipar import Tensor
from minipar.nn import Parameter
from minipar.optim import SGD, AdamW, adamw_reference, clip_grad_norm


def params_and_grads(seed=0, dtype=numpy.float64):
    rng = numpy.random.default_rng(seed)
    shapes = [(70_000,), (5, 4), (3,)]  # one large enough to span several update blocks
    params = [Tensor(rng.standard_normal(s), requires_grad=True, dtype=dtype) for s in shapes]
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(4)]
    return params, grads


def reference_adamw(values, grads, lr, betas, eps, wd):
    """``adamw_reference``, the formula written plainly beside the in-place chain, step by step."""
    values = [v.copy() for v in values]
    m = [numpy.zeros_like(v) for v in values]
    s = [numpy.zeros_like(v) for v in values]
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            values[i], m[i], s[i] = adamw_reference(values[i], g, m[i], s[i], t, lr, betas, eps, wd,
                                                    decays=values[i].ndim >= 2)
    return values


def test_the_reference_adamw_is_the_papers_formula():
    p, g, m, v = numpy.array([2.0]), numpy.array([0.5]), numpy.array([0.1]), numpy.array([0.04])
    new_p, new_m, new_v = adamw_reference(p, g, m, v, t=2, lr=0.1, betas=(0.9, 0.99), eps=1e-8,
                                          weight_decay=0.5, decays=True)
    m_t, v_t = 0.9 * 0.1 + 0.1 * 0.5, 0.99 * 0.04 + 0.01 * 0.25
    step = (m_t / (1 - 0.9**2)) / (math.sqrt(v_t / (1 - 0.99**2)) + 1e-8)
    assert new_m[0] == pytest.approx(m_t) and new_v[0] == pytest.approx(v_t)
    assert new_p[0] == pytest.approx(2.0 - 0.1 * 0.5 * 2.0 - 0.1 * step, rel=1e-14)


@pytest.mark.parametrize("dtype,rtol", [(numpy.float64, 1e-12), (numpy.float32, 2e-6)])
def test_adamw_matches_the_formula(dtype, rtol):
    params, grads = params_and_grads(dtype=dtype)
    start = [p.data.astype(numpy.float64) for p in params]
    opt = AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.copy()
        opt.step()
    expected = reference_adamw(start, [[g.astype(numpy.float64) for g in s] for s in grads],
                               0.01, (0.9, 0.95), 1e-8, 0.1)
    for p, e in zip(params, expected):
        assert p.data.dtype == dtype
        numpy.testing.assert_allclose(p.data, e, rtol=rtol, atol=rtol)


def test_weight_decay_skips_vectors():
    w, b = Parameter(numpy.ones((2, 2))), Parameter(numpy.ones(2))
    opt = AdamW([w, b], lr=0.1, weight_decay=0.5)
    w.grad, b.grad = numpy.zeros((2, 2), numpy.float32), numpy.zeros(2, numpy.float32)
    opt.step()
    numpy.testing.assert_allclose(w.data, 0.95)  # p *= 1 - lr * wd
    numpy.testing.assert_allclose(b.data, 1.0)


def test_adamw_matches_pytorch():
    torch = pytest.importorskip("torch")
    params, grads = params_and_grads(dtype=numpy.float64)
    tparams = [torch.tensor(p.data.copy(), requires_grad=True) for p in params]
    opt = AdamW(params, lr=0.003, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    groups = [{"params": [t for t in tparams if t.ndim >= 2], "weight_decay": 0.1},
              {"params": [t for t in tparams if t.ndim < 2], "weight_decay": 0.0}]
    topt = torch.optim.AdamW(groups, lr=0.003, betas=(0.9, 0.95), eps=1e-8)
    for step_grads in grads:
        for p, t, g in zip(params, tparams, step_grads):
            p.grad, t.grad = g.copy(), torch.tensor(g)
        opt.step()
        topt.step()
    for p, t in zip(params, tparams):
        numpy.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_sgd_with_momentum_and_decay():
    p = Parameter(numpy.array([1.0, -2.0]))
    opt = SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    expected, buf = numpy.array([1.0, -2.0]), None
    for g in ([0.5, 0.5], [1.0, -1.0]):
        p.grad = numpy.array(g, numpy.float32)
        opt.step()
        d = numpy.array(g) + 0.01 * expected
        buf = d if buf is None else 0.9 * buf + d
        expected = expected - 0.1 * buf
    numpy.testing.assert_allclose(p.data, expected, rtol=1e-6)
    numpy.testing.assert_array_equal(p.grad, [1.0, -1.0])  # the gradient itself is untouched


def test_clip_grad_norm_scales_to_the_global_norm():
    a, b = Tensor(numpy.zeros(2), requires_grad=True), Tensor(numpy.zeros(1), requires_grad=True)
    a.grad, b.grad = numpy.array([3.0, 0.0], numpy.float32), numpy.array([4.0], numpy.float32)
    assert clip_grad_norm([a, b], 10.0) == pytest.approx(5.0)
    numpy.testing.assert_allclose(a.grad, [3.0, 0.0])  # below the bound: unchanged
    assert clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    total = math.sqrt(float((a.grad**2).sum() + (b.grad**2).sum()))
    assert total == pytest.approx(1.0, rel=1e-5)


def test_optimizer_argument_errors():
    with pytest.raises(ValueError, match="empty"):
        AdamW([])
    with pytest.raises(ValueError, match="betas"):
        AdamW([Parameter(numpy.ones(2))], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="learning rate"):
        SGD([Parameter(numpy.ones(2))], lr=-1.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_gradient_is_widened_before_any_arithmetic(dtype):
    """fp32 masters with 16-bit gradients (mixed precision, loss scale 1, no clipping): each block
    of the gradient is widened to float32 as it is read, so the step equals the one taken with
    the same gradients given in float32, bit for bit (g^2 computed in 16 bits would not be)."""
    from minipar.dtypes import as_dtype

    rng = numpy.random.default_rng(3)
    shapes = [(3000,), (40, 30)]
    start = [rng.standard_normal(s).astype(numpy.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(as_dtype(dtype)) for s in shapes] for _ in range(2)]
    finals = []
    for widen in (False, True):
        params = [Tensor(v.copy(), requires_grad=True, dtype=numpy.float32) for v in start]
        opt = AdamW(params, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.astype(numpy.float32) if widen else g.copy()
            opt.step()
        finals.append([p.data.copy() for p in params])
    for narrow, wide in zip(*finals):
        numpy.testing.assert_array_equal(narrow, wide)


def test_clip_grad_norm_with_a_bound_of_zero_does_not_clip():
    """max_norm 0 turns clipping off (--grad-clip 0): the norm is returned, the gradients untouched."""
    a = Tensor(numpy.zeros(2), requires_grad=True)
    a.grad = numpy.array([3.0, 4.0])
    assert clip_grad_norm([a], 0.0) == pytest.approx(5.0)
    numpy.testing.assert_array_equal(a.grad, [3.0, 4.0])
