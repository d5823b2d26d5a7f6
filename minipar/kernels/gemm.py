"""Every matmul on the GPU goes through ``gemm.cu``: this file plans and launches it.

``plan`` maps a matrix product of arrays, as NumPy defines it (batched and broadcast over the
leading axes), onto the kernel's arguments: for each operand a transpose flag and a row stride
(``ld``) read off the array's strides, so that the transposed views of the backward products
(``g @ w.T``, ``x.T @ g``) cost no copy, and one stride per operand across the batch (0 when the
operand is shared). Only an operand whose layout the kernel cannot address (negative strides, a
batch that is not evenly spaced) is copied first.

``matmul`` runs the plan on CuPy arrays with the kernel compiled by NVRTC (``cupy.RawModule``; CuPy
also caches the binary on disk). ``emulator.matmul`` runs the very same plan through the CPU
emulation of the kernel, which is how the tests check the plan without a GPU. cuBLAS is never
called here: it is only the baseline of the tests and of ``bench/gemm.py``.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy

SOURCE = Path(__file__).with_name("gemm.cu")

# Block tile BM x BN, slab depth BK, TM x TN outputs per thread: 256 threads in both.
# float32: 64 accumulators per thread; ptxas reports ~105 registers and no spills (tests check).
# bfloat16 and float16: the same 64 float32 accumulators; a 16-byte load carries 8 values, so a
# slab is 16 deep for each of the 256 threads to load one run of A and one of B.
TILES = {
    "float32": dict(BM=128, BN=128, BK=8, TM=8, TN=8),
    "float64": dict(BM=64, BN=64, BK=8, TM=4, TN=4),
    "bfloat16": dict(BM=128, BN=128, BK=16, TM=8, TN=8),
    "float16": dict(BM=128, BN=128, BK=16, TM=8, TN=8),
}
# The kernel's C++ type of each dtype (gemm.cu defines the two 16-bit ones as their bits).
CTYPES = {"float32": "float", "float64": "double", "bfloat16": "bfloat16", "float16": "float16"}
NAIVE_BLOCK = 16  # gemm_naive's blocks are 16 x 16 threads
_MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
_INT32_MAX = 2**31 - 1


def threads(tiles):
    return (tiles["BM"] // tiles["TM"]) * (tiles["BN"] // tiles["TN"])


_NAMES = {}  # dtype -> name: NumPy's dtype.name is a Python property (4.8 us), and every product asks


def dtype_name(dtype):
    """'float32', 'bfloat16', ...: NumPy spells ml_dtypes' bfloat16 by name only once it is imported."""
    if isinstance(dtype, str):
        return dtype
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = numpy.dtype(dtype).name
    return name


def kernel_name(dtype, trans_a, trans_b, naive=False):
    """The C++ name of one instantiation of a kernel template in gemm.cu."""
    ctype = CTYPES[dtype_name(dtype)]
    flags = f"{str(bool(trans_a)).lower()}, {str(bool(trans_b)).lower()}"
    if naive:
        return f"gemm_naive<{ctype}, {flags}>"
    t = TILES[dtype_name(dtype)]
    return f"gemm_tiled<{ctype}, {t['BM']}, {t['BN']}, {t['BK']}, {t['TM']}, {t['TN']}, {flags}>"


@dataclass
class Operand:
    array: object  # the array whose memory the kernel reads, starting at its element [0, ..., 0]
    trans: bool
    ld: int
    batch_stride: int  # elements


@dataclass
class Plan:
    a: Operand
    b: Operand
    M: int
    N: int
    K: int
    batch: int
    out_shape: tuple


def _matrix_layout(shape, strides):
    """(trans, ld) that let the kernel read a matrix with these element strides, or None."""
    rows, cols = shape
    s_row, s_col = strides
    if cols == 1 or s_col == 1:  # rows are contiguous: as stored
        ld = s_row if rows > 1 else cols
        return (False, ld) if ld >= cols else None
    if rows == 1 or s_row == 1:  # columns are contiguous: the transpose of a row-major matrix
        ld = s_col if cols > 1 else rows
        return (True, ld) if ld >= rows else None
    return None


