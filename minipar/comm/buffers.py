"""What MPI is handed for an array, and the reduction it applies.

A C-contiguous host array of a dtype MPI has goes as it is: the common case, checked first and
cheaply. bfloat16, which MPI has no type for, travels as its 16-bit patterns with a reduction of
our own. Anything else MPI cannot read gets an error that says what to pass instead.

GPU arrays: MPI gets a CuPy array's device memory directly only when the MPI library says it is
CUDA-aware (``MPIX_Query_cuda_support``, which MPICH and Open MPI both have); otherwise each array is
staged through host memory (copied down, moved, copied back when the operation completes). On GPUs
the collectives normally go through NCCL (``nccl.py``), which uses this class for what NCCL cannot
do: host arrays, point-to-point messages, and the case of two ranks on one GPU.
"""

import functools
import os

import numpy
from mpi4py import MPI

from minipar.dtypes import as_dtype, is_bfloat16

OPS = {"sum": MPI.SUM, "max": MPI.MAX}


def wire(x):
    """What MPI is handed for ``x``: bfloat16 (ml_dtypes), which MPI has no type for, travels as
    its 16-bit patterns (uint16), and its sums go through ``bfloat16_op``; float16 is MPI's own."""
    return x.view(numpy.uint16) if is_bfloat16(x.dtype) else x


@functools.cache
def bfloat16_op(op):
    """A user-defined MPI reduction over bfloat16 carried as uint16: each pairwise sum (or max) in
    bfloat16, as ml_dtypes computes it (in float32, rounded once)."""
    ufunc, bfloat16 = {"sum": numpy.add, "max": numpy.maximum}[op], as_dtype("bfloat16")

    def reduce(inbuf, inoutbuf, datatype):
        into = numpy.frombuffer(inoutbuf, bfloat16)
        ufunc(numpy.frombuffer(inbuf, bfloat16), into, out=into)

    return MPI.Op.Create(reduce, commute=True)


def check_buffer(x, what):
    if not isinstance(x, numpy.ndarray) and not hasattr(x, "__cuda_array_interface__"):
        raise TypeError(f"{what}: the MPI communicator moves NumPy or CuPy arrays, got {type(x).__name__}")
    if x.dtype.kind in "bOMm":  # refused here, on a group of 1 too, not by mpi4py on larger ones only
        if x.dtype.kind == "b":
            raise ValueError(f"{what}: MPI has no portable boolean type; send x.astype('int8')")
        raise TypeError(f"{what}: MPI cannot move {x.dtype} arrays (numbers and strings only); send numbers "
                        "(x.astype('int64') for dates and durations)")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: MPI needs a C-contiguous array; pass xp.ascontiguousarray(x)")
    return x


def check_root(root, size):
    """Refuse a broadcast root that is no rank of the group, as MPI does, on a group of 1 too (which
    sends nothing, so MPI never sees it)."""
    if not 0 <= root < size:
        raise ValueError(f"broadcast: root {root} is not a rank of this group of {size}; pass one of 0..{size - 1}")


@functools.cache
def cuda_aware():
    """Whether the loaded MPI library moves GPU memory itself (MINIPAR_MPI_CUDA_AWARE=0/1 overrides)."""
    choice = os.environ.get("MINIPAR_MPI_CUDA_AWARE")
    if choice in ("0", "1"):
        return choice == "1"
    import ctypes

    try:
        with open("/proc/self/maps") as maps:  # the libmpi mpi4py loaded (Linux)
            libraries = {line.split()[-1] for line in maps if "libmpi" in line.split("/")[-1]}
    except OSError:
        return False
    for path in sorted(libraries):
        query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            return query() == 1
    return False


# host arrays of these dtypes go to MPI as they are: the common case, checked first and cheaply,
# since a small collective's own time is a few microseconds
AS_IS = frozenset(numpy.dtype(t) for t in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                                            "uint8", "uint16", "uint32", "uint64"))

# what mpi4py raises when it cannot take a buffer as it is (not contiguous, a dtype MPI has not,
# counts or dtypes that do not match): as it parses the arguments, before MPI is called
REFUSED = (BufferError, KeyError, ValueError, TypeError)


def as_is(x):
    """Whether MPI takes ``x`` as it is: a C-contiguous host array of a dtype MPI has."""
    return type(x) is numpy.ndarray and x.dtype in AS_IS and x.flags.c_contiguous


def stage(x, what, copy_back):
    """(the buffer MPI reads or writes, what to run once the operation is done) for ``x``."""
    if as_is(x):
        return x, None
    check_buffer(x, what)
    if isinstance(x, numpy.ndarray):
        return wire(x), None
    import cupy  # pragma: no cover - GPU only

    cupy.cuda.get_current_stream().synchronize()  # kernels still writing x must finish first
    if cuda_aware():
        return wire(x), None
    host = x.get()
    return wire(host), ((lambda: x.set(host)) if copy_back else None)


@functools.cache  # on every collective's path: the checks run once per (op, dtype)
def reduction_op(op, dtype=None):
    if op not in OPS:
        raise ValueError(f"reduction op must be one of {sorted(OPS)}, got {op!r}")
    kind = None if dtype is None else numpy.dtype(dtype).kind
    if kind == "c" and op == "max":
        raise ValueError("complex numbers have no max; reduce abs(x), or the real and imaginary parts apart")
    if kind is not None and kind not in "iufc" and not is_bfloat16(dtype):
        raise TypeError(f"MPI sums and maxes numbers, not {dtype} arrays; reduce numbers (x.astype(...))")
    return bfloat16_op(op) if is_bfloat16(dtype) else OPS[op]
