"""What a checkpoint on disk says, checked before it is believed.

A checkpoint comes from disk, and a disk holds what anyone put there. Before any rank reads a shard
or sends a message, ``read_index`` checks every name and field the checkpoint gives:

* ``latest`` holds exactly one plain name ``iter_NNNNNNN``, a real directory (not a symbolic link)
  inside the save directory: never ``..``, an absolute path, or a link leading elsewhere;
* the index's shard files are plain names ``rank_NNNNN.safetensors``, regular files (not links)
  inside the checkpoint directory, at the sizes the index records;
* the index matches its own checksum (``seal``: the SHA-256 of its other fields), so a flipped
  digit in an iteration or a step count is caught as the shards' flipped bits are;
* every field of the index has its type and range (``validate``), so a damaged field is one
  CheckpointError naming the field and the file, never a KeyError or TypeError further on.

A checksum finds damage, not an edit made on purpose (whoever edits a field can seal it again):
the field checks and the shards' own checksums are what stop such an index from reaching memory
it should not.
"""

import hashlib
import json
import math
import os
import re

from minipar.checkpoint.files import is_plain
from minipar.checkpoint.tensor_file import DTYPE_NAMES
from minipar.dtypes import FLOAT_DTYPES, as_dtype

FORMAT = "minipar-sharded-checkpoint-3"  # 3: the index is sealed by its own checksum; 2: a box's
# checksum covers its key, dtype and shape too
ITER_NAME = re.compile(r"iter_[0-9]{7,}")
SHARD_NAME = re.compile(r"rank_[0-9]{5,}\.safetensors")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DAMAGED = "the index is damaged: load an earlier checkpoint"
_MISSING = object()


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message names the file and the problem.

    ``speaks``: None where one rank alone found the problem (its caller must end the other ranks);
    True or False where every rank raised it together (a failed save), True on the one rank whose
    message says why."""

    speaks = None


def is_sha256(value):
    """Whether ``value`` is a SHA-256 as a checkpoint writes one: 64 lowercase hexadecimal digits."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def seal(index):
    """``index`` with its checksum, ``sha256``: the SHA-256 of its other fields written as canonical
    JSON (sorted keys, no spaces), which reads back the same from the indented file."""
    fields = {key: value for key, value in index.items() if key != "sha256"}
    # through JSON once first, so that the checksum sorts what a reader will hold (keys as text)
    text = json.dumps(json.loads(json.dumps(fields)), sort_keys=True, separators=(",", ":"))
    return dict(fields, sha256=hashlib.sha256(text.encode()).hexdigest())


def find(path):
    """The checkpoint directory ``path`` names: an ``iter_*`` directory, or a save directory whose
    ``latest`` file names one. Raises CheckpointError saying what is missing."""
    index = os.path.join(path, "index.json")
    if os.path.isfile(index):
        return path  # a directory the user named: trusted as given
    if os.path.lexists(index):  # a folder or a FIFO by that name: no save leaves one
        raise CheckpointError(f"{index} is not a regular file: the checkpoint is damaged; load an earlier one")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory" if not os.path.lexists(path) else
                              f"{path}: not a directory; give a save directory or one of its iter_* checkpoints")
    latest = os.path.join(path, "latest")
    if not os.path.lexists(latest):
        raise CheckpointError(f"{path}: no checkpoint here (no index.json, no 'latest' file); a save "
                              "that did not finish leaves only an *.partial directory")
    text = None
    if is_plain(latest, "file"):  # a link or a FIFO is not opened at all
        try:
            with open(latest, "rb") as f:
                text = f.read(4096).decode("ascii").rstrip("\n")
        except (OSError, UnicodeDecodeError):
            pass
    if text is None or not ITER_NAME.fullmatch(text):
        raise CheckpointError(f"{latest} does not hold the name of a checkpoint directory (iter_NNNNNNN, "
                              f"a plain name inside {path}): it is damaged; pass an iter_* directory to --load")
    target = os.path.join(path, text)
    old = target + ".old"
    if not os.path.lexists(target) and is_plain(old, "dir") and is_plain(os.path.join(old, "index.json"), "file"):
        target = old  # a save of the same iteration again stopped between its two renames
    if os.path.lexists(target) and not is_plain(target, "dir"):
        raise CheckpointError(f"{latest} names {target}, which is not a directory inside {path} (a link?): "
                              "a checkpoint is read only from its own directory; pass it to --load itself")
    if not is_plain(os.path.join(target, "index.json"), "file"):
        raise CheckpointError(f"{latest} names {target}, which has no index.json: the checkpoint is "
                              f"incomplete; pass an earlier iter_* directory of {path} to --load")
    return target


def read_index(path):
    """The index of the checkpoint at ``path``, after checking every field of it and that every
    shard file it lists is there at its full size (checks every rank can make before any
    communication)."""
    path = find(path)
    index_file = os.path.join(path, "index.json")
    try:
        with open(index_file) as f:
            index = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{index_file} is not readable JSON ({exc})") from exc
    validate(index, index_file)
    for name, size in index["files"].items():
        file = os.path.join(path, name)
        if not os.path.lexists(file):
            raise CheckpointError(f"{file} is missing: the checkpoint lacks one rank's shards")
        if not is_plain(file, "file"):
            raise CheckpointError(f"{file} is not a regular file (a link?): a checkpoint's shards are "
                                  "read only from its own directory; load an earlier checkpoint")
        if os.path.getsize(file) != size:
            raise CheckpointError(f"{file} is truncated or damaged: {os.path.getsize(file)} bytes, "
                                  f"the index says {size}")
    index["path"] = path
    return index


