"""Review of the Hugging Face interop and the data path: each test here failed before its fix
(or pins a behaviour checked by hand against transformers 5.25, noted where so). Fast: no
training runs, no MPI."""

import errno
import os
import re
import sys
import tracemalloc

import numpy
import pytest

from minipar import token_cache
from minipar.checkpoint import hf
from minipar.data import Dataset
from test_hf import CONFIG, minipar_state, transformers_tensors


# ---- minipar/checkpoint/hf.py ----------------------------------------------------------------------

def test_a_tensor_under_both_key_prefixes_is_refused_by_name():
    """``h.0.ln_1.weight`` and ``transformer.h.0.ln_1.weight`` are one parameter: a file with both
    (and different values) loaded whichever came last, without a word."""
    tensors = transformers_tensors(minipar_state())
    tensors["h.0.ln_1.weight"] = tensors["transformer.h.0.ln_1.weight"] + 1
    with pytest.raises(ValueError, match=r"holds both h\.0\.ln_1\.weight and transformer\.h\.0\.ln_1\.weight"):
        hf.from_hf(tensors)


def test_a_head_without_an_embedding_is_not_called_untied():
    """A file with lm_head.weight and no wte was refused as "untied": the missing tensor is what
    the user must hear of (named by the caller's missing-key check), so from_hf lets it through."""
    tensors = transformers_tensors(minipar_state())
    del tensors["transformer.wte.weight"]
    assert "transformer.wte.weight" not in hf.from_hf(tensors)


def test_a_head_of_another_shape_says_both_shapes():
    tensors = transformers_tensors(minipar_state())
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1]
    with pytest.raises(ValueError, match=r"lm_head\.weight has shape \(258, 16\) and transformer\.wte\.weight "
                                         r"\(259, 16\)"):
        hf.from_hf(tensors)


def test_an_export_that_cannot_be_renamed_into_place_keeps_the_previous_one(tmp_path, monkeypatch):
    """The previous export was moved aside, then the rename of the new one failed (a full
    directory, Ctrl-C between the two): the folder was gone, its files left in a hidden .old-hf-*."""
    out = str(tmp_path / "out")
    hf.save_snapshot(minipar_state(0), CONFIG, out)
    before = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    real = os.replace

    def replace(a, b):
        if b == out and os.path.basename(a).startswith(".tmp-hf-"):
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        hf.save_snapshot(minipar_state(1), CONFIG, out)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary, no moved-aside export left
    assert {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)} == before


def test_buffers_of_any_dtype_are_skipped_in_a_snapshot(tmp_path):
    """transformers 4.27-4.30 kept the causal mask as a bool buffer: a snapshot directory skips it
    by name before its dtype is judged (checked here so that it stays so)."""
    from test_hf import write_snapshot

    tensors = transformers_tensors(minipar_state(), buffers=False)
    for i in range(CONFIG.n_layer):
        tensors[f"transformer.h.{i}.attn.bias"] = numpy.tril(numpy.ones((16, 16), bool))[None, None]
    state, flags, _ = hf.load_snapshot(write_snapshot(tmp_path / "snap", tensors))
    assert set(state) == set(minipar_state()) and flags["n_layer"] == 2


def test_a_key_outside_gpt2s_body_keeps_the_files_own_name():
    """from_hf put transformer. before every key without it: a GPT2ForSequenceClassification's
    score.weight was then refused as transformer.score.weight, a name the file does not hold."""
    for prefix in (True, False):
        tensors = transformers_tensors(minipar_state(), prefix=prefix)
        tensors["score.weight"] = numpy.zeros((2, CONFIG.n_embd), numpy.float32)
        state = hf.from_hf(tensors)
        assert "score.weight" in state and "transformer.score.weight" not in state
        assert set(state) - {"score.weight"} == set(minipar_state())  # h.0..., wte...: still GPT-2's names


@pytest.mark.parametrize("cls,heads", [("GPT2ForSequenceClassification", ["score.weight"]),
                                       ("GPT2DoubleHeadsModel", ["multiple_choice_head.summary.weight",
                                                                 "multiple_choice_head.summary.bias"])])
