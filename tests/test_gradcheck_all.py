"""The audit of the rule "every op's gradient is checked by central differences in float64 with a
random upstream gradient", for every ``Function`` in minipar, not only minipar/functional.

``AUDIT`` names, for each Function, where its backward is checked; a test fails when a Function
appears that it does not list. The checks the other files did not make are here: the branches
``gradcheck.op_cases`` does not reach (``extra_cases``), the ops outside minipar/functional that run on
one process, every input of a multi-input op alone (a fresh ``needs_input_grad`` with the others
frozen), the split backward of ``minipar.weight_grad`` (B, then W asking for one input only), and
the GPU's branches run on NumPy arrays. A collective's backward needs MPI: the audit points to the
MPI script that checks it against one device.
"""

import importlib
import pathlib
import pkgutil

import numpy
import pytest

import minipar
import minipar.autograd as autograd
import minipar.functional as F
from minipar import Tensor, backend
from minipar.autograd import Function
from minipar.comm import world
from minipar.functional import attention
from minipar.functional.blockwise import DropoutSite
from minipar.functional.gelu import GELU
from minipar.gradcheck import gradcheck, op_cases
from minipar.kernels import gemm
from minipar.parallel.cross_entropy import vocab_parallel_cross_entropy
from minipar.parallel.recompute import checkpoint
from minipar.parallel.ring_attention import RingAttention
from minipar.parallel.zero3_units import UnitBackward

ROOT = pathlib.Path(__file__).resolve().parent.parent


def extra_cases(seed=0):
    """``[(name, fn, inputs)]``: what ``op_cases`` leaves out, float64 inputs that require grad."""
    rng = numpy.random.default_rng(seed)

    def t(*shape, positive=False):
        data = rng.standard_normal(shape)
        return Tensor(numpy.abs(data) + 0.5 if positive else data, requires_grad=True, dtype=numpy.float64)

    ids = numpy.array([[1, 2, 1], [0, 1, 2]])
    targets = numpy.array([[4, 2, 0], [2, 6, 1]])  # 2 is ignored, though the vocabulary has it
    shard_targets = numpy.array([[1, 2, -1], [0, 4, 3]])  # a vocabulary of 5 in 6 columns
    return [
        # branches of the functional ops
        ("pow (exponent 0: a constant)", lambda a: F.pow(a, 0), [t(3, 4)]),
        ("pow (negative exponent)", lambda a: F.pow(a, -2), [t(3, 4, positive=True)]),
        ("sub (number - tensor)", lambda b: F.sub(2.0, b), [t(3, 4)]),
        ("div (number / tensor)", lambda b: F.div(1.0, b), [t(3, 4, positive=True)]),
        ("matmul (shared matrix @ batch)", F.matmul, [t(3, 4), t(2, 4, 5)]),
        ("getitem (Ellipsis, None, int)", lambda a: a[..., None, 1], [t(2, 3, 4)]),
        ("embedding (every row skipped)", lambda w: F.embedding(ids, w, skip=ids >= 0), [t(3, 4)]),
        ("linear (no bias)", F.linear, [t(2, 3, 5), t(4, 5)]),
        ("layer_norm (no bias)", F.layer_norm, [t(2, 3, 6), t(6)]),
        ("cross_entropy (ignore_index=2, mean)", lambda x: F.cross_entropy(x, targets, ignore_index=2), [t(2, 3, 7)]),
        ("causal_attention (recomputed, no dropout)",
         lambda qkv: F.causal_attention(qkv, 2, query_block=2, recompute=True), [t(2, 5, 12)]),
        # PATCHES below make these run one sequence per group, or GELU in blocks of 5 elements
        ("causal_attention (a group per sequence, dropout 0.2)",
         lambda qkv: F.causal_attention(qkv, 3, 0.2, key=(3, 0), query_block=2), [t(3, 5, 18)]),
        ("causal_attention (a group per sequence, recomputed, dropout 0.2)",
         lambda qkv: F.causal_attention(qkv, 3, 0.2, key=(3, 0), query_block=2, recompute=True), [t(3, 5, 18)]),
        ("gelu (blocks of 5 elements, the last one short)", F.gelu, [t(3, 6)]),
        # ops outside minipar/functional, on one process (a world of 1)
        ("vocab_parallel_cross_entropy (one rank, a padding column, mean)",
         lambda x: vocab_parallel_cross_entropy(x, shard_targets, world(), 0, 5), [t(2, 3, 6)]),
        ("vocab_parallel_cross_entropy (one rank, a padding column, sum)",
         lambda x: vocab_parallel_cross_entropy(x, shard_targets, world(), 0, 5, reduction="sum"), [t(2, 3, 6)]),
        ("checkpoint (linear and gelu recomputed in backward)",
         lambda x, w, b: checkpoint(lambda h: F.gelu(F.linear(h, w, b)), x, [w, b]), [t(2, 3), t(4, 3), t(4)]),
        ("checkpoint (embedding of integer ids)",
         lambda w: checkpoint(lambda i: F.tanh(F.embedding(i.data, w)), ids, [w]), [t(3, 4)]),
        ("ring_attention (one rank, dropout 0.2)",
         lambda qkv: RingAttention.apply(qkv, 3, world(), numpy.arange(5)[None],
                                         DropoutSite((3, 0), 0.2, numpy.arange(2), numpy.arange(3))),
         [t(2, 5, 18)]),
        ("ZeRO-3 unit boundary (identity)", lambda y: UnitBackward.apply(y, lambda: None), [t(3, 4)]),
    ]


