"""ZeRO stages 1, 2 and 3 against the single-device run (float64): gradients, parameters after
AdamW steps with weight decay, dropout, gradient clipping, ignored targets spread unevenly over
ranks and micro-batches, two micro-batches accumulated per step, and sizes that need padding.

    run_mpi.sh -n 4 tests/mpi/zero.py
"""

import numpy as np

import minipar
import minipar.functional as F
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.nn import Linear, Module
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.data import scale_loss, split_batch, token_count
from minipar.parallel.zero1 import ZeRO1
from minipar.parallel.zero2 import ZeRO2
from minipar.parallel.zero3 import ZeRO3
from minipar.rng import rows_of

minipar.set_default_dtype("float64")
world()
grid = ProcessGrid(tp=1, pp=1)
dp = grid.dp_group
N, r = dp.size, dp.rank
# hidden 6 and vocabulary 13: most parameter sizes do not divide by 4, so groups are padded
config = GPTConfig(n_layer=2, n_head=2, n_embd=6, block_size=6, vocab_size=13, dropout=0.1)
hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)


def close(a, b, what, tol=1e-11):
    if not np.allclose(a, b, rtol=tol, atol=tol):
        raise AssertionError(f"rank {r}: {what}: max error {np.abs(np.asarray(a) - np.asarray(b)).max()}")


def make(stage, bucket_bytes):
    minipar.manual_seed(0)
    serial = GPT(config)
    minipar.manual_seed(7 + r)  # other weights and dropout seed on every rank: ZeRO must broadcast rank 0's
    model = GPT(config, grid)  # the grid tells dropout which rows of the batch are this rank's
    if r == 0:
        model.load_state_dict(serial.state_dict())
        model.rng.set_state(serial.rng.state())
    if stage == 3:
        return serial, model, ZeRO3(model, dp, **hyper)
    return serial, model, {1: ZeRO1, 2: ZeRO2}[stage](model, dp, bucket_bytes=bucket_bytes, **hyper)


for stage in (1, 2, 3):
    for bucket_bytes in ((1, 700) if stage < 3 else (None,)):  # 1: a group per parameter
        serial, model, zero = make(stage, bucket_bytes)
        names = [n for n, _ in serial.named_parameters()]
        opt = AdamW(serial.parameters(), **hyper)
        for step in range(3):
            rng = np.random.default_rng(step)
            x, y = rng.integers(0, 13, (4 * N, 6)), rng.integers(0, 13, (4 * N, 6))
            y[0, :3] = y[-1, :5] = -1  # ignored targets: uneven over ranks and over micro-batches
            serial.rng.iteration = model.rng.iteration = step  # keys the dropout masks
            _, loss_s = serial(x, y)
            loss_s.backward()
            grads_s = {n: p.grad.copy() for n, p in serial.named_parameters()}
            norm_s = clip_grad_norm(serial.parameters(), 0.5)
            total = token_count(y)
            came = dict(zero.unit_gathers) if stage == 3 else None
            for i, half in enumerate((slice(0, 2 * N), slice(2 * N, 4 * N))):  # two micro-batches
                xs, ys = split_batch(x[half], y[half], dp)
                with model.rng.at(rows=rows_of(4 * N, (i, 2), (r, N))):  # their rows in the batch
                    logits, _ = model(xs)
                    scale_loss(model.loss(logits, ys, reduction="sum"), total).backward()
            if stage == 3:  # from the second step on, every unit but the step's first was prefetched
                came = {k: zero.unit_gathers[k] - came[k] for k in came}
                # two micro-batches, each gathering every unit for its forward and all but the embeddings
                # (lookups: their backward reads no table) for its backward
                units = 2 * (2 * len(model.units()) - 1)
                want = {"prefetched": 0, "on demand": units} if step == 0 else {"prefetched": units - 1, "on demand": 1}
                if came != want:
                    raise AssertionError(f"rank {r}: step {step}: ZeRO-3 gathers {came}, expected {want}")
            if step == 0:
                grads = zero.full_gradients()
                for name, p in zip(names, model.parameters()):
                    close(grads[id(p)], grads_s[name].reshape(-1), f"stage {stage} grad {name}")
            close(zero.clip_grad_norm(0.5), norm_s, f"stage {stage} gradient norm")
            zero.step()
            zero.zero_grad()
            opt.step()
            opt.zero_grad()
        state = zero.full_state_dict()
        for name in names:
            close(state[name], serial.state_dict()[name], f"stage {stage} buckets {bucket_bytes} parameter {name}")


class HalfUsed(Module):
    """Two layers, the second never used: its group still has to be sent (and zero). With
    ``both`` (a later micro-batch) the unused layer runs on the used one's output: the group's
    gradients then come in across micro-batches, and those after it was first sent must follow."""

    def __init__(self):
        self.used, self.unused = Linear(5, 5), Linear(5, 5)

    def forward(self, x, both=False):
        return self.unused(self.used(x)) if both else self.used(x)


for stage in (1, 2):
    minipar.manual_seed(3)
    plain, sharded = HalfUsed(), HalfUsed()
    sharded.load_state_dict(plain.state_dict())
    zero = {1: ZeRO1, 2: ZeRO2}[stage](sharded, dp, bucket_bytes=1 << 20, **hyper)  # one group for everything
    x = np.random.default_rng(4).standard_normal((2 * N, 5))
    F.sum(plain(x) ** 2).backward()
    F.sum(sharded(split_batch(x, x, dp)[0]) ** 2).backward()
    grads = zero.full_gradients()
    close(grads[id(sharded.used.weight)], plain.used.weight.grad.reshape(-1), f"stage {stage} used")
    close(grads[id(sharded.unused.weight)], np.zeros(25), f"stage {stage} unused")
    zero.zero_grad()
    plain.zero_grad()
    for both in (False, True):  # two micro-batches: the second layer unused in the first only
        F.sum(plain(x, both) ** 2).backward()
        F.sum(sharded(split_batch(x, x, dp)[0], both) ** 2).backward()
    grads = zero.full_gradients()
    for name, p in sharded.named_parameters():
        close(grads[id(p)], dict(plain.named_parameters())[name].grad.reshape(-1), f"stage {stage} 2 micro-batches {name}")

# misuse is refused: a backward after the step's gradients were summed, bad hyperparameters
serial, model, zero = make(2, 700)
_, loss = model(*split_batch(np.zeros((N, 6), np.int64), np.zeros((N, 6), np.int64), dp))
loss.backward()
zero.step()
refused = 0
try:
    model(*split_batch(np.zeros((N, 6), np.int64), np.zeros((N, 6), np.int64), dp))[1].backward()
except RuntimeError:
    refused += 1
try:
    ZeRO1(model, dp, lr=-1.0)
except ValueError:
    refused += 1
if refused != 2:
    raise AssertionError(f"rank {r}: misuse was accepted")
if r == 0:
    print(f"zero OK on {N} ranks")
