"""PipeDream-2BW against its rule on one device (float64, dropout on): every step's loss and the
parameters after five batches equal a single-device loop in which each step's gradient is taken
at the previous version's weights,

    W(t+1) = W(t) - AdamW(grad f(W(t-1))),   W(-1) = W(0),

and differ from synchronous training (the same loop with grad f(W(t))), which 1F1B equals. Each step
has its own learning rate and its gradients are clipped to a global norm, as the trainer's are
(the update is made a batch after its step: with the rate and norm of its own). The stream is cut
once (a drain after batch 2, as before a checkpoint) and an evaluation runs while a batch is in
flight (its messages must not meet the stream's). The stash holds one more copy of the rank's
parameters, and one of a batch's gradients (set aside until its update), counted. And no stage
waits for another at a step: while the stream runs, no blocking collective between stages (the
pipeline's group, the tied embedding's) is called. And each call posts every receive but the
first of each kind (activations, gradients) before it waits for the one before it of that kind,
and tests each before its own wait.

    run_mpi.sh -n 4 tests/mpi/pipedream.py --pp 4 --m 4

``--plant-bug``: the step updates in place the arrays the in-flight forwards read, so those micro-
batches run their backward on the next version: the parameters must then be found wrong.
"""

import argparse
import itertools

import numpy as np

import minipar
from minipar.autograd import no_grad
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.pipedream import PipeDream2BW
from minipar.parallel.pipeline.weight_stash import WeightStash
from minipar.verify import rel_err

p = argparse.ArgumentParser()
p.add_argument("--pp", type=int, required=True)
p.add_argument("--m", type=int, default=4)
p.add_argument("--recompute", action="store_true")
p.add_argument("--plant-bug", action="store_true")
args = p.parse_args()

minipar.set_default_dtype("float64")
grid = ProcessGrid(tp=1, pp=args.pp)
config = GPTConfig(n_layer=args.pp, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.1)
hyper = dict(lr=2e-2, weight_decay=0.1)
STEPS, FOLLOWED = 5, (True, True, False, True, False)  # batch 2 drains the pipeline; the last must
RATES, MAX_NORM = [2e-2 * (1 - 0.15 * t) for t in range(STEPS)], 0.9  # the norms are 0.7-1.1
rank = world().rank
data = np.random.default_rng(0)
batches = [tuple(data.integers(0, config.vocab_size, (2 * args.m * grid.dp, config.block_size)) for _ in "xy")
           for _ in range(STEPS)]
x_eval = data.integers(0, config.vocab_size, (2 * args.m * grid.dp, config.block_size))


def single_device(delay):
    """One device: each step's gradient at the weights ``delay`` versions back (0: synchronous).
    Returns the losses, the evaluation loss after the first step and the final parameters."""
    minipar.manual_seed(3)
    model = GPT(config)
    opt = AdamW(model.parameters(), **hyper)
    versions = [{n: q.data.copy() for n, q in model.named_parameters()}] * (delay + 1)  # W(-1) = W(0)
    losses = []
    for t, (x, y) in enumerate(batches):
        for n, q in model.named_parameters():  # the version the gradient is taken at
            q.data[...] = versions[0][n]
        model.rng.iteration = t
        loss = model(x, y)[1]
        loss.backward()
        losses.append(loss.item())
        for n, q in model.named_parameters():  # the newest version, which the update moves
            q.data[...] = versions[-1][n]
        clipped.append(clip_grad_norm(model.parameters(), MAX_NORM) > MAX_NORM)
        opt.lr = RATES[t]
        opt.step()
        opt.zero_grad()
        versions = versions[1:] + [{n: q.data.copy() for n, q in model.named_parameters()}]
        if t == 0:
            model.eval()
            with no_grad():
                evaluated = model(x_eval, x_eval)[1].item()
            model.train()
    return losses, evaluated, model.state_dict()


