"""The step protocol: what every data-parallel optimizer offers the training loop.

Plain data parallelism with AdamW and ZeRO stages 1, 2 and 3 differ in where the gradients and the
Adam state live and in how they are summed over the data-parallel group, but a step is the same
for all of them, so every caller (the trainer, the pipeline executor, the lessons) writes it once:

    construction   the gradient-ready hooks are registered, replicas start from DP rank 0's weights
    backward(s)    the hooks fire as each gradient completes; inside ``no_sync()`` (every micro-batch
                   but the last) nothing is sent that could still wait
    finish_gradients()   the gradients summed over DP and finished by ``model.finalize_grads()``
                   (sequence-parallel sums, the tied embedding's two parts), in the order this
                   class needs: an all-reduce in flight is waited for first, a reduce-scatter of
                   whole buffers comes after
    clip_grad_norm(max_norm)   the whole model's norm (over TP, PP and DP), returned; scaled down
    step(grad_scale)     the AdamW update of what this rank owns, then whatever it must share
                   (``grad_scale`` multiplies the gradients as AdamW reads them)
    zero_grad()    gradients zeroed, ready for the next step's backward
    state_bytes()  {"parameters", "gradients", "optimizer"}: bytes this rank holds after a step

plus ``lr`` (the schedule sets it), ``step_count`` and ``state_arrays()`` for checkpoints,
``full_gradients()`` and ``full_state_dict()`` for checks against one device, and
``nonfinite_gradients()`` to name what diverged. Each class's distinguishing communication is one
named method: ``DataParallelAdamW.all_reduce_bucket``, ``ZeRO1.reduce_scatter_gradients``,
``ZeRO2.reduce_scatter_group``, ``ZeRO3.gather_parameters`` / ``release_parameters`` /
``reduce_scatter_group``. ``zero_stage`` is read in one place, ``make_optimizer`` (``optimizers.py``).

What the protocol asks of the model: ``parameters()``, ``named_parameters()``, ``grid`` (the
ProcessGrid its parameters' placements name groups of, for the norm over TP and PP; ``Module``'s is
None, one device), ``finalize_grads()`` (``Module``'s does nothing) and, for ZeRO-3, ``units()``
and ``wrap_units(runner)`` (see ``zero3.py``).

Which group sums a gradient is the parameter's placement: "edp" in its ``grad_sum`` (an expert's
weights, ``parallel/experts.py``) means the grid's expert-data-parallel group, anything else the
optimizer's ``comm``; ``gradient_group`` is that rule, which every stage's sums, broadcasts and
gathers follow.
"""

import contextlib
import hashlib
from abc import ABC, abstractmethod

import numpy

from minipar.backend import xp

STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")  # a parameter and AdamW's m and v (PyTorch's names)
STASHED = "stashed_param"  # PipeDream-2BW's older weight version (``weight_stash.py``)


def gradient_group(p, grid, comm):
    """The communicator ``p``'s gradient is summed over, for an optimizer over ``comm``: the grid's
    edp group for an expert's weights (the ranks holding the same experts), ``comm`` for the rest.
    The edp groups cut the DP x CP group by EP rank, so ``comm`` must be that group: its sums
    and the experts' then cover the same ranks, and a norm over it counts every piece once."""
    if "edp" not in p.placement.grad_sum:
        return comm
    if grid is None or comm is not grid.dp_cp_group:
        raise ValueError("an expert parameter's gradient is summed over its grid's edp group, a part of "
                         "the DP x CP group: build the model on a grid and run the optimizer over "
                         "grid.dp_cp_group (make_optimizer does)")
    return grid.edp_group


def finished_by_model(p):
    """Whether the model still adds to ``p``'s gradient after backward (``finalize_grads``): the
    partial sums of sequence parallelism over TP, the tied embedding's two parts over a pipeline's
    ends. ZeRO-2 and 3 hold these back from their reduce-scatters during backward."""
    return "tp" in p.placement.grad_sum or "embedding" in p.placement.grad_sum


def check_same_layout(model, comm, what, settings=()):
    """Raise on every rank of ``comm`` unless all were given the same parameters (name, shape,
    dtype; an expert's name differs by EP rank, so not its name) and ``settings`` (what else cuts
    the groups): otherwise their broadcasts and reduce-scatters differ in size or number, and hang
    or sum unrelated values. One all-gather of a digest; only if they differ, one of the lines
    themselves, to name the first difference."""
    if comm is None or comm.size == 1:
        return
    lines = [f"parameter {i}: {'an expert' if 'edp' in p.placement.grad_sum else n} {tuple(p.shape)} {p.dtype}"
             for i, (n, p) in enumerate(model.named_parameters())] + list(settings)
    text = "\n".join(lines).encode()
    mine = hashlib.sha256(text).digest() + len(text).to_bytes(8, "little")
    digests = comm.all_gather(numpy.frombuffer(mine, numpy.uint8))
    if (digests == digests[0]).all():
        return
    sizes = [int.from_bytes(bytes(d[32:]), "little") for d in digests]
    padded = numpy.zeros(max(sizes), numpy.uint8)
    padded[: len(text)] = numpy.frombuffer(text, numpy.uint8)
    texts = [bytes(t[:n]).decode().split("\n") for t, n in zip(comm.all_gather(padded), sizes)]
    r = next(i for i, t in enumerate(texts) if t != texts[0])
    theirs, first = (dict(line.split(": ", 1) for line in t) for t in (texts[r], texts[0]))
    key = next(k for k in {**theirs, **first} if theirs.get(k) != first.get(k))
    raise ValueError(f"{what}: the ranks of the data-parallel group were given different models, so their "
                     f"collectives would not match: {key} is {theirs.get(key, 'nothing')} on rank {r} but "
                     f"{first.get(key, 'nothing')} on rank 0; build the same model, with the same optimizer "
                     "arguments, on every rank of the group")


