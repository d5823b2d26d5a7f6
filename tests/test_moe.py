"""The mixture-of-experts layer: routing, permute/unpermute, capacity, the auxiliary losses, the
whole layer's gradients (float64, central differences), and expert parallelism on 2 and 4 ranks
against one device."""

import math
from types import SimpleNamespace

import numpy
import pytest

import minipar
import minipar.functional as F
from minipar import Tensor
from minipar.gradcheck import gradcheck
from minipar.models.layers import MLP, _Layers
from minipar.models.moe import MoEMLP, MoEStep, Router, RoutingGroups, capacity_keep, top_k
from mpi_run import check_mpi, run_mpi

CONFIG = SimpleNamespace(n_embd=4, bias=True, n_layer=2, dropout=0.0)


pytestmark = pytest.mark.usefixtures("float64")  # conftest's; it also seeds the generator


def rows(n, h=4, seed=0):
    return numpy.random.default_rng(seed).standard_normal((n, h))


def routed_by(logits, n_experts, k, normalize=True):
    """A router whose logits are ``logits`` (N, E): weight = identity, the tokens are the logits."""
    router = Router(n_experts, n_experts, k, normalize)
    router.weight.data[...] = numpy.eye(n_experts)
    return router(Tensor(numpy.asarray(logits, float)))


def test_permute_then_unpermute_gives_back_the_tokens():
    x = rows(5)
    indices = numpy.array([[2, 0], [1, 2], [2, 3], [0, 1], [3, 2]])
    slots, counts = F.sort_by_expert(indices, 4)
    assert counts.tolist() == [2, 2, 4, 2] and (indices.reshape(-1)[slots] == numpy.sort(indices, None)).all()
    assert slots.tolist() == [1, 6, 2, 7, 0, 3, 4, 9, 5, 8]  # within an expert, in token order (stable)
    weights = numpy.random.default_rng(1).random((5, 2))
    back = F.unpermute(F.permute(Tensor(x), slots, 2), Tensor(weights), slots)
    numpy.testing.assert_allclose(back.data, x * weights.sum(1, keepdims=True), rtol=1e-14)
    order = numpy.random.default_rng(2).permutation(5)  # k = 1: a plain reordering and its inverse
    numpy.testing.assert_array_equal(F.permute(F.permute(Tensor(x), order), numpy.argsort(order)).data, x)


def test_a_dropped_slot_adds_nothing():
    indices = numpy.array([[0, 1], [1, 0]])
    slots, counts = F.sort_by_expert(indices, 2, keep=numpy.array([[True, False], [True, True]]))
    assert slots.tolist() == [0, 3, 2] and counts.tolist() == [2, 1]  # slot 1 (token 0's 2nd) dropped
    out = F.unpermute(Tensor(numpy.array([[10.0], [20.0], [30.0]])), Tensor(numpy.full((2, 2), 0.5)), slots)
    assert out.data[:, 0].tolist() == [5.0, 25.0]


def test_ties_go_to_the_lowest_expert_index():
    probs = numpy.array([[0.2, 0.3, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])
    assert top_k(probs, 2).tolist() == [[1, 2], [0, 1]]
    route = routed_by([[0.0, 1.0, 1.0, 0.0]], 4, 3)
    assert route.indices.tolist() == [[1, 2, 0]]


def test_ties_among_many_experts_go_to_the_lowest_index_too():
    # past 16 experts NumPy's default argsort is no longer an insertion sort, and not stable
    probs = numpy.zeros((1, 64))
    probs[0, [5, 40, 41, 63]] = 0.25
    assert top_k(probs, 4).tolist() == [[5, 40, 41, 63]]


def test_a_16_bit_router_scores_in_float32():
    # logits 1 and 1 + 2^-10: one bfloat16 (8 significant bits), which would tie them for expert 0
    minipar.set_default_dtype("bfloat16")
    router = Router(2, 2, 1)
    router.weight.data[...] = numpy.array([[1.0, 0.0], [1.0, 1.0]]).astype(router.weight.dtype)
    route = router(Tensor(numpy.array([[1.0, 2.0**-10]]), dtype="bfloat16"))
    assert route.indices.tolist() == [[1]] and route.probs.dtype == numpy.float32


def test_router_weights_renormalised_or_not():
    logits = rows(3)
    p = numpy.exp(logits) / numpy.exp(logits).sum(1, keepdims=True)
    for normalize in (True, False):
        route = routed_by(logits, 4, 2, normalize)
        top = numpy.take_along_axis(p, route.indices, 1)
        expect = top / top.sum(1, keepdims=True) if normalize else top
        numpy.testing.assert_allclose(route.weights.data, expect, rtol=1e-14)
    with pytest.raises(ValueError, match="top-k must lie in"):
        Router(4, 3, 4)
    # the GPT's default: renormalised for k > 1, p[e_1] for k = 1 (Switch); pre-softmax: never
    from minipar.models import GPT, GPTConfig

    for k, pre, normalized in ((2, False, True), (1, False, False), (2, True, False)):
        config = GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16, num_experts=2,
                           moe_router_topk=k, moe_router_pre_softmax=pre)
        assert GPT(config).transformer.h[0].mlp.router.normalize is normalized


