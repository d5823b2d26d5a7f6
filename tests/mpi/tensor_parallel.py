"""Every tensor-parallel layer, the vocab-parallel loss and the whole GPT against their serial twins
(float64): outputs, input gradients and weight gradients.

    run_mpi.sh -n 4 tests/mpi/tensor_parallel.py
"""

import os
import sys

import numpy as np

import minipar.functional as F
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.nn import Embedding, Linear
from minipar.parallel import ProcessGrid
from minipar.parallel import tensor as T
from minipar.parallel.cross_entropy import vocab_parallel_cross_entropy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tp_common, beside this file
from tp_common import N, close, data, gpt_matches, grid, leaf, part, r, tp, twins  # noqa: E402

B, S, C_in, C_out = 2, 2 * N, 6, 4 * N
x_full, seq = data(1, (B, S, C_in)), slice(r * S // N, (r + 1) * S // N)

# ColumnParallelLinear, also with the fused-qkv split and with a sequence-parallel input
for chunks, sp in ((1, False), (3, False), (1, True)):
    serial, col = twins(lambda: Linear(C_in, 3 * C_out),
                        lambda: T.ColumnParallelLinear(C_in, 3 * C_out, tp, chunks=chunks, sequence_parallel=sp))
    g = data(2, (B, S, 3 * C_out))
    xs = leaf(x_full)
    serial(xs).backward(g)
    xp_ = leaf(x_full[:, seq] if sp else x_full)
    y = col(xp_)
    close(y.data, part(serial(leaf(x_full)).data, -1, chunks), f"column forward chunks={chunks} sp={sp}")
    y.backward(part(g, -1, chunks))
    close(xp_.grad, xs.grad[:, seq] if sp else xs.grad, f"column dx chunks={chunks} sp={sp}")
    close(col.weight.grad, part(serial.weight.grad, 0, chunks), f"column dW chunks={chunks}")
    close(col.bias.grad, part(serial.bias.grad, 0, chunks), f"column db chunks={chunks}")

# gather_output: every rank ends with the whole output; its gradient is the same on every rank
serial, col = twins(lambda: Linear(C_in, C_out), lambda: T.ColumnParallelLinear(C_in, C_out, tp, gather_output=True))
g = data(11, (B, S, C_out))
xs, xg = leaf(x_full), leaf(x_full)
ys = serial(xs)
ys.backward(g)
y = col(xg)
close(y.data, ys.data, "column gather_output forward")
y.backward(g)
close(xg.grad, xs.grad, "column gather_output dx")
close(col.weight.grad, part(serial.weight.grad, 0), "column gather_output dW")

# RowParallelLinear: parallel input, whole input, sequence-parallel output
for parallel_in, sp in ((True, False), (False, False), (True, True)):
    serial, row = twins(lambda: Linear(C_out, C_in),
                        lambda: T.RowParallelLinear(C_out, C_in, tp, input_is_parallel=parallel_in, sequence_parallel=sp))
    x = data(3, (B, S, C_out))
    g = data(4, (B, S, C_in))
    xs = leaf(x)
    ys = serial(xs)
    ys.backward(g)
    xr = leaf(part(x, -1) if parallel_in else x)
    y = row(xr)
    close(y.data, ys.data[:, seq] if sp else ys.data, f"row forward in_parallel={parallel_in} sp={sp}")
    y.backward(g[:, seq] if sp else g)
    close(xr.grad, part(xs.grad, -1) if parallel_in else xs.grad, f"row dx in_parallel={parallel_in}")
    close(row.weight.grad, part(serial.weight.grad, 1), "row dW")
    if sp:  # each rank saw its shard of the sequence: the bias gradient is partial until summed
        T.finalize_grads(row, tp)
        try:
            T.finalize_grads(row, tp)  # a second sum would double it
            raise AssertionError(f"rank {r}: a second finalize_grads was not refused")
        except RuntimeError as e:
            assert "already called" in str(e), e
    close(row.bias.grad, serial.bias.grad, f"row db sp={sp}")

# VocabParallelEmbedding with a vocabulary that needs padding (10 rows over 4 ranks -> 12)
V = 10 if N == 4 else 9
serial, emb = twins(lambda: Embedding(V, 5), lambda: T.VocabParallelEmbedding(V, 5, tp))
ids = np.random.default_rng(5).integers(0, V, (B, S))
g = data(6, (B, S, 5))
ys = serial(ids)
ys.backward(g)
y = emb(ids)
close(y.data, ys.data, "vocab embedding forward")
y.backward(g)
padded = np.concatenate([serial.weight.grad, np.zeros((T.padded_vocab(V, N) - V, 5))])
close(emb.weight.grad, part(padded, 0), "vocab embedding dW")

# Vocab-parallel cross-entropy: padding columns hold garbage, two targets are ignored. Logits near
# 1000 too, where exp overflows: the ranks must subtract the row's maximum over all of them (a sum
# of their maxima, about N x 1000, would leave exp(z - m) = 0 and the loss infinite)
Vp = T.padded_vocab(V, N)
targets = np.random.default_rng(8).integers(0, V, (B, S))
targets[0, 1] = targets[1, 0] = -1
# of both reductions; a scalar upstream other than 1 catches a backward that forgets to scale by it
# (the serial loss's backward is checked by central differences with random upstreams)
for shift, reduction in ((0.0, "mean"), (1000.0, "mean"), (0.0, "sum")):
    logits = data(7, (B, S, Vp)) * 3 + shift
    upstream = np.asarray(0.37)
    ls = leaf(logits[..., :V])
    loss_s = F.cross_entropy(ls, targets, reduction=reduction)
    loss_s.backward(upstream)
    lp = leaf(part(logits, -1))
    loss = vocab_parallel_cross_entropy(lp, targets, tp, r * Vp // N, V, reduction=reduction)
    close(loss.item(), loss_s.item(), f"vocab-parallel loss ({reduction}), logits + {shift}")
    loss.backward(upstream)
    close(lp.grad, part(np.concatenate([ls.grad, np.zeros((B, S, Vp - V))], axis=-1), -1),
          f"vocab-parallel dlogits ({reduction}), logits + {shift}")

# The whole GPT, with and without sequence parallelism, with dropout
config = GPTConfig(n_layer=2, n_head=2 * N, n_embd=4 * N, block_size=2 * N, vocab_size=V, dropout=0.1)
ids = np.random.default_rng(9).integers(0, V, (2, 2 * N))
targets = np.random.default_rng(10).integers(0, V, (2, 2 * N))
for sp in (False, True):
    serial, model = twins(lambda: GPT(config), lambda: GPT(config, grid, sequence_parallel=sp))
    close_state = model.full_state_dict()
    for name, value in serial.state_dict().items():
        close(close_state[name], value, f"initial {name} sp={sp}", tol=0)
    gpt_matches(serial, model, ids, targets, f"sp={sp}")
    twin = GPT(config, grid, sequence_parallel=sp)
    twin.load_full_state_dict(serial.state_dict())
    for name, value in twin.full_state_dict().items():
        close(value, serial.state_dict()[name], f"load/gather round trip {name}", tol=0)

# TP x DP with dropout: each DP rank runs its slice of the batch and drops its part of the masks
if world().size % 2 == 0 and world().size >= 4:
    grid2 = ProcessGrid(tp=world().size // 2, pp=1)  # DP = 2
    dp = grid2.dp_group
    ids4 = np.random.default_rng(12).integers(0, V, (4, 2 * N))
    targets4 = np.random.default_rng(13).integers(0, V, (4, 2 * N))
    rows = slice(2 * dp.rank, 2 * dp.rank + 2)
    config2 = GPTConfig(n_layer=2, n_head=N, n_embd=2 * N, block_size=2 * N, vocab_size=V, dropout=0.2)
    for sp in (False, True):
        serial, model = twins(lambda: GPT(config2), lambda: GPT(config2, grid2, sequence_parallel=sp))
        logits_s, loss_s = serial(ids4, targets4)
        loss_s.backward()
        logits, loss = model(ids4[rows], targets4[rows])
        loss.backward()
        model.finalize_grads()
        close(model.gather_logits(logits).data, logits_s.data[rows], f"TPxDP logits sp={sp}")
        grads = T.full_parameters(model, "grad")
        for name, p in serial.named_parameters():  # equal halves: the batch mean is the mean of means
            close(dp.all_reduce(grads[name]) / 2, p.grad, f"TPxDP grad {name} sp={sp}")

# Bad input is refused on every rank: out-of-range ids, a sequence that does not split, a second
# finalize_grads, sampling from a sequence-parallel model
model = GPT(config, grid, sequence_parallel=True)
checks = 0
for attempt, kind in ((lambda: model(np.full((1, 2 * N), V)), IndexError),
                      (lambda: model(np.zeros((1, 2 * N - 1), np.int64)), ValueError),
                      (lambda: model.generate(np.zeros((1, 2), np.int64), 1), ValueError)):
    try:
        attempt()
    except kind:
        checks += 1
_, loss = model(ids, targets)
loss.backward()
model.finalize_grads()
try:
    model.finalize_grads()
except RuntimeError:
    checks += 1
if tp.all_reduce(np.array([checks]))[0] != 4 * N:
    raise AssertionError(f"rank {r}: bad input was accepted ({checks} of 4 refused here)")

# A model that does not fit the grid fails on every rank, before any communication
raised = 0
try:
    GPT(GPTConfig(n_layer=1, n_head=N + 1, n_embd=4 * (N + 1), block_size=4), grid)
except ValueError as exc:
    raised = int("not divisible by TP" in str(exc))
if tp.all_reduce(np.array([raised]))[0] != N:
    raise AssertionError("a model with heads not divisible by TP was accepted")
if r == 0:
    print(f"tensor parallel OK on {N} ranks")
