"""Train the GPT on any layout: ``python -m minipar.train --help``, or on N ranks
``./run_mpi.sh -n 8 -m minipar.train --tp 2 --pp 2 --zero-stage 1``.

On one device this is nanoGPT's loop: sample a batch, forward, backward, clip, AdamW, with a
warm-up and cosine learning-rate schedule, a validation estimate every ``--eval-interval`` steps, a
progress line, an optional JSON log and a loss-curve picture at the end. On N ranks the same loop
runs on a TP x CP x DP x PP grid (``minipar/trainer.py`` builds it), with Megatron-LM's flag names. A
run is a pure function of its flags, whatever the layout: ``--global-batch-size`` samples are
drawn per step from the seed, and a layout only changes how they are split across data-parallel
ranks and micro-batches.

Every flag is checked on every rank before any rank communicates (the run's sizes by
``minipar.parallel.validate``, which reports every problem at once); then one all-reduce tells every
rank whether any found a problem (``minipar.cli.agree``), so each problem is one line, one rank
prints them, and every rank exits with status 2, never a hang.
"""

import os
import signal
import sys
import time

from minipar.cli import FlagError, agree
from minipar.train_checks import check_args, check_files
from minipar.train_flags import build_parser  # noqa: F401 (the trainer's flags, imported from here by their users)

def build(p, args, share_tokens=False):
    """The data and the model's config the flags describe; a bad combination is a one-line error.
    ``share_tokens``: a corpus the token cache lacks is left for ``Dataset.share_tokens`` to
    tokenize on one rank, and its block-size check for ``check_block_size`` after it."""
    from minipar.data import Dataset, load_corpus
    from minipar.models import GPTConfig

    try:
        config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                           block_size=args.block_size, vocab_size=args.vocab_size, dropout=args.dropout,
                           num_experts=args.num_experts or 0,
                           moe_router_topk=args.moe_router_topk, moe_layer_freq=args.moe_layer_freq,
                           moe_expert_capacity_factor=args.moe_expert_capacity_factor,
                           moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
                           moe_router_pre_softmax=args.moe_router_pre_softmax)
    except ValueError as exc:
        p.error(str(exc))
    try:
        data = Dataset(load_corpus(args.data), tokenizer=args.tokenizer, path=args.data, defer_cache=True,
                       share_tokens=share_tokens)
    except (OSError, ValueError) as exc:
        p.error(f"--data {args.data or '(default corpus)'}: {exc}")
    if data.splits is not None:
        check_block_size(p, args, data)
    return data, config


def check_block_size(p, args, data):
    """A one-line error if a split of ``data`` is too short for one sequence and its targets."""
    try:
        data.check_block_size(args.block_size, args.taken_from.get("block_size"))
    except ValueError as exc:
        p.error(f"--data {args.data or '(default corpus)'}: {exc}")


