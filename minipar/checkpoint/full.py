"""The whole single-device weights from any layout, and back: for ``--export-weights``,
``--init-weights`` and sampling after a pipelined run.

``gather_full_state`` sends every rank's parameter boxes (the ones it would save, so each element
once) to world rank 0, which puts them in place; ``load_full_state`` fills every rank's parameters
from whole arrays, as ``reshard.load`` fills them from saved boxes.
"""

import json

import numpy

from minipar.backend import to_numpy
from minipar.checkpoint.boxes import region
from minipar.checkpoint.pieces import pieces, weights_dtype
from minipar.checkpoint.sharded import fill

_TAG = 7001


def _my_boxes(model, optimizer, grid):
    shapes, boxes = {}, []
    for piece in pieces(model, optimizer, grid):
        if piece.kind == "param":
            shapes[piece.name] = piece.global_shape
            if piece.write:
                boxes += [(piece.name, start, stop, to_numpy(view)) for start, stop, view in piece.global_boxes()]
    return shapes, boxes


def gather_full_state(model, optimizer, grid=None):
    """{name: whole array} on world rank 0 (None on the others); a collective over the world."""
    shapes, boxes = _my_boxes(model, optimizer, grid)
    dtype = weights_dtype(model, optimizer)  # a mixed-precision run's fp32 masters
    header = json.dumps([(name, start, stop, list(shapes[name])) for name, start, stop, _ in boxes]).encode()
    data = numpy.concatenate([b.ravel() for *_, b in boxes]) if boxes else numpy.zeros(0, dtype)
    if grid is None:
        headers, datas = [header], [data]
    else:  # each rank's list of boxes (JSON), then their values in that order
        headers = grid.world.gather_to_root(numpy.frombuffer(header, numpy.uint8), _TAG)
        datas = grid.world.gather_to_root(numpy.asarray(data, dtype), _TAG + 2)
        if headers is None:
            return None
    full = {}
    for header, data in zip(headers, datas):
        offset = 0
        for name, start, stop, shape in json.loads(bytes(header)):
            box = [b - a for a, b in zip(start, stop)]
            n = int(numpy.prod(box))
            full.setdefault(name, numpy.zeros(shape, dtype))[region(start, stop)] = data[offset : offset + n].reshape(box)
            offset += n
    return full


class _Whole:
    """A reader over whole arrays in memory: one box per tensor, the whole of it."""

    path = "the weights"

    def __init__(self, state):
        self.state = state

    def boxes(self, tensor, shape):  # the shapes were checked first (load_full_state)
        name = tensor.split("/", 1)[1]
        if name not in self.state:
            raise ValueError(f"the weights have no {name}")
        shape = self.state[name].shape
        return [{"start": (0,) * len(shape), "stop": tuple(shape), "name": name}]

    def read(self, box):
        return self.state[box["name"]]


def load_full_state(model, optimizer, state, grid=None):
    """Set every rank's parameters from the single-device ``state`` ({name: whole array}), whatever
    the layout; the optimizer's moments are left as they are."""
    expected = {}
    for piece in pieces(model, optimizer, grid):
        if piece.kind == "param":
            expected[piece.name] = piece.global_shape
    problems = [f"{n}: shape {tuple(state[n].shape)}, model has {s}" for n, s in expected.items()
                if n in state and tuple(state[n].shape) != tuple(s)]
    problems += [f"missing: {n}" for n in expected if n not in state]
    if problems:
        raise ValueError("the weights do not fit the model:\n  " + "\n  ".join(problems))
    fill([p for p in pieces(model, optimizer, grid) if p.kind == "param"], _Whole(state))
    optimizer.masters_to_model()  # mixed precision: the pieces filled were the fp32 masters
