"""Train the GPT on any layout: ``python -m minipar.train --help``, or on N ranks
``./run_mpi.sh -n 8 -m minipar.train --tp 2 --pp 2 --zero-stage 1``.

On one device this is nanoGPT's loop: sample a batch, forward, backward, clip, AdamW, with a
warm-up and cosine learning-rate schedule, a validation estimate every ``--eval-interval`` steps, a
progress line, an optional JSON log and a loss-curve picture at the end. On N ranks the same loop
runs on a TP x PP x DP grid (``minipar/trainer.py`` builds it), with Megatron-LM's flag names. A
run is a pure function of its flags, whatever the layout: ``--global-batch-size`` samples are
drawn per step from the seed, and a layout only changes how they are split across data-parallel
ranks and micro-batches.

Every flag is checked on every rank before any rank communicates (the run's sizes by
``minipar.parallel.validate``, which reports every problem at once); then one all-reduce tells every
rank whether any found a problem (``minipar.cli.agree``), so each problem is one line, one rank
prints them, and every rank exits with status 2, never a hang.
"""

import argparse
import math
import os
import sys

from minipar.cli import FlagError, Parser, agree

DEFAULTS = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=16, max_iters=600,
                lr=3e-3, min_lr=3e-4, warmup_iters=50)


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def build_parser():
    from minipar import backend

    p = Parser(prog="python -m minipar.train", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                description="Train a GPT on bytes of text (by default the Python standard library's "
                            "source), on one device or on a TP x PP x DP grid of MPI ranks.")
    m = p.add_argument_group("model")
    m.add_argument("--n-layer", "--num-layers", type=positive_int, default=DEFAULTS["n_layer"], help="transformer blocks")
    m.add_argument("--n-head", "--num-attention-heads", type=positive_int, default=DEFAULTS["n_head"], help="attention heads")
    m.add_argument("--n-embd", "--hidden-size", type=positive_int, default=DEFAULTS["n_embd"], help="hidden size")
    m.add_argument("--block-size", "--seq-length", type=positive_int, default=DEFAULTS["block_size"], help="context length in bytes")
    m.add_argument("--dropout", type=non_negative_float, default=0.0, help="dropout probability")
    g = p.add_argument_group("parallelism (DP = ranks / (TP x PP))")
    g.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=positive_int, default=1, help="tensor-parallel size")
    g.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=positive_int, default=1, help="pipeline stages")
    g.add_argument("--dp", type=positive_int, help="data-parallel size (checked against the number of ranks)")
    g.add_argument("--num-virtual-stages", "--virtual-pipeline-model-parallel-size", "--vpp", dest="vpp", type=positive_int, default=1, help="model chunks per pipeline rank (interleaved schedule)")
    g.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b", help="pipeline schedule")
    g.add_argument("--micro-batch-size", type=positive_int, help="sequences per micro-batch per DP rank (default: the global batch / DP / PP)")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage of the data-parallel optimizer")
    g.add_argument("--sequence-parallel", action="store_true", help="split LayerNorm and dropout along the sequence (TP > 1)")
    g.add_argument("--recompute", "--recompute-activations", dest="recompute", action="store_true", help="keep only each block's input; recompute it in backward")
    o = p.add_argument_group("optimisation")
    o.add_argument("--max-iters", "--train-iters", dest="max_iters", type=positive_int, default=DEFAULTS["max_iters"], help="training steps in total")
    o.add_argument("--global-batch-size", "--batch-size", dest="batch_size", type=positive_int, default=DEFAULTS["batch_size"], help="sequences per step")
    o.add_argument("--lr", type=non_negative_float, default=DEFAULTS["lr"], help="peak learning rate")
    o.add_argument("--min-lr", type=non_negative_float, default=DEFAULTS["min_lr"], help="final learning rate of the cosine decay")
    o.add_argument("--warmup-iters", "--lr-warmup-iters", dest="warmup_iters", type=int, default=DEFAULTS["warmup_iters"], help="linear warm-up steps")
    o.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="AdamW decoupled weight decay (matrices only)")
    o.add_argument("--grad-clip", "--clip-grad", dest="grad_clip", type=non_negative_float, default=1.0, help="max global gradient norm (0: off)")
    o.add_argument("--seed", type=int, default=1337, help="seed of the weights, the batches and dropout")
    o.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="floating dtype of the whole run")
    o.add_argument("--device", type=backend.device_flag, choices=backend.DEVICES, default=backend.device_from_environment(),
                   help="where the arrays live: cuda runs every op on CuPy arrays, matrix products with "
                        "minipar's own kernel, collectives on NCCL; rank r uses GPU r %% GPUs of its node")
    d = p.add_argument_group("data, output and checkpoints")
    d.add_argument("--data", metavar="PATH", help="text file or directory (default: the Python standard library)")
    d.add_argument("--eval-interval", type=positive_int, default=100, help="steps between validation estimates")
    d.add_argument("--eval-iters", type=positive_int, default=10, help="batches per validation estimate")
    d.add_argument("--log-interval", type=positive_int, default=20, help="steps between progress lines")
    d.add_argument("--log-json", metavar="FILE", help="write one JSON object per step (iter, loss, lr, ms, ...)")
    d.add_argument("--init-weights", metavar="FILE", help="start from these weights (.safetensors, GPT-2 names)")
    d.add_argument("--export-weights", metavar="FILE", help="save the final weights (.safetensors, GPT-2 names)")
    d.add_argument("--save", metavar="DIR", help="write sharded checkpoints here (every --save-interval steps and at the end)")
    d.add_argument("--save-interval", type=positive_int, default=100, help="steps between checkpoints")
    d.add_argument("--keep-checkpoints", metavar="N", type=positive_int, help="keep only the N newest checkpoints in --save (default: all)")
    d.add_argument("--overwrite-checkpoints", action="store_true", help="let this run write into a --save directory that holds checkpoints it does not continue")
    d.add_argument("--load", metavar="DIR", help="continue from the latest checkpoint in DIR (or a checkpoint directory)")
    d.add_argument("--exit-interval", type=positive_int, help="stop when the iterations done are a multiple of this (as Megatron-LM: a planned interruption; needs --save, resume with --load)")
    d.add_argument("--report", action="store_true", help="print every rank's memory and bytes sent per step at the end")
    d.add_argument("--plot", metavar="FILE", default="out/loss.png", help="loss-curve picture ('' for none)")
    d.add_argument("--sample", type=int, default=200, help="bytes to generate after training (0: none)")
    return p


