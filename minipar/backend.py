"""The array module and the device: which one runs the math, and the operations it decides.

The default float dtype (``dtypes.py``) and the seeded generator (``random.py``) are settings of
the process, not of the device, and live apart from it.

Every other module does its math through ``xp`` from here, so the same code runs on NumPy (CPU) or
CuPy (GPU). ``xp`` is a namespace that ``use_device`` fills with NumPy's or CuPy's functions: the
modules that imported it before the choice (``from minipar.backend import xp``) see the choice too,
so ``--device cuda`` can be read from the command line after the imports. At import the device is
``MINIPAR_DEVICE`` (``cpu``, the default, or ``cuda``). One it cannot use (another name, ``cuda``
without a working CuPy and GPU) is an error, never a quiet fall back to the CPU: every use of
``xp`` raises it, and the scripts report it among their flags (``environment_problem``).

Five operations are here rather than in ``functional`` because the device decides how they run:
``matmul`` (BLAS on the CPU, our own kernel in ``kernels/gemm.cu`` on the GPU: cuBLAS is never
used for the model's math), ``dot_along``, ``sum_along`` and ``sum_of_squares`` (BLAS tricks on
the CPU, plain reductions on the GPU, where CuPy would hand them to cuBLAS; the plain forms are
also the references the tests hold the BLAS tricks to), and ``sum_segments``
(NumPy's ``reduceat`` on the CPU; CuPy's is not accurate enough, see there).

On import it also tunes glibc's allocator for NumPy's allocate-per-op pattern (``allocator.py``);
``MINIPAR_MALLOC_TUNING=0`` leaves the allocator alone.
"""

import argparse
import math
import os
import types

import numpy

from minipar.allocator import keep_freed_memory
from minipar import node
from minipar.dtypes import is_16bit

DEVICES = ("cpu", "cuda")
DEVICE = None
xp = types.ModuleType("xp", "NumPy or CuPy, as use_device chose")

if os.environ.get("MINIPAR_MALLOC_TUNING", "1") != "0":
    keep_freed_memory()

