"""The backward split in two: B (input gradients) now, W (weight gradients) later.

Zero-bubble pipelines (Qi et al. 2024, "Zero Bubble Pipeline Parallelism") observe that of a
layer's two backward products, y = x W^T giving dx = g W and dW = g^T x, only dx is on the critical
path: the previous stage waits for it. dW can run whenever the stage would otherwise idle, as long
as it runs before the optimizer step. So

    pending = backward_input(out, weights, grad)   # B: every gradient but the weights'
    ...                                            # other work (forwards, other B's)
    pending.run()                                  # W: the weights' gradients, into .grad

B walks the graph as ``engine.backward`` does, but a node consuming one of ``weights`` computes
only its other inputs' gradients and is parked here with its output gradients; W calls the same
backward on each parked node, in the order B met them, asking for the weights' gradients only.
Each half is the fused backward's arithmetic on the same arrays, and each weight accumulates its
parts in the same order, so B then W equals the fused backward bit for bit.

The price is memory: until W runs, each parked node keeps what its weight gradient needs (a
linear layer's input x and its output gradient g; a LayerNorm's normalised input) where the fused
backward would have freed it. ``nbytes`` counts it, every buffer once, leaving out the weights
themselves (parameters, held anyway). Gradient hooks (data parallelism's buckets) of a deferred
weight fire in W, when its last parked use has run.
"""

import contextlib
from collections import Counter

from minipar import engine
from minipar.backend import xp


def _root(a):
    """The array that owns ``a``'s memory: a view's base, followed to its end."""
    while a.base is not None and isinstance(a.base, xp.ndarray):
        a = a.base
    return a


class WeightGradients:
    """The W half of one or more split backwards over ``weights`` (the tensors whose gradients
    wait): the parked nodes, their output gradients, and what they keep alive."""

    def __init__(self, weights):
        self._weights = {id(w): w for w in weights}
        self._parked = []  # (fn, ctx, out_grads, inputs, in_shapes, needs of W), in B's order
        self._nbytes = 0  # what they keep alive (``nbytes``), counted once after each B, not at every look

    def __len__(self):
        return len(self._parked)

    def holds(self, tensor):
        return id(tensor) in self._weights

    def waits(self, tensor):
        """Whether a node parked here already has ``tensor``'s gradient to make (a weight two ops
        use: this W will take a second part of it)."""
        return any(n and t is tensor for _, _, _, inputs, _, needs in self._parked for t, n in zip(inputs, needs))

    def deferred(self, node):
        """The indices of ``node``'s inputs whose gradients W computes."""
        if not node.fn.defers_weights:
            return ()
        return tuple(i for i, t in enumerate(node.inputs) if t is not None and self.holds(t))

    def defer(self, node, out_grads, indices):
        """Called by the engine during B: park ``node`` for W with the gradients of its outputs."""
        needs = tuple(n and i in indices for i, n in enumerate(node.ctx.needs_input_grad))
        # only the weights: a kept activation input (a LayerNorm's residual stream) would hold its
        # array, and through its node the graph before it, until W, which needs neither
        inputs = tuple(t if i in indices else None for i, t in enumerate(node.inputs))
        self._parked.append((node.fn, node.ctx, out_grads, inputs, node.in_shapes, needs))
        self._nbytes = None

    def buffers(self):
        """{id: buffer} kept alive for W: the output gradients and saved arrays of the parked
        nodes, each underlying buffer once, the weights' own arrays left out."""
        # a view shares memory with exactly the arrays of its own root: one set lookup per array
        # where asking NumPy of every weight cost more than a split backward saves (7 ms a step)
        weights = {id(_root(w.data)) for w in self._weights.values()}
        held = {}
        for _, ctx, out_grads, _, _, _ in self._parked:
            for a in list(out_grads) + [v for v in vars(ctx).values() if isinstance(v, xp.ndarray)]:
                a = _root(a)
                if id(a) not in held and id(a) not in weights:
                    held[id(a)] = a
        return held

    def nbytes(self):
        """Bytes kept alive for W (``buffers``)."""
        if self._nbytes is None:
            self._nbytes = sum(a.nbytes for a in self.buffers().values())
        return self._nbytes

    def run(self):
        """W: every parked node's weight gradients, accumulated into ``.grad`` in B's order. A
        weight's gradient hooks fire once its last parked use has run."""
        uses = Counter(t for _, _, _, inputs, _, needs in self._parked
                       for t, n in zip(inputs, needs) if n and getattr(t, "_grad_hooks", None))
        parked, self._parked, self._nbytes = self._parked, [], 0
        with _running():
            for fn, ctx, out_grads, inputs, in_shapes, needs in parked:
                ctx.needs_input_grad = needs
                in_grads = engine.call_backward(fn, ctx, out_grads, inputs, weights_only=True)
                in_grads = [g if n else None for g, n in zip(in_grads, needs)]
                engine.deliver(fn, inputs, in_shapes, in_grads, out_grads, slots=None)
                for t, n in zip(inputs, needs):
                    if n and t in uses:
                        uses[t] -= 1
                        if uses[t] == 0:
                            engine.fire_hooks(t)


_passes = 0  # how many W's have begun; odd while one runs


def weight_pass():
    """Which W is running (a number that differs from one W to the next), or None outside every W.
    A gradient hook that fires in W can tell its W's gradients from an earlier W's by it."""
    return _passes if _passes % 2 else None


def left_to_w(tensor):
    """Whether the backward running now is a split one's B that leaves ``tensor``'s gradient to W
    (no gradient of it arrives before W: a holder need not make room for one yet)."""
    split = engine.current_split()
    return split is not None and split.holds(tensor)


def second_part_in_w(tensor):
    """Whether the running B's W already has a part of ``tensor``'s gradient to make: an op
    reaching it now gives that W two, summed into ``grad`` before the weight's hook fires."""
    split = engine.current_split()
    return split is not None and split.waits(tensor)


@contextlib.contextmanager
def _running():
    global _passes
    if _passes % 2:
        raise RuntimeError("a W inside another W: run each split backward's W on its own")
    _passes += 1
    try:
        yield
    finally:
        _passes += 1


def backward_input(tensor, weights, grad=None):
    """B: backpropagate ``grad`` from ``tensor`` into every leaf but ``weights`` (those left for
    W). Returns the ``WeightGradients`` whose ``run()`` is W."""
    weights = list(weights)
    if any(w._node is not None for w in weights):
        raise ValueError("backward_input: the weights whose gradients W computes must be leaves (parameters)")
    pending = WeightGradients(weights)
    with engine.splitting(pending):
        engine.backward(tensor, grad)
    return pending
