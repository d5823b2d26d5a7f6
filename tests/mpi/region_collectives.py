"""Forward and backward of every region collective against the serial computation (float64).

Each rank builds every rank's inputs from seeds, so it can compute the serial answer itself.
"""

import numpy as np

import minipar
from minipar import Tensor
from minipar.comm import world
from minipar.parallel import collectives as C

minipar.set_default_dtype("float64")
comm = world()
N, r = comm.size, comm.rank
B, T, H = 2, 2 * N, 3


def data(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape)


def leaf(array):
    return Tensor(array, requires_grad=True)


def close(a, b, what):
    if not np.allclose(a, b, rtol=1e-12, atol=1e-12):
        raise AssertionError(f"rank {r}: {what}: max error {np.abs(a - b).max()}")


def run(fn, x, upstream):
    y = fn(x, comm)
    y.backward(upstream)
    return y.data, x.grad


full = (B, T, H)
# f: identity forward; backward sums every rank's gradient
y, g = run(C.copy_to_region, leaf(data(0, full)), data(100 + r, full))
close(y, data(0, full), "copy_to_region forward")
close(g, sum(data(100 + k, full) for k in range(N)), "copy_to_region backward")

# g: sums every rank's input; backward is the identity
y, g = run(C.reduce_from_region, leaf(data(200 + r, full)), data(300 + r, full))
close(y, sum(data(200 + k, full) for k in range(N)), "reduce_from_region forward")
close(g, data(300 + r, full), "reduce_from_region backward")

# g in place (RowParallelLinear's, VocabParallelEmbedding's): the sum overwrites the array passed in
array = data(200 + r, full)
y, g = run(lambda x, comm: C.reduce_from_region(x, comm, in_place=True), leaf(array), data(1600 + r, full))
close(y, sum(data(200 + k, full) for k in range(N)), "reduce_from_region in place forward")
if not np.shares_memory(y, array):
    raise AssertionError(f"rank {r}: reduce_from_region in place: the sum is not in the input array")
close(array, sum(data(200 + k, full) for k in range(N)), "reduce_from_region in place: the input array")
close(g, data(1600 + r, full), "reduce_from_region in place backward")

# gather along the last axis; the region after it is replicated, so the upstream gradient is too
piece = (B, T, H)
y, g = run(C.gather_from_region, leaf(data(400 + r, piece)), data(500, (B, T, H * N)))
close(y, np.concatenate([data(400 + k, piece) for k in range(N)], axis=-1), "gather forward")
close(g, data(500, (B, T, H * N))[..., r * H : (r + 1) * H], "gather backward")

# scatter along the last axis (a replicated input); backward gathers the ranks' gradients
y, g = run(C.scatter_to_region, leaf(data(600, (B, T, H * N))), data(700 + r, piece))
close(y, data(600, (B, T, H * N))[..., r * H : (r + 1) * H], "scatter forward")
close(g, np.concatenate([data(700 + k, piece) for k in range(N)], axis=-1), "scatter backward")

shard = (B, T // N, H)
rows = slice(r * (T // N), (r + 1) * (T // N))
# sequence parallel entry: all-gather the shards; backward reduce-scatters the ranks' gradients
y, g = run(C.gather_from_sequence_region, leaf(data(800 + r, shard)), data(900 + r, full))
close(y, np.concatenate([data(800 + k, shard) for k in range(N)], axis=1), "sequence gather forward")
close(g, sum(data(900 + k, full) for k in range(N))[:, rows], "sequence gather backward")

# sequence parallel exit: reduce-scatter partial sums; backward all-gathers
y, g = run(C.reduce_scatter_to_sequence_region, leaf(data(1000 + r, full)), data(1100 + r, shard))
close(y, sum(data(1000 + k, full) for k in range(N))[:, rows], "sequence reduce-scatter forward")
close(g, np.concatenate([data(1100 + k, shard) for k in range(N)], axis=1), "sequence reduce-scatter backward")

# sequence scatter of a replicated input; backward all-gathers
y, g = run(C.scatter_to_sequence_region, leaf(data(1200, full)), data(1300 + r, shard))
close(y, data(1200, full)[:, rows], "sequence scatter forward")
close(g, np.concatenate([data(1300 + k, shard) for k in range(N)], axis=1), "sequence scatter backward")

# the same two in rank order (the MLP's): the gathered shards stacked, not put in sequence order
y, g = run(C.gather_tokens_from_sequence_region, leaf(data(800 + r, shard)), data(1400 + r, (N,) + shard))
close(y, np.stack([data(800 + k, shard) for k in range(N)]), "tokens gather forward")
close(g, sum(data(1400 + k, (N,) + shard) for k in range(N))[r], "tokens gather backward")
y, g = run(C.reduce_scatter_tokens_to_sequence_region, leaf(data(1500 + r, (N,) + shard)), data(1100 + r, shard))
close(y, sum(data(1500 + k, (N,) + shard) for k in range(N))[r], "tokens reduce-scatter forward")
close(g, np.stack([data(1100 + k, shard) for k in range(N)]), "tokens reduce-scatter backward")

if r == 0:
    print(f"region collectives OK on {N} ranks")
