"""16-bit dtypes in the engine: the ops take bfloat16 and float16, compute LayerNorm, softmax, the
loss, attention and GELU in float32, accumulate products in float32, and hand back 16 bits."""

import numpy
import pytest

import minipar
import minipar.functional as F
from minipar import backend
from minipar.autograd import Tensor
from minipar.dtypes import as_dtype, bfloat16, compute_dtype, finfo, float16, is_float, set_default_dtype
from minipar.models.gpt import GPT, GPTConfig

SIXTEEN = [bfloat16, float16]


def test_dtypes_name_the_16_bit_formats():
    assert as_dtype("bfloat16") == bfloat16 and as_dtype("float16") == float16
    assert is_float(bfloat16) and is_float("float32") and not is_float("int64")
    assert compute_dtype(bfloat16) == numpy.float32 and compute_dtype("float64") == numpy.float64
    assert finfo(bfloat16).bits == 16 and float(finfo(float16).max) == 65504.0
    set_default_dtype("bfloat16")
    assert Tensor([1.0, 2.0]).dtype == bfloat16


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_matmul_accumulates_in_float32(dtype):
    rng = numpy.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(dtype) for s in [(64, 512), (512, 32)])
    exact = (a.astype(numpy.float32) @ b.astype(numpy.float32)).astype(dtype)
    got = backend.matmul(a, b)
    assert got.dtype == dtype
    numpy.testing.assert_array_equal(got.view(numpy.uint16), exact.view(numpy.uint16))
    # accumulating in the 16-bit format itself would be far off: the check above can fail
    naive = numpy.zeros((64, 32), dtype)
    for k in range(512):
        naive += numpy.outer(a[:, k], b[k]).astype(dtype)
    assert not numpy.array_equal(naive.view(numpy.uint16), exact.view(numpy.uint16))


def _ops(dtype):
    rng = numpy.random.default_rng(1)
    x = rng.standard_normal((2, 8, 12))
    w, bias = rng.standard_normal(12) + 1.0, rng.standard_normal(12)
    targets = rng.integers(0, 12, (2, 8))
    weight = rng.standard_normal((5, 12)) * 0.3
    return {
        "layer_norm": (lambda x, w, b: F.layer_norm(x, w, b), [x, w, bias]),
        "softmax": (lambda x: F.softmax(x * 3.0), [x]),
        "log_softmax": (lambda x: F.log_softmax(x), [x]),
        "gelu": (lambda x: F.gelu(x), [x]),
        "cross_entropy": (lambda x: F.cross_entropy(x, targets), [x]),
        "linear": (lambda x, w: F.linear(x, w), [x, weight]),
        "attention": (lambda x: F.causal_attention(x, n_head=2), [x]),
    }


@pytest.mark.parametrize("name", list(_ops(None)))
@pytest.mark.parametrize("dtype", SIXTEEN)
def test_ops_take_16_bits_and_match_float32(name, dtype):
    fn, inputs = _ops(dtype)[name]
    outs, grads = {}, {}
    for dt in (numpy.float32, dtype):
        ts = [Tensor(a.astype(dt), requires_grad=True, dtype=dt) for a in inputs]
        y = fn(*ts)
        # the loss stays float32; every other output is in the inputs' 16-bit dtype
        assert y.dtype == (numpy.float32 if name == "cross_entropy" else dt), (name, y.dtype)
        (y * y).sum().backward() if y.ndim else y.backward()
        assert all(t.grad.dtype == dt for t in ts)
        outs[dt] = y.numpy().astype(numpy.float64)
        grads[dt] = [t.grad.astype(numpy.float64) for t in ts]
    tol = 3e-2 if dtype == bfloat16 else 4e-3  # 8 and 11 bits of mantissa, a few roundings
    scale = numpy.abs(outs[numpy.float32]).max() + 1e-3
    assert numpy.abs(outs[dtype] - outs[numpy.float32]).max() <= tol * scale
    for g16, g32 in zip(grads[dtype], grads[numpy.float32]):
        assert numpy.abs(g16 - g32).max() <= 2 * tol * (numpy.abs(g32).max() + 1e-3)


