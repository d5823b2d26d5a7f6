"""The array module and the default floating dtype.

Every other module does its math through ``xp`` from here, so the same code runs on NumPy (CPU) or
CuPy (GPU). The choice is made once, at import, from ``MINIPAR_DEVICE`` (``cpu``, the default, or
``cuda``). Asking for ``cuda`` without a working CuPy is an error, never a quiet fall back to the CPU.

On import it also tunes glibc's allocator for NumPy's allocate-per-op pattern (see
``_keep_freed_memory``); ``MINIPAR_MALLOC_TUNING=0`` leaves the allocator alone.
"""

import os

import numpy

DEVICE = os.environ.get("MINIPAR_DEVICE", "cpu").strip().lower() or "cpu"

if DEVICE == "cpu":
    xp = numpy
elif DEVICE == "cuda":
    try:
        import cupy as xp  # noqa: F401  (the GPU backend arrives with its own issue)
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            "MINIPAR_DEVICE=cuda needs CuPy: pip install -e '.[gpu]' "
            "(cupy-cuda12x; use cupy-cuda13x on CUDA 13), or unset MINIPAR_DEVICE to run on the CPU"
        ) from exc
else:
    raise ValueError(f"MINIPAR_DEVICE={DEVICE!r} is not a device: use 'cpu' or 'cuda'")


def _keep_freed_memory():
    """Ask glibc to keep freed blocks of up to 32 MiB in the process for reuse.

    Every op returns a fresh array, and by default glibc hands blocks above its (adaptive) mmap
    threshold straight back to the kernel when they are freed and trims the heap top when it grows;
    the next array of that size then page-faults its memory back in, one zeroed 4 KiB page at a time.
    Measured on the bench/step_time.py model: ~29,000 page faults and ~35 ms of a ~260 ms step.
    PyTorch avoids the same cost with its caching allocators. A no-op where libc is not glibc.
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's ceiling for this setting on 64-bit
    mallopt(M_TRIM_THRESHOLD, 1 << 30)


if os.environ.get("MINIPAR_MALLOC_TUNING", "1") != "0":
    _keep_freed_memory()

_FLOAT_DTYPES = ("float32", "float64")
_default_dtype = numpy.dtype(numpy.float32)
_generator = numpy.random.default_rng(0)


def set_default_dtype(dtype):
    """Use ``dtype`` (``numpy.float32``/``numpy.float64`` or their names) for new float tensors.

    float64 is for checking: gradient checks, and parallel-vs-serial comparisons that should agree
    to ~1e-12 instead of float32's ~1e-6.
    """
    global _default_dtype
    if dtype is None:  # numpy.dtype(None) would quietly mean float64
        raise ValueError("set_default_dtype(None): give 'float32' or 'float64'")
    try:
        dt = numpy.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"not a dtype: {dtype!r}; use 'float32' or 'float64'") from exc
    if dt.name not in _FLOAT_DTYPES:
        raise ValueError(f"default dtype must be float32 or float64, got {dt.name}")
    _default_dtype = dt


def get_default_dtype():
    return _default_dtype


def manual_seed(seed):
    """Reseed the generator that parameter initialisation and dropout draw from by default."""
    global _generator
    _generator = numpy.random.default_rng(seed)


def default_generator():
    """The process-wide generator. It is a NumPy generator on every device: initial weights are
    drawn on the host in float64 so float32, float64, CPU and GPU runs start from the same values."""
    return _generator


def blocks(n, size=1 << 16):
    """Slices cutting range(n) into pieces of ``size`` elements, for chains of elementwise ops.

    A chain like GELU's dozen ufuncs over a 4 MiB activation streams it through memory once per
    ufunc; run piece by piece, each 256 KiB piece stays in the core's L2 cache for the whole chain
    (measured ~1.8x faster on GELU). On a GPU the whole range is one piece: there, every launch costs.
    """
    if xp is not numpy:
        return [slice(0, n)]  # pragma: no cover - GPU only
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def to_numpy(array):
    """A host (NumPy) copy-or-view of an xp array, for printing, saving and comparing."""
    if xp is numpy:
        return numpy.asarray(array)
    return xp.asnumpy(array)  # pragma: no cover - GPU only