# the RunConfig field each flag sets, so that a problem names the flag
FLAGS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "virtual_stages": "--num-virtual-stages", "schedule": "--schedule",
         "global_batch": "--global-batch-size", "micro_batch_size": "--micro-batch-size", "n_layer": "--n-layer",
         "n_head": "--n-head", "n_embd": "--n-embd", "block_size": "--block-size", "dropout": "--dropout",
         "sequence_parallel": "--sequence-parallel", "zero_stage": "--zero-stage", "dtype": "--dtype"}


def run_config(args, world_size):
    """The run the flags describe, as plain numbers (``minipar.parallel.validate``)."""
    from minipar.parallel.validate import RunConfig

    return RunConfig(world_size=world_size, tp=args.tp, pp=args.pp, dp=args.dp, virtual_stages=args.vpp,
                     schedule=args.schedule, global_batch=args.batch_size, micro_batch_size=args.micro_batch_size,
                     n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                     dropout=args.dropout, sequence_parallel=args.sequence_parallel, zero_stage=args.zero_stage,
                     recompute=args.recompute, dtype=args.dtype)


def _writable(flag, path):
    """A problem now, not after the whole run, if ``path`` cannot be written (None if it can)."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        return f"{flag} {path}: cannot create {directory} ({exc.strerror})"
    if os.path.isdir(path) or not os.access(directory, os.W_OK):
        return f"{flag} {path}: not a writable file path"
    return None


def check_args(args, world_size):
    """Every error a flag's own type cannot see, one line each, before anything is built or sent;
    raises FlagError with all of them. Fills in ``args.dp`` and ``args.micro_batches``."""
    from minipar import backend
    from minipar.parallel.validate import resolve

    problems = []
    try:
        backend.use_device(args.device)
    except (ImportError, RuntimeError) as exc:
        problems.append(f"--device {args.device}: {exc}")
    if args.warmup_iters < 0:
        problems.append(f"--warmup-iters must be >= 0, got {args.warmup_iters}")
    if args.min_lr > args.lr:
        problems.append(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.seed < 0:
        problems.append(f"--seed must be >= 0, got {args.seed}")
    if args.data is not None and not os.path.exists(args.data):
        problems.append(f"--data {args.data}: no such file or directory")
    if args.init_weights is not None and not os.path.isfile(args.init_weights):
        problems.append(f"--init-weights {args.init_weights}: no such file")
    if args.init_weights and args.load:
        problems.append("--init-weights and --load both set the weights: give one")
    for flag in ("init_weights", "export_weights"):
        path = getattr(args, flag)
        if path is not None and not path.endswith(".safetensors"):
            problems.append(f"--{flag.replace('_', '-')} {path}: expected a .safetensors file")
    if args.plot:
        from minipar.plots import path_problem

        why = path_problem(args.plot)
        if why:
            problems.append(f"--plot {args.plot}: {why}")
    for flag in ("log_json", "export_weights", "plot"):
        if getattr(args, flag):
            problems.append(_writable("--" + flag.replace("_", "-"), getattr(args, flag)))
    if args.save:
        problems.append(_writable("--save", os.path.join(args.save, "latest")))
    for flag in ("keep_checkpoints", "overwrite_checkpoints"):
        if getattr(args, flag) and not args.save:
            problems.append(f"--{flag.replace('_', '-')} is about the checkpoints of --save DIR: give --save")
    if args.exit_interval and not args.save:
        problems.append("--exit-interval stops the run to resume it later: give --save DIR to keep its state")
    run, layout = resolve(run_config(args, world_size), FLAGS)  # the layout, model, schedule, batch, ZeRO
    if not layout:  # the sizes make sense: will the model fit before it is allocated?
        from minipar.parallel.memory import problem as memory_problem

        problems.append(memory_problem(run, backend.free_memory(), FLAGS))
    problems = [p for p in problems if p] + layout
    if problems:
        raise FlagError(*problems)
    args.dp, args.micro_batches = run.dp, run.micro_batches


def check_files(p, args, config, data):
    """The checkpoint or weights to start from must hold this model and have been trained on this
    corpus (read on every rank, before any communication). ``args.load`` becomes the checkpoint
    directory itself (not ``latest``, which may move)."""
    from minipar.checkpoint.sharded import CheckpointError, check_model, read_index
    from minipar.run_inputs import corpus_matches

    if args.load:
        try:
            index = read_index(args.load)
            check_model(index, config, args.dtype)
        except CheckpointError as exc:
            p.error(f"--load: {exc}")
        args.load = index["path"]
        saved = index["trainer"]
        # read_index checked the index's own fields; the trainer's state is ours to check
        rng = saved.get("rng") if isinstance(saved.get("rng"), dict) else {}
        missing = [key for key in ("iteration", "seed", "batch_size") if type(saved.get(key)) is not int]
        missing += [] if type(rng.get("seed")) is int else ["rng.seed"]
        if missing:
            p.error(f"--load: {args.load}/index.json: its trainer state has no whole number "
                    f"{', '.join(missing)}: it was not written by minipar.train")
        problem = corpus_matches(saved.get("corpus"), data, f"--data {args.data or '(default corpus)'}")
        if problem:
            p.error(problem)
        for key, flag in (("seed", "--seed"), ("batch_size", "--global-batch-size")):
            if saved[key] != getattr(args, key):
                p.error(f"--load: the checkpoint was trained with {flag} {saved[key]}, not "
                        f"{getattr(args, key)}: the data would differ from the run it continues")
        if index["iteration"] >= args.max_iters:
            p.error(f"--load: the checkpoint is at iteration {index['iteration']}, so --max-iters "
                    f"{args.max_iters} leaves nothing to train: raise --max-iters")
    if args.init_weights:
        from minipar import checkpoint
        from minipar.models import GPT

        try:
            weights = checkpoint.load_weights(args.init_weights)
        except (OSError, ValueError) as exc:
            p.error(f"--init-weights {args.init_weights}: {exc}")
        # the names and shapes of the single-device model (the trainer reseeds before its own)
        expected = {n: q.shape for n, q in GPT(config).named_parameters()}
        problems = [f"missing: {n}" for n in expected if n not in weights]
        problems += [f"unexpected: {n}" for n in weights if n not in expected]
        problems += [f"{n}: shape {tuple(weights[n].shape)}, model has {s}" for n, s in expected.items()
                     if n in weights and tuple(weights[n].shape) != s]
        if problems:
            more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
            p.error(f"--init-weights {args.init_weights}: {'; '.join(problems[:2])}{more}; "
                    "the model flags must match the file's model")
        # a float32 file may start a float64 run and back: the cast is explicit, here
        return {k: v.astype(args.dtype) for k, v in weights.items()}
    return None


def build(p, args):
    """The data and the model's config the flags describe; a bad combination is a one-line error."""
    from minipar.data import Dataset, load_corpus
    from minipar.models import GPTConfig

    try:
        config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                           block_size=args.block_size, dropout=args.dropout)
    except ValueError as exc:
        p.error(str(exc))
    try:
        data = Dataset(load_corpus(args.data))
        data.check_block_size(args.block_size)
    except (OSError, ValueError) as exc:
        p.error(f"--data {args.data or '(default corpus)'}: {exc}")
    return data, config


