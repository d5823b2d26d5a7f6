"""One place that turns a ZeRO stage into a step-protocol object (``protocol.py``).

    stage 0   DataParallelAdamW   buckets all-reduced during backward; every rank holds everything
    stage 1   ZeRO1               optimizer state sharded; gradients reduce-scattered after backward
    stage 2   ZeRO2               + gradients sharded, reduce-scattered group by group in backward
    stage 3   ZeRO3               + parameters sharded, gathered around each unit of the model

Everything after construction is the same calls for every stage, so this is the only code that
reads the stage number (DeepSpeed's ``zero_optimization.stage``, Megatron's
``--use-distributed-optimizer``).
"""

from minipar.parallel.data import DataParallelAdamW
from minipar.parallel.mixed_precision import MixedPrecisionOptimizer
from minipar.parallel.zero1 import ZeRO1
from minipar.parallel.zero2 import ZeRO2
from minipar.parallel.zero3 import ZeRO3

BY_STAGE = {0: DataParallelAdamW, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}


def make_optimizer(model, grid, zero_stage=0, bucket_bytes=4 << 20, policy=None, scaler=None, **hyper):
    """The step-protocol object for ``model`` (built on ``grid``): AdamW with ``hyper`` (lr, betas,
    eps, weight_decay) over the grid's data-parallel group (with context parallelism DP x CP: every
    one of those ranks computed gradients of the same weights from other tokens), its state kept as
    ZeRO ``zero_stage`` says. ``bucket_bytes``: the size of the gradient buckets (stage 0) or groups (stages 1-2);
    ZeRO-3's groups are the model's units.

    ``policy`` (``precision.Policy``): mixed precision, the stage keeping fp32 masters, wrapped in
    ``MixedPrecisionOptimizer`` with ``scaler`` (None: no loss scale) agreeing over the world."""
    if zero_stage not in BY_STAGE:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if model.grid is not grid:
        raise ValueError("make_optimizer: the model was built on another grid (its parameters' "
                         "placements name that grid's groups)")
    if policy is None and scaler is not None:
        raise ValueError("make_optimizer: a loss scaler needs a precision policy")
    if zero_stage == 3:
        inner = ZeRO3(model, grid.dp_cp_group, policy=policy, **hyper)
    else:
        inner = BY_STAGE[zero_stage](model, grid.dp_cp_group, bucket_bytes=bucket_bytes, policy=policy, **hyper)
    return inner if policy is None else MixedPrecisionOptimizer(inner, scaler, grid.world)


__all__ = ["BY_STAGE", "DataParallelAdamW", "ZeRO1", "ZeRO2", "ZeRO3", "make_optimizer"]
