"""Before any GPU check: is everything there? One line per check, and at the first missing piece
one line that says what is missing and how to bring it, then exit 3.

    python3 bench/gpu_preflight.py            (bench/gpu_check.sh runs it first, with ~15 s to spare)

A lent GPU machine gives one try. Without this, a missing MPI library or CuPy shows up minutes into
the run, as a traceback in the middle of a test log. The checks, in the order the later steps need
them: this Python, NumPy, minipar imported from this checkout, MPI loaded by mpi4py, CuPy, a GPU,
NVRTC compiling our GEMM kernel and one product matching the host's; then what is only reported
(mpiexec for the two-rank steps, NCCL, a host C++ compiler for lesson 7's emulator, CUPY_TF32).
"""

import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START = time.perf_counter()


class Missing(Exception):
    pass


def check(what, run):
    """Run one check; print its line, or the one failure line and stop."""
    try:
        detail = run()
    except Missing as exc:
        print(f"preflight: FAILED: {what}: {exc}", flush=True)
        sys.exit(3)
    except Exception as exc:  # noqa: BLE001 - any failure here is reported the same way
        print(f"preflight: FAILED: {what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              flush=True)
        sys.exit(3)
    print(f"preflight: ok   {what}: {detail}  [{time.perf_counter() - START:.1f} s]", flush=True)


def python():
    if sys.version_info < (3, 10):
        raise Missing(f"Python {sys.version.split()[0]} is too old; minipar needs 3.10 or newer")
    return f"{sys.version.split()[0]} at {sys.executable}"


def numpy_version():
    try:
        import numpy
    except ImportError as exc:
        raise Missing(f"{exc}; carry a NumPy wheel for this Python") from exc
    return numpy.__version__


def minipar_from_checkout():
    try:
        import minipar
    except ImportError as exc:
        raise Missing(f"{exc}; put the checkout on PYTHONPATH (PYTHONPATH={ROOT})") from exc
    where = os.path.dirname(os.path.dirname(os.path.abspath(minipar.__file__)))
    if os.path.realpath(where) != os.path.realpath(ROOT):
        raise Missing(f"minipar is imported from {where}, not from this checkout {ROOT}: put {ROOT} first "
                      "on PYTHONPATH")
    return f"from {where}"


def mpi_library():
    try:
        import mpi4py
        from mpi4py import MPI
    except ImportError as exc:
        raise Missing(f"no mpi4py ({exc}); carry its wheel in .gpu_wheels/ (bench/gpu_wheels.sh)") from exc
    except RuntimeError as exc:  # mpi4py 4 loads libmpi itself and says "cannot load MPI library"
        raise Missing(f"mpi4py {mpi4py.__version__} finds no MPI library ({str(exc).splitlines()[0]}); carry the "
                      "mpich wheel in .gpu_wheels/ (bench/gpu_wheels.sh), which gpu_check.sh unpacks") from exc
    return f"mpi4py {mpi4py.__version__}, {MPI.Get_library_version().splitlines()[0].strip()}"


def cupy_version():
    try:
        import cupy
    except ImportError as exc:
        raise Missing(f"no CuPy ({exc}); with network: pip install -e '.[gpu-cuda13]' (CUDA 13) or "
                      "'.[gpu-cuda12]' (CUDA 12); without network, carry its wheel") from exc
    return f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver " \
           f"{cupy.cuda.runtime.driverGetVersion()}"


def gpu():
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise Missing(f"CuPy sees no GPU ({exc}); check nvidia-smi and CUDA_VISIBLE_DEVICES") from exc
    if count == 0:
        raise Missing("CuPy sees no GPU; check nvidia-smi and CUDA_VISIBLE_DEVICES")
    from minipar.backend import gpu_name

    p = cupy.cuda.runtime.getDeviceProperties(0)
    return f"{count} x {gpu_name(0)}, compute capability {p['major']}.{p['minor']}, {p['totalGlobalMem'] / 2**30:.0f} GiB"


def our_kernel():
    import cupy
    import numpy

    from minipar.kernels import gemm

    rng = numpy.random.default_rng(0)
    a, b = rng.standard_normal((300, 70)), rng.standard_normal((200, 70))  # b is read transposed
    started = time.perf_counter()
    c = gemm.matmul(cupy.asarray(a, "float32"), cupy.asarray(b, "float32").T)
    cupy.cuda.get_current_stream().synchronize()
    seconds = time.perf_counter() - started
    exact = a.astype("float32").astype("float64") @ b.astype("float32").astype("float64").T
    error = float(numpy.abs(c.get() - exact).max() / numpy.abs(exact).max())
    if not error < 1e-5:
        raise Missing(f"our GEMM kernel compiled, but a 300x200x70 product is off by {error:.1e} (relative)")
    return f"NVRTC compiled gemm.cu and ran it in {seconds:.1f} s; a 300x200x70 product matches (error {error:.1e})"


def reported():
    """What only some steps need: said, not stopped for."""
    import cupy

    lines = []
    mpiexec = shutil.which("mpiexec")
    lines.append(f"mpiexec: {mpiexec or 'NOT FOUND: the two-rank steps will fail'}")
    try:
        from cupy.cuda import nccl

        lines.append(f"NCCL: {nccl.get_version() if nccl.available else 'NOT AVAILABLE: the NCCL test will fail'}")
    except Exception as exc:  # noqa: BLE001
        lines.append(f"NCCL: NOT AVAILABLE ({type(exc).__name__}: {exc}): the NCCL test will fail")
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0] if cxx else ""
    lines.append(f"C++ compiler for lesson 7's emulator: {version or 'NOT FOUND: lesson 7 will fail'}")
    lines.append(f"CUPY_TF32={os.environ.get('CUPY_TF32', '(unset)')} (cuBLAS in full FP32 needs 0), CuPy cache "
                 f"{os.environ.get('CUPY_CACHE_DIR', '~/.cupy/kernel_cache')}, {cupy.cuda.runtime.getDeviceCount()} GPU(s)")
    return lines


def main():
    check("Python", python)
    check("NumPy", numpy_version)
    check("minipar", minipar_from_checkout)
    check("MPI", mpi_library)
    check("CuPy", cupy_version)
    check("GPU", gpu)
    check("our GEMM kernel", our_kernel)
    for line in reported():
        print(f"preflight: note {line}", flush=True)
    print(f"preflight: everything the checks need is here ({time.perf_counter() - START:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
