"""Ops at their edges: central differences where the catalogue (``gradcheck.op_cases``) does not
reach (non-contiguous views, both operands broadcast, negative axes, zero-size arrays, casts, an
attached loss), rows a loss ignores or a mask empties, 16-bit sums, and a check that the catalogue
applies every Function of ``minipar.functional``."""

import importlib
import inspect
import pkgutil
import warnings

import numpy
import pytest

import minipar.autograd as autograd
import minipar.functional as F
from minipar import Tensor
from minipar.autograd import Function
from minipar.comm import world
from minipar.dtypes import as_dtype
from minipar.gradcheck import gradcheck, op_cases
from minipar.parallel.cross_entropy import vocab_parallel_cross_entropy


def _t(*shape, seed=0):
    return Tensor(numpy.random.default_rng(seed).standard_normal(shape), requires_grad=True, dtype=numpy.float64)


# Each function takes contiguous float64 inputs (gradcheck makes them so) and views them first
# where the op is to see a non-contiguous array.
EDGES = {
    "reshape of a transposed view": (lambda a: F.reshape(F.transpose(a), (2, 6)), [_t(3, 4)]),
    "mul, both operands broadcast": (F.mul, [_t(3, 1), _t(1, 4, seed=1)]),
    "div, both operands broadcast": (lambda a, b: F.div(a, F.exp(b)), [_t(2, 1, 4), _t(3, 1, seed=1)]),
    "matmul, both batches broadcast": (F.matmul, [_t(2, 1, 3, 4), _t(1, 3, 4, 2, seed=1)]),
    "sum, negative axes, keepdims": (lambda a: F.sum(a, axis=(-1, -3), keepdims=True), [_t(2, 3, 4)]),
    "mean, negative axis": (lambda a: F.mean(a, axis=-2), [_t(2, 3, 4)]),
    "softmax along axis -3": (lambda a: F.softmax(a, axis=-3), [_t(2, 3, 4)]),
    "log_softmax along axis 0 of a view": (lambda a: F.log_softmax(F.transpose(a), axis=0), [_t(3, 4)]),
    "getitem, boolean mask": (lambda a: a[numpy.array([True, False, True])], [_t(3, 4)]),
    "getitem, repeated 2-D index": (lambda a: a[numpy.array([[0, 0], [2, 0]]), numpy.array([[1, 1], [3, 1]])],
                                    [_t(3, 4)]),
    "getitem, slice and repeated list": (lambda a: a[1:, [2, 2, 0]], [_t(3, 4)]),
    "gelu of a strided view": (lambda a: F.gelu(a[:, ::2]), [_t(3, 6)]),
    "layer_norm of a transposed view, no bias": (lambda x, w: F.layer_norm(F.transpose(x, (1, 0, 2)), w),
                                                 [_t(3, 2, 5), _t(5, seed=1)]),
    "linear of a transposed view, no bias": (lambda x, w: F.linear(F.transpose(x), w), [_t(5, 3), _t(4, 5, seed=1)]),
    "cross_entropy of a transposed view": (lambda x: F.cross_entropy(F.transpose(x), numpy.array([1, 0, 3])),
                                           [_t(4, 3)]),
    "masked_fill with a broadcast mask": (lambda a: F.masked_fill(a, numpy.array([True, False, True, False]), 1.0),
                                          [_t(2, 4)]),
    "a tensor used three times": (lambda a: F.matmul(a, F.transpose(a)) * F.sum(F.gelu(a)), [_t(3, 4)]),
    "concat along axis -1, one input twice": (lambda a, b: F.concat([a, b, a], axis=-1), [_t(2, 3), _t(2, 1, seed=1)]),
}


@pytest.mark.parametrize("name", list(EDGES))
def test_edge_gradients_match_central_differences(name):
    fn, inputs = EDGES[name]
    for r in gradcheck(fn, inputs):
        assert r.ok, f"{name}: {r}"


