"""The GPU code paths, checked on the CPU: every matrix product of a GPT training step goes through
``backend.matmul``, which on the GPU is our kernel. Here the device is switched to the GPU's
branches on NumPy arrays and the kernel runs in its CPU emulator: the step must equal the BLAS
one, and every product must have gone through the kernel's plan."""

import collections

import numpy
import pytest

import minipar
from minipar import backend
from minipar.kernels import emulator, gemm
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm

pytestmark = pytest.mark.skipif(emulator.compiler() is None, reason="no C++ compiler for the emulator")


def one_step(dropout):
    """Loss, gradients and updated parameters of one AdamW step of a small GPT, float64."""
    minipar.manual_seed(3)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=256, dropout=dropout))
    rng = numpy.random.default_rng(0)
    idx, targets = rng.integers(0, 256, (2, 8)), rng.integers(0, 256, (2, 8))
    _, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad.copy() for n, p in model.named_parameters()}
    opt = AdamW(model.parameters(), lr=1e-2)
    clip_grad_norm(model.parameters(), 1.0)
    opt.step()
    return float(loss.data), grads, {n: p.data.copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_training_step_through_the_emulated_kernel_equals_blas(dropout, monkeypatch):
    minipar.set_default_dtype("float64")
    reference = one_step(dropout)

    seen = collections.Counter()

    def kernel(a, b, out=None):
        p = gemm.plan(a, b, numpy)
        seen[(p.a.trans, p.b.trans, p.batch > 1)] += 1
        return emulator.matmul(a, b, out=out)

    monkeypatch.setattr(backend, "DEVICE", "cuda")  # the GPU's branches, on NumPy arrays
    monkeypatch.setattr(gemm, "matmul", kernel)
    loss, grads, params = one_step(dropout)

    assert abs(loss - reference[0]) <= 1e-13 * abs(reference[0])
    for name in grads:
        assert numpy.allclose(grads[name], reference[1][name], rtol=1e-10, atol=1e-13), name
        assert numpy.allclose(params[name], reference[2][name], rtol=1e-10, atol=1e-13), name
    # The forward products, both backward products (one transposed operand each, read in place),
    # and the batched attention products all went through the kernel.
    assert seen[(False, True, False)] and seen[(True, False, False)] and seen[(False, False, False)], seen
    assert any(batched for (_, _, batched) in seen), seen


def test_the_gpu_branches_of_the_reductions_agree_with_the_cpu_ones(monkeypatch):
    rng = numpy.random.default_rng(1)
    a, b = rng.standard_normal((5, 7, 3)), rng.standard_normal((5, 7, 3))
    cpu = [backend.dot_along(a, b, 1), backend.sum_along(a, -1), backend.sum_along(a, -2), backend.sum_of_squares([a, b])]
    monkeypatch.setattr(backend, "DEVICE", "cuda")
    gpu = [backend.dot_along(a, b, 1), backend.sum_along(a, -1), backend.sum_along(a, -2), backend.sum_of_squares([a, b])]
    assert all(numpy.allclose(x, y, rtol=1e-13) for x, y in zip(cpu, gpu))


def test_an_unknown_device_or_a_missing_cupy_is_an_error():
    with pytest.raises(ValueError, match="'tpu' is not one of cpu, cuda"):
        backend.use_device("tpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs CuPy: pip install"):
            backend.use_device("cuda")
        assert backend.DEVICE == "cpu" and backend.xp.ndarray is numpy.ndarray  # nothing half-switched
