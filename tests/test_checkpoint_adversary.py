"""A checkpoint on disk is input: edited headers, paths leading out of the directory, planted
links, malformed index fields, shards of the wrong size and saves whose boxes do not tile a tensor
each give one error naming the file and the problem, and never a traceback, a silent load of
garbage or a write outside the directory (a full disk and crashes: test_checkpoint_crashes.py)."""

import json
import os
import re
import shutil

import numpy
import pytest

import minipar
from minipar.checkpoint import reshard, sharded
from minipar.checkpoint.files import write_file
from minipar.checkpoint.index import seal
from minipar.checkpoint.sharded import CheckpointError
from minipar.checkpoint.tensor_file import tensor_file
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer

CONFIG = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)
WTE = "param/transformer.wte.weight/0"  # a (32, 16) box of rank 0's shard file


def _make():
    minipar.manual_seed(0)
    grid = ProcessGrid(1, 1)
    model = GPT(CONFIG, grid)
    return model, make_optimizer(model, grid, 0, lr=1e-2), grid


def _saved(tmp_path, iterations=(1,)):
    save = str(tmp_path / "save")
    model, opt, grid = _make()
    for it in iterations:
        sharded.save(save, it, model, opt, grid, {"iteration": it})
    return save


def _load(path):
    return sharded.load(path, *_make())


