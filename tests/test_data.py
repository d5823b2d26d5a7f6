import os

import numpy
import pytest

from minipar.data import VOCAB_SIZE, Dataset, decode, default_corpus_files, encode, load_corpus


def test_byte_tokenizer_round_trip():
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = encode(text)
    assert ids.dtype == numpy.uint8 and ids.max() < VOCAB_SIZE
    assert len(ids) == len(text.encode("utf-8"))
    assert decode(ids) == text


def test_default_corpus_is_the_standard_library_in_a_fixed_order():
    files = default_corpus_files()
    assert len(files) > 50 and files == sorted(files)
    assert any(f.endswith(os.sep + "os.py") for f in files)
    corpus = load_corpus()
    assert len(corpus) > 1_000_000 and b"def " in corpus
    assert corpus == load_corpus()


def test_batches_are_deterministic_and_shifted():
    data = Dataset(bytes(range(256)) * 40)
    x, y = data.batch("train", step=3, batch_size=4, block_size=16, seed=7)
    x2, y2 = data.batch("train", step=3, batch_size=4, block_size=16, seed=7)
    assert x.shape == y.shape == (4, 16) and x.dtype == numpy.int64
    numpy.testing.assert_array_equal(x, x2)
    numpy.testing.assert_array_equal(y, y2)
    numpy.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    other, _ = data.batch("train", step=4, batch_size=4, block_size=16, seed=7)
    assert not numpy.array_equal(x, other)
    val, _ = data.batch("val", step=3, batch_size=4, block_size=16, seed=7)
    n_train = len(data.splits["train"])
    assert len(data.splits["val"]) == 10240 - n_train and n_train == 9216
    assert val.max() < 256


def test_the_batch_recipe_is_pinned():
    """A step's windows start where default_rng([seed, split, step]) says (train 0, val 1): pinned,
    since a resume is exact only if the next version draws the same batches."""
    data = Dataset(bytes(range(256)) * 40)
    for split, code in (("train", 0), ("val", 1)):
        x, _ = data.batch(split, 3, 4, 16, 7)
        starts = numpy.random.default_rng([7, code, 3]).integers(0, len(data.splits[split]) - 16, size=4)
        numpy.testing.assert_array_equal(x, data.splits[split][starts[:, None] + numpy.arange(16)], err_msg=split)


def test_directory_corpus_skips_binary_and_hidden_files(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    (tmp_path / ".hidden").write_text("secret")
    assert load_corpus(str(tmp_path)) == b"first\nsecond"


def test_a_corpus_folder_follows_links_to_folders_once_each_and_refuses_a_link_to_nothing(tmp_path):
    """Links to folders were never entered and links to nothing dropped: a corpus gathered by
    linking datasets' folders trained on part of them, without a word."""
    corpus, data = tmp_path / "corpus", tmp_path / "data"
    corpus.mkdir()
    data.mkdir()
    (corpus / "a.txt").write_text("first")
    (data / "b.txt").write_text("second")
    (corpus / "linked").symlink_to(data)
    (corpus / "linked_again").symlink_to(data)  # the same folder twice: read once
    (data / "loop").symlink_to(corpus)  # back up to the corpus: not walked again
    assert load_corpus(str(corpus)) == b"first\nsecond"
    (corpus / "gone.txt").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"gone.txt: a link to nothing in the corpus \(1 such\)"):
        load_corpus(str(corpus))


def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="too few"):
        Dataset(b"tiny corpus").check_block_size(64)


def test_every_window_can_be_drawn():
    # 12 train tokens, block 4: starts 0..7 are the valid windows (targets end at the last token)
    data = Dataset(bytes(range(12)) + b"\xff", val_fraction=1 / 13)
    starts = set()
    for step in range(300):
        x, y = data.batch("train", step, batch_size=4, block_size=4, seed=0)
        starts.update(x[:, 0].tolist())
        assert y.max() <= 11
    assert starts == set(range(8))


@pytest.mark.timeout(30)  # a FIFO read would block: fail in seconds, not at the suite's 600
def test_fifo_in_a_corpus_directory_is_skipped(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    os.mkfifo(tmp_path / "pipe")
    assert load_corpus(str(tmp_path)) == b"text"  # and no hang on the FIFO


def test_a_folder_of_the_corpus_that_cannot_be_listed_is_an_error(tmp_path, monkeypatch):
    """os.walk skips a folder it cannot list unless told: the corpus would shrink without a word
    (a folder of mode 000 is readable by root, so the refusal is played by scandir here)."""
    (tmp_path / "a.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("def g(x):\n    return x\n")
    real = os.scandir

    def scandir(path="."):
        if os.path.basename(os.fspath(path)) == "sub":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ValueError, match=r"sub: cannot list this folder of the corpus \(Permission denied\): make it readable"):
        load_corpus(str(tmp_path))


def test_ids_past_a_byte_decode_as_the_replacement_character():
    assert decode([104, 105, 300, 33]) == "hi\ufffd!" and decode(encode("déjà vu")) == "déjà vu"
