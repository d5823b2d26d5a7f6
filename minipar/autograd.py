"""Reverse-mode automatic differentiation: Tensor, Function and the backward pass.

Reading order: ``Function.apply`` (how a graph node is recorded during forward), then ``backward``
(how gradients flow back through the recorded nodes), then the Tensor operator methods at the bottom,
which only forward to ``minipar.functional``.

A ``Function`` works on raw xp arrays: ``forward(ctx, *args)`` returns an array (or a tuple of
arrays for ops with several outputs) and stores what its backward needs on ``ctx``;
``backward(ctx, *grads)`` receives one gradient per output and returns one gradient per positional
argument (``None`` where no gradient is needed). Two rules keep the engine simple and the ops short:

* Broadcasting is undone in one place, here (``_unbroadcast``): an op may return a gradient in the
  broadcast shape of its output and the engine sums it down to the input's shape.
* A backward never writes into the gradients it receives, and returns for each input either a
  fresh array or a view of a gradient it received (``a + b`` hands ``grad`` itself to both inputs);
  never an array that something else still holds. The engine then knows which gradients it owns:
  those that share no memory with the node's other gradients. It accumulates into owned arrays in
  place and copies the others only when it has to.
"""

import contextlib

from minipar.backend import get_default_dtype, to_numpy, xp

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

    def __init__(self):
        self.needs_input_grad = ()


class Node:
    """One recorded op application: the function, its context, its tensor inputs and output shapes."""

    __slots__ = ("fn", "ctx", "inputs", "in_shapes", "out_meta")

    def __init__(self, fn, ctx, inputs, out_meta):
        self.fn = fn
        self.ctx = ctx
        self.inputs = inputs  # the positional args; non-Tensor args are kept as None
        self.in_shapes = tuple(t.data.shape if t is not None else None for t in inputs)
        self.out_meta = out_meta  # [(shape, dtype)] per output, to make zero grads for unused outputs

    def parents(self):
        return [t._node for t in self.inputs if t is not None and t._node is not None]

    def free(self):
        self.ctx = None
        self.inputs = ()


class Function:
    """Base class of every differentiable op. Subclasses define two static methods:

    ``forward(ctx, *args, **kwargs) -> array | tuple of arrays`` and
    ``backward(ctx, *grads) -> grad | tuple of grads`` (one per positional arg).
    """

    @classmethod
    def apply(cls, *args, **kwargs):
        arrays = [a.data if isinstance(a, Tensor) else a for a in args]
        ctx = Context()
        track = _grad_enabled and any(isinstance(a, Tensor) and a.requires_grad for a in args)
        if track:
            ctx.needs_input_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        out = cls.forward(ctx, *arrays, **kwargs)
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


def _unbroadcast(grad, shape):
    """Sum ``grad`` down to ``shape``: over leading axes that broadcasting added, and over axes where
    the input had size 1. This is the only place in the engine that knows about broadcasting.
    Any other difference of shape is a bug in an op's backward: the result then keeps a shape that
    differs from ``shape`` and the caller raises (a reshape here would hide it)."""
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    if lead > 0:
        grad = grad.sum(axis=tuple(range(lead)))
    ones = tuple(i for i, n in enumerate(shape) if n == 1 and i < grad.ndim and grad.shape[i] != 1)
    return grad.sum(axis=ones, keepdims=True) if ones else grad


def _topological_order(root):
    """Nodes reachable from ``root``, every node after all the nodes it consumes. Iterative DFS:
    a 96-layer model (thousands of nodes) must not hit Python's recursion limit."""
    order, seen = [], {root}
    stack = [(root, iter(root.parents()))]
    while stack:
        node, parents = stack[-1]
        for parent in parents:
            if parent not in seen:
                seen.add(parent)
                stack.append((parent, iter(parent.parents())))
                break
        else:
            stack.pop()
            order.append(node)
    return order


class _GradSlot:
    """The running sum of the gradients that reach one output of one node.

    A gradient that may be shared (see the module docstring) is kept as it arrives; the first sum
    into it then creates a fresh array, and later gradients are added into that in place.
    """

    __slots__ = ("grad", "owned")

    def __init__(self, grad, owned):
        self.grad, self.owned = grad, owned

    def add(self, grad):
        if self.owned:
            self.grad += grad
        else:
            self.grad, self.owned = self.grad + grad, True


