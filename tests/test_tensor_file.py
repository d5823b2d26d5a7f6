"""Our safetensors writer (``checkpoint/tensor_file.py``), read back by the safetensors library."""

import errno
import json
import os

import ml_dtypes
import numpy
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from minipar.checkpoint.files import write_file
from minipar.checkpoint.tensor_file import tensor_file


def test_what_the_library_reads_back_is_what_was_written(tmp_path):
    rng = numpy.random.default_rng(0)
    tensors = {"h.0.attn.c_attn.weight": rng.standard_normal((6, 5)),  # float64
               "wte.weight": rng.standard_normal((7, 3)).astype(numpy.float32),
               "step": numpy.arange(3, dtype=numpy.int64), "half": rng.standard_normal(5).astype(numpy.float16),
               "empty": numpy.zeros((0, 4), numpy.float32), "bytes": numpy.arange(5, dtype=numpy.uint8),
               "mask": numpy.array([True, False, True]), "scalar": numpy.array(2.5, numpy.float32),
               "fortran": numpy.asfortranarray(rng.standard_normal((4, 3))),  # copied to C order
               "big-endian": numpy.arange(4, dtype=">f4")}
    path = str(tmp_path / "x.safetensors")
    parts = tensor_file(tensors, metadata={"format": "pt", "steps": "3"})
    assert write_file(path, parts) == (tmp_path / "x.safetensors").stat().st_size
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for name, array in tensors.items():
        assert back[name].dtype == array.dtype.newbyteorder("=") and back[name].shape == array.shape, name
        assert numpy.array_equal(back[name], array), name
    with safe_open(path, framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "steps": "3"}


def test_each_tensor_starts_aligned_to_its_item_size_and_contiguous_arrays_are_not_copied():
    arrays = {"a": numpy.ones(3, numpy.uint8), "b": numpy.ones(3, numpy.float64), "c": numpy.ones(5, numpy.float32),
              "d": numpy.ones(1, numpy.float16)}
    head, *data = tensor_file(arrays)
    size = int.from_bytes(head[:8], "little")
    assert len(head) == 8 + size and len(head) % 8 == 0  # the data starts at a multiple of 8
    header = json.loads(head[8:])
    for name, array in arrays.items():
        begin, end = header[name]["data_offsets"]
        assert begin % array.itemsize == 0 and end - begin == array.nbytes, name
    assert sorted(tuple(h["data_offsets"]) for h in header.values()) == [(0, 24), (24, 44), (44, 46), (46, 49)]
    assert all(numpy.shares_memory(part, arrays[name]) for part, name in zip(data, "bcda"))


def test_bfloat16_is_written_as_bf16():
    head = tensor_file({"w": numpy.ones((2, 2), ml_dtypes.bfloat16)})[0]
    assert json.loads(head[8:])["w"] == {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}


def test_what_safetensors_cannot_hold_is_refused_by_name():
    with pytest.raises(ValueError, match="tensor z: safetensors has no dtype for complex128"):
        tensor_file({"z": numpy.ones(2, complex)})
    with pytest.raises(ValueError, match="cannot be named __metadata__"):
        tensor_file({"__metadata__": numpy.ones(2)})
    with pytest.raises(TypeError, match="metadata maps strings to strings"):
        tensor_file({"a": numpy.ones(2)}, metadata={"steps": 3})


def test_write_file_finishes_every_buffer_that_os_write_takes_only_part_of(tmp_path, monkeypatch):
    """Linux writes at most about 2 GiB a call, and a pipe or a signal can cut a write short."""
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    parts = [b"header:", numpy.arange(50, dtype=numpy.float64), b"", numpy.arange(3, dtype=numpy.uint8)]
    path = tmp_path / "f"
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert write_file(str(path), parts) == len(expected) == 7 + 400 + 3
    assert path.read_bytes() == expected


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file an fsync is for")
def test_write_file_syncs_its_bytes_before_the_rename_names_them(tmp_path, monkeypatch):
    """Durability: the temporary's bytes reach the disk (fsync of its descriptor) before the rename
    makes the target name them; a crash after the rename must not find a named but empty file."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = str(tmp_path / "f")
    write_file(path, b"data")
    assert len(events) == 2 and events[1][0] == "replace" and events[1][2] == path, events
    assert events[0] == ("fsync", events[1][1]), events  # the temporary itself, before its rename


def test_fsync_dir_syncs_the_directory_itself(tmp_path, monkeypatch):
    """``fsync_dir`` is what makes a rename durable: it must fsync a descriptor of that directory."""
    from minipar.checkpoint.files import fsync_dir

    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real_fsync(fd))
    fsync_dir(str(tmp_path))
    assert synced == [os.stat(tmp_path).st_ino]


def test_a_write_that_fails_names_the_target_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """An OSError names the file the caller asked for (not the temporary, which is gone), and any
    failure, an OSError or not, removes the temporary and leaves the previous file as it was."""
    path = tmp_path / "f"
    path.write_bytes(b"old")

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as os.write says it: no file named

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as caught:
        write_file(str(path), b"new")
    assert caught.value.filename == str(path), caught.value.filename
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["f"] and path.read_bytes() == b"old"
    with pytest.raises(TypeError):
        write_file(str(path), [b"new", object()])  # not a buffer: fails half-way through the parts
    assert os.listdir(tmp_path) == ["f"] and path.read_bytes() == b"old"


def test_a_temporary_that_cannot_be_created_names_the_target(tmp_path):
    """write_file's OSError names the file asked for even when the temporary beside it cannot be
    made (a missing or read-only folder, no inodes left): never a random name that never existed."""
    path = str(tmp_path / "gone" / "f")
    with pytest.raises(OSError) as caught:
        write_file(path, b"data")
    assert caught.value.filename == path, caught.value.filename
