"""The paths of ``python -m minipar.train``'s outputs, checked with its flags (``train_checks``):
each must be writable now, not after the whole run, and none may destroy an input or another
output."""

import os


def writable(flag, path):
    """A problem now, not after the whole run, if ``path`` cannot be written (None if it can)."""
    from minipar.checkpoint.files import folder_problem

    if os.path.isdir(path):
        return f"{flag} {path}: not a writable file path"
    why = folder_problem(os.path.dirname(os.path.abspath(path)))
    return None if why is None else f"{flag} {path}: {why}"


def _inside(path, folder):
    """True if ``path`` is ``folder`` or lies under it (links resolved; neither need exist yet)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def clashing_paths(args):
    """Outputs that would destroy an input or each other, one line each: the corpus overwritten
    by the log, a checkpoint written into the corpus's folder (and read back as text), two files
    of one name, or anything inside --export-hf's folder, which the export replaces whole, an
    input (the weights or the tokenizer it started from) included."""
    files = [(f"--{flag.replace('_', '-')}", getattr(args, flag)) for flag in ("log_json", "export_weights", "plot")]
    files = [(flag, path) for flag, path in files if path]
    outputs = files + [(flag, path) for flag, path in (("--save", args.save), ("--export-hf", args.export_hf)) if path]
    problems = [f"{a} and {b} both name {path}: each needs a file of its own"
                for i, (a, path) in enumerate(files) for b, other in files[i + 1:] if _inside(path, other)]
    if args.export_hf:
        problems += [f"{flag} {path} is inside --export-hf {args.export_hf}, which the export replaces whole "
                     "when the run ends: put it elsewhere" for flag, path in outputs
                     if flag != "--export-hf" and _inside(path, args.export_hf)]
    for flag, path in files + [(flag, path) for flag, path in outputs if flag == "--export-hf"]:
        for source, directory in _save_directories(args):
            if _in_checkpoints(path, directory):
                problems.append(f"{flag} {path} would write into the checkpoints of {source} {directory} "
                                "(its latest, .lock and iter_* are the checkpoints'): put it elsewhere")
        if os.path.basename(path).endswith(".tokens"):
            problems.append(f"{flag} {path}: .tokens is the name of a corpus's token cache, which a run reads "
                            "while it writes its outputs: use another name")
    tokenizer = getattr(getattr(args, "tokenizer", None), "directory", None)  # (loaded by then: train_sources)
    inputs = [(flag, path) for flag, path in (("--data", args.data), ("--init-weights", args.init_weights),
                                                ("--tokenizer", tokenizer)) if path]
    for source, given in inputs:
        # --export-weights over --init-weights writes the trained weights back, atomically: allowed
        problems += [f"{flag} {path} would write into {source} {given}, an input of this run: put it elsewhere"
                     for flag, path in outputs if _inside(path, given)
                     and (flag, source) != ("--export-weights", "--init-weights")]
        if args.export_hf and _inside(given, args.export_hf) and not _inside(args.export_hf, given):
            problems.append(f"{source} {given} is inside --export-hf {args.export_hf}, which the export replaces "
                            "whole when the run ends: put the export elsewhere")
    return problems


def _save_directories(args):
    """(flag, directory) of the save directories a run writes or reads: --save, and --load's (the
    folder it names, or the one holding the checkpoint it names)."""
    out = [("--save", args.save)] if args.save else []
    load = getattr(args, "load", None)
    if load:
        named = os.path.isfile(os.path.join(load, "index.json"))
        folder = os.path.dirname(os.path.normpath(load)) or "." if named else load
        if not args.save or os.path.realpath(folder) != os.path.realpath(args.save):  # one folder: said once
            out.append(("--load", folder))
    return out


def _in_checkpoints(path, directory):
    """Whether ``path`` is, or lies in, what a save directory's checkpoints are made of: its
    ``latest``, its ``.lock``, an ``iter_*`` folder (a partial one too)."""
    if not _inside(path, directory):
        return False
    first = os.path.relpath(os.path.realpath(path), os.path.realpath(directory)).split(os.sep)[0]
    return first in ("latest", ".lock") or first.startswith("iter_")


def trim_log(path, start):
    """A run resumed at iteration ``start`` appends to its --log-json: first the rows of iterations
    from ``start`` on go, which a run that went on past its last checkpoint wrote and this one
    writes again (the file is rewritten atomically; a line that is no JSON row is kept as it is)."""
    import json

    from minipar.checkpoint.files import write_file

    if not start or not os.path.isfile(path):
        return

    def before(line):
        try:
            return json.loads(line).get("iter", -1) < start
        except (ValueError, AttributeError):
            return True

    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    kept = [line for line in lines if before(line)]
    if len(kept) < len(lines):
        write_file(path, b"".join(kept))
