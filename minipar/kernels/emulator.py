"""Run gemm.cu on the CPU (``emulate.cpp``): the kernel's tests and lesson 07 need no GPU.

The C++ shims are compiled with g++ together with the unchanged CUDA source into a small shared
library, loaded with ctypes, cached by a hash of the sources and flags. ``source`` replaces
gemm.cu's text, which is how the tests plant bugs in it and watch them get caught.

``mode`` schedules each block's threads: ``"parallel"`` (all at once, meeting at a real barrier),
``"reversed"`` or ``"shuffled"`` (one thread at a time between barriers, in that order: a missing
``__syncthreads()`` then fails deterministically).
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import partial
from pathlib import Path

import numpy

from minipar.kernels import gemm

HERE = Path(__file__).parent
MODES = {"parallel": 0, "reversed": 1, "shuffled": 2}
_libraries = {}


class EmulatorError(RuntimeError):
    pass


def compiler():
    """The C++ compiler the emulator uses, or None (tests skip then)."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cache_dir():
    root = os.environ.get("MINIPAR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "minipar")
    path = Path(root) / "emulator"
    path.mkdir(parents=True, exist_ok=True)
    return path


def library(dtype="float32", source=None):
    """The emulator for one dtype's tile shapes, built from ``source`` (default: gemm.cu)."""
    dtype = gemm.dtype_name(dtype)
    source = gemm.SOURCE.read_text() if source is None else source
    shims = (HERE / "emulate.cpp").read_text()
    tiles = gemm.TILES[dtype]
    ctype = gemm.CTYPES[dtype]
    flags = ["-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
             f"-DEMU_T={ctype}"] + [f"-DEMU_{k}={v}" for k, v in tiles.items()]
    key = hashlib.sha256("\0".join([source, shims, *flags]).encode()).hexdigest()[:16]
    if key in _libraries:
        return _libraries[key]
    target = _cache_dir() / f"gemm_{dtype}_{key}.so"
    if not target.exists():
        cxx = compiler()
        if cxx is None:
            raise EmulatorError("the GEMM emulator needs a C++20 compiler: install g++ (or set CXX)")
        with tempfile.TemporaryDirectory() as work:
            Path(work, "gemm.cu").write_text(source)
            Path(work, "emulate.cpp").write_text(shims)
            built = Path(work, "emulate.so")
            result = subprocess.run([cxx, *flags, "-o", str(built), str(Path(work, "emulate.cpp"))],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise EmulatorError(f"compiling gemm.cu for the CPU failed:\n{result.stderr[-4000:]}")
            os.replace(built, target)  # atomic: a concurrent build leaves one whole file
    lib = ctypes.CDLL(str(target))
    lib.emulate_gemm.restype = ctypes.c_int
    lib.emulate_gemm.argtypes = ([ctypes.c_int] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 6
                                 + [ctypes.c_longlong] * 3 + [ctypes.c_int] * 2 + [ctypes.c_uint])
    lib.emulate_trace.restype = ctypes.c_int
    lib.emulate_trace.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.emulate_counts.argtypes = [ctypes.c_void_p]
    lib.emulate_watch.argtypes = [ctypes.c_int]
    _libraries[key] = lib
    return lib


def _launch(lib, naive, mode, seed, p, c, ldc, stride_c, first, count):
    step = c.dtype.itemsize
    code = lib.emulate_gemm(
        int(p.a.trans), int(p.b.trans), int(naive),
        p.a.array.ctypes.data + first * p.a.batch_stride * step,
        p.b.array.ctypes.data + first * p.b.batch_stride * step,
        c.ctypes.data + first * stride_c * step,
        p.M, p.N, p.K, p.a.ld, p.b.ld, ldc, p.a.batch_stride, p.b.batch_stride, stride_c, count,
        MODES[mode], seed)
    if code == 2:
        raise EmulatorError("the threads of a block did not all reach the same __syncthreads()")
    if code == 3:
        raise EmulatorError("a 16-byte vector load or store at an address that is not 16-byte aligned "
                            "(a GPU stops the kernel: misaligned address)")


def matmul(a, b, out=None, *, naive=False, mode="parallel", seed=0, source=None):
    """``a @ b`` on NumPy arrays, computed by gemm.cu's kernel running on the CPU."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    lib = library(a.dtype if gemm.dtype_name(a.dtype) in gemm.TILES else "float32", source)  # plan() checks dtypes
    return gemm.run(a, b, out, partial(_launch, lib, naive, mode, seed), numpy)


def watch(dtype, linear_thread, source=None):
    """Record the global loads of one thread (block-major numbering) from now on, and count all
    (in the emulator built from ``source``: pass the same one to ``matmul`` and ``trace``)."""
    library(dtype, source).emulate_watch(linear_thread)


def trace(dtype, source=None):
    """The watched thread's loads: rows of (operand 0=A 1=B, i, k, along_k, count); and the
    totals (load instructions, elements loaded) of every thread since ``watch``."""
    lib = library(dtype, source)
    n = lib.emulate_trace(None, 0)
    rows = numpy.zeros((n, 5), numpy.int32)
    lib.emulate_trace(rows.ctypes.data, n)
    totals = numpy.zeros(2, numpy.int64)
    lib.emulate_counts(totals.ctypes.data)
    return rows, (int(totals[0]), int(totals[1]))
