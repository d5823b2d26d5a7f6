"""A single transformers-layout .safetensors file (``--init-weights FILE``) skips the ``attn.bias``
/ ``attn.masked_bias`` buffers by name before judging dtypes, as a snapshot directory does:
transformers 4.27-4.30 saved them as bool / uint8. And 16-bit floats are refused with a fix."""

import numpy
import pytest
from safetensors.numpy import save_file

from minipar.checkpoint import hf, load_weights, save_weights
from test_hf import CONFIG, RUN, minipar_state, train, transformers_tensors


def old_transformers_file(path):
    """``minipar_state()`` as transformers 4.27-4.30 saved it: a bool causal mask, a uint8 fill."""
    tensors = transformers_tensors(minipar_state(), buffers=False)
    T = CONFIG.block_size
    for i in range(CONFIG.n_layer):
        tensors[f"transformer.h.{i}.attn.bias"] = numpy.tril(numpy.ones((T, T), bool))[None, None]
        tensors[f"transformer.h.{i}.attn.masked_bias"] = numpy.array(7, numpy.uint8)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(path)


def test_a_single_file_skips_bool_and_uint8_buffers_by_name(tmp_path):
    tensors = load_weights(old_transformers_file(tmp_path / "w.safetensors"))
    assert not any(name.endswith(hf.BUFFERS) for name in tensors)
    state = minipar_state()
    loaded = hf.from_hf(tensors)  # what --init-weights FILE does next (train_checks)
    assert set(loaded) == set(state)
    for name, value in state.items():
        assert loaded[name].tobytes() == value.tobytes(), name


def test_only_the_buffers_names_are_skipped(tmp_path):
    """c_attn.bias ends in "attn.bias" too: a bool one is judged, and refused."""
    path = str(tmp_path / "w.safetensors")
    save_file({"transformer.h.0.attn.c_attn.bias": numpy.ones(3, bool)}, path)
    with pytest.raises(ValueError, match=r"tensor transformer.h.0.attn.c_attn.bias is BOOL: weights must be float32"):
        load_weights(path)


def test_float16_weights_are_refused_with_the_fix(tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_weights({"a": numpy.ones(3, numpy.float16)}, path)
    with pytest.raises(ValueError, match=r"tensor a is F16: weights must be float32 or float64 \(F32, F64\); "
                                         r"convert float16 weights to float32 first$"):
        load_weights(path)


def test_init_weights_takes_such_a_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    path = old_transformers_file(tmp_path / "w.safetensors")
    run = train("--init-weights", path, "--n-layer", 2, "--n-head", 2, "--n-embd", 16, "--block-size", 16,
                "--vocab-size", 259, "--max-iters", "0", "--data", corpus, *RUN)
    assert run.returncode == 0, run.stderr
    assert "val loss" in run.stdout
