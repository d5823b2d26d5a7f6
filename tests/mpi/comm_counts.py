"""The byte account when calls fail, on two or more ranks, waiting politely and in MPI: a receive
whose message does not fit is refused by every wait and counted once; a call refused before
anything is sent counts nothing on any path, and leaves the ranks in step."""

import numpy as np

from minipar.comm import world
from minipar.comm.mpi import MPICommunicator

comm = world()
N, r = comm.size, comm.rank


def check(ok, what):
    if not ok:
        raise AssertionError(f"rank {r}: {what}")


def error(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the error itself is compared
        return exc
    return None


def counted(c):
    return {op: (t.calls, t.bytes_sent, t.bytes_received) for op, t in c.stats.by_op.items()}


for mode in ("polite", "blocking"):
    c = MPICommunicator(comm.comm, mode, polite=mode == "polite")
    # rank 0 sends rank 1 a short message, a long one and a fitting one
    if r == 0:
        for tag, n in ((10, 4), (11, 8), (12, 4)):
            c.send(np.arange(float(n)), 1, tag=tag)
        check(counted(c) == {"send": (3, 128, 0)}, f"{mode}: sends counted {counted(c)}")
    elif r == 1:
        for tag, size, says in ((10, 8, "got 32 bytes into a buffer of 64"),
                                (11, 4, "got a message larger than its buffer of 32 bytes")):
            request = c.irecv(np.full(size, -1.0), 0, tag=tag)
            first = error(request.wait)
            check(isinstance(first, ValueError) and f"recv from rank 0 (tag {tag}) {says}" in str(first),
                  f"{mode}: tag {tag}: {first!r}")
            again = [error(request.wait), error(request.test), error(request.wait)]
            check(all(e is first for e in again), f"{mode}: tag {tag}: later waits said {again!r}")
        out = np.zeros(4)
        request = c.irecv(out, 0, tag=12)
        check(request.wait() is out and request.wait() is out and request.test(), f"{mode}: a fitting message")
        check(np.array_equal(out, np.arange(4.0)), f"{mode}: received {out}")
        check(counted(c) == {"recv": (3, 0, 96)}, f"{mode}: receives counted {counted(c)}")

    # refused before anything is sent: nothing counted, on any path, and every rank still in step
    c.stats.reset()
    objects, complexes = np.array([1, 2], object), np.ones(2, np.complex64)
    refused = [lambda: c.all_reduce(objects), lambda: c.iall_reduce(objects), lambda: c.all_reduce_init(objects),
               lambda: c.all_reduce(complexes, op="max"), lambda: c.iall_reduce(complexes, op="max"),
               lambda: c.all_reduce_init(complexes, op="max"), lambda: c.reduce_scatter(np.array(["a"] * N)),
               lambda: c.all_gather(np.zeros(2, "datetime64[s]")), lambda: c.all_gather_init(np.zeros(2, "m8[s]")),
               lambda: c.broadcast(np.ones(2), root=N), lambda: c.ibroadcast(np.ones(2), root=-1),
               lambda: c.isend(np.ones(2), N), lambda: c.irecv(np.ones(2), N)]
    errors = [error(call) for call in refused]
    check(all(errors), f"{mode}: accepted {[i for i, e in enumerate(errors) if e is None]}")
    raw = [e for e in errors[:-2] if "error stack" in str(e)]  # sends to no rank are MPI's to refuse
    check(not raw, f"{mode}: MPI's own errors where ours should be: {raw}")
    check(counted(c) == {}, f"{mode}: refused calls counted {counted(c)}")
    total = c.all_reduce(np.ones(3))
    check(np.array_equal(total, np.full(3, float(N))) and counted(c)["all_reduce"][0] == 1, f"{mode}: after refusals")
    comm.barrier()
if r == 0:
    print(f"comm counts OK on {N} ranks")
