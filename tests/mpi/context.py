"""Ring attention and Ulysses against single-device causal attention on the whole sequence.

Every rank builds the whole (B, T, 3C) projection and upstream gradient from seeds, computes the
single-device answer, and compares its rows with what the context-parallel op gives on its
positions: forward values and the gradient of qkv, float64 and float32, with and without dropout,
load-balanced and contiguous positions. It also checks the bytes each rank sent, and that bad
arguments raise the same ValueError on every rank.

    --plant-bug rescale   the online softmax forgets to rescale (alpha = 1): ring must fail
    --plant-bug owner     the ring attaches the wrong rank's positions to a block: ring must fail
"""

import argparse
import sys

import numpy as np

import minipar
import minipar.functional as F
from minipar import Tensor
from minipar import backend
from minipar.backend import xp
from minipar.comm import world
from minipar.dtypes import as_dtype
from minipar.functional import blockwise
from minipar.parallel import ring_attention as ring_module
from minipar.parallel.context import (contiguous_positions, load_balanced_positions, ring_attention,
                                      ulysses_attention)
from minipar.verify import rel_err

parser = argparse.ArgumentParser()
parser.add_argument("--plant-bug", choices=["rescale", "owner"])
backend.add_device_flag(parser)
args = parser.parse_args()
backend.use_device(args.device)
if args.plant_bug == "rescale":
    blockwise.rescale = lambda m, shift: xp.ones_like(m)
elif args.plant_bug == "owner":
    ring_module._Ring.owner = lambda self, step: (self.rank + step) % self.size

comm = world()
N, r = comm.size, comm.rank
B, T, H, D = 2, 24, 4, 4
C = H * D
KEY, ROWS, HEAD_OFFSET = (11, 3, 5, 2), np.array([4, 9]), 3
TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2}  # bfloat16: 8 bits, a few roundings
OPS = {"ring": ring_attention, "ulysses": ulysses_attention}
SPLITS = {"balanced": load_balanced_positions, "contiguous": contiguous_positions}

rng = np.random.default_rng(0)
full_qkv, upstream = rng.standard_normal((B, T, 3 * C)), rng.standard_normal((B, T, C))


def worst(value):
    return float(comm.all_reduce(np.array([value]), op="max")[0])


