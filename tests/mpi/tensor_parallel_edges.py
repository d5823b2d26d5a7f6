"""Tensor parallelism at its edges, against the single-device run (float64): odd batch, sequence
shard and feature sizes; the MLP's rank-ordered sequence-parallel pair; a gathered output under
sequence parallelism; a padded vocabulary where a whole rank holds only padding; ignored targets
whose logits are -inf; the whole GPT with all of these; bad sizes refused on every rank.

    run_mpi.sh -n 4 tests/mpi/tensor_parallel_edges.py
"""

import functools
import os
import sys
import warnings

import numpy as np

import minipar
import minipar.functional as F
from minipar.models import GPT, GPTConfig
from minipar.nn import Embedding, Linear
from minipar.parallel import tensor as T
from minipar.parallel.cross_entropy import vocab_parallel_cross_entropy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tp_common, beside this file
from tp_common import N, close, data, gpt_matches, grid, leaf, part, r, tp, twins  # noqa: E402

warnings.simplefilter("error")  # nothing here may compute -inf - -inf or 0 / 0 on the way
B, S, C = 3, 3 * N, 5  # odd batch, odd shard (3 positions), odd features
seq = slice(r * S // N, (r + 1) * S // N)
close = functools.partial(close, tol=1e-12)


# The MLP under sequence parallelism: c_fc gathers the shards and keeps the tokens in rank order,
# GELU treats each alone, c_proj reduce-scatters them from rank order. Hidden 3N: 3 per rank.
x = data(1, (B, S, C))
g = data(2, (B, S, C))
minipar.manual_seed(0)
fc, proj = Linear(C, 3 * N), Linear(3 * N, C)
minipar.manual_seed(0)
fc_p = T.ColumnParallelLinear(C, 3 * N, tp, sequence_parallel=True, rank_order=True)
proj_p = T.RowParallelLinear(3 * N, C, tp, sequence_parallel=True, rank_order=True)
xs, xr = leaf(x), leaf(x[:, seq])
y_s = proj(F.gelu(fc(xs)))
y_s.backward(g)
y = proj_p(F.gelu(fc_p(xr)))
close(y.data, y_s.data[:, seq], "rank-ordered MLP forward")
y.backward(g[:, seq])
T.finalize_grads(proj_p, tp)
close(xr.grad, xs.grad[:, seq], "rank-ordered MLP dx")
close(fc_p.weight.grad, part(fc.weight.grad, 0), "rank-ordered c_fc dW")
close(fc_p.bias.grad, part(fc.bias.grad, 0), "rank-ordered c_fc db")
close(proj_p.weight.grad, part(proj.weight.grad, 1), "rank-ordered c_proj dW")
close(proj_p.bias.grad, proj.bias.grad, "rank-ordered c_proj db (summed over the shards)")

# gather_output under sequence parallelism: the shard in, the whole output on every rank
serial, col = twins(lambda: Linear(C, 2 * N), lambda: T.ColumnParallelLinear(C, 2 * N, tp, gather_output=True,
                                                                           sequence_parallel=True))
xs, xr = leaf(x), leaf(x[:, seq])
g = data(3, (B, S, 2 * N))
serial(xs).backward(g)
y = col(xr)
close(y.data, serial(leaf(x)).data, "gathered column forward (sp)")
y.backward(g)
close(xr.grad, xs.grad[:, seq], "gathered column dx (sp)")
close(col.weight.grad, part(serial.weight.grad, 0), "gathered column dW (sp)")

# The vocabulary-parallel embedding, sequence-parallel, with a padded vocabulary of 2N + 1
V = 2 * N + 1
serial, emb = twins(lambda: Embedding(V, C), lambda: T.VocabParallelEmbedding(V, C, tp, sequence_parallel=True))
ids = np.random.default_rng(4).integers(0, V, (B, S))
ids[0, :3] = V - 1  # the last id (on the last rank, beside its padding), three times
g = data(5, (B, S, C))
serial(ids).backward(g)
y = emb(ids)
close(y.data, serial(ids).data[:, seq], "vocab embedding forward (sp)")
y.backward(g[:, seq])
whole = np.concatenate([serial.weight.grad, np.zeros((T.padded_vocab(V, N) - V, C))])
close(emb.weight.grad, part(whole, 0), "vocab embedding dW (sp)")

# The loss with 2 columns per rank over a vocabulary of 2N - 3 (as a caller may cut it): the last
# rank holds only padding. Ignored rows: one masks column 0 with -inf (where an ignored row's
# target would be read), one is -inf everywhere. Logits near 1000 too.
V2, rows = max(2 * N - 3, 1), 6
targets = np.random.default_rng(6).integers(0, V2, rows)
targets[1] = targets[4] = -1
for shift in (0.0, 1000.0):
    for reduction in ("mean", "sum"):
        logits = data(7, (rows, 2 * N)) * 3 + shift
        logits[1, 0] = -np.inf
        logits[4] = -np.inf
        kept = [0, 2, 3, 5]
        ls = leaf(logits[kept][:, :V2])
        loss_s = F.cross_entropy(ls, targets[kept], reduction=reduction)
        loss_s.backward()
        lp = leaf(part(logits, -1))
        loss = vocab_parallel_cross_entropy(lp, targets, tp, 2 * r, V2, reduction=reduction)
        close(loss.item(), loss_s.item(), f"vocab-parallel loss {reduction}, logits + {shift}")
        loss.backward()
        whole = np.zeros((rows, 2 * N))
        whole[kept, :V2] = ls.grad
        close(lp.grad, part(whole, -1), f"vocab-parallel dlogits {reduction}, logits + {shift}")
        serial_ignoring = leaf(logits[:, :V2])  # and the serial loss, given the ignored rows, agrees
        close(F.cross_entropy(serial_ignoring, targets, reduction=reduction).item(), loss_s.item(),
              f"serial loss {reduction} with ignored -inf rows, logits + {shift}")

# The whole GPT: batch 3, sequence 3N, a vocabulary of 2N + 1 (padded), ignored targets, dropout
config = GPTConfig(n_layer=2, n_head=N, n_embd=2 * N, block_size=3 * N, vocab_size=V, dropout=0.1)
ids = np.random.default_rng(9).integers(0, V, (B, S))
targets = np.random.default_rng(10).integers(0, V, (B, S))
targets[0, 0] = targets[2, -1] = -1
for sp in (False, True):
    serial, model = twins(lambda: GPT(config), lambda: GPT(config, grid, sequence_parallel=sp))
    gpt_matches(serial, model, ids, targets, f"sp={sp}", tol=1e-12)

# Sizes that do not split are refused on every rank, before any message, naming the fix
refused = 0
for make in (lambda: T.ColumnParallelLinear(C, N + 1, tp), lambda: T.RowParallelLinear(N + 1, C, tp),
             lambda: T.ColumnParallelLinear(C, 3 * (N + 1), tp, chunks=3)):
    try:
        make()
    except ValueError as exc:
        refused += int("multiple of" in str(exc)) if N > 1 else 0
if tp.all_reduce(np.array([refused]))[0] != (3 * N if N > 1 else 0):
    raise AssertionError(f"rank {r}: sizes that TP does not divide were not refused with the fix named")
if r == 0:
    print(f"tensor parallel edges OK on {N} ranks")
