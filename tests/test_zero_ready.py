"""When ZeRO-3 may send a group: only once every parameter of the group has its gradient for the
backward now running. A group's parameters may come in different backwards (a parameter its unit
uses in some micro-batches only), so a count of hooks across micro-batches completes early: the
group was sent and its parameters freed while backward still needed them. GPT uses every
parameter of each unit in every forward, so these models are the public API's others: units
whose parameters are used in some micro-batches only, a parameter used twice in one unit and by
two units. Each is checked against the plain model with AdamW on one device, in float64: the
gradients of a step of several micro-batches and the parameters after it. (The ranks' agreement
on the parameters: tests/mpi/zero_agree.py, run by test_zero_ranks_must_agree_on_the_parameters.)
"""

import numpy as np
import pytest

import minipar
from minipar import functional as F
from minipar.nn import Linear, Module, Parameter
from minipar.optim import AdamW
from minipar.parallel import ProcessGrid
from minipar.parallel.zero2 import ZeRO2
from minipar.parallel.zero3 import ZeRO3

from late_sends import LateSends
from mpi_run import check_mpi

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)


pytestmark = pytest.mark.usefixtures("float64")  # (tests/conftest.py's)


class Units(Module):
    """Two units: ``body`` (``used``, then ``sometimes`` when the micro-batch asks for it, then
    ``shared`` twice) and ``head``, which uses ``shared`` too. Unwrapped it is the plain model."""

    def __init__(self):
        self.used, self.sometimes, self.out = Linear(4, 4), Linear(4, 4), Linear(4, 3)
        self.shared = Parameter(np.random.default_rng(9).standard_normal((4, 4)) * 0.3)
        self._runner = None

    def units(self):
        return [("body", self.used.parameters() + self.sometimes.parameters() + [self.shared]),
                ("head", self.out.parameters() + [self.shared])]

    def wrap_units(self, runner):
        self._runner = runner

    def _run(self, name, run, x):
        return run(x) if self._runner is None else self._runner(name, run, x)

    def body(self, x, both):
        y = self.used(x)
        y = self.sometimes(y) if both else y
        return F.linear(F.linear(y, self.shared), self.shared)

    def forward(self, x, both):
        y = self._run("body", lambda x: self.body(x, both), x)
        return self._run("head", lambda y: self.out(F.linear(y, self.shared)), y)


def _pair():
    minipar.manual_seed(0)
    plain, sharded = Units(), Units()
    sharded.load_state_dict(plain.state_dict())
    return plain, sharded, ZeRO3(sharded, ProcessGrid(1, 1).dp_group, **HYPER)


def _backward(model, x, both):
    F.sum(model(x, both) ** 2).backward()


def _compare(plain, sharded, zero, what):
    for p in plain.parameters():  # a parameter no micro-batch used: zeros, as every ZeRO stage sends
        p.grad = np.zeros_like(p.data) if p.grad is None else p.grad
    grads = zero.full_gradients()
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        np.testing.assert_allclose(grads[id(q)], p.grad.reshape(-1), rtol=1e-12, atol=1e-14,
                                   err_msg=f"{what}: gradient of {name}")
    opt = AdamW(plain.parameters(), **HYPER)
    opt.step()
    zero.step()
    state = zero.full_state_dict()
    for name, p in plain.named_parameters():
        np.testing.assert_allclose(state[name], p.data, rtol=1e-12, atol=1e-14,
                                   err_msg=f"{what}: {name} after the step")


# which micro-batches use ``sometimes``: later only (its group's count completed early, before
# ``used`` had this backward's gradient), earlier only, never, and mixed over three
@pytest.mark.parametrize("uses", [(False, True), (True, False), (False, False), (False, True, False, True)])
def test_a_group_goes_out_only_when_every_gradient_of_this_backward_is_in(uses):
    plain, sharded, zero = _pair()
    x = np.random.default_rng(1).standard_normal((3, 4))
    for i, both in enumerate(uses):  # micro-batches: each its own backward
        _backward(plain, x * (i + 1), both)
        _backward(sharded, x * (i + 1), both)
    _compare(plain, sharded, zero, f"micro-batches {uses}")


@pytest.mark.parametrize("stage,bucket_bytes", [(2, 1), (2, 1 << 20), (3, None)])
def test_zero_grad_discards_what_a_dropped_step_left(stage, bucket_bytes):
    """A backward whose step is dropped (zero_grad, no step) leaves sends in flight and groups
    waiting for ``sometimes``: none of its gradients may reach the next step."""
    minipar.manual_seed(0)
    plain, sharded = Units(), Units()
    sharded.load_state_dict(plain.state_dict())
    comm = LateSends(ProcessGrid(1, 1).dp_group)
    zero = ZeRO3(sharded, comm, **HYPER) if stage == 3 else ZeRO2(sharded, comm, bucket_bytes=bucket_bytes, **HYPER)
    held = zero.ledger.now["gradients"]
    x = np.random.default_rng(2).standard_normal((3, 4))
    _backward(sharded, 5 * x, False)
    zero.zero_grad()
    assert zero.ledger.now["gradients"] == held  # no buffer left behind
    _backward(plain, x, True)
    _backward(sharded, x, True)
    _compare(plain, sharded, zero, f"stage {stage} after a dropped step")


def test_a_parameter_no_unit_names_is_refused():
    minipar.manual_seed(0)
    model = Units()
    model.units = lambda: [("body", model.used.parameters())]
    with pytest.raises(ValueError, match="parameter shared is in no unit"):
        ZeRO3(model, ProcessGrid(1, 1).dp_group)


def test_zero_ranks_must_agree_on_the_parameters():
    out = check_mpi(2, "zero_agree.py", timeout=120)
    assert "zero agree OK on 2 ranks" in out
