"""PipeDream-2BW's double-buffered weights (Narayanan et al. 2021, "Memory-Efficient Pipeline-
Parallel DNN Training"), as one more implementation of the step protocol around any stage-0 optimizer.

Without a flush, a stage starts the forwards of the next batch before the backwards of this one are
done, so it updates its weights while micro-batches that ran forward on the old ones still have to
come back. Each micro-batch must run its backward on the weights its forward saw (weight stashing),
and every stage must use the same version for a micro-batch, so the update is delayed by one:

    W(t+1) = W(t) - lr * grad f(W(t-1))        (with AdamW: AdamW's update, fed grad f(W(t-1)))

Batch t runs forward and backward on version t-1; its summed gradient updates version t. Two
versions are alive, never more (the paper's "2BW", two buffered weights):

    newest   W(t): the model's parameters, what the optimizer steps (and batch t+1 runs on)
    stash    W(t-1): the version the batch in flight runs on, a second copy of the parameters

The graph a forward records keeps references to the arrays it read (``Function.apply`` passes
``p.data``), so the backward of a micro-batch reads its forward's version as long as no array is
changed in place while it is in flight. That is what ``step`` is built around: the newest arrays,
which the next batch's early forwards have read, become the stash untouched; the old stash (free:
its batch's backwards are done) receives a copy of them and is what the optimizer updates. The
executor (``pipedream.py``) runs each forward and backward inside ``weights(version)``, which
points the parameters at that version's arrays (recompute reruns a forward in the backward, which
must read the same version).

No stage waits for another at the step. Stage s ends batch t (its last backward) later than stage
s + 1, the first stage last of all, and whatever sums the stages' gradients (the tied embedding's two
parts, the norm that clipping divides by) would hold each stage until the first one got there: in a
stream of batches 2 (p - 1) forward-times every step, which is most of the bubble PipeDream-2BW is
there to remove ((p - 1) / (m + p - 1) for 1F1B; 2 (p - 1) / (3 m + 2 (p - 1)) with F = 1, B = 2).
But W(t+1) is first read by batch t+2's forwards, a batch later. So ``step`` (at the end of batch
t) only sets batch t's gradients aside, a copy (the next batch's backwards fill the buffers) whose
sums between stages it starts, and ``apply`` makes the update when W(t+1) is first asked for
(``weights``), or at the next ``step``, or when the stream drains. By then every sum is in.

``plant_bug``: the newest arrays are updated in place instead (the stash gets a copy): a micro-batch
forwarded before the step then runs its backward on the next version's weights, the bug weight
stashing exists to prevent.
"""

import contextlib
import math

from minipar.backend import xp
from minipar.parallel.grad_norm import start_grad_norm
from minipar.parallel.protocol import STASHED, DistributedOptimizer


_MADE_IN_APPLY = ("PipeDream-2BW's gradients are whole only in its set-aside copy (the tied embedding's parts "
                  "are added there): each update's norm is in WeightStash.updates, clipped to its max_norm")


