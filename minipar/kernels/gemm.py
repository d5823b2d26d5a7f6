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

from dataclasses import dataclass
from pathlib import Path

import numpy

SOURCE = Path(__file__).with_name("gemm.cu")

# Block tile BM x BN, slab depth BK, TM x TN outputs per thread: 256 threads in both.
# float32: 64 accumulators per thread; ptxas reports ~105 registers and no spills (tests check).
TILES = {
    "float32": dict(BM=128, BN=128, BK=8, TM=8, TN=8),
    "float64": dict(BM=64, BN=64, BK=8, TM=4, TN=4),
}
NAIVE_BLOCK = 16  # gemm_naive's blocks are 16 x 16 threads
_MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
_INT32_MAX = 2**31 - 1


def threads(tiles):
    return (tiles["BM"] // tiles["TM"]) * (tiles["BN"] // tiles["TN"])


def kernel_name(dtype, trans_a, trans_b, naive=False):
    """The C++ name of one instantiation of a kernel template in gemm.cu."""
    ctype = {"float32": "float", "float64": "double"}[numpy.dtype(dtype).name]
    flags = f"{str(bool(trans_a)).lower()}, {str(bool(trans_b)).lower()}"
    if naive:
        return f"gemm_naive<{ctype}, {flags}>"
    t = TILES[numpy.dtype(dtype).name]
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


def _operand(x, batch_shape, xp):
    """Broadcast x's leading axes to the batch and read off how the kernel addresses it."""
    x = xp.broadcast_to(x, batch_shape + x.shape[-2:])
    for attempt in range(2):
        strides = [s // x.itemsize for s in x.strides]
        layout = _matrix_layout(x.shape[-2:], strides[-2:])
        stride = _batch_stride(x.shape[:-2], strides[:-2])
        if layout is not None and stride is not None and min(strides, default=0) >= 0:
            return Operand(x, layout[0], layout[1], stride)
        x = xp.ascontiguousarray(x)  # the one case that copies; the second attempt always fits
    raise AssertionError("a C-contiguous array always has a layout")  # pragma: no cover


def plan(a, b, xp):
    """How to compute ``a @ b`` (NumPy's rules) with the kernel."""
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul needs operands with >= 2 axes, got shapes {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
    if a.dtype != b.dtype or a.dtype.name not in TILES:
        raise TypeError(f"the GEMM kernel multiplies float32 or float64 matrices of one dtype, got "
                        f"{a.dtype} @ {b.dtype}: cast them first")
    batch_shape = tuple(numpy.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    M, K = a.shape[-2:]
    N = b.shape[-1]
    batch = int(numpy.prod(batch_shape, dtype=numpy.int64))
    pa, pb = _operand(a, batch_shape, xp), _operand(b, batch_shape, xp)
    if max(M, N, K, pa.ld, pb.ld) > _INT32_MAX:
        raise ValueError(f"matmul: a matrix side or row stride above 2^31 - 1 ({a.shape} @ {b.shape})")
    return Plan(pa, pb, M, N, K, batch, batch_shape + (M, N))


def output(p, out, xp):
    """The array the kernel writes: ``out`` itself when the kernel can address it, else a new one."""
    if out is not None:
        if out.shape != p.out_shape or out.dtype != p.a.array.dtype:
            raise ValueError(f"matmul: out is {out.shape} {out.dtype}, the product is {p.out_shape} "
                             f"{p.a.array.dtype}")
        strides = [s // out.itemsize for s in out.strides]
        layout = _matrix_layout(out.shape[-2:], strides[-2:])
        stride = _batch_stride(out.shape[:-2], strides[:-2])
        if layout is not None and not layout[0] and stride is not None and min(strides, default=0) >= 0:
            return out, layout[1], stride
    c = xp.empty(p.out_shape, p.a.array.dtype)
    return c, max(p.N, 1), p.M * p.N


def run(a, b, out, launch, xp):
    """``a @ b`` through ``launch``: ``launch(p, c, ldc, stride_c, first, count)`` runs the kernel
    on batch entries first .. first + count - 1 (the grid's z is at most 65535)."""
    p = plan(a, b, xp)
    c, ldc, stride_c = output(p, out, xp)
    if p.M and p.N:
        if -(-p.M // 16) > _MAX_GRID_YZ:  # the naive kernel's 16-row blocks need the most
            raise ValueError(f"matmul: {p.M} rows is more than the grid can cover")
        for first in range(0, p.batch, _MAX_GRID_YZ):
            launch(p, c, ldc, stride_c, first, min(_MAX_GRID_YZ, p.batch - first))
    if out is not None and c is not out:
        out[...] = c
        return out
    return c


# ---- the GPU --------------------------------------------------------------------------------------
_modules = {}


def _module(dtype):
    """gemm.cu compiled for one dtype: the tiled kernel in its four transpose cases, and the
    naive one (the benchmark's baseline)."""
    import cupy

    name = numpy.dtype(dtype).name
    if name not in _modules:
        names = [kernel_name(name, ta, tb, naive) for naive in (False, True)
                 for ta in (False, True) for tb in (False, True)]
        _modules[name] = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",),
                                        name_expressions=names)
    return _modules[name]


def _gpu_launcher(naive):
    def launch(p, c, ldc, stride_c, first, count):
        dtype = c.dtype
        kernel = _module(dtype).get_function(kernel_name(dtype, p.a.trans, p.b.trans, naive))
        step = dtype.itemsize
        a_ptr = p.a.array.data.ptr + first * p.a.batch_stride * step
        b_ptr = p.b.array.data.ptr + first * p.b.batch_stride * step
        c_ptr = c.data.ptr + first * stride_c * step
        if naive:
            grid = (-(-p.N // NAIVE_BLOCK), -(-p.M // NAIVE_BLOCK), count)
            block = (NAIVE_BLOCK, NAIVE_BLOCK, 1)
        else:
            t = TILES[dtype.name]
            grid, block = (-(-p.N // t["BN"]), -(-p.M // t["BM"]), count), (threads(t), 1, 1)
        i32, i64 = numpy.int32, numpy.int64  # CuPy would pass Python ints as 64-bit
        kernel(grid, block, (i64(a_ptr), i64(b_ptr), i64(c_ptr), i32(p.M), i32(p.N), i32(p.K),
                             i32(p.a.ld), i32(p.b.ld), i32(ldc), i64(p.a.batch_stride),
                             i64(p.b.batch_stride), i64(stride_c)))
    return launch


def matmul(a, b, out=None, naive=False):
    """``a @ b`` on CuPy arrays with our kernel (``naive=True``: the one-thread-per-element one)."""
    import cupy

    return run(a, b, out, _gpu_launcher(naive), cupy)
