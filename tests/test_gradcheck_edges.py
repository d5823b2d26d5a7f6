"""Gradient checks at the edges ``gradcheck.op_cases``, ``test_gradcheck_all.extra_cases``,
``test_op_edges`` and ``test_ops`` leave out, each by central differences in float64 with a random
upstream gradient where central differences can reach it:

* ``EDGES``: each op at a shape or value where a backward is most easily wrong (attention at
  T = 1 and with uneven or unsorted key blocks, LayerNorm of (near-)constant rows, a loss with
  every target ignored, a permutation with every slot of a token dropped, ...), fused and split
  into B and W;
* the MoE layer with exact router ties and capacity drops (ties broken by expert and token
  order), with its experts behind a one-rank all-to-all-v;
* the GPT with dropout under full and selective recomputation;
* the 16-bit paths (``in_float32``), which central differences cannot reach: their gradients
  against the float64 backward at the same rounded inputs, and their B/W split against their
  fused backward;
* a backward writing into a gradient it shares with another branch (gradcheck itself only sees
  the upstream it hands to the root);
* the region collectives on one rank (their exchanges across ranks: the MPI scripts).
"""

import numpy
import pytest

import minipar
import minipar.functional as F
from minipar import Tensor, nn
from minipar.comm import world
from minipar.dtypes import as_dtype
from minipar.functional.blockwise import DropoutSite, blockwise_attention
from minipar.gradcheck import gradcheck
from minipar.models.config import GPTConfig
from minipar.models.gpt import GPT
from minipar.models.moe import MoEMLP
from minipar.parallel import collectives as C
from minipar.parallel.cross_entropy import vocab_parallel_cross_entropy
from minipar.parallel.experts import all_to_all_v
from minipar.parallel.ring_attention import RingAttention
from minipar.rng import DropoutRNG
from minipar.weight_grad import backward_input
from test_gradcheck_all import all_cases, case

INF = float("-inf")