def _whole(minimum=0):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _dtype_name(v):
    # one of the dtypes a shard can hold, by name: NumPy's own parser, asked first, handed text such
    # as "i4,(2" to Python's and raised SyntaxError, a traceback in place of this field's error
    return isinstance(v, str) and v in DTYPE_NAMES


def _list_of(n, each):
    return lambda v: isinstance(v, list) and (n is None or len(v) == n) and all(each(x) for x in v)


class _Fields:
    """One index file's fields, each looked up and checked by its full name."""

    def __init__(self, file):
        self.file = file

    def __call__(self, parent, key, where, what, ok):
        if isinstance(key, int):
            name = f"{where}[{key}]"
        elif not _IDENTIFIER.fullmatch(key):  # a tensor's or a file's name: quoted, as in the JSON
            name = f"{where}[{json.dumps(key)}]"
        else:
            name = f"{where}.{key}" if where else key
        if isinstance(parent, list):
            value = parent[key] if key < len(parent) else _MISSING
        else:
            value = parent.get(key, _MISSING)
        if value is _MISSING:
            raise CheckpointError(f"{self.file}: field {name} is missing; {_DAMAGED}")
        if not ok(value):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise CheckpointError(f"{self.file}: field {name} is {shown}, not {what}; {_DAMAGED}")
        return value


def validate(index, index_file):
    """Raise CheckpointError naming the first field of ``index`` that is missing or not what a
    ``FORMAT`` index holds there."""
    if not isinstance(index, dict) or not isinstance(index.get("format"), str):
        raise CheckpointError(f"{index_file} is not a minipar checkpoint index (its 'format' field is missing "
                              "or not a string): pass a checkpoint minipar saved")
    if index["format"] != FORMAT:
        raise CheckpointError(f"{index_file} is a {index['format']!r} checkpoint; this minipar reads "
                              f"{FORMAT!r} only (its checksums cover the index itself, and each box's dtype "
                              "and shape): load it with the minipar that wrote it, or start the run again")
    field, is_dict = _Fields(index_file), (lambda v: isinstance(v, dict))
    sealed = field(index, "sha256", "", "64 lowercase hexadecimal digits",
                   is_sha256)
    if seal(index)["sha256"] != sealed:
        raise CheckpointError(f"{index_file} does not match its own checksum: it was damaged or edited after "
                              "it was written; load an earlier checkpoint")
    field(index, "iteration", "", "a whole number >= 0", _whole())
    field(index, "dtype", "", f"a float dtype name, one of {', '.join(FLOAT_DTYPES)}", lambda v: v in FLOAT_DTYPES)
    field(index, "model", "", "an object", is_dict)
    layout = field(index, "layout", "", "an object", is_dict)
    for size in ("tp", "pp", "dp"):
        field(layout, size, "layout", "a whole number >= 1", _whole(1))
    trainer = field(index, "trainer", "", "an object", is_dict)
    field(trainer, "optimizer_steps", "trainer", "a whole number >= 0", _whole())
    files = field(index, "files", "", "an object", is_dict)
    for name in files:
        if not SHARD_NAME.fullmatch(name):
            raise CheckpointError(f"{index_file}: field files names {json.dumps(name)[:60]}, not a plain "
                                  f"name rank_NNNNN.safetensors inside the checkpoint; {_DAMAGED}")
        field(files, name, "files", "a whole number of bytes", _whole())
    tensors = field(index, "tensors", "", "an object", is_dict)
    for tensor in tensors:
        where = f"tensors[{json.dumps(tensor)}]"
        entry = field(tensors, tensor, "tensors", "an object", is_dict)
        shape = field(entry, "shape", where, "a list of whole numbers", _list_of(None, _whole()))
        boxes = field(entry, "boxes", where, "a list", lambda v: isinstance(v, list))
        # a box belongs to its tensor (its key is the tensor's name and its number, so it cannot
        # be another tensor's, whose checksum would pass) and holds floats no wider than the
        # checkpoint's dtype (PipeDream-2BW's stashed weights of a 16-bit run are 16-bit): a box of
        # integers, or of float64 in a float32 checkpoint, would be cast silently
        own_key = re.compile(re.escape(tensor) + r"/[0-9]+")
        held = 0
        for i in range(len(boxes)):
            box = field(boxes, i, f"{where}.boxes", "an object", is_dict)
            at = f"{where}.boxes[{i}]"
            field(box, "file", at, "one of the names in files", lambda v: isinstance(v, str) and v in files)
            field(box, "key", at, f"{json.dumps(tensor + '/N')}, a box of this tensor",
                  lambda v: isinstance(v, str) and own_key.fullmatch(v) is not None)
            field(box, "dtype", at, f"a float dtype no wider than the checkpoint's, {index['dtype']}",
                  lambda v: v in FLOAT_DTYPES and as_dtype(v).itemsize <= as_dtype(index["dtype"]).itemsize)
            start = field(box, "start", at, f"a list of {len(shape)} whole numbers", _list_of(len(shape), _whole()))
            stop = field(box, "stop", at, f"a list of {len(shape)} whole numbers, each above start and at most the "
                         f"shape {shape}", lambda v: _list_of(len(shape), _whole())(v)
                         and all(a < b <= n for a, b, n in zip(start, v, shape)))
            field(box, "sha256", at, "64 lowercase hexadecimal digits",
                  is_sha256)
            held += math.prod(b - a for a, b in zip(start, stop))
        # the boxes of a save tile their tensor: a box listed twice or one missing shows in the sum
        # (a load checks that the parts it reads are covered, box by box)
        if held != math.prod(shape):
            raise CheckpointError(f"{index_file}: field {where}.boxes hold {held:,} values of a tensor of "
                                  f"{math.prod(shape):,}: a box is listed twice or missing; {_DAMAGED}")
