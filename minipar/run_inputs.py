"""Every rank of a run reads the same inputs, and one run at a time writes a save directory.

Each rank reads its flags' files on its own, before any communication, so that a bad flag is one
line and never a hang. That leaves three ways for ranks to disagree without any error:

* ranks launched with different flags (an MPMD launch, ``mpiexec -n 1 ... : -n 1 ...``): another
  ZeRO stage or step count on one rank hangs the job, another seed or learning rate trains a
  model no single run would;
* ``--load DIR`` means ``DIR/latest``, which another run may move while this job starts: ranks
  that read it a moment apart load tensor-parallel shards of different iterations, then run
  different numbers of steps, and hang.
* ``--data`` (or the default corpus, this Python's standard library) can change while the ranks
  read it, or differ between hosts: the ranks then train on different corpora and exit 0; so can
  ``--init-weights``, and each rank would start from its own weights.

So once the flags are agreed, rank 0 decides what is loaded and broadcasts it: its flags as
parsed, the checkpoint directory it resolved (no rank reads ``latest`` again), the SHA-256 of that
checkpoint's index, the corpus's length and SHA-256, and the SHA-256 of the initial weights it
loaded (``checkpoint.weights.digest``: by content, so hosts may hold their copies under other
paths). Every rank compares its own with them;
a difference ends the job before training, one line, every rank with status 2.

The save directory is claimed the same way before training (rank 0, ``checkpoint/lock.py``), and
a run does not write into a directory of checkpoints that it does not continue unless told to.
"""

import hashlib
import json
import os
import re

import numpy

from minipar.checkpoint.index import ITER_NAME, CheckpointError, find, read_index
from minipar.checkpoint.lock import SaveDirectoryBusy, SaveLock
from minipar.checkpoint.weights import digest
from minipar.cli import FlagError
from minipar.tokenizer import BPETokenizer


def broadcast_text(comm, text, root=0):
    """Root's ``text`` on every rank (UTF-8 bytes: a length, then the bytes)."""
    data = numpy.frombuffer(text.encode(), numpy.uint8) if comm.rank == root else None
    size = comm.broadcast(numpy.array([0 if data is None else data.size], numpy.int64), root)
    buffer = data.copy() if data is not None else numpy.zeros(int(size[0]), numpy.uint8)
    return comm.broadcast(buffer, root).tobytes().decode()


