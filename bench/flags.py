"""The benchmarks' own flag types and checks, beside the trainer's (``minipar.cli``: counts and
numbers, the parser of one-line errors and ``parse``, which the benchmarks use too).

A count of 0 rounds has no median, a size of 0 bytes never grows by doubling, nan seconds cannot
be slept: each is refused, one line for the whole job, exit status 2, before anything is measured.
``minipar.cli.parse(parser, comm, check)`` runs argparse and ``check(args)`` (the problems of
several flags together) on every rank and lets one rank print them.
"""

import argparse
import math

from minipar.cli import non_negative_float

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def probability(text):
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be below 1, got {text}")
    return value


def size_arg(text):
    """A byte count >= 1: 4096, 4K, 64M, 1G (B optional)."""
    plain = text.strip().upper().removesuffix("B")
    scale = UNITS.get(plain[-1:], 1)
    number = plain[:-1] if scale > 1 else plain
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 1M)") from None
    if not math.isfinite(value) or value * scale < 1:
        raise argparse.ArgumentTypeError(f"must be a size of at least 1 byte, got {text!r}")
    return int(value * scale)


def sizes_arg(text):
    """Comma-separated sizes, each ``size_arg``."""
    return [size_arg(part) for part in text.split(",")]


def run_problems(names, **fields):
    """The problems ``minipar.parallel.validate`` finds in the run ``fields`` describe (model
    sizes, a layout on the ranks, a batch), each naming its flag as ``names`` ({field: flag}) does."""
    from minipar.parallel.run_config import RunConfig
    from minipar.parallel.validate import problems

    return problems(RunConfig(**fields), names)
