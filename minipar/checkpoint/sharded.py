"""Sharded checkpoints: every rank writes its own pieces; one index describes them all; any layout
can load them.

A checkpoint is a directory ``iter_0000020/`` in the save directory:

    rank_00000.safetensors   the boxes rank 0 writes (``pieces.py`` says which ones are its)
    rank_00000.json          their list: tensor, box of the whole tensor, checksum
    ...
    index.json               written last: the model, layout, iteration, trainer state, every
                             tensor's whole shape and where each box of it is, every file's size

Saving is atomic at the level of the checkpoint. All ranks write into ``iter_0000020.partial/``;
after a barrier, rank 0 merges the ranks' lists into ``index.json``, checks that the boxes cover
every tensor exactly once, renames the directory to ``iter_0000020`` and points ``latest`` at it.
A crash at any moment leaves the previous checkpoint, and ``latest``, as they were.

Loading on any layout: every rank computes the boxes of the whole tensors its own pieces cover,
reads the saved boxes that intersect them (only those: a TP=4 rank does not read the other
ranks' quarters), verifies each one's checksum, and copies the intersections into place. Vocabulary
padding is no problem: it is in no saved box, and a new layout's padding is left at zero.
"""

import dataclasses
import hashlib
import json
import os
import shutil

import numpy
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from minipar.backend import to_numpy, xp
from minipar.checkpoint.boxes import intersect, region, volume
from minipar.checkpoint.pieces import pieces

FORMAT = "minipar-sharded-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message names the file and the problem."""


def _sha256(array):
    return hashlib.sha256(numpy.ascontiguousarray(array).tobytes()).hexdigest()


def _write_atomically(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory, iteration, model, optimizer, grid, trainer_state):
    """Write a checkpoint of iteration ``iteration`` into ``directory`` (a collective over the
    world). ``trainer_state``: JSON-able facts to resume with (seed, RNG, data position...)."""
    world = grid.world
    trainer_state = dict(trainer_state, optimizer_steps=optimizer.step_count)
    final = os.path.join(directory, f"iter_{iteration:07d}")
    partial = final + ".partial"
    if world.rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # what a crashed save left
        os.makedirs(partial)
    world.barrier()
    tensors, boxes, held = {}, [], set()
    for piece in pieces(model, optimizer, grid):
        held.add(f"{piece.kind}/{piece.name}")
        if not piece.write:
            continue
        for n, (start, stop, view) in enumerate(piece.global_boxes()):
            key = f"{piece.kind}/{piece.name}/{n}"
            tensors[key] = numpy.ascontiguousarray(to_numpy(view))
            boxes.append({"tensor": f"{piece.kind}/{piece.name}", "key": key, "start": start, "stop": stop,
                          "shape": piece.global_shape, "sha256": _sha256(tensors[key])})
    stem = os.path.join(partial, f"rank_{world.rank:05d}")
    listing = {"file": None, "bytes": 0, "boxes": boxes, "held": sorted(held)}
    if tensors:  # a replica that saves nothing writes no shard file
        save_file(tensors, stem + ".safetensors")
        with open(stem + ".safetensors", "rb+") as f:
            os.fsync(f.fileno())
        listing.update(file=os.path.basename(stem) + ".safetensors", bytes=os.path.getsize(stem + ".safetensors"))
    _write_atomically(stem + ".json", json.dumps(listing))
    world.barrier()
    if world.rank == 0:
        index = _merge(partial, world.size, iteration, model, grid, trainer_state)
        _write_atomically(os.path.join(partial, "index.json"), json.dumps(index, indent=1))
        _fsync_dir(partial)
        if os.path.exists(final):  # the same iteration saved again: replace it, never half of it
            shutil.rmtree(final + ".old", ignore_errors=True)
            os.replace(final, final + ".old")
        os.replace(partial, final)
        _fsync_dir(directory)  # the rename is on disk before `latest` names it
        shutil.rmtree(final + ".old", ignore_errors=True)
        _write_atomically(os.path.join(directory, "latest"), os.path.basename(final) + "\n")
        _fsync_dir(directory)
    world.barrier()
    return final


