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

needs_emulator = pytest.mark.skipif(emulator.compiler() is None, reason="no C++ compiler for the emulator")


def one_step(dropout, config=None, batch=2):
    """Loss, gradients and updated parameters of one AdamW step of a small GPT, float64."""
    minipar.manual_seed(3)
    config = config or dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=256)
    model = GPT(GPTConfig(**config, dropout=dropout))
    rng = numpy.random.default_rng(0)
    shape = (batch, config["block_size"])
    idx, targets = rng.integers(0, config["vocab_size"], shape), rng.integers(0, config["vocab_size"], shape)
    _, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad.copy() for n, p in model.named_parameters()}
    opt = AdamW(model.parameters(), lr=1e-2)
    clip_grad_norm(model.parameters(), 1.0)
    opt.step()
    return float(loss.data), grads, {n: p.data.copy() for n, p in model.named_parameters()}


@needs_emulator
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


def test_a_step_of_real_size_on_the_gpu_branches_equals_the_cpu_one(monkeypatch):
    """The emulated kernel is slow, so the step above is tiny, and a branch that breaks only past
    some size (the CPU's elementwise blocks: GELU's backward did) passes it. Here the products
    are NumPy's, and the activations run to several blocks."""
    from minipar.functional.gelu import GELU

    minipar.set_default_dtype("float64")
    config = dict(n_layer=2, n_head=4, n_embd=128, block_size=128, vocab_size=512)
    monkeypatch.setattr(GELU, "BLOCK", 1 << 14)  # whatever this machine's L2: the MLP's 262,144 are 16 blocks
    reference = one_step(0.1, config, batch=4)
    monkeypatch.setattr(backend, "DEVICE", "cuda")
    monkeypatch.setattr(gemm, "matmul", lambda a, b, out=None: numpy.matmul(a, b, out=out))
    loss, grads, params = one_step(0.1, config, batch=4)
    assert abs(loss - reference[0]) <= 1e-13 * abs(reference[0])
    for name in grads:
        assert numpy.allclose(grads[name], reference[1][name], rtol=1e-10, atol=1e-13), name
        assert numpy.allclose(params[name], reference[2][name], rtol=1e-10, atol=1e-13), name


@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-13), ("float32", 1e-5)])
def test_the_gpu_branches_of_the_reductions_agree_with_the_cpu_ones(monkeypatch, dtype, rtol):
    """The GPU branches are the plain reductions, the reference for the CPU's BLAS tricks."""
    rng = numpy.random.default_rng(1)
    for shape in [(5, 7, 3), (64, 300, 257)]:
        a, b = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
        monkeypatch.setattr(backend, "DEVICE", "cpu")
        cpu = [backend.dot_along(a, b, 1), backend.sum_along(a, -1), backend.sum_along(a, -2),
               backend.sum_of_squares([a, b])]
        monkeypatch.setattr(backend, "DEVICE", "cuda")
        gpu = [backend.dot_along(a, b, 1), backend.sum_along(a, -1), backend.sum_along(a, -2),
               backend.sum_of_squares([a, b])]
        for x, y in zip(cpu, gpu):
            scale = numpy.abs(numpy.asarray(y, "float64")).max()
            assert numpy.abs(numpy.asarray(x, "float64") - y).max() <= rtol * scale, shape


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_sum_of_squares_is_infinite_only_where_an_element_is(monkeypatch, device):
    """float32 squares overflow past 1.8e19: gradients of 3e19 and 4e19, finite, had an infinite
    norm, and the run stopped as diverged, naming no gradient (none was non-finite)."""
    monkeypatch.setattr(backend, "DEVICE", device)
    big = numpy.array([3e19, 4e19], numpy.float32)
    assert numpy.isclose(backend.sum_of_squares([big, numpy.ones(3, numpy.float32)]), 2.5e39 + 3, rtol=1e-6)
    assert backend.sum_of_squares([big, numpy.array([numpy.inf], numpy.float32)]) == numpy.inf
    assert numpy.isnan(backend.sum_of_squares([numpy.array([numpy.nan, 1.0], numpy.float32)]))


