"""Where the time goes, op by op: every Function's forward and backward, timed while a block runs.

    with OpTimes() as times:
        for _ in range(10):
            loss = model(x, y)[1]; loss.backward()
    print(times.table(steps=10))

Every op passes through two doors, ``Function.apply`` (forward) and ``engine.call_backward``
(backward, also a split backward's W pass); inside the ``with`` block both are wrapped by a
timer. Times are exclusive: an op called inside another op's forward or backward (activation
recompute runs the layer's forward again inside its backward) is charged to itself, not to its
caller as well. What an op waits for (a collective inside a tensor-parallel region, a ring
attention's messages) is its own time. What is outside every op (the engine's bookkeeping, the
optimizer, a pipeline's executor and waits) is the block's time less the ops'.

The wrapping costs about a microsecond a call. Only one ``OpTimes`` may be active at a time.
"""

import contextlib
import time
from collections import defaultdict

from minipar import engine
from minipar.autograd import Function

_active = []


class OpTimes:
    def __init__(self):
        self.seconds = defaultdict(float)  # (op name, "forward" | "backward") -> exclusive seconds
        self.calls = defaultdict(int)
        self.wall = 0.0  # the time inside the ``with`` block
        self._children = []  # a stack: the time of the ops running inside each op now running
        self._paused = False

    @contextlib.contextmanager
    def paused(self):
        """Ops run inside this block are not timed (an evaluation between training steps)."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def _timed(self, name, kind, run, *args):
        if self._paused:
            return run(*args)
        self._children.append(0.0)
        start = time.perf_counter()
        try:
            return run(*args)
        finally:
            spent = time.perf_counter() - start
            inner = self._children.pop()
            self.seconds[name, kind] += spent - inner
            self.calls[name, kind] += 1
            if self._children:
                self._children[-1] += spent

    def __enter__(self):
        if _active:
            raise RuntimeError("an OpTimes is already timing: nest no second one")
        _active.append(self)
        apply, call_backward = Function.__dict__["apply"], engine.call_backward
        self._restore = (apply, call_backward)
        timer = self

        def timed_apply(cls, *args, **kwargs):
            return timer._timed(cls.__name__, "forward", lambda: apply.__func__(cls, *args, **kwargs))

        def timed_backward(fn, ctx, out_grads, inputs, **kwargs):  # weights_only: a split backward's W
            return timer._timed(fn.__name__, "backward", lambda: call_backward(fn, ctx, out_grads, inputs, **kwargs))

        Function.apply = classmethod(timed_apply)
        engine.call_backward = timed_backward
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._start
        Function.apply, engine.call_backward = self._restore
        _active.clear()
        return False

    def rows(self):
        """[(op, forward s, backward s, forward calls, backward calls)], the costliest first."""
        names = {name for name, _ in self.seconds}
        rows = [(n, self.seconds[n, "forward"], self.seconds[n, "backward"], self.calls[n, "forward"],
                 self.calls[n, "backward"]) for n in names]
        return sorted(rows, key=lambda r: -(r[1] + r[2]))

    def table(self, steps=1):
        """The rows as text, in milliseconds per step (``steps``: how many the block ran), with the
        time outside every op and the block's whole time at the bottom."""
        lines = [f"{'op':<24}{'forward ms':>12}{'backward ms':>13}{'calls':>8}"]
        inside = 0.0
        for name, forward, backward, calls, _ in self.rows():
            inside += forward + backward
            lines.append(f"{name:<24}{1e3 * forward / steps:>12.2f}{1e3 * backward / steps:>13.2f}{calls // steps:>8}")
        lines.append(f"{'(outside every op)':<24}{1e3 * (self.wall - inside) / steps:>25.2f}")
        lines.append(f"{'(all)':<24}{1e3 * self.wall / steps:>25.2f}")
        return "\n".join(lines)