def edge_cases(seed=0):
    """``[(name, fn, inputs)]``, float64 inputs that require grad."""
    rng = numpy.random.default_rng(seed)

    def t(*shape, scale=1.0, shift=0.0, positive=False):
        data = rng.standard_normal(shape) * scale + shift
        return Tensor(numpy.abs(data) + 0.5 if positive else data, requires_grad=True, dtype=numpy.float64)

    def strided(*shape):  # a leaf whose array is a view in another order (gradcheck perturbs it there)
        return Tensor(rng.standard_normal(shape[::-1]).T, requires_grad=True, dtype=numpy.float64)

    def site(p, B, H):
        return DropoutSite((3, 1), p, numpy.arange(B), numpy.arange(H))

    masked = numpy.array([False, True, False, True])
    return [
        # attention: one token (the mask has nothing to hide), one query per block, a block past T
        ("causal_attention (T=1)", lambda q: F.causal_attention(q, 2), [t(2, 1, 12)]),
        ("causal_attention (T=1, dropout 0.3, recomputed)",
         lambda q: F.causal_attention(q, 3, 0.3, key=(1, 2), recompute=True), [t(2, 1, 18)]),
        ("causal_attention (blocks of 1 query)", lambda q: F.causal_attention(q, 2, query_block=1), [t(2, 4, 12)]),
        ("causal_attention (a block longer than T)", lambda q: F.causal_attention(q, 2, query_block=9), [t(1, 4, 12)]),
        ("causal_attention (global rows, positions and heads of the mask)",
         lambda q: F.causal_attention(q, 2, 0.3, key=(5, 5), rows=[4, 1], positions=[7, 8, 9], head_offset=2,
                                      query_block=2), [t(2, 3, 12)]),
        # blockwise / ring: the online softmax over uneven, scattered and unsorted key blocks
        ("blockwise attention (T=1)", lambda q: blockwise_attention(q, 2, [numpy.r_[0:1]]), [t(2, 1, 12)]),
        ("blockwise attention (uneven blocks 6 | 1, the later first)",
         lambda q: blockwise_attention(q, 2, [numpy.r_[1:7], numpy.r_[0:1]]), [t(2, 7, 12)]),
        ("blockwise attention (3 uneven blocks of scattered runs, dropout 0.25)",
         lambda q: blockwise_attention(q, 2, [numpy.r_[5:7], numpy.r_[0:1, 7:9], numpy.r_[1:5]], 0.25, key=(4, 4)),
         [t(2, 9, 12)]),
        ("blockwise attention (one key a block, last to first)",
         lambda q: blockwise_attention(q, 1, [numpy.r_[i:i + 1] for i in reversed(range(5))]), [t(1, 5, 6)]),
        ("blockwise attention (unsorted positions within a block)",
         lambda q: blockwise_attention(q, 2, [numpy.array([4, 0, 2]), numpy.array([3, 1])]), [t(2, 5, 12)]),
        ("ring_attention (one rank, zigzag positions)",
         lambda q: RingAttention.apply(q, 2, world(), numpy.array([[0, 1, 6, 7, 2, 3, 4, 5]]), None), [t(2, 8, 12)]),
        ("ring_attention (one rank, shuffled positions, dropout 0.3)",
         lambda q: RingAttention.apply(q, 3, world(), numpy.array([[3, 0, 4, 1, 2]]), site(0.3, 2, 3)),
         [t(2, 5, 18)]),
        ("ring_attention (one rank, T=1)", lambda q: RingAttention.apply(q, 2, world(), numpy.array([[0]]), None),
         [t(2, 1, 12)]),
        # LayerNorm where var << eps: rstd ~ 1/sqrt(eps) amplifies any mistake in the projection
        # term (a smaller step there: see STEPS). Rows around 0, not an offset: x ~ 5 +- 1e-3 loses 4
        # digits of x - mean, and the differences' rounding noise then outgrows the tolerance
        ("layer_norm (near-constant rows)", F.layer_norm, [t(3, 8, scale=1e-3), t(8), t(8)]),
        ("layer_norm (a constant row)", lambda x, w: F.layer_norm(x, w),
         [Tensor(numpy.full((2, 6), 3.0), requires_grad=True, dtype=numpy.float64), t(6)]),
        ("layer_norm (one feature)", F.layer_norm, [t(3, 1), t(1), t(1)]),
        # losses: every target ignored, logits far from 0, a masked column, a padded vocabulary
        ("cross_entropy (every target ignored, sum)",
         lambda x: F.cross_entropy(x, numpy.array([-1, -1]), reduction="sum"), [t(2, 5)]),
        ("cross_entropy (logits ~ 1000)", lambda x: F.cross_entropy(x + 1000.0, numpy.array([1, 3, 0])),
         [t(3, 5, scale=30)]),
        ("cross_entropy (a -inf column, an ignored row)",
         lambda x: F.cross_entropy(F.masked_fill(x, masked, INF), numpy.array([0, 2, -1])), [t(3, 4)]),
        ("cross_entropy (one token, no batch axis)", lambda x: F.cross_entropy(x, numpy.array(2)), [t(5)]),
        ("vocab_parallel_cross_entropy (one rank, 2 padding columns, an ignored target)",
         lambda x: vocab_parallel_cross_entropy(x, numpy.array([[3, -1], [0, 1]]), world(), 0, 4), [t(2, 2, 6)]),
        ("vocab_parallel_cross_entropy (one rank, ignore_index=2 inside the vocabulary)",
         lambda x: vocab_parallel_cross_entropy(x, numpy.array([2, 0, 2, 4]), world(), 0, 5, ignore_index=2),
         [t(4, 5)]),
        ("vocab_parallel_cross_entropy (one rank, every target ignored, sum)",
         lambda x: vocab_parallel_cross_entropy(x, numpy.array([-1, -1]), world(), 0, 5, reduction="sum"),
         [t(2, 5)]),
        # softmax of a row masked entirely beside a partly masked one
        ("softmax (a row of -inf, a row half -inf)",
         lambda x: F.softmax(F.masked_fill(x, numpy.array([[True] * 4, list(masked)]), INF)), [t(2, 4)]),
        # reductions keeping every axis
        ("sum (all axes, keepdims)", lambda x: F.sum(x, keepdims=True), [t(2, 3)]),
        ("mean (all axes named, keepdims)", lambda x: F.mean(x, axis=(0, 1, 2), keepdims=True), [t(2, 3, 2)]),
        # broadcasting: the first operand, or both
        ("add (both operands broadcast)", F.add, [t(3, 1), t(1, 4)]),
        ("sub (both operands broadcast)", F.sub, [t(2, 1, 4), t(3, 1)]),
        ("div (the numerator broadcast, a 0-d denominator)",
         lambda a, b: F.div(a, F.exp(b)), [t(1, 3), Tensor(numpy.array(0.3), requires_grad=True, dtype=numpy.float64)]),
        ("pow (0.5)", lambda a: F.pow(a, 0.5), [t(3, 4, positive=True)]),
        # products: a shared matrix against two batch axes (the fold into one GEMM), a 1-D input
        ("matmul (4-D batch @ shared matrix)", F.matmul, [t(2, 2, 3, 4), t(4, 5)]),
        ("matmul (matrix @ 4-D batch)", F.matmul, [t(3, 4), t(2, 2, 4, 5)]),
        # strided leaves: transposed views reach an op's backward as they are
        ("matmul (both operands transposed views)", F.matmul, [strided(3, 4), strided(4, 5)]),
        ("linear (a transposed input and weight)", F.linear, [strided(4, 5), strided(3, 5), t(3)]),
        ("softmax (a transposed input)", F.softmax, [strided(3, 5)]),
        ("sum (axis 0 of a transposed input)", lambda a: F.sum(a, axis=0), [strided(3, 4)]),
        ("embedding (a transposed weight, repeated ids)",
         lambda w: F.embedding(numpy.array([[2, 0, 2]]), w), [strided(4, 3)]),
        ("causal_attention (a strided qkv)", lambda q: F.causal_attention(q, 2), [strided(1, 3, 12)]),
        ("linear (a 1-D input)", F.linear, [t(5), t(3, 5), t(3)]),
        ("linear (a 4-D input)", F.linear, [t(2, 1, 2, 5), t(3, 5), t(3)]),
        # indexing and moving
        ("getitem (negative step)", lambda a: a[::-2, 1:-1], [t(5, 4)]),
        ("getitem (int and a repeated list)", lambda a: a[0, [1, 1, 3]], [t(2, 4)]),
        ("getitem (a NumPy integer)", lambda a: a[numpy.int64(1)], [t(2, 4)]),
        ("split (an empty part)", lambda a: F.split(a, [0, 2, 3], axis=0)[2], [t(5, 2)]),
        # dropout: most elements dropped, the mask from manual_seed, the model's mask by position
        ("dropout (p=0.9)", lambda a: F.dropout(a, 0.9, key=(1, 1)), [t(5, 6)]),
        ("dropout (key from manual_seed)", lambda a: (minipar.manual_seed(7), F.dropout(a, 0.4))[1], [t(3, 5)]),
        ("nn.Dropout (by position, DropoutRNG)",
         lambda a: nn.Dropout(0.3, rng=DropoutRNG(seed=3), layer=1, site=2)(a), [t(2, 3, 4)]),
        ("embedding (rows never looked up)", lambda w: F.embedding(numpy.array([[5, 5]]), w), [t(7, 2)]),
        ("embedding (a skipped row among repeats)",
         lambda w: F.embedding(numpy.array([1, 1, 2, 1]), w, skip=numpy.array([False, True, False, False])), [t(4, 2)]),
        # routing: a plain permutation, every slot dropped, a token with every slot dropped
        ("permute (k=1, a permutation)", lambda x: F.permute(x, numpy.array([2, 0, 3, 1]), 1), [t(4, 3)]),
        ("permute (every slot dropped)", lambda x: F.permute(x, numpy.zeros(0, numpy.int64), 2), [t(3, 2)]),
        ("unpermute (token 1's slots both dropped)",
         lambda y, w: F.unpermute(y, w, numpy.array([0, 1, 4, 5])), [t(4, 2), t(3, 2)]),
        ("load-balancing loss (3 routing groups)",
         lambda p: F.load_balancing_loss(p, numpy.array([[0, 1], [1, 2], [2, 0]]), 0.5, numpy.array([0, 1, 2])),
         [t(3, 3)]),
        ("router z-loss (logits ~ 50)", lambda z: F.z_loss(z, 0.1), [t(3, 4, scale=50)]),
        ("gelu (exp(-2z) overflows to inf below -9.3)", F.gelu,
         [Tensor(numpy.array([-30.0, -9.5, -5.0, 0.0, 1e-8, 5.0, 30.0]), requires_grad=True, dtype=numpy.float64)]),
        # a weight used twice by one op, or by two ops, under the B/W split too (test_edge_split)
        ("matmul (w @ w)", lambda w: F.matmul(w, w), [t(4, 4)]),
        ("linear (tanh(w) through w)", lambda w: F.linear(F.tanh(w), w), [t(4, 4)]),
        ("tied embedding and head", lambda w: F.linear(F.embedding(numpy.array([[1, 3, 1]]), w), w), [t(5, 4)]),
    ]


