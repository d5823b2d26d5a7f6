"""What every MPI lesson does around its technique, so that each lesson's ``main`` reads as the story.

A lesson is five moves, and only the middle two are its own:

    args, comm = lesson.start(...)                 flags agreed on every rank; dtype, device
    reference = lesson.reference_run(...)          the single-device run every layout must equal
    ... the technique: build the parallel model, train the same steps, count what it sends and holds
    compare = lesson.Comparison(reference)         its relative errors, one row per quantity
    return lesson.finish(comm, failed, report, "The ... equals ...")

``finish`` makes the ranks agree on the verdict, lets rank 0 print the report and one last
sentence, and returns the exit status: 0, or 1 on a mismatch (``--plant-bug`` makes one). Every
row of an error table (``print_errors``) ends in "ok" or "FAIL", and a mismatch's last sentence
names what failed.

This module belongs to the lessons: minipar never imports it. A lesson finds it because a
script's folder comes first on ``sys.path`` (``python -m mpi4py`` keeps that rule).
"""

import os
import sys
from dataclasses import dataclass

import numpy as np

import minipar
from minipar import backend
from minipar.backend import add_device_flag
from minipar.cli import Parser, device_problems, parse
from minipar.comm import end_job, world
from minipar.data import Dataset, load_corpus
from minipar.mfu import model_flops_per_token
from minipar.models import GPT
from minipar.models.moe import step_statistics
from minipar.optim import AdamW, clip_grad_norm
from minipar.verify import as_one_vector, rel_err, worst_tensor

from computed_once import computed_once
from lesson_checks import at_least_one, memory_problems, output_problems, too_big  # noqa: F401 (re-exported)

# how far a parallel run may be from one device: rounding in another summation order
TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
# AdamW for every run; eps = 1e-5 so that nearly cancelled gradients are not full steps (minipar.verify)
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)


def start(description, flags=None, check=None, *, plant_bug, training=True, steps=3, dtypes=tuple(TOLERANCE),
          dtype_help=None):
    """The world and the flags, parsed and checked on every rank before any message: on a problem,
    one rank prints it, one line each, and every rank exits with status 2 (minipar.cli).

    ``flags(parser)`` adds the lesson's own flags; ``check(args, ranks)`` returns the problems
    argparse cannot see, one line each (``validate.problems`` of the run, ``at_least_one``). A
    training lesson also takes --steps, --dtype (one of ``dtypes``; ``dtype_help`` says why where
    that is float32 alone), --device and --seed, and from here on runs in that dtype on that device.
    Returns (args, comm): on GPUs, comm is then NCCL's."""
    comm = world()
    p = Parser(description=description)
    if flags is not None:
        flags(p)
    if training:
        p.add_argument("--steps", type=int, default=steps, help="optimizer steps compared")
        p.add_argument("--dtype", choices=dtypes, default="float32", help=dtype_help)
        add_device_flag(p)
        p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plant-bug", action="store_true", help=plant_bug)

    def problems(args):
        if training:
            found = device_problems(args) + ([f"--seed must be >= 0, got {args.seed}"] if args.seed < 0 else [])
        else:  # a lesson without --device runs on NumPy, but a MINIPAR_DEVICE it cannot honour is refused
            unusable = backend.environment_problem()
            found = [unusable] if unusable else []
        return found + (check(args, comm.size) if check is not None else [])

    args = parse(p, comm, problems)
    if training:
        minipar.set_default_dtype(args.dtype)
        comm = world()  # on GPUs, NCCL's communicator now that the device is chosen
    return args, comm


def batches(args, block_size):
    """Each step's global batch (x, y): a pure function of the seed and the step, so every rank
    and every layout sees the same samples."""
    data = Dataset(load_corpus())
    return [data.batch("train", step, args.batch_size, block_size, args.seed) for step in range(args.steps)]


@dataclass
class Reference:
    """What the single-device run leaves to compare with."""
    losses: list   # each step's loss
    grads: dict    # the first step's gradients by name (before clipping)
    logits: object  # the first step's logits, (B, T, vocab)
    params: dict   # the parameters after the last step
    routing: dict = None  # a mixture of experts': the first step's ``step_statistics``
    last_routing: dict = None  # ... and the last step's


