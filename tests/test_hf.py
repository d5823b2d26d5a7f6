"""Hugging Face GPT-2 snapshots in and out, without the network, torch or transformers: the test
writes a tiny snapshot in transformers' layout itself (Conv1D weights (in, out), keys with or
without ``transformer.``, the tied ``lm_head.weight``, the ``attn.bias`` buffers)."""

import json
import os
import subprocess
import sys

import numpy
import pytest
from safetensors.numpy import load_file, save_file

import minipar
from minipar.checkpoint import hf, load_weights
from minipar.models import GPT, GPTConfig
from mpi_run import run_train

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=259)  # 259: TP pads it
RUN = ["--global-batch-size", "4", "--eval-iters", "1", "--sample", "0", "--plot", ""]
# transformers' Conv1D layers, (in, out), written here from its documentation, not from minipar's list
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def minipar_state(seed=0):
    minipar.manual_seed(seed)
    return GPT(CONFIG).state_dict()


def transformers_tensors(state, prefix=True, head=True, buffers=True):
    """``state`` as transformers saves a GPT2LMHeadModel (or, prefix=False, a GPT2Model)."""
    out = {}
    for name, value in state.items():
        key = name if prefix else name.removeprefix("transformer.")
        out[key] = numpy.ascontiguousarray(value.T if name.endswith(CONV1D) else value)
    T = CONFIG.block_size
    for i in range(CONFIG.n_layer) if buffers else ():
        out[f"{'transformer.' if prefix else ''}h.{i}.attn.bias"] = numpy.tril(numpy.ones((T, T), numpy.float32))[None, None]
        out[f"{'transformer.' if prefix else ''}h.{i}.attn.masked_bias"] = numpy.array(-1e4, numpy.float32)
    if head:
        out["lm_head.weight"] = state["transformer.wte.weight"].copy()
    return out


def write_snapshot(directory, tensors, **config):
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    fields = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": CONFIG.vocab_size,
              "n_positions": CONFIG.block_size, "n_ctx": CONFIG.block_size, "n_embd": CONFIG.n_embd,
              "n_layer": CONFIG.n_layer, "n_head": CONFIG.n_head, "n_inner": None, "activation_function": "gelu_new",
              "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5,
              "initializer_range": 0.02, "bos_token_id": 50256, "eos_token_id": 50256, **config}
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(fields, fh)
    return str(directory)


