"""A result computed on one rank alone and sent to every rank: the lessons' single-device run.

Every rank needs the single-device run to compare what it holds against. Run on every rank, it
costs N times the work, and on a laptop where 8 ranks share 2 cores that is 4 times the wall time
of running it once. So one rank runs it while the others wait, and then broadcasts it.

The result is a tree of dicts (string keys), lists, numbers, strings and arrays. It travels as two
buffers: a JSON outline in which each array is a placeholder {"__array__": [offset, shape,
dtype, device]}, and one payload of every array's bytes. Arrays come back on the device they left (a
GPU's go through host memory: the payload is bytes, and a host array crosses NCCL's
communicator through MPI). Nothing is pickled.
"""

import json

import numpy as np

from minipar.backend import to_numpy, xp
from minipar.dtypes import as_dtype

ARRAY = "__array__"  # the placeholder's one key


def computed_once(comm, compute, root=0):
    """``compute()`` on rank ``root``, the tree it returns on every rank of ``comm`` (a collective).
    Every rank, the root too and a world of one, gets the tree rebuilt from the outline: the same
    types everywhere (tuples become lists, NumPy scalars Python numbers), and what cannot travel
    fails on one rank as it would on eight."""
    if comm.rank == root:
        chunks = []
        outline = np.frombuffer(json.dumps(_outline(compute(), chunks)).encode(), np.uint8).copy()
        payload = np.concatenate([np.zeros(0, np.uint8)] + chunks)
        if comm.size > 1:
            comm.broadcast(np.array([outline.size, payload.size], np.int64), root)
    else:
        sizes = comm.broadcast(np.zeros(2, np.int64), root)
        outline, payload = np.empty(int(sizes[0]), np.uint8), np.empty(int(sizes[1]), np.uint8)
    if comm.size > 1:
        comm.broadcast(outline, root)
        comm.broadcast(payload, root)
    return _rebuilt(json.loads(outline.tobytes()), payload)


def _outline(value, chunks):
    """``value`` with each array replaced by its placeholder; its bytes appended to ``chunks``."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"computed_once sends dicts with string keys, got keys {list(value)[:3]}")
        return {k: _outline(v, chunks) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_outline(v, chunks) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "__array_interface__") or hasattr(value, "__cuda_array_interface__"):
        host = np.asarray(to_numpy(value), order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        start = sum(chunk.size for chunk in chunks)
        chunks.append(host.reshape(-1).view(np.uint8))
        return {ARRAY: [start, list(host.shape), host.dtype.name, not isinstance(value, np.ndarray)]}
    raise TypeError(f"computed_once cannot send a {type(value).__name__}")


def _rebuilt(outline, payload):
    """The tree ``_outline`` described, each array a copy of its bytes in ``payload``."""
    if isinstance(outline, list):
        return [_rebuilt(v, payload) for v in outline]
    if isinstance(outline, dict) and set(outline) == {ARRAY}:
        start, shape, dtype, on_device = outline[ARRAY]
        dtype = as_dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        host = payload[start: start + count * dtype.itemsize].view(dtype).reshape(shape).copy()  # aligned, its own
        return xp.asarray(host) if on_device else host
    if isinstance(outline, dict):
        return {k: _rebuilt(v, payload) for k, v in outline.items()}
    return outline
