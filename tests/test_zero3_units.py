"""ZeRO-3 on one rank: each unit runs once, its gathered parameters are freed after its forward
although the graph needs them in backward, and after its backward (or B) although its gradients
may wait, and the gradients equal the plain model's. (Against the single-device run on several
ranks: tests/mpi/zero.py.)"""

import numpy as np
import pytest

import minipar
from minipar import functional as F
from minipar.autograd import Function, Tensor, save_parameters_by_reference
from minipar.models import GPT, GPTConfig
from minipar.nn import Parameter
from minipar.parallel import ProcessGrid
from minipar.parallel.zero3 import ZeRO3

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab_size=13, dropout=0.0)


pytestmark = pytest.mark.usefixtures("float64")  # (tests/conftest.py's)


def _pair():
    minipar.manual_seed(0)
    plain = GPT(CONFIG)
    sharded = GPT(CONFIG, ProcessGrid(1, 1))
    sharded.load_state_dict(plain.state_dict())
    return plain, sharded, ZeRO3(sharded, ProcessGrid(1, 1).dp_group)


def _batch(seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 13, (3, 6)), rng.integers(0, 13, (3, 6))


def test_each_unit_runs_once_and_the_gradients_are_the_plain_models():
    plain, sharded, opt = _pair()
    runs = []
    for block in sharded.transformer.h:
        forward = block.forward
        block.forward = lambda x, forward=forward: runs.append(1) or forward(x)
    x, y = _batch(1)
    plain(x, y)[1].backward()
    sharded(x, y)[1].backward()
    assert len(runs) == CONFIG.n_layer  # no unit is recomputed in backward
    grads = opt.full_gradients()
    for p, q in zip(plain.parameters(), sharded.parameters()):
        np.testing.assert_allclose(grads[id(q)], p.grad.reshape(-1), rtol=1e-12, atol=1e-14)


def test_forward_leaves_no_unit_gathered_while_its_graph_waits():
    _, sharded, opt = _pair()
    x, y = _batch(2)
    for step in range(2):  # the second step follows the first one's record: the head is prefetched
        _, loss = sharded(x, y)
        assert all(p.data.size == 0 for p in sharded.parameters())
        prefetched = sum(whole.nbytes for _, whole in opt._prefetched.values())
        assert opt.ledger.now["parameters"] == opt.master.nbytes + prefetched
        assert (prefetched > 0) == (step == 1)
        loss.backward()
        assert opt.ledger.now["parameters"] == opt.master.nbytes  # every group freed after its backward
        opt.step()
        opt.zero_grad()


def test_an_op_that_keeps_a_view_of_a_gathered_weight_is_caught():
    _, sharded, _ = _pair()
    wte = sharded.transformer.wte.weight
    # x @ W^T through a transpose op: the graph keeps the transposed view, and with it the buffer
    sharded.logits = lambda x: F.matmul(sharded.transformer.ln_f(x), wte.transpose())
    with pytest.raises(RuntimeError, match="could not free a unit's gathered parameters"):
        sharded(*_batch(3))


def test_a_parameter_saved_by_reference_is_read_at_backward_and_must_be_there():
    w = Parameter(np.random.default_rng(5).standard_normal((4, 3)))
    w.held_by = "a holder"  # what ZeRO-3 sets: this parameter's data comes and goes
    save_parameters_by_reference()
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    whole = w.data
    y = F.linear(x, w)
    w.data = whole[:0]  # released after forward
    with pytest.raises(RuntimeError, match="has not gathered"):
        y.sum().backward()
    y = F.linear(x, w.__class__(whole))  # unheld (saved as it is): what x's gradient is
    y.sum().backward()
    expected, x.grad = x.grad.copy(), None
    w.data = whole
    y = F.linear(x, w)  # held: backward reads what the parameter holds then
    w.data = 2 * whole  # gathered again, into another buffer
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, 2 * expected)