def test_capacity_keeps_the_most_probable_slots_ties_by_token_order():
    # 5 tokens all to expert 0 (k = 1, E = 2); capacity ceil(0.8 * 5 / 2) = 2
    logits = numpy.log([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3], [0.9, 0.1], [0.9, 0.1]])
    route = routed_by(logits, 2, 1)
    slot_probs = numpy.take_along_axis(route.probs.data, route.indices, 1)
    keep = capacity_keep(route.indices, slot_probs, 2, 0.8)
    assert keep[:, 0].tolist() == [False, True, False, True, False]
    # two groups of 2 tokens (the 5th is left out: groups must be equal), capacity ceil(0.8*2/2) = 1 each
    keep = capacity_keep(route.indices[:4], slot_probs[:4], 2, 0.8, group_ids=numpy.array([0, 0, 1, 1]))
    assert keep[:, 0].tolist() == [False, True, False, True]
    # groups need not be consecutive tokens (context parallelism: a rank's two chunks)
    keep = capacity_keep(route.indices[:4], slot_probs[:4], 2, 0.8, group_ids=numpy.array([0, 1, 0, 1]))
    assert keep[:, 0].tolist() == [False, True, True, False]
    with pytest.raises(ValueError, match="routing groups must be equal"):
        capacity_keep(route.indices, slot_probs, 2, 0.8, group_ids=numpy.array([0, 0, 0, 1, 1]))


def test_moe_drops_over_capacity_and_reports_the_loads():
    moe = MoEMLP(CONFIG, 4, 2, capacity_factor=1.0)
    x = rows(6)
    x[:, 0] = 5.0
    moe.router.weight.data[:] = 0.0
    moe.router.weight.data[:, 0] = [1.0, 0.9, -1.0, -1.0]  # every token: experts 0 and 1, never 2, 3
    y = moe(Tensor(x))
    assert moe.tokens_per_expert.tolist() == [3, 3, 0, 0] and moe.dropped == 6  # capacity ceil(6*2/4) = 3
    # every token has the same logits (5, 4.5, -5, -5): the first three tokens stay, the rest add 0
    w = numpy.exp([5.0, 4.5]) / numpy.exp([5.0, 4.5]).sum()
    kept = w[0] * moe.experts[0](Tensor(x[:3])).data + w[1] * moe.experts[1](Tensor(x[:3])).data
    numpy.testing.assert_allclose(y.data[:3], kept, rtol=1e-13)
    numpy.testing.assert_array_equal(y.data[3:], 0.0)


def test_uneven_and_empty_expert_loads_match_a_token_by_token_loop():
    moe = MoEMLP(CONFIG, 4, 2)
    x = Tensor(rows(7), requires_grad=True)
    x.data[:, 0] = 5.0
    moe.router.weight.data[3, 0] = -10.0  # expert 3 gets no token
    y = moe(x)
    y.backward(rows(7, seed=3))
    assert moe.tokens_per_expert[3] == 0 and moe.tokens_per_expert.sum() == 14 and moe.dropped == 0
    route = moe.router(Tensor(x.data))
    for n in range(7):
        expect = sum(route.weights.data[n, j] * moe.experts[int(e)](Tensor(x.data[n:n + 1])).data[0]
                     for j, e in enumerate(route.indices[n]))
        numpy.testing.assert_allclose(y.data[n], expect, rtol=1e-12)
    for p in moe.experts[3].parameters():  # an expert without tokens gets a zero gradient, not None
        assert p.grad is not None and not p.grad.any()


