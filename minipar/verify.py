"""Comparing a parallel run with the single-device run: relative errors the lessons and tests print.

Errors are relative in the 2-norm, ||a - b|| / ||b||. Gradients are compared tensor by tensor (the
worst is reported). Parameters after optimizer steps are compared as one vector: Adam divides each
gradient by its own running size, so an entry whose gradient nearly cancels takes a step of
ordinary size in a direction set by rounding, different for every summation order; a bias that
started at zero is only a few such steps large, and its own relative error says more about Adam
than about the layout. (Lessons also run AdamW with eps = 1e-5, below which gradients count as
nearly zero instead of as full steps.)
"""

import numpy

from minipar.backend import array_of, to_numpy


def rel_err(a, b):
    """||a - b|| / ||b|| (b == 0 everywhere: ||a - b||)."""
    a = numpy.asarray(to_numpy(array_of(a)), numpy.float64)
    b = numpy.asarray(to_numpy(array_of(b)), numpy.float64)
    if a.shape != b.shape:
        a = a.reshape(b.shape)
    norm = numpy.linalg.norm(b)
    return float(numpy.linalg.norm(a - b) / norm) if norm > 0 else float(numpy.linalg.norm(a - b))


def worst_tensor(values, reference):
    """max over names of rel_err(values[name], reference[name])."""
    return max(rel_err(values[name], ref) for name, ref in reference.items())


def as_one_vector(values, reference):
    """rel_err of all the tensors concatenated, in the order of ``reference``."""
    names = list(reference)
    flat = lambda d: numpy.concatenate([numpy.asarray(to_numpy(d[n]), numpy.float64).ravel() for n in names])  # noqa: E731
    return rel_err(flat(values), flat(reference))