EDGES = [name for name, _, _ in edge_cases()]
# gradcheck's step 1e-6 where the function bends on a scale of ~sqrt(var + eps) ~ 3e-3: its O(step^2)
# truncation error (~5e-6 on gradients ~600) exceeds the tolerance, the backward is right to ~1e-10
# relative (checked against central differences in long double); a step of 1e-7 leaves ~5e-8
STEPS = {"layer_norm (near-constant rows)": 1e-7}


def _edge(name):
    return next((fn, inputs) for n, fn, inputs in edge_cases() if n == name)


def assert_ok(reports, name):
    assert reports and all(r.checked > 0 for r in reports), name
    for r in reports:
        assert r.ok, f"{name}: {r}"


@pytest.mark.parametrize("name", EDGES)
def test_edge(name):
    fn, inputs = _edge(name)
    assert_ok(gradcheck(fn, inputs, eps=STEPS.get(name, 1e-6)), name)


@pytest.mark.parametrize("name", EDGES)
def test_edge_split(name):
    """B, then W for every input: W asks each op for its weights' gradients alone."""
    fn, inputs = _edge(name)
    assert_ok(gradcheck(fn, inputs, eps=STEPS.get(name, 1e-6), split=list(inputs)), name)


# ---- the MoE layer: exact ties, capacity drops ----------------------------------------------------

