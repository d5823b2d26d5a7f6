"""ZeRO-3's view of the model's units (FSDP's wrapping units, ``model.units()``): the parameter
groups they are gathered and sent in, the identity at a unit's boundaries whose backward tells
``zero3.py`` where backward is, and which groups a unit's backward reads (gathered for it again)."""

from minipar.autograd import Function


def unit_groups(units, key=lambda p: 0):
    """The parameter groups of ``units`` [(name, parameters)], in forward order: a parameter used
    by several units alone (so that each gathers it), then the rest of each unit's, in runs of one
    ``key`` (the group its gradient is summed over: an MoE block's experts apart from its dense
    weights)."""
    uses = {}
    for _, params in units:
        for p in dict.fromkeys(params):
            uses[id(p)] = uses.get(id(p), 0) + 1
    order, seen = [], set()
    for _, params in units:
        shared = [p for p in dict.fromkeys(params) if uses[id(p)] > 1 and id(p) not in seen]
        runs = []
        for p in (p for p in dict.fromkeys(params) if uses[id(p)] == 1):
            if runs and key(runs[-1][-1]) == key(p):
                runs[-1].append(p)
            else:
                runs.append([p])
        order += [[p] for p in shared] + runs
        seen.update(id(p) for p in shared)
    return order


class UnitBackward(Function):
    """Identity on a unit's boundary whose backward calls ``hook``. On the unit's output every op
    of the unit comes before it in forward, so its backward comes before theirs (FSDP's pre-backward:
    gather, make the buffers); on the unit's input it comes after every op that the input reaches
    (FSDP's post-backward, ``RegisterPostBackwardFunction``: release)."""

    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return grad, None


def read_in_backward(y, groups):
    """Those of a unit's ``groups`` that the backward of its graph, from its output ``y`` back to
    its boundaries (a ``UnitBackward``, or leaves), reads: a parameter an op saved by reference
    (``autograd.save_parameters_by_reference``: a linear layer's dx = g W, a LayerNorm's), or one
    of an op whose weights only anchor it (``defers_weights`` False: recomputation's
    ``Checkpoint``, which runs the unit again). A lookup reads none (an embedding keeps the ids and
    the table's shape), nor does W (dW = g^T x). The graph is the same on every rank (an MoE block
    runs every expert, on 0 rows too), so every rank gathers alike."""
    wanted, read, seen, todo = {id(p) for g in groups for p in g.params}, set(), set(), [y._node]
    while todo:
        node = todo.pop()
        if node is None or node.fn is UnitBackward or node in seen:
            continue
        seen.add(node)
        saved = {id(p) for _, p, _ in node.ctx.by_reference}
        for t in node.inputs:
            if t is not None and id(t) in wanted and (id(t) in saved or not node.fn.defers_weights):
                read.add(id(t))
            elif t is not None:
                todo.append(t._node)
    return tuple(g for g in groups if any(id(p) in read for p in g.params))
