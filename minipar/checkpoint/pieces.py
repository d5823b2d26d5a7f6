"""What a rank holds of the training state, as pieces of whole tensors.

The state is the parameters and AdamW's two moments ("exp_avg" m and "exp_avg_sq" v, PyTorch's
names) of every parameter of the single-device model, plus a step count. Where a rank keeps them
depends on the optimizer:

    AdamW (+ DataParallel)   each parameter's local (TP) array, and m, v of the same shape
    ZeroAdamW, stages 1-2    the parameters as above; m and v as flat pieces of this DP rank's shard
    Zero3                    parameters, m and v all as flat pieces

A ``Piece`` is one such array with what it takes to place it in the whole tensor (``boxes.py``):
its local shape, its TP placement and, for a flat piece, its range of the flattened local array.
``write`` says whether this rank is the one that saves it: every element of the whole state is
saved exactly once, by DP rank 0 for replicated state, TP rank 0 for a weight every TP rank holds
whole, and the first stage for the tied embedding (the last stage's copy is the same tensor).
Every rank loads all of its pieces.
"""

from dataclasses import dataclass

from minipar.checkpoint.boxes import Placement, flat_boxes, region, to_global, volume

KINDS = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class Piece:
    kind: str
    name: str
    array: object  # the rank's memory: the whole local array, or a flat view of the piece
    local_shape: tuple
    placement: Placement
    flat: tuple = None  # (a, b): the piece is this range of the flattened local array
    write: bool = True

    @property
    def global_shape(self):
        return self.placement.global_shape(self.local_shape)

    def views(self):
        """(local start, local stop, view) for boxes of the local array that cover the piece; each
        view is a writable window on ``array``."""
        if self.flat is None:
            return [((0,) * len(self.local_shape), tuple(self.local_shape), self.array)]
        out, offset = [], 0
        for start, stop in flat_boxes(self.local_shape, *self.flat):
            n = volume(start, stop)
            out.append((start, stop, self.array[offset : offset + n].reshape([e - s for s, e in zip(start, stop)])))
            offset += n
        return out

    def global_boxes(self):
        """(global start, global stop, view) of every part of the piece that is in the whole
        tensor (padding is not), the view being that part of the rank's memory."""
        out = []
        for ls, le, view in self.views():
            for gs, ge, sub_s, sub_e in to_global(self.placement, ls, le):
                out.append((gs, ge, view[region(sub_s, sub_e, ls)]))
        return out


def _writer(param, grid, replicated_over_dp):
    """Whether this rank saves its copy of ``param``'s state (see the module docstring)."""
    if getattr(param, "pipeline_copy", False):
        return False
    if grid is not None and grid.tp_rank != 0 and not hasattr(param, "partition"):
        return False
    return not (replicated_over_dp and grid is not None and grid.dp_rank != 0)


def pieces(model, optimizer, grid=None):
    """Every Piece of the training state this rank holds (``grid`` None: one device)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    groups = getattr(optimizer, "groups", None)
    if groups is None:  # plain AdamW: whole local arrays, replicated over DP
        for p, m, v in zip(optimizer.params, optimizer.m, optimizer.v):
            write = _writer(p, grid, replicated_over_dp=True)
            for kind, array in zip(KINDS, (p.data, m, v)):
                out.append(Piece(kind, names[id(p)], array, p.shape, Placement.of(p), write=write))
        return out
    zero3 = optimizer.stage == 3
    if not zero3:  # ZeRO 1-2 keep whole parameters on every DP rank
        for p in model.parameters():
            out.append(Piece("param", names[id(p)], p.data, p.shape, Placement.of(p),
                             write=_writer(p, grid, replicated_over_dp=True)))
    stores = (("param", optimizer.master),) if zero3 else ()
    stores += (("exp_avg", optimizer.moments[0]), ("exp_avg_sq", optimizer.moments[1]))
    for g in groups:
        for i, a, b, at in g.segments():
            p = g.params[i]
            shape = optimizer.shapes[id(p)] if zero3 else p.shape
            start = g.shard.start + at
            for kind, store in stores:
                out.append(Piece(kind, names[id(p)], store[start : start + b - a], shape, Placement.of(p),
                                 flat=(a - g.offsets[i], b - g.offsets[i]),
                                 write=_writer(p, grid, replicated_over_dp=False)))
    return out


def step_count(optimizer):
    """AdamW's step count t (bias correction), wherever the optimizer keeps it."""
    return getattr(optimizer, "optimizer", optimizer).step_count


def set_step_count(optimizer, t):
    getattr(optimizer, "optimizer", optimizer).step_count = int(t)
