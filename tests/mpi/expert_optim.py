"""Every optimizer path with expert parameters against one device (float64), on 4 ranks.

A tiny model, a dense Linear, a mixture-of-experts MLP (E = 4, top-2, dropless) and a dense head,
trained 3 AdamW steps with clipping active under ZeRO 0, 1, 2 and 3 on the layouts

    DP=4 with EP=1, 2, 4;   TP=2 x DP=2 with EP=2;   CP=2 x DP=2 with EP=2

where each DP rank takes its rows of a global batch (and each CP rank its positions of them) and
scales its loss, the mean squared output, by its share of the tokens (under ZeRO 2 and 3 in two
micro-batches, each reduce-scattered from the gradient hooks; ZeRO-3 gathers the experts over
their own group around the MoE layer). "The same as one device":
the model built without a grid, the whole batch, ``minipar.optim.AdamW`` with the same clipping;
then every step's gradient norm and every parameter after the steps (experts by their global
names) agree. Replicas start from different weights: the optimizer's broadcasts must give every
rank its own experts' values (from the first rank holding the same experts) and the dense ones.

Then checkpoints: the EP=2 ZeRO-1 run's state is saved sharded and loaded onto EP=1 and EP=4,
under ZeRO 3, 2, 1 and 0: every parameter and Adam moment, by name, equals the reference's.

    --plant-bug   expert gradients summed (and experts broadcast) over all of DP: must fail
"""

import shutil
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

import minipar
import minipar.functional as F
import minipar.parallel.data
import minipar.parallel.zero
from minipar.checkpoint import sharded
from minipar.checkpoint.pieces import pieces
from minipar.comm import world
from minipar.models.moe import MoEMLP
from minipar.nn import Linear, Module
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.verify import rel_err

PLANT_BUG = "--plant-bug" in sys.argv
if PLANT_BUG:  # the code before experts: every gradient summed over the optimizer's DP x CP group
    minipar.parallel.data.gradient_group = minipar.parallel.zero.gradient_group = lambda p, grid, comm: comm

minipar.set_default_dtype("float64")
comm = world()
R = comm.rank
if comm.size != 4:
    sys.exit("expert_optim.py runs on 4 ranks")
H, E, K, B, T = 4, 4, 2, 8, 4  # hidden, experts, top-k, global batch rows, positions per row
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 1e-4  # below every step's norm: clipping scales every step
TOL = 1e-12
LAYOUTS = [dict(dp=4, ep=1), dict(dp=4, ep=2), dict(dp=4, ep=4), dict(tp=2, dp=2, ep=2), dict(cp=2, dp=2, ep=2),
           dict(cp=2, dp=2, ep=4), dict(cp=4, ep=2)]  # the last two: EP over CP ranks too (CP first)
failures = []


@dataclass
class Tiny:  # what MoEMLP reads of a config; a dataclass, as a checkpoint's index records it
    n_embd: int = H
    bias: bool = True
    n_layer: int = 2


class Net(Module):
    def __init__(self, grid=None):
        self.config, self.grid, self._runner = Tiny(), grid, None
        ep = grid.ep_group if grid is not None and grid.ep > 1 else None
        self.inp = Linear(H, H, std=0.5)
        self.moe = MoEMLP(self.config, E, K, ep=ep)
        self.head = Linear(H, H, std=0.5)

    def layers(self):
        return (("inp", self.inp), ("moe", self.moe), ("head", self.head))

    def units(self):  # ZeRO-3 gathers each layer's parameters around it: the MoE's router and experts apart
        return [(name, layer.parameters()) for name, layer in self.layers()]

    def wrap_units(self, runner):
        self._runner = runner

    def forward(self, x):
        for name, layer in self.layers():
            x = layer(x) if self._runner is None else self._runner(name, layer, x)
        return x


def batch(step):
    return np.random.default_rng(step).standard_normal((B, T, H))


def loss_of(y):
    """The rank's share of the mean squared output over the global batch: its mean times its
    share of the tokens, which is its sum over the global count."""
    return F.sum(y * y) * (1.0 / (B * T * H))


