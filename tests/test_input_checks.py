"""Bad input is refused with an error that names the problem, never silently accepted."""

import os
import subprocess
import sys

import numpy
import pytest

import minipar
import minipar.functional as F
from minipar import Tensor
from minipar.autograd import Function
from minipar.dtypes import set_default_dtype
from minipar.models import GPT, GPTConfig
from minipar.nn import Parameter
from minipar.optim import AdamW


def f32(*shape):
    return Tensor(numpy.ones(shape, numpy.float32), requires_grad=True)


def f64(*shape):
    return Tensor(numpy.ones(shape), requires_grad=True, dtype=numpy.float64)


@pytest.mark.parametrize("op", [
    lambda: F.matmul(f32(2, 3), f64(3, 2)),
    lambda: F.linear(f32(2, 3), f64(4, 3)),
    lambda: F.layer_norm(f32(2, 3), f64(3)),
    lambda: F.concat([f32(2, 3), f64(2, 3)]),
    lambda: f32(3) * f64(3),
])
def test_mixed_float_dtypes_are_refused(op):
    with pytest.raises(TypeError, match="float32 and float64"):
        op()


def test_constants_take_the_tensors_dtype():
    x = f32(2, 3)
    for out in (x @ numpy.ones((3, 2)), F.linear(x, numpy.ones((4, 3))), x + numpy.ones(3),
                F.layer_norm(x, numpy.ones(3)), numpy.ones(3) * x):
        assert out.dtype == numpy.float32


def test_integer_tensors_are_refused_by_float_ops():
    ints = Tensor(numpy.arange(6).reshape(2, 3))
    for op in (F.exp, F.softmax, F.mean, lambda t: t * 0.5, lambda t: F.matmul(t, f32(3, 1))):
        with pytest.raises(TypeError, match="needs float tensors"):
            op(ints)


@pytest.mark.parametrize("op,message", [
    (lambda x: F.sum(x, axis=5), "axis 5 is out of range"),
    (lambda x: F.mean(x, axis=-3), "axis -3 is out of range"),
    (lambda x: F.softmax(x, axis=2), "axis 2 is out of range"),
    (lambda x: F.sum(x, axis=(1, -1)), "repeated axis"),
    (lambda x: F.transpose(x, (0, 3)), "out of range"),
    (lambda x: F.transpose(x, (0,)), "not a permutation"),
    (lambda x: F.split(x, 2, axis=4), "out of range"),
])
def test_axes_out_of_range_are_errors(op, message):
    with pytest.raises(ValueError, match=message):
        op(f32(2, 3))


def test_a_backward_with_a_wrong_shape_of_the_same_size_is_caught():
    class ForgetsToTransposeBack(Function):
        @staticmethod
        def forward(ctx, x):
            return x.T.copy()

        @staticmethod
        def backward(ctx, grad):
            return grad  # shape (3, 2) for an input of shape (2, 3)

    with pytest.raises(RuntimeError, match=r"shape \(3, 2\) for an input of shape \(2, 3\)"):
        ForgetsToTransposeBack.apply(f32(2, 3)).sum().backward()


def test_edge_cases_of_single_ops():
    x = Tensor(numpy.array([0.0, 2.0]), requires_grad=True)
    F.pow(x, 0).sum().backward()
    numpy.testing.assert_array_equal(x.grad, [0.0, 0.0])  # not nan at x = 0
    with pytest.raises(ValueError, match="empty axis"):
        F.mean(Tensor(numpy.ones((2, 0))), axis=1)
    leaf = Tensor(numpy.array(3.0), requires_grad=True)
    leaf.backward()
    assert leaf.grad == 1.0


def test_tensors_convert_to_arrays_but_not_through_ufuncs():
    x = f32(2)
    numpy.testing.assert_array_equal(numpy.asarray(x), [1, 1])
    with pytest.raises(TypeError):
        numpy.exp(x)


def test_default_dtype_refuses_none_and_non_floats():
    with pytest.raises(ValueError, match="float32"):
        set_default_dtype(None)
    with pytest.raises(ValueError, match="float32 or float64"):
        set_default_dtype("int32")


def test_gpt_config_accepts_integers_only():
    assert GPTConfig(n_layer=numpy.int64(2)).n_layer == 2
    with pytest.raises(ValueError, match="positive integer"):
        GPTConfig(n_layer=True)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        GPTConfig(dropout="0.1")


def test_gpt_takes_tensor_ids_and_tensor_state():
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=4, block_size=4, vocab_size=7))
    ids = numpy.array([[1, 2, 3]])
    numpy.testing.assert_array_equal(model(Tensor(ids))[0].data, model(ids)[0].data)
    model.load_state_dict(dict(model.named_parameters()))


def test_adamw_refuses_parameters_it_could_not_update_in_place():
    assert Parameter(numpy.ones((4, 3)).T).data.flags.c_contiguous
    strided = Tensor(numpy.ones((4, 3)).T, requires_grad=True)
    with pytest.raises(ValueError, match="C-contiguous"):
        AdamW([strided])


def test_adamw_refuses_16_bit_copies_it_could_not_write_through():
    """A model copy is written through a flat view of itself: a strided copy (whose reshape would be
    a new array, so every update would be lost) or one of another shape is refused up front."""
    master = Parameter(numpy.ones((4, 3)))
    for copy in (numpy.ones((3, 4), numpy.float32).T, numpy.ones((3, 4), numpy.float32)):
        with pytest.raises(ValueError, match="copies: one C-contiguous array"):
            AdamW([master], copies=[copy])
    AdamW([master], copies=[numpy.ones((4, 3), numpy.float32)])  # the right one is taken


def test_gradcheck_compares_entry_by_entry():
    from minipar.gradcheck import gradcheck

    scale = numpy.array([1e4, 1e-3])

    class SmallEntryWrong(Function):
        @staticmethod
        def forward(ctx, x):
            return x * scale

        @staticmethod
        def backward(ctx, grad):
            return grad * scale * numpy.array([1.0, 2.0])  # the small entry is twice too large

    x = Tensor(numpy.ones(2), requires_grad=True, dtype=numpy.float64)
    report = gradcheck(SmallEntryWrong.apply, [x])[0]
    assert report.rel_err < 1e-6  # a norm-wise comparison would pass it
    assert not report.ok


@pytest.mark.parametrize("device,message", [("tpu", "MINIPAR_DEVICE='tpu': device 'tpu' is not one of cpu, cuda"),
                                            ("cuda", "MINIPAR_DEVICE='cuda': the cuda device needs CuPy")])
def test_backend_device_errors(device, message):
    try:
        import cupy  # noqa: F401
        if device == "cuda":
            pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    # the import succeeds (a script reports the variable among its flags); the first use fails
    run = subprocess.run([sys.executable, "-c", "import minipar; from minipar.backend import xp; xp.zeros(1)"],
                         capture_output=True, text=True,
                         env=dict(os.environ, MINIPAR_DEVICE=device), timeout=60)
    assert run.returncode != 0 and message in run.stderr


def test_float64_mode_keeps_float64():
    set_default_dtype("float64")
    minipar.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=4, block_size=4, vocab_size=7))
    _, loss = model(numpy.array([[1, 2]]), numpy.array([[2, 3]]))
    assert loss.dtype == numpy.float64
