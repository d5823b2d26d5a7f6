"""Check analytic gradients against central differences, in float64.

For a function f with output y and a random upstream gradient G, the scalar L = sum(y * G) has
dL/dx = (backward of f applied to G). A random G, unlike ``y.sum()``, catches a backward that is
right only for an all-ones gradient (a forgotten ``* grad``, a transposed product). Each entry's
numerical derivative is the central difference

    dL/dx_i ~ (L(x + eps e_i) - L(x - eps e_i)) / (2 eps),

whose truncation error is O(eps^2); with eps = 1e-6 in float64 both it and the rounding error
(~1e-16 / eps) are far below the tolerance, so a wrong backward stands out by many orders of magnitude.
"""

from dataclasses import dataclass

import numpy

from minipar.autograd import Tensor, no_grad
from minipar.backend import to_numpy, xp


@dataclass
class GradReport:
    name: str
    max_abs_err: float
    rel_err: float  # max |analytic - numeric| / max |numeric|: a norm-wise relative error
    checked: int  # entries compared
    ok: bool


def gradcheck(fn, inputs, names=None, eps=1e-6, rtol=1e-6, atol=1e-8, seed=0, max_entries=None):
    """Compare ``fn``'s backward with central differences for every input that requires grad.

    ``fn(*inputs)`` must return a Tensor and be deterministic (reseed any dropout inside it).
    ``max_entries`` checks a random subset of each input's entries instead of all of them.
    An input passes when max |analytic - numeric| <= atol + rtol * max |numeric|; ``atol`` sits
    above the rounding noise of the differences (~1e-16 |L| / eps), far below a real mistake.
    Returns one ``GradReport`` per checked input.
    """
    checked = [(i, t) for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.requires_grad]
    if not checked:
        raise ValueError("gradcheck: no input requires grad")
    for i, t in checked:
        if t.dtype != numpy.float64:
            raise TypeError(f"gradcheck needs float64 inputs, input {i} is {t.dtype}")
        t.data = xp.ascontiguousarray(t.data)  # so that perturbing a flat view perturbs the input
    rng = numpy.random.default_rng(seed)
    out = fn(*inputs)
    upstream = xp.asarray(rng.standard_normal(out.shape))
    for _, t in checked:
        t.grad = None
    out.backward(upstream)

    def objective():
        with no_grad():
            return float((fn(*inputs).data * upstream).sum())

    reports = []
    for i, t in checked:
        analytic = to_numpy(t.grad if t.grad is not None else xp.zeros_like(t.data)).ravel()
        flat = t.data.reshape(-1)  # a view: perturbing it perturbs the input
        entries = numpy.arange(flat.size)
        if max_entries is not None and flat.size > max_entries:
            entries = numpy.sort(rng.choice(flat.size, max_entries, replace=False))
        numeric = numpy.empty(len(entries))
        for k, e in enumerate(entries):
            original = float(flat[e])
            flat[e] = original + eps
            plus = objective()
            flat[e] = original - eps
            minus = objective()
            flat[e] = original
            numeric[k] = (plus - minus) / (2 * eps)
        diff = numpy.abs(analytic[entries] - numeric)
        max_abs = float(diff.max()) if diff.size else 0.0
        scale = float(numpy.abs(numeric).max()) if numeric.size else 0.0
        rel = max_abs / scale if scale > 0 else max_abs
        name = names[i] if names else f"input {i}"
        reports.append(GradReport(name, max_abs, rel, len(entries), max_abs <= atol + rtol * scale))
    return reports
