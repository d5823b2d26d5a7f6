"""Our safetensors writer (``checkpoint/tensor_file.py``), read back by the safetensors library."""

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
