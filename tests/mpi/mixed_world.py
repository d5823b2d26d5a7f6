"""A loss scaler must agree its overflow verdict over every rank of the run: a
``MixedPrecisionOptimizer`` built without the world (or with a smaller group) on a run of several
ranks is refused on every rank, before any message, instead of letting each rank skip or take a
step by its own gradients (the replicas, or a weight's TP pieces, then silently drift apart).

    run_mpi.sh -n 2 tests/mpi/mixed_world.py
"""

import sys

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.data import DataParallelAdamW
from minipar.parallel.mixed_precision import MixedPrecisionOptimizer
from minipar.precision import DynamicLossScaler, Policy

comm = world()
minipar.set_default_dtype("float16")
config = GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=16)
failures = []
for layout in (dict(dp=2), dict(tp=2)):  # the DP replicas, then a weight's two TP pieces
    grid = ProcessGrid(world=comm, **layout)
    inner = DataParallelAdamW(GPT(config, grid), grid.dp_cp_group, policy=Policy.of("float16"))
    for given in (None, grid.dp_cp_group if layout.get("tp") else grid.tp_group):
        try:
            MixedPrecisionOptimizer(inner, DynamicLossScaler(), given)
            failures.append(f"{layout}: a scaler agreeing over {None if given is None else given.size} rank(s) accepted")
        except ValueError as exc:
            if "world" not in str(exc):
                failures.append(f"{layout}: the error does not name the fix: {exc}")
    MixedPrecisionOptimizer(inner, DynamicLossScaler(), grid.world)  # the whole run: accepted
    MixedPrecisionOptimizer(inner, None)  # bf16: no scaler, nothing to agree
for line in failures:
    print(f"rank {comm.rank}: {line}", flush=True)
if comm.all_reduce(np.array([len(failures)]))[0]:
    sys.exit(1)
if comm.rank == 0:
    print("a scaler without the world refused OK")