CONFIG = dict(n_embd=4, bias=True, n_layer=2, dropout=0.0)


@pytest.mark.parametrize("tie,experts,k,factor,ep", [
    ("every expert", 4, 2, 0.5, False),  # all p = 1/E: top-k takes experts 0, 1; capacity cuts by token order
    ("experts 0 and 1", 3, 2, 0.8, False),  # p0 == p1 for every token: expert 0 wins each tie
    ("experts 0 and 1", 3, 1, 0.7, False),
    (None, 4, 2, 0.8, True),  # the experts behind the all-to-all-v of a one-rank EP group
])
def test_moe_layer_with_ties_and_capacity_drops(tie, experts, k, factor, ep, float64):
    """A tie of router weights stays exact whatever x (equal rows of W_r give equal logits bit for
    bit), so central differences in x and in the experts see a fixed routing. The router weight
    itself is left out where it ties: perturbing it breaks the tie, a jump no derivative has."""
    from types import SimpleNamespace

    moe = MoEMLP(SimpleNamespace(**CONFIG), experts, k, factor, ep=world() if ep else None)
    weight = moe.router.weight.data
    if tie == "every expert":
        weight[...] = 0.0
    elif tie == "experts 0 and 1":
        weight[1] = weight[0]
    x = Tensor(numpy.random.default_rng(1).standard_normal((2, 3, 4)), requires_grad=True)
    names, params = zip(*[(n, p) for n, p in moe.named_parameters() if tie is None or n != "router.weight"])
    reports = gradcheck(lambda *_: moe(x), [x, *params], names=["x", *names], max_entries=12)
    assert moe.dropped > 0
    if tie is not None:
        probs = moe.router(x.reshape(-1, 4)).probs.data
        assert (probs[:, 0] == probs[:, 1]).all()
    assert_ok(reports, f"MoE, ties of {tie}")


