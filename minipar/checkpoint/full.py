"""The whole single-device weights from any layout, and back: for ``--export-weights``,
``--init-weights`` and sampling after a pipelined run.

``gather_full_state`` sends every rank's parameter boxes (the ones it would save, so each element
once) to world rank 0, which puts them in place; ``load_full_state`` fills every rank's parameters
from whole arrays, as ``sharded.load`` fills them from saved boxes.
"""

import json

import numpy

from minipar.backend import to_numpy
from minipar.checkpoint.boxes import region
from minipar.checkpoint.pieces import pieces
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
    world = grid.world if grid is not None else None
    dtype = model.parameters()[0].dtype
    if world is not None and world.rank != 0:
        header = json.dumps([(name, start, stop, list(shapes[name])) for name, start, stop, _ in boxes]).encode()
        data = numpy.concatenate([b.ravel() for *_, b in boxes]) if boxes else numpy.zeros(0, dtype)
        world.send(numpy.array([len(header), data.size], numpy.int64), 0, _TAG)
        world.send(numpy.frombuffer(header, numpy.uint8).copy(), 0, _TAG + 1)
        world.send(numpy.ascontiguousarray(data, dtype), 0, _TAG + 2)
        return None
    full = {name: numpy.zeros(shape, dtype) for name, shape in shapes.items()}
    parts = [(name, start, stop, data) for name, start, stop, data in boxes]
    for r in range(1, world.size if world is not None else 1):
        sizes = world.recv(numpy.zeros(2, numpy.int64), r, _TAG)
        header = json.loads(world.recv(numpy.zeros(int(sizes[0]), numpy.uint8), r, _TAG + 1).tobytes())
        data = world.recv(numpy.zeros(int(sizes[1]), dtype), r, _TAG + 2)
        offset = 0
        for name, start, stop, shape in header:
            n = int(numpy.prod([b - a for a, b in zip(start, stop)]))
            full.setdefault(name, numpy.zeros(shape, dtype))
            parts.append((name, start, stop, data[offset : offset + n].reshape([b - a for a, b in zip(start, stop)])))
            offset += n
    for name, start, stop, data in parts:
        full[name][region(start, stop)] = data
    return full


class _Whole:
    """A reader over whole arrays in memory: one box per tensor, the whole of it."""

    path = "the weights"

    def __init__(self, state):
        self.state = state

    def boxes(self, tensor):
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
