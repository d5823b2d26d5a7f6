"""ZeRO stages 1, 2 and 3 refuse, on every rank and before any other message, ranks of the
data-parallel group that were given different parameters (a shape, a count, a dtype, a name) or
different layouts of them (ZeRO-1/2's bucket size, ZeRO-3's units): their broadcasts and
reduce-scatters would not match, and would hang or sum unrelated values. The error names the
first difference. Ranks that agree build as before.

    run_mpi.sh -n 2 tests/mpi/zero_agree.py
"""

import numpy as np

import minipar
from minipar.comm import world
from minipar.nn import Linear, Module
from minipar.parallel import ProcessGrid
from minipar.parallel.zero1 import ZeRO1
from minipar.parallel.zero2 import ZeRO2
from minipar.parallel.zero3 import ZeRO3

minipar.set_default_dtype("float64")
world()
dp = ProcessGrid(tp=1, pp=1).dp_group
r = dp.rank


class Layers(Module):
    """Linear layers of the given widths, each a unit of its own (for ZeRO-3)."""

    def __init__(self, widths, dtype="float64", name="second"):
        minipar.set_default_dtype(dtype)
        self.first = Linear(4, widths[0])
        setattr(self, name, Linear(widths[0], widths[1]))
        if len(widths) > 2:
            self.third = Linear(widths[1], widths[2])
        minipar.set_default_dtype("float64")
        self.together = False  # ZeRO-3: one unit for all, not one per layer
        self._runner = None

    def units(self):
        layers = [(n, m) for n, m in vars(self).items() if isinstance(m, Linear)]
        if self.together:
            return [("all", [p for _, m in layers for p in m.parameters()])]
        return [(n, m.parameters()) for n, m in layers]

    def wrap_units(self, runner):
        self._runner = runner


def make(stage, model, bucket_bytes=1 << 20):
    if stage == 3:
        return ZeRO3(model, dp)
    return {1: ZeRO1, 2: ZeRO2}[stage](model, dp, bucket_bytes=bucket_bytes)


def refused(stage, expected, mine, others):
    """Build rank 0's model from ``mine`` and the others' from ``others``; every rank must refuse
    with ``expected`` in its message."""
    model = mine() if r == 0 else others()
    try:
        make(stage, model)
    except ValueError as exc:
        if expected not in str(exc):
            raise AssertionError(f"rank {r}: stage {stage}: expected {expected!r} in: {exc}") from None
        return str(exc)
    raise AssertionError(f"rank {r}: stage {stage}: different parameters were accepted ({expected})")


for stage in (1, 2, 3):
    # a shape: the first differing parameter is named, with both ranks' versions
    msg = refused(stage, "parameter 2 is second.weight (6, 5) float64 on rank 1 but second.weight (5, 5) "
                  "float64 on rank 0", lambda: Layers((5, 5)), lambda: Layers((5, 6)))
    # a count: rank 1 has a layer more
    refused(stage, "parameter 4 is third.weight (3, 5) float64 on rank 1 but nothing on rank 0",
            lambda: Layers((5, 5)), lambda: Layers((5, 5, 3)))
    # a dtype (every parameter differs: the first is named)
    refused(stage, "parameter 0 is first.weight (5, 4) float32 on rank 1 but first.weight (5, 4) float64 on rank 0",
            lambda: Layers((5, 5)), lambda: Layers((5, 5), dtype="float32"))
    # a name with the same shapes: a model of another structure
    refused(stage, "parameter 2 is other.weight (5, 5) float64 on rank 1 but second.weight (5, 5) float64 on rank 0",
            lambda: Layers((5, 5)), lambda: Layers((5, 5), name="other"))
    if stage < 3:  # another bucket size cuts other groups
        model = Layers((5, 5))
        try:
            make(stage, model, bucket_bytes=1 << 20 if r == 0 else 1)
            raise AssertionError(f"rank {r}: stage {stage}: different bucket sizes were accepted")
        except ValueError as exc:
            if "bucket_bytes is 1 on rank 1 but 1048576 on rank 0" not in str(exc):
                raise
    else:  # other units make other groups
        model = Layers((5, 5))
        model.together = r == 1
        try:
            make(3, model)
            raise AssertionError(f"rank {r}: ZeRO-3 with different units was accepted")
        except ValueError as exc:
            if "unit 0 is all with parameters 0, 1, 2, 3 on rank 1 but first with parameters 0, 1 on rank 0" \
                    not in str(exc):
                raise
    # ranks that agree: built, every one from rank 0's weights
    minipar.manual_seed(5 + r)  # other weights on each rank: ZeRO broadcasts rank 0's
    model = Layers((5, 5))
    zero = make(stage, model)
    if stage == 3:
        state = zero.full_state_dict()
    else:
        state = model.state_dict()
    gathered = dp.all_gather(np.concatenate([a.reshape(-1) for a in state.values()]))
    if not np.array_equal(gathered[0], gathered[-1]):
        raise AssertionError(f"rank {r}: stage {stage}: replicas differ after construction")
    if r == 0 and stage == 1:
        print("first difference, as every rank says it:", msg)

if r == 0:
    print(f"zero agree OK on {dp.size} ranks")