def index_sha256(checkpoint):
    """SHA-256 of a checkpoint's ``index.json``: it names every shard's checksum, so equal index
    hashes mean the same checkpoint, whichever host's disk it is read from."""
    with open(os.path.join(checkpoint, "index.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


BY_CONTENT = ("load", "data", "init_weights", "taken_from")  # taken_from: the paths a snapshot's flags came from
DERIVED = ("planned_state_peaks",)  # check_args' memory plan: no flag, and equal where the flags are


def _flags(args):
    """The flags as parsed and completed, as JSON values. ``--load``, ``--data`` and
    ``--init-weights`` are left out: what they name is compared below, by content, so that hosts
    may hold their own copies. A tokenizer (``train_sources`` puts the object in
    ``args.tokenizer``) is compared by its files' bytes, the SHA-256 it keeps of them."""
    def value(v):
        if isinstance(v, BPETokenizer):
            return {"tokenizer sha256": v.sha256}
        if v is None or isinstance(v, (bool, int, float, str, list, tuple, dict)):
            return v
        raise TypeError(f"run_inputs: a flag's value of type {type(v).__name__} cannot be compared across ranks")

    return json.loads(json.dumps({k: value(v) for k, v in vars(args).items() if k not in BY_CONTENT + DERIVED}))


def _facts(args, data, weights):
    facts = {"flags": _flags(args), "corpus": [data.size, data.sha256]}
    if weights is not None:
        facts["weights"] = digest(weights)
    if args.load:
        facts.update(checkpoint=os.path.abspath(args.load), index=index_sha256(args.load))
    return facts


def same_inputs(comm, args, data, weights=None):
    """The problems (lines) of this rank's inputs against rank 0's; afterwards ``args.load`` is
    rank 0's checkpoint directory on every rank. ``weights``: the initial weights this rank loaded
    (``--init-weights``). A collective: every rank calls it."""
    theirs = json.loads(broadcast_text(comm, json.dumps(_facts(args, data, weights)) if comm.rank == 0 else ""))
    if comm.rank == 0:
        return []
    problems = []
    mine = _flags(args)
    differ = sorted(set(mine) | set(theirs["flags"]), key=str)
    differ = [k for k in differ if mine.get(k) != theirs["flags"].get(k)]
    if differ:
        shown = "; ".join(f"--{k.replace('_', '-')} {mine.get(k)!r}, rank 0's {theirs['flags'].get(k)!r}"
                          for k in differ[:4])
        problems.append(f"rank {comm.rank} was launched with other flags than rank 0 ({shown}"
                        f"{'; and more' if len(differ) > 4 else ''}): launch every rank with the same command line")
    if theirs["corpus"] != [data.size, data.sha256]:
        (n0, h0), (n, h) = theirs["corpus"], (data.size, data.sha256)
        problems.append(f"--data {args.data or '(default corpus)'}: rank {comm.rank} read {n:,} bytes "
                        f"(sha256 {h[:12]}), rank 0 read {n0:,} (sha256 {h0[:12]}): the corpus changed "
                        "while the job started, or the hosts hold different files (the default corpus "
                        "is each host's Python standard library); give every rank the same file")
    loaded, rank0 = digest(weights) if weights is not None else None, theirs.get("weights")
    if (loaded is None) != (rank0 is None):
        problems.append(f"rank {comm.rank} was launched {'without' if loaded is None else 'with'} --init-weights, "
                        f"rank 0 {'with' if loaded is None else 'without'}: launch every rank with the same command line")
    elif loaded != rank0:
        problems.append(f"--init-weights {args.init_weights}: rank {comm.rank} loaded other weights than rank 0 "
                        f"(sha256 {loaded[:12]}, rank 0's {rank0[:12]}): the file changed while the job started, "
                        "or the hosts hold different files; give every rank the same weights")
    if args.load:
        args.load = theirs["checkpoint"]  # rank 0's choice, whatever `latest` says now
        try:
            mine = index_sha256(args.load)
        except OSError as exc:
            mine = f"unreadable ({exc.strerror})"
        if mine != theirs["index"]:
            problems.append(f"--load: rank {comm.rank} does not see the checkpoint rank 0 loads "
                            f"({args.load}: index {mine[:12]}, rank 0's {theirs['index'][:12]}): "
                            "every host must see the same checkpoint files")
    return problems


def _checkpoints_in(directory):
    if not os.path.isdir(directory):
        return []
    return sorted((name for name in os.listdir(directory) if ITER_NAME.fullmatch(name)), key=_iteration)


def _iteration(name):
    """The iteration of a checkpoint's folder, ``iter_N`` (or ``iter_N.old``, which ``find`` may
    resolve to: a save of the same iteration stopped between its two renames)."""
    return int(re.match(r"iter_(\d+)", name).group(1))


def _iteration_of(path):
    """The iteration of the checkpoint at ``path``: its folder's name's, or, for a copy under
    another name (``ckpt/best``), its index's; None if it cannot be read (``check_files`` says why)."""
    if re.match(r"iter_\d+", os.path.basename(path)):
        return _iteration(os.path.basename(path))
    try:
        return read_index(path)["iteration"]
    except CheckpointError:
        return None


def _newest(directory, found):
    """The iteration the save directory's history has reached: the checkpoint ``latest`` names (a
    resume with --overwrite-checkpoints moved it back, leaving the abandoned ones beyond it), else
    the highest ``iter_N``."""
    try:
        return _iteration_of(find(directory))
    except CheckpointError:
        return max(map(_iteration, found), default=None)


def claim_save_directory(args, rank):
    """Rank 0 locks ``--save`` for this run (held until the process ends) and refuses to write
    into checkpoints the run does not continue; raises FlagError. Returns the lock (None when
    there is nothing to save or on other ranks)."""
    if not args.save or rank != 0:
        return None
    found = _checkpoints_in(args.save)
    continues = args.load and os.path.dirname(os.path.realpath(args.load)) == os.path.realpath(args.save)
    if found and not continues and not args.overwrite_checkpoints:
        raise FlagError(f"--save {args.save} already holds checkpoints ({', '.join(found[-2:])}"
                        f"{' and more' if len(found) > 2 else ''}) that this run does not continue: "
                        f"pass --load {args.save} to continue them, save elsewhere, or pass "
                        "--overwrite-checkpoints to let this run replace them")
    # a run resumed from an older checkpoint would replace the newer ones at their iterations, or
    # prune them, with other training
    loaded, newest = (_iteration_of(os.path.realpath(args.load)), _newest(args.save, found)) if continues else (None, None)
    newer = [] if None in (loaded, newest) else [name for name in found if loaded < _iteration(name) <= newest]
    if newer and not args.overwrite_checkpoints:
        raise FlagError(f"--load {args.load} is not the newest checkpoint of --save {args.save} ({', '.join(newer[-2:])}"
                        f"{' and more' if len(newer) > 2 else ''} came after it), and this run would replace or "
                        f"prune those: pass --load {os.path.join(args.save, newer[-1])} to continue from the newest, "
                        "save elsewhere, or pass --overwrite-checkpoints to let this run replace them")
    try:
        return SaveLock(args.save).acquire()
    except SaveDirectoryBusy as exc:
        raise FlagError(f"--save {exc}") from None
    except OSError as exc:
        raise FlagError(f"--save {args.save}: cannot lock it ({exc.strerror})") from None


def tokens_of(args):
    """What turns the corpus into tokens, as a checkpoint records it: "bytes", or the SHA-256 of
    the tokenizer's files."""
    return "bytes" if args.tokenizer is None else args.tokenizer.sha256


def tokenizer_matches(saved, args, recipe=None):
    """A problem line if a checkpoint's tokenizer (``tokens_of`` when it was saved) is not this
    run's, or made its tokens by another of minipar's recipes (``token_cache.RECIPE``: the same
    tokenizer files read another way) when this run trains on; else None. Checkpoints from before
    either was recorded have none."""
    from minipar.token_cache import RECIPE

    ours = tokens_of(args)
    if saved is None or saved == ours:
        if ours == "bytes" or recipe in (None, RECIPE) or not args.max_iters:  # --max-iters 0 trains nothing
            return None
        return (f"--load: the checkpoint's tokens were made by minipar's tokenizing recipe {recipe}, this "
                f"minipar makes recipe {RECIPE} of the same tokenizer (minipar/token_cache.py says how they "
                "differ): the same text would be other tokens; continue it with the minipar that saved it, "
                "or start a new run from its weights (--max-iters 0 --export-weights FILE, then --init-weights FILE)")

    def name(tokens):
        return "bytes (no --tokenizer)" if tokens == "bytes" else f"a tokenizer of sha256 {tokens[:12]}"

    return (f"--load: the checkpoint was trained on tokens of {name(saved)}, this run makes them of "
            f"{name(ours)}: the same text would be other tokens; resume with the tokenizer it was trained with")


def corpus_matches(saved, data, flag):
    """A problem line if a checkpoint's corpus (its trainer state's [bytes, sha256]) is not
    ``data``'s, else None. Checkpoints from before the corpus was recorded have none."""
    if saved is None or list(saved) == [data.size, data.sha256]:
        return None
    return (f"--load: the checkpoint was trained on a corpus of {saved[0]:,} bytes (sha256 "
            f"{saved[1][:12]}), {flag} gives {data.size:,} bytes (sha256 {data.sha256[:12]}): the data "
            "would differ from the run it continues")