PATCHES = {  # case -> [(object, attribute, value)] for its forward and backward
    "causal_attention (a group per sequence, dropout 0.2)": [(attention, "_CACHED_SCORES", 1)],
    "causal_attention (a group per sequence, recomputed, dropout 0.2)": [(attention, "_CACHED_SCORES", 1)],
    "gelu (blocks of 5 elements, the last one short)": [(GELU, "BLOCK", 5)],
}


def all_cases(seed=0):
    return op_cases(seed) + extra_cases(seed)


CASES = [name for name, _, _ in all_cases()]
MULTI = [(name, k) for name, _, inputs in all_cases() for k in range(len(inputs)) if len(inputs) > 1]
# the inputs W computes: each alone, and all of them together (a linear layer's weight and bias)
SPLITS = [(name, (k,)) for name, _, inputs in all_cases() for k in range(len(inputs))] + \
         [(name, tuple(range(len(inputs)))) for name, _, inputs in all_cases() if len(inputs) > 1]


def case(name, monkeypatch, seed=0):
    for obj, attr, value in PATCHES.get(name, ()):
        monkeypatch.setattr(obj, attr, value)
    return next((fn, inputs) for n, fn, inputs in all_cases(seed) if n == name)


def assert_ok(reports, name):
    assert reports and all(r.checked > 0 for r in reports), name
    for r in reports:
        assert r.ok, f"{name}: {r}"


@pytest.mark.parametrize("name", [n for n, _, _ in extra_cases()])
def test_extra_case_matches_central_differences(name, monkeypatch):
    fn, inputs = case(name, monkeypatch)
    assert_ok(gradcheck(fn, inputs), name)


def test_the_patched_cases_reach_their_branches(monkeypatch):
    """What PATCHES is for: three sequence groups of one sequence each, GELU's 18 elements in blocks."""
    monkeypatch.setattr(attention, "_CACHED_SCORES", 1)
    assert attention._sequence_groups(3, 3, 5, 2, 8) == [(0, 1), (1, 2), (2, 3)]
    monkeypatch.setattr(GELU, "BLOCK", 5)
    assert [b.stop - b.start for b in backend.blocks(18, GELU.BLOCK)] == [5, 5, 5, 3]


@pytest.mark.parametrize("name,k", MULTI)
def test_each_input_alone(name, k, monkeypatch):
    """Only input k requires grad: the op's backward runs with a ``needs_input_grad`` that asks for
    it alone, and must still give it its whole gradient."""
    fn, inputs = case(name, monkeypatch)
    for i, t in enumerate(inputs):
        t.requires_grad = i == k
    (report,) = gradcheck(fn, inputs)
    assert report.ok and report.checked > 0, f"{name}: {report}"


@pytest.mark.parametrize("name,deferred", SPLITS, ids=[f"{n}-W of {list(d)}" for n, d in SPLITS])
def test_split_backward(name, deferred, monkeypatch):
    """The zero-bubble split (``weight_grad``): B with the deferred inputs' ``needs_input_grad``
    cleared, then W on the same ``ctx`` asking for theirs alone; every gradient against central
    differences."""
    fn, inputs = case(name, monkeypatch)
    assert_ok(gradcheck(fn, inputs, split=[inputs[k] for k in deferred]), f"{name}, W of inputs {deferred}")


@pytest.mark.parametrize("name", CASES)
def test_gpu_branches_on_numpy_arrays(name, monkeypatch):
    """The code a GPU runs (one query block, contiguous heads, GELU in one piece, plain reductions,
    the kernel's products: here NumPy's), on NumPy arrays."""
    fn, inputs = case(name, monkeypatch)
    monkeypatch.setattr(backend, "DEVICE", "cuda")
    monkeypatch.setattr(gemm, "matmul", lambda a, b, out=None: numpy.matmul(a, b, out=out))
    assert_ok(gradcheck(fn, inputs), name)


# ---- the audit ------------------------------------------------------------------------------------