class WeightStash(DistributedOptimizer):
    """``inner``: a stage-0 optimizer over the model's parameters (``DataParallelAdamW``), or the
    mixed-precision wrapper of one without a loss scale (bf16): its fp32 masters are the newest
    version, W(t), which the model's 16-bit weights are the rounding of, and the stash the 16-bit
    W(t-1). ``max_norm``: clip each update's gradients to this global norm (0: do not clip)."""

    def __init__(self, inner, plant_bug=False, max_norm=0.0):
        if getattr(inner, "scaler", None) is not None:
            raise ValueError("PipeDream-2BW with a loss scale (fp16): an overflow skips a step, and the delayed "
                             "update would have to be skipped with it; train in bf16")
        inner = getattr(inner, "inner", inner)  # bf16's wrapper adds nothing without a scale
        if inner.stage != 0:
            raise ValueError("PipeDream-2BW stashes the model's own weights: it needs ZeRO stage 0")
        super().__init__(inner.model, inner.comm)
        self.inner, self.stage, self.plant_bug, self.max_norm = inner, inner.stage, plant_bug, max_norm
        self.policy, self.params = inner.policy, inner.model.parameters()
        inner.model.tied_sum_elsewhere = True  # ``step`` adds the tied embedding's parts, on its copy
        self.newest = 0  # W(0); the stash is W(-1) := W(0), the version batch 0 runs on
        self.stash = [p.data.copy() for p in self.params]
        grads = None if self.policy is None else self.policy.grads  # fp32 with --accumulate-allreduce-grads-in-fp32
        self.saved = [xp.empty_like(p.data, dtype=grads) for p in self.params]  # a batch's gradients, until its update
        self.pending = None  # the set-aside batch's (grad_scale, lr, its norm's sum, the tied embedding's sums)
        self.updates = []  # each update's (gradient norm, parameters whose gradient was not finite), in order

    @property
    def stashed(self):
        return self.newest - 1

    @property
    def upcoming(self):
        """The version the batch after the one in flight runs on: the one the pending update makes."""
        return self.newest + (self.pending is not None)

    @contextlib.contextmanager
    def weights(self, version):
        """Run the forward or backward inside on weight ``version`` (the newest or the stashed one;
        the first forward on the version the pending update makes makes it)."""
        if version == self.upcoming and self.pending is not None:
            self.apply()
        if version == self.newest:
            yield
            return
        if version != self.stashed:
            raise RuntimeError(f"weight version {version} is not alive: PipeDream-2BW keeps versions "
                               f"{self.stashed} and {self.newest} only")
        newest = [p.data for p in self.params]
        for p, s in zip(self.params, self.stash):
            p.data = s
        try:
            yield
        finally:
            for p, a in zip(self.params, newest):
                p.data = a

    def step(self, grad_scale=1.0):
        """At the end of batch t's backwards: the previous batch's update if it is still pending,
        then batch t's gradients set aside and their sums between stages started (``apply`` makes
        the update). The stage's own sums (data parallelism, sequence parallelism) are taken now."""
        self.inner.finish_gradients()
        self.apply()
        for s, p in zip(self.saved, self.params):
            xp.copyto(s, p.grad)
        group = getattr(self.model, "embedding_group", None)
        tied = [group.iall_reduce(s) for s, p in zip(self.saved, self.params) if "embedding" in p.placement.grad_sum]
        # the first stage's norm counts the tied embedding, whole: it is started once that sum is in,
        # in ``apply`` (waiting for it here would wait for the last stage to make progress in MPI)
        norm = None if tied and self.grid.pp_rank == 0 else start_grad_norm(self.params, self.grid, self.saved)
        # the learning rate too: the caller sets the next step's before this update is made
        self.pending = (grad_scale, self.lr, norm, tied)

    def apply(self):
        """The update set aside by ``step``: W(t+1) = W(t) - AdamW(batch t's gradients, clipped), the
        arrays read so far kept as the stash W(t) (see the module's docstring)."""
        if self.pending is None:
            return
        (grad_scale, lr, norm, tied), self.pending = self.pending, None
        for request in tied:
            request.wait()
        total = (norm if norm is not None else start_grad_norm(self.params, self.grid, self.saved)).wait()
        bad = [] if math.isfinite(total) else [p for p, g in zip(self.params, self.saved) if not xp.isfinite(g).all()]
        self.updates.append((total, bad))
        if self.max_norm > 0 and total > self.max_norm:  # DistributedOptimizer.clip_grad_norm's factor
            for g in self.saved:
                g *= self.max_norm / (total + 1e-6)
        if self.plant_bug:  # the stash gets a copy, the arrays the in-flight graphs read are updated
            for p, s in zip(self.params, self.stash):
                s[...] = p.data
        else:  # the arrays read so far stay W(t); the freed W(t-1) buffers receive W(t) and are updated
            for p, s in zip(self.params, self.stash):
                xp.copyto(s, p.data)
            self.stash, old = [p.data for p in self.params], self.stash
            for p, a in zip(self.params, old):
                p.data = a
        adamw = self.inner.adamw
        if self.inner.masters is not None:  # the masters' update is rounded into the newest arrays, these now
            adamw.copies = [p.data for p in self.params]
        live = [p.grad for p in adamw.params]  # the next batch's, being summed: AdamW reads the set-aside ones
        for p, g in zip(adamw.params, self.saved):
            p.grad = g
        current, self.lr = self.lr, lr
        try:
            if math.isfinite(total):  # else W(t+1) = W(t), and the trainer ends the run on the norm
                adamw.step(grad_scale)
        finally:
            self.lr = current
            for p, g in zip(adamw.params, live):
                p.grad = g
        self.newest += 1

    def masters_to_model(self):
        """The model's weights were set from outside (``checkpoint.full.load_full_state``, which
        ``--init-weights`` runs after this wrapper is built): W(-1) := W(0) again, as at
        construction, or batch 0 would run on the weights the model was built with."""
        if self.newest != 0 or self.pending is not None:
            raise RuntimeError("PipeDream-2BW's weights were set after its first step: its stashed version "
                               "would not follow; set them before training starts")
        self.inner.masters_to_model()
        for s, p in zip(self.stash, self.params):
            xp.copyto(s, p.data)

    def stash_bytes(self):
        """The bytes the second version costs: one more copy of this rank's parameters, and one of
        their gradients (a batch's, set aside until its update)."""
        return sum(s.nbytes for s in self.stash) + sum(g.nbytes for g in self.saved)

    # ---- everything else is the stage's ------------------------------------------------------
    @property
    def adamw(self):
        return self.inner.adamw

    def no_sync(self):
        return self.inner.no_sync()

    def finish_gradients(self):
        self.inner.finish_gradients()

    def grad_norm(self):
        raise RuntimeError(_MADE_IN_APPLY)

    def _gradients(self):
        return self.inner._gradients()

    def clip_grad_norm(self, max_norm):
        raise RuntimeError(_MADE_IN_APPLY)

    def zero_grad(self):
        self.inner.zero_grad()

    def state_bytes(self):
        return {**self.inner.state_bytes(), "stash": self.stash_bytes()}

    def full_gradients(self):
        raise RuntimeError(_MADE_IN_APPLY)

    def state_arrays(self):
        """The stage's arrays, and the stashed version W(t-1) beside each parameter: at a save the
        stream has drained (the trainer ends it there), so the newest version and the stash are the
        whole of 2BW's state; a resume runs its first batch on the stash, as the stream would have."""
        return self.inner.state_arrays() + [(STASHED, p, s, p.shape, None) for p, s in zip(self.params, self.stash)]
