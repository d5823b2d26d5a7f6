"""Ring attention and Ulysses as ops spread over ranks, checked where ``context.py`` does not look.

1. gradient: central differences of L = sum over every rank of sum(out * G) (G a random upstream
   gradient), 96 entries of the whole (B, T, 3C) projection perturbed on the rank holding each,
   every rank running the forward each time; float64, with and without dropout.
2. held: backward's travelling dK,dV accumulators are sent one per ring step; a rank must not
   keep every one it sent alive until the end (N-1 blocks the size of its K,V: the whole
   sequence's), only the one still in flight.

    run_mpi.sh -n 4 tests/mpi/context_checks.py
"""

import sys

import numpy as np

import minipar
from minipar import Tensor, no_grad
from minipar.comm import world
from minipar.parallel import ring_attention as ring_module
from minipar.parallel.context import load_balanced_positions, ring_attention, ulysses_attention

minipar.set_default_dtype("float64")
comm = world()
N, r = comm.size, comm.rank
B, T, H, D = 1, 4 * N, N, 2
C = H * D
KEY, ROWS = (3, 1), [2]
OPS = {"ring": ring_attention, "ulysses": ulysses_attention}
positions = load_balanced_positions(T, N, r)
rng = np.random.default_rng(0)
full, upstream = rng.standard_normal((B, T, 3 * C)), rng.standard_normal((B, T, C))
# 96 entries of the projection, drawn alike on every rank: all of them on 2 ranks, a quarter on 4
# (every entry there took 30 s of distributed forwards)
ENTRIES = [np.unravel_index(i, full.shape) for i in np.random.default_rng(1).choice(full.size, 96, replace=False)]
failures = []


def total(op, x, p):
    """L: every rank's sum(out * G) over its positions, summed over the ranks."""
    with no_grad():
        out = op(Tensor(x[:, positions]), H, comm, positions, p, KEY, ROWS)
    return float(comm.all_reduce(np.array([(out.data * upstream[:, positions]).sum()]))[0])


for name, op in OPS.items():
    for p in (0.0, 0.3):
        local = Tensor(full[:, positions], requires_grad=True)
        op(local, H, comm, positions, p, KEY, ROWS).backward(upstream[:, positions])
        analytic = np.zeros_like(full)
        analytic[:, positions] = local.grad
        analytic = comm.all_reduce(analytic)  # each position's gradient from the rank holding it
        numeric, eps = np.zeros_like(full), 1e-6
        for index in ENTRIES:  # the same entries on every rank, in the same order
            x = full.copy()
            x[index] += eps
            plus = total(op, x, p)
            x[index] -= 2 * eps
            numeric[index] = (plus - total(op, x, p)) / (2 * eps)
        picked = tuple(np.array(ENTRIES).T)
        err = np.abs(analytic[picked] - numeric[picked]).max() / np.abs(numeric[picked]).max()
        if not err < 1e-7:
            failures.append(f"{name} p={p}: gradient against central differences, relative error {err:.1e}")
        elif r == 0:
            print(f"{name:8} p={p}: gradient against central differences {err:.1e}")

# the dK,dV accumulators a rank has sent and not yet seen delivered, when it sends another
DKV = ring_module.DKV_TAG
sent, worst = [], [0]
isend = comm.isend


def counting_isend(x, dest, tag=0):
    request = isend(x, dest, tag)
    if tag == DKV:
        worst[0] = max(worst[0], sum(not s._done for s in sent))  # without testing them (no progress)
        sent.append(request)
    return request


comm.isend = counting_isend
local = Tensor(full[:, positions], requires_grad=True)
ring_attention(local, H, comm, positions).backward(upstream[:, positions])
comm.isend = isend
if len(sent) != N - 1 or worst[0] > 0:
    failures.append(f"ring backward sent {len(sent)} dK,dV blocks (expected {N - 1}) and held up to "
                    f"{worst[0]} earlier ones undelivered while sending another (expected 0)")

for line in failures:
    print(f"rank {r}: {line}", flush=True)
ok = comm.all_reduce(np.array([len(failures)]))[0] == 0
if r == 0:
    print(f"context parallel checks {'OK' if ok else 'FAILED'} on {N} ranks", flush=True)
sys.exit(0 if ok else 1)
