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

Loading on any layout (``reshard.py``, re-exported here as ``load``): every rank reads only the
saved boxes its own pieces intersect, each checked against the index and its checksum.

Housekeeping of the save directory (``retention.py``, re-exported here): ``remove_stale_partials
(directory)`` removes what crashed saves left; ``prune(directory, keep)`` keeps the newest ``keep``
checkpoints and the one ``latest`` names.
"""

import dataclasses
import errno
import json
import os

import numpy

from minipar.backend import to_numpy
from minipar.checkpoint.boxes import intersect, volume
from minipar.checkpoint.failures import agree_on_failure, first_failure
from minipar.checkpoint.files import fsync_dir, remove, write_file
from minipar.checkpoint.index import FORMAT, CheckpointError, find, read_index, seal
from minipar.checkpoint.pieces import pieces, weights_dtype
from minipar.checkpoint.reshard import box_checksum, check_model, fill, load
from minipar.checkpoint.retention import prune, remove_stale_partials
from minipar.checkpoint.tensor_file import as_stored, tensor_file

__all__ = ["FORMAT", "CheckpointError", "check_model", "fill", "find", "load", "prune", "read_index",
           "remove_stale_partials", "save", "agree_on_failure"]


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
                          "sha256": box_checksum(key, array.dtype, array.shape, array)})
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
