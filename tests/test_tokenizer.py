"""--tokenizer DIR: a byte-level BPE in GPT-2's two formats, the corpus's ids cached beside it, and a
run whose vocabulary follows the tokenizer. The tokenizer is trained here, on the test's text."""

import json
import os
import re
import subprocess
import sys

import numpy
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package (pip install 'minipar[gpt2]') is not installed")

from minipar import token_cache  # noqa: E402
from minipar.data import Dataset  # noqa: E402
from minipar.tokenizer import BPETokenizer  # noqa: E402

TEXT = "".join(f"def f{i}(x):\n    return x * {i}  # café\n" for i in range(200))
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--global-batch-size", "4",
        "--eval-iters", "1", "--plot", ""]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A directory with GPT-2's tokenizer.json layout, and one with its vocab.json + merges.txt."""
    root = tmp_path_factory.mktemp("bpe")
    (root / "text.txt").write_text(TEXT)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(root / "text.txt")], trainer)
    (root / "whole").mkdir()
    tok.save(str(root / "whole" / "tokenizer.json"))
    (root / "pair").mkdir()
    tok.model.save(str(root / "pair"))
    return str(root / "whole"), str(root / "pair")


def test_both_formats_encode_alike_and_decode_back(bpe):
    whole, pair = BPETokenizer(bpe[0]), BPETokenizer(bpe[1])
    assert whole.vocab_size == pair.vocab_size > 256 and whole.eos_id == 0
    ids = whole.encode(TEXT[:200])
    assert ids.dtype == numpy.uint16 and len(ids) < 200  # merges: fewer ids than characters
    assert numpy.array_equal(ids, pair.encode(TEXT[:200]))
    assert whole.decode(ids) == pair.decode(ids) == TEXT[:200]


def test_a_tokenizer_json_made_for_model_inputs_still_encodes_the_whole_corpus(bpe, tmp_path):
    """A tokenizer.json saved with truncation (max_length 16), padding and a post-processor that
    puts <|endoftext|> around each text: the corpus, one text, was cut to its first 16 tokens
    without a word, and would have been wrapped in special tokens."""
    tok = tokenizers.Tokenizer.from_file(os.path.join(bpe[0], "tokenizer.json"))
    tok.enable_truncation(max_length=16)
    tok.enable_padding(length=20000, pad_id=0, pad_token="<|endoftext|>")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A <|endoftext|>", special_tokens=[("<|endoftext|>", 0)])
    (tmp_path / "inputs").mkdir()
    tok.save(str(tmp_path / "inputs" / "tokenizer.json"))
    plain, for_inputs = BPETokenizer(bpe[0]), BPETokenizer(str(tmp_path / "inputs"))
    assert len(plain.encode(TEXT)) > 1000
    assert numpy.array_equal(for_inputs.encode(TEXT), plain.encode(TEXT))


def test_a_corpus_encoded_in_pieces_gets_the_whole_texts_ids(tmp_path, monkeypatch):
    """Encoded as one text, a 20 MB corpus took 3.5 GB on every rank; in pieces of a mebibyte, 0.35.
    A cut anywhere else would change the ids: " \n" before a word is two pre-tokens inside the
    text and one at a piece's end, which this tokenizer (trained on the text) merges into one id."""
    from minipar import tokenizer as module

    text = "".join(f"def f{i}(x):\n  \n\n    return x's {i}<|endoftext|>\n'll café \nz{i}\n" for i in range(300))
    (tmp_path / "text.txt").write_text(text)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(tmp_path / "text.txt")], tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    tokenizer = BPETokenizer(str(tmp_path / "tok"))
    whole = tokenizer._tok.encode(text, add_special_tokens=False).ids
    assert tokenizer._tok.encode(" \n").ids != tokenizer._tok.encode(" \nz").ids[:-1]  # the merge a bad cut makes
    monkeypatch.setattr(module, "PIECE", 7)  # a cut after nearly every line that allows one
    pieces = list(tokenizer._pieces(text))
    assert "".join(pieces) == text and len(pieces) >= 600
    assert tokenizer.encode(text).tolist() == whole
    monkeypatch.setattr(tokenizer._tok, "pre_tokenizer", tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True))
    assert len(list(tokenizer._pieces(text))) == 1  # a space put before each piece would change its ids


