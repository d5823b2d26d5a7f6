"""The whole GPT with context parallelism against the single-device GPT, float64 with dropout: the
logits of each rank's positions (without a pipeline), every gradient of the first step (summed over
DP x CP) and the parameters after AdamW steps, through the pipeline executor the trainer uses.

    run_mpi.sh -n 4 tests/mpi/context_gpt.py CP TP COMM [sp] [zero1 | zero3] [pp2] [selective | full]
                                             [SCHEDULE=1f1b] [M=PP] [ignore] [eval]

``full``: whole-block recomputation (the ring runs again in backward); ``M=4``: four micro-batches
(the ring's messages of several micro-batches interleave on a pipeline); ``ignore``: targets of -1
at the edges of the chunks and one whole chunk ignored; ``eval``: the evaluation loss too.
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

cp, tp, comm_type = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
options = {a for a in sys.argv[4:] if "=" not in a}
values = dict(a.split("=", 1) for a in sys.argv[4:] if "=" in a)
pp = 2 if "pp2" in options else 1
schedule, M = values.get("SCHEDULE", "1f1b"), int(values.get("M", pp))
v = 2 if schedule in ("interleaved", "zb-v") else 1
minipar.set_default_dtype("float64")
comm = world()
dp = comm.size // (cp * tp * pp)
config = GPTConfig(n_layer=2 * pp * v, n_head=4, n_embd=16, block_size=16, vocab_size=64, dropout=0.1)
B, T, STEPS, HYPER = 4 * M * dp, 16, 2, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
rng = np.random.default_rng(0)
batches = [(rng.integers(0, 64, (B, T)), rng.integers(0, 64, (B, T))) for _ in range(STEPS)]
if "ignore" in options:  # -1 on both sides of every chunk edge, and the whole of the last chunk of row 0
    c = T // (2 * cp)
    for _, y in batches:
        y[:, c - 1 :: c] = -1
        y[:, c :: c] = -1
        y[0, T - c :] = -1


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
serial.eval()
eval_loss = float(serial(*batches[0])[1].data)

# the same on the grid
minipar.manual_seed(1)
grid = ProcessGrid(tp=tp, pp=pp, cp=cp)
recompute = "full" if "full" in options else "selective" if "selective" in options else None
model = GPT(config, grid, sequence_parallel="sp" in options, cp_comm_type=comm_type, virtual_stages=v,
            recompute_granularity=recompute, pipeline_shape="v" if schedule == "zb-v" else "round-robin")
stage = 3 if "zero3" in options else 1 if "zero1" in options else 0
opt = make_optimizer(model, grid, stage, **HYPER)
executor = PipelineExecutor(model, grid, schedule, micro_batches=M, optimizer=opt)
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
if "eval" in options:
    model.eval()
    record = executor.evaluate(*batches[0])  # each last-stage rank's share: their sum is the mean
    share = record.loss if model.chunks[-1] == model.n_chunks - 1 else 0.0
    close(comm.all_reduce(np.array([share]))[0] / tp, eval_loss, "evaluation loss")  # TP ranks: equal shares
    checked.append("evaluation loss")

print(f"rank {comm.rank}: context parallel CP={cp} TP={tp} {comm_type} {' '.join(sys.argv[4:])} OK "
      f"({', '.join(checked + ['parameters'])})", flush=True)
