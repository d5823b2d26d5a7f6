"""gemm.cu without a GPU, run by the CPU emulator: results, every element written, planted bugs
caught. Compiled by nvcc and NVRTC: test_gemm_compile.py; GPU runs: test_gpu.py."""

import numpy
import pytest

from minipar.kernels import emulator, gemm

pytestmark = pytest.mark.skipif(emulator.compiler() is None, reason="no C++ compiler for the emulator")
rng = numpy.random.default_rng(0)


def operands(M, N, K, trans_a, trans_b, dtype):
    """op(A) (M x K) and op(B) (K x N); a transposed operand is a view of a stored transpose."""
    a = rng.standard_normal((K, M) if trans_a else (M, K)).astype(dtype)
    b = rng.standard_normal((N, K) if trans_b else (K, N)).astype(dtype)
    return (a.T if trans_a else a), (b.T if trans_b else b)


def relative_error(c, a, b):
    """Worst element's error relative to the largest; infinite if any element is not finite (never
    written, or garbage: a comparison with NaN would pass every threshold test as False)."""
    if not numpy.isfinite(c).all():
        return numpy.inf
    ref = a.astype(numpy.float64) @ b.astype(numpy.float64)
    return numpy.abs(c - ref).max() / max(numpy.abs(ref).max(), 1e-300)


SIZES = [(1, 1, 1), (7, 33, 1), (33, 7, 127), (127, 129, 7), (1, 130, 33), (129, 1, 8), (7, 7, 4097),
         (4097, 3, 5), (3, 4097, 2)]


@pytest.mark.parametrize("dtype,tolerance", [("float32", 2e-6), ("float64", 1e-14)])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_every_shape_and_transpose_matches_float64(dtype, tolerance, trans_a, trans_b):
    for M, N, K in SIZES:
        a, b = operands(M, N, K, trans_a, trans_b, dtype)
        assert gemm.plan(a, b, numpy).a.trans == (trans_a and M > 1 and K > 1)  # read in place
        out = numpy.full((M, N), numpy.nan, dtype)  # poisoned: an element never written stays NaN
        c = emulator.matmul(a, b, out=out)
        assert c is out and not numpy.isnan(c).any(), (M, N, K)
        assert relative_error(c, a, b) < tolerance * max(1, numpy.sqrt(K)), (M, N, K)


@pytest.mark.parametrize("mode", ["reversed", "shuffled"])
def test_one_thread_at_a_time_in_any_order_gives_the_same_result(mode):
    a, b = operands(70, 131, 37, False, True, "float32")
    assert numpy.array_equal(emulator.matmul(a, b, mode=mode), emulator.matmul(a, b))


def test_the_naive_kernel_agrees():
    a, b = operands(19, 21, 23, True, False, "float32")
    assert relative_error(emulator.matmul(a, b, naive=True), a, b) < 1e-6


@pytest.mark.parametrize("shape_a,shape_b", [
    ((3, 2, 9, 5), (2, 5, 4)),   # broadcast batch
    ((4, 6, 5), (5, 7)),         # a batch times one shared matrix (stride 0)
    ((6, 5), (4, 5, 7)),
    ((2, 1, 3, 4), (1, 5, 4, 2)),
])
def test_batched_and_broadcast_products_follow_numpy(shape_a, shape_b):
    a, b = rng.standard_normal(shape_a), rng.standard_normal(shape_b)
    assert numpy.allclose(emulator.matmul(a, b), a @ b, rtol=1e-13, atol=1e-13)