CASE = "cases"  # a case of op_cases or extra_cases applies it (test_the_cases_apply...)
# Function -> CASE, or [(file, text it must hold)]: a check elsewhere, by central differences in
# float64 with a random upstream gradient, or for a collective against one device under MPI.
AUDIT = {
    "Add": CASE, "Sub": CASE, "Mul": CASE, "Div": CASE, "Neg": CASE, "Pow": CASE, "Exp": CASE, "Log": CASE,
    "Tanh": CASE, "MaskedFill": CASE, "Dropout": CASE, "GELU": CASE,
    "Sum": CASE, "Softmax": CASE, "LogSoftmax": CASE, "LayerNorm": CASE,
    "Reshape": CASE, "Transpose": CASE, "GetItem": CASE, "Split": CASE, "Concat": CASE,
    "MatMul": CASE, "Linear": CASE, "Embedding": CASE, "CrossEntropy": CASE,
    "CausalAttention": CASE, "BlockwiseAttention": CASE, "Permute": CASE, "Unpermute": CASE,
    "VocabParallelCrossEntropy": CASE,  # one rank here; across ranks: MPI_TOO
    "Checkpoint": CASE, "UnitBackward": CASE,
    "RingAttention": CASE,  # one rank here; across ranks: MPI_TOO
    "Cast": [("tests/test_op_edges.py", "def test_cast_gradient_by_central_differences")],
    "AttachLoss": [("tests/test_op_edges.py", "def test_attach_loss_gradient_is_that_of_the_sum_of_the_losses")],
    "ChunksToSequence": [("tests/test_context.py", "gradcheck(lambda c: ulysses.ChunksToSequence.apply(c, spans)")],
    "SequenceToChunks": [("tests/test_context.py", "gradcheck(lambda q: ulysses.SequenceToChunks.apply(q, spans, N)")],
    # collectives: their backward is the conjugate collective, checked against one device
    "RegionCollective": [("tests/mpi/region_collectives.py", name) for name in (
        "C.copy_to_region", "C.reduce_from_region", "C.gather_from_region", "C.scatter_to_region",
        "C.gather_from_sequence_region", "C.reduce_scatter_to_sequence_region", "C.scatter_to_sequence_region",
        "C.gather_tokens_from_sequence_region", "C.reduce_scatter_tokens_to_sequence_region")]
    + [("tests/test_mpi.py", '"region_collectives.py"'),
       ("tests/mpi/context_checks.py", "central differences"),  # all_to_all, inside Ulysses
       ("tests/test_context.py", '"context_checks.py"')],
    "AllToAllV": [("tests/mpi/experts.py", "ep_module.all_to_all_v"), ("tests/mpi/experts.py", "input gradient"),
                  ("tests/test_moe.py", '"experts.py"')],
}
MPI_TOO = {"RingAttention": [("tests/mpi/context_checks.py", "ring_attention"), ("tests/test_context.py", '"context_checks.py"')],
           "VocabParallelCrossEntropy": [("tests/mpi/tensor_parallel.py", "vocab_parallel_cross_entropy")]}


def functions_of_minipar():
    """{name: class} of every Function subclass (at any depth) defined in minipar."""
    for module in pkgutil.walk_packages(minipar.__path__, "minipar."):
        if not module.name.endswith("__main__"):  # a command line, run on import
            importlib.import_module(module.name)
    found, todo = {}, [Function]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("minipar."):
                assert found.setdefault(sub.__name__, sub) is sub, f"two Functions named {sub.__name__}"
    return found


def test_every_function_of_minipar_is_in_the_audit():
    found = set(functions_of_minipar())
    assert not found - set(AUDIT), f"add these Functions to AUDIT, with a gradient check: {sorted(found - set(AUDIT))}"
    assert not set(AUDIT) - found, f"AUDIT lists Functions minipar no longer has: {sorted(set(AUDIT) - found)}"


def test_the_cases_apply_every_function_the_audit_says_they_do(monkeypatch):
    applied = set()

    class Recording(autograd.Node):
        __slots__ = ()

        def __init__(self, fn, *args):
            applied.add(fn.__name__)
            super().__init__(fn, *args)

    monkeypatch.setattr(autograd, "Node", Recording)
    for _, fn, inputs in all_cases():
        fn(*inputs)
    missing = {name for name, where in AUDIT.items() if where == CASE} - applied
    assert not missing, f"AUDIT says a case checks {sorted(missing)}, but none applies them"


@pytest.mark.parametrize("name", [n for n, where in AUDIT.items() if where != CASE] + list(MPI_TOO))
def test_the_checks_the_audit_points_to_exist(name):
    for path, text in (AUDIT[name] if AUDIT[name] != CASE else []) + MPI_TOO.get(name, []):
        assert text in (ROOT / path).read_text(), f"{name}: {path} has no {text!r}"