@pytest.mark.parametrize("experts", [0, 4])
def test_gpt_trains_in_bfloat16_near_float32(experts):
    """The whole GPT in bfloat16 (with a mixture of experts, whose router runs in float32): its
    loss is float32 and near the float32 model's."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        set_default_dtype(dtype)
        minipar.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, num_experts=experts,
                              moe_aux_loss_coeff=0.01 if experts else 0.0))
        idx = numpy.random.default_rng(0).integers(0, 64, (4, 16))
        _, loss = model(idx, idx)
        loss.backward()
        assert loss.dtype == numpy.float32
        assert {p.grad.dtype for p in model.parameters()} == {numpy.dtype(dtype)}
        losses[dtype] = loss.item()
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.02 * losses["float32"]
    if experts:
        assert model.transformer.h[0].mlp.router.weight.grad.dtype == bfloat16  # cast back to the weight's


def test_cast_moves_the_gradient_back_to_the_input_dtype():
    x = Tensor(numpy.ones(3), requires_grad=True, dtype=bfloat16)
    y = F.cast(x, "float32")
    assert y.dtype == numpy.float32 and F.cast(y, "float32") is y
    (y * 3.0).sum().backward()
    assert x.grad.dtype == bfloat16 and numpy.array_equal(x.grad.astype(numpy.float32), [3.0, 3.0, 3.0])
    with pytest.raises(TypeError, match="float dtype"):
        F.cast(x, "int32")


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_python_numbers_mixed_into_16_bit_arithmetic_take_no_gradient(dtype):
    """A Python number beside a 16-bit tensor (x + 2, 2 - x, x * 3) has no shape and no gradient:
    the widened backward hands back the tensor's alone, in its dtype."""
    x = Tensor(numpy.ones(3), requires_grad=True, dtype=dtype)
    y = ((x + 2.0) * 3.0 - 1.0)
    (2.0 - y).sum().backward()
    assert x.grad.dtype == dtype and numpy.array_equal(x.grad.astype(numpy.float32), [-3.0, -3.0, -3.0])


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_attention_dropout_held_in_16_bits_keeps_its_exact_scale(dtype):
    # One position: each query sees one key with probability 1, so out = R v and dv = R dy; the
    # held 16-bit mask must not round 1/(1-p) (1/0.9 is no bf16 or fp16 number).
    rng = numpy.random.default_rng(3)
    B, H, C, p, key = 16, 4, 32, 0.1, (7, 2)
    qkv = Tensor(rng.standard_normal((B, 1, 3 * C)), dtype=dtype, requires_grad=True)
    dy = rng.standard_normal((B, 1, C)).astype(dtype)
    out = F.causal_attention(qkv, H, p, key=key)
    (out * Tensor(dy, dtype=dtype)).sum().backward()
    wide = Tensor(qkv.data, dtype=numpy.float32, requires_grad=True)
    ref = F.causal_attention(wide, H, p, key=key)
    (ref * Tensor(dy, dtype=numpy.float32)).sum().backward()
    kept = ref.data != 0
    assert 0.5 < kept.mean() < 1.0  # some dropped, most kept: the check below sees the scale
    dv, dv_exact = qkv.grad[..., 2 * C:], wide.grad[..., 2 * C:].astype(dtype)
    assert dv.dtype == dtype
    numpy.testing.assert_array_equal(dv.view(numpy.uint16), dv_exact.view(numpy.uint16))


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_the_models_dropout_in_16_bits_scales_its_survivors_by_the_exact_scale(dtype):
    """The embedding's and the residual dropouts (nn.Dropout): each survivor times 1/(1-p) taken
    in float32 and rounded once, forward and backward; a 16-bit mask of 1/0.9 (1.109 in bfloat16)
    scaled every survivor low."""
    from minipar.nn import Dropout
    from minipar.rng import DropoutRNG

    x = Tensor(numpy.random.default_rng(2).standard_normal((4, 8, 16)), dtype=dtype, requires_grad=True)
    out = Dropout(0.1, DropoutRNG(seed=3))(x)
    out.backward(numpy.ones(out.shape, dtype))
    kept = out.data != 0
    assert 0.5 < kept.mean() < 1.0 and out.dtype == dtype and x.grad.dtype == dtype
    exact = (x.data.astype(numpy.float32) * kept * numpy.float32(1 / 0.9)).astype(dtype)
    numpy.testing.assert_array_equal(out.data.view(numpy.uint16), exact.view(numpy.uint16))
    numpy.testing.assert_array_equal(x.grad.view(numpy.uint16), (kept / numpy.float32(0.9)).astype(dtype).view(numpy.uint16))


ROWS = 4100  # a float32 sum of 4100 ones is exact; a 16-bit running sum stalls at 256 (bf16) or 2048 (fp16)


def _linear_bias(dtype):
    b = Tensor(numpy.zeros(3), requires_grad=True, dtype=dtype)
    return F.linear(Tensor(numpy.ones((ROWS, 2)), dtype=dtype), Tensor(numpy.ones((3, 2)), dtype=dtype), b), b


def _embedding_row(dtype):
    w = Tensor(numpy.zeros((2, 3)), requires_grad=True, dtype=dtype)
    return F.embedding(numpy.zeros(ROWS, numpy.int64), w), w  # one id, repeated: its rows add up


def _broadcast_add(dtype):
    b = Tensor(numpy.zeros(3), requires_grad=True, dtype=dtype)
    return F.add(Tensor(numpy.ones((ROWS, 3)), dtype=dtype), b), b


@pytest.mark.parametrize("make", [_linear_bias, _embedding_row, _broadcast_add])
@pytest.mark.parametrize("dtype", SIXTEEN)
def test_gradients_summed_over_rows_accumulate_in_float32(make, dtype):
    """A 16-bit gradient that is a sum over many rows (a bias, an embedding row used by many
    tokens, a broadcast operand) is accumulated in float32 and rounded to 16 bits once."""
    y, param = make(dtype)
    y.backward(numpy.ones(y.shape, dtype))
    expected = numpy.asarray(float(ROWS), numpy.float32).astype(dtype)  # 4096 in bf16, 4100 in fp16
    assert param.grad.dtype == dtype
    assert numpy.all(param.grad.reshape(-1)[:3] == expected), param.grad
