"""The whole GPT with context parallelism against the single-device GPT, float64 with dropout: the
logits of each rank's positions, every gradient (summed over DP x CP) and the parameters after
AdamW steps, through the pipeline executor the trainer uses.

    run_mpi.sh -n 4 tests/mpi/context_gpt.py CP TP COMM [sp] [zero1 | zero3] [pp2] [selective]
"""

import sys

import numpy as np

import minipar
from minipar.backend import to_numpy
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.tensor import local_shard
from minipar.rng import rows_of

cp, tp, comm_type, options = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], set(sys.argv[4:])
pp = 2 if "pp2" in options else 1
minipar.set_default_dtype("float64")
comm = world()
config = GPTConfig(n_layer=2, n_head=4, n_embd=16, block_size=16, vocab_size=64, dropout=0.1)
B, T, STEPS, HYPER = 4, 16, 2, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
rng = np.random.default_rng(0)
batches = [(rng.integers(0, 64, (B, T)), rng.integers(0, 64, (B, T))) for _ in range(STEPS)]


def close(a, b, what, tol=1e-10):
    a, b = np.asarray(a), np.asarray(b)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30) if a.shape == b.shape else np.inf
    if not err < tol:
        raise AssertionError(f"rank {comm.rank} ({what}): relative error {err:.2e}, shapes {a.shape} {b.shape}")


# the single device
minipar.manual_seed(1)
serial = GPT(config)
opt = AdamW(serial.parameters(), **HYPER)
grads, logits0 = None, None
for step, (x, y) in enumerate(batches):
    serial.rng.iteration = step
    logits, loss = serial(x, y)
    loss.backward()
    if step == 0:
        grads, logits0 = {n: p.grad.copy() for n, p in serial.named_parameters()}, logits.data
    clip_grad_norm(serial.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
after = serial.state_dict()

# the same on the grid
minipar.manual_seed(1)
grid = ProcessGrid(tp=tp, pp=pp, cp=cp)
model = GPT(config, grid, sequence_parallel="sp" in options, cp_comm_type=comm_type,
            recompute_granularity="selective" if "selective" in options else None)
stage = 3 if "zero3" in options else 1 if "zero1" in options else 0
opt = make_optimizer(model, grid, stage, **HYPER)
executor = PipelineExecutor(model, grid, "1f1b", micro_batches=pp, optimizer=opt)
named = dict(model.named_parameters())
checked = []


def update():
    opt.finish_gradients()
    if model.rng.iteration == 0 and not stage:  # ZeRO holds summed pieces, not p.grad
        for n, p in named.items():
            close(p.grad, local_shard(p, grads[n], grid), f"gradient of {n}")
        checked.append("gradients")
    opt.clip_grad_norm(1.0)
    opt.step()


if pp == 1:  # the first step's logits (before any step) of this rank's rows and positions, whole vocabulary
    model.rng.iteration = 0
    rows = rows_of(B, (0, 1), (grid.dp_rank, grid.dp))
    with model.rng.at(rows=rows):
        logits, _ = model(batches[0][0][to_numpy(rows)])  # the batches stay on the host
    positions = model.context_positions(T)
    close(model.gather_logits(logits).data, logits0[rows][:, positions], "logits")
    checked.append("logits")
for step, (x, y) in enumerate(batches):
    model.rng.iteration = step
    executor.step(x, y, optimizer_step=update)
    opt.zero_grad()
final = opt.full_state_dict() if stage == 3 else {n: p.data for n, p in named.items()}  # ZeRO-3 keeps pieces
for n, p in named.items():
    close(final[n], local_shard(p, after[n], grid), f"{n} after {STEPS} steps")

print(f"rank {comm.rank}: context parallel CP={cp} TP={tp} {comm_type} {' '.join(sorted(options))} OK "
      f"({', '.join(checked + ['parameters'])})", flush=True)
