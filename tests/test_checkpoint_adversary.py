"""A checkpoint on disk is input: edited headers, paths leading out of the directory, planted
links, malformed index fields and a full disk each give one CheckpointError naming the file and
the problem, and never a traceback, a silent load of garbage or a write outside the directory."""

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import minipar
from minipar.checkpoint import sharded
from minipar.checkpoint.index import seal
from minipar.checkpoint.sharded import CheckpointError
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer

CONFIG = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)
WTE = "param/transformer.wte.weight/0"  # a (32, 16) box of rank 0's shard file
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_a_box_read_as_another_dtype_fails_its_checksum_though_header_and_index_agree(tmp_path):
    """The checksum covers the box's dtype and shape, not only its bytes: the same bytes as int32
    are not the weights that were saved."""
    save = _saved(tmp_path)
    _edit_header(os.path.join(save, "iter_0000001", "rank_00000.safetensors"), WTE, lambda t: t.update(dtype="I32"))
    _edit_index(save, lambda index: index["tensors"]["param/transformer.wte.weight"]["boxes"][0].update(dtype="int32"))
    with pytest.raises(CheckpointError, match=f"{WTE}.* does not match its checksum"):
        _load(save)


def test_a_tensor_in_no_saved_box_is_refused_not_left_at_its_initial_values(tmp_path):
    save = _saved(tmp_path)
    _edit_index(save, lambda index: index["tensors"]["param/transformer.wte.weight"].update(boxes=[]))
    with pytest.raises(CheckpointError, match="in no saved box"):
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
    out += [(("trainer", "optimizer_steps"), DELETE), (("trainer", "optimizer_steps"), "3"), (("trainer",), None)]
    out += [(("files", shard), "12"), (("files", shard), -1), (("files", shard), None), (("files",), [])]
    out += [(("tensors", tensor), None), (("tensors", tensor, "shape"), DELETE), (("tensors", tensor, "shape"), ["a"]),
            (("tensors", tensor, "boxes"), None), (box, None), (("tensors",), [])]
    out += [(box + ("file",), None), (box + ("file",), "rank_00009.safetensors"), (box + ("key",), 5),
            (box + ("dtype",), "F32"), (box + ("start",), DELETE), (box + ("start",), [0]),
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


def _fail_writes_to(monkeypatch, directory, name):
    """os.write raises ENOSPC for the temporary file of ``name`` under ``directory``, as on a full disk."""
    write = os.write

    def full(fd, data):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(str(directory)) and os.path.basename(path).startswith(f".{name}."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr(os, "write", full)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file a write is for")
@pytest.mark.parametrize("name", ["rank_00000.safetensors", "rank_00000.json", "index.json", "latest"])
def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(name, tmp_path, monkeypatch):
    save = _saved(tmp_path)
    model, opt, grid = _make()
    opt.step_count = 7  # so that which checkpoint loads shows
    _fail_writes_to(monkeypatch, tmp_path, name)
    with pytest.raises(CheckpointError) as caught:
        sharded.save(save, 2, model, opt, grid, {})
    monkeypatch.undo()
    message = str(caught.value)
    assert message.startswith("checkpoint iter_0000002 was not saved: No space left on device") and name in message
    assert "the previous checkpoint and " + os.path.join(save, "latest") + " are unchanged" in message
    # no partial files, no temporaries; a rank's own failure leaves the folder, empty: another
    # rank may be about to open its file in it (removing it once made those ranks fail too)
    partial = ["iter_0000002.partial"] if name.startswith("rank_") else []
    assert sorted(os.listdir(save)) == ["iter_0000001", *partial, "latest"]
    assert all(os.listdir(os.path.join(save, folder)) == [] for folder in partial)
    assert _load(save) == {"iteration": 1, "optimizer_steps": 0}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file a write is for")
def test_a_full_disk_at_the_first_save_does_not_promise_an_earlier_checkpoint(tmp_path, monkeypatch):
    save = str(tmp_path / "ckpt")
    model, opt, grid = _make()
    _fail_writes_to(monkeypatch, tmp_path, "index.json")
    with pytest.raises(CheckpointError, match="iter_0000001 was not saved: No space left on device .*; no earlier "
                       "checkpoint was saved there: free space"):
        sharded.save(save, 1, model, opt, grid, {})


def test_a_save_refused_permission_says_to_make_the_folder_writable_not_to_free_space(tmp_path):
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "iter_0000003.partial"))
    message = str(sharded._not_saved(str(tmp_path), str(tmp_path / "iter_0000003"), denied))
    assert "was not saved: Permission denied" in message and "make it writable" in message, message
    assert "free space" not in message


def test_a_resave_that_fails_between_its_renames_keeps_the_previous_one(tmp_path, monkeypatch):
    save = _saved(tmp_path)
    model, opt, grid = _make()
    opt.step_count = 7
    replace = os.replace

    def failing(src, dst):
        if str(src).endswith(".partial"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), src)
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(CheckpointError, match="iter_0000001 was not saved: Input/output error"):
        sharded.save(save, 1, model, opt, grid, {})
    monkeypatch.undo()
    assert sorted(os.listdir(save)) == ["iter_0000001.old", "latest"]  # stopped between the two renames
    assert sharded.find(save).endswith("iter_0000001.old") and _load(save) == {"iteration": 1, "optimizer_steps": 0}
    sharded.save(save, 1, model, opt, grid, {})  # the same iteration again, whole this time
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest"] and _load(save) == {"optimizer_steps": 7}


