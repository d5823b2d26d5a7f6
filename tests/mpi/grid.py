"""ProcessGrid on a live world: its groups equal the rank arithmetic, and bad sizes fail everywhere.

    run_mpi.sh -n 8 tests/mpi/grid.py TP PP [CP]
"""

import sys

import numpy as np

from minipar.comm import world
from minipar.parallel import ProcessGrid

tp, pp = int(sys.argv[1]), int(sys.argv[2])
cp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
comm = world()
grid = ProcessGrid(tp=tp, pp=pp, cp=cp)
r = comm.rank


def check(ok, what):
    if not ok:
        raise AssertionError(f"rank {r}: {what}")


lay = grid.layout
check((grid.tp_rank, grid.cp_rank, grid.dp_rank, grid.pp_rank) == lay.coords(r), "coordinates")
for kind in ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp", "embedding"):  # EP = 1: edp is dp_cp
    group = getattr(grid, f"{kind}_group")
    expected = getattr(lay, f"{kind}_group")(r)
    if expected is None:
        check(group is None, f"{kind}: rank should be in no group")
        continue
    members = group.all_gather(np.array([r]))[:, 0].tolist()
    check(members == expected, f"{kind} group {members} != {expected}")
stage = tp * cp * grid.dp  # ranks per pipeline stage
check(grid.prev_stage == (None if grid.pp_rank == 0 else r - stage), "previous stage")
check(grid.next_stage == (None if grid.pp_rank == pp - 1 else r + stage), "next stage")

# Bad sizes raise on every rank, before any group is made, so nothing hangs.
raised = 0
for bad in (dict(tp=comm.size + 1, pp=1), dict(tp=1, pp=1, dp=comm.size + 1), dict(tp=0, pp=1)):
    try:
        ProcessGrid(**bad)
    except ValueError:
        raised += 1
total = comm.all_reduce(np.array([raised]))[0]
check(total == 3 * comm.size, f"bad sizes raised {total} times, expected {3 * comm.size}")
if r == 0:
    print(grid.describe())
    print("grid OK")
