"""Byte-level tokenizer, the default corpus and deterministic batches.

Tokens are the bytes of the UTF-8 text (vocabulary 256): no tokenizer to train or download. A
run may instead take GPT-2's BPE (``--tokenizer DIR``: ``minipar.tokenizer``), whose ids of the
corpus are cached beside it (``minipar.token_cache``).
The default corpus is the Python standard library's own top-level source files, which every Python
installation carries: real, structured text with no download.

Batches are a pure function of (seed, split, step): the batch of step 1000 is the same whether a run
got there directly or resumed from a checkpoint, and however a parallel layout later splits it.
Data stays on the host (NumPy); the model moves ids to the device.
"""

import hashlib
import os
import sysconfig

import numpy

VOCAB_SIZE = 256
_SPLIT_CODE = {"train": 0, "val": 1}


def encode(text):
    return numpy.frombuffer(text.encode("utf-8"), dtype=numpy.uint8).copy()


def decode(ids):
    """The text of byte ids. An id past 255 (a vocabulary wider than the bytes, whose extra ids the
    data never holds but an untrained model may sample) is no byte: it reads as U+FFFD, as bytes
    that are no UTF-8 do, where casting it to a byte would print some other character."""
    text = bytearray()
    for i in numpy.asarray(ids).reshape(-1).tolist():
        text += bytes((i,)) if 0 <= i < 256 else "\ufffd".encode()
    return text.decode("utf-8", errors="replace")