@pytest.mark.parametrize("op", [lambda a: F.linear(a, _t(3, 4)), lambda a: F.layer_norm(a, _t(4)), F.gelu,
                                lambda a: F.softmax(a), lambda a: F.sum(a, axis=0), lambda a: a[:, numpy.array([0, 0])],
                                lambda a: F.cross_entropy(a, numpy.zeros(0, numpy.int64), reduction="sum")])
def test_zero_rows_give_zero_size_gradients(op):
    a = _t(0, 4)
    y = op(a)
    y.backward(numpy.ones(y.shape))
    assert a.grad.shape == (0, 4)


def test_cast_gradient_by_central_differences():
    """Cast's backward, checked with a step that float32 represents: x and x +- 2^-8 are exact
    there, so the narrowing cast loses nothing. (The upstream gradient is rounded to float32 on its
    way back, by design: 6e-8 relative, inside the tolerance; through float16 it would not be.)"""
    rng = numpy.random.default_rng(0)
    x = Tensor(rng.integers(-256, 256, (3, 4)) / 256.0, requires_grad=True, dtype=numpy.float64)
    reports = gradcheck(lambda a: F.cast(F.cast(a, "float32") * 2.0, "float64"), [x], eps=2.0**-8)
    assert reports[0].ok, reports


def test_attach_loss_gradient_is_that_of_the_sum_of_the_losses():
    """attach_loss(y, aux, s) is y forward, and backward differentiates sum(y G) + s aux: central
    differences of that sum."""
    x, g, s = _t(3, 4), numpy.random.default_rng(1).standard_normal((3, 4)), 0.7

    def total(a):
        return float((F.tanh(a).data * g).sum() + s * F.z_loss(a).data)

    F.attach_loss(F.tanh(x), F.z_loss(x), s).backward(g)
    numeric = numpy.zeros(x.shape)
    flat, eps = x.data.reshape(-1), 1e-6
    for i in range(flat.size):
        flat[i] += eps
        plus = total(x)
        flat[i] -= 2 * eps
        minus = total(x)
        flat[i] += eps
        numeric.flat[i] = (plus - minus) / (2 * eps)
    numpy.testing.assert_allclose(x.grad, numeric, rtol=1e-7, atol=1e-9)


def _functions_of_functional():
    found = set()
    for module in pkgutil.iter_modules(F.__path__):
        mod = importlib.import_module(f"minipar.functional.{module.name}")
        found |= {c for c in vars(mod).values()
                  if inspect.isclass(c) and issubclass(c, Function) and c.__module__ == mod.__name__}
    return found


def test_the_catalogue_checks_every_function_of_functional(monkeypatch):
    """Every Function in minipar/functional is applied by some case of ``op_cases`` (or, named
    here, by a central-difference test of this file), so no op's backward goes unchecked."""
    applied = set()

    class Recording(autograd.Node):
        __slots__ = ()

        def __init__(self, fn, *args):
            applied.add(fn)
            super().__init__(fn, *args)

    monkeypatch.setattr(autograd, "Node", Recording)
    for _, fn, inputs in op_cases():
        fn(*inputs)
    checked_here = {"Cast": test_cast_gradient_by_central_differences,
                    "AttachLoss": test_attach_loss_gradient_is_that_of_the_sum_of_the_losses}
    missing = {c.__name__ for c in _functions_of_functional() - applied} - set(checked_here)
    assert not missing, f"no central-difference case applies {sorted(missing)}: add one to gradcheck.op_cases"


# ---- rows a loss ignores, rows a mask empties ----------------------------------------------------

def _ignored_rows_logits():
    """Rows 1 and 3 are ignored: row 1 masks token 0 (the column an ignored row's target is read
    from) with -inf, row 3 masks everything."""
    logits = numpy.random.default_rng(0).standard_normal((4, 5))
    logits[1, 0] = -numpy.inf
    logits[3] = -numpy.inf
    return logits, numpy.array([2, -1, 4, -1])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("parallel", [False, True])
