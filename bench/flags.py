"""The benchmarks' flags: types that refuse what no benchmark can measure, and the one-line errors
the trainer and the lessons give (``minipar.cli``).

A count of 0 rounds has no median, a size of 0 bytes never grows by doubling, nan seconds cannot
be slept: each is refused as its flag is parsed, one line for the whole job, exit status 2, before
anything is measured. ``parse(parser, comm, check)`` runs argparse and ``check(args)`` (the
problems of several flags together) on every rank and lets one rank print them.
"""

import argparse
import math

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def __getattr__(name):
    """``Parser`` and ``parse`` are minipar.cli's, imported when first asked for: the types alone
    load no NumPy (step_time.py sets BLAS's threads before NumPy loads)."""
    if name in ("Parser", "parse"):
        from minipar import cli

        return getattr(cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _number(text, kind):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def positive_int(text):
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def positive_float(text):
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def probability(text):
    value = _number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
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


def non_negative_int(text):
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