class DistributedOptimizer(ABC):
    """AdamW over the ranks of ``comm`` (the data-parallel group) for ``model``, whose parameters
    are placed on ``model.grid`` (the norm adds the TP and PP parts over it). ``stage``: what ZeRO
    stage the class is (0: nothing sharded), for reports."""

    stage = None
    loss_scale = 1.0  # what the caller multiplies the loss by before backward (mixed precision's S)
    skipped_step = False  # whether the last step was skipped for an overflow (mixed precision's)
    policy = None  # the precision policy (minipar.precision) the state is kept in; None: the model's dtype

    def __init__(self, model, comm):
        self.model, self.comm, self.grid = model, comm, model.grid
        # this rank's index in each group, for placement.is_primary (a single device: all index 0)
        self.ranks = self.grid.ranks() if self.grid is not None else {}

    # ---- the learning rate and the step count (the optimizer that does the arithmetic keeps them)
    @property
    @abstractmethod
    def adamw(self):
        """The AdamW this class steps (over whole arrays or over this rank's pieces)."""

    @property
    def lr(self):
        return self.adamw.lr

    @lr.setter
    def lr(self, value):
        self.adamw.lr = value

    @property
    def step_count(self):
        return self.adamw.step_count

    @step_count.setter
    def step_count(self, t):
        self.adamw.step_count = int(t)

    # ---- the step ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """More micro-batches follow: defer what can wait. The default defers nothing (ZeRO-1 sends
        nothing during backward anyway; ZeRO-2 and 3 keep only their pieces, so they must send each
        micro-batch's gradients, as DeepSpeed does)."""
        yield

    @abstractmethod
    def finish_gradients(self):
        """Sum the step's gradients over DP and finish them (``model.finalize_grads()``), once per
        step; later calls before ``zero_grad()`` change nothing."""

    @abstractmethod
    def grad_norm(self):
        """The whole model's gradient norm (a collective; finishes the gradients first)."""

    @abstractmethod
    def _gradients(self):
        """The arrays holding this rank's gradients that the step will use (clipping scales them)."""

    def clip_grad_norm(self, max_norm):
        """Scale the gradients by min(1, max_norm / ||g||) over the whole model; returns ||g||."""
        total = self.grad_norm()
        if max_norm > 0 and total > max_norm:
            for g in self._gradients():
                g *= max_norm / (total + 1e-6)
        return total

    @abstractmethod
    def step(self, grad_scale=1.0):
        """The AdamW update (finishes the gradients first if the caller did not); ``grad_scale``
        multiplies the gradients as they are read (mixed precision's unscaling)."""

    @abstractmethod
    def zero_grad(self):
        """Zero the gradients for the next step (keeping whatever buffers the hooks fill)."""

    # ---- accounting, checks, checkpoints ------------------------------------------------------
    @abstractmethod
    def state_bytes(self):
        """Bytes this rank holds now: {"parameters", "gradients", "optimizer"}."""

    def peak_state_bytes(self):
        """The most bytes of training state this rank held at once (a class that allocates during
        the step keeps count of it)."""
        return sum(self.state_bytes().values())

    def padding(self):
        """Values added to cut flat buffers into equal pieces (held, and sent, like the others)."""
        return 0

    @abstractmethod
    def full_gradients(self):
        """{id(parameter): this rank's whole local gradient} after the DP sum (maybe a collective)."""

    def full_state_dict(self):
        """{name: whole local parameter} (ZeRO-3 gathers them: a collective)."""
        return self.model.state_dict()

    @abstractmethod
    def state_arrays(self):
        """(kind, parameter, array, shape, flat) for each array of training state this rank holds:
        kind "param", "exp_avg" or "exp_avg_sq" (and PipeDream-2BW's STASHED); shape the parameter's local shape; flat None for a
        whole local array, or (a, b), the range of the flattened local array this flat array is
        (a piece that differs across the DP group)."""

    def masters_to_model(self):
        """Round fp32 master weights into the model's (after a checkpoint loaded them); nothing
        to do without masters."""

    def nonfinite_gradients(self):
        """Parameters a gradient of which, as this rank holds it, has a NaN or an infinity."""
        return [p for p in self.model.parameters() if p.grad is not None and not bool(xp.isfinite(p.grad).all())]