def test_views_are_read_in_place_and_awkward_ones_copied():
    x = rng.standard_normal((4, 10, 6))
    p = gemm.plan(x.transpose(0, 2, 1), x, numpy)  # x^T x per batch: the backward's product
    assert p.a.trans and not p.b.trans and p.a.batch_stride == 60 and p.a.array.base is not None
    flipped = x[:, ::-1]  # negative strides: copied first
    assert numpy.allclose(emulator.matmul(flipped, x.transpose(0, 2, 1)), flipped @ x.transpose(0, 2, 1))
    gapped = x[::2, :, :3]  # every other batch entry: one stride still steps through them
    assert gemm.plan(gapped, x[0, :3, :], numpy).a.batch_stride == 120
    assert numpy.allclose(emulator.matmul(gapped, x[0, :3, :]), gapped @ x[0, :3, :])


def test_out_may_be_a_strided_slice():
    q, k = rng.standard_normal((2, 8, 4)), rng.standard_normal((2, 8, 4))
    y = numpy.zeros((2, 12, 8))
    emulator.matmul(q, k.transpose(0, 2, 1), out=y[:, 2:10])  # as attention writes a query block
    assert numpy.allclose(y[:, 2:10], q @ k.transpose(0, 2, 1)) and not y[:, :2].any() and not y[:, 10:].any()


def test_bad_operands_are_refused_by_name():
    with pytest.raises(TypeError, match="float32 @ float64"):
        emulator.matmul(numpy.ones((2, 2), "float32"), numpy.ones((2, 2)))
    with pytest.raises(ValueError, match="inner dimensions"):
        emulator.matmul(numpy.ones((2, 3)), numpy.ones((2, 3)))


# ---- planted bugs -----------------------------------------------------------------------------
def planted(old, new, count=1):
    source = gemm.SOURCE.read_text()
    assert source.count(old) >= count, old
    return source.replace(old, new, count)


def test_a_wrong_tile_index_is_caught():
    source = planted("const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;",
                     "const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BM / 2;")
    a, b = operands(40, 300, 9, False, False, "float32")
    assert relative_error(emulator.matmul(a, b, source=source), a, b) > 0.1


def test_a_wrong_slab_index_is_caught():
    source = planted("const int i = r / RUN_STEPS, k = (r % RUN_STEPS) * VEC;",
                     "const int i = r / RUN_STEPS, k = (r % RUN_STEPS);")
    a, b = operands(33, 20, 30, False, False, "float32")
    assert relative_error(emulator.matmul(a, b, source=source), a, b) > 0.1


@pytest.mark.parametrize("which", ["first", "last"])
@pytest.mark.parametrize("mode", ["reversed", "shuffled"])
def test_a_missing_syncthreads_fails_every_time_one_thread_at_a_time(which, mode):
    source = gemm.SOURCE.read_text()
    at = source.index("__syncthreads();") if which == "first" else source.rindex("__syncthreads();")
    source = source[:at] + source[at + len("__syncthreads();"):]
    a, b = operands(40, 40, 300, False, False, "float32")
    for seed in range(3):
        assert relative_error(emulator.matmul(a, b, mode=mode, seed=seed, source=source), a, b) > 0.1


@pytest.mark.parametrize("mode", ["parallel", "reversed"])
def test_threads_meeting_at_different_barriers_are_reported(mode):
    """As many barriers on every thread, but odd threads wait at another __syncthreads() call: the
    counts agree, the call sites do not (undefined on a GPU)."""
    source = planted("__syncthreads();  // everyone is done",
                     'if (threadIdx.x % 2) { __syncthreads(); } else { __syncthreads(); asm volatile("" ::: "memory"); }  //')
    a, b = operands(8, 8, 8, False, False, "float32")
    with pytest.raises(emulator.EmulatorError, match="did not all reach"):
        emulator.matmul(a, b, mode=mode, source=source)


@pytest.mark.parametrize("mode", ["parallel", "reversed"])
def test_a_barrier_only_some_threads_reach_is_reported(mode):
    source = planted("__syncthreads();  // the whole slab", "if (threadIdx.x % 2) __syncthreads();  //")
    a, b = operands(8, 8, 8, False, False, "float32")
    with pytest.raises(emulator.EmulatorError, match="did not all reach"):
        emulator.matmul(a, b, mode=mode, source=source)


