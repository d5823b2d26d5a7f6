"""The backward pass: replay the recorded nodes in reverse and accumulate gradients.

``autograd.Function.apply`` records a ``Node`` per op during forward; ``backward(loss)`` orders the
nodes reachable from the loss, walks them from the loss back to the leaves, and leaves each leaf's
gradient in its ``.grad``. Two rules keep the engine simple and the ops short:

* Broadcasting is undone in one place, here (``_unbroadcast``): an op may return a gradient in the
  broadcast shape of its output and the engine sums it down to the input's shape.
* A backward never writes into the gradients it receives, and returns for each input either a
  fresh array or a view of a gradient it received (``a + b`` hands ``grad`` itself to both inputs);
  never an array that something else still holds. The engine then knows which gradients it owns:
  those that share no memory with the node's other gradients. It accumulates into owned arrays in
  place and copies the others only when it has to.

The backward can also be split in two (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): B,
the gradients of everything but the weights (what the previous pipeline stage waits for), now, and
W, the weights' gradients, later. Inside ``splitting(split)`` a node that consumes a weight runs
its backward with ``needs_input_grad`` cleared for the weights and parks (node, output gradients)
in ``split``; W (``minipar.weight_grad``) calls the same backward again with only the weights
asked for, and ``deliver``s them as here. Both halves run the fused backward's arithmetic on the
same arrays, and W keeps the nodes' order, so B then W equals the fused backward bit for bit.

The engine knows tensors only by their attributes (``data``, ``requires_grad``, ``_node``,
``_index``, ``_accumulate``), so it sits below ``autograd`` and imports nothing from it.
"""

import contextlib

from minipar.backend import array_of, xp


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
    grad = xp.asarray(array_of(grad))
    if grad.shape != tensor.shape or grad.dtype != tensor.dtype:
        raise ValueError(
            f"grad has shape {grad.shape} {grad.dtype}, tensor has {tensor.shape} {tensor.dtype}"
        )
    if tensor._node is None:  # a leaf: its gradient with respect to itself
        tensor._accumulate(grad, owned=False)
        fire_hooks(tensor)
        return

    root = tensor._node
    order = _topological_order(root)
    freed = next((node for node in order if node.ctx is None), None)
    if freed is not None:  # refused before any node runs: no leaf is left with part of a gradient
        _refuse_freed(freed)
    waiting = _leaves_with_hooks(order)
    slots = {root: [None] * len(root.out_meta)}
    slots[root][tensor._index] = _GradSlot(grad, owned=False)
    for node in reversed(order):
        node_slots = slots.pop(node, None)
        if node_slots is None:  # no gradient flows through this node
            _count_down(node, waiting)
            node.free()
            continue
        if node.ctx is None:  # freed while this backward ran (a nested backward reaching it)
            _refuse_freed(node)
        out_grads = [
            s.grad if s is not None else xp.zeros(shape, dtype)
            for s, (shape, dtype) in zip(node_slots, node.out_meta)
        ]
        deferred = _split.deferred(node) if _split is not None else ()
        if deferred:  # B now, W later: the weights' part of this node waits in the split
            _split.defer(node, out_grads, deferred)
            node.ctx.needs_input_grad = tuple(n and i not in deferred
                                              for i, n in enumerate(node.ctx.needs_input_grad))
        if not deferred or any(node.ctx.needs_input_grad):
            in_grads = call_backward(node.fn, node.ctx, out_grads, node.inputs)
            in_grads = [None if i in deferred else g for i, g in enumerate(in_grads)]
            deliver(node.fn, node.inputs, node.in_shapes, in_grads, out_grads, slots)
        _count_down(node, waiting)
        node.free()


def _refuse_freed(node):
    raise RuntimeError(f"the graph through {node.fn.__name__} was freed by an earlier backward(): "
                       "run the forward again before a second backward()")


class _Released:
    """Stands on a parked context for a weight its holder released after B: W computes dW from the
    saved inputs and output gradients alone, so any use of this fails, naming the weight."""

    def __init__(self, fn, name):
        self._what = (fn, name)

    def _message(self):
        fn, name = self._what
        return (f"{fn}'s weight gradient (a split backward's W) read ctx.{name}, which its holder released "
                "after B: a W must compute dW from the saved inputs and output gradients alone")

    def _fail(self, *args, **kwargs):
        raise RuntimeError(self._message())

    def __getattr__(self, attribute):  # an AttributeError, so that hasattr() (casts over a context) says no
        if "_what" not in self.__dict__:  # (copy and pickle ask before __init__ has run)
            raise AttributeError(attribute)
        raise AttributeError(f"{self._message()} (its .{attribute})")

    __array__ = __array_ufunc__ = __array_function__ = __getitem__ = __len__ = __iter__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _fail
    __matmul__ = __rmatmul__ = __neg__ = __pow__ = _fail