def backward(tensor, grad=None):
    """Accumulate d(tensor)/d(leaf) * grad into ``.grad`` of every leaf that requires grad.

    ``grad`` is the upstream gradient (same shape as ``tensor``); it may be omitted for a scalar.
    The graph is freed as it is consumed, so saved activations are released during backward.
    """
    if not tensor.requires_grad:
        raise RuntimeError(
            "backward() on a tensor that does not require grad: none of its inputs did, or it "
            "was computed under no_grad()"
        )
    if tensor._node is not None and tensor._node.ctx is None:
        raise RuntimeError(
            "backward() through a graph that an earlier backward() already freed: "
            "run the forward again"
        )
    if grad is None:
        if tensor.data.size != 1:
            raise RuntimeError(f"backward() on a tensor of shape {tensor.shape} needs grad=")
        grad = xp.ones_like(tensor.data)
    grad = grad.data if isinstance(grad, Tensor) else xp.asarray(grad)
    if grad.shape != tensor.shape or grad.dtype != tensor.dtype:
        raise ValueError(
            f"grad has shape {grad.shape} {grad.dtype}, tensor has {tensor.shape} {tensor.dtype}"
        )
    if tensor._node is None:  # a leaf: its gradient with respect to itself
        tensor._accumulate(grad, owned=False)
        return

    root = tensor._node
    slots = {root: [None] * len(root.out_meta)}
    slots[root][tensor._index] = _GradSlot(grad, owned=False)
    for node in reversed(_topological_order(root)):
        node_slots = slots.pop(node, None)
        if node_slots is None:  # no gradient flows through this node
            node.free()
            continue
        if node.ctx is None:
            raise RuntimeError(
                f"the graph through {node.fn.__name__} was freed by an earlier backward(): "
                "run the forward again before a second backward()"
            )
        out_grads = [
            s.grad if s is not None else xp.zeros(shape, dtype)
            for s, (shape, dtype) in zip(node_slots, node.out_meta)
        ]
        in_grads = node.fn.backward(node.ctx, *out_grads)
        if not isinstance(in_grads, tuple):
            in_grads = (in_grads,)
        if len(in_grads) != len(node.inputs):
            raise RuntimeError(
                f"{node.fn.__name__}.backward returned {len(in_grads)} gradients for "
                f"{len(node.inputs)} inputs"
            )
        in_grads = [
            None if t is None or g is None else _unbroadcast(g, shape)
            for t, g, shape in zip(node.inputs, in_grads, node.in_shapes)
        ]
        for i, (t, g) in enumerate(zip(node.inputs, in_grads)):
            if g is None:
                continue
            if g.shape != t.data.shape:
                raise RuntimeError(
                    f"{node.fn.__name__}.backward produced a gradient of shape {g.shape} for an "
                    f"input of shape {t.data.shape}"
                )
            if g.dtype != t.data.dtype:
                raise TypeError(
                    f"{node.fn.__name__}.backward produced a {g.dtype} gradient for a "
                    f"{t.data.dtype} input (a silent upcast): keep every constant in the input dtype"
                )
            others = out_grads + [o for j, o in enumerate(in_grads) if j != i and o is not None]
            owned = not any(xp.may_share_memory(g, o) for o in others)
            if t._node is None:
                t._accumulate(g, owned)
            else:
                parent_slots = slots.setdefault(t._node, [None] * len(t._node.out_meta))
                slot = parent_slots[t._index]
                if slot is None:
                    parent_slots[t._index] = _GradSlot(g, owned)
                else:
                    slot.add(g)
        node.free()


class Tensor:
    """An xp array plus what autograd needs: ``grad``, ``requires_grad`` and the node that made it."""

    # NumPy must not compute on a Tensor behind autograd's back: ndarray + Tensor then defers to
    # Tensor.__radd__ and numpy.exp(Tensor) is an error, while numpy.asarray(Tensor) still works.
    __array_ufunc__ = None

    def __init__(self, data, requires_grad=False, dtype=None):
        if isinstance(data, Tensor):
            data = data.data
        array = xp.asarray(data)
        if dtype is not None:
            array = array.astype(dtype, copy=False)
        elif array.dtype.kind == "f" or array.dtype.kind in "biu" and requires_grad:
            array = array.astype(get_default_dtype(), copy=False)
        if requires_grad and array.dtype.kind != "f":
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
            # .grad is the user's to modify in place (clipping does), so it must not be shared
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
        return array if dtype is None else array.astype(dtype, copy=False)

    def item(self):
        return self.data.item()

    def detach(self):
        return Tensor._wrap(self.data)

    def backward(self, grad=None):
        backward(self, grad)

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