def test_ignored_rows_add_nothing_whatever_their_logits(reduction, parallel):
    logits, targets = _ignored_rows_logits()
    x = Tensor(logits, requires_grad=True, dtype=numpy.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor does an ignored row warn about -inf - -inf
        if parallel:
            loss = vocab_parallel_cross_entropy(x, targets, world(), 0, 5, reduction=reduction)
        else:
            loss = F.cross_entropy(x, targets, reduction=reduction)
        loss.backward()
    kept = Tensor(logits[[0, 2]], requires_grad=True, dtype=numpy.float64)
    reference = F.cross_entropy(kept, targets[[0, 2]], reduction=reduction)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-14)
    numpy.testing.assert_allclose(x.grad[[0, 2]], kept.grad, rtol=1e-14)
    assert not x.grad[[1, 3]].any(), x.grad


def test_a_row_that_masks_every_entry_takes_no_probability_and_poisons_nothing():
    """softmax of a row that is -inf everywhere is 0 (nothing to attend to), log_softmax -inf; not
    nan, which would reach every gradient through nan * 0 in the products that follow."""
    logits = numpy.random.default_rng(0).standard_normal((2, 3))
    logits[1] = -numpy.inf
    g = numpy.random.default_rng(1).standard_normal((2, 3))
    for op in (F.softmax, F.log_softmax):
        x = Tensor(logits, requires_grad=True, dtype=numpy.float64)
        whole = Tensor(logits[:1], requires_grad=True, dtype=numpy.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = op(x)
            y.backward(g)
        op(whole).backward(g[:1])
        numpy.testing.assert_array_equal(y.data[1], 0.0 if op is F.softmax else -numpy.inf)
        numpy.testing.assert_allclose(x.grad[:1], whole.grad, rtol=1e-14)
        assert numpy.isfinite(x.grad).all(), (op, x.grad)


# ---- 16-bit sums are taken in float32 -----------------------------------------------------------

ROWS = 4096  # bfloat16 has 8 bits of mantissa: a sum of 4096 ones kept in bfloat16 stops at 256


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", ["matmul: the batch broadcasts b", "matmul: the batch broadcasts a",
                                  "getitem: an index repeated"])
def test_16_bit_gradients_summed_over_a_broadcast_or_repeated_index_accumulate_in_float32(case, dtype):
    dt = as_dtype(dtype)
    if case == "matmul: the batch broadcasts b":
        param = Tensor(numpy.zeros((1, 1, 3)), requires_grad=True, dtype=dt)
        y = F.matmul(Tensor(numpy.ones((ROWS, 1, 1)), dtype=dt), param)
    elif case == "matmul: the batch broadcasts a":
        param = Tensor(numpy.zeros((1, 1, 1)), requires_grad=True, dtype=dt)
        y = F.matmul(param, Tensor(numpy.ones((ROWS, 1, 3)), dtype=dt))
    else:
        param = Tensor(numpy.zeros((2, 3)), requires_grad=True, dtype=dt)
        y = param[numpy.zeros(ROWS, numpy.int64)]
    y.backward(numpy.ones(y.shape, dt))
    expected = numpy.asarray(float(3 * ROWS if case.endswith("broadcasts a") else ROWS), numpy.float32)
    assert param.grad.dtype == dt
    assert numpy.all(param.grad.reshape(-1)[:param.shape[-1]] == expected.astype(dt)), param.grad


def test_split_and_concat_refuse_what_would_cut_wrong_parts():
    x = _t(2, 6)
    with pytest.raises(ValueError, match="not divisible into 0 equal parts"):
        F.split(x, 0)  # was a ZeroDivisionError
    with pytest.raises(ValueError, match=r"sizes must be non-negative integers, got \[3, -1, 4\]"):
        F.split(x, [3, -1, 4])  # they add up to 6, and cut (2, 3), (2, 0) and an overlapping (2, 4)
    with pytest.raises(ValueError, match="at least one tensor"):
        F.concat([])