def test_a_task_models_heads_are_refused_naming_its_class(cls, heads, tmp_path):
    """A task model's snapshot holds GPT-2's body and heads minipar's GPT has not: the refusal says
    which class the file is, and how to save the body alone (which then loads)."""
    from test_hf import write_snapshot

    body = transformers_tensors(minipar_state())
    tensors = dict(body, **{name: numpy.zeros((1, CONFIG.n_embd), numpy.float32) for name in heads})
    snap = write_snapshot(tmp_path / "task", tensors, architectures=[cls])
    expected = (f"{snap} is a {cls} (config.json's architectures): its model.safetensors holds heads GPT2LMHeadModel "
                f"has not ({', '.join(sorted(heads))}), and minipar reads GPT2LMHeadModel / GPT2Model snapshots: save "
                "the GPT-2 body alone, model.transformer.save_pretrained(DIR)")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        hf.load_snapshot(snap)
    state, _, _ = hf.load_snapshot(write_snapshot(tmp_path / "body", body, architectures=[cls]))  # heads removed
    assert set(state) == set(minipar_state())


def weightless_snapshot(directory):
    """A snapshot folder with a valid config.json and no model.safetensors yet."""
    from test_hf import write_snapshot

    write_snapshot(directory, transformers_tensors(minipar_state()))
    os.remove(directory / "model.safetensors")
    return directory


@pytest.mark.parametrize("name", ["pytorch_model.bin", "pytorch_model.bin.index.json"])
def test_a_pickle_only_snapshot_is_told_how_to_resave_it(name, tmp_path):
    """Only "has no model.safetensors" was said of a snapshot in transformers' older, pickled format.
    The file here is no pickle at all: it must not be opened, only seen."""
    snap = weightless_snapshot(tmp_path / "snap")
    (snap / name).write_bytes(b"not read")
    expected = (f"{snap} has no model.safetensors: it holds {name} (a pickle, which minipar never loads): "
                "re-save it with save_pretrained(..., safe_serialization=True)")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        hf.load_snapshot(str(snap))
    os.remove(snap / name)
    with pytest.raises(ValueError, match=f"^{re.escape(str(snap))} has no model.safetensors$"):  # nothing to hint at
        hf.load_snapshot(str(snap))


@pytest.mark.timeout(30)  # a FIFO read would block: fail in seconds, not at the suite's 600
@pytest.mark.parametrize("kind", ["fifo", "folder", "broken link"])
def test_a_model_safetensors_that_is_no_file_is_not_called_missing(kind, tmp_path):
    """A FIFO (or a folder) named model.safetensors was reported as "has no model.safetensors"."""
    snap = weightless_snapshot(tmp_path / "snap")
    path = snap / "model.safetensors"
    {"fifo": os.mkfifo, "folder": os.mkdir, "broken link": lambda p: os.symlink(tmp_path / "blob", p)}[kind](path)
    expected = (f"{path} is a link to {tmp_path / 'blob'}, which does not exist" if kind == "broken link"
                else f"{path}: not a regular file")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        hf.load_snapshot(str(snap))


# ---- minipar/tokenizer.py --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair_and_whole(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("bpe")
    text = "".join(f"def f{i}(x):\n    return x * {i}  # café\n" for i in range(100))
    (root / "text.txt").write_text(text)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    tok.train([str(root / "text.txt")], tokenizers.trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet))
    (root / "whole").mkdir()
    tok.save(str(root / "whole" / "tokenizer.json"))
    (root / "pair").mkdir()
    tok.model.save(str(root / "pair"))
    return str(root / "pair"), str(root / "whole")


EDGES = ["", " ", "   ", "\n\n\n", "a  b   c\t\td", "héllo wörld ✓ 😀 中文", "\r\n\r\n", "\0\x01", "'s 've n't",
         "trailing   ", "\u00a0nbsp \ufeffbom a\u2028b", "<|endoftext|>", "x<|endoftext|>y", " <|endoftext|> \n"]


@pytest.mark.parametrize("text", EDGES)
def test_both_formats_encode_edge_cases_alike_and_decode_back(pair_and_whole, text):
    """vocab.json + merges.txt read <|endoftext|> in the text as 13 bytes' tokens, where
    tokenizer.json (and transformers' GPT2Tokenizer from either format, checked by hand with
    transformers 5.25) read it as the one special token: one tokenizer, two encodings of a corpus
    with document separators."""
    from minipar.tokenizer import BPETokenizer

    pair, whole = BPETokenizer(pair_and_whole[0]), BPETokenizer(pair_and_whole[1])
    a, b = pair.encode(text), whole.encode(text)
    assert a.dtype == numpy.uint16 and a.tolist() == b.tolist()
    assert pair.decode(a) == whole.decode(b) == text
    if "<|endoftext|>" in text:
        assert a.tolist().count(pair.eos_id) == 1


def test_a_missing_tokenizers_package_is_named_with_its_extra(monkeypatch, tmp_path):
    from minipar.tokenizer import BPETokenizer

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import raises ImportError
    with pytest.raises(ValueError, match=r"needs the tokenizers package: pip install 'minipar\[gpt2\]'"):
        BPETokenizer(str(tmp_path))


