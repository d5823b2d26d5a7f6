"""What a rank holds of the training state, as pieces of whole tensors.

The state is the parameters and AdamW's two moments ("exp_avg" m and "exp_avg_sq" v, PyTorch's
names) of every parameter of the single-device model, plus a step count. Where a rank keeps them
depends on the optimizer, which lists them (``state_arrays()``, part of the step protocol):

    DataParallelAdamW        each parameter's local (TP) array, and m, v of the same shape
    ZeRO1, ZeRO2             the parameters as above; m and v as flat pieces of this DP rank's shard
    ZeRO3                    parameters, m and v all as flat pieces
    WeightStash              PipeDream-2BW's stage-0 arrays, and the stashed older version of each
                             parameter ("stashed_param", placed as the parameter)

A ``Piece`` is one such array with what it takes to place it in the whole tensor (``boxes.py``):
its local shape, the parameter's split and which part of it this rank holds, and, for a flat
piece, its range of the flattened local array. ``write`` says whether this rank is the one that
saves it: every element of the whole state is saved exactly once, by the primary copy
(``placement.is_primary``: DP rank 0 for state every replica holds, TP rank 0 for a weight every
TP rank holds whole, the first stage for the tied embedding, the first rank holding the same
experts for an expert's weights). ZeRO's flat pieces differ across the DP group (an expert's
across its edp group), so there no DP rank holds a copy of another's. Every rank loads all of its
pieces. An expert is saved under its global name (``experts.<e>...``), whole, whatever EP holds
it, so a checkpoint loads onto any EP size.
"""

from dataclasses import dataclass

from minipar.checkpoint.boxes import flat_boxes, region, to_global, volume
from minipar.placement import Split, is_primary


@dataclass
class Piece:
    kind: str
    name: str
    array: object  # the rank's memory: the whole local array, or a flat view of the piece
    local_shape: tuple
    split: Split = None  # how the local array is cut from the whole tensor (None: it is the whole)
    part: tuple = (0, 1)  # (index, n): this rank holds part index of n of the split
    flat: tuple = None  # (a, b): the piece is this range of the flattened local array
    write: bool = True

    @property
    def global_shape(self):
        return self.split.whole_shape(self.local_shape) if self.split is not None else tuple(self.local_shape)

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
            for gs, ge, sub_s, sub_e in to_global(self.split, *self.part, ls, le):
                out.append((gs, ge, view[region(sub_s, sub_e, ls)]))
        return out


def _cut(param, grid):
    """(split, (index, n)) of ``param`` on this rank: the group names resolved by the grid."""
    split = param.placement.split
    if split is None:
        return None, (0, 1)
    if grid is None:
        raise ValueError(f"a parameter split over '{split.group}' needs the grid to place its part: "
                         "pass grid=")
    comm = grid.group(split.group)
    return split, (comm.rank, comm.size)


def pieces(model, optimizer, grid=None):
    """Every Piece of the training state this rank holds (``grid`` None: one device), from the
    optimizer's ``state_arrays()`` (the step protocol, ``parallel/protocol.py``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    whole = grid.ranks() if grid is not None else {}  # copies over every group, DP included
    # ZeRO's pieces: a different one on every DP x CP rank (an expert's, on every rank of its edp group)
    flat = dict(whole, dp=0, cp=0, edp=0)
    return [Piece(kind, names[id(p)], array, shape, *_cut(p, grid), flat=part,
                  write=is_primary(p.placement, whole if part is None else flat))
            for kind, p, array, shape, part in optimizer.state_arrays()]


def weights_dtype(model, optimizer):
    """The dtype of the weights a checkpoint keeps (its "param" pieces): the fp32 master weights
    of a mixed-precision run (so that a bf16 or fp16 checkpoint starts a float32 run, and back),
    else the model's."""
    return optimizer.policy.main if optimizer.policy is not None else model.parameters()[0].dtype
