"""Activation recomputation ("checkpointing", Chen et al. 2016): keep a layer's input, not its
activations, and run the layer again in backward.

During forward, ``checkpoint(fn, x)`` runs ``fn`` without recording a graph, so none of its
intermediate arrays are kept: only x. In backward it runs ``fn(x)`` again, this time recording,
and backpropagates the incoming gradient through that fresh graph. The parameters inside ``fn``
receive their gradients from that inner backward, exactly as without checkpointing. The price is
one more forward of ``fn``; the saving is every activation inside it.

The dropout masks must repeat exactly in the second run. A mask is a
function of the layer and of where the tokens are (``minipar.rng``): the model's DropoutRNG is set
back to what it said at the first run (iteration, rows, positions), then restored, because the
backward may run while another micro-batch's forward is the current one.

The parameters of ``fn`` are also passed as inputs of the recorded node (their gradients come from
the inner backward, not from it). The outer graph then counts the node as a use of each parameter,
so gradient hooks (data parallelism's buckets) fire once, after the inner backward has added the
region's part; the inner backward holds them back.
"""

import numpy

from minipar.autograd import Function, Tensor, no_grad
from minipar.backend import xp
from minipar.dtypes import is_float
from minipar.engine import hold_hooks


_RERUNS = [0]  # how many recomputations are running now


def recomputing():
    """Whether a layer's forward is the second run of a recomputation (in backward): what it
    counts as happening once per step (routing statistics) it must not count again."""
    return _RERUNS[0] > 0


class Checkpoint(Function):
    defers_weights = False  # its parameter inputs are anchors; the inner backward splits B and W itself

    @staticmethod
    def forward(ctx, x, anchor, fn, rng, *params):
        ctx.x, ctx.fn, ctx.rng, ctx.n_params = x, fn, rng, len(params)
        ctx.rng_state = rng.state() if rng is not None else None
        with no_grad():
            y = fn(Tensor._wrap(x))
        return y.data

    @staticmethod
    def backward(ctx, grad):
        float_input = is_float(ctx.x.dtype)
        x = Tensor._wrap(ctx.x, requires_grad=float_input)
        if ctx.rng is not None:  # draw the same dropout masks as the first run
            now = ctx.rng.state()
            ctx.rng.set_state(ctx.rng_state)
        _RERUNS[0] += 1
        try:
            y = ctx.fn(x)
        finally:
            _RERUNS[0] -= 1
        if ctx.rng is not None:
            ctx.rng.set_state(now)
        with hold_hooks():
            y.backward(grad)
        return ((x.grad if float_input else None),) + (None,) * (3 + ctx.n_params)


def checkpoint(fn, x, params=(), rng=None):
    """``fn(x)`` that keeps only ``x`` for backward and recomputes the rest there.

    ``rng``: the model's DropoutRNG, so that dropout inside ``fn`` draws the same masks twice.
    ``params``: the parameters ``fn`` uses (for gradient hooks, see the module docstring).
    ``x`` may be integer ids (an embedding): the result still depends on the parameters inside,
    which an ``anchor`` that requires grad tells the engine even when ``params`` is empty.
    """
    x = x if isinstance(x, Tensor) else Tensor(xp.asarray(x))
    anchor = Tensor(numpy.zeros(0), requires_grad=True)
    return Checkpoint.apply(x, anchor, fn, rng, *params)
