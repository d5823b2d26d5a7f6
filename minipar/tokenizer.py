"""GPT-2's byte-level BPE, read from a snapshot directory through the ``tokenizers`` package (the
optional extra ``pip install 'minipar[gpt2]'``). Bytes (``minipar.data``) stay the default.

Byte-level BPE (Radford et al. 2019, section 2.2): the text's UTF-8 bytes are mapped to 256
printable characters, split into word-like pieces by a regular expression, and each piece is
merged pair by pair in the order ``merges.txt`` lists, into ids of ``vocab.json``. Every byte
string has an encoding, so no text is unknown. A snapshot holds it as ``tokenizer.json`` (the
whole pipeline) or as the two older files ``vocab.json`` and ``merges.txt``.
"""

import hashlib
import os
import re

import numpy

FILES = ("tokenizer.json", "vocab.json", "merges.txt")
END_OF_TEXT = "<|endoftext|>"
PIECE = 1 << 20  # characters a corpus is encoded in at a time (``BPETokenizer._pieces``)
SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")  # just after a newline with a non-space on both sides


def tokenizer_files(directory):
    """The files that define the tokenizer in ``directory``: tokenizer.json, else vocab.json and
    merges.txt; raises ValueError naming what is missing."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory}: no such directory" if not os.path.lexists(directory) else
                         f"{directory}: not a directory of tokenizer files")
    whole = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(whole):
        return [whole]
    pair = [os.path.join(directory, name) for name in FILES[1:]]
    if all(os.path.isfile(p) for p in pair):
        return pair
    raise ValueError(f"{directory} holds neither tokenizer.json nor vocab.json with merges.txt")


class BPETokenizer:
    """``encode(text)`` -> uint16 ids, ``decode(ids)`` -> text; ``vocab_size`` counts the added
    tokens (GPT-2: 50,000 merges + 256 bytes + <|endoftext|> = 50257); ``sha256`` names the
    files' contents, so a cache of tokens knows which tokenizer made it."""

    def __init__(self, directory):
        try:
            import tokenizers
        except ImportError:
            raise ValueError("reading a BPE tokenizer needs the tokenizers package: pip install 'minipar[gpt2]'") from None
        self.directory, self.files = directory, tokenizer_files(directory)
        if len(self.files) == 1:
            try:
                self._tok = tokenizers.Tokenizer.from_file(self.files[0])
            except Exception as exc:  # its Rust errors have no common Python type
                raise ValueError(f"{self.files[0]}: not a tokenizer ({exc})") from None
            # a file saved for a model's inputs may truncate or pad each text to its length: the
            # corpus is one text, which it would cut to the first max_length tokens, silently
            self._tok.no_truncation()
            self._tok.no_padding()
        else:
            try:
                self._tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(*self.files))
            except Exception as exc:
                raise ValueError(f"{directory}: vocab.json and merges.txt are not a BPE ({exc})") from None
            self._tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
            self._tok.decoder = tokenizers.decoders.ByteLevel()
            if self._tok.token_to_id(END_OF_TEXT) is not None:  # as tokenizer.json and transformers have it:
                # the separator in the text is its one id, not the 13 bytes' tokens of "<|endoftext|>"
                self._tok.add_special_tokens([tokenizers.AddedToken(END_OF_TEXT, special=True, normalized=False)])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.vocab = vocab = self._tok.get_vocab(with_added_tokens=True)  # token -> id
        ids = sorted(set(vocab.values()))
        if len(ids) != len(vocab) or ids != list(range(len(ids))):  # ids shared, or holes: encoding is ambiguous
            raise ValueError(f"{directory}: the vocabulary's ids are not 0 .. {len(vocab) - 1}, each once "
                             f"({len(vocab)} tokens, {len(ids)} distinct ids from {ids[0] if ids else None} to "
                             f"{ids[-1] if ids else None})")
        lost = [c for c in tokenizers.pre_tokenizers.ByteLevel.alphabet() if c not in vocab]
        if lost:  # a byte without a token is dropped from the text, silently
            raise ValueError(f"{directory}: the vocabulary lacks {len(lost)} of the 256 byte-level symbols "
                             f"(such as {lost[0]!r}): text with those bytes would be dropped, not encoded")
        if self.vocab_size > 2**16:
            raise ValueError(f"{directory}: {self.vocab_size} tokens do not fit the uint16 ids a corpus is cached as")
        self.eos_id = self._tok.token_to_id(END_OF_TEXT)
        digest = hashlib.sha256()
        for path in self.files:
            with open(path, "rb") as fh:
                digest.update(os.path.basename(path).encode() + b"\0" + fh.read())
        self.sha256 = digest.hexdigest()

    def encode(self, text):
        # no special tokens around the whole corpus (a post-processor's <s> ... </s>): the text's
        # own <|endoftext|> separators are kept, as added tokens
        return numpy.concatenate([numpy.array(self._tok.encode(piece, add_special_tokens=False).ids, numpy.uint16)
                                  for piece in self._pieces(text)] or [numpy.zeros(0, numpy.uint16)])

    def _pieces(self, text):
        """``text`` cut where encoding the pieces one by one gives the whole text's ids: what the
        tokenizers package returns for one text (each token's string, offsets and masks) takes
        about 175 bytes a character, 3.5 GB for a 20 MB corpus, and every rank tokenizes at once.
        GPT-2's pre-tokenizer (the regular expression of byte-level BPE, no prefix space, no
        normaliser) never makes a piece that spans a newline with a non-space on either side
        ("x\ny": "x", "\n", "y"), so cuts just after such a newline are safe; with any other
        pre-tokenizer the text stays whole."""
        pre = self._tok.pre_tokenizer
        gpt2_like = (type(pre).__name__ == "ByteLevel" and pre.use_regex and not pre.add_prefix_space
                     and self._tok.normalizer is None)
        start = 0
        while gpt2_like and len(text) - start > PIECE:
            cut = SAFE_CUT.search(text, start + PIECE)
            if cut is None:
                break
            yield text[start : cut.start()]
            start = cut.start()
        yield text[start:]

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