def _batch_stride(shape, strides):
    """One stride that steps through every leading index in order, or None. Axes of length 1
    do not matter; a broadcast operand has stride 0 on its broadcast axes."""
    kept = [(n, s) for n, s in zip(shape, strides) if n > 1]
    for (_, outer), (n, inner) in zip(kept, kept[1:]):
        if outer != inner * n:
            return None
    return kept[-1][1] if kept else 0


def _address(x):
    return x.data.ptr if hasattr(x, "__cuda_array_interface__") else x.ctypes.data


def _addressable(x, writes=False):
    """(trans, ld, batch stride) with which the kernel can read (or write) x in place, or None.
    Elements must lie on whole multiples of their size (a field of a NumPy record may not); an
    output must also have no two of its elements at one address (a zero stride)."""
    if any(s % x.itemsize for s in x.strides) or _address(x) % x.itemsize:
        return None
    strides = [s // x.itemsize for s in x.strides]
    layout = _matrix_layout(x.shape[-2:], strides[-2:])
    stride = _batch_stride(x.shape[:-2], strides[:-2])
    if layout is None or stride is None or min(strides, default=0) < 0:
        return None
    if writes and (layout[0] or any(s == 0 for n, s in zip(x.shape, strides) if n > 1)):
        return None
    return layout[0], layout[1], stride


def _operand(x, batch_shape, xp):
    """Broadcast x's leading axes to the batch and read off how the kernel addresses it."""
    if x.shape[:-2] != batch_shape:  # broadcast_to costs microseconds, and most operands have the batch
        x = xp.broadcast_to(x, batch_shape + x.shape[-2:])
    found = _addressable(x)
    if found is None:
        x = xp.ascontiguousarray(x)  # the one case that copies: a C-contiguous array always fits
        found = _addressable(x)
    return Operand(x, *found)


def check(a, b):
    """The product's batch shape and M, N, K, after checking the operands (NumPy's rules)."""
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul needs operands with >= 2 axes, got shapes {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
    if a.dtype != b.dtype or dtype_name(a.dtype) not in TILES:
        raise TypeError(f"the GEMM kernel multiplies matrices of one dtype, {', '.join(TILES)}, got "
                        f"{a.dtype} @ {b.dtype}: cast them first")
    batch_shape = a.shape[:-2]
    if batch_shape != b.shape[:-2]:
        batch_shape = tuple(numpy.broadcast_shapes(batch_shape, b.shape[:-2]))
    return batch_shape, a.shape[-2], b.shape[-1], a.shape[-1]


def plan(a, b, xp, checked=None):
    """How to compute ``a @ b`` with the kernel (operands with no elements are the caller's);
    ``checked``: what ``check(a, b)`` returned, if the caller has it."""
    batch_shape, M, N, K = checked or check(a, b)
    batch = math.prod(batch_shape)
    pa, pb = _operand(a, batch_shape, xp), _operand(b, batch_shape, xp)
    if max(M, N, K, pa.ld, pb.ld) > _INT32_MAX:
        raise ValueError(f"matmul: a matrix side or row stride above 2^31 - 1 ({a.shape} @ {b.shape})")
    return Plan(pa, pb, M, N, K, batch, batch_shape + (M, N))


def output(p, out, a, b, xp):
    """The array the kernel writes, with its ldc and batch stride: ``out`` itself when the kernel
    can write it in place (row-major rows, no element twice, no overlap with an operand: blocks
    would overwrite what later blocks still read), else a new array copied into ``out`` after."""
    if out is not None:
        found = _addressable(out, writes=True)
        overlaps = any(xp.may_share_memory(out, x) for x in (a, b))
        if found is not None and found[1] <= _INT32_MAX and not overlaps:
            return out, found[1], found[2]
    return xp.empty(p.out_shape, p.a.array.dtype), p.N, p.M * p.N


def run(a, b, out, launch, xp):
    """``a @ b`` through ``launch``: ``launch(p, c, ldc, stride_c, first, count)`` runs the kernel
    on batch entries first .. first + count - 1 (the grid's z is at most 65535)."""
    batch_shape, M, N, K = check(a, b)
    shape = batch_shape + (M, N)
    if out is not None and (out.shape != shape or out.dtype != a.dtype):
        raise ValueError(f"matmul: out is {out.shape} {out.dtype}, the product is {shape} {a.dtype}")
    if 0 in shape or K == 0:  # nothing to launch: the product is empty, or all zeros (K = 0)
        c = xp.zeros(shape, a.dtype) if out is None else out
        c[...] = 0
        return c
    p = plan(a, b, xp, (batch_shape, M, N, K))
    c, ldc, stride_c = output(p, out, a, b, xp)
    for first in range(0, p.batch, _MAX_GRID_YZ):
        launch(p, c, ldc, stride_c, first, min(_MAX_GRID_YZ, p.batch - first))
    if out is not None and c is not out:
        out[...] = c
        return out
    return c


# ---- the GPU --------------------------------------------------------------------------------------
_modules, _kernels = {}, {}


def _module(dtype):
    """gemm.cu compiled for one dtype: the tiled kernel in its four transpose cases, and the
    naive one (the benchmark's baseline)."""
    import cupy

    name = dtype_name(dtype)
    if name not in _modules:
        names = [kernel_name(name, ta, tb, naive) for naive in (False, True)
                 for ta in (False, True) for tb in (False, True)]
        _modules[name] = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",),
                                        name_expressions=names)
    return _modules[name]


def _kernel(dtype, trans_a, trans_b, naive):
    """One compiled kernel, looked up once: ``get_function`` makes a new function object on every
    call, which would add its cost to every small product (and to what the benchmark measures)."""
    key = (dtype_name(dtype), bool(trans_a), bool(trans_b), naive)
    if key not in _kernels:
        _kernels[key] = _module(key[0]).get_function(kernel_name(*key))
    return _kernels[key]


def _gpu_launcher(naive):
    def launch(p, c, ldc, stride_c, first, count):
        dtype = c.dtype
        kernel = _kernel(dtype, p.a.trans, p.b.trans, naive)
        step = dtype.itemsize
        a_ptr = p.a.array.data.ptr + first * p.a.batch_stride * step
        b_ptr = p.b.array.data.ptr + first * p.b.batch_stride * step
        c_ptr = c.data.ptr + first * stride_c * step
        if naive:
            grid = (-(-p.N // NAIVE_BLOCK), -(-p.M // NAIVE_BLOCK), count)
            block = (NAIVE_BLOCK, NAIVE_BLOCK, 1)
        else:
            t = TILES[dtype_name(dtype)]
            grid, block = (-(-p.N // t["BN"]), -(-p.M // t["BM"]), count), (threads(t), 1, 1)
        if grid[1] > _MAX_GRID_YZ:
            raise ValueError(f"matmul: {p.M} rows need {grid[1]} blocks along the grid's y, more than "
                             f"CUDA allows ({_MAX_GRID_YZ})")
        i32, i64 = numpy.int32, numpy.int64  # CuPy would pass Python ints as 64-bit
        kernel(grid, block, (i64(a_ptr), i64(b_ptr), i64(c_ptr), i32(p.M), i32(p.N), i32(p.K),
                             i32(p.a.ld), i32(p.b.ld), i32(ldc), i64(p.a.batch_stride),
                             i64(p.b.batch_stride), i64(stride_c)))
    return launch


def matmul(a, b, out=None, naive=False):
    """``a @ b`` on CuPy arrays with our kernel (``naive=True``: the one-thread-per-element one)."""
    import cupy

    return run(a, b, out, _gpu_launcher(naive), cupy)