def _merge(partial, n_ranks, iteration, model, grid, trainer_state):
    files, tensors, held = {}, {}, set()
    for r in range(n_ranks):
        with open(os.path.join(partial, f"rank_{r:05d}.json")) as f:
            part = json.load(f)
        held.update(part["held"])
        if part["file"] is not None:
            files[part["file"]] = part["bytes"]
        for box in part["boxes"]:
            entry = tensors.setdefault(box["tensor"], {"shape": box["shape"], "boxes": []})
            entry["boxes"].append({"file": part["file"], **{k: box[k] for k in ("key", "start", "stop", "sha256")}})
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
            "dtype": str(model.parameters()[0].dtype),
            "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp},
            "trainer": trainer_state,
            "files": files, "tensors": tensors}


def find(path):
    """The checkpoint directory ``path`` names: an ``iter_*`` directory, or a save directory whose
    ``latest`` file names one. Raises CheckpointError saying what is missing."""
    if os.path.isfile(os.path.join(path, "index.json")):
        return path
    latest = os.path.join(path, "latest")
    if not os.path.isfile(latest):
        raise CheckpointError(f"{path}: no checkpoint here (no index.json, no 'latest' file); a save "
                              "that did not finish leaves only an *.partial directory")
    with open(latest) as f:
        target = os.path.join(path, f.read().strip())
    if not os.path.isdir(target) and os.path.isfile(os.path.join(target + ".old", "index.json")):
        target += ".old"  # a save of the same iteration again stopped between its two renames
    if not os.path.isfile(os.path.join(target, "index.json")):
        raise CheckpointError(f"{latest} names {target}, which has no index.json: the checkpoint is "
                              f"incomplete; pass an earlier iter_* directory of {path} to --load")
    return target


def read_index(path):
    """The index of the checkpoint at ``path``, after checking that every shard file it lists is
    there at its full size (cheap checks every rank can make before any communication)."""
    path = find(path)
    index_file = os.path.join(path, "index.json")
    try:
        with open(index_file) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index_file} is not readable JSON ({exc})") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{index_file} is not a {FORMAT} index")
    for name, size in index["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing: the checkpoint lacks one rank's shards")
        if os.path.getsize(file) != size:
            raise CheckpointError(f"{file} is truncated or damaged: {os.path.getsize(file)} bytes, "
                                  f"the index says {size}")
    index["path"] = path
    return index


def check_model(index, config, dtype):
    """Raise CheckpointError unless the checkpoint holds this model, listing every difference."""
    saved = index["model"]
    mine = dataclasses.asdict(config)
    diffs = [f"{k} {saved.get(k)} (flags: {mine[k]})" for k in mine if k != "dropout" and saved.get(k) != mine[k]]
    if index["dtype"] != str(numpy.dtype(dtype)):
        diffs.append(f"dtype {index['dtype']} (flags: {numpy.dtype(dtype)})")
    if diffs:
        raise CheckpointError(f"{index['path']} holds a different model: " + "; ".join(diffs))


class _Reader:
    """Saved boxes by tensor, read lazily, each verified against its checksum once."""

    def __init__(self, index):
        self.path, self.tensors, self.cache = index["path"], index["tensors"], {}

    def boxes(self, tensor):
        if tensor not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {tensor} in the index (a different model?)")
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
            if _sha256(array) != box["sha256"]:
                raise CheckpointError(f"{file} is damaged: {box['key']} does not match its checksum")
            self.cache[key] = array
        return self.cache[key]


def fill(piece_list, reader):
    """Copy every piece's values from the reader's boxes; raise if a part is not in any."""
    for piece in piece_list:
        tensor = f"{piece.kind}/{piece.name}"
        for start, stop, view in piece.global_boxes():
            covered = numpy.zeros(view.shape, bool)
            for box in reader.boxes(tensor):
                common = intersect(start, stop, box["start"], box["stop"])
                if common is None:
                    continue
                src = reader.read(box)[region(*common, box["start"])]
                dst = region(*common, start)
                view[dst] = xp.asarray(src, dtype=view.dtype)
                covered[dst] = True
            if not covered.all():
                raise CheckpointError(f"{reader.path}: part {start}..{stop} of {tensor} is in no saved box")


def load(path, model, optimizer, grid=None):
    """Load the checkpoint at ``path`` into this rank's model and optimizer, whatever layout wrote
    it. Returns the trainer state saved with it."""
    index = read_index(path)
    check_model(index, model.config, model.parameters()[0].dtype)
    fill(pieces(model, optimizer, grid), _Reader(index))
    optimizer.step_count = index["trainer"]["optimizer_steps"]
    return index["trainer"]
