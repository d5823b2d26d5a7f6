"""Train the GPT on any layout: ``python -m minipar.train --help``, or on N ranks
``./run_mpi.sh -n 8 -m minipar.train --tp 2 --pp 2 --zero-stage 1``.

On one device this is nanoGPT's loop: sample a batch, forward, backward, clip, AdamW, with a
warm-up and cosine learning-rate schedule, a validation estimate every ``--eval-interval`` steps, a
progress line, an optional JSON log and a loss-curve picture at the end. On N ranks the same loop
runs on a TP x PP x DP grid (``minipar/trainer.py`` builds it), with Megatron-LM's flag names. A
run is a pure function of its flags, whatever the layout: ``--global-batch-size`` samples are
drawn per step from the seed, and a layout only changes how they are split across data-parallel
ranks and micro-batches.

Every flag is checked on every rank before any rank communicates; then one all-reduce tells every
rank whether any found a problem, so a bad flag is one line and exit status 2, never a hang.
"""

import argparse
import math
import os
import sys

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


class FlagError(Exception):
    """A bad flag, found by one rank without communicating (see ``_agree``)."""


class _Parser(argparse.ArgumentParser):
    rank = 0  # only rank 0 prints help

    def error(self, message):
        """One line naming the problem (argparse would print the whole usage first)."""
        raise FlagError(f"{self.prog}: error: {message} (see --help)")

    def print_help(self, file=None):
        if self.rank == 0:
            super().print_help(file)