def case(method, split, dtype, p, group=comm, length=T):
    """(errors of the output and of dqkv, bytes sent forward per op, within tolerance) on ``group``,
    for the first ``length`` positions of the sequence."""
    minipar.set_default_dtype(dtype)
    qkv, grad = full_qkv[:, :length], upstream[:, :length]
    reference_in = Tensor(qkv, requires_grad=True)
    reference = F.causal_attention(reference_in, H, p, KEY, ROWS, None, HEAD_OFFSET)
    reference.backward(grad.astype(as_dtype(dtype)))
    n = group.size
    positions = SPLITS[split](length, n, group.rank)
    local = Tensor(qkv[:, positions], requires_grad=True)
    group.stats.reset()
    out = OPS[method](local, H, group, positions, p, KEY, ROWS, HEAD_OFFSET)
    forward = {op: t.bytes_sent for op, t in group.stats.by_op.items()}
    group.stats.reset()
    out.backward(grad[:, positions].astype(as_dtype(dtype)))
    backward = {op: t.bytes_sent for op, t in group.stats.by_op.items()}
    assert out.dtype == as_dtype(dtype) and local.grad.dtype == as_dtype(dtype)
    rows = xp.asarray(positions)
    errors = (worst(rel_err(out, reference.data[:, rows])), worst(rel_err(local.grad, reference_in.grad[:, rows])))
    if method == "ring":  # one K,V block per step forward; K,V and dK,dV blocks backward, in the
        kv = 2 * B * (length // n) * C * as_dtype(dtype).itemsize  # model's dtype (bfloat16: half float32's)
        expected = {"send": ((n - 1) * kv, 2 * (n - 1) * kv)}
    else:  # (n-1)/n of the local qkv and of the local output, both ways
        a2a = (n - 1) * (local.data.nbytes + out.data.nbytes) // n
        expected = {"all_to_all": (a2a, a2a)}
    for op, (fwd, bwd) in expected.items():
        assert forward.get(op, 0) == fwd and backward.get(op, 0) == bwd, (
            f"rank {r} {method}: {op} sent {forward.get(op, 0)} forward, {backward.get(op, 0)} backward; "
            f"expected {fwd}, {bwd}")
    sent = {op: forward.get(op, 0) for op in ("send", "all_to_all", "all_gather")}
    return errors, sent, errors[0] < TOLERANCE[dtype] and errors[1] < TOLERANCE[dtype]


def raises_everywhere(fn, words):
    """fn() raises a ValueError containing ``words`` on every rank."""
    try:
        fn()
    except ValueError as exc:
        ok = words in str(exc)
    else:
        ok = False
    assert worst(0.0 if ok else 1.0) == 0.0, f"rank {r}: expected a ValueError with {words!r} on every rank"


passed = True
if r == 0:
    print(f"{N} ranks, B={B} T={T} H={H} D={D}: relative errors (2-norm), worst rank; bytes sent per rank "
          "forward (send / all_to_all / all_gather)")
for method in OPS:
    for split in SPLITS:
        for dtype in ("float64", "float32", "bfloat16"):
            for p in (0.0, 0.1):
                (err_y, err_g), sent, ok = case(method, split, dtype, p)
                passed &= ok
                if r == 0:
                    print(f"{method:8} {split:10} {dtype} p={p}: out {err_y:.1e}  dqkv {err_g:.1e}  "
                          f"bytes {sent['send']}/{sent['all_to_all']}/{sent['all_gather']}"
                          f"{'' if ok else '  MISMATCH'}")

# one token per chunk: a pair of blocks can hold the causal diagonal alone (key = query), which a
# pair skipped as "all in the future" one position too early would lose
for method in OPS:
    for split, length in (("balanced", 2 * N), ("contiguous", N)):
        for p in (0.0, 0.1):
            errors, _, ok = case(method, split, "float64", p, length=length)
            passed &= ok
            if r == 0 and not ok:
                print(f"{method:8} {split:10} T={length} p={p}: out {errors[0]:.1e}  dqkv {errors[1]:.1e}  MISMATCH")

# a CP group that is not the world: pairs of ranks ({0, 2} and {1, 3} on 4), each ring in the
# reverse of the world's order
group = comm.split(r % 2 if N > 2 else 0, -r, "cp")
for method in OPS:
    errors, _, ok = case(method, "balanced", "float64", 0.1, group)
    passed &= ok
    if r == 0:
        print(f"{method:8} on CP groups of {group.size}, ranks reversed: out {errors[0]:.1e}  dqkv {errors[1]:.1e}"
              f"{'' if ok else '  MISMATCH'}")

minipar.set_default_dtype("float64")
positions = load_balanced_positions(T, N, r)
local = Tensor(full_qkv[:, positions])
raises_everywhere(lambda: ulysses_attention(local, N + 1, comm, positions), "multiple of the context-parallel")
raises_everywhere(lambda: ring_attention(local, H, comm, positions[:-1]), "positions must be")
raises_everywhere(lambda: ring_attention(local, H, comm, positions, 0.1), "pass key=")
raises_everywhere(lambda: ring_attention(local, H, comm, np.zeros_like(positions)), "once each")
raises_everywhere(lambda: ring_attention(local, H, comm, positions, head_offset=r), "called differently")
# ranks that differ only in their dtype (their ring messages would differ in size) or dropout
narrow = Tensor(full_qkv[:, positions], dtype="float32" if r == 0 else "float64")
raises_everywhere(lambda: ring_attention(narrow, H, comm, positions), "called differently")
raises_everywhere(lambda: ulysses_attention(local, H, comm, positions, 0.1 * (1 + r), KEY), "called differently")
# ranks that call different ops (a ring's messages against Ulysses' all-to-alls would hang)
raises_everywhere(lambda: (ring_attention if r == 0 else ulysses_attention)(local, H, comm, positions),
                  "call the same op")

if r == 0:
    print(f"context parallel attention {'OK' if passed else 'FAILED'} on {N} ranks")
sys.exit(0 if passed else 1)