# ---- minipar/token_cache.py ------------------------------------------------------------------------

class _Bytes:
    """A tokenizer of bytes, as minipar.tokenizer's interface has it (no tokenizers package)."""
    sha256 = "0" * 64

    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return numpy.frombuffer(text.encode(), numpy.uint8).astype(numpy.uint16)


def test_a_cache_that_cannot_be_written_leaves_the_run_its_ids(tmp_path, monkeypatch):
    """A full disk (or a quota) while the cache was written stopped the run, although its tokens
    were made: they are used from memory, and the run says the cache was not kept."""
    corpus = b"def f(x):\n    return x\n" * 20
    path = tmp_path / "corpus.txt"
    path.write_bytes(corpus)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(token_cache, "write_file", full)
    data = Dataset(corpus, tokenizer=_Bytes(), path=str(path))
    ids = numpy.concatenate([data.splits["train"], data.splits["val"]])
    assert ids.tolist() == list(corpus)
    assert any("could not be written (No space left on device)" in note for note in data.notes), data.notes
    assert [f for f in os.listdir(tmp_path) if f != "corpus.txt"] == []


def test_a_deferred_cache_is_written_when_kept_and_then_read_from_the_file(tmp_path):
    """The trainer writes the cache only once its run goes on (``defer_cache``); then its ids are
    the cache's memmap, as a run that found the cache has them, not a copy in every rank's memory."""
    corpus = b"def f(x):\n    return x\n" * 20
    path = tmp_path / "corpus.txt"
    path.write_bytes(corpus)
    data = Dataset(corpus, tokenizer=_Bytes(), path=str(path), defer_cache=True)
    assert os.listdir(tmp_path) == ["corpus.txt"] and not isinstance(data.splits["train"], numpy.memmap)
    data.keep_cache()
    assert len(os.listdir(tmp_path)) == 2 and isinstance(data.splits["train"], numpy.memmap)
    ids = numpy.concatenate([data.splits["train"], data.splits["val"]])
    assert ids.tolist() == list(corpus)


def test_the_cache_is_verified_without_a_copy_of_its_ids(tmp_path):
    """The check of a cache's SHA-256 made a bytes copy of every id (``tobytes``): the memmap is
    there so that a large corpus's ids need not all sit in memory."""
    corpus = bytes(range(128)) * 16384  # 2 MiB of ASCII text: 4 MiB of uint16 ids
    path = tmp_path / "corpus.txt"
    path.write_bytes(corpus)
    tokenizer = _Bytes()
    Dataset(corpus, tokenizer=tokenizer, path=str(path))
    (cache,) = [f for f in os.listdir(tmp_path) if f.endswith(".tokens")]
    tracemalloc.start()
    try:
        ids = token_cache._read(str(tmp_path / cache))  # noqa: SLF001
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ids is not None and len(ids) == len(corpus) and peak < 1 << 20, peak


# ---- minipar/data.py -------------------------------------------------------------------------------

def test_a_split_of_exactly_one_window_is_taken():
    """block_size + 1 tokens are one window and its targets; check_block_size asked for one more."""
    data = Dataset(bytes(range(17)) * 9 + bytes(range(17)), val_fraction=0.1)  # 170 tokens: val 17
    assert len(data.splits["val"]) == 17
    data.check_block_size(16)
    x, y = data.batch("val", 0, batch_size=2, block_size=16, seed=0)
    assert x[0].tolist() == list(range(16)) and y[0].tolist() == list(range(1, 17))
    with pytest.raises(ValueError, match="the val split has 17 tokens, too few for --block-size 17"):
        data.check_block_size(17)


def test_data_parallel_ranks_take_disjoint_rows_of_one_global_batch():
    """The batch of a step is drawn whole from (seed, split, step), then cut: every DP rank's rows
    (per micro-batch) are its own, and together they are the global batch, whatever the layout."""
    from minipar.rng import rows_of

    data = Dataset(bytes(range(256)) * 40)
    x, _ = data.batch("train", 5, batch_size=8, block_size=16, seed=3)
    for dp, micro in ((1, 1), (2, 1), (2, 2), (4, 2)):
        taken = [int(r) for i in range(micro) for rank in range(dp) for r in rows_of(8, (i, micro), (rank, dp))]
        assert sorted(taken) == list(range(8)), (dp, micro)  # each row once: no overlap, none left out
    again, _ = data.batch("train", 5, batch_size=8, block_size=16, seed=3)
    other, _ = data.batch("train", 5, batch_size=8, block_size=16, seed=4)
    assert numpy.array_equal(x, again) and not numpy.array_equal(x, other)
