"""Every Communicator operation against the serial computation, on any number of ranks."""

import numpy as np

from minipar.comm import ring_bytes, wait_all, world

comm = world()
N, r = comm.size, comm.rank


def data(seed, shape, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def check(ok, what):
    if not ok:
        raise AssertionError(f"rank {r}: {what}")


# all_reduce: sum and max, in place
x = data(r, (5, 7))
y = comm.all_reduce(x)
check(y is x, "all_reduce works in place")
check(np.allclose(x, sum(data(k, (5, 7)) for k in range(N)), rtol=1e-13), "all_reduce sum")
x = data(r, (3,), np.float32)
comm.all_reduce(x, op="max")
check(np.array_equal(x, np.max([data(k, (3,), np.float32) for k in range(N)], axis=0)), "all_reduce max")

# reduce_scatter: chunk r of the sum
x = data(10 + r, (2 * N, 3))
out = comm.reduce_scatter(x)
full = sum(data(10 + k, (2 * N, 3)) for k in range(N))
check(out.shape == (2, 3) and np.allclose(out, full[2 * r : 2 * r + 2], rtol=1e-13), "reduce_scatter")

# all_gather: every rank's array, in rank order
out = comm.all_gather(data(20 + r, (4,)))
check(out.shape == (N, 4) and all(np.array_equal(out[k], data(20 + k, (4,))) for k in range(N)), "all_gather")

# all_to_all: chunk i of rank r lands as chunk r of rank i; the result is the input's shape
x = data(50 + r, (2 * N, 3))
out = comm.all_to_all(x)
check(out.shape == x.shape and all(np.array_equal(out[2 * k : 2 * k + 2], data(50 + k, (2 * N, 3))[2 * r : 2 * r + 2])
                                   for k in range(N)), "all_to_all")
check(np.array_equal(comm.iall_to_all(out).wait(), x), "all_to_all is its own inverse")
# all_to_all cuts axis 0 into N chunks: rows that do not divide are refused, even where their
# elements would (MPI sees only elements, and would cut rows in two)
for bad in [np.ones(()), np.ones((2 * N + 1, N))] if N > 1 else [np.ones(())]:
    try:
        comm.all_to_all(bad)
        check(False, f"all_to_all accepted shape {bad.shape} on {N} ranks")
    except ValueError as exc:
        check(f"all_to_all: axis 0 of shape {bad.shape} does not split into {N} chunks" in str(exc), f"all_to_all: {exc}")

# broadcast from the last rank
x = data(30 + r, (6,))
comm.broadcast(x, root=N - 1)
check(np.array_equal(x, data(30 + N - 1, (6,))), "broadcast")

# non-blocking point to point around a ring
send = data(40 + r, (8,), np.float32)
recv = np.empty(8, np.float32)
wait_all([comm.isend(send, (r + 1) % N, tag=7), comm.irecv(recv, (r - 1) % N, tag=7)])
check(np.array_equal(recv, data(40 + (r - 1) % N, (8,), np.float32)), "isend/irecv ring")

# blocking point to point between pairs (0,1), (2,3), ...
if N > 1 and r < N - N % 2:
    peer = r ^ 1
    if r % 2 == 0:
        comm.send(np.full(3, float(r)), peer)
    else:
        got = comm.recv(np.empty(3), peer)
        check(np.array_equal(got, np.full(3, float(peer))), "send/recv")

# contiguity is checked before anything is sent
try:
    comm.all_reduce(np.ones((4, 4))[:, ::2])
    check(False, "a strided buffer was accepted")
except ValueError as exc:
    check("C-contiguous" in str(exc), "strided buffer message")

# byte accounting follows the ring model
comm.stats.reset()
buf = np.ones(N * 1000, np.float32)
comm.all_reduce(buf)
comm.reduce_scatter(buf)
comm.all_gather(buf[:1000])
comm.all_to_all(buf)
t = comm.stats.by_op
check(t["all_reduce"].bytes_sent == 2 * (N - 1) * buf.nbytes // N, "all_reduce bytes")
check(t["reduce_scatter"].bytes_sent == (N - 1) * buf.nbytes // N, "reduce_scatter bytes")
check(t["all_gather"].bytes_received == (N - 1) * buf.nbytes // N, "all_gather bytes")
check(t["all_to_all"].bytes_sent == t["all_to_all"].bytes_received == (N - 1) * buf.nbytes // N, "all_to_all bytes")
check(ring_bytes("all_reduce", 4000, 4) == (6000, 6000), "ring model")

# split into even and odd ranks
sub = comm.split(r % 2, r, "parity")
check(sub.size == (N + 1 - r % 2) // 2 and sub.rank == r // 2, "split sizes")
members = sub.all_gather(np.array([r]))[:, 0]
check(list(members) == list(range(r % 2, N, 2)), f"split members {members}")
comm.barrier()
if r == 0:
    print(f"comm ops OK on {N} ranks")

# broadcast is charged as a pipelined chain: N-1 links carry S, so sent and received add up
comm.stats.reset()
comm.broadcast(np.ones(100), root=N - 1)
t = comm.stats.by_op["broadcast"]
totals = comm.all_reduce(np.array([t.bytes_sent, t.bytes_received]))
check(list(totals) == [(N - 1) * 800, (N - 1) * 800], f"broadcast bytes {list(totals)}")

# a non-blocking operation keeps its buffers alive: the caller may drop the send buffer at once
request = comm.ireduce_scatter(np.full(N * 4096, float(r + 1)))
scribble = [np.full(N * 4096, 7.0) for _ in range(8)]  # reuse whatever memory was freed
check(np.all(request.wait() == N * (N + 1) / 2), "ireduce_scatter with a dropped send buffer")

# a receive that does not match the message is an error, not stale or reinterpreted data
if N > 1 and r < 2:
    if r == 0:
        comm.send(np.arange(4.0), 1, tag=99)
    else:
        try:
            comm.recv(np.full(8, -1.0), 0, tag=99)
            check(False, "a message of 4 float64 was received into 8 without an error")
        except ValueError as exc:
            check("got 32 bytes into a buffer of 64" in str(exc), f"recv message: {exc}")
# gather_to_root: arrays of different lengths, in rank order on the root only
parts = comm.gather_to_root(np.arange(r + 1, dtype=np.float32) * (r + 1), tag=300, root=N - 1)
if r == N - 1:
    check([p.tolist() for p in parts] == [(np.arange(k + 1) * (k + 1)).tolist() for k in range(N)], "gather_to_root")
else:
    check(parts is None, "gather_to_root gives None off the root")
# The plain all_reduce, reduce_scatter and all_gather of host arrays go straight to MPI's blocking
# calls on a rank with a core to itself, and take the general path (staging, polite waits) on an
# oversubscribed one. The same group both ways, whichever this machine's core count picks: equal
# results, errors and bytes, and bad input refused before anything is counted or sent.
from minipar.comm.mpi import MPICommunicator  # noqa: E402
from minipar.dtypes import bfloat16  # noqa: E402

x64, x32, x16 = data(60 + r, (2 * N, 3)), data(61 + r, (2 * N,), np.float32), data(62 + r, (N, 2)).astype(bfloat16)
bad_inputs = [("all_reduce", (x32,), {"op": "mean"}), ("all_reduce", (np.ones((4, 4))[:, ::2],), {}),
              ("all_reduce", (np.ones(3, bool),), {}), ("reduce_scatter", (np.ones(()),), {}),
              ("reduce_scatter", (x64,), {"out": np.empty((2, 4))}),
              ("reduce_scatter", (x64,), {"out": np.empty((2, 3), np.float32)}),
              ("all_gather", (x32,), {"out": np.empty((N, 2 * N))}),
              ("all_gather", (x32,), {"out": np.empty((N + 1, 2 * N), np.float32)}),
              ("all_gather", (x32,), {"out": np.empty((N, 2 * N + 1), np.float32)}),
              ("all_gather", (x32,), {"out": np.empty(2 * N * N, np.float32)}),
              ("reduce_scatter", (x32,), {"out": np.empty(3, np.float32)}),
              ("reduce_scatter", (x32,), {"out": np.empty(2)}),
              ("reduce_scatter", (x32,), {"out": np.empty((1, 2), np.float32)}),
              # what the direct paths leave to mpi4py and MPI, or check because mpi4py does not
              ("all_reduce", (np.ones(8)[::2],), {}), ("all_reduce", (np.asfortranarray(np.ones((4, 3))),), {}),
              ("reduce_scatter", (np.ones(2 * N, bool),), {}), ("reduce_scatter", (np.ones(4 * N)[::2],), {}),
              ("all_gather", (np.ones(3, bool),), {}), ("all_gather", (x32,), {"out": np.empty((2 * N, N), np.float32)}),
              ("all_reduce", (np.ones(3, np.dtype(bool, metadata={"m": 1})),), {})]  # bool, if not numpy's own object
if N > 1:
    bad_inputs += [("reduce_scatter", (np.ones(2 * N + 1),), {}),
                   ("all_gather", (x32,), {"out": np.asfortranarray(np.empty((N, 2 * N), np.float32))})]
results = {}
for mode in ("polite", "blocking"):
    c = MPICommunicator(comm.comm, mode, polite=mode == "polite")
    rs_out, rs_flat, ag_out = np.empty((2, 3)), np.empty(2, np.float32), np.empty((N, 2 * N), np.float32)
    got = [c.all_reduce(x64.copy()), c.all_reduce(x32.copy(), op="max"), c.all_reduce(x16.copy()),
           c.all_reduce(x32.astype(np.complex64) * (1 - 2j)), c.all_reduce(np.full((), r + 0.5)),
           c.reduce_scatter(x64), c.reduce_scatter(x32), c.reduce_scatter(x16), c.all_gather(x32),
           c.all_gather(x16), c.all_gather(x64)]
    check(c.reduce_scatter(x64, out=rs_out) is rs_out and c.reduce_scatter(x32, out=rs_flat) is rs_flat
          and c.all_gather(x32, out=ag_out) is ag_out, f"{mode}: out= is the result")
    got += [rs_out, rs_flat, ag_out]
    for name, args, kwargs in bad_inputs:
        try:
            getattr(c, name)(*args, **kwargs)
            check(False, f"{mode}: {name} accepted {[getattr(a, 'shape', a) for a in args]} {kwargs}")
        except (ValueError, TypeError, BufferError, KeyError) as exc:
            got.append(str(exc))
    got.append({op: (t.calls, t.bytes_sent, t.bytes_received) for op, t in c.stats.by_op.items()})
    results[mode] = got
for a, b in zip(results["blocking"], results["polite"]):
    same = a == b if isinstance(a, (str, dict)) else a.dtype == b.dtype and np.array_equal(a, b)
    check(same, f"the direct and the general path disagree: {a} against {b}")
ar_bytes = 2 * (N - 1) * (x64.nbytes + x32.nbytes + x16.nbytes + 2 * x32.nbytes + 8) // N  # charged once, all together
check(results["blocking"][-1]["all_reduce"] == (5, ar_bytes, ar_bytes), f"all_reduce counted {results['blocking'][-1]}")
if N > 1:  # and the direct paths are taken, not only right: a general path that fails is never reached
    fast = MPICommunicator(comm.comm, "direct", polite=False)

    def general_path(*args, **kwargs):
        raise AssertionError("a plain host array took the general path")

    fast._all_reduce = fast._reduce_scatter = fast._all_gather = general_path
    flat = x64.reshape(-1)
    general = results["polite"]  # the same calls through the general path
    for a, b in ((fast.all_reduce(x64.copy()), general[0]), (fast.reduce_scatter(flat), general[5].reshape(-1)),
                 (fast.all_gather(x32), general[8])):
        check(a.dtype == b.dtype and np.array_equal(a, b), "the direct paths give the general paths' results")
comm.barrier()
if r == 0:
    print(f"comm checks OK on {N} ranks")
