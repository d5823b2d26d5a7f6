"""The world's collectives and point-to-point messages on GPU (CuPy) arrays, against the host
computation: through NCCL when every rank has a GPU of its own, else through MPI."""

import numpy as np

from minipar import backend

backend.use_device("cuda")
import cupy  # noqa: E402

from minipar.comm import world  # noqa: E402
from minipar.comm.nccl import NCCLCommunicator  # noqa: E402

comm = world()
N, r = comm.size, comm.rank


def data(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def check(ok, what):
    if not ok:
        raise AssertionError(f"rank {r}: {what}")


x = cupy.asarray(data(r, (5, 7)))
check(comm.all_reduce(x) is x, "all_reduce in place")
check(np.allclose(x.get(), sum(data(k, (5, 7)) for k in range(N)), rtol=1e-5), "all_reduce")
out = comm.reduce_scatter(cupy.asarray(data(10 + r, (2 * N, 3))))
check(np.allclose(out.get(), sum(data(10 + k, (2 * N, 3)) for k in range(N))[2 * r : 2 * r + 2], rtol=1e-5),
      "reduce_scatter")
out = comm.iall_gather(cupy.asarray(data(20 + r, (4,)))).wait()
check(all(np.array_equal(out[k].get(), data(20 + k, (4,))) for k in range(N)), "all_gather")
x = cupy.asarray(data(30 + r, (6,)))
comm.broadcast(x, root=N - 1)
check(np.array_equal(x.get(), data(30 + N - 1, (6,))), "broadcast")
x = cupy.asarray(data(40 + r, (3,)))
comm.iall_reduce(x, op="max").wait()
check(np.array_equal(x.get(), np.max([data(40 + k, (3,)) for k in range(N)], axis=0)), "iall_reduce max")
out = comm.ireduce_scatter(cupy.asarray(data(50 + r, (N, 2)))).wait()
check(np.allclose(out.get(), sum(data(50 + k, (N, 2)) for k in range(N))[r : r + 1], rtol=1e-5), "ireduce_scatter")
out = comm.iall_to_all(cupy.asarray(data(55 + r, (2 * N, 3)))).wait()
check(all(np.array_equal(out[2 * k : 2 * k + 2].get(), data(55 + k, (2 * N, 3))[2 * r : 2 * r + 2]) for k in range(N)),
      "all_to_all")
pair = comm.split(r // 2, r, "pairs")  # sub-groups: {0, 1}, {2, 3}, ...
x = cupy.asarray(data(60 + r, (4,)))
pair.all_reduce(x)
check(np.allclose(x.get(), sum(data(60 + k, (4,)) for k in range(r - r % 2, min(r - r % 2 + 2, N))), rtol=1e-5),
      "all_reduce on a split group")
host = comm.all_reduce(np.array([r], np.int64))  # host arrays still work, through MPI
check(isinstance(host, np.ndarray) and int(host[0]) == N * (N - 1) // 2, "host all_reduce")
if N > 1:
    message = cupy.arange(8, dtype=cupy.float32) + r
    got = cupy.empty(8, cupy.float32)
    request = comm.irecv(got, (r - 1) % N, tag=5)
    comm.isend(message, (r + 1) % N, tag=5).wait()
    request.wait()
    check(np.array_equal(got.get(), np.arange(8, dtype=np.float32) + (r - 1) % N), "send/recv")
comm.barrier()
if r == 0:
    print(f"gpu comm OK on {N} ranks via {'NCCL' if isinstance(comm, NCCLCommunicator) else 'MPI'}")
