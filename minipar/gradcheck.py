"""Check analytic gradients against central differences, in float64.

For a function f with output y and a random upstream gradient G, the scalar L = sum(y * G) has
dL/dx = (backward of f applied to G). A random G, unlike ``y.sum()``, catches a backward that is
right only for an all-ones gradient (a forgotten ``* grad``, a transposed product). Each entry's
numerical derivative is the central difference

    dL/dx_i ~ (L(x + eps e_i) - L(x - eps e_i)) / (2 eps),

whose truncation error is O(eps^2); with eps = 1e-6 in float64 both it and the rounding error
(~1e-16 sum|y G| / eps) are far below the tolerance, so a wrong backward stands out by many orders
of magnitude. Inputs are perturbed where they lie: a strided view stays a view, so an op whose
backward is wrong only for non-contiguous operands is caught.
"""

from dataclasses import dataclass

import numpy

from minipar.autograd import Tensor, no_grad
from minipar.backend import to_numpy, xp
from minipar.weight_grad import backward_input


@dataclass
class GradReport:
    name: str
    max_abs_err: float
    rel_err: float  # max |analytic - numeric| / max |numeric|: a norm-wise relative error
    checked: int  # entries compared
    ok: bool
    resolved: bool = True  # False: the differences' rounding is not below a thousandth of the gradient


def gradcheck(fn, inputs, names=None, eps=1e-6, rtol=1e-6, atol=1e-10, seed=0, max_entries=None, split=None):
    """Compare ``fn``'s backward with central differences for every input that requires grad.

    ``fn(*inputs)`` must return a Tensor and be deterministic (reseed any dropout inside it).
    ``max_entries`` checks a random subset of each input's entries instead of all of them.
    An input passes when every entry has |analytic - numeric| <= atol + noise + rtol * |numeric|:
    ``noise`` is the differences' rounding, 4 ulp x sum|y G| / eps (1e-9 for an objective of
    magnitude 1, and it grows with it), ``atol`` a margin above it far below a real mistake, and
    comparing entry by entry means a wrong small entry cannot hide behind a large one. Where the
    noise exceeds both ``atol`` and a thousandth of the largest numeric entry (not 0: an output
    that did not move at all has no rounding), the differences cannot tell a wrong gradient from
    a right one: the input fails, ``resolved`` False (a tiny gradient beside a huge output; a
    smaller objective or a larger ``eps`` can resolve it).
    Inputs are perturbed in place: each must be writable and share no memory with another.
    ``split``: the inputs whose gradients a split backward leaves for W (``minipar.weight_grad``):
    the gradients checked are then those of B followed by W, as a zero-bubble pipeline runs them.
    Returns one ``GradReport`` per checked input.
    """
    checked = [(i, t) for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.requires_grad]
    if not checked:
        raise ValueError("gradcheck: no input requires grad")
    for i, t in checked:
        if t.dtype != numpy.float64:
            raise TypeError(f"gradcheck needs float64 inputs, input {i} is {t.dtype}")
        if not getattr(getattr(t.data, "flags", None), "writeable", True):
            raise ValueError(f"gradcheck perturbs its inputs in place, and input {i} is read-only "
                             "(a broadcast view?): pass a writable array")
    for k, (i, a) in enumerate(checked):  # perturbing one would perturb the other: differences of both
        for j, b in checked[k + 1:]:
            if isinstance(a.data, numpy.ndarray) and numpy.shares_memory(a.data, b.data):
                raise ValueError(f"gradcheck perturbs its inputs in place, and inputs {i} and {j} share memory "
                                 "(views of one array): pass separate arrays")
    rng = numpy.random.default_rng(seed)
    out = fn(*inputs)
    upstream = xp.asarray(rng.standard_normal(out.shape))
    # the rounding of L's sum, each term's (it cancels where the terms do), from the output at hand
    noise = 4 * numpy.finfo(numpy.float64).eps * float(xp.abs(out.data * upstream).sum()) / eps
    for _, t in checked:
        t.grad = None
    # backward gets a copy: one that wrote into the gradient it receives (engine.py forbids it)
    # would change the upstream the differences use too, and could pass a wrong gradient
    given = upstream.copy()
    if split is None:
        out.backward(given)
    else:
        backward_input(out, split, given).run()
    if not xp.array_equal(given, upstream):
        raise AssertionError("gradcheck: the backward wrote into the upstream gradient it received")

    def objective():
        with no_grad():
            return float((fn(*inputs).data * upstream).sum())

    reports = []
    for i, t in checked:
        analytic = to_numpy(t.grad if t.grad is not None else xp.zeros_like(t.data)).ravel()
        data = t.data  # perturbed by index where it lies: a strided input is not copied
        entries = numpy.arange(data.size)
        if max_entries is not None and data.size > max_entries:
            entries = numpy.sort(rng.choice(data.size, max_entries, replace=False))
        numeric = numpy.empty(len(entries))
        for k, e in enumerate(entries):
            at = numpy.unravel_index(e, data.shape)  # entry e in C order, as ``analytic`` is raveled
            original = float(data[at])
            data[at] = original + eps
            plus = objective()
            data[at] = original - eps
            minus = objective()
            data[at] = original
            numeric[k] = (plus - minus) / (2 * eps)
        diff = numpy.abs(analytic[entries] - numeric)
        max_abs = float(diff.max()) if diff.size else 0.0
        scale = float(numpy.abs(numeric).max()) if numeric.size else 0.0
        rel = max_abs / scale if scale > 0 else max_abs
        name = names[i] if names else f"input {i}"
        resolved = noise <= max(atol, 1e-3 * scale) or scale == 0  # 0: L did not move at all, no rounding
        ok = resolved and bool(numpy.all(diff <= atol + noise + rtol * numpy.abs(numeric)))
        reports.append(GradReport(name, max_abs, rel, len(entries), ok, resolved))
    return reports


