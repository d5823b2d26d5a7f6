"""Sharded checkpoints: every rank writes its own pieces; one index describes them all; any layout
can load them.

A checkpoint is a directory ``iter_0000020/`` in the save directory:

    rank_00000.safetensors   the boxes rank 0 writes (``pieces.py`` says which ones are its)
    rank_00000.json          their list: tensor, box of the whole tensor, dtype, checksum
    ...
    index.json               written last: the model, layout, iteration, trainer state, every
                             tensor's whole shape and where each box of it is, every file's size,
                             and its own checksum

Saving is atomic at the level of the checkpoint. All ranks write into ``iter_0000020.partial/``;
once all have (an all-reduce of who failed), rank 0 merges the ranks' lists into ``index.json``,
checks that the boxes cover every tensor exactly once, renames the directory to ``iter_0000020``
and points ``latest`` at it. A crash at any moment leaves the previous checkpoint, and ``latest``,
as they were. Every file is written whole or not at all, never through a planted link
(``files.py``). A save that cannot write (the disk is full) raises CheckpointError on every rank,
after every rank has finished its own writing: the lowest rank that failed says that this
checkpoint was not saved, why, and that the previous one and ``latest`` are unchanged; the others
say only that it was not saved (``CheckpointError.speaks``). Nothing of it is left behind.

Loading on any layout: every rank computes the boxes of the whole tensors its own pieces cover,
reads the saved boxes that intersect them (only those: a TP=4 rank does not read the other
ranks' quarters), checks each one's dtype and shape against the index and its checksum (over its
key, dtype, shape and bytes), and copies the intersections into place. Vocabulary padding is no
problem: it is in no saved box, and a new layout's padding is left at zero. Nothing read from the
checkpoint is trusted before ``index.py`` has checked it.

Housekeeping of the save directory (``retention.py``, re-exported here): ``remove_stale_partials
(directory)`` removes what crashed saves left; ``prune(directory, keep)`` keeps the newest ``keep``
checkpoints and the one ``latest`` names.
"""

import dataclasses
import errno
import hashlib
import json
import os

import numpy
from safetensors import SafetensorError, safe_open

from minipar.backend import to_numpy, xp
from minipar.checkpoint.boxes import intersect, region, volume
from minipar.checkpoint.files import fsync_dir, remove, write_file
from minipar.checkpoint.index import FORMAT, CheckpointError, find, read_index, seal
from minipar.checkpoint.pieces import pieces, weights_dtype
from minipar.checkpoint.retention import prune, remove_stale_partials
from minipar.checkpoint.tensor_file import as_stored, tensor_file
from minipar.dtypes import as_dtype
from minipar.parallel.protocol import STASHED

__all__ = ["FORMAT", "CheckpointError", "check_model", "fill", "find", "load", "prune", "read_index",
           "remove_stale_partials", "save", "agree_on_failure"]


def _checksum(key, dtype, shape, array):
    """SHA-256 of a box: its name, dtype and shape as well as its bytes, so that a header edited to
    another dtype or shape of the same size does not pass."""
    h = hashlib.sha256(f"{key}:{as_dtype(dtype).name}:{list(shape)}".encode())  # as_dtype: "bfloat16" too
    h.update(numpy.ascontiguousarray(array).reshape(-1).view(numpy.uint8))  # in place: tobytes() copied the box
    return h.hexdigest()


def save(directory, iteration, model, optimizer, grid, trainer_state):
    """Write a checkpoint of iteration ``iteration`` into ``directory`` (a collective over the
    world). ``trainer_state``: JSON-able facts to resume with (seed, RNG, data position...).
    Raises CheckpointError on every rank if any rank cannot write (see the module's docstring)."""
    world = grid.world
    trainer_state = dict(trainer_state, optimizer_steps=optimizer.step_count)
    final = os.path.join(directory, f"iter_{iteration:07d}")
    partial = final + ".partial"
    failed = None
    if world.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            remove(partial)  # what a crashed save of this same iteration left
            os.makedirs(partial)
        except OSError as exc:
            failed = exc
    _agree(world, failed, directory, final)
    stem = os.path.join(partial, f"rank_{world.rank:05d}")
    try:
        _write_mine(stem, model, optimizer, grid)
    except OSError as exc:
        remove(stem + ".safetensors")
        remove(stem + ".json")
        failed = exc
    _agree(world, failed, directory, final, partial)
    if world.rank == 0:
        try:
            index = _merge(partial, world.size, iteration, model, grid, trainer_state, weights_dtype(model, optimizer))
            _publish(directory, partial, final, index)
        except OSError as exc:
            remove(partial)  # every rank has finished writing into it
            failed = exc
    _agree(world, failed, directory, final)
    return final


def first_failure(world, failed):
    """(the lowest rank whose ``failed`` is not None, how many such ranks), or None: one
    all-reduce that every rank reaches, whether or not its own part failed."""
    votes = numpy.zeros(world.size, numpy.int64)  # a host array: MPI moves it on any device
    votes[world.rank] = failed is not None
    if world.size > 1:
        votes = world.all_reduce(votes)
    return (int(numpy.argmax(votes)), int(votes.sum())) if votes.any() else None


def agree_on_failure(world, failed, what):
    """Raise on every rank if any rank's ``failed`` (a CheckpointError, or None) is one: the lowest
    such rank's own, which speaks, the others' saying only where to look (``CheckpointError.speaks``),
    so that a damage every rank reads is one line, not one per rank. ``what``: what failed."""
    found = first_failure(world, failed)
    if found is None:
        return
    first = found[0]
    error = failed if world.rank == first else CheckpointError(f"{what} (rank {first} says why)")
    error.speaks = world.rank == first
    raise error


