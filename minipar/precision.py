"""Mixed precision: which dtype each array of training has, and the loss scale fp16 needs.

Micikevicius et al. (2018) train in 16 bits with three rules, which Megatron-LM follows:

1. Weights, activations and gradients in 16 bits (half the memory and bandwidth), but the
   optimizer updates **fp32 master weights**: an update lr * m / sqrt(v) is often below half a
   unit in the last place of a 16-bit weight (bfloat16 has 8 bits of mantissa: 1 + 2^-8 rounds to
   1), so a 16-bit weight would simply stop moving. Adam's m and v are fp32 too. After the update
   the masters are rounded into the model's 16-bit weights.
2. **Accumulate in fp32**: products, LayerNorm, softmax and the loss (``functional/widen.py``,
   ``backend.matmul``); the gradients' sum over data-parallel ranks too, with
   ``--accumulate-allreduce-grads-in-fp32`` (``Policy.grads``).
3. **Loss scaling, for fp16 only**: float16 has 5 bits of exponent; gradients smaller than 2^-24
   become zero. Multiplying the loss by S moves every gradient up by S into the representable
   range; the optimizer divides it out (in fp32) before the update. Too large an S overflows to
   infinity: the step is then skipped on every rank and S backs off. bfloat16 has float32's 8 bits
   of exponent and needs no scale.

``Policy`` names the dtypes; the optimizers of the step protocol (``parallel/data.py``,
``parallel/zero.py``) keep the masters when given one; ``ConstantLossScaler`` and
``DynamicLossScaler`` (Megatron's algorithm) are the scale's state machines, which
``parallel/mixed_precision.py`` drives once per step.
"""

import math
from dataclasses import dataclass

import numpy

from minipar.dtypes import as_dtype, is_16bit, is_float


@dataclass(frozen=True)
class Policy:
    """The dtypes of a run. ``params``: the model's weights, activations and gradients; ``main``:
    the optimizer's master weights and Adam moments; ``grads``: the dtype gradients are accumulated
    (over micro-batches) and reduced over data-parallel ranks in."""

    params: numpy.dtype
    main: numpy.dtype
    grads: numpy.dtype

    def __post_init__(self):
        for field in ("params", "main", "grads"):
            object.__setattr__(self, field, as_dtype(getattr(self, field)))
        if not is_float(self.params):
            raise ValueError(f"a precision policy is for a float model, not {self.params.name}")
        if is_16bit(self.main):
            raise ValueError(f"master weights must be float32 or float64, not {self.main.name}: a 16-bit "
                             "master would lose the small updates it exists to keep")
        if self.main.itemsize < self.params.itemsize:  # float32 masters of a float64 model
            raise ValueError(f"{self.main.name} master weights for a {self.params.name} model would round "
                             f"every update to {self.main.name}: use main={self.params.name!r}")
        if self.grads not in (self.params, self.main):
            raise ValueError(f"gradients are reduced in the model's dtype ({self.params.name}) or the "
                             f"masters' ({self.main.name}), not {self.grads.name}")

    @classmethod
    def of(cls, params, accumulate_in_main=False, main="float32"):
        """The policy for a model in ``params``, with masters in ``main`` (float32, or float64 to
        check the mechanism against a plain float64 run)."""
        return cls(params, main, main if accumulate_in_main else params)

    def bytes_per_parameter(self):
        """(weight, gradient, optimizer state) bytes per parameter: the ZeRO paper's 2 + 2 + 12 for
        bf16/fp16 with fp32 masters."""
        p, g, m = self.params.itemsize, self.grads.itemsize, self.main.itemsize
        return p, g, 3 * m  # master copy, m, v


class ConstantLossScaler:
    """A fixed loss scale (Megatron's ``--loss-scale``): a step whose gradients overflow is still
    skipped, but the scale never moves."""

    def __init__(self, scale):
        self.scale = _finite_scale(scale, "the loss scale")

    def update(self, found_inf):
        """After a step's overflow check; returns whether the step is skipped."""
        return bool(found_inf)

    def at_floor(self):
        """Whether an overflow can no longer lower the scale: a constant one never moves."""
        return True

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, state):
        """Nothing to resume: the scale is the run's own flag, as Megatron's ConstantGradScaler has
        no state (a checkpoint's scale, constant or dynamic, would override what the user typed)."""


