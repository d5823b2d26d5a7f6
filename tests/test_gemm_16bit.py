"""gemm.cu with bfloat16 and float16 inputs on the CPU emulator: 16-bit tiles, float32 accumulation,
the product rounded once to the inputs' dtype. The error bound is that of exact float32 accumulation
of the (already rounded) 16-bit inputs, so a 16-bit accumulator fails it."""

import numpy
import pytest

from minipar.dtypes import bfloat16, float16
from minipar.kernels import emulator, gemm

pytestmark = pytest.mark.skipif(emulator.compiler() is None, reason="no C++ compiler for the emulator")
rng = numpy.random.default_rng(1)
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}  # half the spacing at 1: 8 and 11 significant bits
SIZES = [(7, 33, 1), (33, 7, 127), (127, 129, 7), (1, 130, 33), (7, 7, 2049)]


def operands(M, N, K, trans_a, trans_b, dtype):
    a = rng.standard_normal((K, M) if trans_a else (M, K)).astype(dtype)
    b = rng.standard_normal((N, K) if trans_b else (K, N)).astype(dtype)
    return (a.T if trans_a else a), (b.T if trans_b else b)


def excess(c, a, b):
    """The worst element's error over its bound (<= 1 passes). The reference is the float64 product
    of the 16-bit inputs themselves, exact to float64; the kernel differs from it by float32
    accumulation, |error| <= gamma_K |A| |B| with gamma_K = K u32 / (1 - K u32), and then by one
    rounding of the sum to 16 bits, u16 |C|. (A product of two 16-bit values is exact in float32.)"""
    a64, b64 = a.astype(numpy.float64), b.astype(numpy.float64)
    ref, size = a64 @ b64, numpy.abs(a64) @ numpy.abs(b64)
    K, u16, u32 = a.shape[-1], UNIT_ROUNDOFF[c.dtype.name], 2.0**-24
    gamma = K * u32 / (1 - K * u32)
    bound = u16 * numpy.abs(ref) + (1 + u16) * gamma * size + 1e-300
    return float((numpy.abs(c.astype(numpy.float64) - ref) / bound).max())


@pytest.mark.parametrize("dtype", [bfloat16, float16])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_16_bit_tiles_accumulate_in_float32(dtype, trans_a, trans_b):
    for M, N, K in SIZES:
        a, b = operands(M, N, K, trans_a, trans_b, dtype)
        out = numpy.full((M, N), numpy.nan, numpy.float32).astype(dtype)  # unwritten elements stay NaN
        c = emulator.matmul(a, b, out=out)
        assert c is out and c.dtype == dtype and numpy.isfinite(c.astype(numpy.float32)).all(), (M, N, K)
        assert excess(c, a, b) <= 1, (M, N, K)
        # the same numbers as float32 BLAS on the widened inputs, narrowed once (up to the order of
        # the float32 additions, which can move a tie of the final rounding by one 16-bit step)
        widened = (a.astype(numpy.float32) @ b.astype(numpy.float32)).astype(dtype)
        assert (c == widened).mean() > 0.95, (M, N, K)


@pytest.mark.parametrize("dtype", [bfloat16, float16])
def test_the_naive_kernel_and_any_thread_order_agree(dtype):
    a, b = operands(19, 21, 70, True, False, dtype)
    assert excess(emulator.matmul(a, b, naive=True), a, b) <= 1
    c = emulator.matmul(a, b)
    assert numpy.array_equal(emulator.matmul(a, b, mode="shuffled").view(numpy.uint16), c.view(numpy.uint16))


def test_a_16_bit_accumulator_breaks_the_bound():
    """Rounding the running sum to bfloat16 after every product (a 16-bit accumulator, what mixed
    precision avoids): over K = 2049 the error is ~sqrt(K) 16-bit roundings, far past the bound."""
    source = gemm.SOURCE.read_text()
    line = "for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];  // an outer product"
    assert source.count(line) == 1
    source = source.replace(line, "for (int j = 0; j < TN; ++j) { T r; narrow(acc[i][j] + a[i] * b[j], r); "
                                  "acc[i][j] = widen(r); }")
    a, b = operands(7, 7, 2049, False, False, bfloat16)
    assert excess(emulator.matmul(a, b), a, b) <= 1
    assert excess(emulator.matmul(a, b, source=source), a, b) > 4


def test_mixed_dtypes_are_refused():
    a = numpy.ones((2, 2), bfloat16)
    with pytest.raises(TypeError, match="one dtype"):
        emulator.matmul(a, numpy.ones((2, 2), numpy.float32))


def test_on_the_gpu_backend_matmul_hands_16_bit_operands_to_the_kernel(monkeypatch):
    """The GPU's branch of ``backend.matmul`` on NumPy arrays, the kernel in its emulator: a bf16
    GPT's linear layers reach the kernel as bfloat16 (no widened copy), and the loss and gradients
    equal the CPU's widen-then-BLAS ones within bfloat16's rounding."""
    import minipar
    from minipar import backend
    from minipar.models import GPT, GPTConfig

    def step():
        minipar.set_default_dtype("bfloat16")
        minipar.manual_seed(3)
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64, dropout=0.0))
        idx = numpy.random.default_rng(0).integers(0, 64, (2, 9))
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        return float(loss.data), {n: p.grad.astype(numpy.float32) for n, p in model.named_parameters()}

    loss, grads = step()
    seen = []

    def kernel(a, b, out=None):
        seen.append(a.dtype.name)
        return emulator.matmul(a, b, out=out)

    monkeypatch.setattr(backend, "DEVICE", "cuda")
    monkeypatch.setattr(gemm, "matmul", kernel)
    loss_gpu, grads_gpu = step()
    assert "bfloat16" in seen  # attention's products run on its widened (float32) q, k, v
    assert abs(loss_gpu - loss) <= 1e-2 * loss
    for name, g in grads.items():
        assert numpy.abs(grads_gpu[name] - g).max() <= 3e-2 * (numpy.abs(g).max() + 1e-3), name