def test_the_trace_counts_the_tiled_kernels_loads():
    M = N = K = 256
    a, b = operands(M, N, K, False, False, "float32")
    emulator.watch("float32", 0)
    emulator.matmul(a, b)
    rows, (loads, elements) = emulator.trace("float32")
    t = gemm.TILES["float32"]
    assert elements == M * N * K * (1 / t["BN"] + 1 / t["BM"])  # each A element N/BN times, B M/BM
    assert loads == elements // 4  # all of them as 16-byte vectors
    assert len(rows) == 2 * K // t["BK"] and set(rows[:, 0]) == {0, 1}  # thread 0: one run of A, one of B per slab


def test_a_misaligned_vector_load_stops_the_kernel_as_on_a_gpu():
    source = planted("const int i = r / RUN_STEPS, k = (r % RUN_STEPS) * VEC;",
                     "const int i = r / RUN_STEPS, k = (r % RUN_STEPS);")
    a, b = operands(40, 40, 300, False, False, "float32")  # rows 1200 bytes apart: the vector path
    with pytest.raises(emulator.EmulatorError, match="not 16-byte aligned"):
        emulator.matmul(a, b, source=source)


# ---- the edges the review found -----------------------------------------------------------------
def test_each_batch_entry_checks_its_own_alignment():
    # A batch stride of 65 floats: entry 0 is 16-byte aligned, entry 1 is not. A kernel that tested
    # the alignment before moving to its entry would issue misaligned vector loads there.
    storage = rng.standard_normal(3 * 65).astype("float32")
    a = numpy.lib.stride_tricks.as_strided(storage, (3, 8, 8), (65 * 4, 8 * 4, 4))
    b = rng.standard_normal((8, 8)).astype("float32")
    assert gemm.plan(a, b, numpy).a.batch_stride == 65  # read in place, not copied
    assert relative_error(emulator.matmul(a, b), a, b) < 1e-6


def test_empty_products_follow_numpy():
    for shape_a, shape_b in [((3, 0), (0, 4)), ((0, 3), (3, 4)), ((2, 0, 3, 5), (5, 2)), ((3, 4), (4, 0))]:
        a, b = numpy.ones(shape_a), numpy.ones(shape_b)
        c = emulator.matmul(a, b)
        assert c.shape == (a @ b).shape and not c.any()


def test_out_that_the_kernel_cannot_write_in_place_is_filled_after():
    a, b = rng.standard_normal((70, 40)), rng.standard_normal((40, 130))
    for out in (numpy.empty((130, 70)).T,        # column-major
                numpy.broadcast_to(numpy.empty((1, 130)), (70, 130)).copy()[:, ::-1]):  # negative stride
        c = emulator.matmul(a, b, out=out)
        assert c is out and numpy.allclose(out, a @ b, rtol=1e-12)
    x, y = rng.standard_normal((200, 200)), rng.standard_normal((200, 200))
    expected = x @ y
    assert numpy.allclose(emulator.matmul(x, y, out=y), expected, rtol=1e-12)  # out is an operand


def test_an_out_with_two_elements_at_one_address_is_never_written_in_place():
    """A zero batch stride puts every batch entry's product at one address: on a GPU their blocks
    would race. The kernel writes a new array, copied into ``out`` after (NumPy's rule: the last wins)."""
    a, b = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 5, 2))
    shared = numpy.zeros((4, 2))
    out = numpy.lib.stride_tricks.as_strided(shared, (3, 4, 2), (0,) + shared.strides)
    plan = gemm.plan(a, b, numpy)
    assert gemm.output(plan, out, a, b, numpy)[0] is not out
    emulator.matmul(a, b, out=out)
    numpy.testing.assert_allclose(shared, a[-1] @ b[-1], rtol=1e-12)


