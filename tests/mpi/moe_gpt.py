"""The mixture-of-experts GPT on a grid against the single-device MoE GPT, float64 with dropout:
every gradient after the sums, the auxiliary losses and the routing statistics, and the
parameters after AdamW steps, through the pipeline executor the trainer uses.

The reference routes the groups of tokens the ranks route (``RoutingGroups``): each DP rank's rows
of each micro-batch, each CP rank's two chunks, each SP rank's positions. So with a capacity
factor it drops the same slots, and its balancing loss is the same mean over groups.

    run_mpi.sh -n 4 tests/mpi/moe_gpt.py EP TP CP PP [sp] [zero1] [capacity] [recompute] [zb-h1] [plant-bug]
"""

import sys

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.models.moe import RoutingGroups, step_statistics
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel import experts as ep_module
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.tensor import local_shard

ep, tp, cp, pp = (int(a) for a in sys.argv[1:5])
options = set(sys.argv[5:])
if "plant-bug" in options:  # combine with the wrong permutation: rows return to the wrong tokens
    ep_module.inverse = lambda order: np.arange(len(order))
minipar.set_default_dtype("float64")
comm = world()
dp = comm.size // (tp * cp * pp)
config = GPTConfig(n_layer=2 * pp, n_head=4, n_embd=16, block_size=16, vocab_size=64, dropout=0.1,
                   num_experts=4, moe_router_topk=2, moe_layer_freq=1 if pp == 1 else 2,
                   moe_expert_capacity_factor=1.0 if "capacity" in options else None,
                   moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
B, T, STEPS, M = 8, 16, 2, 2  # rows, length, steps, micro-batches
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
rng = np.random.default_rng(0)
batches = [(rng.integers(0, 64, (B, T)), rng.integers(0, 64, (B, T))) for _ in range(STEPS)]
errors = {}


def close(a, b, what, tol=1e-10):
    a, b = np.asarray(a, float), np.asarray(b, float)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30) if a.shape == b.shape else np.inf
    if not err < tol:
        raise AssertionError(f"rank {comm.rank} ({what}): relative error {err:.2e}, shapes {a.shape} {b.shape}")
    kind = what.split(" ")[0]
    errors[kind] = max(errors.get(kind, 0.0), err)


# the single device, routing the groups the grid routes, the whole batch in one forward
minipar.manual_seed(1)
serial = GPT(config, moe_routing=RoutingGroups(rows=B // (M * dp), cp=cp, sp=tp if "sp" in options else 1))
opt = AdamW(serial.parameters(), **HYPER)
for step, (x, y) in enumerate(batches):
    serial.rng.iteration = step
    serial.moe.reset()
    serial(x, y)[1].backward()
    if step == 0:
        grads = {n: p.grad.copy() for n, p in serial.named_parameters()}
        stats = step_statistics(serial)
    clip_grad_norm(serial.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
after = serial.state_dict()

# the same on the grid
minipar.manual_seed(1)
grid = ProcessGrid(tp=tp, pp=pp, cp=cp, ep=ep)
model = GPT(config, grid, sequence_parallel="sp" in options, recompute_granularity="full" if "recompute" in options else None)
opt = make_optimizer(model, grid, 1 if "zero1" in options else 0, **HYPER)
executor = PipelineExecutor(model, grid, "zb-h1" if "zb-h1" in options else "1f1b", micro_batches=M, optimizer=opt)
named = dict(model.named_parameters())


def update():
    opt.finish_gradients()
    if model.rng.iteration == 0:
        full = opt.full_gradients()  # ZeRO-1's pieces gathered: every rank's whole local gradients
        for n, p in named.items():
            close(full[id(p)].reshape(p.shape), local_shard(p, grads[n], grid), f"gradient of {n}")
    opt.clip_grad_norm(1.0)
    opt.step()


for step, (x, y) in enumerate(batches):
    model.rng.iteration = step
    model.moe.reset()
    executor.step(x, y, optimizer_step=update)
    if step == 0:
        got = step_statistics(model, comm)
        close(got["aux_loss"], stats["aux_loss"], "aux loss")
        close(got["z_loss"], stats["z_loss"], "z-loss")
        close(got["tokens_per_expert"], stats["tokens_per_expert"], "tokens per expert", tol=0.5)
        close(got["dropped"], stats["dropped"], "dropped slots", tol=0.5)
        if "capacity" in options and not stats["dropped"].any():
            raise AssertionError("the capacity factor dropped nothing: the test would not see dropping")
    opt.zero_grad()
for n, p in named.items():
    close(p.data, local_shard(p, after[n], grid), f"parameters {n} after {STEPS} steps")

worst = comm.all_reduce(np.array([errors[k] for k in sorted(errors)]), op="max")
if comm.rank == 0:
    print(f"MoE GPT EP={ep} TP={tp} CP={cp} PP={pp} DP={dp} {' '.join(sorted(options))}: OK; worst relative errors "
          + ", ".join(f"{k} {e:.1e}" for k, e in zip(sorted(errors), worst))
          + f"; aux loss {got['aux_loss']:.6f}, tokens per expert {got['tokens_per_expert'].tolist()}, "
            f"dropped {got['dropped'].tolist()}", flush=True)