clipped = []
delayed, synchronous = single_device(1), single_device(0)
assert any(clipped[:STEPS]), clipped  # the delayed run's steps: clipping takes part
minipar.manual_seed(3)
model = GPT(config, grid)
opt = WeightStash(make_optimizer(model, grid, 0, **hyper), plant_bug=args.plant_bug, max_norm=MAX_NORM)
run = PipeDream2BW(model, grid, args.m, opt, recompute=args.recompute)
mine = dict(model.named_parameters())
waited = []  # blocking collectives between stages called inside a step of the stream


def watched(comm):
    for name in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "barrier"):
        setattr(comm, name, lambda *a, _call=getattr(comm, name), _name=name, **k: (waited.append(_name), _call(*a, **k))[1])


for group in (grid.pp_group, model.embedding_group):
    if group is not None and group.size > 1:
        watched(group)
clock, receives = itertools.count(), []  # this call's receives: kind (a tag's parity), posted, taken


def posted_ahead(comm):
    irecv = comm.irecv

    def post(out, source, tag=0):
        request, entry = irecv(out, source, tag), {"kind": tag % 2, "up": next(clock)}
        receives.append(entry)
        wait, test = request.wait, request.test
        request.wait = lambda: (entry.update(taken=next(clock)), wait())[1]
        request.test = lambda: (entry.setdefault("tested", next(clock)), test())[1]
        return request

    comm.irecv = post


if grid.pp > 1:
    posted_ahead(grid.pp_group)
for t, (x, y) in enumerate(batches):
    model.rng.iteration = t
    opt.lr = RATES[t]
    following = batches[t + 1] if FOLLOWED[t] else None
    receives.clear()  # (an evaluation's, run between two calls, are its own run's)
    record = run.step(x, y, optimizer_step=opt.step, following=following)
    assert not waited, f"rank {rank} step {t}: {waited} between stages"
    for kind in (0, 1):
        mine_of_kind = [r for r in receives if r["kind"] == kind]
        assert all("taken" in r for r in mine_of_kind), f"rank {rank} step {t}: a receive posted and not taken"
        late = [b for a, b in zip(mine_of_kind, mine_of_kind[1:]) if b["up"] > a["taken"]]
        assert not late, f"rank {rank} step {t}: {len(late)} receives posted after the one before was waited on"
        # and tested between instructions before their wait: MPI moves them only inside its calls
        idle = [r for r in mine_of_kind[1:] if not r.get("tested", r["taken"]) < r["taken"]]
        assert not idle, f"rank {rank} step {t}: {len(idle)} receives posted ahead never tested before their wait"
    opt.zero_grad()
    if record.loss is not None:  # the last stage's share of the batch: summed over DP
        loss = grid.dp_group.all_reduce(np.array([record.loss]))[0] if grid.dp > 1 else record.loss
        err = rel_err(loss, delayed[0][t])
        assert err < 1e-12, f"rank {rank} step {t}: loss {loss} vs {delayed[0][t]}, off by {err:.1e}"
    if t == 0:  # batch 1 is in flight: an evaluation on the newest weights, W(1)
        model.eval()
        evaluated = run.evaluate(x_eval, x_eval).loss
        model.train()
        if evaluated is not None:
            evaluated = grid.dp_group.all_reduce(np.array([evaluated]))[0] if grid.dp > 1 else evaluated
            assert rel_err(evaluated, delayed[1]) < 1e-12, f"rank {rank}: evaluation {evaluated} vs {delayed[1]}"

worst, apart = 0.0, 0.0
for n, q in mine.items():
    err = rel_err(q.data, delayed[2][n])
    worst, apart = max(worst, err), max(apart, rel_err(q.data, synchronous[2][n]))
    assert err < 1e-10, f"rank {rank}: parameter {n} off by {err:.1e} after {STEPS} steps"
assert apart > 1e-3, f"rank {rank}: PipeDream-2BW equals synchronous training ({apart:.1e} apart)"
held = sum(q.data.nbytes for q in mine.values())  # the stash: the weights again, and a batch's gradients
assert opt.state_bytes()["stash"] == opt.stash_bytes() == 2 * held, (opt.state_bytes(), held)
print(f"rank {rank}: pipedream-2bw OK (max error vs the delayed rule {worst:.1e}, "
      f"{apart:.1e} from synchronous, stash {opt.stash_bytes()} bytes)", flush=True)
