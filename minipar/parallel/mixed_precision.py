"""Mixed precision as one more implementation of the step protocol: a wrapper around any stage.

The stage underneath (``DataParallelAdamW``, ``ZeRO1/2/3``, built with a ``precision.Policy``)
owns the layout: 16-bit weights and gradients, fp32 masters and Adam moments where its state
lives. What this wrapper adds is the loss scale and what follows from it, once per step:

    caller         backward of (loss x ``loss_scale``): every gradient is S times too large
    finish_gradients()   the stage's sums over DP (x CP), and the model's
    check          is any gradient, anywhere, inf or NaN? Each rank looks at what it holds (its
                   ZeRO pieces, its TP/PP parts) and one all-reduce (max) over the whole world
                   makes the verdict every rank's: a rank that stepped while another skipped
                   would leave the replicas, or the pieces of one weight, out of step
    scaler         ``update(found_inf)``: on an overflow the step is skipped and the scale may back
                   off; after a window of clean steps it grows (``precision.DynamicLossScaler``).
                   This step's gradients were made with the scale *before* the update: that S
                   (``step_scale``) is the one every unscaling of this step divides by
    clip           the norm is the scaled gradients' norm / S; the clipping factor and 1/S are
                   folded into one ``grad_scale`` that AdamW applies in fp32 as it reads each
                   gradient, so the 16-bit gradients are never rounded again
    step(grad_scale)     the stage's update of the masters, rounded into the 16-bit weights
                   (skipped: the parameters, masters and moments stay bit-identical)

With no scaler (bf16, whose range is float32's) nothing is checked and nothing is skipped, as in
Megatron; the overflow check costs one all-reduce of one number per step.
"""

import math

import numpy

from minipar.backend import xp
from minipar.parallel.protocol import DistributedOptimizer


class MixedPrecisionOptimizer(DistributedOptimizer):
    """``inner`` (a stage built with a precision policy) driven with ``scaler`` (None: no loss
    scale, bf16) over ``world`` (the communicator every rank of the run is in; None: one process)."""

    def __init__(self, inner, scaler=None, world=None):
        if inner.policy is None:
            raise ValueError("MixedPrecisionOptimizer wraps an optimizer built with a precision policy")
        # every rank of the run must share the verdict: one that skips while another steps leaves the
        # replicas, or the TP/PP pieces of the model, silently out of step. Checked here, on every
        # rank, from sizes alone (no message)
        ranks = inner.grid.world.size if inner.grid is not None else inner.comm.size
        agreed = 1 if world is None else world.size
        if scaler is not None and ranks > 1 and (agreed < ranks or inner.grid is not None and agreed != ranks):
            raise ValueError(f"MixedPrecisionOptimizer: the run has {ranks} ranks but its overflow verdict would "
                             f"be agreed over {agreed}: pass the grid's world (world=grid.world, as "
                             "make_optimizer does)")
        super().__init__(inner.model, inner.comm)
        self.inner, self.scaler, self.world = inner, scaler, world
        self.stage, self.policy = inner.stage, inner.policy
        self.skipped_step = False  # the last checked step's verdict
        self._checked, self._clipped, self._grad_scale = False, False, 1.0
        self.skipped_steps = 0
        self.step_scale = self.loss_scale  # the scale this step's backward used

    @property
    def adamw(self):
        return self.inner.adamw

    @property
    def loss_scale(self):
        return 1.0 if self.scaler is None else self.scaler.scale

    # ---- the step -----------------------------------------------------------------------------
    def no_sync(self):
        return self.inner.no_sync()

    def finish_gradients(self):
        self.inner.finish_gradients()

    def local_overflow(self):
        """Whether a gradient this rank holds (the arrays its step would read) is inf or NaN."""
        return any(not bool(xp.isfinite(g).all()) for g in self.inner._gradients())

    def check_overflow(self):
        """Once per step, on every rank: the overflow verdict agreed over the world, the scaler
        updated with it; returns whether this step is skipped."""
        if self._checked:
            return self.skipped_step
        self.finish_gradients()
        self._checked = True
        self.step_scale = self.loss_scale  # before the update: the scale the gradients carry
        if self.scaler is None:
            self.skipped_step = False
            return False
        found = numpy.array([1.0 if self.local_overflow() else 0.0])
        if self.world is not None:
            found = self.world.all_reduce(found, op="max")
        self.skipped_step = self.scaler.update(bool(found[0]))
        self.skipped_steps += self.skipped_step
        return self.skipped_step

    def grad_norm(self):
        """The unscaled gradients' norm (inf if the step overflowed)."""
        if self.check_overflow():
            return math.inf
        return self.inner.grad_norm() / self.step_scale

    def _gradients(self):
        return self.inner._gradients()

    def clip_grad_norm(self, max_norm):
        """The unscaled norm, returned; the clipping factor is kept for ``step`` (folded into the
        unscaling) rather than applied to the 16-bit gradients. inf for an overflowed step, which
        ``step`` skips."""
        total = self.grad_norm()
        self._clipped = True
        self._grad_scale = 1.0 / self.step_scale
        if math.isfinite(total) and max_norm > 0 and total > max_norm:
            self._grad_scale *= max_norm / (total + 1e-6)
        return total

    def step(self, grad_scale=1.0):
        """The stage's update with the gradients unscaled (and clipped, if ``clip_grad_norm`` said
        so), unless the step overflowed: then nothing changes but the scaler."""
        if self.check_overflow():
            return
        if not self._clipped:  # no clip_grad_norm this step: unscale only
            self._grad_scale = 1.0 / self.step_scale
        self.inner.step(self._grad_scale * grad_scale)

    def zero_grad(self):
        self.inner.zero_grad()
        self._checked, self._clipped, self._grad_scale = False, False, 1.0

    # ---- accounting, checks, checkpoints: the stage's --------------------------------------------
    def state_bytes(self):
        return self.inner.state_bytes()

    def peak_state_bytes(self):
        return self.inner.peak_state_bytes()

    def padding(self):
        return self.inner.padding()

    def full_gradients(self):
        """The gradients as the stage holds them, unscaled (float64 copies, for checks)."""
        scale = self.step_scale if self._checked else self.loss_scale  # before the check: the scale in use
        return {k: g.astype(numpy.float64) / scale for k, g in self.inner.full_gradients().items()}

    def full_state_dict(self):
        return self.inner.full_state_dict()

    def state_arrays(self):
        return self.inner.state_arrays()

    def nonfinite_gradients(self):
        return self.inner.nonfinite_gradients()

    def masters_to_model(self):
        self.inner.masters_to_model()