def test_a_decoded_sample_shows_where_a_document_ended(bpe):
    """<|endoftext|> is decoded, not dropped: a sample says where the model ended one text."""
    tokenizer = BPETokenizer(bpe[0])
    ids = [*tokenizer.encode("def f(x):"), tokenizer.eos_id, *tokenizer.encode("def g")]
    assert tokenizer.decode(ids) == "def f(x):<|endoftext|>def g"


def test_two_tokenizers_of_one_corpus_keep_their_own_cached_ids(bpe, tmp_path):
    """The cache is keyed by the tokenizer's files as well as the corpus: another vocabulary over
    the same text must not read the first one's ids."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train([str(corpus)], tokenizers.trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "smaller").mkdir()
    tok.save(str(tmp_path / "smaller" / "tokenizer.json"))
    for directory in (bpe[0], str(tmp_path / "smaller")):
        tokenizer = BPETokenizer(directory)
        data = Dataset(corpus.read_bytes(), tokenizer=tokenizer, path=str(corpus))
        assert numpy.array_equal(numpy.concatenate([data.splits["train"], data.splits["val"]]), tokenizer.encode(TEXT))
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".tokens")]) == 2


def test_the_corpus_is_tokenized_once_and_the_cache_verified(bpe, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    tokenizer = BPETokenizer(bpe[0])
    first = Dataset(corpus.read_bytes(), tokenizer=tokenizer, path=str(corpus))
    cached = [f for f in os.listdir(tmp_path) if f.endswith(".tokens")]
    assert len(cached) == 1 and cached[0].startswith(".corpus.txt.") and first.notes == []
    expected = tokenizer.encode(TEXT)
    assert numpy.array_equal(numpy.concatenate([first.splits["train"], first.splits["val"]]), expected)
    train_ids = numpy.array(first.splits["train"])  # a copy: the cache is damaged in place below
    with monkeypatch.context() as m:  # a second run reads the cache and tokenizes nothing
        m.setattr(tokenizer, "encode", lambda text: pytest.fail("tokenized again"))
        again = Dataset(corpus.read_bytes(), tokenizer=tokenizer, path=str(corpus))
    assert numpy.array_equal(again.splits["train"], train_ids)
    raw = bytearray((tmp_path / cached[0]).read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / cached[0]).write_bytes(bytes(raw))
    mended = Dataset(corpus.read_bytes(), tokenizer=tokenizer, path=str(corpus))
    assert "damaged" in mended.notes[0] and numpy.array_equal(mended.splits["train"], train_ids)
    # a corpus in a directory that cannot be written: the cache goes to the user's, and says so
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(token_cache.os, "access", lambda path, mode: False)
    elsewhere = Dataset(corpus.read_bytes(), tokenizer=tokenizer, path=str(corpus))
    assert "is not writable" in elsewhere.notes[0] and str(tmp_path / "cache" / "minipar") in elsewhere.notes[0]
    assert numpy.array_equal(elsewhere.splits["train"], train_ids)


def test_a_corpus_changed_in_place_is_tokenized_again(bpe, tmp_path):
    """The cache is keyed by the corpus's bytes as well as the tokenizer: a file edited under the
    same name must not be read back as its old ids."""
    corpus = tmp_path / "corpus.txt"
    tokenizer = BPETokenizer(bpe[0])
    for text in (TEXT, TEXT.replace("return", "yield")):
        corpus.write_text(text)
        data = Dataset(corpus.read_bytes(), tokenizer=tokenizer, path=str(corpus))
        ids = numpy.concatenate([data.splits["train"], data.splits["val"]])
        assert numpy.array_equal(ids, tokenizer.encode(text)), "the ids of the corpus before it changed"
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".tokens")]) == 2


def train(*args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "minipar.train", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def test_a_corpus_too_short_under_a_tokenizer_says_how_many_tokens_its_bytes_made(bpe, tmp_path):
    """A tokenizer can make far fewer tokens than the corpus has bytes (a normalizer that deletes
    text: none at all), so "too few tokens" alone would leave the user looking at a long file."""
    corpus = TEXT[:400].encode()
    data = Dataset(corpus, tokenizer=BPETokenizer(bpe[0]), path=str(tmp_path / "short.txt"))
    made = sum(map(len, data.splits.values()))
    assert made < 200
    said = rf"has \d+ tokens \(its tokenizer made {made} tokens of {len(corpus)} bytes\), too few for --block-size 200"
    with pytest.raises(ValueError, match=said + ": use a larger corpus or a smaller block size"):
        data.check_block_size(200)


def test_a_run_refused_for_its_flags_leaves_no_token_cache(bpe, tmp_path):
    """The corpus is tokenized before its length is known to be enough; the cache beside it, and
    the save directory, are written only once the run goes on (a refused run writes nothing)."""
    (tmp_path / "short.txt").write_text(TEXT[:400])
    run = train("--tokenizer", bpe[0], "--data", "short.txt", "--block-size", "200", "--max-iters", "1",
                "--save", "ck", cwd=tmp_path)
    assert run.returncode == 2 and "too few for --block-size 200" in run.stderr, run.stderr
    assert sorted(os.listdir(tmp_path)) == ["short.txt"]


def test_a_corpus_that_is_not_utf8_is_said_to_be_so(bpe, tmp_path):
    """Under a tokenizer its bytes that are not UTF-8 became U+FFFD without a word."""
    corpus = tmp_path / "latin1.txt"
    corpus.write_bytes(TEXT.encode() + "café".encode("latin-1") * 50)
    for _ in range(2):  # tokenized, then read from the cache: said both times
        data = Dataset(corpus.read_bytes(), tokenizer=BPETokenizer(bpe[0]), path=str(corpus))
        assert any(f"byte {len(TEXT.encode()) + 3} is the first that is not" in note for note in data.notes)


def altered_vocabulary(pair, folder, change):
    """A copy of the vocab.json + merges.txt tokenizer ``pair`` in ``folder``, its vocabulary
    ({token: id}) passed through ``change``."""
    import json
    import shutil

    os.makedirs(folder)
    shutil.copy(os.path.join(pair, "merges.txt"), folder)
    with open(os.path.join(pair, "vocab.json")) as fh:
        vocab = json.load(fh)
    with open(os.path.join(folder, "vocab.json"), "w") as fh:
        json.dump(change(vocab), fh)
    return str(folder)


def two_ids_swapped(vocab):
    a, b = sorted(vocab)[:2]
    return dict(vocab, **{a: vocab[b], b: vocab[a]})


@pytest.mark.parametrize("change,message", [  # each trained without a word, or failed later with a traceback
    (lambda v: dict(v, **{"Ġ5": v["d"]}), "the vocabulary's ids are not 0 .. 299, each once (300 tokens, 299 distinct"),
    (lambda v: {t: (5000 if i == len(v) - 1 else i) for t, i in v.items()}, "distinct ids from 0 to 5000"),
    (lambda v: {t: i for i, t in enumerate(sorted((t for t in v if t != "Ā"), key=v.get))},  # byte 0's symbol
     "the vocabulary lacks 1 of the 256 byte-level symbols (such as 'Ā')"),
])
def test_a_vocabulary_that_cannot_encode_every_text_one_way_is_refused(bpe, tmp_path, change, message):
    """Ids shared by two tokens encoded one text differently from run to run; ids beyond the
    vocabulary broke the cache of uint16 ids; a missing byte symbol dropped text silently."""
    folder = altered_vocabulary(bpe[1], tmp_path / "tok", change)
    with pytest.raises(ValueError, match=re.escape(message)):
        BPETokenizer(folder)


def test_a_snapshot_starts_only_with_its_own_tokenizers_ids_and_an_export_spares_the_tokenizer(bpe, tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    snap = tmp_path / "snap"
    assert train(*TINY, "--tokenizer", bpe[0], "--data", "corpus.txt", "--max-iters", "1", "--export-hf", "snap",
                 cwd=tmp_path).returncode == 0
    swapped = altered_vocabulary(bpe[1], tmp_path / "swapped", two_ids_swapped)
    run = train("--init-weights", "snap", "--tokenizer", swapped, "--data", "corpus.txt", "--max-iters", "0",
                "--eval-iters", "1", "--sample", "0", "--plot", "", cwd=tmp_path)
    assert run.returncode == 2 and f"--tokenizer {swapped} gives tokens other ids than the tokenizer in " \
        "--init-weights snap" in run.stderr, run.stderr
    before = (snap / "model.safetensors").read_bytes()
    run = train(*TINY, "--tokenizer", "snap", "--data", "corpus.txt", "--max-iters", "1", "--export-hf", "snap",
                cwd=tmp_path)
    assert run.returncode == 2 and "--export-hf snap would write into --tokenizer snap" in run.stderr, run.stderr
    assert (snap / "model.safetensors").read_bytes() == before


def test_a_run_takes_its_vocabulary_from_the_tokenizer_and_samples_text(bpe, tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    run = train(*TINY, "--tokenizer", bpe[1], "--data", "corpus.txt", "--max-iters", "2", "--sample", "8",
                "--prompt", "def", "--export-hf", "out", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    sample = run.stdout.split("sample:\n", 1)[1]
    assert sample.startswith("def") and len(sample.strip()) > len("def")  # 8 ids more, decoded as text
    config = json.load(open(tmp_path / "out" / "config.json"))
    assert config["vocab_size"] == BPETokenizer(bpe[1]).vocab_size and config["eos_token_id"] == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "merges.txt", "model.safetensors", "vocab.json"]
    run = train(*TINY, "--tokenizer", bpe[0], "--vocab-size", "256", "--data", "corpus.txt", "--max-iters", "1",
                cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert f"--vocab-size 256 disagrees with --tokenizer {bpe[0]}'s vocabulary" in lines[0]


def test_ranks_agree_on_a_tokenizer_by_its_files(bpe, tmp_path):
    """Every rank loads the tokenizer itself; the ranks compare it by its files' bytes, not the object."""
    from mpi_run import run_train

    (tmp_path / "corpus.txt").write_text(TEXT)
    code, out, _ = run_train(2, *TINY, "--tokenizer", bpe[0], "--data", str(tmp_path / "corpus.txt"),
                             "--max-iters", "1", "--sample", "0")
    assert code == 0 and "iter     0" in out, out