def build_parser():
    p = _Parser(prog="python -m minipar.train", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
    o.add_argument("--device", choices=("cpu", "cuda"), default=os.environ.get("MINIPAR_DEVICE", "cpu").strip().lower(),
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
    d.add_argument("--load", metavar="DIR", help="continue from the latest checkpoint in DIR (or a checkpoint directory)")
    d.add_argument("--exit-interval", type=positive_int, help="stop when the iterations done are a multiple of this (as Megatron-LM: a planned interruption; needs --save, resume with --load)")
    d.add_argument("--report", action="store_true", help="print every rank's memory and bytes sent per step at the end")
    d.add_argument("--plot", metavar="FILE", default="out/loss.png", help="loss-curve picture ('' for none)")
    d.add_argument("--sample", type=int, default=200, help="bytes to generate after training (0: none)")
    return p


def _writable(p, flag, path):
    """Fail now, not after the whole run, if ``path`` cannot be written."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        p.error(f"{flag} {path}: cannot create {directory} ({exc.strerror})")
    if os.path.isdir(path) or not os.access(directory, os.W_OK):
        p.error(f"{flag} {path}: not a writable file path")


def check_args(p, args, world_size):
    """Errors a flag's own type cannot see, one line each, before anything is built or sent.
    Fills in ``args.dp`` and ``args.micro_batches``."""
    from minipar import backend

    try:
        backend.use_device(args.device)
    except (ImportError, RuntimeError) as exc:
        p.error(f"--device {args.device}: {exc}")
    if args.warmup_iters < 0:
        p.error(f"--warmup-iters must be >= 0, got {args.warmup_iters}")
    if args.min_lr > args.lr:
        p.error(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.data is not None and not os.path.exists(args.data):
        p.error(f"--data {args.data}: no such file or directory")
    if args.init_weights is not None and not os.path.isfile(args.init_weights):
        p.error(f"--init-weights {args.init_weights}: no such file")
    if args.init_weights and args.load:
        p.error("--init-weights and --load both set the weights: give one")
    for flag in ("init_weights", "export_weights"):
        path = getattr(args, flag)
        if path is not None and not path.endswith(".safetensors"):
            p.error(f"--{flag.replace('_', '-')} {path}: expected a .safetensors file")
    for flag in ("log_json", "export_weights", "plot"):
        if getattr(args, flag):
            _writable(p, "--" + flag.replace("_", "-"), getattr(args, flag))
    if args.save:
        _writable(p, "--save", os.path.join(args.save, "latest"))
    if args.exit_interval and not args.save:
        p.error("--exit-interval stops the run to resume it later: give --save DIR to keep its state")
    check_layout(p, args, world_size)


def check_layout(p, args, world_size):
    from minipar.parallel.pipeline.executor import MAX_TAG
    from minipar.parallel.pipeline.schedules import check as check_schedule
    from minipar.parallel.topology import Layout
    from minipar.parallel.zero import NOT_WITH_PIPELINES

    tp, pp = args.tp, args.pp
    if args.dp is None:
        if world_size % (tp * pp):
            p.error(f"{world_size} ranks do not split into TP x PP = {tp} x {pp} groups: launch a multiple "
                    f"of {tp * pp} ranks or change --tp/--pp")
        args.dp = world_size // (tp * pp)
    elif tp * pp * args.dp != world_size:
        p.error(f"TP x PP x DP = {tp} x {pp} x {args.dp} = {tp * pp * args.dp} ranks, but the job has "
                f"{world_size}: launch with -n {tp * pp * args.dp} or change the sizes")
    try:
        Layout(tp, pp, args.dp).check_model(args.n_head, args.n_embd, args.n_layer, args.vpp)
    except ValueError as exc:
        p.error(str(exc))
    if args.vpp > 1 and (pp == 1 or args.schedule != "interleaved"):
        p.error(f"--num-virtual-stages {args.vpp} needs --pp > 1 and --schedule interleaved")
    rows = args.batch_size // args.dp  # sequences per DP rank per step
    if args.batch_size % args.dp:
        p.error(f"--global-batch-size {args.batch_size} does not split over DP={args.dp} ranks: use a multiple of {args.dp}")
    mbs = args.micro_batch_size or (rows // pp if rows % pp == 0 else None)
    if mbs is None or rows % mbs:
        p.error(f"{rows} sequences per data-parallel rank do not split into micro-batches of "
                f"{mbs or 'the default size (rows / PP)'}: set --micro-batch-size to a divisor of {rows}")
    args.micro_batches = rows // mbs
    try:
        check_schedule(pp, args.micro_batches, args.vpp, interleaved=args.schedule == "interleaved")
    except ValueError as exc:
        p.error(f"{exc} (micro-batches = global batch / (DP x micro-batch size))")
    if pp > 1 and 2 * args.micro_batches * pp * args.vpp > MAX_TAG:
        p.error(f"{args.micro_batches} micro-batches x {pp * args.vpp} pipeline chunks need more message "
                f"tags than MPI promises ({MAX_TAG}): raise --micro-batch-size")
    if args.sequence_parallel and tp == 1:
        p.error("--sequence-parallel splits along the tensor-parallel group: it needs --tp > 1")
    if args.sequence_parallel and args.block_size % tp:
        p.error(f"--sequence-parallel splits the sequence: --block-size {args.block_size} is not divisible by TP={tp}")
    if args.sequence_parallel and args.zero_stage >= 2:
        p.error("ZeRO stages 2 and 3 send gradients before sequence parallelism's partial sums are "
                "added: use --zero-stage 0 or 1 with --sequence-parallel")
    if pp > 1 and args.zero_stage >= 2:
        p.error(NOT_WITH_PIPELINES.format(stage_1="--zero-stage 1 (or 0)"))


def check_files(p, args, config):
    """The checkpoint or weights to start from must hold this model (read on every rank, before
    any communication)."""
    from minipar.checkpoint.sharded import CheckpointError, check_model, read_index

    if args.load:
        try:
            index = read_index(args.load)
            check_model(index, config, args.dtype)
        except CheckpointError as exc:
            p.error(f"--load: {exc}")
        saved = index["trainer"]
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


def _agree(comm, problem):
    """End the job with one line if any rank found a bad flag.

    Every rank checked the flags on its own, so every rank reaches this one all-reduce, and it
    cannot hang. The lowest rank with a problem prints it, and no rank exits before it has
    (under ``python -m mpi4py`` the first non-zero exit aborts the whole job at once).
    """
    first = 0 if problem else None
    if comm.size > 1:
        import numpy  # a host array: MPI moves it on any device

        votes = comm.all_reduce(numpy.array([comm.size - comm.rank if problem else 0], numpy.int64), op="max")
        first = comm.size - int(votes[0]) if votes[0] else None
    if first is None:
        return
    if comm.rank == first:
        print(problem, file=sys.stderr, flush=True)
    comm.barrier()
    sys.exit(2)


def main(argv=None):
    from minipar.comm import world

    comm = world()
    parser = build_parser()
    parser.rank = comm.rank
    problem = None
    try:
        args = parser.parse_args(argv)
        check_args(parser, args, comm.size)
        data, config = build(parser, args)
        weights = check_files(parser, args, config)
    except FlagError as exc:
        problem = exc
    _agree(comm, problem)
    comm = world()  # on GPUs now NCCL's (a collective: every rank chose the device above)
    from minipar.checkpoint.sharded import CheckpointError
    from minipar.trainer import Trainer

    try:
        trainer = Trainer(args, config, data, comm, weights)
    except CheckpointError as exc:  # found by the rank that read the damaged part: end every rank
        print(f"{parser.prog}: error: --load: {exc}", file=sys.stderr, flush=True)
        if comm.size > 1:
            comm.abort(1)
        return 1
    return trainer.run()


if __name__ == "__main__":
    sys.exit(main())
