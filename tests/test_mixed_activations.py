"""Activations in 16 bits: what a bfloat16 or float16 model saves for backward is held in 16 bits
(``functional/widen.py``), half the float32 model's bytes, but for the LayerNorms' 1/sigma, one
float32 per row."""

import os
import sys

import numpy
import pytest

import minipar.functional as F
from minipar.autograd import Tensor
from minipar.dtypes import bfloat16, float16, is_float
from minipar.plan.activations import formula

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from activation_memory import measure  # noqa: E402  (bench/ is scripts, not a package)


@pytest.mark.parametrize("granularity", [None, "selective"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_layer_holds_half_the_float32_bytes(dtype, granularity):
    s, b, h, a = 32, 2, 32, 2
    wide, wide_traced = measure(s, b, h, a, "float32", 0.1, granularity)
    half, half_traced = measure(s, b, h, a, dtype, 0.1, granularity)
    assert half == half_traced == sum(formula(s, b, h, a, 2, True, granularity).values())
    # fp32 = 4 X + 4 (2 s b) + M and 16-bit = 2 X + 4 (2 s b) + M: X the activations, 2 s b the
    # 1/sigma (two LayerNorms, one per row), M = 2 s b h the two dropouts' 1-byte masks; the int64
    # coordinates of selective's dropout stay as they are
    coordinates = 8 * (b + a + s) if granularity == "selective" else 0
    assert 2 * (half - coordinates) - (wide - coordinates) == 4 * 2 * s * b + 2 * s * b * h
    assert half < 0.52 * wide


@pytest.mark.parametrize("dtype", [bfloat16, float16])
def test_a_saved_16_bit_input_is_held_as_it_is_and_widened_only_in_backward(dtype):
    a = Tensor(numpy.linspace(-1, 1, 12).reshape(3, 4), requires_grad=True, dtype=dtype)
    b = Tensor(numpy.linspace(1, 2, 12).reshape(3, 4), requires_grad=True, dtype=dtype)
    y = F.mul(a, b)
    ctx = y._node.ctx
    assert ctx.a is a.data and ctx.b is b.data  # no copy: the graph holds those tensors anyway
    z = F.gelu(a)
    held = [v for v in vars(z._node.ctx).values() if hasattr(v, "dtype") and is_float(v.dtype)]
    assert held and all(v.dtype == dtype for v in held)
    ln = F.layer_norm(a, Tensor(numpy.ones(4), requires_grad=True, dtype=dtype))
    assert ln._node.ctx.xhat.dtype == dtype and ln._node.ctx.rstd.dtype == numpy.float32
    (y.sum() + z.sum() + ln.sum()).backward()
    assert a.grad.dtype == dtype and numpy.allclose(
        b.grad.astype(numpy.float32), a.data.astype(numpy.float32), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [bfloat16, float16])
def test_a_saved_part_of_a_widened_input_is_held_as_its_own_16_bit_copy(dtype):
    """An op that saves a part of its widened input (here its first row, C-contiguous but smaller
    than the input) holds that part's own 16-bit copy, exact, of the part's shape; backward sees it
    widened again."""
    from minipar.autograd import Function
    from minipar.functional.widen import in_float32

    @in_float32()
    class TimesFirstRow(Function):
        """y = x * x[0], the first row taken as a constant (no gradient through it)."""

        @staticmethod
        def forward(ctx, x):
            ctx.row = x[:1]
            return x * ctx.row

        @staticmethod
        def backward(ctx, grad):
            assert ctx.row.dtype == numpy.float32
            return grad * ctx.row

    data = numpy.linspace(-2, 2, 12).reshape(3, 4)
    x = Tensor(data, requires_grad=True, dtype=dtype)
    y = TimesFirstRow.apply(x)
    held = y._node.ctx.row
    assert held.dtype == dtype and held.shape == (1, 4)
    numpy.testing.assert_array_equal(held.astype(numpy.float32), x.data[:1].astype(numpy.float32))
    y.backward(numpy.ones((3, 4), dtype))
    numpy.testing.assert_array_equal(x.grad.astype(numpy.float32), numpy.broadcast_to(held.astype(numpy.float32), (3, 4)))
