import numpy as np
import pytest

import minipar.functional as F
import minipar.op_times
from minipar import Tensor, engine
from minipar.autograd import Function
from minipar.op_times import OpTimes
from minipar.parallel.recompute import checkpoint


class Clock:
    """A stand-in for the time module whose clock moves only when told: the figures are exact."""

    now = 0.0

    @classmethod
    def perf_counter(cls):
        return cls.now


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    Clock.now = 0.0
    monkeypatch.setattr(minipar.op_times, "time", Clock)


class Slow(Function):
    """Takes ``seconds`` of the clock in forward and twice that in backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        Clock.now += seconds
        return x * 2.0

    @staticmethod
    def backward(ctx, grad):
        Clock.now += 2 * ctx.seconds
        return grad * 2.0, None


def test_each_op_is_charged_its_own_forward_and_backward():
    x = Tensor(np.ones(3), requires_grad=True)
    with OpTimes() as times:
        for _ in range(2):
            F.sum(Slow.apply(x, 0.25)).backward()
            Clock.now += 1.0  # outside every op
    rows = {name: row for name, *row in times.rows()}
    assert rows["Slow"] == [0.5, 1.0, 2, 2] and rows["Sum"] == [0.0, 0.0, 2, 2]
    assert times.rows()[0][0] == "Slow" and times.wall == 3.5  # the costliest first
    with times.paused():
        Slow.apply(x, 0.25)
    assert times.rows()[0][1:] == (0.5, 1.0, 2, 2)  # nothing timed while paused
    lines = [line.split() for line in times.table(steps=2).splitlines()]  # per step, in ms
    assert lines[1] == ["Slow", "250.00", "500.00", "1"]
    assert lines[-2:] == [["(outside", "every", "op)", "1000.00"], ["(all)", "1750.00"]]


def test_an_op_inside_another_is_not_charged_to_both():
    """Recompute runs Slow's forward again inside its own backward: that second forward is
    Slow's, and the recompute node's own time excludes it."""
    x = Tensor(np.ones(3), requires_grad=True)
    with OpTimes() as times:
        F.sum(checkpoint(lambda t: Slow.apply(t, 0.25), x)).backward()
    rows = {name: row for name, *row in times.rows()}
    assert rows["Slow"] == [0.5, 0.5, 2, 1]  # forward under no_grad, again in backward, and its backward
    assert all(row[:2] == [0.0, 0.0] for name, row in rows.items() if name != "Slow")


def test_a_split_backward_is_charged_in_b_and_in_w():
    """Zero-bubble's W calls the backward again for the weights alone (``weights_only``): the
    timer's door took no such keyword, and every split-backward schedule under it raised."""
    from minipar.weight_grad import backward_input

    w = Tensor(np.ones(3), requires_grad=True)
    x = Tensor(np.ones(3), requires_grad=True)
    with OpTimes() as times:
        pending = backward_input(F.sum(Slow.apply(x, 0.25) * w), [w])
        pending.run()
    rows = {name: row for name, *row in times.rows()}
    assert rows["Slow"] == [0.25, 0.5, 1, 1] and rows["Mul"][3] == 2, rows  # Mul: B, then W
    assert w.grad is not None and x.grad is not None


def test_the_doors_are_restored_and_one_timer_at_a_time():
    apply, call_backward = Function.__dict__["apply"], engine.call_backward
    with OpTimes():
        with pytest.raises(RuntimeError, match="already timing"):
            OpTimes().__enter__()
    assert Function.__dict__["apply"] is apply and engine.call_backward is call_backward
    with pytest.raises(ValueError):
        with OpTimes():
            raise ValueError("the block failed")
    assert Function.__dict__["apply"] is apply and engine.call_backward is call_backward