def test_gelu_on_the_gpu_branches_equals_the_cpu_blocks(monkeypatch):
    """On a GPU the chain runs as one piece, however many elements: the backward's scratch too
    (sized from the CPU's block, it once broke every activation larger than one block)."""
    from minipar.autograd import Context
    from minipar.functional.gelu import GELU

    rng = numpy.random.default_rng(2)
    x, g = rng.standard_normal((2, 3 * GELU.BLOCK + 5)).astype("float32")
    results = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setattr(backend, "DEVICE", device)
        ctx = Context()
        results[device] = GELU.forward(ctx, x), GELU.backward(ctx, g)
    for cpu, gpu in zip(results["cpu"], results["cuda"]):
        assert numpy.array_equal(cpu, gpu)


def test_elementwise_blocks_fill_the_l2_cache_sysfs_gives(tmp_path, monkeypatch):
    from minipar import node
    from minipar.functional.gelu import GELU

    for machine, l2 in (("a", "1024K"), ("b", "2M")):
        for index, (level, size) in enumerate([("1", "48K"), ("2", l2), ("3", "32768K")]):
            (tmp_path / machine / f"index{index}").mkdir(parents=True)
            (tmp_path / machine / f"index{index}" / "level").write_text(level + "\n")
            (tmp_path / machine / f"index{index}" / "size").write_text(size + "\n")
    assert node.l2_cache_bytes(str(tmp_path / "a")) == 1 << 20 and node.l2_cache_bytes(str(tmp_path / "b")) == 2 << 20
    assert GELU.BLOCK == backend.cache_block(3)  # the forward's three arrays
    assert node.l2_cache_bytes(str(tmp_path / "none")) == 512 * 1024  # not Linux: the default
    monkeypatch.setattr(node, "l2_cache_bytes", lambda: 1 << 20)
    assert backend.cache_block(3) == 1 << 16 and backend.cache_block(5) == 1 << 15
    monkeypatch.setattr(node, "l2_cache_bytes", lambda: 1 << 10)
    assert backend.cache_block(3) == 1 << 12  # never below 4096 elements


def test_choosing_a_device_leaves_the_dtype_and_the_generator_alone(monkeypatch):
    """The device (backend), the default dtype (dtypes) and the generator (random) are separate."""
    from minipar import dtypes, random

    minipar.set_default_dtype("float64")
    minipar.manual_seed(5)
    generator = random.default_generator()
    with pytest.raises(ValueError):
        backend.use_device("tpu")
    backend.use_device("cpu")
    assert dtypes.get_default_dtype() == numpy.float64 and random.default_generator() is generator
    assert not any(hasattr(backend, n) for n in ("get_default_dtype", "set_default_dtype", "manual_seed",
                                                  "default_generator"))


def test_an_unknown_device_or_a_missing_cupy_is_an_error():
    with pytest.raises(ValueError, match="'tpu' is not one of cpu, cuda"):
        backend.use_device("tpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs CuPy: pip install"):
            backend.use_device("cuda")
        assert backend.DEVICE == "cpu" and backend.xp.ndarray is numpy.ndarray  # nothing half-switched


def running_sum_segments(rows, starts):
    """What CuPy's ``add.reduceat`` computes: differences of one running sum over all rows."""
    running = numpy.cumsum(rows, axis=0, dtype=rows.dtype)
    ends = numpy.append(starts[1:], len(rows)) - 1
    before = numpy.concatenate([numpy.zeros((1, rows.shape[1]), rows.dtype), running[ends[:-1]]])
    return running[ends] - before