def train(*args, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "minipar.train", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    return str(path)


def test_conv1d_weights_are_transposed_and_both_key_prefixes_read():
    state = minipar_state()
    for prefix in (True, False):
        loaded = hf.from_hf(transformers_tensors(state, prefix=prefix))
        assert set(loaded) == set(state)  # no lm_head, no attn.bias buffers
        for name, value in state.items():
            assert loaded[name].tobytes() == value.tobytes() and loaded[name].shape == value.shape, name
    written = hf.to_hf(state)
    C = CONFIG.n_embd
    assert written["transformer.h.0.attn.c_attn.weight"].shape == (C, 3 * C)  # Conv1D: (in, out)
    assert written["transformer.h.1.mlp.c_proj.weight"].shape == (4 * C, C)
    assert written["transformer.h.0.attn.c_attn.bias"].shape == (3 * C,)
    assert "lm_head.weight" not in written
    assert hf.is_hf_layout(written) and not hf.is_hf_layout(state)


def test_config_json_says_what_the_model_computes(tmp_path):
    """Every field transformers' GPT2Config reads that minipar decides: the sizes (positions and
    width apart, n_ctx the positions as GPT-2's own file has it), the dropout in all three places,
    LayerNorm's epsilon, the tied head; and it reads back as the same flags."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=259)
    hf.save_snapshot(GPT(config).state_dict(), config, str(tmp_path / "out"), dropout=0.2)
    written = json.load(open(tmp_path / "out" / "config.json"))
    expected = dict(n_layer=2, n_head=2, n_embd=32, n_positions=16, n_ctx=16, vocab_size=259, n_inner=None,
                    resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2, layer_norm_epsilon=1e-5,
                    tie_word_embeddings=True, activation_function="gelu_new", model_type="gpt2")
    assert {k: written.get(k) for k in expected} == expected and written["torch_dtype"] == "float32"
    assert hf.read_config(str(tmp_path / "out"))[0] == dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=259)
    wide = {name: value.astype(numpy.float64) for name, value in GPT(config).state_dict().items()}
    hf.save_snapshot(wide, config, str(tmp_path / "out64"))  # the dtype its tensors are written in
    assert json.load(open(tmp_path / "out64" / "config.json"))["torch_dtype"] == "float64"


def test_an_untied_head_is_refused():
    tensors = transformers_tensors(minipar_state())
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="untied"):
        hf.from_hf(tensors)


def test_a_snapshot_converts_and_round_trips_bit_for_bit(tmp_path, corpus):
    state = minipar_state()
    tensors = transformers_tensors(state, prefix=False)  # the original gpt2 snapshot's layout
    snap = write_snapshot(tmp_path / "snap", tensors)
    out = tmp_path / "out"
    run = train("--init-weights", snap, "--max-iters", "0", "--export-hf", out, "--data", corpus, *RUN)
    assert run.returncode == 0, run.stderr  # no model flags given: config.json's (the defaults would not fit)
    assert "val loss" in run.stdout
    exported = load_file(str(out / "model.safetensors"))
    expected = transformers_tensors(state, prefix=True, head=False, buffers=False)
    assert set(exported) == set(expected)
    for name, value in expected.items():
        assert exported[name].dtype == numpy.float32 and exported[name].tobytes() == value.tobytes(), name
    config = json.load(open(out / "config.json"))
    assert (config["n_layer"], config["n_positions"], config["vocab_size"], config["eos_token_id"]) == (2, 16, 259, 50256)
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["activation_function"] == "gelu_new"
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt", "out", "snap"]  # no temporary left behind
    # the single file, in transformers' layout, with the model flags given: the same weights again
    again = tmp_path / "again"
    run = train("--init-weights", out / "model.safetensors", "--n-layer", 2, "--n-head", 2, "--n-embd", 16,
                "--block-size", 16, "--vocab-size", 259, "--max-iters", "0", "--export-hf", again,
                "--data", corpus, *RUN)
    assert run.returncode == 0, run.stderr
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


@pytest.mark.parametrize("flags,config,message", [
    (["--n-layer", "3"], {}, "--n-layer 3 disagrees with SNAP/config.json's n_layer 2: drop --n-layer"),
    (["--vocab-size", "300"], {}, "--vocab-size 300 disagrees with SNAP/config.json's vocab_size 259"),
    ([], {"activation_function": "relu"}, "activation_function is 'relu'; minipar computes 'gelu_new' only"),
    ([], {"n_inner": 48}, "n_inner is 48; minipar's MLP is 4 x n_embd = 64 wide"),
    ([], {"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon is 1e-06"),
    # these four were said of flags nobody typed ("--n-layer must be a positive integer, got 0")
    ([], {"n_layer": 0}, "SNAP/config.json: n_layer 0: a model's sizes are whole numbers >= 1"),
    ([], {"n_head": 3}, "SNAP/config.json: n_embd 16 is not divisible by n_head 3"),
    ([], {"n_embd": 32, "n_head": 2}, "its model.safetensors does not hold the model its config.json describes"),
    ([], {"NaN": ("transformer.h.0.attn.c_attn.weight",)},
     "transformer.h.0.attn.c_attn.weight holds NaN or infinite values: a run starts from finite"),
    # the tied head's NaN at the embedding's: said to be untied, since NaN != NaN
    ([], {"NaN": ("transformer.wte.weight", "lm_head.weight")}, "transformer.wte.weight holds NaN or infinite"),
    (["--num-experts", "4"], {}, "--init-weights SNAP: GPT-2 has dense MLPs, and this model has --num-experts 4"),
    # a key without transformer. that is no GPT2Model module: named as the file has it, not transformer.score.weight
    ([], {"extra": "score.weight"}, "--init-weights SNAP: unexpected: score.weight; its model.safetensors does not"),
    ([], {"eos_token_id": "</s>"}, 'SNAP/config.json: eos_token_id is "</s>", not a token id'),
    ([], {"extra": "score.weight", "architectures": ["GPT2ForSequenceClassification"]},
     "SNAP is a GPT2ForSequenceClassification (config.json's architectures): its model.safetensors holds heads "
     "GPT2LMHeadModel has not (score.weight), and minipar reads GPT2LMHeadModel / GPT2Model snapshots"),
])
def test_a_snapshot_the_run_cannot_take_is_one_line(flags, config, message, tmp_path, corpus):
    tensors = transformers_tensors(minipar_state())
    for name in config.pop("NaN", ()):  # once exported again with exit status 0 under --max-iters 0
        tensors[name][0, 0] = numpy.nan
    if "extra" in config:  # a task model's head, as GPT2ForSequenceClassification saves it: (labels, n_embd)
        tensors[config.pop("extra")] = numpy.zeros((2, CONFIG.n_embd), numpy.float32)
    snap = write_snapshot(tmp_path / "snap", tensors, **config)
    run = train("--init-weights", snap, *flags, "--max-iters", "0", "--data", corpus, *RUN)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert message.replace("SNAP", snap) in lines[0]


def test_a_corpus_too_short_for_the_snapshots_positions_names_config_json(tmp_path):
    """n_positions came from config.json, which no --block-size may contradict: the fix is a
    larger corpus, and the message must not send the user to a flag they never typed."""
    snap = write_snapshot(tmp_path / "snap", transformers_tensors(minipar_state()))
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)  # a validation split of 10 bytes, for sequences of 16
    run = train("--init-weights", snap, "--max-iters", "0", "--data", short, *RUN)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert (f"the val split has 10 tokens, too few for sequences of 16 tokens ({snap}/config.json's "
            "n_positions): use a larger corpus") in lines[0] and "--block-size" not in lines[0]


def test_a_mixture_of_experts_is_not_exported_as_gpt2(tmp_path, corpus):
    out = str(tmp_path / "hf")
    run = train("--num-experts", "4", "--max-iters", "1", "--export-hf", out, "--data", corpus, *RUN)
    assert run.returncode == 2 and "GPT-2 has dense MLPs, and this model has --num-experts 4" in run.stderr
    assert not os.path.exists(out)


def test_a_tensor_parallel_checkpoint_exports_what_one_rank_exports(tmp_path, corpus):
    """Two steps on TP=2 (the vocabulary 259 padded to 260 in memory), saved sharded; its export,
    the export of the same checkpoint loaded on one rank, and its minipar weights are equal."""
    snap = write_snapshot(tmp_path / "snap", transformers_tensors(minipar_state()))
    save, tp2, one, weights = (tmp_path / name for name in ("save", "tp2", "one", "w.safetensors"))
    code, out, _ = run_train(2, "--tp", 2, "--init-weights", snap, "--max-iters", 2, "--save", save,
                             "--export-hf", tp2, "--export-weights", weights, "--data", corpus, *RUN)
    assert code == 0, out
    run = train("--load", save, "--n-layer", 2, "--n-head", 2, "--n-embd", 16, "--block-size", 16,
                "--vocab-size", 259, "--max-iters", 0, "--export-hf", one, "--data", corpus, *RUN)
    assert run.returncode == 0, run.stderr
    a, b = load_file(str(tp2 / "model.safetensors")), load_file(str(one / "model.safetensors"))
    trained = load_weights(str(weights))
    assert a["transformer.wte.weight"].shape == (259, 16)
    assert not numpy.array_equal(trained["transformer.wte.weight"], minipar_state()["transformer.wte.weight"])
    for name, value in transformers_tensors(trained, head=False, buffers=False).items():
        assert a[name].tobytes() == value.tobytes() == b[name].tobytes(), name


@pytest.mark.timeout(30)  # a FIFO read would block: fail in seconds, not at the suite's 600
@pytest.mark.parametrize("kind", ["fifo", "nested", "list"])
def test_a_config_json_that_is_no_settings_object_is_one_line(kind, tmp_path):
    """A FIFO blocked the read forever; JSON nested too deep was a RecursionError traceback."""
    path = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("[" * 100_000 + "]" * 100_000 if kind == "nested" else "[1, 2]")
    expected = {"fifo": "not a regular file", "nested": "not a readable JSON file (RecursionError",
                "list": "a JSON list, not an object of a model's settings"}[kind]
    with pytest.raises(ValueError, match=f"^{path}: " + expected.replace("(", r"\(")):
        hf.read_config(str(tmp_path))


def test_an_export_is_refused_through_a_link_or_over_an_input(tmp_path, corpus):
    """The export, renamed into place, replaced a link with a folder, and a folder holding the
    run's own weights or tokenizer with the new export."""
    os.mkdir(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    snap = write_snapshot(tmp_path / "snap", transformers_tensors(minipar_state()))
    run = train("--max-iters", "0", "--data", corpus, *RUN, "--export-hf", tmp_path / "link")
    assert run.returncode == 2 and f"--export-hf {tmp_path / 'link'}: is a link (to {tmp_path / 'real'}): give the " \
        "folder itself" in run.stderr, run.stderr
    run = train("--init-weights", f"{snap}/model.safetensors", "--n-layer", 2, "--n-head", 2, "--n-embd", 16,
                "--block-size", 16, "--vocab-size", 259, "--max-iters", "0", "--data", corpus, *RUN, "--export-hf", snap)
    assert run.returncode == 2 and f"--init-weights {snap}/model.safetensors is inside --export-hf {snap}, which " \
        "the export replaces whole" in run.stderr, run.stderr
    assert os.path.islink(tmp_path / "link") and os.listdir(tmp_path / "real") == []


def test_a_folder_without_config_json_is_named_as_such(tmp_path):
    """An empty folder once read as "config.json: not a readable JSON file ([Errno 2] ...)"."""
    with pytest.raises(ValueError, match=f"^{tmp_path} has no config.json: a Hugging Face GPT-2 snapshot holds"):
        hf.read_config(str(tmp_path))


def test_a_snapshots_vocabulary_too_small_for_bytes_is_named_by_its_file(tmp_path):
    """No --vocab-size was given: the error names where the 11 came from, the snapshot's config."""
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11)
    hf.save_snapshot(GPT(config).state_dict(), config, str(tmp_path / "small"))
    run = train("--init-weights", str(tmp_path / "small"), "--max-iters", "1", "--sample", "0", "--plot", "")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert f"{tmp_path / 'small' / 'config.json'}'s vocab_size 11: the byte-level tokens need at least 256" in lines[0]


def test_an_export_is_on_disk_before_its_name_is(tmp_path, monkeypatch):
    """The snapshot's folder is synced, its files named in it, before it is renamed into place,
    and its parent after: only the files themselves were synced, so a power cut after the rename
    could leave the export's name on an empty folder (or the previous export's)."""
    events = []
    real_replace = os.replace
    monkeypatch.setattr(hf, "fsync_dir", lambda d: events.append(("sync", d, sorted(os.listdir(d)))))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", a, b)), real_replace(a, b))[1])
    out = str(tmp_path / "out")
    for _ in range(2):  # a new export, then one over it
        events.clear()
        hf.save_snapshot(minipar_state(), CONFIG, out)
        (tmp,) = [a for kind, a, b in events if kind == "replace" and b == out]  # the one rename into place
        renamed = events.index(("replace", tmp, out))
        assert ("sync", tmp, ["config.json", "model.safetensors"]) in events[:renamed], events
        assert [e[:2] for e in events[renamed:] if e[0] == "sync"] == [("sync", str(tmp_path))], events
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_a_checkpoint_of_a_snapshot_exports_the_snapshots_token_ids(tmp_path, corpus):
    """The bos/eos ids come from the snapshot's config.json; a checkpoint keeps them, so converting
    it later (--load, no --init-weights, no --tokenizer) writes them, not null."""
    snap = write_snapshot(tmp_path / "snap", transformers_tensors(minipar_state()))
    save = tmp_path / "ckpt"
    run = train("--init-weights", snap, "--max-iters", "1", "--save", save, "--data", corpus, *RUN)
    assert run.returncode == 0, run.stderr
    out = tmp_path / "out"
    run = train("--load", save, "--n-layer", 2, "--n-head", 2, "--n-embd", 16, "--block-size", 16,
                "--vocab-size", 259, "--max-iters", "0", "--export-hf", out, "--data", corpus, *RUN)
    assert run.returncode == 0, run.stderr
    config = json.load(open(out / "config.json"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (50256, 50256)


def test_a_list_of_end_tokens_goes_through_a_checkpoint(tmp_path, corpus):
    """transformers lets eos_token_id be a list: a run from such a snapshot saves checkpoints its
    own resume takes (they were refused as malformed), and exports the list."""
    snap = write_snapshot(tmp_path / "snap", transformers_tensors(minipar_state()), eos_token_id=[10, 0])
    save, out = tmp_path / "ckpt", tmp_path / "out"
    assert train("--init-weights", snap, "--max-iters", "1", "--save", save, "--data", corpus, *RUN).returncode == 0
    run = train("--load", save, "--n-layer", 2, "--n-head", 2, "--n-embd", 16, "--block-size", 16,
                "--vocab-size", 259, "--max-iters", "2", "--use-checkpoint-opt_param-scheduler", "--export-hf", out,
                "--data", corpus, *RUN)
    assert run.returncode == 0, run.stderr
    assert json.load(open(out / "config.json"))["eos_token_id"] == [10, 0]