def test_an_empty_inner_dimension_writes_zeros_into_out():
    """K = 0: the product is a sum of nothing, zeros, also into an ``out`` that held something."""
    out = numpy.ones((2, 3), numpy.float32)
    assert emulator.matmul(numpy.zeros((2, 0), numpy.float32), numpy.zeros((0, 3), numpy.float32), out=out) is out
    assert not out.any()


def test_a_batch_beyond_the_grids_z_limit_is_launched_in_parts(monkeypatch):
    """CUDA's grid has at most 65535 blocks along z, one per batch entry: a larger batch runs in
    parts, the last one the remainder (here a limit of 2 and a batch of 3, written into the first
    three entries of a larger buffer, whose fourth must stay untouched)."""
    monkeypatch.setattr(gemm, "_MAX_GRID_YZ", 2)
    a, b = rng.standard_normal((4, 3, 5)).astype(numpy.float32), rng.standard_normal((4, 5, 2)).astype(numpy.float32)
    big = numpy.zeros((4, 3, 2), numpy.float32)
    emulator.matmul(a[:3], b[:3], out=big[:3])
    numpy.testing.assert_allclose(big[:3], a[:3] @ b[:3], rtol=1e-5, atol=1e-5)
    assert not big[3].any(), "a launch wrote past the end of out"


def test_elements_off_their_natural_alignment_are_copied_first():
    records = numpy.zeros((6, 5), dtype=[("pad", "f4"), ("x", "f8")])  # 12-byte records
    records["x"] = rng.standard_normal((6, 5))
    a = records["x"]
    assert numpy.allclose(emulator.matmul(a, a.T), a @ a.T, rtol=1e-12)


def test_a_block_that_reads_shared_memory_it_never_wrote_fails():
    # Only block (0, 0) copies the A slab; later blocks would find its values left behind by the
    # block before (right, when all blocks share A's rows). Shared memory is NaN at each block's start.
    source = planted("load_slab<T, BM, BK, THREADS, !TRANS_A>(As, A, M, K, m0, k0, lda, a_aligned);",
                     "if (blockIdx.x == 0) load_slab<T, BM, BK, THREADS, !TRANS_A>(As, A, M, K, m0, k0, lda, a_aligned);")
    a, b = operands(40, 300, 8, False, False, "float32")
    for mode in ("parallel", "reversed"):
        assert relative_error(emulator.matmul(a, b, mode=mode, source=source), a, b) == numpy.inf


def random_view(generator, shape):
    """An array of ``shape`` that is a view of a larger one: maybe stepped, reversed or transposed."""
    steps = [int(generator.integers(1, 3)) for _ in shape]
    base = generator.standard_normal([n * s + 1 for n, s in zip(shape, steps)])
    view = base[tuple(slice(1, 1 + n * s, s) for n, s in zip(shape, steps))]
    if generator.random() < 0.3:
        view = view[..., ::-1, :]
    if generator.random() < 0.4:  # stored transposed, read as the shape asked for
        stored = numpy.ascontiguousarray(numpy.swapaxes(view, -1, -2))
        view = numpy.swapaxes(stored, -1, -2)
    return view


def test_random_views_batches_and_outs_follow_numpy():
    generator = numpy.random.default_rng(7)
    for case in range(60):
        M, N, K = (int(n) for n in generator.integers(1, 20, 3))
        batch_a = tuple(int(n) for n in generator.choice([1, 2, 3], int(generator.integers(0, 3))))
        batch_b = tuple(1 if generator.random() < 0.3 else n for n in batch_a)
        a, b = random_view(generator, batch_a + (M, K)), random_view(generator, batch_b + (K, N))
        expected = a @ b
        out = random_view(generator, expected.shape) if generator.random() < 0.4 else None
        got = emulator.matmul(a, b, out=out, mode="shuffled" if case % 3 == 0 else "parallel", seed=case)
        assert numpy.allclose(got, expected, rtol=1e-12, atol=1e-12), (case, a.strides, b.strides)
        assert out is None or got is out
