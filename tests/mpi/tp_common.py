"""What the tensor-parallel scripts (``tensor_parallel.py``, ``tensor_parallel_edges.py``) share:
every rank in one TP group, float64, and the pieces that hold a rank's part against one device."""

import numpy as np

import minipar
from minipar import Tensor
from minipar.comm import world
from minipar.parallel import ProcessGrid
from minipar.parallel import tensor as T

minipar.set_default_dtype("float64")
grid = ProcessGrid(tp=world().size, pp=1)
tp = grid.tp_group
N, r = tp.size, tp.rank


def data(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape)


def close(a, b, what, tol=1e-11):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or not np.allclose(a, b, rtol=tol, atol=tol):
        err = np.abs(a - b).max() if a.shape == b.shape else f"shapes {a.shape} vs {b.shape}"
        raise AssertionError(f"rank {r}: {what}: {err}")


def part(x, axis, chunks=1):
    """This rank's shard of x along axis, each of ``chunks`` blocks split separately."""
    blocks = np.split(x, chunks, axis=axis)
    return np.concatenate([np.split(b, N, axis=axis)[r] for b in blocks], axis=axis)


def leaf(a):
    return Tensor(a, requires_grad=True)


def twins(make_serial, make_parallel, seed=0):
    minipar.manual_seed(seed)
    serial = make_serial()
    minipar.manual_seed(seed)
    return serial, make_parallel()


def gpt_matches(serial, model, ids, targets, what, tol=1e-11):
    """One forward and backward of the serial GPT and of its twin on the grid: the logits, the
    loss and every gradient (the model's finished, gathered whole) agree."""
    logits_s, loss_s = serial(ids, targets)
    loss_s.backward()
    logits, loss = model(ids, targets)
    loss.backward()
    model.finalize_grads()
    close(model.gather_logits(logits).data, logits_s.data, f"GPT logits {what}", tol)
    close(loss.item(), loss_s.item(), f"GPT loss {what}", tol)
    grads = T.full_parameters(model, "grad")
    for name, p in serial.named_parameters():
        close(grads[name], p.grad, f"GPT grad {name} {what}", tol)