# ---- the checks above can fail ---------------------------------------------------------------------

class WrongWeightHalf(Function):
    """x * w whose w gradient is right only when the backward is fused: asked for w alone (W of
    a split backward, or w the only input requiring grad) it forgets the upstream gradient."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.x, ctx.w = x, w
        return x * w

    @staticmethod
    def backward(ctx, grad):
        need_x, need_w = ctx.needs_input_grad
        grad_w = (grad * ctx.x if need_x else ctx.x.copy()) if need_w else None
        return (grad * ctx.w if need_x else None), grad_w


class ZeroesItsGradient(Function):
    """exp whose backward zeroes the gradient it receives: the differences, taken with that same
    (now zero) upstream array, would agree with it."""

    @staticmethod
    def forward(ctx, x):
        return numpy.exp(x)

    @staticmethod
    def backward(ctx, grad):
        grad *= 0.0
        return grad


class WrongWhenStrided(Function):
    """x^2 whose backward reads its saved input in the wrong order when that input is a strided
    view: right on contiguous inputs only."""

    @staticmethod
    def forward(ctx, x):
        ctx.x = x
        return x * x

    @staticmethod
    def backward(ctx, grad):
        x = ctx.x if ctx.x.flags.c_contiguous else numpy.ascontiguousarray(ctx.x).reshape(ctx.x.shape[::-1]).T
        return 2 * x * grad


class OnePercentOff(WrongWhenStrided):
    """x^2 (the forward above) with a backward 1% too large."""

    @staticmethod
    def backward(ctx, grad):
        return 2.02 * ctx.x * grad


def _t(*shape, seed=0):
    return Tensor(numpy.random.default_rng(seed).standard_normal(shape), requires_grad=True, dtype=numpy.float64)


def test_a_backward_wrong_only_for_one_input_or_in_w_is_caught():
    x, w = _t(3, 4), _t(3, 4, seed=1)
    assert all(r.ok for r in gradcheck(WrongWeightHalf.apply, [x, w]))  # fused: right
    assert not gradcheck(WrongWeightHalf.apply, [x, w], split=[w])[1].ok
    x.requires_grad = False
    assert not gradcheck(WrongWeightHalf.apply, [x, w])[0].ok


def test_a_backward_that_writes_into_its_upstream_gradient_is_caught():
    with pytest.raises(AssertionError, match="wrote into the upstream gradient"):
        gradcheck(ZeroesItsGradient.apply, [_t(3, 4)])


def test_a_strided_input_is_checked_as_it_is():
    """gradcheck perturbs an input where it lies: a transposed view stays one, and a backward that
    is wrong only for strided operands fails."""
    x = Tensor._wrap(_t(4, 3).data.T, requires_grad=True)
    assert not x.data.flags.c_contiguous
    assert not gradcheck(WrongWhenStrided.apply, [x])[0].ok and not x.data.flags.c_contiguous
    assert gradcheck(WrongWhenStrided.apply, [_t(3, 4)])[0].ok


def test_the_tolerance_grows_with_the_objective_and_still_catches_a_wrong_gradient():
    """Next to an output of 1e5, the differences' rounding (~1e-16 x 1e5 / 1e-6, 9e-4) passes a right
    gradient of x^2 that a fixed 1e-8 failed, and fails one 1% off; a gradient below that rounding
    (tanh x 1e-3) cannot be told right or wrong, and fails as unresolved."""
    big = Tensor(numpy.full((3, 4), 1e5), dtype=numpy.float64)
    assert gradcheck(lambda x: F.concat([x * x, big]), [_t(3, 4)])[0].ok
    assert not gradcheck(lambda x: F.concat([OnePercentOff.apply(x), big]), [_t(3, 4)])[0].ok
    report = gradcheck(lambda x: F.concat([F.tanh(x) * 1e-3, big]), [_t(3, 4)])[0]
    assert not report.ok and not report.resolved
    assert gradcheck(lambda x: F.tanh(x) * 1e-3, [_t(3, 4)])[0].ok  # alone, resolved and right


def test_inputs_the_checker_cannot_perturb_alone_are_refused():
    base = numpy.random.default_rng(0).standard_normal((3, 3))
    with pytest.raises(ValueError, match="inputs 0 and 1 share memory"):
        gradcheck(F.matmul, [Tensor(base, requires_grad=True, dtype=numpy.float64),
                             Tensor(base.T, requires_grad=True, dtype=numpy.float64)])
    with pytest.raises(ValueError, match="input 0 is read-only"):
        gradcheck(F.tanh, [Tensor(numpy.broadcast_to(base[0], (3, 3)), requires_grad=True, dtype=numpy.float64)])