def free_memory(host=False):
    """(bytes free on this rank's device, how many ranks of the node share them, what was read),
    or None where nothing says: the GPU's free memory, or the host's MemAvailable (Linux), which
    ``host`` asks for on a GPU too."""
    ranks = node.local_size()
    if DEVICE == "cuda" and not host:
        import cupy

        free, _ = cupy.cuda.runtime.memGetInfo()
        sharing = -(-ranks // cupy.cuda.runtime.getDeviceCount())  # ranks go round the GPUs
        return free, sharing, f"free memory of the {gpu_name()}"
    try:
        with open("/proc/meminfo") as fh:
            kib = next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kib * 1024, ranks, "MemAvailable"


def _cupy_on_this_rank():
    try:
        import cupy
    except ImportError as exc:
        raise ImportError("the cuda device needs CuPy: pip install -e '.[gpu-cuda12]' (or '.[gpu-cuda13]' "
                          "on CUDA 13), or run on the CPU (--device cpu, MINIPAR_DEVICE=cpu)") from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        count, why = 0, str(exc)
    else:
        why = "no device found"
    if count == 0:
        raise RuntimeError(f"the cuda device was asked for, but CuPy sees no GPU ({why}): run on the "
                           "CPU (--device cpu, MINIPAR_DEVICE=cpu)")
    cupy.cuda.Device(node.local_rank() % count).use()  # ranks of a node spread over its GPUs
    return cupy


def use_device(name):
    """Run on ``name`` ("cpu" or "cuda") from now on. Call it before making any array: arrays
    already made stay where they are."""
    global DEVICE
    name = (name or "cpu").strip().lower()
    if name not in DEVICES:
        raise ValueError(f"device {name!r} is not one of {', '.join(DEVICES)}")
    if name == DEVICE:
        return
    module = numpy if name == "cpu" else _cupy_on_this_rank()
    for key in [k for k in vars(xp) if not k.startswith("__")]:
        delattr(xp, key)
    # Copied names cost nothing per call; the rest (NumPy loads numpy.random and others lazily)
    # are looked up on first use through the module-level __getattr__ (PEP 562).
    xp.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    xp.__getattr__ = lambda attr: getattr(module, attr)
    DEVICE = name


def on_gpu():
    return DEVICE == "cuda"


def gpu_name(index=None):
    """The name of GPU ``index`` (default: this rank's), e.g. "NVIDIA H200". CuPy gives the
    driver's char array as bytes; a str is taken as it is."""
    import cupy

    index = cupy.cuda.Device().id if index is None else index
    name = cupy.cuda.runtime.getDeviceProperties(index)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def device_from_environment():
    """``MINIPAR_DEVICE`` as a device name ("cpu" when unset or empty), not yet checked."""
    return os.environ.get("MINIPAR_DEVICE", "").strip().lower() or "cpu"


def environment_problem():
    """Why the device ``MINIPAR_DEVICE`` names cannot be used, as one line naming the variable;
    None if it can (or was replaced since by ``use_device``)."""
    return None if DEVICE is not None else _environment_problem


def device_flag(text):
    """The type of ``--device``: argparse applies it to the default too (MINIPAR_DEVICE), which its
    ``choices`` are never checked against."""
    name = text.strip().lower()
    if name in DEVICES:
        return name
    choices = " or ".join(DEVICES)
    if text == os.environ.get("MINIPAR_DEVICE"):
        raise argparse.ArgumentTypeError(f"MINIPAR_DEVICE={text!r} (the default of --device) is not a device: "
                                         f"set it to {choices}, or unset it")
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: choose {choices}")


def add_device_flag(parser):
    """``--device`` for a script's argparse parser; pass the parsed value to ``use_device``."""
    parser.add_argument("--device", type=device_flag, choices=DEVICES, default=device_from_environment(),
                        help="cpu (NumPy) or cuda (CuPy, minipar's GEMM kernel, NCCL collectives)")


def _refuse_every_use(problem, kind):
    """Leave no device: every use of ``xp`` raises ``problem``, never a quiet fall back to the CPU."""
    def refuse(attr):
        raise kind(problem)

    xp.__getattr__ = refuse


_environment_problem = None
try:
    use_device(device_from_environment())
except (ValueError, ImportError, RuntimeError) as exc:
    # Not raised here, while ``import minipar`` runs: a script could not catch it, and a traceback
    # would stand where a flag problem is one line (the CLI's and the lessons' --device defaults to
    # this variable and is checked with the other flags). Code that uses xp unchecked still fails.
    _environment_problem = f"MINIPAR_DEVICE={os.environ['MINIPAR_DEVICE']!r}: {exc}"
    _refuse_every_use(_environment_problem, type(exc))


def _widened(*arrays):
    """16-bit float arrays widened to float32, the dtype their products and sums accumulate in
    (mixed precision's rule: 16-bit inputs, float32 accumulation); others as they are."""
    return tuple(a.astype(numpy.float32) if is_16bit(a.dtype) else a for a in arrays)


def matmul(a, b, out=None):
    """``a @ b`` with NumPy's batching rules: every matrix product of the engine goes through here.

    16-bit inputs (bfloat16, float16) are multiplied with float32 accumulation and the product
    narrowed to their dtype. On the GPU our kernel reads two 16-bit operands of one dtype as they
    are (``kernels/gemm.cu``); BLAS has no 16-bit GEMM, so on the CPU (and for a 16-bit operand
    with a float32 one) they are widened first: the same numbers, at the cost of a copy."""
    if DEVICE != "cpu" and a.dtype == b.dtype and is_16bit(a.dtype):
        from minipar.kernels import gemm

        return gemm.matmul(a, b, out=out)
    if is_16bit(a.dtype) or is_16bit(b.dtype):
        product = matmul(*_widened(a, b))
        if out is None:
            return product.astype(a.dtype)
        out[...] = product
        return out
    if DEVICE == "cpu":
        return numpy.matmul(a, b, out=out)
    from minipar.kernels import gemm

    return gemm.matmul(a, b, out=out)


def dot_along(a, b, axis):
    """The sum over ``axis`` of a * b. NumPy's einsum does it without the temporary product."""
    if is_16bit(a.dtype):
        return dot_along(*_widened(a, b), axis).astype(a.dtype)
    if DEVICE == "cpu":
        letters = "abcdefgh"[: a.ndim]
        kept = letters.replace(letters[axis], "")
        return numpy.einsum(f"{letters},{letters}->{kept}", a, b)
    return (a * b).sum(axis=axis)


def sum_along(a, axis):
    """The sum over the last axis (-1) or the one before (-2). On the CPU a product with a ones
    vector: one BLAS pass, ~4x faster than ``a.sum(axis=-1)`` on (1024, 256) float32, whose rows are
    short. On the GPU a plain reduction."""
    if is_16bit(a.dtype):
        return sum_along(*_widened(a), axis).astype(a.dtype)
    if DEVICE != "cpu":
        return a.sum(axis=axis)
    ones = numpy.ones(a.shape[axis], a.dtype)
    if axis in (-1, a.ndim - 1):
        return a @ ones
    if axis in (-2, a.ndim - 2):
        return ones @ a
    raise ValueError(f"sum_along sums over axis -1 or -2, not {axis}")


def sum_of_squares(arrays):
    """The sum of the squares of every element of ``arrays``, as a Python float: BLAS dots on the
    CPU; on the GPU one reduction per array and a single read back to the host.

    A float32 BLAS dot accumulates in float32 along a few long strides: 3e-5 relative error over
    5M elements (the plain reduction, the GPU's, has 4e-9). So float32 squares are summed pairwise
    into float64 (~1e-10; 0.3 ms for 834K elements, against 0.05 for the dot). A float32 square
    overflows past 1.8e19, where the gradient is still finite: a sum that came out infinite is
    taken again with the squares in float64, so the norm is infinite only if an element is."""
    arrays = [x.astype(numpy.float32) if is_16bit(x.dtype) else x for x in arrays]  # fp16's square overflows at 256
    if DEVICE != "cpu":
        with numpy.errstate(over="ignore"):  # (NumPy standing in for CuPy in the tests; CuPy never warns)
            total = float(sum(((x * x).sum() for x in arrays), xp.zeros((), "float64")))
        if math.isfinite(total):
            return total
        return float(sum((xp.square(x.astype(xp.float64)).sum() for x in arrays), xp.zeros((), "float64")))
    total = 0.0  # a float even for no arrays
    for x in arrays:
        flat = x.ravel()
        if flat.dtype == numpy.float64:
            total += float(numpy.vdot(flat, flat))
            continue
        with numpy.errstate(over="ignore"):
            part = float(numpy.square(flat).sum(dtype=numpy.float64))
        total += part if math.isfinite(part) else float(numpy.square(flat, dtype=numpy.float64).sum())
    return total


def sum_segments(rows, starts):
    """Sums of runs of consecutive rows: ``out[i] = rows[starts[i]:starts[i + 1]].sum(axis=0)`` (the
    last run goes to the end), for ascending ``starts`` beginning at 0.

    The CPU runs NumPy's ``add.reduceat``, which adds each run's rows one after another. CuPy's
    ``reduceat`` instead subtracts two running sums over all rows, so a run's error grows with the
    whole array (~1e-6 relative in float32 for 8192 rows). The GPU therefore sums each run pairwise:
    at stride s every row at an even multiple of s in its run adds the row s further on, if that
    row is still in the run; after log2(longest run) such rounds each run's sum is in its first row.
    Both are deterministic, and both are as accurate as a plain sum of the run's rows."""
    if DEVICE == "cpu":
        return numpy.add.reduceat(rows, starts, axis=0)
    n = rows.shape[0]
    if n == 0:
        return rows[:0]
    first = xp.zeros(n, xp.int64)
    first[starts[1:]] = 1
    run = xp.cumsum(first)                        # the run each row belongs to
    lengths = xp.diff(xp.append(starts, n))
    position = xp.arange(n) - starts[run]         # the row's place in its run
    left = lengths[run] - position                # rows from this one to the end of its run
    acc = rows.copy()
    stride, longest = 1, int(lengths.max())
    while stride < longest:
        i = xp.flatnonzero((position % (2 * stride) == 0) & (left > stride))
        acc[i] += acc[i + stride]                 # rows i + stride sit at odd multiples: not written now
        stride *= 2
    return acc[starts]


def blocks(n, size=1 << 16):
    """Slices cutting range(n) into pieces of ``size`` elements, for chains of elementwise ops.

    A chain like GELU's dozen ufuncs over a 4 MiB activation streams it through memory once per
    ufunc; run piece by piece, each 256 KiB piece stays in the core's L2 cache for the whole chain
    (measured ~1.8x faster on GELU). On a GPU the whole range is one piece: there, every launch costs.
    """
    if DEVICE != "cpu":
        return [slice(0, n)]  # pragma: no cover - GPU only
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def cache_block(arrays, itemsize=4):
    """Elements per block (a power of two, at least 4096) for ``blocks``, so that ``arrays``
    arrays of ``itemsize`` bytes of a block together fill at most the core's L2 cache."""
    fit = node.l2_cache_bytes() // (arrays * itemsize)
    return max(1 << 12, 1 << max(fit, 1).bit_length() - 1)


def array_of(value):
    """The array a Tensor holds (its ``.data``), or ``value`` itself when it is already an array
    or a list. A CuPy array has a ``.data`` of its own, a raw memory pointer, so "``.data`` if it
    has one" would hand that pointer on."""
    if isinstance(value, (numpy.ndarray, xp.ndarray)):
        return value
    return getattr(value, "data", value)


def to_numpy(array):
    """A host (NumPy) copy-or-view of an xp array, for printing, saving and comparing."""
    if hasattr(array, "__cuda_array_interface__"):  # a CuPy array, whatever the current device
        return array.get()  # pragma: no cover - GPU only
    return numpy.asarray(array)