def _end(comm, prog, message):
    """One rank found a problem the others cannot see: say it, and end every rank."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    if comm.size > 1:
        comm.abort(1)
    return 1


def _checkpoint_failed(comm, prog, flag, exc):
    """A checkpoint that could not be loaded or saved. Raised by every rank (``exc.speaks`` set,
    ``checkpoint.failures.agree_on_failure``): one line, from the rank that found why, and all end together,
    nothing aborted; raised by one rank alone: it says so and ends the others."""
    if exc.speaks is None:
        return _end(comm, prog, f"{flag}: {exc}")
    if exc.speaks:
        print(f"{prog}: error: {flag}: {exc}", file=sys.stderr, flush=True)
    comm.barrier()
    from minipar.comm import end_job

    end_job(1)  # all together: no abort


def _an_output(args, path):
    """Whether ``path`` is one of the files the run writes besides its checkpoints (each writer
    names its output when it fails: a full disk)."""
    outputs = (args.log_json, args.export_weights, args.export_hf, args.plot)
    return path is not None and os.path.abspath(path) in {os.path.abspath(p) for p in outputs if p}


def unwritten(args, iteration, trained):
    """What survives an output that could not be written, and what to do about it."""
    if not trained:
        return interrupted(args, iteration).replace("interrupted", "stopped", 1)
    if not args.save:
        return "the run trained all its iterations, but saved no checkpoint: free space, and run again with --save DIR"
    return (f"the run trained all its iterations, and its last checkpoint is in {args.save}: free space, and "
            f"write the outputs from it with --load {args.save} --max-iters 0 and the same output flags")


INTERRUPT_GRACE_S, INTERRUPT_STAGGER_S = 2.0, 0.5  # how long a rank other than 0 waits before it speaks


def interrupted(args, iteration):
    """The line a Ctrl-C ends the run with: where it stopped and which checkpoint survives (a save
    in progress is written aside and renamed at its end, so the previous one is whole).
    ``iteration`` None: stopped before training started (``args`` None: before the flags were read)."""
    from minipar.train_report import last_checkpoint

    line = "interrupted before training started" if iteration is None else f"interrupted at iteration {iteration}"
    if args is None or not args.save:
        return line
    kept = last_checkpoint(args.save)
    if kept is None:
        return f"{line}; no checkpoint was saved in {args.save} yet"
    if iteration is not None and kept == iteration + 1:  # stopped between a step's save and the next step
        line = f"interrupted after iteration {kept - 1}"
    return f"{line}; the last checkpoint in {args.save} (iteration {kept}) is kept: continue with --load {args.save}"


def main(argv=None):
    from minipar.comm import world

    comm = world()
    parser = build_parser()
    parser.rank = comm.rank
    run = {}  # what an interruption reports, once there is any: the flags, the trainer; the save lock
    try:
        return _main(comm, parser, argv, run)
    except KeyboardInterrupt:  # Ctrl-C is how a user stops a run, not a bug: no traceback, from start to end
        # a second Ctrl-C (mpiexec forwards each, and a signal to every task sends its own) must not
        # land in the lines below as a traceback: the first one is being answered
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if comm.rank != 0:
            # Ctrl-C reaches every rank, and rank 0's line and exit end the job within this grace;
            # a rank still here was interrupted alone (kill -INT of its process), or rank 0 cannot
            # speak (Python sees a signal only between calls, and rank 0 may be inside MPI waiting
            # for this rank): it says so itself, the lowest such rank first, its exit ending the rest
            time.sleep(INTERRUPT_GRACE_S + INTERRUPT_STAGGER_S * min(comm.rank - 1, 16))
        who = "" if comm.rank == 0 else f"rank {comm.rank}: "  # says it for the job: rank 0 could not
        trainer = run.get("trainer")
        # (a resumed run's iteration before its first step is where it resumed)
        line = interrupted(run.get("args"), None if trainer is None else max(trainer.model.rng.iteration, trainer.start))
        print(f"{parser.prog}: {who}{line}", file=sys.stderr, flush=True)
        return 128 + 2  # the shell's status for a death by SIGINT (2), so scripts see the interruption
    finally:
        if run.get("lock") is not None:
            run["lock"].release()


def _main(comm, parser, argv, run):
    """``main`` up to the run's exit status; fills ``run`` as it goes (``main`` reports from it)."""
    from minipar.comm import end_job, world
    from minipar.run_inputs import claim_save_directory, same_inputs

    problems = []
    try:
        args = run["args"] = parser.parse_args(argv)  # with a snapshot's config.json and a tokenizer's vocabulary
        check_args(args, comm.size)
        data, config = build(parser, args, share_tokens=True)
        weights = check_files(parser, args, config, data)
    except FlagError as exc:
        problems = exc.lines
    agree(comm, problems, parser.prog)
    agree(comm, same_inputs(comm, args, data, weights), parser.prog)  # rank 0's checkpoint, corpus, weights
    data.share_tokens(comm)  # a corpus the cache lacked, tokenized on rank 0 for every rank
    problems = []
    try:
        check_block_size(parser, args, data)  # (again where the ids were cached: the same verdict)
        run["lock"] = claim_save_directory(args, comm.rank)  # last: held only by a run that goes on
    except FlagError as exc:
        problems = exc.lines
    agree(comm, problems, parser.prog)
    data.keep_cache(comm)  # the run goes on: a corpus tokenized now keeps its ids for the next run
    if comm.rank == 0:
        for note in data.notes:
            print(note, flush=True)
    if args.load and args.use_checkpoint_opt_param_scheduler and args.max_iters:  # --load: rank 0's now, on every rank
        from minipar.checkpoint.sharded import read_index
        from minipar.lr_schedule import take_schedule

        take_schedule(args, read_index(args.load)["trainer"]["schedule"])
    comm = world()  # on GPUs now NCCL's (a collective: every rank chose the device above)
    from minipar.checkpoint.sharded import CheckpointError
    from minipar.trainer import Trainer

    try:
        trainer = run["trainer"] = Trainer(args, config, data, comm, weights)
    except CheckpointError as exc:  # a damaged part, found by the ranks that read it
        return _checkpoint_failed(comm, parser.prog, "--load", exc)
    try:
        status = trainer.run()
    except CheckpointError as exc:  # a save that failed (a full disk): the last good one stays
        return _checkpoint_failed(comm, parser.prog, "--save", exc)
    except OSError as exc:
        if not _an_output(args, exc.filename):  # not one of the run's own writes: a bug to be seen whole
            raise
        return _end(comm, parser.prog, f"cannot write {exc.filename} ({exc.strerror or exc}): "
                    + unwritten(args, trainer.model.rng.iteration, trainer.trained))
    if status:  # a diverged or stuck run, which every rank saw in the same all-reduced numbers
        end_job(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