def default_corpus_files():
    """The standard library's top-level ``*.py`` files, sorted by name: a fixed order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(stdlib) if f.endswith(".py"))
    if not files:
        raise FileNotFoundError(f"no Python sources in {stdlib}; pass a text file with --data")
    return [os.path.join(stdlib, f) for f in files]


def _text_files(directory):
    """Every non-hidden regular file under ``directory`` that holds no NUL byte, by sorted relative
    path. Sockets, FIFOs and devices are skipped: opening a FIFO would wait forever. Links are
    followed, to folders too (a corpus gathered by linking datasets' folders), each folder once."""
    def unreadable(exc):  # os.walk skips a folder it cannot list unless told: a corpus would shrink unseen
        raise ValueError(f"{exc.filename}: cannot list this folder of the corpus ({exc.strerror}): make it "
                         "readable, or move it out of the folder given to --data")

    found, seen = [], {os.path.realpath(directory)}
    for root, dirs, files in os.walk(directory, onerror=unreadable, followlinks=True):
        kept = []
        for d in sorted(d for d in dirs if not d.startswith(".")):
            real = os.path.realpath(os.path.join(root, d))
            if real not in seen:  # a folder reached again through a link (or a loop) is walked once
                seen.add(real)
                kept.append(d)
        dirs[:] = kept
        found += [os.path.join(root, f) for f in files if not f.startswith(".")]
    broken = [f for f in found if not os.path.exists(f)]
    if broken:  # a link to nothing: the corpus would shrink unseen too
        raise ValueError(f"{broken[0]}: a link to nothing in the corpus ({len(broken)} such): remove it or "
                         "point it at the file it stood for")
    found = [f for f in found if os.path.isfile(f)]
    texts = []
    for path in sorted(found, key=lambda p: os.path.relpath(p, directory)):
        with open(path, "rb") as fh:
            if b"\0" not in fh.read(8192):
                texts.append(path)
    return texts


def load_corpus(path=None):
    """The bytes of ``path`` (a text file, or a directory of them), or of the default corpus."""
    if path is None:
        files = default_corpus_files()
    elif os.path.isdir(path):
        files = _text_files(path)
        if not files:
            raise ValueError(f"{path} holds no text files")
    elif os.path.isfile(path):
        files = [path]
    elif os.path.exists(path):
        raise ValueError(f"{path} is neither a regular file nor a directory")
    else:
        raise FileNotFoundError(f"{path}: no such file or directory")
    chunks = []
    for f in files:
        with open(f, "rb") as fh:
            chunks.append(fh.read())
    return b"\n".join(chunks)


class Dataset:
    """Token ids split into train (first 90%) and validation (last 10%). ``size`` and ``sha256``
    name the corpus, so that ranks and checkpoints can check they mean the same one. The ids are
    the corpus's bytes, or given a ``tokenizer`` its ids (``path``: where the corpus was read,
    None for the default one, which decides where they are cached); ``notes`` are for the user.
    ``share_tokens``: a corpus not in the cache is left untokenized (``splits`` None) for
    ``share_tokens`` to tokenize on one rank and send to the rest."""

    def __init__(self, corpus, val_fraction=0.1, tokenizer=None, path=None, defer_cache=False, share_tokens=False):
        self.size, self.sha256 = len(corpus), hashlib.sha256(corpus).hexdigest()
        self.notes, self.tokenized, self._keep, self.splits = [], tokenizer is not None, None, None
        self.val_fraction, self._untokenized = val_fraction, None
        if tokenizer is None:
            ids = numpy.frombuffer(corpus, dtype=numpy.uint8)
        else:
            from minipar.token_cache import cached_token_ids

            ids, self.notes, self._keep = cached_token_ids(corpus, self.sha256, path, tokenizer, not share_tokens)
            if ids is None:
                self._untokenized = corpus, tokenizer
        if ids is not None:
            self._split(ids)
        self._ids = ids  # whole, for the cache (a memmap of it once kept)
        if not defer_cache:
            self.keep_cache()

    def _split(self, ids):
        n_train = int(len(ids) * (1.0 - self.val_fraction))
        self.splits = {"train": ids[:n_train], "val": ids[n_train:]}

    def share_tokens(self, comm):
        """Tokenize the corpus once for the job: a collective of every rank. Where some rank
        found no cache, rank 0 tokenizes (or takes its cached ids) and broadcasts them, while the
        others wait without spinning (tokenizing takes seconds a MB): 8 ranks tokenizing at once
        on one host took 8 times the cores and memory. The ranks agreed beforehand that they read
        the same corpus with the same tokenizer (``run_inputs.same_inputs``), so the ids are the
        ones each would have made."""
        from minipar.comm.base import wait_without_spinning

        lacking = numpy.array([int(self.splits is None)], numpy.int64)
        if comm.size > 1:
            comm.all_reduce(lacking, op="max")
        if not lacking[0]:
            return
        ids = self._ids
        if comm.rank == 0 and ids is None:
            from minipar.token_cache import encode

            ids = encode(*self._untokenized)
        count = numpy.array([0 if ids is None else len(ids)], numpy.int64)
        wait_without_spinning(comm.ibroadcast(count).test)
        # rank 0 sends its own ids (copied only if read-only: a cache's memmap)
        made = numpy.require(ids, "<u2", ["C", "W"]) if comm.rank == 0 else numpy.empty(int(count[0]), "<u2")
        wait_without_spinning(comm.ibroadcast(made).test)
        if self.splits is None:
            self._ids, self._untokenized = made, None
            self._split(made)

    def keep_cache(self, comm=None):
        """Write the token cache of a corpus tokenized now (``token_cache``); with ``defer_cache``
        the trainer calls it once the run is sure to go on, so that a run refused for its flags
        leaves nothing behind. With ``comm`` (a collective of its ranks): the first rank of each
        host writes it, and the others map the file it wrote, so that the host's page cache holds
        one copy of the ids (each rank writing its own, the others renamed over, kept its own
        deleted file mapped); a rank that cannot read it there (another corpus path, a disk of its
        own) writes its own."""
        from minipar.node import local_rank

        first = comm is None or comm.size == 1 or local_rank() == 0
        if first:
            self._keep_cache(reuse=False)
        if comm is not None and comm.size > 1:
            from minipar.comm.base import wait_without_spinning

            wait_without_spinning(comm.ibarrier().test)
        if not first:
            self._keep_cache(reuse=True)

    def _keep_cache(self, reuse):
        if self._keep is not None and self._ids is not None:
            notes, ids = self._keep(self._ids, reuse)
            self.notes, self._keep = self.notes + notes, None
            if ids is not None:
                self._ids = ids
                self._split(ids)

    def check_block_size(self, block_size, source=None):
        """Raise a ValueError if a split is too short for one window of ``block_size`` tokens and
        its next-token targets. ``source``: where the length came from, if not --block-size (a
        snapshot's config.json, which no flag may contradict: only a larger corpus helps)."""
        for name, ids in self.splits.items():
            if len(ids) < block_size + 1:  # one window and its targets, shifted by one
                length = (f"--block-size {block_size}" if source is None
                          else f"sequences of {block_size} tokens ({source})")
                fix = "use a larger corpus" + (" or a smaller block size" if source is None else "")
                # a tokenizer may make far fewer tokens than the corpus has bytes (or none at all)
                made = f" (its tokenizer made {sum(map(len, self.splits.values())):,} tokens of {self.size:,} bytes)"
                raise ValueError(f"the {name} split has {len(ids)} tokens{made if self.tokenized else ''}, too few "
                                 f"for {length}: {fix}")

    def batch(self, split, step, batch_size, block_size, seed):
        """Inputs and next-token targets, both (batch_size, block_size) int64, for this step."""
        ids = self.splits[split]
        rng = numpy.random.default_rng([seed, _SPLIT_CODE[split], step])
        # the last window starts at len - block_size - 1, so that its targets end at the last id
        starts = rng.integers(0, len(ids) - block_size, size=batch_size)
        window = starts[:, None] + numpy.arange(block_size)
        return ids[window].astype(numpy.int64), ids[window + 1].astype(numpy.int64)