class DynamicLossScaler:
    """Megatron's ``DynamicGradScaler``: start at ``initial_scale``; every step whose gradients
    overflow is skipped, and after ``hysteresis`` such steps (not necessarily in a row: clean steps
    do not refill it, a growth does) the scale is multiplied by ``backoff_factor``, never below
    ``min_scale``; after ``growth_interval`` clean steps in a row (``--loss-scale-window``) it is
    multiplied by ``growth_factor`` and the hysteresis refilled. Trying a larger scale every window
    keeps it near the largest that does not overflow, which keeps the most small gradients."""

    def __init__(self, initial_scale=2.0**32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=1000, hysteresis=2):
        # an infinite scale makes every gradient inf, and inf halved is inf: every step skipped, forever
        _finite_scale(initial_scale, "initial_scale")
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"need 0 < min_scale <= initial_scale, got {min_scale} and {initial_scale}")
        _finite_scale(min_scale, "min_scale")
        if not 1.0 < growth_factor < math.inf or not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"need a finite growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, "
                             f"{backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"the window and the hysteresis must be >= 1, got {growth_interval}, {hysteresis}")
        self.scale, self.min_scale = float(initial_scale), float(min_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis

    def update(self, found_inf):
        """After a step's overflow check (the same verdict on every rank); returns whether the step
        is skipped."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return True
        self.growth_tracker += 1
        # >=: a run resumed with a shorter --loss-scale-window may have counted past it already
        # (with == its scale never grew again)
        if self.growth_tracker >= self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor
        return False

    def at_floor(self):
        """Whether an overflow can no longer lower the scale."""
        return self.scale <= self.min_scale

    def state_dict(self):
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state):
        """Go on from a dynamic scale's state; a constant scale's (only "scale") has none to go on
        from, so this one starts as its flags say, as a fresh run's does."""
        if "growth_tracker" not in state:
            return
        scale, growth, hysteresis = float(state["scale"]), int(state["growth_tracker"]), int(state["hysteresis_tracker"])
        # a non-finite or non-positive scale would skip every step and never count as at its floor
        _finite_scale(scale, "the checkpoint's loss scale")
        if growth < 0:
            raise ValueError(f"the checkpoint's loss scale has a negative growth_tracker {growth}")
        # the overflows still tolerated, at most this run's --hysteresis (a resumed run may lower it)
        self.scale, self.growth_tracker, self.hysteresis_tracker = scale, growth, min(hysteresis, self.hysteresis)


SMALLEST_SCALE = 2.0**-24  # float16's smallest subnormal: a gradient of 1 scaled below it is 0
LARGEST_SCALE = float(numpy.finfo(numpy.float32).max)  # the loss is scaled in float32


def _finite_scale(scale, what):
    """``scale`` as a float, refused unless finite, at least SMALLEST_SCALE (below it every
    gradient up to 1 flushes to zero in float16, and the run's losses turn to nan for no reason
    the user could see) and at most LARGEST_SCALE."""
    if not 0 < float(scale) < math.inf:
        raise ValueError(f"{what} must be finite and positive, got {scale}")
    if float(scale) > LARGEST_SCALE:
        raise ValueError(f"{what} {scale} is above float32's largest number (3.4e38): the scaled loss is inf "
                         "and every step would be skipped; use 2^32 (Megatron's initial scale) or less")
    if float(scale) < SMALLEST_SCALE:
        raise ValueError(f"{what} {scale} is below 2^-24, float16's smallest number: gradients scaled by it "
                         "flush to 0 in float16; use 1 or more (Megatron's smallest by default)")
    return float(scale)


def check_policy(policy, model_dtype):
    """``policy`` (or None: no masters), refused unless it is the model's dtype's."""
    if policy is not None and policy.params != model_dtype:
        raise ValueError(f"the precision policy is for a {policy.params.name} model, this one is "
                         f"{numpy.dtype(model_dtype).name}: build the model in the policy's dtype "
                         "(set_default_dtype) first")
    return policy


MEGATRON_DEFAULTS = dict(initial_loss_scale=2.0**32, min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2)


def from_flags(dtype="float32", bf16=False, fp16=False, accumulate_allreduce_grads_in_fp32=False,
               loss_scale=None, initial_loss_scale=None, min_loss_scale=None, loss_scale_window=None,
               hysteresis=None):
    """(the model's dtype, the Policy or None, the loss scaler or None) that Megatron's flags ask
    for: --bf16 (no loss scale), --fp16 (a dynamic scale, or --loss-scale's constant one); neither:
    ``dtype`` throughout, no masters. The flags are checked first (``train_checks``)."""
    if not (bf16 or fp16):
        return dtype, None, None
    params = "bfloat16" if bf16 else "float16"
    policy = Policy.of(params, accumulate_in_main=accumulate_allreduce_grads_in_fp32)
    if bf16:
        return params, policy, None
    if loss_scale is not None:
        return params, policy, ConstantLossScaler(loss_scale)
    given = dict(initial_loss_scale=initial_loss_scale, min_loss_scale=min_loss_scale,
                 loss_scale_window=loss_scale_window, hysteresis=hysteresis)
    f = {k: MEGATRON_DEFAULTS[k] if v is None else v for k, v in given.items()}
    return params, policy, DynamicLossScaler(f["initial_loss_scale"], f["min_loss_scale"],
                                             growth_interval=f["loss_scale_window"], hysteresis=f["hysteresis"])