def test_load_balancing_and_z_loss_by_hand():
    # 2 tokens, E = 2, k = 1, both to expert 1: p = (.25, .75) and (.2, .8)
    logits = numpy.log([[1.0, 3.0], [1.0, 4.0]])
    route = routed_by(logits, 2, 1)
    assert route.indices.tolist() == [[1], [1]]
    aux = F.load_balancing_loss(route.probs, route.indices, coeff=0.1)
    assert aux.item() == pytest.approx(0.1 * 2 * (0 * 0.225 + 1 * 0.775), rel=1e-14)
    z = F.z_loss(route.logits, coeff=0.01)
    assert z.item() == pytest.approx(0.01 * (math.log(4) ** 2 + math.log(5) ** 2) / 2, rel=1e-14)
    # k = 2, E = 3: p = (1, 2, 5) / 8 for both tokens, both to experts 2 and 1: f = (0, 1/2, 1/2)
    route = routed_by(numpy.log([[1.0, 2.0, 5.0]] * 2), 3, 2)
    assert route.indices.tolist() == [[2, 1], [2, 1]]
    aux = F.load_balancing_loss(route.probs, route.indices)
    assert aux.item() == pytest.approx(3 * (0.5 * 2 / 8 + 0.5 * 5 / 8), rel=1e-14)
    moe = MoEMLP(CONFIG, 3, 2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    moe(Tensor(rows(5)))
    assert moe.aux_loss.item() > 0 and moe.z_loss.item() > 0
    # two groups (token 0 | token 1 of the first case): the mean of each group's loss, not the union's
    route = routed_by(logits, 2, 1)
    aux = F.load_balancing_loss(route.probs, route.indices, coeff=1.0, group_ids=numpy.array([1, 0]))
    assert aux.item() == pytest.approx((2 * 0.75 + 2 * 0.8) / 2, rel=1e-14)


def test_one_expert_top_one_is_the_dense_mlp():
    dense = MLP(CONFIG, _Layers(None, False, None), 0)
    moe = MoEMLP(CONFIG, 1, 1)
    moe.load_state_dict({"router.weight": moe.router.weight.data,
                         **{f"experts.0.{n}": p.data for n, p in dense.named_parameters()}})
    x1, x2 = Tensor(rows(6).reshape(2, 3, 4), requires_grad=True), Tensor(rows(6).reshape(2, 3, 4), requires_grad=True)
    g = rows(6, seed=5).reshape(2, 3, 4)
    y1, y2 = dense(x1), moe(x2)
    y1.backward(g)
    y2.backward(g)
    numpy.testing.assert_allclose(y2.data, y1.data, rtol=1e-14, atol=1e-16)
    numpy.testing.assert_allclose(x2.grad, x1.grad, rtol=1e-14, atol=1e-16)
    grads = dict(moe.named_parameters())
    for n, p in dense.named_parameters():
        numpy.testing.assert_allclose(grads[f"experts.0.{n}"].grad, p.grad, rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("capacity_factor", [None, 0.8])
def test_the_whole_layer_against_central_differences(capacity_factor):
    moe = MoEMLP(CONFIG, 3, 2, capacity_factor)
    x = Tensor(rows(6).reshape(2, 3, 4), requires_grad=True)
    names, params = zip(*moe.named_parameters())
    # the whole (2, 3, 4) output against gradcheck's random upstream: one constant along the hidden
    # axis (a .sum(axis=-1)) passed a backward that mixed up hidden units
    reports = gradcheck(lambda *_: moe(x), [x, *params], names=["x", *names], max_entries=24)
    assert capacity_factor is None or moe.dropped > 0
    for report in reports:
        assert report.ok, report


@pytest.mark.parametrize("groups", [None, numpy.array([0, 1, 1, 0, 2, 2])])
def test_the_router_losses_against_central_differences(groups):
    router = Router(4, 3, 2)
    x = Tensor(rows(6), requires_grad=True)

    def losses(*_):
        route = router(x)
        return F.load_balancing_loss(route.probs, route.indices, 0.3, groups) + F.z_loss(route.logits, 0.2)

    for report in gradcheck(losses, [x, router.weight], names=["x", "router"]):
        assert report.ok, report


def test_the_auxiliary_losses_join_the_gradient_scaled_by_their_share():
    """A layer's output carries its auxiliary losses into backward (each with gradient = its share
    of the step): backward from the output alone equals the output's backward plus the losses'."""
    g = rows(6, seed=3).reshape(2, 3, 4)

    def grads(attached, share):
        minipar.manual_seed(0)
        moe = MoEMLP(CONFIG, 3, 2, aux_loss_coeff=0.3 * attached, z_loss_coeff=0.2 * attached, step=MoEStep())
        moe.step.tokens = 6 / share  # this forward's 6 tokens are ``share`` of the step's
        x = Tensor(rows(6).reshape(2, 3, 4), requires_grad=True)
        moe(x).backward(g)
        if not attached:  # the same losses, added by hand
            lb = MoEMLP(CONFIG, 3, 2, aux_loss_coeff=0.3, z_loss_coeff=0.2)
            lb.load_state_dict(moe.state_dict())
            lb(x)
            ((lb.aux_loss + lb.z_loss) * share).backward()
            moe.router.weight.grad = moe.router.weight.grad + lb.router.weight.grad
            assert moe.step.aux == {0: 0.0}
        else:
            assert moe.step.aux[0] == pytest.approx(share * moe.aux_loss.item(), rel=1e-15) and moe.step.aux[0] > 0
        return x.grad, moe.router.weight.grad

    for share in (1.0, 0.25):
        (xa, ra), (xb, rb) = grads(True, share), grads(False, share)
        numpy.testing.assert_allclose(ra, rb, rtol=1e-13, atol=1e-15)
        numpy.testing.assert_allclose(xa, xb, rtol=1e-13, atol=1e-15)


def test_routing_groups_name_the_tokens_each_rank_routes():
    # DP: 2 rows per forward; CP = 2 (chunks 0 and 3 on rank 0, 1 and 2 on rank 1, of 2 positions each)
    ids = RoutingGroups(rows=2, cp=2).ids(numpy.arange(4), numpy.arange(8)).reshape(4, 8)
    assert ids[0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0] and (ids[1] == ids[0]).all()
    assert ids[2].tolist() == [2, 2, 3, 3, 3, 3, 2, 2]
    # and SP = 2 within each CP rank's 4 positions: rank 0's (0, 1, 6, 7) as (0, 1) and (6, 7)
    ids = RoutingGroups(rows=4, cp=2, sp=2).ids(numpy.arange(4), numpy.arange(8)).reshape(4, 8)
    assert ids[0].tolist() == [0, 0, 2, 2, 3, 3, 1, 1]  # rank 1: (2, 3) and (4, 5)
    assert RoutingGroups(rows=1).ids(numpy.arange(3), numpy.arange(2)).tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("n", [2, 4])
def test_expert_parallel_equals_one_device(n):
    assert f"experts OK on {n} ranks" in check_mpi(n, "experts.py", timeout=60)


def test_expert_parallel_fails_on_a_planted_bug():
    code, out, _ = run_mpi(4, "experts.py", "--plant-bug", timeout=60)
    assert code != 0 and "experts FAILED on 4 ranks" in out and "output: MISMATCH" in out


def test_capacity_is_the_documented_ceiling_for_factors_that_are_no_binary_fraction():
    from minipar.models.moe import capacity

    assert capacity(1.1, 100, 1, 10) == 11 and capacity(1.1, 50, 2, 5) == 22  # 11.000000000000002 in floats
    assert capacity(1.0, 7, 2, 4) == 4 and capacity(1.25, 8, 1, 4) == 3 and capacity(0.3, 10, 1, 16) == 1