def _end(comm, prog, message):
    """One rank found a problem the others cannot see: say it, and end every rank."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    if comm.size > 1:
        comm.abort(1)
    return 1


def interrupted(args, iteration):
    """The line a Ctrl-C ends the run with: where it stopped and which checkpoint survives (a save
    in progress is written aside and renamed at its end, so the previous one is whole)."""
    from minipar.checkpoint.sharded import CheckpointError, read_index

    line = f"interrupted at iteration {iteration}"
    if not args.save:
        return line
    try:
        kept = read_index(args.save)["iteration"]
    except CheckpointError:
        return f"{line}; no checkpoint was saved in {args.save} yet"
    return f"{line}; the last checkpoint in {args.save} (iteration {kept}) is kept: continue with --load {args.save}"


def main(argv=None):
    from minipar.comm import world
    from minipar.run_inputs import claim_save_directory, same_inputs

    comm = world()
    parser = build_parser()
    parser.rank = comm.rank
    problems, lock = [], None
    try:
        args = parser.parse_args(argv)
        check_args(args, comm.size)
        data, config = build(parser, args)
        weights = check_files(parser, args, config, data)
        lock = claim_save_directory(args, comm.rank)  # last: held only by a run that goes on
    except FlagError as exc:
        problems = exc.lines
    agree(comm, problems, parser.prog)
    agree(comm, same_inputs(comm, args, data), parser.prog)  # rank 0's checkpoint and corpus, on every rank
    comm = world()  # on GPUs now NCCL's (a collective: every rank chose the device above)
    from minipar.checkpoint.sharded import CheckpointError
    from minipar.trainer import Trainer

    try:
        trainer = Trainer(args, config, data, comm, weights)
    except CheckpointError as exc:  # found by the rank that read the damaged part
        return _end(comm, parser.prog, f"--load: {exc}")
    try:
        return trainer.run()
    except CheckpointError as exc:  # a save that failed (a full disk): the last good one stays
        return _end(comm, parser.prog, f"--save: {exc}")
    except KeyboardInterrupt:  # Ctrl-C is how a user stops a run, not a bug: no traceback
        if comm.rank == 0:
            print(f"{parser.prog}: {interrupted(args, trainer.model.rng.iteration)}", file=sys.stderr, flush=True)
        return 128 + 2  # the shell's status for a death by SIGINT (2), so scripts see the interruption
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
