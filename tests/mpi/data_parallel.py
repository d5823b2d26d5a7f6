"""DataParallelAdamW against the single-device run (float64): several bucket sizes, gradient
accumulation, ignored targets spread unevenly over the ranks, an uneven batch, replica checks.

    run_mpi.sh -n 4 tests/mpi/data_parallel.py
"""

import contextlib

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW
from minipar.parallel import ProcessGrid
from minipar.parallel.data import DataParallelAdamW, scale_loss, token_count
from minipar.parallel.recompute import checkpoint

minipar.set_default_dtype("float64")
comm = world()
grid = ProcessGrid(tp=1, pp=1)
dp = grid.dp_group
N, r = dp.size, dp.rank
config = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab_size=13, dropout=0.1)


def close(a, b, what, tol=1e-11):
    if not np.allclose(a, b, rtol=tol, atol=tol):
        raise AssertionError(f"rank {r}: {what}: max error {np.abs(np.asarray(a) - np.asarray(b)).max()}")


def share(model, xs, ys):
    """This rank's share of the mean over every rank's counted targets: its losses summed over the
    count the ranks add up (one all-reduce)."""
    logits, _ = model(xs)
    return scale_loss(model.loss(logits, ys, reduction="sum"), token_count(ys, comm=dp))


def batch(seed, rows=2 * N, ignore=False):
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, 13, (rows, 6)), rng.integers(0, 13, (rows, 6))
    if ignore:  # rank 0's rows lose many targets, the others few: per-rank means would be wrong
        y[: rows // N, :4] = -1
        y[-1, 0] = -1
    return x, y


def models(bucket_bytes):
    minipar.manual_seed(0)
    serial = GPT(config)
    minipar.manual_seed(1 + r)  # different on every rank: DataParallelAdamW must broadcast rank 0's
    replica = GPT(config, grid)
    return serial, replica, DataParallelAdamW(replica, dp, bucket_bytes=bucket_bytes, lr=1e-2, eps=1e-5)


# bucket sizes: smaller than any parameter (one bucket per parameter), medium, everything in one
for bucket_bytes in (1, 2048, 1 << 30):
    serial, replica, ddp = models(bucket_bytes)
    if bucket_bytes == 1 and len(ddp.buckets) != len(replica.parameters()):
        raise AssertionError("a bucket smaller than every parameter should hold one parameter each")
    # the replicas now hold rank 0's weights: give rank 0 the single-device model's weights
    state = serial.state_dict()
    replica.load_state_dict(state)
    ddp.check_replicas()
    opt_s = AdamW(serial.parameters(), lr=1e-2, eps=1e-5)
    # a backward thrown away: its buckets' sums were started and never waited for; zero_grad lets
    # them end (MPI still writes into the buckets) before the next step starts them again
    xs, ys = ddp.split_batch(*batch(9))
    share(replica, xs, ys).backward()
    ddp.zero_grad()
    for step in range(2):
        x, y = batch(10 + step, ignore=True)
        serial.rng.set_state(replica.rng.state())
        _, loss_s = serial(x, y)
        loss_s.backward()
        xs, ys = ddp.split_batch(x, y)
        share(replica, xs, ys).backward()
        ddp.finish_gradients()
        for (name, p_s), p in zip(serial.named_parameters(), replica.parameters()):
            close(p.grad, p_s.grad, f"bucket {bucket_bytes} step {step} grad {name}")
        opt_s.step()
        ddp.step()
        opt_s.zero_grad()
        ddp.zero_grad()
    for (name, p_s), p in zip(serial.named_parameters(), replica.parameters()):
        close(p.data, p_s.data, f"bucket {bucket_bytes} parameter {name}")
    ddp.check_replicas()

# recomputation inside data parallelism: the last block and the embeddings are recomputed; the tied
# embedding is used inside a recomputed region (embed) and outside it (the head). Every parameter's
# hook must fire once, when all of its gradient is in: one bucket for all, so that a hook firing
# early or twice would start the all-reduce before the first layers' gradients exist.
serial, replica, ddp = models(1 << 30)
replica.load_state_dict(serial.state_dict())
units = dict(replica.units())
last = f"h.{len(replica.transformer.h) - 1}"
replica.wrap_units(lambda name, run, x: checkpoint(run, x, units[name], rng=replica.rng)
                   if name in ("embed", last) else run(x))
x, y = batch(40)
serial.rng.set_state(replica.rng.state())
serial(x, y)[1].backward()
xs, ys = ddp.split_batch(x, y)
share(replica, xs, ys).backward()
ddp.finish_gradients()
for (name, p_s), p in zip(serial.named_parameters(), replica.parameters()):
    close(p.grad, p_s.grad, f"recomputed embedding grad {name}")
# misuse is refused: a backward after finish_gradients() without zero_grad(), gradients moved out of
# the buckets by an optimizer's zero_grad(), a second backward outside no_sync() (its gradients would
# miss the sums the first one started); a second finish_gradients() changes nothing
before = [p.grad.copy() for p in replica.parameters()]
ddp.finish_gradients()
close(np.concatenate([p.grad.ravel() for p in replica.parameters()]), np.concatenate([b.ravel() for b in before]),
      "a second finish_gradients")
refused = 0
try:
    replica(xs, ys)[1].backward()
except RuntimeError:
    refused += 1
ddp.zero_grad()
replica.zero_grad()  # model.zero_grad(), not the optimizer's: the buckets lose their views
try:
    replica(xs, ys)[1].backward()
except RuntimeError:
    refused += 1
ddp.zero_grad()  # the buckets' views back
replica(xs, ys)[1].backward()
try:
    replica(xs, ys)[1].backward()
except RuntimeError as e:
    refused += "reported complete twice" in str(e)
ddp.zero_grad()  # the first backward's sums are still running: let them end
if refused != 3:
    raise AssertionError(f"rank {r}: misuse of DataParallelAdamW was accepted")

# gradient accumulation: two micro-batches, the all-reduce only after the second
serial, replica, ddp = models(4096)
replica.load_state_dict(serial.state_dict())
x, y = batch(20, rows=4 * N)
sent = dp.stats.by_op["all_reduce"].calls
for half in (slice(0, 2 * N), slice(2 * N, 4 * N)):
    serial.rng.set_state(replica.rng.state())
    _, loss_s = serial(x[half], y[half])
    (loss_s * 0.5).backward()
    xs, ys = ddp.split_batch(x[half], y[half])
    with ddp.no_sync() if half.start == 0 else contextlib.nullcontext():
        (share(replica, xs, ys) * 0.5).backward()
    if half.start == 0 and dp.stats.by_op["all_reduce"].calls != sent + 1:  # only the count of targets
        raise AssertionError("no_sync still sent gradients")
ddp.finish_gradients()
for (name, p_s), p in zip(serial.named_parameters(), replica.parameters()):
    close(p.grad, p_s.grad, f"accumulated grad {name}")

# a batch that does not split evenly is refused on every rank
try:
    ddp.split_batch(*batch(30, rows=2 * N + 1))
    raise AssertionError("an uneven batch was accepted")
except ValueError as exc:
    assert "multiple of DP" in str(exc)

# a replica that drifts is noticed
if N > 1:
    if r == N - 1:
        replica.parameters()[0].data[0, 0] += 1e-12
    try:
        ddp.check_replicas()
        raise AssertionError("diverged replicas were not noticed")
    except RuntimeError:
        pass
if r == 0:
    print(f"data parallel OK on {N} ranks")
