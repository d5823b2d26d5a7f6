"""Bad flags end a job in one line on every rank, before any rank communicates.

The training CLI (``minipar.train``), the planner, the lessons and the benchmarks share this: the
types of their numeric flags, a parser whose errors are raised, not printed with the whole usage on
every rank, and ``agree``, after which either every rank goes on or every rank exits with status 2
and exactly one has printed the problems, one line each.
The problems of a run's sizes come from ``minipar.parallel.validate``; a script adds its own.
"""

import argparse
import math
import sys


def _int_at_least(text, low):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def non_negative_int(text):
    return _int_at_least(text, 0)


def positive_int(text):
    return _int_at_least(text, 1)


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text):
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0, got 0")
    return value


class FlagError(Exception):
    """Bad flags, found by one rank without communicating (see ``agree``); one line each."""

    def __init__(self, *lines):
        super().__init__("\n".join(lines))
        self.lines = list(lines)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, except None and False: such a flag's help says in words
    what happens without it ("(default: the global batch / DP / PP)"), or it is a switch."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, without abbreviations (Megatron-LM's ``allow_abbrev=False``:
    ``--n-lay`` read as ``--n-layer`` today may mean another flag once one is added), and refusing
    two names of one flag given two values (``--tp 2 --tensor-model-parallel-size 1``: argparse keeps
    the last, which looks like another flag). One name given twice is an override, as usual."""

    rank = 0  # only rank 0 prints help

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def typed(self, words):
        """{dest: [(the flag as typed, its value)]} of the options in ``words`` that take one value
        (a value missing or of the wrong type left to argparse to refuse)."""
        given = {}
        for i, word in enumerate(words):
            flag, eq, value = word.partition("=")
            action = self._option_string_actions.get(flag) if word.startswith("--") else None
            if action is None or action.nargs is not None or action.dest == "help":
                continue
            if not eq:  # the next word, unless it is a flag (this one's value missing: argparse says so)
                value = words[i + 1] if i + 1 < len(words) else None
                if value is not None and value.partition("=")[0] in self._option_string_actions:
                    value = None
            try:
                value = action.type(value) if action.type is not None and value is not None else value
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                pass
            given.setdefault(action.dest, []).append((flag, value))
        return given

    def parse_known_args(self, args=None, namespace=None):
        for seen in self.typed(list(sys.argv[1:] if args is None else args)).values():
            # one spelling repeated is an override (base flags, then the change)
            clash = [(a, x, b, y) for i, (a, x) in enumerate(seen) for b, y in seen[i + 1:]
                     if a != b and x != y and None not in (x, y)]
            if clash:
                a, x, b, y = clash[0]
                self.error(f"{a} {x} and {b} {y} are two names of one flag, given two values: give one")
        return super().parse_known_args(args, namespace)

    def error(self, message):
        """One line naming the problem (argparse would print the whole usage first)."""
        raise FlagError(f"{message} (see --help)")

    def print_help(self, file=None):
        if self.rank == 0:
            super().print_help(file)


def device_problems(args):
    """Take ``args.device`` for this process (``backend.use_device``): [] if it can be used, else
    one line (no CuPy, no GPU) to report with the other flags' problems, before the ranks agree,
    rather than a traceback from every rank afterwards."""
    from minipar.backend import use_device

    try:
        use_device(args.device)
    except (ImportError, RuntimeError, ValueError) as exc:
        return [f"--device {args.device}: {exc}"]
    return []


def agree(comm, problems, prog):
    """End the job if any rank found a problem: the lowest such rank prints its problems as
    ``prog: error: ...`` lines, then every rank exits with status 2.

    Every rank checked its flags on its own, so every rank reaches this one all-reduce, and it
    cannot hang. No rank exits before the printing one has printed (under ``python -m mpi4py``
    the first non-zero exit aborts the whole job at once). ``comm`` None: a script of one process
    that never starts MPI.
    """
    first = 0 if problems else None
    if comm is not None and comm.size > 1:
        import numpy  # a host array: MPI moves it on any device

        votes = comm.all_reduce(numpy.array([comm.size - comm.rank if problems else 0], numpy.int64), op="max")
        first = comm.size - int(votes[0]) if votes[0] else None
    if first is None:
        return
    if comm is None or comm.rank == first:
        print("\n".join(f"{prog}: error: {line}" for line in problems), file=sys.stderr, flush=True)
    if comm is not None:
        comm.barrier()
    from minipar.comm import end_job  # (lazily: a script of one process never loads the communicators)

    end_job(2)


def parse(parser, comm, check=None, argv=None):
    """The flags, parsed on every rank, and ``check(args)`` (the problems argparse cannot see, a
    list of lines, e.g. ``validate.problems`` of the run they describe). On any problem the job
    ends through ``agree``: one rank prints, every rank exits 2, before any other message."""
    parser.rank = 0 if comm is None else comm.rank
    args, found = None, []
    try:
        args = parser.parse_args(argv)
        found = list(check(args)) if check is not None else []
    except FlagError as exc:
        found = exc.lines
    agree(comm, found, parser.prog)
    return args