def _agree(world, failed, directory, final, partial=None):
    """Every rank learns whether any rank's step failed (``failed``: its OSError, or None), and if
    one did, every rank raises: the lowest failing rank says why, the others say only that it did
    (``CheckpointError.speaks``), so a disk that is full for all of them prints one line, not one
    per rank, and no rank is left waiting for one that gave up. ``partial``: every rank has
    finished writing into it, so after a failure rank 0 removes it and nothing is left behind."""
    found = first_failure(world, failed)
    if found is None:
        return
    first, count = found
    if partial is not None and world.rank == 0:
        remove(partial)
    if world.rank == first:
        error = _not_saved(directory, final, failed, others=count - 1)
    else:
        error = CheckpointError(f"checkpoint {os.path.basename(final)} was not saved (rank {first} says why)")
    error.speaks = world.rank == first
    raise error


def _write_mine(stem, model, optimizer, grid):
    """This rank's shard file (if it writes any box) and its list of boxes."""
    tensors, boxes, held = {}, [], set()
    for piece in pieces(model, optimizer, grid):
        held.add(f"{piece.kind}/{piece.name}")
        if not piece.write:
            continue
        for n, (start, stop, view) in enumerate(piece.global_boxes()):
            key = f"{piece.kind}/{piece.name}/{n}"
            array = tensors[key] = as_stored(to_numpy(view))  # the bytes the checksum covers
            boxes.append({"tensor": f"{piece.kind}/{piece.name}", "key": key, "start": start, "stop": stop,
                          "shape": piece.global_shape, "dtype": array.dtype.name,
                          "sha256": _checksum(key, array.dtype, array.shape, array)})
    listing = {"file": None, "bytes": 0, "boxes": boxes, "held": sorted(held)}
    if tensors:  # a replica that saves nothing writes no shard file
        written = write_file(stem + ".safetensors", tensor_file(tensors))
        listing.update(file=os.path.basename(stem) + ".safetensors", bytes=written)
    write_file(stem + ".json", json.dumps(listing).encode())


def _publish(directory, partial, final, index):
    """Rank 0: the index into the finished directory, the directory into place, then ``latest``."""
    write_file(os.path.join(partial, "index.json"), json.dumps(seal(index), indent=1).encode())
    fsync_dir(partial)
    if os.path.lexists(final):  # the same iteration saved again: replace it, never half of it
        remove(final + ".old")
        os.replace(final, final + ".old")
    os.replace(partial, final)
    fsync_dir(directory)  # the rename is on disk before `latest` names it
    try:
        write_file(os.path.join(directory, "latest"), (os.path.basename(final) + "\n").encode())
    except OSError:
        _put_back(final, partial)  # so that "not saved, the previous one unchanged" is true
        raise
    fsync_dir(directory)
    remove(final + ".old")  # only now: until `latest` is written, it may be the one to go back to


def _put_back(final, partial):
    try:
        os.replace(final, partial)
        if os.path.lexists(final + ".old"):
            os.replace(final + ".old", final)
    except OSError:
        pass  # find() still recovers iter_N.old, and the next start removes iter_N.partial


def _not_saved(directory, final, exc, others=0):
    where = f" ({exc.filename})" if exc.filename else ""
    if others:
        where += f" (and {others} more rank{'s' * (others > 1)} could not write theirs)"
    latest = os.path.join(directory, "latest")
    fix = ("free space there" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else
           "make it writable" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "fix that")
    if os.path.lexists(latest):
        kept = (f"the previous checkpoint and {latest} are unchanged: {fix} (or save to another directory) "
                "and resume from the previous checkpoint")
    else:
        kept = f"no earlier checkpoint was saved there: {fix} (or save to another directory) and start again"
    return CheckpointError(f"checkpoint {os.path.basename(final)} was not saved: {exc.strerror or exc}{where}; {kept}")


def _merge(partial, n_ranks, iteration, model, grid, trainer_state, dtype):
    files, tensors, held = {}, {}, set()
    for r in range(n_ranks):
        with open(os.path.join(partial, f"rank_{r:05d}.json")) as f:
            part = json.load(f)
        held.update(part["held"])
        if part["file"] is not None:
            files[part["file"]] = part["bytes"]
        for box in part["boxes"]:
            entry = tensors.setdefault(box["tensor"], {"shape": box["shape"], "boxes": []})
            kept = {k: box[k] for k in ("key", "dtype", "start", "stop", "sha256")}
            entry["boxes"].append({"file": part["file"], **kept})
    # Each element saved exactly once, or the writer rules are wrong: the boxes must not overlap
    # and must add up to the whole tensor; and every tensor some rank holds must be saved.
    if held != set(tensors):
        raise RuntimeError(f"checkpoint: no rank writes {sorted(held - set(tensors))[:3]}")
    for name, entry in tensors.items():
        boxes = [(tuple(b["start"]), tuple(b["stop"])) for b in entry["boxes"]]
        overlap = any(intersect(*boxes[i], *boxes[j]) for i in range(len(boxes)) for j in range(i))
        covered = sum(volume(*box) for box in boxes)
        if overlap or covered != numpy.prod(entry["shape"]):
            raise RuntimeError(f"checkpoint boxes of {name} overlap or cover {covered} of "
                               f"{numpy.prod(entry['shape'])} elements")
    layout = grid.layout
    return {"format": FORMAT, "iteration": iteration, "model": dataclasses.asdict(model.config),
            "dtype": numpy.dtype(dtype).name,  # "float32" of a big-endian array too (str: ">f4")
            "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp},
            "trainer": trainer_state,
            "files": files, "tensors": tensors}


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
        raise CheckpointError(f"{index['path']} holds a different model: " + "; ".join(diffs))


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
            elif _checksum(box["key"], box["dtype"], shape, array) != box["sha256"]:
                problem = "it does not match its checksum"
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
