"""The process-wide random generator: initial weights and the model's dropout seed come from it.

It is a NumPy generator whatever the device: initial weights are drawn on the host in float64 and
then cast and moved, so float32 and float64 runs, and CPU and GPU runs, start from the same values.
Dropout itself draws nothing from it: its masks are a hash of position (``rng.py``).
"""

import numpy

_generator = numpy.random.default_rng(0)


def manual_seed(seed):
    """Reseed the generator (``minipar.manual_seed``): the same seed, the same initial model."""
    global _generator
    _generator = numpy.random.default_rng(seed)


def default_generator():
    return _generator
