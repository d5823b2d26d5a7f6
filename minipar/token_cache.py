"""A corpus tokenized once: its BPE ids kept as a uint16 file beside it, read back as a memmap.

Tokenizing GPT-2's way runs at a few MB/s, so the ids are cached. The cache's name carries the
tokenizer's and the corpus's SHA-256, so a changed corpus or tokenizer is a new file, never a stale
one; its header carries the ids' own SHA-256, checked on every read, so a damaged file is noticed
and made again. It is written to a temporary file and renamed, so a crash or two ranks tokenizing
at once leave a whole file or none.

    file:  b"MINIPAR-TOKENS-1" | count (uint64, little-endian) | sha256 of the ids (32 bytes) | ids (uint16)
"""

import hashlib
import os

import numpy

from minipar.checkpoint.files import write_file

MAGIC = b"MINIPAR-TOKENS-1"
HEADER = len(MAGIC) + 8 + 32
# part of every cache's key: raised when the same tokenizer files come to make other ids (2: the
# vocab.json + merges.txt format reads <|endoftext|> in the text as its one special id; 3: a
# tokenizer.json's truncation, padding and post-processor's special tokens are not applied)
RECIPE = 3


def user_cache_dir():
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minipar")


def cache_path(corpus_path, key):
    """(where the cache of ``corpus_path`` goes, a note if that is not beside the corpus). A hidden
    name, so that a directory corpus does not read its own cache as text."""
    if corpus_path is None:  # the default corpus is this Python's own standard library: not ours to write into
        return os.path.join(user_cache_dir(), f"stdlib-{key}.tokens"), None
    corpus_path = os.path.abspath(corpus_path)
    if os.path.isdir(corpus_path):
        directory, name = corpus_path, f".minipar-{key}.tokens"
    else:
        directory, name = os.path.dirname(corpus_path), f".{os.path.basename(corpus_path)}.{key}.tokens"
    if os.access(directory, os.W_OK):
        return os.path.join(directory, name), None
    elsewhere = os.path.join(user_cache_dir(), name.lstrip("."))
    return elsewhere, f"{directory} is not writable: the corpus's tokens are cached in {elsewhere}"


def _read(path):
    """The cached ids as a read-only memmap, or None if the file is missing or not whole."""
    try:
        with open(path, "rb") as fh:
            header = fh.read(HEADER)
        if len(header) < HEADER or not header.startswith(MAGIC):
            return None
        count = int.from_bytes(header[len(MAGIC) : len(MAGIC) + 8], "little")
        if os.path.getsize(path) != HEADER + 2 * count:
            return None
        ids = numpy.memmap(path, dtype="<u2", mode="r", offset=HEADER, shape=(count,)) if count else numpy.zeros(0, "<u2")
    except OSError:
        return None
    # hashed in place: tobytes() would copy every id into memory, which the memmap is there to spare
    return ids if hashlib.sha256(memoryview(ids).cast("B")).digest() == header[-32:] else None


def _write(path, ids):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ids = numpy.ascontiguousarray(ids, dtype="<u2")
    write_file(path, [MAGIC + len(ids).to_bytes(8, "little") + hashlib.sha256(ids).digest(), ids])


def cached_token_ids(corpus, corpus_sha256, corpus_path, tokenizer, tokenize=True):
    """(the corpus's ids, notes for the user, and None or a call that writes the cache): read from
    the cache, or tokenized, the cache written by the returned call once the run is sure to go on
    (a run refused for its flags writes nothing). The call takes the ids to keep (and ``reuse``:
    whether to map a cache another rank wrote meanwhile, if there is a whole one) and returns
    (notes for the user, the ids read back from the cache as a memmap, or None where it could not
    be written). ``tokenize`` False: on a miss the ids are None, for the caller to make
    (``encode``) or to receive from a rank that made them (``Dataset.share_tokens``)."""
    key = hashlib.sha256(f"{tokenizer.sha256}:{corpus_sha256}:{RECIPE}".encode()).hexdigest()[:16]
    path, note = cache_path(corpus_path, key)
    notes = [note] if note else []
    try:  # byte-level BPE reads text: bytes that are not UTF-8 become U+FFFD, said once per run
        corpus.decode("utf-8")
    except UnicodeDecodeError as exc:
        notes.append(f"the corpus is not UTF-8 throughout (byte {exc.start} is the first that is not): the "
                     "tokenizer reads text, so such bytes became U+FFFD; convert it (iconv -f latin1 -t utf-8)")
    ids = _read(path)
    if ids is not None:
        return ids, notes, None
    if os.path.exists(path):
        notes.append(f"the token cache {path} was damaged: the corpus was tokenized again")

    def keep(made, reuse=False):
        found = _read(path) if reuse else None  # written by another rank of this host
        if found is not None:
            return [], found
        try:
            _write(path, made)
        except OSError as exc:  # a full disk, a quota: the run goes on with the ids it made
            return [f"the token cache {path} could not be written ({exc.strerror or exc}): the ids are "
                    "kept in memory, and the next run tokenizes the corpus again"], None
        return [], _read(path)  # paged in from the file as read, not held in every rank's memory

    return (encode(corpus, tokenizer) if tokenize else None), notes, keep


def encode(corpus, tokenizer):
    """The corpus's ids as uint16, made now (a few MB/s: the reason for the cache)."""
    return numpy.asarray(tokenizer.encode(corpus.decode("utf-8", errors="replace")), dtype="<u2")