def test_segment_sums_on_the_gpu_are_as_accurate_as_the_cpu_ones(monkeypatch):
    """An embedding gradient over 8192 tokens: each id's rows summed. The GPU branch (pairwise per
    run) is as accurate as NumPy's run-by-run sum; a running-sum difference is ~10x worse."""
    rng = numpy.random.default_rng(0)
    ids = numpy.sort(rng.zipf(1.3, 8192) % 300)  # a few ids occur thousands of times, most a few
    rows = rng.standard_normal((8192, 64)).astype("float32")
    starts = numpy.flatnonzero(numpy.r_[True, ids[1:] != ids[:-1]])
    exact = numpy.add.reduceat(rows.astype("float64"), starts, axis=0)

    def error(x):
        return float(numpy.abs(x - exact).max() / numpy.abs(exact).max())

    cpu = backend.sum_segments(rows, starts)
    monkeypatch.setattr(backend, "DEVICE", "cuda")
    gpu = backend.sum_segments(rows, starts)
    assert gpu.dtype == rows.dtype and gpu.shape == exact.shape
    assert error(cpu) < 3e-7 and error(gpu) < 3e-7, (error(cpu), error(gpu))
    assert error(running_sum_segments(rows, starts)) > 5e-7  # the error this replaces is real here
    single = numpy.arange(5.0).reshape(5, 1)  # runs of one row, and of the whole array
    assert numpy.array_equal(backend.sum_segments(single, numpy.arange(5)), single)
    assert backend.sum_segments(single, numpy.array([0]))[0, 0] == 10.0
    assert backend.sum_segments(single[:0], numpy.array([], numpy.int64)).shape == (0, 1)


def test_the_embedding_gradient_through_the_gpu_branch_equals_the_cpu_one(monkeypatch, float64):
    import minipar.functional as F

    rng = numpy.random.default_rng(2)
    w = minipar.Tensor(rng.standard_normal((50, 8)), requires_grad=True)
    ids, upstream = rng.integers(0, 50, (4, 33)), rng.standard_normal((4, 33, 8))
    F.embedding(ids, w).backward(upstream)
    cpu, w.grad = w.grad, None
    monkeypatch.setattr(backend, "DEVICE", "cuda")
    F.embedding(ids, w).backward(upstream)
    expected = numpy.zeros((50, 8))
    numpy.add.at(expected, ids.reshape(-1), upstream.reshape(-1, 8))
    assert numpy.allclose(w.grad, cpu, rtol=1e-13, atol=1e-13) and numpy.allclose(cpu, expected, rtol=1e-13)


def test_each_gpu_kernel_is_looked_up_once(monkeypatch):
    """``get_function`` makes a new function object per call: the launcher keeps the first one."""
    lookups = []

    class Module:
        def get_function(self, name):
            lookups.append(name)
            return object()

    monkeypatch.setattr(gemm, "_kernels", {})
    monkeypatch.setattr(gemm, "_module", lambda dtype: Module())
    first = gemm._kernel("float32", False, True, False)
    assert gemm._kernel(numpy.dtype("float32"), 0, 1, False) is first
    assert gemm._kernel("float32", True, True, False) is not first
    assert lookups == [gemm.kernel_name("float32", False, True), gemm.kernel_name("float32", True, True)]


class PointerData(numpy.ndarray):
    """A NumPy array whose ``.data`` is unusable, as a CuPy array's is (a raw memory pointer).
    NumPy's own ``.data`` is a buffer that reads back as the same values, so only this catches
    code that unwraps "``.data`` if the value has one" instead of only a Tensor's."""

    @property
    def data(self):
        raise AssertionError("read .data of an array; on the GPU that is a memory pointer")


def test_arrays_are_never_unwrapped_through_their_own_data():
    from minipar.autograd import Tensor
    from minipar.parallel.data import token_count
    from minipar.verify import rel_err

    minipar.set_default_dtype("float64")
    try:
        minipar.manual_seed(3)
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64))
        rng = numpy.random.default_rng(0)
        idx, targets = rng.integers(0, 64, (2, 8)), rng.integers(-1, 64, (2, 8))
        logits, loss = model(idx.view(PointerData), targets.view(PointerData))
        assert float(loss.data) == float(model(idx, targets)[1].data)
        assert token_count(targets.view(PointerData)) == token_count(targets) == int((targets != -1).sum())
        upstream = rng.standard_normal(logits.shape)
        logits.backward(upstream.view(PointerData))
        assert backend.array_of(upstream) is upstream
        held = Tensor(upstream)
        assert backend.array_of(held) is held.data
        assert rel_err(upstream.view(PointerData), upstream) == 0.0
    finally:
        minipar.set_default_dtype("float32")