def reference_run(comm, config, batches, seed, max_norm=None, routing=None, delay=0, root=0):
    """The single-device run, on rank ``root`` alone and sent to every rank (``computed_once``; a
    collective: every rank of ``comm`` calls it, with the same ``root``): AdamW (``HYPER``) from
    ``seed`` over ``batches``, each whole batch at once, the gradients clipped to ``max_norm`` if
    given. ``routing``: the RoutingGroups a parallel mixture of experts routes (``models/moe.py``).
    ``delay``: each step's gradient is taken at the weights that many updates back (PipeDream-2BW's
    W(t+1) = W(t) - lr grad f(W(t-1)) is delay 1; W(-1) = W(0)), and updates the newest ones."""
    def run():
        return vars(_single_device(config, batches, seed, max_norm, routing, delay))

    return Reference(**computed_once(comm, run, root))


def _single_device(config, batches, seed, max_norm, routing, delay):
    minipar.manual_seed(seed)
    model = GPT(config, moe_routing=routing)
    opt = AdamW(model.parameters(), **HYPER)
    losses = []
    versions = [{n: p.data.copy() for n, p in model.named_parameters()}] * (delay + 1)
    for step, (x, y) in enumerate(batches):
        model.rng.iteration = step  # keys the dropout masks (with each token's place)
        model.moe.reset()
        for n, p in model.named_parameters():  # the version the gradient is taken at
            p.data[...] = versions[0][n]
        logits, loss = model(x, y)
        loss.backward()
        for n, p in model.named_parameters():  # the newest, which the update moves
            p.data[...] = versions[-1][n]
        if step == 0:
            first = logits.data, {n: p.grad.copy() for n, p in model.named_parameters()}
            moe = step_statistics(model) if config.num_experts else None
        last_moe = step_statistics(model) if config.num_experts else None
        if max_norm is not None:
            clip_grad_norm(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        versions = versions[1:] + [{n: p.data.copy() for n, p in model.named_parameters()}]
    return Reference(losses, first[1], first[0], model.state_dict(), moe, last_moe)


class Comparison:
    """A run's relative errors against the reference (minipar.verify), one row per quantity in
    ``order``; the loss keeps its worst step. ``errors`` is the table's column: {row: error}."""

    def __init__(self, reference, order=("loss", "gradients", "parameters"), loss="loss"):
        self.reference = reference
        names = {"logits": "logits", "loss": loss, "gradients": "gradients (worst tensor)",
                 "parameters": f"parameters after {len(reference.losses)} steps",
                 "aux": "balancing + z-loss", "routing": "slots per expert (diff)"}
        self.names = {row: names[row] for row in order}
        self.errors = {name: 0.0 for name in self.names.values()}

    def record(self, row, error):
        """An error measured by the lesson itself; the worst one recorded stays (NaN the worst)."""
        name = self.names[row]
        self.errors[name] = float(np.maximum(self.errors[name], error))

    def logits(self, logits, rows=slice(None)):
        """The first step's logits; ``rows``: which of the reference's this rank holds."""
        self.record("logits", rel_err(logits, self.reference.logits[rows]))

    def loss(self, step, loss):
        self.record("loss", rel_err(loss, self.reference.losses[step]))

    def gradients(self, grads, reference=None):
        """The first step's gradients by name, the worst tensor: of the names given (a pipeline
        stage holds some), against ``reference``'s where the run holds other shapes (TP shards)."""
        if reference is None:
            reference = {n: self.reference.grads[n] for n in grads}
        self.record("gradients", worst_tensor(grads, reference))

    def parameters(self, params, some=False):
        """All parameters after the last step, as one vector; ``some``: only those ``params`` names
        (the experts an expert-parallel rank holds), else every parameter of the model."""
        reference = {n: self.reference.params[n] for n in params} if some else self.reference.params
        self.record("parameters", as_one_vector(params, reference))

    def stage_parameters(self, comm, model):
        """All parameters after the last step as one vector over the ranks of ``comm``, each
        holding some (a pipeline stage its layers): their sums of squares added up."""
        sq = np.zeros(2)
        for n, p in model.named_parameters():
            a, b = np.asarray(p.data, np.float64), np.asarray(self.reference.params[n], np.float64)
            sq += [((a - b) ** 2).sum(), (b ** 2).sum()]
        sq = comm.all_reduce(sq)
        self.record("parameters", float(np.sqrt(sq[0] / sq[1])))

    def worst_over(self, comm):
        """Each row's worst over the ranks, on every rank (each rank compared what it holds)."""
        self.errors = {name: comm.all_reduce(np.array([e]), op="max")[0] for name, e in self.errors.items()}
        return self.errors


def print_errors(runs, tolerance, width=10, title="relative error against the single-device run", note=""):
    """The table of relative errors: a row per quantity, a column per run, and last the row's
    verdict, "ok" or "FAIL" (an error above ``tolerance`` in any column, or NaN). ``runs`` is
    {column heading: {row: error}}; a lone run under the heading None prints no heading row."""
    print(f"\n{title} (tolerance {tolerance:g}){note}")
    if list(runs) != [None]:
        print(f"  {'':<28}" + "".join(f"{heading:>{width}}" for heading in runs))
    for row in next(iter(runs.values())):
        verdict = "FAIL" if _failing(tolerance, runs, row) else "ok"
        print(f"  {row:<28}" + "".join(f"{errors[row]:>{width}.1e}" for errors in runs.values()) + f"  {verdict}")


def _failing(tolerance, runs, row):
    """The headings of the columns whose error in ``row`` is above ``tolerance``, or NaN."""
    return [str(heading) for heading, errors in runs.items() if not errors[row] <= tolerance]


def failed_rows(tolerance, runs, where=""):
    """[the line naming the rows of an error table (``runs`` as ``print_errors`` takes it) above
    ``tolerance``, each with the columns it failed in], or [] if none is: a mismatch's words (``finish``).
    ``where``: which table, where a lesson prints several."""
    rows = []
    for row in next(iter(runs.values()), {}):  # (lesson 4 with PipeDream-2BW alone has no table of runs)
        columns = _failing(tolerance, runs, row)
        if columns:
            rows.append(row if list(runs) == [None] else f"{row} [{', '.join(columns)}]")
    return [f"see the rows above marked FAIL{where}: {', '.join(rows)}"] if rows else []


def mfu(comm, config, tokens, seconds, peak):
    """The line reporting model FLOPs utilisation (a collective): the GPT's training FLOPs for
    ``tokens`` per step over the steps' ``seconds`` (the slowest rank's mean, the first step left
    out when there are more: it warms up and compares gradients) and ``peak`` (``minipar.mfu.measured_peak``)."""
    step_s = comm.all_reduce(np.array([np.mean(seconds[1:] or seconds)]), op="max")[0]
    flops = tokens * model_flops_per_token(config)
    return (f"MFU {flops / step_s / peak:.1%}: {flops / 1e9:.3f} GFLOP per step in {1e3 * step_s:.0f} ms, "
            f"peak {peak / 1e9:.1f} GFLOP/s (all ranks at once)")


def finish(comm, failed, report, passed):
    """The end of every lesson: the ranks agree on the verdict (one rank's mismatch fails all),
    rank 0 runs ``report()`` and prints the last sentence, ``passed`` or the mismatch, and every
    rank returns the exit status, 0 or 1. ``failed``: what failed on this rank, a line each ([]
    if nothing did): rank 0's lines name the mismatch. No rank returns before rank 0 has printed:
    under ``python -m mpi4py`` a rank's non-zero exit ends the whole job at once."""
    failed_here = list(failed)
    failed = bool(comm.all_reduce(np.array([int(bool(failed_here))]), op="max")[0])
    if comm.rank == 0:
        report()
        what = "; ".join(failed_here) or "a check failed on a rank other than 0 (rank 0's passed)"
        print(f"\nMISMATCH: {what}" if failed else f"\n{passed}")
    comm.barrier()
    return int(failed)


def end(status):
    """A lesson script's last call: every rank exits with ``status``, the agreed verdict of
    ``finish`` (or a refusal's). MPI is finalized first (``minipar.comm.end_job``), so a failing
    lesson prints its MISMATCH line and nothing after it from MPICH."""
    end_job(status)


def parse_one_process(parser, check):
    """The flags of a lesson that runs in one process (01, 07), as ``minipar.cli.parse`` checks them
    (``check(args)``: the problems, a line each). Started on several MPI ranks (run_mpi.sh -n 2),
    each rank would run the whole lesson and print it, interleaved with the others: that is refused
    too, in one line from one rank, every rank exiting with status 2."""
    ranks = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)  # MPICH's, Open MPI's
    comm = world() if ranks > 1 else None  # MPI only to agree on the refusal

    def problems(args):
        found = check(args)
        if ranks > 1:
            found.append(f"this lesson runs in one process, and {ranks} ranks started it (each would run it all): "
                         f"run python {os.path.relpath(sys.argv[0])}")
        return found

    return parse(parser, comm, problems)