# ---- the model with dropout, recomputed --------------------------------------------------------------

@pytest.mark.parametrize("granularity,extra", [("full", {}), ("selective", {}),
                                               ("full", dict(num_experts=3, moe_expert_capacity_factor=0.7))])
def test_gpt_with_dropout_recomputed(granularity, extra, float64):
    """Recomputation reruns dropout in backward from the DropoutRNG's saved state: a mask drawn
    anew would still give gradients, but of another function than the forward's."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=11, dropout=0.2, **extra),
                recompute_granularity=granularity)
    rng = numpy.random.default_rng(0)
    idx, targets = rng.integers(0, 11, (2, 4)), rng.integers(0, 11, (2, 4))
    targets[0, 1] = -1  # an ignored target
    start = model.rng.state()

    def loss(*_):
        model.rng.set_state(start)  # the same masks on every evaluation
        return model(idx, targets)[1]

    names, params = zip(*model.named_parameters())
    assert_ok(gradcheck(loss, list(params), names=list(names), max_entries=6), granularity)


# ---- 16-bit paths ---------------------------------------------------------------------------------

SIXTEEN = {"bfloat16": 1.5e-2, "float16": 8e-3}  # 8 and 11 bits of mantissa, a few roundings: bf16's
# twice its worst honest error over the cases (7.7e-3), so a backward 2% off in bf16 alone fails;
# float16's 9x its worst (9e-4), which a backward 3% off in float16 alone exceeds 7 times
ALL = [n for n, _, _ in all_cases()]


def _in(dtype, inputs):
    return [Tensor(t.data.astype(dtype), requires_grad=True, dtype=dtype) for t in inputs]


@pytest.mark.parametrize("dtype", list(SIXTEEN))
@pytest.mark.parametrize("name", ALL)
def test_16_bit_gradient_near_the_float64_one(name, dtype, monkeypatch):
    """Central differences cannot run in 16 bits; the float64 backward (checked by them) can, at
    the same rounded inputs and upstream gradient: the widened path must land within rounding."""
    fn, inputs = case(name, monkeypatch)
    dt = as_dtype(dtype)
    narrow = _in(dt, inputs)
    wide = _in(numpy.float64, narrow)
    y = fn(*narrow)
    upstream = numpy.random.default_rng(5).standard_normal(y.shape).astype(y.dtype)
    y.backward(upstream)
    fn(*wide).backward(upstream.astype(numpy.float64))
    for a, b in zip(narrow, wide):
        assert a.grad.dtype == dt, (name, a.grad.dtype)
        err = numpy.abs(a.grad.astype(numpy.float64) - b.grad).max()
        assert err <= SIXTEEN[dtype] * (numpy.abs(b.grad).max() + 1e-6), (name, err)


@pytest.mark.parametrize("dtype", list(SIXTEEN))
@pytest.mark.parametrize("name", ALL)
def test_16_bit_split_equals_fused(name, dtype, monkeypatch):
    """A split backward calls a widened backward twice on one ctx (``in_float32`` widens what it
    holds and puts the 16-bit arrays back): B then W must equal the fused backward bit for bit."""
    fn, inputs = case(name, monkeypatch)
    dt = as_dtype(dtype)
    fused, split = _in(dt, inputs), _in(dt, inputs)
    y = fn(*fused)
    upstream = numpy.random.default_rng(5).standard_normal(y.shape).astype(y.dtype)
    y.backward(upstream.copy())
    backward_input(fn(*split), split, upstream.copy()).run()
    for a, b in zip(fused, split):
        assert b.grad.dtype == a.grad.dtype and numpy.array_equal(a.grad, b.grad, equal_nan=True), name


# ---- a gradient shared with another branch ---------------------------------------------------------

@pytest.mark.parametrize("first", [True, False])
def test_no_backward_writes_into_a_gradient_another_branch_holds(first, monkeypatch):
    """y = op(x) + tanh(w): Add hands one array to both branches. An op writing into it would change
    the other branch's gradient (which runs first depends on the order of the sum): each op's
    gradients, and w's, must be those it gives alone."""
    bad = []
    for name in ALL:
        fn, inputs = case(name, monkeypatch)
        y = fn(*inputs)
        upstream = numpy.random.default_rng(3).standard_normal(y.shape)
        y.backward(upstream.copy())
        alone = [t.grad for t in inputs]
        for t in inputs:
            t.grad = None
        w = Tensor(numpy.random.default_rng(4).standard_normal(y.shape), requires_grad=True, dtype=numpy.float64)
        (fn(*inputs) + F.tanh(w) if first else F.tanh(w) + fn(*inputs)).backward(upstream.copy())
        if not all(numpy.array_equal(a, t.grad) for a, t in zip(alone, inputs)) or \
                not numpy.allclose(w.grad, upstream * (1 - numpy.tanh(w.data) ** 2), rtol=1e-14, atol=0):
            bad.append(name)
    assert not bad, bad


