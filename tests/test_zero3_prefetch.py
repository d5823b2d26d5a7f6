"""ZeRO-3's prefetch on one rank (minipar/parallel/zero3_prefetch.py): from the second step on,
each gather of a unit starts the next recorded unit's and nothing more, so a rank holds at most
two units' parameters whole beside its pieces. (On several ranks: tests/mpi/zero.py counts the
gathers that came prefetched.)"""

import numpy as np
import pytest

import minipar
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.zero3 import ZeRO3

# three blocks: a prefetch of two units ahead, or of all, holds more than two units at once
CONFIG = GPTConfig(n_layer=3, n_head=2, n_embd=8, block_size=6, vocab_size=13, dropout=0.0)


pytestmark = pytest.mark.usefixtures("float64")  # (tests/conftest.py's)


def _prefetched_bytes(opt):
    return sum(whole.nbytes for _, whole in opt._prefetched.values())


def _watched():
    """A ZeRO-3 GPT whose every unit gather appends (its groups, the groups prefetched right
    after it) to ``seen``, and which keeps in ``opt.most_prefetched`` the most bytes prefetched
    at once, counted after every start of a prefetch (where alone they grow)."""
    minipar.manual_seed(0)
    model = GPT(CONFIG, ProcessGrid(1, 1))
    opt = ZeRO3(model, ProcessGrid(1, 1).dp_group)
    seen, gather, prefetch = [], opt._gather_unit, opt._prefetch_next
    opt.most_prefetched = 0

    def watched(name, groups):
        gather(name, groups)
        seen.append((name, {id(g) for g in groups}, set(opt._prefetched)))

    def watched_prefetch():
        prefetch()
        opt.most_prefetched = max(opt.most_prefetched, _prefetched_bytes(opt))

    opt._gather_unit, opt._prefetch_next = watched, watched_prefetch
    return model, opt, seen


def _step(model, opt, micro_batches=2):
    rng = np.random.default_rng(0)
    for _ in range(micro_batches):
        _, loss = model(rng.integers(0, 13, (3, 6)), rng.integers(0, 13, (3, 6)))
        loss.backward()
    opt.step()
    opt.zero_grad()


def test_each_gather_prefetches_the_next_recorded_unit_alone_and_two_units_at_most_are_whole():
    model, opt, seen = _watched()
    _step(model, opt)
    order = [(name, groups) for name, groups, _ in seen]
    assert all(not prefetched for _, _, prefetched in seen)  # no record yet: nothing prefetched
    seen.clear()
    came, before = dict(opt.unit_gathers), opt.ledger.now["parameters"]
    opt.ledger.peak["parameters"] = before  # this step's peak alone
    _step(model, opt)
    assert [(name, groups) for name, groups, _ in seen] == order  # the same schedule as the record
    for k, (name, groups, prefetched) in enumerate(seen):
        # the next unit's groups, less those this unit holds now (the head's, before its backward):
        # its forward's release starts those
        following = order[k + 1][1] - groups if k + 1 < len(order) else set()
        assert prefetched == following, f"gather {k} ({name}): prefetched other than the next unit"
    assert {k: opt.unit_gathers[k] - came[k] for k in came} == {"prefetched": len(order) - 1, "on demand": 1}
    size = {id(g): g.padded * opt.master.itemsize for g in opt.groups}  # a group's whole buffer
    units = sorted((sum(size[i] for i in groups) for _, groups in order), reverse=True)
    assert before == opt.master.nbytes
    assert opt.ledger.peak["parameters"] <= opt.master.nbytes + units[0] + units[1]
    assert opt.ledger.peak["parameters"] > opt.master.nbytes + units[0]  # two were held: a prefetch beside a unit


class _Watched:
    """A request that notes whether it was tested before its wait."""

    def __init__(self, request, log):
        self.request, self.tested = request, False
        log.append(self)

    def test(self):
        self.tested = True
        return self.request.test()

    def wait(self):
        self.waited_tested, request, self.request = self.tested, self.request, None  # (it keeps the buffer)
        return request.wait()


def test_a_gather_prefetched_at_a_units_backward_is_tested_by_its_gradient_hooks():
    """MPICH moves a message only inside an MPI call: the gather prefetched as a unit's backward
    starts (for the unit before it) must be tested while that backward runs, not only waited for."""
    model, opt, _ = _watched()
    _step(model, opt)
    started, at_backward = [], []
    for g in opt.groups:
        start = g.comm.iall_gather
        g.comm.iall_gather = lambda *a, start=start, **k: _Watched(start(*a, **k), started)
    before = opt.before_unit_backward

    def watched(name, read):
        n = len(started)
        before(name, read)
        at_backward.extend(started[n:])

    opt.before_unit_backward = watched
    _step(model, opt)
    assert at_backward and all(r.waited_tested for r in at_backward)


def test_prefetch_peak_is_the_most_bytes_prefetched_at_once_not_the_last():
    model, opt, _ = _watched()
    _step(model, opt)
    assert opt.prefetch_peak == opt.most_prefetched == 0  # the first step records, prefetches nothing
    # one micro-batch of the two recorded: the last prefetch (the second micro-batch's embeddings,
    # which never come) is smaller than a block's, prefetched before it
    _step(model, opt, micro_batches=1)
    assert opt.most_prefetched > 0
    assert opt.prefetch_peak == opt.most_prefetched


def test_zero_grad_twice_between_steps_keeps_the_record_and_the_prefetch():
    model, opt, seen = _watched()
    _step(model, opt)
    units = len(seen)
    opt.zero_grad()  # a second step's end with nothing recorded: the last record stays the plan
    came = dict(opt.unit_gathers)
    _step(model, opt)
    assert {k: opt.unit_gathers[k] - came[k] for k in came} == {"prefetched": units - 1, "on demand": 1}


def test_a_step_that_departs_from_the_record_frees_what_it_prefetched():
    model, opt, _ = _watched()
    _step(model, opt)  # two micro-batches recorded
    rng = np.random.default_rng(0)
    _, loss = model(rng.integers(0, 13, (3, 6)), rng.integers(0, 13, (3, 6)))
    loss.backward()
    assert opt._prefetched  # the second micro-batch's first unit, which does not come
    opt.step()
    opt.zero_grad()
    assert not opt._prefetched
    assert opt.ledger.now["parameters"] == opt.master.nbytes


def test_evaluation_after_a_step_prefetches_nothing():
    model, opt, _ = _watched()
    _step(model, opt)
    _step(model, opt)
    assert opt.unit_gathers["prefetched"] > 0 and opt.ledger.now["parameters"] == opt.master.nbytes
    with minipar.no_grad():
        model(np.random.default_rng(1).integers(0, 13, (3, 6)))
    assert not opt._prefetched
    assert opt.ledger.now["parameters"] == opt.master.nbytes
