"""On a real GPU: our kernel against float64 references (every element written), the GPU GPT step
against the CPU one, and the communicators on GPU arrays. Skipped where CuPy or a GPU is missing
(CI has none; bench/gpu_check.sh runs these on a GPU machine)."""

import numpy
import pytest

from minipar import backend

cupy = pytest.importorskip("cupy")
try:
    GPUS = cupy.cuda.runtime.getDeviceCount()
except cupy.cuda.runtime.CUDARuntimeError:
    GPUS = 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no GPU")

from minipar.kernels import gemm  # noqa: E402
from mpi_run import check_mpi  # noqa: E402
from test_gemm_kernel import SIZES, relative_error  # noqa: E402
from test_gpu_paths import one_step  # noqa: E402


@pytest.mark.parametrize("dtype,tolerance", [("float32", 2e-6), ("float64", 1e-14)])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_the_kernel_matches_float64_for_every_shape_and_transpose(dtype, tolerance, trans_a, trans_b):
    rng = numpy.random.default_rng(0)
    for M, N, K in SIZES + [(4097, 4097, 33), (1024, 1024, 1024)]:
        a = rng.standard_normal((K, M) if trans_a else (M, K)).astype(dtype)
        b = rng.standard_normal((N, K) if trans_b else (K, N)).astype(dtype)
        a, b = (a.T if trans_a else a), (b.T if trans_b else b)
        out = cupy.full((M, N), cupy.nan, dtype)  # poisoned
        c = gemm.matmul(cupy.asarray(a), cupy.asarray(b), out=out)
        assert c is out and not bool(cupy.isnan(c).any()), (M, N, K)
        assert relative_error(c.get(), a, b) < tolerance * max(1, numpy.sqrt(K)), (M, N, K)


def test_batched_broadcast_and_strided_out_on_the_gpu():
    rng = numpy.random.default_rng(1)
    a, b = rng.standard_normal((3, 2, 9, 5)).astype("float32"), rng.standard_normal((2, 5, 14)).astype("float32")
    c = gemm.matmul(cupy.asarray(a), cupy.asarray(b))
    assert numpy.allclose(c.get(), a @ b, rtol=1e-5, atol=1e-5)
    q = cupy.asarray(rng.standard_normal((4, 8, 16)).astype("float32"))
    y = cupy.zeros((4, 12, 8), "float32")
    gemm.matmul(q, q.transpose(0, 2, 1), out=y[:, 2:10])
    assert numpy.allclose(y[:, 2:10].get(), (q @ q.transpose(0, 2, 1)).get(), rtol=1e-5, atol=1e-4)
    assert not bool(y[:, :2].any()) and not bool(y[:, 10:].any())


def test_the_naive_kernel_agrees_on_the_gpu():
    a = cupy.random.standard_normal((130, 70), dtype="float32")
    b = cupy.random.standard_normal((70, 33), dtype="float32")
    assert relative_error(gemm.matmul(a, b, naive=True).get(), a.get(), b.get()) < 1e-5


def test_a_gpu_training_step_equals_the_cpu_step():
    cpu = one_step(dropout=0.1)  # float32, the default
    backend.use_device("cuda")
    try:
        gpu = one_step(dropout=0.1)
    finally:
        backend.use_device("cpu")
    assert abs(cpu[0] - gpu[0]) <= 1e-5 * abs(cpu[0])
    for name in cpu[1]:
        assert numpy.allclose(backend.to_numpy(gpu[1][name]), cpu[1][name], rtol=1e-3, atol=1e-5), name
        assert numpy.allclose(backend.to_numpy(gpu[2][name]), cpu[2][name], rtol=1e-4, atol=1e-5), name


def test_communicators_on_gpu_arrays(monkeypatch):
    monkeypatch.setenv("MINIPAR_DEVICE", "cuda")
    out = check_mpi(2, "gpu_comm.py", timeout=180)
    assert "gpu comm OK on 2 ranks via" in out
    if GPUS == 1:  # two ranks on one GPU: NCCL refuses that, so MPI carries it, said once
        assert "via MPI" in out and out.count("share a GPU") == 1
    else:  # a GPU each: NCCL, and no fallback
        assert "via NCCL" in out and "share a GPU" not in out


def test_context_parallel_attention_on_gpu_arrays(monkeypatch):
    monkeypatch.setenv("MINIPAR_DEVICE", "cuda")
    out = check_mpi(2, "context.py", "--device", "cuda", timeout=180)
    assert "context parallel attention OK on 2 ranks" in out


def test_nccl_itself_runs_on_a_world_of_one():
    """With one GPU the two-rank test above goes through MPI (NCCL refuses two ranks on one GPU),
    so NCCL runs here, on one rank: the unique id's round trip (bytes in CuPy 14, a tuple before),
    the communicator, and each collective on a GPU array, with its result and its byte account."""
    from minipar.comm.mpi import world as mpi_world
    from minipar.comm.nccl import NCCLCommunicator

    comm = NCCLCommunicator(mpi_world(), "nccl-one")
    assert (comm.rank, comm.size) == (0, 1)
    x = cupy.arange(12, dtype=cupy.float32)
    assert comm.all_reduce(x) is x and numpy.array_equal(x.get(), numpy.arange(12))
    assert numpy.array_equal(comm.reduce_scatter(x).get(), numpy.arange(12))
    assert comm.iall_gather(x).wait().shape == (1, 12)
    assert numpy.array_equal(comm.all_to_all(x.reshape(3, 4)).get(), numpy.arange(12).reshape(3, 4))
    comm.broadcast(x, root=0)
    comm.iall_reduce(x, op="max").wait()
    cupy.cuda.get_current_stream().synchronize()
    assert numpy.array_equal(x.get(), numpy.arange(12))
    assert comm.stats.by_op["all_reduce"].calls >= 2 and comm.stats.total().bytes_sent == 0  # one rank sends nothing
    host = comm.all_reduce(numpy.ones(3))  # host arrays go through MPI
    assert isinstance(host, numpy.ndarray) and host.tolist() == [1.0, 1.0, 1.0]