def test_a_backward_frees_each_unit_it_gathered_and_the_embeddings_gather_nothing():
    """The embeddings' backward reads no table (a lookup's gradient needs the ids alone): it is not
    gathered for it, nor recorded for the next step's prefetch; the head's is (dx = g W). Every unit
    is free again once its backward is over, the tied embedding too, although its gradient waits
    in its buffer for the embeddings' part."""
    _, sharded, opt = _pair()
    x, y = _batch(4)
    _, loss = sharded(x, y)
    loss.backward()
    assert [name for name, _ in opt._record] == ["embed", "h.0", "h.1", "head", "head", "h.1", "h.0"]
    assert opt.ledger.now["parameters"] == opt.master.nbytes and not opt._whole and not opt._flats


def test_a_split_backward_frees_its_units_after_b_and_w_makes_the_buffers():
    """B (zero-bubble schedules) gathers each unit it reads and frees it when B has left it, and
    makes no gradient buffer: no weight gradient comes before W; but the tied embedding's, whose
    two parts (the head's, the lookup's) this one chunk's W takes before its hook. W reads no
    weight (dW = g^T x), runs with every unit released, makes each other group's buffer at its
    first hook and sends it at its last: the gradients are a whole backward's."""
    from minipar.weight_grad import backward_input

    plain, sharded, opt = _pair()
    x, y = _batch(5)
    plain(x, y)[1].backward()
    _, loss = sharded(x, y)
    pending = backward_input(loss, sharded.parameters())
    tied = opt._group_of[id(sharded.transformer.wte.weight)]
    assert opt.ledger.now["parameters"] == opt.master.nbytes and not opt._whole and set(opt._flats) == {id(tied)}
    assert all(p.data.size == 0 for p in sharded.parameters())
    pending.run()
    assert not opt._flats
    grads = opt.full_gradients()
    for p, q in zip(plain.parameters(), sharded.parameters()):
        np.testing.assert_allclose(grads[id(q)], p.grad.reshape(-1), rtol=1e-12, atol=1e-14)


class _Squared(Function):
    """y = x w^2: a weight gradient that reads the weight (2 g x w), which no op of the GPT's has."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.x, ctx.w = x, w
        return x * w * w

    @staticmethod
    def backward(ctx, grad):
        need_x, need_w = ctx.needs_input_grad
        return (grad * ctx.w * ctx.w if need_x else None), ((2 * grad * ctx.x * ctx.w).sum(0) if need_w else None)


def test_a_w_that_reads_a_weight_released_after_b_fails_naming_it():
    """W runs with the weights a holder released after B, and no holder gathers one again behind
    the schedule's back: an op whose weight gradient reads its weight fails there, saying so."""
    from minipar.weight_grad import backward_input

    w = Parameter(np.arange(1.0, 4.0))
    w.held_by = "a holder"
    save_parameters_by_reference()
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    whole = w.data
    pending = backward_input(_Squared.apply(x, w).sum(), [w])  # B reads the weight: it is whole
    np.testing.assert_array_equal(x.grad, np.tile(whole ** 2, (2, 1)))
    w.data = whole[:0]  # released after B
    with pytest.raises(RuntimeError, match=r"_Squared's weight gradient .* read ctx.w, which its holder released after B"):
        pending.run()


class _Comm:
    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


@pytest.mark.parametrize("sizes,n", [((5, 7), 4), ((3, 9), 4), ((1,), 3), ((6, 6, 6), 2)])
def test_every_zero_stage_pads_a_group_by_less_than_one_element_per_rank(sizes, n):
    """The flat layout all ZeRO stages shard (parallel/shards.py): the pieces are as small as an
    equal cut allows, so padding is below N elements (12 over 4 ranks: none), and the ranks' pieces
    cover every parameter element once."""
    from minipar.parallel.shards import Group

    params = [np.zeros(s) for s in sizes]
    groups = [Group(params, _Comm(n, r), 0) for r in range(n)]
    total = sum(sizes)
    padding = groups[0].padded - total
    assert 0 <= padding < n and (padding == 0) == (total % n == 0) and groups[0].padded == n * groups[0].piece
    covered = [0] * total
    for g in groups:
        for i, a, b, _ in g.segments():
            for k in range(a, b):
                covered[k] += 1
    assert covered == [1] * total