def call_backward(fn, ctx, out_grads, inputs, weights_only=False):
    """``fn.backward`` on the node's output gradients: one gradient per input (None where the
    input needs none), possibly in a broadcast shape that ``deliver`` sums down. A parameter the
    forward saved by reference (``autograd.save_parameters_by_reference``) is put back first.
    ``weights_only``: a split backward's W, which asks for the weights' gradients alone; those read
    the inputs and the output gradients (dW = g^T x), never the weights, so a weight its holder has
    released since B stays released, and a backward that reads it fails saying so (its holder
    does not gather it again behind the schedule's back)."""
    for name, param, shape in ctx.by_reference:
        if param.data.shape != shape:
            if weights_only:
                setattr(ctx, name, _Released(fn.__name__, name))
                continue
            raise RuntimeError(f"{fn.__name__}.backward needs a parameter of shape {shape} that its holder has "
                               f"not gathered (its data has shape {param.data.shape})")
        setattr(ctx, name, param.data)
    in_grads = fn.backward(ctx, *out_grads)
    for name, _, _ in ctx.by_reference:  # a context parked for W must not keep the gathered arrays
        setattr(ctx, name, None)
    if not isinstance(in_grads, tuple):
        in_grads = (in_grads,)
    if len(in_grads) != len(inputs):
        raise RuntimeError(f"{fn.__name__}.backward returned {len(in_grads)} gradients for {len(inputs)} inputs")
    return in_grads


def deliver(fn, inputs, in_shapes, in_grads, out_grads, slots):
    """Hand each input its gradient: a leaf accumulates it in ``.grad``, a computed tensor in the
    slot of the node that made it (``slots``; None when every input receiving one is a leaf, as
    for the weights of a split backward's W)."""
    in_grads = [None if t is None or g is None else _unbroadcast(g, shape)
                for t, g, shape in zip(inputs, in_grads, in_shapes)]
    for i, (t, g) in enumerate(zip(inputs, in_grads)):
        if g is None:
            continue
        if g.shape != in_shapes[i]:  # the shape in forward: a released weight's data is empty in W
            raise RuntimeError(
                f"{fn.__name__}.backward produced a gradient of shape {g.shape} for an "
                f"input of shape {in_shapes[i]}"
            )
        if g.dtype != t.data.dtype:
            raise TypeError(
                f"{fn.__name__}.backward produced a {g.dtype} gradient for a "
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


def _leaves_with_hooks(order):
    """{leaf: number of uses in this graph} for the leaves that asked to hear when their gradient
    is complete (data parallelism starts a bucket's all-reduce then, while backward goes on). In a
    split backward the deferred weights are left out: their gradients are complete only after W."""
    waiting = {}
    for node in order:
        for t in node.inputs:
            if t is not None and t._node is None and getattr(t, "_grad_hooks", None) \
                    and not (_split is not None and _split.holds(t)):  # a deferred weight's hooks fire in W
                waiting[t] = waiting.get(t, 0) + 1
    return waiting


def _count_down(node, waiting):
    """One use of each hooked leaf input of ``node`` has been accounted for; fire at zero."""
    if not waiting:
        return
    for t in node.inputs:
        if t is not None and t in waiting:
            waiting[t] -= 1
            if waiting[t] == 0:
                del waiting[t]
                fire_hooks(t)


_hooks_held = 0
_split = None  # the WeightGradients collecting W while a split backward runs (minipar.weight_grad)


def current_split():
    """The split whose W the backward running now leaves its weights' gradients to (the
    ``WeightGradients`` of ``splitting``); None in a whole backward or outside every backward."""
    return _split


@contextlib.contextmanager
def splitting(split):
    """Inside, every ``backward`` (also one nested in another op's backward, as activation
    recompute's) computes B only: a node that consumes one of ``split``'s weights runs its backward
    for its other inputs now and hands (node, output gradients) to ``split.defer`` for W."""
    global _split
    previous, _split = _split, split
    try:
        yield split
    finally:
        _split = previous


@contextlib.contextmanager
def hold_hooks():
    """Inside, gradient hooks do not fire. A recomputed region's inner backward runs inside: its
    parameters are also inputs of the outer node, whose completion fires their hooks once, after
    the inner backward has added everything."""
    global _hooks_held
    _hooks_held += 1
    try:
        yield
    finally:
        _hooks_held -= 1


def fire_hooks(tensor):
    if _hooks_held:
        return
    for hook in getattr(tensor, "_grad_hooks", ()):
        hook(tensor)