def test_a_resume_makes_its_tokens_as_the_run_it_continues(bpe, tmp_path):
    """A checkpoint records what made its tokens (bytes, or its tokenizer's files): the same text
    under another tokenizer would be other tokens, so the resume is refused in one line."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    common = [*TINY, "--data", "corpus.txt", "--lr-decay-iters", "4", "--sample", "0"]
    assert train(*common, "--tokenizer", bpe[0], "--max-iters", "2", "--save", "ck", cwd=tmp_path).returncode == 0
    run = train(*common, "--vocab-size", "300", "--max-iters", "4", "--load", "ck", cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "trained on tokens of a tokenizer of sha256 " in lines[0] and "this run makes them of bytes" in lines[0]
    assert train(*common, "--tokenizer", bpe[0], "--max-iters", "4", "--load", "ck", cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("mode", ["all-miss", "some-miss", "trainer"])
def test_a_corpus_the_cache_lacks_is_tokenized_once_for_every_rank(bpe, tmp_path, mode):
    """8 ranks on a host used to tokenize the corpus 8 times at once (8 times the cores and the
    memory): rank 0 alone encodes it, or sends the ids it has cached, and every rank ends with them,
    mapped from one cache file per corpus path (each rank wrote its own before)."""
    from mpi_run import run_mpi

    code, out, _ = run_mpi(3, "shared_tokens.py", bpe[0], str(tmp_path / "work"), mode)
    assert code == 0 and "ok" in out, out


def test_a_resume_by_another_tokenizing_recipe_is_refused(bpe, tmp_path):
    """The same tokenizer files read another way (``token_cache.RECIPE``: a tokenizer.json's
    truncation once cut the corpus) make other tokens of the same text: a checkpoint records its
    recipe, a run that would train on is refused in one line, and one that trains nothing (an
    export) is not."""
    from minipar.checkpoint.index import seal

    (tmp_path / "corpus.txt").write_text(TEXT)
    common = [*TINY, "--tokenizer", bpe[0], "--data", "corpus.txt", "--lr-decay-iters", "4", "--sample", "0"]
    assert train(*common, "--max-iters", "2", "--save", "ck", cwd=tmp_path).returncode == 0
    path = tmp_path / "ck" / "iter_0000002" / "index.json"
    index = json.loads(path.read_text())
    assert index["trainer"]["token_recipe"] == token_cache.RECIPE
    index["trainer"]["token_recipe"] = token_cache.RECIPE - 1
    path.write_text(json.dumps(seal(index)))
    run = train(*common, "--max-iters", "4", "--load", "ck", cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert f"made by minipar's tokenizing recipe {token_cache.RECIPE - 1}, this minipar makes recipe" in lines[0]
    exported = train(*common, "--max-iters", "0", "--load", "ck", "--export-weights", "w.safetensors", cwd=tmp_path)
    assert exported.returncode == 0 and (tmp_path / "w.safetensors").exists(), exported.stderr
