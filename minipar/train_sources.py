"""Where a run's model and tokens come from, besides its own flags: a Hugging Face snapshot
(``--init-weights DIR``: its config.json gives the model flags) and a BPE tokenizer
(``--tokenizer DIR``: its vocabulary gives ``--vocab-size``).

A flag the user gave that disagrees with either is a one-line error naming both values; a flag
left at its default takes theirs. Read on every rank before any communication, as every flag is.
"""

import argparse
import os

from minipar.cli import FlagError

BYTES = 256  # the byte-level default's vocabulary (minipar.data)
# minipar's model flags as the user types them
FLAG_NAMES = {"n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd", "block_size": "--block-size",
              "vocab_size": "--vocab-size"}


def given_flags(parser, argv):
    """The destinations of the flags typed on the command line, not left at their defaults: the
    flags parsed again with every default absent (and then put back)."""
    defaults = [(action, action.default) for action in parser._actions]  # noqa: SLF001
    try:
        for action, _ in defaults:
            action.default = argparse.SUPPRESS
        return set(vars(argparse.ArgumentParser.parse_args(parser, argv)))
    finally:
        for action, default in defaults:
            action.default = default


def apply_sources(args, given):
    """Set the model flags from ``--init-weights DIR``'s config.json and ``--vocab-size`` from
    ``--tokenizer DIR``; raises FlagError with every disagreement. Leaves ``args.tokenizer`` the
    loaded tokenizer (or None), ``args.hf_token_ids`` the bos/eos ids an export writes and
    ``args.taken_from`` where each flag set here came from."""
    from minipar.checkpoint.hf import FIELDS, read_config
    from minipar.tokenizer import BPETokenizer, tokenizer_files

    problems, args.hf_token_ids = [], {}
    source = {}  # flag -> (value, where it came from)
    args.taken_from = {}  # flag -> where its value came from, for the flags set here
    if args.init_weights and os.path.isdir(args.init_weights):
        where = os.path.join(args.init_weights, "config.json")
        try:
            snapshot, args.hf_token_ids = read_config(args.init_weights)
        except ValueError as exc:
            raise FlagError(f"--init-weights {args.init_weights}: {exc}") from None
        source.update({flag: (value, f"{where}'s {FIELDS[flag]}") for flag, value in snapshot.items()})
        if not args.tokenizer:
            try:
                tokenizer_files(args.init_weights)
                problems.append(f"--init-weights {args.init_weights} holds a tokenizer: give --tokenizer "
                                f"{args.init_weights} to use it, or --tokenizer bytes to feed the model bytes")
            except ValueError:
                pass  # no tokenizer beside the weights: bytes, as by default
    tokenizer = None
    if args.tokenizer and args.tokenizer != "bytes":
        try:
            tokenizer = BPETokenizer(args.tokenizer)
        except ValueError as exc:
            raise FlagError(f"--tokenizer {args.tokenizer}: {exc}") from None
        vocab = (tokenizer.vocab_size, f"--tokenizer {args.tokenizer}'s vocabulary")
        if "vocab_size" in source and source["vocab_size"][0] != vocab[0]:
            problems.append(f"{source['vocab_size'][1]} is {source['vocab_size'][0]}, {vocab[1]} has "
                            f"{vocab[0]} tokens: give the tokenizer of these weights")
        source["vocab_size"] = vocab
        if args.init_weights and os.path.isdir(args.init_weights) and not os.path.samefile(args.init_weights,
                                                                                            args.tokenizer):
            try:  # the snapshot's own tokenizer, if it has one: its ids are what the embeddings were trained on
                own = BPETokenizer(args.init_weights).vocab
            except ValueError:
                own = None
            if own is not None and own != tokenizer.vocab:
                problems.append(f"--tokenizer {args.tokenizer} gives tokens other ids than the tokenizer in "
                                f"--init-weights {args.init_weights}, whose embeddings were trained on its ids: "
                                f"give --tokenizer {args.init_weights}")
        if tokenizer.eos_id is not None and args.hf_token_ids.get("eos_token_id") is None:
            args.hf_token_ids = {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id}
    args.tokenizer = tokenizer
    for flag, (value, where) in source.items():
        if flag in given and getattr(args, flag) != value:
            problems.append(f"{FLAG_NAMES[flag]} {getattr(args, flag)} disagrees with {where} {value}: "
                            f"drop {FLAG_NAMES[flag]}")
        else:
            setattr(args, flag, value)
            args.taken_from[flag] = where
    if args.vocab_size is None:
        args.vocab_size = BYTES
    elif tokenizer is None and args.vocab_size < BYTES:
        named = args.taken_from.get("vocab_size", "--vocab-size")  # the flag, or the file it came from
        problems.append(f"{named} {args.vocab_size}: the byte-level tokens need at least {BYTES} "
                        "(give --tokenizer DIR for another vocabulary)")
    if problems:
        raise FlagError(*problems)