TMPFS_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint_adversary import _make
    from minipar.checkpoint import sharded
    save = os.path.join(sys.argv[1], "save")
    model, opt, grid = _make()
    sharded.save(save, 1, model, opt, grid, {})
    with open(os.path.join(sys.argv[1], "filler"), "wb", buffering=0) as f:  # fill the disk
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass
    try:
        sharded.save(save, 2, model, opt, grid, {})
    except sharded.CheckpointError as exc:
        print(exc)
    print(sorted(os.listdir(save)), sharded.load(save, *_make()))
""")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("mount"),
                    reason="a real full disk needs root, unshare and mount (a private tmpfs)")
def test_a_really_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "script.py"
    script.write_text(TMPFS_SCRIPT)
    here = os.path.dirname(os.path.abspath(__file__))
    command = f"mount -t tmpfs -o size=512k tmpfs {disk} && {sys.executable} {script} {disk} {here}"
    run = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    if run.returncode != 0 and "mount" in run.stderr and "Traceback" not in run.stderr:
        pytest.skip(f"no private tmpfs here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("checkpoint iter_0000002 was not saved: No space left on device")
    # the shard did not fit: its rank's folder stays, empty, for the next start to remove
    assert lines[1] == "['iter_0000001', 'iter_0000002.partial', 'latest'] {'optimizer_steps': 0}", lines


def test_every_file_of_a_checkpoint_has_the_users_mode_and_no_temporary_is_left(tmp_path):
    umask = os.umask(0o027)
    try:
        save = _saved(tmp_path, iterations=(1, 1))  # the same iteration again replaces it whole
    finally:
        os.umask(umask)
    step = os.path.join(save, "iter_0000001")
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest"]
    assert sorted(os.listdir(step)) == ["index.json", "rank_00000.json", "rank_00000.safetensors"]
    for path in [os.path.join(save, "latest")] + [os.path.join(step, f) for f in os.listdir(step)]:
        assert os.stat(path).st_mode & 0o777 == 0o640, path


def test_remove_stale_partials_removes_only_what_crashed_saves_left(tmp_path):
    save = _saved(tmp_path, iterations=(1, 2))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    shutil.copytree(os.path.join(save, "iter_0000002"), os.path.join(save, "iter_0000003.partial"))
    shutil.copytree(os.path.join(save, "iter_0000001"), os.path.join(save, "iter_0000001.old"))
    shutil.copytree(os.path.join(save, "iter_0000001"), os.path.join(save, "iter_0000005.old"))  # put back
    os.symlink(outside, os.path.join(save, "iter_0000004.partial"))
    open(os.path.join(save, ".latest.abc123.tmp"), "w").write("iter_00")
    open(os.path.join(save, "notes.partial"), "w").write("mine")
    removed = sharded.remove_stale_partials(save)
    assert removed == [".latest.abc123.tmp", "iter_0000001.old", "iter_0000003.partial", "iter_0000004.partial"]
    assert sorted(os.listdir(save)) == ["iter_0000001", "iter_0000002", "iter_0000005", "latest", "notes.partial"]
    assert os.listdir(outside) == ["keep"] and sharded.remove_stale_partials(str(tmp_path / "none")) == []
    assert _load(save) == {"iteration": 2, "optimizer_steps": 0}


def test_prune_keeps_the_newest_and_never_what_latest_names(tmp_path):
    save = _saved(tmp_path, iterations=(1, 2, 3, 4, 5))
    shutil.copytree(os.path.join(save, "iter_0000001"), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(save, "iter_0000000"))  # not a plain directory
    os.mkdir(os.path.join(save, "iter_0000009"))  # no index: not a complete checkpoint
    os.mkdir(os.path.join(save, "iter_12"))  # not a name a save writes
    assert sharded.prune(save, 3) == ["iter_0000001", "iter_0000002"]
    open(os.path.join(save, "latest"), "w").write("iter_0000003\n")  # a run resumed from an older one
    assert sharded.prune(save, 2) == ["iter_0000004"]
    assert sorted(os.listdir(save)) == ["iter_0000000", "iter_0000003", "iter_0000005", "iter_0000009", "iter_12",
                                        "latest"]
    assert os.listdir(tmp_path / "elsewhere") and sharded.prune(save, 1) == ["iter_0000005"]
    assert _load(save) == {"iteration": 3, "optimizer_steps": 0}
    open(os.path.join(save, "latest"), "w").write("../elsewhere")
    assert sharded.prune(save, 1) == []  # which one to keep is unknown: nothing goes
    with pytest.raises(ValueError, match="keep=0 must be a whole number >= 1"):
        sharded.prune(save, 0)
