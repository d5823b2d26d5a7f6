import os

import numpy
import pytest

from minipar.checkpoint import load_weights, save_weights
from minipar.models import GPT, GPTConfig


def test_weights_round_trip_with_gpt2_names(tmp_path):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4))
    path = str(tmp_path / "w.safetensors")
    save_weights(model.state_dict(), path)
    loaded = load_weights(path)
    assert set(loaded) == set(model.state_dict())
    for name, value in model.state_dict().items():
        numpy.testing.assert_array_equal(loaded[name], value)
    assert os.listdir(tmp_path) == ["w.safetensors"]  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # readable like any file the user writes


def test_damaged_file_is_refused(tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_weights({"a": numpy.arange(1000, dtype=numpy.float32)}, path)
    raw = bytearray(open(path, "rb").read())
    raw[-10] ^= 0xFF  # flip bits inside the tensor data
    open(path, "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="damaged"):
        load_weights(path)
    open(path, "wb").write(bytes(raw[:50]))  # truncated
    with pytest.raises(ValueError, match="not a readable"):
        load_weights(path)


def test_a_header_edited_to_another_shape_of_the_same_bytes_is_refused(tmp_path):
    """The checksum covers each tensor's shape (and dtype), not only its bytes."""
    path = tmp_path / "w.safetensors"
    save_weights({"a": numpy.arange(12, dtype=numpy.float32).reshape(4, 3)}, str(path))
    raw = path.read_bytes()
    assert raw.count(b'"shape":[4,3]') == 1
    path.write_bytes(raw.replace(b'"shape":[4,3]', b'"shape":[3,4]'))  # the same length: a valid file
    with pytest.raises(ValueError, match="damaged"):
        load_weights(str(path))


def test_failed_write_keeps_the_previous_file(tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_weights({"a": numpy.ones(3, numpy.float32)}, path)
    with pytest.raises(Exception):
        save_weights({"a": object()}, path)  # not an array: the write fails
    numpy.testing.assert_array_equal(load_weights(path)["a"], numpy.ones(3))
    assert os.listdir(tmp_path) == ["w.safetensors"]


def test_save_weights_syncs_the_directory_once_the_file_is_renamed_into_it(tmp_path, monkeypatch):
    """The rename that names the new file reaches the disk too: its directory is fsynced after it."""
    from minipar.checkpoint import weights

    synced = []
    monkeypatch.setattr(weights, "fsync_dir", lambda d: synced.append((d, os.listdir(d))))
    save_weights({"a": numpy.ones(3, numpy.float32)}, str(tmp_path / "w.safetensors"))
    assert synced == [(str(tmp_path), ["w.safetensors"])]


def test_float16_weights_are_refused_though_safetensors_reads_them(tmp_path):
    """A run takes float32 or float64 weights only: float16 ones would start it from rounded values."""
    path = str(tmp_path / "w.safetensors")
    save_weights({"a": numpy.ones(3, numpy.float16)}, path)
    with pytest.raises(ValueError, match="tensor a is F16: weights must be float32 or float64"):
        load_weights(path)


def test_a_tensor_renamed_in_the_header_is_refused(tmp_path):
    """The checksum covers each tensor's name: weights moved to another name do not load as it."""
    path = tmp_path / "w.safetensors"
    save_weights({"h.0.w": numpy.arange(4, dtype=numpy.float32), "h.1.w": numpy.ones(4, numpy.float32)}, str(path))
    raw = path.read_bytes()
    assert raw.count(b'"h.1.w"') == 1
    path.write_bytes(raw.replace(b'"h.1.w"', b'"h.2.w"'))  # the same length, the same order: a valid file
    with pytest.raises(ValueError, match="damaged"):
        load_weights(str(path))


def _tiny():
    import minipar
    from minipar.parallel import ProcessGrid
    from minipar.parallel.optimizers import make_optimizer

    minipar.manual_seed(0)
    grid = ProcessGrid(1, 1)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32), grid)
    return model, make_optimizer(model, grid, 0, lr=1e-2), grid


def test_big_endian_arrays_are_saved_as_the_little_endian_values_they_are(tmp_path):
    """safetensors stores little-endian bytes, so a big-endian array (NumPy reads such files) is
    converted as it is written; its checksum was taken of the bytes before, and the file written
    was refused on load as damaged."""
    from minipar.checkpoint import sharded

    path = str(tmp_path / "w.safetensors")
    save_weights({"a": numpy.arange(3, dtype=">f4"), "b": numpy.arange(2.0).astype(">f8")}, path)
    loaded = load_weights(path)
    assert loaded["a"].tolist() == [0, 1, 2] and loaded["b"].tolist() == [0, 1]
    model, opt, grid = _tiny()
    wte = dict(model.named_parameters())["transformer.wte.weight"]
    wte.data = wte.data.astype(">f4")  # the same values, the other byte order
    sharded.save(str(tmp_path / "save"), 1, model, opt, grid, {})
    again, opt2, grid2 = _tiny()
    dict(again.named_parameters())["transformer.wte.weight"].data[...] = 0
    sharded.load(str(tmp_path / "save"), again, opt2, grid2)
    numpy.testing.assert_array_equal(dict(again.named_parameters())["transformer.wte.weight"].data, wte.data)


def test_a_load_holds_the_saved_boxes_of_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Loading keeps no second copy of the state: the boxes read from the shards are let go once
    their tensor is filled (they were all kept until the load ended, as much host memory again as
    the rank's share of the checkpoint)."""
    import weakref

    from minipar.checkpoint import reshard, sharded

    save = str(tmp_path / "save")
    sharded.save(save, 1, *_tiny(), {})
    read, alive = [], []
    real = reshard.safe_open

    class Tracked:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.f = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, key):
            array = self.f.get_tensor(key)
            read.append(weakref.ref(array))
            alive.append(sum(r() is not None for r in read))
            return array

    monkeypatch.setattr(reshard, "safe_open", Tracked)
    sharded.load(save, *_tiny())
    assert len(read) > 30 and max(alive) <= 2, alive  # the box being filled, and the last one's view
