"""Reverse-mode automatic differentiation, the recording half: Tensor and Function.

Reading order: ``Function.apply`` (how an op records a graph node during forward), then
``minipar/engine.py`` (how ``backward`` replays the nodes in reverse), then the Tensor operator
methods at the bottom, which only forward to ``minipar.functional``.

A ``Function`` works on raw xp arrays: ``forward(ctx, *args)`` returns an array (or a tuple of
arrays for ops with several outputs) and stores what its backward needs on ``ctx``;
``backward(ctx, *grads)`` receives one gradient per output and returns one gradient per positional
argument (``None`` where no gradient is needed), with the two rules stated in ``engine.py``:
gradients may come back in the broadcast shape, and a backward never writes into the gradients it
receives nor returns an array that something else still holds.
"""

import contextlib

from minipar.backend import to_numpy, xp
from minipar.dtypes import as_dtype, get_default_dtype, is_float
from minipar.engine import Node, backward

_grad_enabled = True


@contextlib.contextmanager
def no_grad():
    """Run forward without recording a graph (evaluation, optimizer updates)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = previous


def is_grad_enabled():
    return _grad_enabled


class Context:
    """Attribute bag for what a forward saves for its backward. Cleared once backward has run."""

    by_reference = ()  # (attribute, parameter, shape) of what forward saved by reference, see below

    def __init__(self):
        self.needs_input_grad = ()


_by_reference = [False]  # whether a parameter may be released between forward and backward (ZeRO-3)


def save_parameters_by_reference():
    """From now on, a parameter with a ``held_by`` (a ZeRO-3 optimizer, which empties its data
    between uses) is saved for backward by reference: an op's ``ctx.weight = weight`` keeps the
    Parameter, and the engine hands backward the parameter's data as it is then, gathered again
    by its holder (FSDP frees and refills a parameter's storage under the saved tensor instead;
    NumPy cannot free an array's memory while a view of it lives). Every op here saves the weight
    array it received as it is; a view of it would keep the gathered buffer alive, which the
    holder detects."""
    _by_reference[0] = True


def _save_by_reference(ctx, args, arrays):
    """Swap the saved arrays of released-able parameters on ``ctx`` for references."""
    held = [(a, array) for a, array in zip(args, arrays) if getattr(a, "held_by", None) is not None]
    if not held:
        return
    saved = [(name, a, array.shape) for name, value in vars(ctx).items() for a, array in held if value is array]
    for name, _, _ in saved:
        setattr(ctx, name, None)
    ctx.by_reference = saved


class Function:
    """Base class of every differentiable op. Subclasses define two static methods:

    ``forward(ctx, *args, **kwargs) -> array | tuple of arrays`` and
    ``backward(ctx, *grads) -> grad | tuple of grads`` (one per positional arg).

    A split backward (``minipar.weight_grad``) calls ``backward`` twice on a node with weight
    inputs, B with the weights' ``needs_input_grad`` cleared and W with only theirs set: such an op
    computes a gradient only when asked and leaves ``ctx`` as it found it. ``defers_weights`` is
    False for an op whose weight inputs only anchor the graph (activation recompute, whose inner
    backward splits itself).
    """

    defers_weights = True

    @classmethod
    def apply(cls, *args, **kwargs):
        arrays = [a.data if isinstance(a, Tensor) else a for a in args]
        ctx = Context()
        track = _grad_enabled and any(isinstance(a, Tensor) and a.requires_grad for a in args)
        if track:
            ctx.needs_input_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        out = cls.forward(ctx, *arrays, **kwargs)
        if track and _by_reference[0]:
            _save_by_reference(ctx, args, arrays)
        outs = out if isinstance(out, tuple) else (out,)
        results = tuple(Tensor._wrap(o, requires_grad=track) for o in outs)
        if track:
            inputs = tuple(a if isinstance(a, Tensor) and a.requires_grad else None for a in args)
            node = Node(cls, ctx, inputs, [(o.shape, o.dtype) for o in outs])
            for index, r in enumerate(results):
                r._node, r._index = node, index
        return results if isinstance(out, tuple) else results[0]

    @staticmethod
    def forward(ctx, *args, **kwargs):  # pragma: no cover - interface
        raise NotImplementedError

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - interface
        raise NotImplementedError


class Tensor:
    """An xp array plus what autograd needs: ``grad``, ``requires_grad`` and the node that made it.

    Float data is stored in the default dtype unless ``dtype`` says otherwise; integer data (token
    ids) stays integer.
    """

    # NumPy must not compute on a Tensor behind autograd's back: ndarray + Tensor then defers to
    # Tensor.__radd__ and numpy.exp(Tensor) is an error, while numpy.asarray(Tensor) still works.
    __array_ufunc__ = None

    def __init__(self, data, requires_grad=False, dtype=None):
        if isinstance(data, Tensor):
            data = data.data
        array = xp.asarray(data)
        if dtype is not None:  # as_dtype: NumPy knows the name "bfloat16" only once ml_dtypes is imported
            array = array.astype(as_dtype(dtype), copy=False)
        elif is_float(array.dtype) or (array.dtype.kind in "biu" and requires_grad):
            array = array.astype(get_default_dtype(), copy=False)
        if requires_grad and not is_float(array.dtype):
            raise TypeError(f"only float tensors can require grad, got {array.dtype}")
        self.data = array
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._node = None
        self._index = 0

    @classmethod
    def _wrap(cls, array, requires_grad=False):
        """Wrap an op's output array without any dtype conversion."""
        t = cls.__new__(cls)
        t.data, t.grad, t.requires_grad, t._node, t._index = array, None, requires_grad, None, 0
        return t

    def _accumulate(self, grad, owned):
        if self.grad is None:
            wide = getattr(self, "accumulate_dtype", None)  # a 16-bit model's gradients summed in fp32
            if wide is not None and grad.dtype != wide:
                self.grad = grad.astype(wide)
            else:  # .grad is the user's to modify in place (clipping does), so it must not be shared
                self.grad = grad if owned else grad.copy()
        else:
            self.grad += grad

    # ---- inspection -------------------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)
    size = property(lambda self: self.data.size)

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({to_numpy(self.data)!r}{grad})"

    def numpy(self):
        return to_numpy(self.data)

    def __array__(self, dtype=None, copy=None):
        array = to_numpy(self.data)
        return array if dtype is None else array.astype(as_dtype(dtype), copy=False)

    def item(self):
        return self.data.item()

    def detach(self):
        return Tensor._wrap(self.data)

    def backward(self, grad=None):
        backward(self, grad)

    def register_grad_hook(self, hook):
        """Call ``hook(tensor)`` during each backward, as soon as this leaf's gradient for that
        backward is complete (all its uses have contributed)."""
        if self._node is not None:
            raise RuntimeError("gradient hooks are for leaf tensors (parameters)")
        if not hasattr(self, "_grad_hooks"):
            self._grad_hooks = []
        self._grad_hooks.append(hook)

    # ---- operators: thin forwards to minipar.functional ----------------------------------------
    def __add__(self, other):
        return F.add(self, other)

    def __radd__(self, other):
        return F.add(other, self)

    def __sub__(self, other):
        return F.sub(self, other)

    def __rsub__(self, other):
        return F.sub(other, self)

    def __mul__(self, other):
        return F.mul(self, other)

    def __rmul__(self, other):
        return F.mul(other, self)

    def __truediv__(self, other):
        return F.div(self, other)

    def __rtruediv__(self, other):
        return F.div(other, self)

    def __neg__(self):
        return F.neg(self)

    def __pow__(self, exponent):
        return F.pow(self, exponent)

    def __matmul__(self, other):
        return F.matmul(self, other)

    def __getitem__(self, index):
        return F.getitem(self, index)

    def reshape(self, *shape):
        return F.reshape(self, shape[0] if len(shape) == 1 else shape)

    def transpose(self, *axes):
        return F.transpose(self, axes[0] if len(axes) == 1 else (axes or None))

    permute = transpose

    def split(self, sections, axis=-1):
        return F.split(self, sections, axis)

    def sum(self, axis=None, keepdims=False):
        return F.sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        return F.mean(self, axis, keepdims)

    def exp(self):
        return F.exp(self)

    def log(self):
        return F.log(self)

    def tanh(self):
        return F.tanh(self)


from minipar import functional as F  # noqa: E402  (functional needs Tensor and Function first)
