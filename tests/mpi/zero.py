"""ZeRO stages 1, 2 and 3 against the single-device run (float64): gradients, parameters after
AdamW steps with weight decay, dropout and gradient clipping.

    run_mpi.sh -n 4 tests/mpi/zero.py
"""

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.data import scale_loss, split_batch
from minipar.parallel.zero import ZeroAdamW
from minipar.parallel.zero3 import Zero3

minipar.set_default_dtype("float64")
world()
grid = ProcessGrid(tp=1, pp=1)
dp = grid.dp_group
N, r = dp.size, dp.rank
config = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab_size=13, dropout=0.1)
hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)


def close(a, b, what, tol=1e-11):
    if not np.allclose(a, b, rtol=tol, atol=tol):
        raise AssertionError(f"rank {r}: {what}: max error {np.abs(np.asarray(a) - np.asarray(b)).max()}")


for stage in (1, 2, 3):
    for bucket_bytes in ((1, 700) if stage < 3 else (None,)):  # 1: a group per parameter
        minipar.manual_seed(0)
        serial = GPT(config)
        minipar.manual_seed(7 + r)  # different weights on every rank: ZeRO must broadcast rank 0's
        model = GPT(config, grid)  # the grid tells dropout which rows of the batch are this rank's
        model.load_state_dict(serial.state_dict()) if r == 0 else None
        model.rng.set_state(serial.rng.state())
        names = [n for n, _ in serial.named_parameters()]
        if stage == 3:
            zero = Zero3(model, dp, **hyper)
        else:
            zero = ZeroAdamW(model, dp, stage, bucket_bytes=bucket_bytes, **hyper)
        opt = AdamW(serial.parameters(), **hyper)
        for step in range(3):
            rng = np.random.default_rng(step)
            x, y = rng.integers(0, 13, (2 * N, 6)), rng.integers(0, 13, (2 * N, 6))
            y[0, :3] = -1  # ignored targets on rank 0 only
            start = serial.rng.state()
            _, loss_s = serial(x, y)
            loss_s.backward()
            grads_s = {n: p.grad.copy() for n, p in serial.named_parameters()}
            norm_s = clip_grad_norm(serial.parameters(), 0.5)
            model.rng.set_state(start)
            xs, ys = split_batch(x, y, dp)
            _, loss = model(xs, ys)
            scale_loss(loss, ys, dp).backward()
            if step == 0:
                grads = zero.full_gradients()
                for name, p in zip(names, model.parameters()):
                    close(grads[id(p)], grads_s[name].reshape(-1), f"stage {stage} grad {name}")
            close(zero.clip_grad_norm(0.5), norm_s, f"stage {stage} gradient norm")
            zero.step()
            zero.zero_grad()
            opt.step()
            opt.zero_grad()
        state = zero.full_state_dict(model.named_parameters()) if stage == 3 else model.state_dict()
        for name in names:
            close(state[name], serial.state_dict()[name], f"stage {stage} buckets {bucket_bytes} parameter {name}")
if r == 0:
    print(f"zero OK on {N} ranks")
