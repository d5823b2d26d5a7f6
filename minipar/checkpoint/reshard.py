"""A sharded checkpoint read back onto any layout.

Every rank computes the boxes of the whole tensors its own pieces cover (``pieces.py``), reads the
saved boxes that intersect them (only those: a TP=4 rank does not read the other ranks' quarters),
checks each one's dtype and shape against the index and its checksum (over its key, dtype, shape
and bytes), and copies the intersections into place. Vocabulary padding is no problem: it is in no
saved box, and a new layout's padding is left at zero. Nothing read from the checkpoint is trusted
before ``index.py`` has checked it. ``sharded.py`` writes what this reads.
"""

import dataclasses
import hashlib
import os

import numpy
from safetensors import SafetensorError, safe_open

from minipar.backend import xp
from minipar.checkpoint.boxes import intersect, region
from minipar.checkpoint.failures import agree_on_failure
from minipar.checkpoint.index import CheckpointError, read_index
from minipar.checkpoint.pieces import pieces, weights_dtype
from minipar.dtypes import as_dtype
from minipar.parallel.protocol import STASHED


def box_checksum(key, dtype, shape, array):
    """SHA-256 of a box: its name, dtype and shape as well as its bytes, so that a header edited to
    another dtype or shape of the same size does not pass."""
    h = hashlib.sha256(f"{key}:{as_dtype(dtype).name}:{list(shape)}".encode())  # as_dtype: "bfloat16" too
    h.update(numpy.ascontiguousarray(array).reshape(-1).view(numpy.uint8))  # in place: tobytes() copied the box
    return h.hexdigest()


def check_model(index, config, dtype, chosen_by=None):
    """Raise CheckpointError unless the checkpoint holds this model, listing every difference.
    ``chosen_by``: the flags that made ``dtype`` the weights' (said where the dtypes differ)."""
    saved = index["model"]
    mine = dataclasses.asdict(config)
    # a field a checkpoint predates has its default (a checkpoint from before experts is dense);
    # dropout, capacity and the auxiliary losses' weights change the training, not the weights
    default = {f.name: f.default for f in dataclasses.fields(config)}
    free = ("dropout", "moe_expert_capacity_factor", "moe_aux_loss_coeff", "moe_z_loss_coeff")
    diffs = [f"{k} {saved.get(k, default[k])} (flags: {mine[k]})" for k in mine
             if k not in free and saved.get(k, default[k]) != mine[k]]
    if index["dtype"] != numpy.dtype(dtype).name:
        diffs.append(f"dtype {index['dtype']} (flags: {numpy.dtype(dtype).name}{f', {chosen_by}' if chosen_by else ''})")
    if diffs:
        raise CheckpointError(f"{index['path']} holds a different model: " + "; ".join(diffs) +
                              ": give the model flags it was trained with, or load a checkpoint of this model")


class _Reader:
    """Saved boxes by tensor, read lazily, each verified once against the index (dtype, shape)
    and its checksum. Only the boxes of the tensor being filled are kept (a piece's views may cross
    one box several times): kept to the end, they were a second copy of the rank's state."""

    def __init__(self, index):
        self.path, self.tensors, self.cache, self.current = index["path"], index["tensors"], {}, None

    def boxes(self, tensor, shape):
        """The saved boxes of ``tensor``, whose whole shape must be ``shape``, the model's (another
        one's boxes were copied in part, or broadcast)."""
        if tensor not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {tensor} in the index (a different model?)")
        if tensor != self.current:
            self.cache, self.current = {}, tensor
        saved = self.tensors[tensor]["shape"]
        if saved != list(shape):
            raise CheckpointError(f"{self.path}: {tensor} is {saved} in the index, but this model's is "
                                  f"{list(shape)}: load a checkpoint of this model")
        return self.tensors[tensor]["boxes"]

    def read(self, box):
        key = (box["file"], box["key"])
        if key not in self.cache:
            file = os.path.join(self.path, box["file"])
            try:
                with safe_open(file, framework="numpy") as f:
                    array = f.get_tensor(box["key"])
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{file} is damaged: cannot read {box['key']} ({exc})") from exc
            shape = tuple(b - a for a, b in zip(box["start"], box["stop"]))
            problem = None
            if array.dtype.name != box["dtype"]:
                problem = f"its dtype is {array.dtype}, the index says {box['dtype']}"
            elif array.shape != shape:
                problem = f"its shape is {array.shape}, its box in the index is {shape}"
            elif box_checksum(box["key"], box["dtype"], shape, array) != box["sha256"]:
                problem = "it does not match its checksum"
            elif not numpy.isfinite(array).all():  # the step would be nan, and "diverged" the wrong advice
                problem = "it holds NaN or infinite values (the run that saved it had diverged, or it was edited)"
            elif box["key"].startswith("exp_avg_sq/") and (array < 0).any():  # Adam's sqrt(v) would be nan
                problem = "it holds negative second moments, which Adam's squares never make"
            if problem:
                raise CheckpointError(f"{file} is damaged: {box['key']}: {problem}; load an earlier checkpoint")
            self.cache[key] = array
        return self.cache[key]


def fill(piece_list, reader):
    """Copy every piece's values from the reader's boxes; raise if a part is not in any."""
    for piece in piece_list:
        tensor = f"{piece.kind}/{piece.name}"
        for start, stop, view in piece.global_boxes():
            covered = numpy.zeros(view.shape, bool)
            for box in reader.boxes(tensor, piece.global_shape):
                common = intersect(start, stop, box["start"], box["stop"])
                if common is None:
                    continue
                src = reader.read(box)[region(*common, box["start"])]
                dst = region(*common, start)
                view[dst] = xp.asarray(src, dtype=view.dtype)
                covered[dst] = True
            if not covered.all():
                raise CheckpointError(f"{reader.path}: part {start}..{stop} of {tensor} is in no saved box")


def _fill_agreed(piece_list, reader, grid, path):
    failed = None
    try:
        fill(piece_list, reader)
    except CheckpointError as exc:
        if grid is None:
            raise
        failed = exc
    if grid is not None:
        agree_on_failure(grid.world, failed, f"the checkpoint {path} was not loaded")


def load(path, model, optimizer, grid=None):
    """Load the checkpoint at ``path`` into this rank's model and optimizer, whatever layout wrote
    it. Returns the trainer state saved with it. Each rank reads its own pieces, so a damage one
    rank finds, others may not: with a ``grid`` every rank's reads end in one vote
    (``agree_on_failure``) before anything communicates again (ZeRO's masters_to_model gathers)."""
    index = read_index(path)
    check_model(index, model.config, weights_dtype(model, optimizer))
    every, reader = pieces(model, optimizer, grid), _Reader(index)
    _fill_agreed([p for p in every if p.kind != STASHED], reader, grid, path)
    optimizer.masters_to_model()  # mixed precision: the 16-bit weights are the loaded masters' rounding
    # PipeDream-2BW's older version: the saved one, after masters_to_model set it to the weights,
    # which is where a stream starts from a checkpoint of a flushed schedule, which has none
    if any(name.startswith(STASHED + "/") for name in index["tensors"]):
        _fill_agreed([p for p in every if p.kind == STASHED], reader, grid, path)
    optimizer.step_count = index["trainer"]["optimizer_steps"]
    return index["trainer"]
