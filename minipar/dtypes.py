"""The float dtypes, and the one new tensors get when the caller names none.

float32 is the default; float64 is for checking: gradient checks, and parallel-vs-serial
comparisons that should agree to ~1e-15 instead of float32's ~1e-7. bfloat16 and float16 are the
16-bit formats of mixed-precision training (``precision.py``): weights, activations and gradients
in 16 bits, the optimizer's master weights and the reductions that need range in float32.

NumPy has float16 but no bfloat16: ``ml_dtypes`` registers it as a NumPy dtype (its ``kind`` is
"V", not "f", so "is this a float" is asked through ``is_float`` here, never through ``kind``);
CuPy arrays take the same dtype object. The default is a setting of the process, not of the device
(``backend`` chooses that): the same choice holds on NumPy and CuPy.

``ml_dtypes`` is one of minipar's dependencies, but everything except bfloat16 runs on NumPy
alone (a bare interpreter on a lent GPU machine imports minipar from the checkout): without it,
asking for bfloat16 is an error that names the package, and nothing else changes.

It is imported when bfloat16 is first asked for (``as_dtype("bfloat16")``, ``dtypes.bfloat16``),
not with minipar: ml_dtypes 0.7 takes ~1 s to import (0.6: 0.1 s), and every rank of every
launch would pay it. Until something has imported it no array can be bfloat16, so asking whether
a dtype is (``is_bfloat16``, ``is_16bit``) never imports it; asking about the name "bfloat16" does.
"""

import sys

import numpy

float16 = numpy.dtype(numpy.float16)
FLOAT_DTYPES = ("float32", "float64", "bfloat16", "float16")
_FLOATS = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64), float16)
_default_dtype = numpy.dtype(numpy.float32)
_bfloat16 = None  # ml_dtypes' bfloat16, once ml_dtypes is imported


def _ml_dtypes():
    """The ml_dtypes module, imported now if nothing has yet; None without the package."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes


def _loaded_bfloat16():
    """bfloat16's dtype if ml_dtypes has been imported (by minipar or anyone), else None."""
    global _bfloat16
    if _bfloat16 is None:
        module = sys.modules.get("ml_dtypes")
        if module is not None and hasattr(module, "bfloat16"):  # not while it is still importing
            _bfloat16 = numpy.dtype(module.bfloat16)
    return _bfloat16


def __getattr__(name):
    """``dtypes.bfloat16`` (and ``from minipar.dtypes import bfloat16``): imports ml_dtypes; None
    without it."""
    if name == "bfloat16":
        return _loaded_bfloat16() if _ml_dtypes() is not None else None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def as_dtype(dtype):
    """``dtype`` (a name, a NumPy type or dtype) as a numpy.dtype, "bfloat16" included."""
    if dtype is None:  # numpy.dtype(None) would quietly mean float64
        raise ValueError("no dtype given: name one of " + ", ".join(FLOAT_DTYPES))
    if isinstance(dtype, str) and dtype == "bfloat16":
        if _ml_dtypes() is None:
            raise ValueError("bfloat16 needs the ml_dtypes package (a dependency of minipar): pip install ml-dtypes")
        return _loaded_bfloat16()
    try:
        return numpy.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"not a dtype: {dtype!r}; use one of {', '.join(FLOAT_DTYPES)}") from exc


def _numpy_dtype(dtype):
    """numpy.dtype(dtype), the name "bfloat16" too (NumPy knows it only once ml_dtypes is imported)."""
    return as_dtype(dtype) if isinstance(dtype, str) and dtype == "bfloat16" else numpy.dtype(dtype)


def _is_bfloat16_dtype(dt):
    """Whether the numpy.dtype ``dt`` is bfloat16, never comparing it with None."""
    bf16 = _loaded_bfloat16()
    return bf16 is not None and dt == bf16


def _asked(answers, dtype, ask):
    """``ask(numpy.dtype(dtype))``, remembered per dtype or scalar type: every op asks these of
    every input, and the whole call costs 0.13 us remembered against 0.7-0.9 us asked. Only
    dtypes and scalar types (NumPy's, ml_dtypes', Python's) are keys: a name is asked each time,
    and so is anything NumPy reads a ``.dtype`` from (a tensor, or a class with one), whose
    answer may change and which would stay alive as a key. A void dtype is not remembered
    before ml_dtypes has loaded either, since bfloat16's kind is "V"."""
    if not (isinstance(dtype, numpy.dtype) or isinstance(dtype, type) and issubclass(dtype, _SCALARS)):
        return ask(_numpy_dtype(dtype))
    try:
        return answers[dtype]
    except KeyError:
        pass
    dt = numpy.dtype(dtype)
    answer = ask(dt)
    if dt.kind != "V" or _loaded_bfloat16() is not None:
        answers[dtype] = answer
    return answer


_FLOAT_ANSWERS, _16BIT_ANSWERS = {}, {}
_SCALARS = (numpy.generic, bool, int, float, complex)


def is_float(dtype):
    """Whether ``dtype`` is one of the floats the engine computes in (bfloat16's kind is "V")."""
    return _asked(_FLOAT_ANSWERS, dtype, lambda dt: dt in _FLOATS or _is_bfloat16_dtype(dt))


def is_16bit(dtype):
    return _asked(_16BIT_ANSWERS, dtype, lambda dt: dt == float16 or _is_bfloat16_dtype(dt))


def is_bfloat16(dtype):
    """Ask this, never ``dtype == bfloat16`` at a call site: without ml_dtypes ``bfloat16`` is None,
    and NumPy reads ``dtype == None`` as float64."""
    return _is_bfloat16_dtype(_numpy_dtype(dtype))


def compute_dtype(dtype):
    """The dtype an op accumulates in for inputs of ``dtype``: float32 for the 16-bit formats (their
    8 or 11 bits of mantissa lose a sum of many terms; bfloat16 has float32's range, float16 does not
    even hold exp(12)), the dtype itself otherwise."""
    return numpy.dtype(numpy.float32) if is_16bit(dtype) else numpy.dtype(dtype)


def finfo(dtype):
    """NumPy's finfo, which refuses ml_dtypes' bfloat16: ml_dtypes has its own."""
    return sys.modules["ml_dtypes"].finfo(dtype) if is_bfloat16(dtype) else numpy.finfo(dtype)


def set_default_dtype(dtype):
    """Use ``dtype`` (one of FLOAT_DTYPES, by name or type) for new float tensors."""
    dt = as_dtype(dtype)
    if dt.name not in FLOAT_DTYPES:
        raise ValueError(f"default dtype must be float32 or float64 (or, for mixed precision, bfloat16 or "
                         f"float16), got {dt.name}")
    global _default_dtype
    _default_dtype = dt


def get_default_dtype():
    return _default_dtype
