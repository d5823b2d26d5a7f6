"""The float dtype new tensors get when the caller names none.

float32 is the default; float64 is for checking: gradient checks, and parallel-vs-serial
comparisons that should agree to ~1e-15 instead of float32's ~1e-7. It is a setting of the
process, not of the device (``backend`` chooses that): the same choice holds on NumPy and CuPy.
"""

import numpy

FLOAT_DTYPES = ("float32", "float64")
_default_dtype = numpy.dtype(numpy.float32)


def set_default_dtype(dtype):
    """Use ``dtype`` (``numpy.float32``/``numpy.float64`` or their names) for new float tensors."""
    global _default_dtype
    if dtype is None:  # numpy.dtype(None) would quietly mean float64
        raise ValueError("set_default_dtype(None): give 'float32' or 'float64'")
    try:
        dt = numpy.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"not a dtype: {dtype!r}; use 'float32' or 'float64'") from exc
    if dt.name not in FLOAT_DTYPES:
        raise ValueError(f"default dtype must be float32 or float64, got {dt.name}")
    _default_dtype = dt


def get_default_dtype():
    return _default_dtype