def reference():
    """The single-device run: each step's norm, then the parameters and Adam moments by name."""
    minipar.manual_seed(0)
    model = Net()
    opt = AdamW(model.parameters(), **HYPER)
    norms = []
    for step in range(3):
        loss_of(model(batch(step))).backward()
        norms.append(clip_grad_norm(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
    assert min(norms) > MAX_NORM, f"clipping must be active: norms {norms}"
    names = [n for n, _ in model.named_parameters()]
    state = {("param", n): p.data.copy() for n, p in model.named_parameters()}
    state.update({("exp_avg", n): m.copy() for n, m in zip(names, opt.m)})
    state.update({("exp_avg_sq", n): v.copy() for n, v in zip(names, opt.v)})
    return norms, state


def build(layout, stage):
    """The model on a grid, every rank starting elsewhere but the first rank holding each weight
    (edp index 0: DP x CP rank 0 for dense weights), which starts from the reference's values."""
    grid = ProcessGrid(**dict(dict(tp=1, pp=1, cp=1), **layout), world=comm)
    minipar.manual_seed(7 + R)
    model = Net(grid)
    if grid.ranks()["edp"] == 0:
        minipar.manual_seed(0)
        values = Net().state_dict()
        for name, p in model.named_parameters():
            p.data[...] = values[name]
    return grid, model, make_optimizer(model, grid, stage, bucket_bytes=300, **HYPER)


def mine(x, grid):
    """This rank's rows (by DP index) and positions (by CP index) of the global batch."""
    rows, positions = B // grid.dp, T // grid.cp
    return x[grid.dp_rank * rows : (grid.dp_rank + 1) * rows, grid.cp_rank * positions : (grid.cp_rank + 1) * positions]


def state_errors(model, opt, grid, state):
    """The worst relative error of every piece of this rank's training state against ``state``."""
    worst = 0.0
    for piece in pieces(model, opt, grid):
        want = state[(piece.kind, piece.name)]
        want = want if piece.flat is None else want.reshape(-1)[slice(*piece.flat)]
        worst = max(worst, rel_err(piece.array, want))
    return worst


def check(what, error):
    if not error <= TOL:
        failures.append(f"rank {R}: {what}: MISMATCH, relative error {error:.2e}")


def run(layout, stage, norms, state):
    grid, model, opt = build(layout, stage)
    errors = []
    for step in range(3):
        x = mine(batch(step), grid)
        for half in (x[: len(x) // 2], x[len(x) // 2 :]) if stage >= 2 else (x,):
            loss_of(model(half)).backward()
        errors.append(abs(opt.clip_grad_norm(MAX_NORM) - norms[step]) / norms[step])
        opt.step()
        opt.zero_grad()
    if stage == 0:
        opt.check_replicas()
    norm_err, param_err = max(errors), state_errors(model, opt, grid, state)
    name = " x ".join(f"{k.upper()}={v}" for k, v in layout.items()) + f", ZeRO-{stage}"
    check(f"{name}: gradient norm", norm_err)
    check(f"{name}: parameters and moments", param_err)
    worst = comm.all_reduce(np.array([norm_err, param_err]), op="max")
    if R == 0:
        print(f"{name:<28} norm rel err {worst[0]:.1e}   state rel err {worst[1]:.1e}", flush=True)
    return grid, model, opt


def reshard(grid, model, opt, state):
    """Save the EP=2 ZeRO-1 run, load it onto EP=1 and EP=4 under ZeRO 3, 2, 1 and 0."""
    path = np.zeros(256, np.uint8)
    if R == 0:
        made = tempfile.mkdtemp(prefix="expert_optim_").encode()
        path[: len(made)] = np.frombuffer(made, np.uint8)
    directory = bytes(comm.broadcast(path, root=0)).rstrip(b"\0").decode()
    try:
        saved = sharded.save(directory, 3, model, opt, grid, {})
        for layout in (dict(dp=4, ep=1), dict(dp=4, ep=4)):
            for stage in (3, 2, 1, 0):
                grid, model, opt = build(layout, stage)
                sharded.load(saved, model, opt, grid)
                error = state_errors(model, opt, grid, state)
                check(f"EP=2 checkpoint onto EP={layout['ep']}, ZeRO-{stage}", error)
                check(f"EP=2 checkpoint onto EP={layout['ep']}, ZeRO-{stage}: step count", abs(opt.step_count - 3))
                worst = comm.all_reduce(np.array([error]), op="max")[0]
                if R == 0:
                    print(f"EP=2 ZeRO-1 checkpoint -> EP={layout['ep']}, ZeRO-{stage}: state rel err {worst:.1e}",
                          flush=True)
    finally:
        comm.barrier()
        if R == 0:
            shutil.rmtree(directory, ignore_errors=True)


norms, state = reference()
if PLANT_BUG:
    run(dict(dp=4, ep=2), 0, norms, state)
else:
    runs = {(tuple(layout.items()), stage): run(layout, stage, norms, state) for layout in LAYOUTS for stage in (0, 1, 2, 3)}
    reshard(*runs[((("dp", 4), ("ep", 2)), 1)], state)
failed = comm.all_reduce(np.array([len(failures)]))[0]
for line in failures[:5]:
    print(line, flush=True)
comm.barrier()
if R == 0:
    print("expert optimizers FAILED on 4 ranks" if failed else "expert optimizers OK on 4 ranks", flush=True)
sys.exit(1 if failed else 0)
