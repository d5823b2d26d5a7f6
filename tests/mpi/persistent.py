"""Planned (persistent) collectives against the plain ones, on any number of ranks, with ranks
that wait politely and ranks that wait in MPI: the same results start after start (the arrays
read as they are at each start), the same byte counts, the same errors for bad input, raised when
planning, and the misuses of a plan (a second start while one runs, a start after free) refused."""

import numpy as np

from minipar.comm import world
from minipar.comm.base import Communicator, Persistent
from minipar.comm.mpi import MPICommunicator
from minipar.dtypes import bfloat16

comm = world()
N, r = comm.size, comm.rank


def check(ok, what):
    if not ok:
        raise AssertionError(f"rank {r}: {what}")


def ints(seed, shape, dtype=np.float64):
    """Whole numbers, so that any order of summing gives the same bits."""
    return np.random.default_rng(seed).integers(-50, 50, shape).astype(dtype)


def error(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the message is compared, whatever the kind
        return f"{type(exc).__name__}: {exc}"
    return None


for mode in ("polite", "blocking"):
    c = MPICommunicator(comm.comm, mode, polite=mode == "polite")
    x, h = ints(r, (2 * N, 3)), ints(r, (N, 4)).astype(bfloat16)
    summed, maxed, h_summed = x.copy(), x.copy(), h.copy()  # all-reduces work in place
    piece, gathered = np.empty((2, 3)), np.empty((N, 2 * N, 3))
    plans = {"sum": c.all_reduce_init(summed), "max": c.all_reduce_init(maxed, op="max"),
             "bf16": c.all_reduce_init(h_summed),
             "scatter": c.reduce_scatter_init(x, out=piece), "scatter new": c.reduce_scatter_init(h),
             "gather": c.all_gather_init(x, out=gathered), "gather new": c.all_gather_init(h)}
    check(plans["scatter"].result is piece and plans["gather"].result is gathered, f"{mode}: out= is the result")
    for step in range(3):  # new values in the same arrays before each start
        x[...], h[...] = ints(10 * step + r, x.shape), ints(10 * step + r, h.shape).astype(bfloat16)
        summed[...], maxed[...], h_summed[...] = x, x, h
        expect = {"sum": c.all_reduce(x.copy()), "max": c.all_reduce(x.copy(), op="max"),
                  "bf16": c.all_reduce(h.copy()), "scatter": c.reduce_scatter(x), "scatter new": c.reduce_scatter(h),
                  "gather": c.all_gather(x), "gather new": c.all_gather(h)}
        for name, plan in plans.items():
            got = plan.run() if step % 2 == 0 else plan.start().wait()
            check(got is plan.result and got.dtype == expect[name].dtype and np.array_equal(got, expect[name]),
                  f"{mode}: planned {name} at start {step}: {got} against {expect[name]}")

    # each start is counted as the plain call on the same arrays is
    c.stats.reset()
    for name in plans:
        plans[name].run()
    planned = c.stats.by_op
    c.stats.reset()
    c.all_reduce(x.copy()), c.all_reduce(x.copy(), op="max"), c.all_reduce(h.copy())
    c.reduce_scatter(x), c.reduce_scatter(h), c.all_gather(x), c.all_gather(h)
    check(planned == c.stats.by_op, f"{mode}: planned calls counted {planned} against {c.stats.by_op}")

    # a plan runs once at a time, and not after free()
    request = plans["sum"].start()
    message = error(plans["sum"].start)
    check(message and "started again before its last start finished" in message, f"{mode}: second start: {message}")
    message = error(plans["sum"].free)
    check(message and "free() while a start is running" in message, f"{mode}: free while running: {message}")
    request.wait()
    check(request.test(), f"{mode}: a finished start tests done")
    plans["sum"].run()
    plans["gather"].free()
    message = error(plans["gather"].run)
    check(message and "started after free()" in message, f"{mode}: start after free: {message}")

    # bad input: the plain form's error, from planning, before anything is counted or sent
    c.stats.reset()
    bad = [("all_reduce", (x,), {"op": "mean"}), ("all_reduce", (np.ones((4, 4))[:, ::2],), {}),
           ("all_reduce", (np.ones(3, bool),), {}), ("reduce_scatter", (np.ones(()),), {}),
           ("reduce_scatter", (x,), {"out": np.empty((2, 4))}),
           ("reduce_scatter", (x,), {"out": np.empty((2, 3), np.float32)}),
           ("all_gather", (x,), {"out": np.empty((N + 1, 2 * N, 3))}), ("all_gather", (np.ones(3, bool),), {}),
           ("all_gather", (x,), {"out": np.asfortranarray(np.empty((N, 2 * N, 3)))})]
    bad += [("all_reduce", ([1.0, 2.0],), {}), ("reduce_scatter", ([1.0] * N,), {}), ("all_gather", ([1.0],), {}),
            ("reduce_scatter", (x,), {"out": [0.0] * 6}), ("all_gather", (x,), {"out": list(range(N))})]
    if N > 1:
        bad.append(("reduce_scatter", (np.ones(2 * N + 1),), {}))
    for name, args, kwargs in bad:
        plain = error(lambda: getattr(c, name)(*args, **kwargs))
        planned = error(lambda: getattr(c, name + "_init")(*args, **kwargs))
        check(plain and "AttributeError" not in plain and planned == plain,
              f"{mode}: {name}_init{kwargs}: {planned!r} where the plain form says {plain!r}")
    check(not c.stats.by_op, f"{mode}: refused plans counted {c.stats.by_op}")

    # a plan the caller does not hold runs (mpi4py's request holds the arrays)
    check(np.array_equal(c.all_reduce_init(x.copy()).run(), c.all_reduce(x.copy())), f"{mode}: a plan held by no one")

    # the general form (what GPU arrays get: the i-form at each start) gives the same
    general = Communicator.reduce_scatter_init(c, x)
    check(type(general) is Persistent and np.array_equal(general.run(), c.reduce_scatter(x))
          and np.array_equal(general.start().wait(), c.reduce_scatter(x)), f"{mode}: the general form")

comm.barrier()
if r == 0:
    print(f"planned collectives OK on {N} ranks")