def op_cases(seed=0):
    """One gradient check per differentiable op: ``[(name, fn, inputs)]`` with float64 inputs.

    Shapes are small and odd so that broadcasting, batching and off-by-one mistakes show; the same
    catalogue drives the test suite and ``lessons/01_autograd.py``.
    """
    import minipar.functional as F
    from minipar.functional.blockwise import blockwise_attention

    rng = numpy.random.default_rng(seed)

    def t(*shape, positive=False):
        data = rng.standard_normal(shape)
        return Tensor(numpy.abs(data) + 0.5 if positive else data, requires_grad=True, dtype=numpy.float64)

    causal = numpy.triu(numpy.ones((5, 5), dtype=bool), k=1)
    repeated_ids = numpy.array([[1, 3, 1, 0], [3, 3, 2, 1]])  # ids 1 and 3 occur several times
    targets = numpy.array([[4, -1, 0], [2, 6, -1]])  # -1 is ignored
    # 4 tokens routed to k = 2 of 4 experts; their slots n k + j sorted by expert, 3 and 6 dropped
    experts = numpy.array([[2, 0], [1, 0], [2, 3], [0, 1]])
    slots = numpy.array([1, 2, 7, 0, 4, 5])
    return [
        ("add (broadcast)", F.add, [t(2, 3, 4), t(3, 1)]),
        ("sub (broadcast)", F.sub, [t(3, 4), t(4)]),
        ("mul (broadcast)", F.mul, [t(2, 3, 4), t(1, 4)]),
        ("div (broadcast)", F.div, [t(3, 4), t(3, 1, positive=True)]),
        ("neg", F.neg, [t(3, 4)]),
        ("pow", lambda a: F.pow(a, 3), [t(3, 4)]),
        ("pow (fractional)", lambda a: F.pow(a, 1.5), [t(3, 4, positive=True)]),
        ("exp", F.exp, [t(3, 4)]),
        ("log", F.log, [t(3, 4, positive=True)]),
        ("tanh", F.tanh, [t(3, 4)]),
        ("sum (axes 0, 2)", lambda a: F.sum(a, axis=(0, 2)), [t(2, 3, 4)]),
        ("sum (all)", F.sum, [t(2, 3, 4)]),
        ("mean (axis 1, keepdims)", lambda a: F.mean(a, axis=1, keepdims=True), [t(2, 3, 4)]),
        ("reshape", lambda a: F.reshape(a, (4, 6)), [t(2, 3, 4)]),
        ("transpose / permute", lambda a: F.transpose(a, (2, 0, 1)), [t(2, 3, 4)]),
        ("slicing", lambda a: a[1:, ::2, -1], [t(3, 5, 2)]),
        ("integer-array indexing", lambda a: a[numpy.array([0, 2, 0])], [t(3, 4)]),
        ("split (3 equal parts)", lambda a: F.split(a, 3, axis=-1)[0] * F.split(a, 3, axis=-1)[2], [t(2, 9)]),
        ("split (sizes, one unused)", lambda a: F.split(a, [1, 3, 2], axis=1)[1], [t(2, 6)]),
        ("concat", lambda a, b: F.concat([a, b, a], axis=1), [t(2, 3), t(2, 4)]),
        ("matmul (2-D)", F.matmul, [t(3, 4), t(4, 5)]),
        ("matmul (batched)", F.matmul, [t(2, 3, 4, 5), t(2, 3, 5, 2)]),
        ("matmul (batch @ shared matrix)", F.matmul, [t(2, 3, 4), t(4, 5)]),
        ("linear", F.linear, [t(2, 3, 5), t(4, 5), t(4)]),
        ("masked_fill (causal mask)", lambda a: F.masked_fill(a, causal, -2.0), [t(2, 5, 5)]),
        ("softmax", lambda a: F.softmax(a, axis=-1), [t(3, 5)]),
        ("softmax of causal scores", lambda a: F.softmax(F.masked_fill(a, causal, float("-inf"))), [t(2, 5, 5)]),
        ("log_softmax", lambda a: F.log_softmax(a, axis=-1), [t(3, 5)]),
        ("layer_norm", F.layer_norm, [t(2, 3, 6), t(6), t(6)]),
        ("gelu (tanh approximation)", F.gelu, [t(3, 7)]),
        ("embedding (repeated ids)", lambda w: F.embedding(repeated_ids, w), [t(5, 3)]),
        ("embedding (rows skipped, as a vocabulary-parallel rank's)",
         lambda w: F.embedding(repeated_ids, w, skip=repeated_ids == repeated_ids.flat[0]), [t(5, 3)]),
        ("cross_entropy (ignore_index=-1)", lambda x: F.cross_entropy(x, targets), [t(2, 3, 7)]),
        ("cross_entropy (sum)", lambda x: F.cross_entropy(x, targets, reduction="sum"), [t(2, 3, 7)]),
        ("permute (k=2, 2 slots dropped)", lambda x: F.permute(x, slots, 2), [t(4, 3)]),
        ("unpermute (weighted combine)", lambda y, w: F.unpermute(y, w, slots),
         [t(6, 3), t(4, 2)]),
        ("load-balancing loss", lambda p: F.load_balancing_loss(p, experts, 0.3), [t(4, 5)]),
        ("router z-loss", lambda z: F.z_loss(z, 0.7), [t(4, 5)]),
        ("dropout (p=0.3, seeded)", lambda a: F.dropout(a, 0.3, key=(7, 0)), [t(4, 5)]),
        ("causal_attention (fused)", lambda qkv: F.causal_attention(qkv, 2), [t(2, 5, 12)]),
        ("causal_attention (3 query blocks)",
         lambda qkv: F.causal_attention(qkv, 2, query_block=2), [t(2, 5, 12)]),
        ("causal_attention (dropout 0.2, seeded)",
         lambda qkv: F.causal_attention(qkv, 3, 0.2, key=(3, 0), query_block=3),
         [t(2, 4, 18)]),
        ("causal_attention (recomputed in backward, dropout 0.2)",
         lambda qkv: F.causal_attention(qkv, 3, 0.2, key=(3, 0), query_block=3, recompute=True), [t(2, 5, 18)]),
        # keys in blocks (the load-balanced chunks of 2 ranks, the later block first), merged by
        # the online softmax; the backward is FlashAttention's, from the output and log-sum-exp
        ("blockwise attention (online softmax merge)",
         lambda qkv: blockwise_attention(qkv, 2, [numpy.r_[2:6], numpy.r_[0:2, 6:8]]), [t(2, 8, 12)]),
        ("blockwise attention (dropout 0.2, seeded)",
         lambda qkv: blockwise_attention(qkv, 3, [numpy.r_[3:5], numpy.r_[0:3]], 0.2, key=(3, 0)),
         [t(2, 5, 18)]),
    ]