# ---- the region collectives on one rank ------------------------------------------------------------

def _t(*shape):
    return Tensor(numpy.random.default_rng(6).standard_normal(shape), requires_grad=True, dtype=numpy.float64)


@pytest.mark.parametrize("name,fn,shape", [
    ("copy_to_region", lambda x: C.copy_to_region(x, world()), (2, 3)),
    ("reduce_from_region", lambda x: C.reduce_from_region(x * 1.0, world(), in_place=True), (2, 3)),
    ("gather_from_region", lambda x: C.gather_from_region(x, world()), (2, 3)),
    ("scatter_to_region", lambda x: C.scatter_to_region(x, world()), (2, 3)),
    ("gather_from_sequence_region", lambda x: C.gather_from_sequence_region(x, world()), (2, 3, 2)),
    ("reduce_scatter_to_sequence_region", lambda x: C.reduce_scatter_to_sequence_region(x, world()), (2, 3, 2)),
    ("scatter_to_sequence_region", lambda x: C.scatter_to_sequence_region(x, world()), (2, 3, 2)),
    ("gather_tokens_from_sequence_region", lambda x: C.gather_tokens_from_sequence_region(x, world()), (2, 3, 2)),
    ("reduce_scatter_tokens_to_sequence_region",
     lambda x: C.reduce_scatter_tokens_to_sequence_region(x, world()), (1, 2, 3, 2)),
    ("all_to_all", lambda x: C.all_to_all(x, world()), (1, 2, 3)),
    ("all_to_all_v", lambda x: all_to_all_v(x, world(), [4], [4]), (4, 3)),
])
def test_one_rank_collective(name, fn, shape):
    """On one rank each pair is the identity both ways: shapes, and no write into the upstream."""
    if world().size != 1:
        pytest.skip("a one-rank check")
    assert_ok(gradcheck(fn, [_t(*shape)]), name)