def _edit_header(shard, key, change):
    """Change one tensor's entry in a safetensors header, keeping the file's size."""
    raw = open(shard, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    change(header[key])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    open(shard, "wb").write(raw[:8] + text.ljust(n) + raw[8 + n :])  # safetensors pads with spaces too


@pytest.mark.parametrize("change,message", [
    (lambda t: t.update(dtype="I32"), "dtype is int32, the index says float32"),
    (lambda t: t.update(shape=[1, 512]), r"shape is \(1, 512\), its box in the index is \(32, 16\)"),
])
def test_an_edited_shard_header_is_refused(change, message, tmp_path):
    save = _saved(tmp_path)
    _edit_header(os.path.join(save, "iter_0000001", "rank_00000.safetensors"), WTE, change)
    with pytest.raises(CheckpointError, match=f"rank_00000.safetensors is damaged: {WTE}: its {message}"):
        _load(save)


def _edit_index(save, change):
    """Change the index as an editor would, and seal it again: only the other checks may refuse it."""
    path = os.path.join(save, "iter_0000001", "index.json")
    index = json.load(open(path))
    change(index)
    open(path, "w").write(json.dumps(seal(index)))


def test_a_box_read_as_another_dtype_is_refused_though_header_and_index_agree(tmp_path):
    """The same bytes as int32 are not the weights that were saved: a box holds floats no wider than
    the checkpoint's (the checksum, over the box's dtype and shape as well as its bytes, would
    refuse them next)."""
    save = _saved(tmp_path)
    _edit_header(os.path.join(save, "iter_0000001", "rank_00000.safetensors"), WTE, lambda t: t.update(dtype="I32"))
    _edit_index(save, lambda index: index["tensors"]["param/transformer.wte.weight"]["boxes"][0].update(dtype="int32"))
    with pytest.raises(CheckpointError, match=r'boxes\[0\]\.dtype is "int32", not a float dtype no wider than '
                                              "the checkpoint's, float32"):
        _load(save)


@pytest.mark.parametrize("tensor,value,message", [
    ("param/transformer.h.0.ln_1.weight", numpy.nan, "it holds NaN or infinite values"),  # "diverged" at the step
    ("exp_avg_sq/transformer.h.0.ln_1.weight", -1.0, "it holds negative second moments"),  # Adam's sqrt: nan
])
def test_a_box_of_values_no_run_saves_is_refused_though_its_checksum_is_remade(tensor, value, message, tmp_path):
    save = _saved(tmp_path)
    _forge(save, tensor, numpy.full(16, value, numpy.float32))
    with pytest.raises(CheckpointError, match=f"{tensor}/0: {message}"):
        _load(save)


def test_a_box_listed_under_another_tensor_is_refused(tmp_path):
    """Its checksum passes (it is a real box of the checkpoint) but it holds another tensor's values:
    the LayerNorm's weight read from Adam's first moment."""
    save = _saved(tmp_path)
    name = "transformer.h.0.ln_1.weight"
    _edit_index(save, lambda index: index["tensors"][f"param/{name}"].update(boxes=index["tensors"][f"exp_avg/{name}"]["boxes"]))
    with pytest.raises(CheckpointError, match=re.escape(f'tensors["param/{name}"].boxes[0].key is "exp_avg/{name}/0"')):
        _load(save)


def test_a_box_listed_twice_is_refused(tmp_path):
    save = _saved(tmp_path)
    boxes = lambda index: index["tensors"]["param/transformer.wte.weight"]["boxes"]  # noqa: E731
    _edit_index(save, lambda index: boxes(index).append(dict(boxes(index)[0])))
    with pytest.raises(CheckpointError, match="a box is listed twice or missing"):
        _load(save)


def test_a_tensor_in_no_saved_box_is_refused_not_left_at_its_initial_values(tmp_path):
    save = _saved(tmp_path)
    _edit_index(save, lambda index: index["tensors"]["param/transformer.wte.weight"].update(boxes=[]))
    with pytest.raises(CheckpointError, match="boxes hold 0 values of a tensor of 512: a box is listed twice or missing"):
        _load(save)


def test_a_save_whose_boxes_miss_part_of_a_tensor_is_refused(tmp_path, monkeypatch):
    """The writer rules' own check: the saved boxes of a tensor must add up to all of it. A rule
    that left out one row (here planted in the embedding's piece) fails the save, not a later load."""
    real = sharded.pieces

    def one_row_short(*args):
        out = real(*args)
        for piece in out:
            if piece.kind == "param" and piece.name.endswith("wte.weight"):
                boxes = piece.global_boxes()
                piece.global_boxes = lambda: [(start, (stop[0] - 1, *stop[1:]), view[:-1]) for start, stop, view in boxes]
        return out

    monkeypatch.setattr(sharded, "pieces", one_row_short)
    with pytest.raises(RuntimeError, match=r"boxes of param/transformer.wte.weight overlap or cover 496 of 512"):
        _saved(tmp_path)


@pytest.mark.parametrize("latest", ["../elsewhere", "/etc/passwd", "iter_0000001/../../elsewhere",
                                    "iter_1", " iter_0000001", "iter_0000001\nextra"])
def test_latest_must_name_a_checkpoint_inside_the_save_directory(latest, tmp_path):
    save = _saved(tmp_path)
    shutil.copytree(os.path.join(save, "iter_0000001"), tmp_path / "elsewhere")  # loadable, but not here
    open(os.path.join(save, "latest"), "w").write(latest)
    with pytest.raises(CheckpointError, match="latest does not hold the name of a checkpoint directory"):
        _load(save)


def test_a_linked_checkpoint_directory_or_latest_is_refused(tmp_path):
    save = _saved(tmp_path)
    shutil.copytree(os.path.join(save, "iter_0000001"), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(save, "iter_0000009"))
    open(os.path.join(save, "latest"), "w").write("iter_0000009\n")
    with pytest.raises(CheckpointError, match="iter_0000009, which is not a directory inside"):
        _load(save)
    open(tmp_path / "other_latest", "w").write("iter_0000001\n")
    os.remove(os.path.join(save, "latest"))
    os.symlink(tmp_path / "other_latest", os.path.join(save, "latest"))
    with pytest.raises(CheckpointError, match="latest does not hold the name"):
        _load(save)
    assert sharded.find(os.path.join(save, "iter_0000001")).endswith("iter_0000001")  # named directly: fine


@pytest.mark.parametrize("where", ["parent", "absolute", "link"])
def test_shard_files_must_be_plain_files_of_the_checkpoint(where, tmp_path):
    save = _saved(tmp_path)
    step = os.path.join(save, "iter_0000001")
    outside = str(tmp_path / "rank_00000.safetensors")
    shutil.copy(os.path.join(step, "rank_00000.safetensors"), outside)  # a good file, in the wrong place
    if where == "link":
        os.remove(os.path.join(step, "rank_00000.safetensors"))
        os.symlink(outside, os.path.join(step, "rank_00000.safetensors"))
        message = "rank_00000.safetensors is not a regular file"
    else:
        name = "../rank_00000.safetensors" if where == "parent" else outside
        index = json.load(open(os.path.join(step, "index.json")))
        index["files"] = {name: index["files"]["rank_00000.safetensors"]}
        for entry in index["tensors"].values():
            for box in entry["boxes"]:
                box["file"] = name
        json.dump(seal(index), open(os.path.join(step, "index.json"), "w"))  # sealed again, as an editor would
        message = "not a plain name rank_NNNNN.safetensors"
    with pytest.raises(CheckpointError, match=message):
        _load(save)


def test_a_save_never_writes_through_a_planted_link(tmp_path):
    save = _saved(tmp_path)
    victim, victim_dir = tmp_path / "victim", tmp_path / "victim_dir"
    victim.write_text("precious")
    victim_dir.mkdir()
    (victim_dir / "keep").write_text("precious too")
    os.symlink(victim, os.path.join(save, "latest.tmp"))
    os.symlink(victim_dir, os.path.join(save, "iter_0000002.partial"))  # a stale partial that is a link
    model, opt, grid = _make()
    sharded.save(save, 2, model, opt, grid, {})
    assert victim.read_text() == "precious" and (victim_dir / "keep").read_text() == "precious too"
    assert os.listdir(victim_dir) == ["keep"]
    assert open(os.path.join(save, "latest")).read() == "iter_0000002\n"
    assert not os.path.islink(os.path.join(save, "latest")) and _load(save) == {"optimizer_steps": 0}


DELETE = object()


def _mutations(index):
    """(path, new value or DELETE) pairs, each making the index malformed in one field."""
    tensor = next(iter(index["tensors"]))
    box = ("tensors", tensor, "boxes", 0)
    shard = next(iter(index["files"]))
    out = [((key,), DELETE) for key in ("format", "iteration", "model", "dtype", "layout", "trainer", "files",
                                        "tensors")]
    out += [(("iteration",), v) for v in ("x", -5, 2.5, None, True)]
    out += [(("dtype",), "float"), (("dtype",), 3), (("model",), []), (("layout", "tp"), 0), (("layout",), [1])]
    out += [(("dtype",), "i4,(2"), (("dtype",), "object")]  # NumPy's parser raises SyntaxError on the first
    out += [(("trainer", "optimizer_steps"), DELETE), (("trainer", "optimizer_steps"), "3"), (("trainer",), None)]
    out += [(("files", shard), "12"), (("files", shard), -1), (("files", shard), None), (("files",), [])]
    out += [(("tensors", tensor), None), (("tensors", tensor, "shape"), DELETE), (("tensors", tensor, "shape"), ["a"]),
            (("tensors", tensor, "boxes"), None), (box, None), (("tensors",), [])]
    out += [(box + ("file",), None), (box + ("file",), "rank_00009.safetensors"), (box + ("key",), 5),
            (box + ("dtype",), "F32"), (box + ("dtype",), "i4,(2"), (box + ("start",), DELETE), (box + ("start",), [0]),
            (box + ("start",), [-1, 0]), (box + ("start",), [0.5, 0]), (box + ("stop",), [33, 16]),
            (box + ("stop",), [0, 0]), (box + ("stop",), None), (box + ("sha256",), "xyz"),
            (box + ("sha256",), 123), (box + ("sha256",), DELETE)]
    return out


def test_an_index_that_does_not_match_its_own_checksum_is_refused(tmp_path):
    save = _saved(tmp_path)
    index_file = os.path.join(save, "iter_0000001", "index.json")
    good = open(index_file).read()
    assert '"iteration": 1,' in good
    for damaged in (good.replace('"iteration": 1,', '"iteration": 7,'),  # one digit, still a valid index
                    good.replace('"optimizer_steps": 0', '"optimizer_steps": 100')):
        open(index_file, "w").write(damaged)
        with pytest.raises(CheckpointError, match="index.json does not match its own checksum: it was damaged or edited"):
            _load(save)
    index = json.loads(good)
    for value in ("0" * 63, 5, DELETE):
        if value is DELETE:
            del index["sha256"]
        else:
            index["sha256"] = value
        open(index_file, "w").write(json.dumps(index))
        with pytest.raises(CheckpointError, match="field sha256 is"):
            _load(save)
    open(index_file, "w").write(json.dumps(json.loads(good), indent=4, sort_keys=True))  # written another way
    assert _load(save)["optimizer_steps"] == 0



def _name(path):
    name = ""
    for key in path:
        if isinstance(key, int):
            name += f"[{key}]"
        elif "/" in key or "." in key:
            name += f"[{json.dumps(key)}]"
        else:
            name += f".{key}" if name else key
    return name


def test_every_malformed_index_field_is_one_checkpoint_error_naming_it(tmp_path):
    save = _saved(tmp_path)
    index_file = os.path.join(save, "iter_0000001", "index.json")
    good = open(index_file).read()
    mutations = _mutations(json.loads(good))
    assert len(mutations) >= 30
    for path, value in mutations:
        index = json.loads(good)
        parent = index
        for key in path[:-1]:
            parent = parent[key]
        if value is DELETE:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        open(index_file, "w").write(json.dumps(seal(index)))  # sealed: the field checks must catch it
        with pytest.raises(CheckpointError) as caught:
            _load(save)
        message = str(caught.value)
        named = "'format' field" if path == ("format",) else _name(path)
        assert "\n" not in message and "index.json" in message and named in message, (path, message)
    open(index_file, "w").write(good.replace("minipar-sharded-checkpoint-3", "minipar-sharded-checkpoint-2"))
    with pytest.raises(CheckpointError, match="is a 'minipar-sharded-checkpoint-2' checkpoint; this minipar reads"):
        sharded.read_index(save)


def test_read_index_checks_every_listed_shard_at_exactly_its_size(tmp_path):
    """Before any rank reads a shard, every file the index lists is checked at the size it records:
    a file grown by a few bytes as well as a short one, and every rank's file, not only rank 0's."""
    save = _saved(tmp_path)
    step = os.path.join(save, "iter_0000001")
    shard = os.path.join(step, "rank_00000.safetensors")
    size = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(bytes(8))
    with pytest.raises(CheckpointError, match=f"rank_00000.safetensors is truncated or damaged: {size + 8} bytes, "
                       f"the index says {size}"):
        sharded.read_index(save)
    os.truncate(shard, size)
    other = os.path.join(step, "rank_00001.safetensors")  # a second rank's file, one byte short
    shutil.copy(shard, other)
    os.truncate(other, size - 1)
    _edit_index(save, lambda index: index["files"].update({"rank_00001.safetensors": size}))
    with pytest.raises(CheckpointError, match=f"rank_00001.safetensors is truncated or damaged: {size - 1} bytes"):
        sharded.read_index(save)


def _planted(monkeypatch, change):
    """sharded.pieces with ``change`` applied to each piece of the embedding's weight."""
    real = sharded.pieces

    def planted(*args):
        out = real(*args)
        for piece in out:
            if piece.name.endswith("wte.weight"):
                change(piece)
        return out

    monkeypatch.setattr(sharded, "pieces", planted)


def test_a_save_whose_boxes_overlap_is_refused_though_they_add_up_to_the_tensor(tmp_path, monkeypatch):
    """Each element saved exactly once: two boxes of the (32, 16) embedding that share row 15 and
    leave out row 31 add up to its 512 elements, and must still fail the save."""
    def overlapping(piece):
        if piece.kind == "param":
            ((_, _, view),) = piece.global_boxes()
            piece.global_boxes = lambda: [((0, 0), (16, 16), view[0:16]), ((15, 0), (31, 16), view[15:31])]

    _planted(monkeypatch, overlapping)
    with pytest.raises(RuntimeError, match=r"boxes of param/transformer.wte.weight overlap or cover 512 of 512"):
        _saved(tmp_path)


def test_a_save_in_which_no_rank_writes_a_tensor_it_holds_is_refused(tmp_path, monkeypatch):
    """Every tensor a rank holds is written by some rank: writer rules that leave the embedding to
    nobody fail the save, not the load of a checkpoint that lacks it."""
    _planted(monkeypatch, lambda piece: setattr(piece, "write", False))
    with pytest.raises(RuntimeError, match=r"checkpoint: no rank writes \[.*/transformer.wte.weight"):
        _saved(tmp_path)


def _forge(save, tensor, array):
    """Replace ``tensor``'s boxes by one box holding all of ``array`` in a new shard, its checksum
    and the index's seal made as the writer makes them: only a check against the model is left."""
    step = os.path.join(save, "iter_0000001")
    key = f"{tensor}/0"
    size = write_file(os.path.join(step, "rank_00001.safetensors"), tensor_file({key: array}))
    box = {"file": "rank_00001.safetensors", "key": key, "dtype": array.dtype.name, "start": [0] * array.ndim,
           "stop": list(array.shape), "sha256": reshard.box_checksum(key, array.dtype, array.shape, array)}

    def change(index):
        index["files"]["rank_00001.safetensors"] = size
        index["tensors"][tensor] = {"shape": list(array.shape), "boxes": [box]}
    _edit_index(save, change)


@pytest.mark.parametrize("shape", [(16,), (64, 16), (16, 16, 1)])
def test_a_saved_tensor_of_another_shape_than_the_models_is_refused(shape, tmp_path):
    """A (16,) row saved for the (16, 16) c_proj weight was broadcast into every row of it, and the
    first 16 rows of a (64, 16) one were taken for it: the whole shape the index gives a tensor
    must be the model's."""
    save = _saved(tmp_path)
    name = "param/transformer.h.0.attn.c_proj.weight"
    _forge(save, name, numpy.arange(numpy.prod(shape), dtype=numpy.float32).reshape(shape))
    with pytest.raises(CheckpointError, match=re.escape(f"{name} is {list(shape)} in the index, but this model's is [16, 16]")):
        _load(save)


def test_an_index_json_that_is_a_folder_is_named_as_such(tmp_path):
    """Not "no checkpoint here ... a save that did not finish": the checkpoint is there, damaged."""
    save = _saved(tmp_path)
    step = os.path.join(save, "iter_0000001")
    os.remove(os.path.join(step, "index.json"))
    os.mkdir(os.path.join(step, "index.json"))
    with pytest.raises(CheckpointError, match="index.json is not a regular file: the checkpoint is damaged"):
        _load(step)
