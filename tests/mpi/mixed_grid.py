"""Mixed precision on grids beyond plain data parallelism, 4 ranks, through the pipeline executor
(the trainer's path: its loss scaling, the MoE auxiliary losses' scale, the step instruction):

    TP=2 x DP=2 (sequence parallel), PP=2 x DP=2, TP=2 x PP=2, CP=2 x DP=2, DP=4 with EP=2 (MoE)

For each layout and the ZeRO stages it allows:

* the float64 policy with a constant loss scale of 2^10 (a power of two: scaling and unscaling are
  exact) and clipping active equals the plain float64 run of the same layout bit for bit: every
  step's norm, the unscaled gradients, the parameters and Adam's moments. So the scale reaches
  every gradient (TP parts, pipeline stages, experts, the auxiliary losses) and is divided out once;
* fp16 with an overflow planted after the sums in one rank's gradients (an expert's, with EP):
  every rank skips the step, its state bit-identical, the scale halved everywhere, and the next
  step is taken on every rank.

    run_mpi.sh -n 4 tests/mpi/mixed_grid.py [layout index ...] [-v]
"""

import faulthandler
import hashlib
import sys

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.precision import ConstantLossScaler, DynamicLossScaler, Policy

comm = world()
if comm.size != 4:
    sys.exit("mixed_grid.py runs on 4 ranks")
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 1e-3  # below every step's norm: clipping scales every step
LAYOUTS = [(dict(tp=2, dp=2), dict(sequence_parallel=True), (0, 1)),
           (dict(pp=2, dp=2), {}, (0, 1)),
           (dict(tp=2, pp=2, dp=1), {}, (0, 1)),
           (dict(cp=2, dp=2), {}, (0, 1, 2, 3)),
           (dict(dp=4, ep=2), {}, (0, 1))]


def config(layout):
    moe = dict(num_experts=4, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001) if layout.get("ep", 1) > 1 else {}
    return GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=16, **moe)


def build(layout, extra, stage, dtype, policy=None, scaler=None):
    minipar.set_default_dtype(dtype)
    minipar.manual_seed(0)
    grid = ProcessGrid(world=comm, **layout)
    model = GPT(config(layout), grid, **extra)
    opt = make_optimizer(model, grid, stage, bucket_bytes=200, policy=policy, scaler=scaler, **HYPER)
    return model, opt, PipelineExecutor(model, grid, "1f1b", 2, optimizer=opt)


def train_step(run, it, plant=None, grads=False):
    """One step; returns (norm, unscaled float64 gradients by name if ``grads``, whether it was
    skipped). ``plant``: the index of this rank's gradient array to put an inf into."""
    model, opt, executor = run
    model.rng.iteration = it
    rng = np.random.default_rng(it)
    x, y = rng.integers(0, 16, (8, 8)), rng.integers(0, 16, (8, 8))
    out = {}

    def update():
        opt.finish_gradients()
        if plant is not None:
            opt._gradients()[plant][0] = np.inf
        names = {id(p): n for n, p in model.named_parameters()}
        out["grads"] = {names[k]: g for k, g in opt.full_gradients().items()} if grads else {}
        out["norm"] = opt.clip_grad_norm(MAX_NORM)
        opt.step()

    with np.errstate(over="ignore", invalid="ignore"):
        executor.step(x, y, optimizer_step=update)
    skipped = opt.skipped_step
    opt.zero_grad()
    return out["norm"], out["grads"], skipped


def moments(opt):
    return [a for kind, _, a, *_ in opt.state_arrays() if kind != "param"]


def digest(opt):
    h = hashlib.sha256()
    for kind, _, a, *_ in opt.state_arrays():
        h.update(kind.encode() + np.ascontiguousarray(a).tobytes())
    for p in opt.model.parameters():
        h.update(np.ascontiguousarray(p.data).tobytes())
    return h.hexdigest()


def expert_array(opt):
    """The index in ``_gradients()`` of an expert's gradients (summed over edp), else the last."""
    inner = opt.inner
    comms = [b.comm for b in inner.buckets] if hasattr(inner, "buckets") else [g.comm for g in inner.groups]
    return next((i for i, c in enumerate(comms) if c is not inner.comm), len(comms) - 1)


def everywhere(value):
    return comm.all_gather(np.array([float(value)]))[:, 0].tolist()


failures = []
faulthandler.dump_traceback_later(240, exit=True)  # a hang names where each rank waits
only = [int(a) for a in sys.argv[1:] if a.isdigit()]  # layouts by index (all if none)
for layout, extra, stages in [L for i, L in enumerate(LAYOUTS) if not only or i in only]:
    for stage in stages:
        what = f"{layout} {extra} ZeRO-{stage}"
        if "-v" in sys.argv and comm.rank == 0:
            print(what, flush=True)
        plain = build(layout, extra, stage, "float64")
        mixed = build(layout, extra, stage, "float64", Policy.of("float64", main="float64"),
                      ConstantLossScaler(2.0**10))
        for it in range(3):
            (n1, g1, _), (n2, g2, _) = train_step(plain, it, grads=True), train_step(mixed, it, grads=True)
            if n1 != n2:
                failures.append(f"{what} step {it}: norm {n2!r} under the policy, {n1!r} plain")
            bad = [n for n in g1 if not np.array_equal(g1[n], g2[n])]
            if bad:
                failures.append(f"{what} step {it}: gradients differ: {bad[:3]}")
        a, b = plain[1].full_state_dict(), mixed[1].full_state_dict()
        bad = [n for n in a if not np.array_equal(a[n], b[n])]
        if bad or not all(np.array_equal(u, v) for u, v in zip(moments(plain[1]), moments(mixed[1]))):
            failures.append(f"{what}: parameters {bad[:3]} or moments differ from the plain float64 run")

        run = build(layout, extra, stage, "float16", Policy.of("float16"), DynamicLossScaler(2.0**8, hysteresis=1))
        train_step(run, 0)
        before, opt = digest(run[1]), run[1]
        _, _, skipped = train_step(run, 1, plant=expert_array(opt) if comm.rank == comm.size - 1 else None)
        if everywhere(skipped) != [1.0] * comm.size or everywhere(opt.loss_scale) != [2.0**7] * comm.size:
            failures.append(f"{what} fp16: skipped {everywhere(skipped)}, scales {everywhere(opt.loss_scale)}")
        if not all(everywhere(digest(opt) == before)):
            failures.append(f"{what} fp16: a skipped step changed the state on ranks {everywhere(digest(opt) == before)}")
        _, _, skipped = train_step(run, 2)
        if any(everywhere(skipped)) or opt.step_count != 2:
            failures.append(f"{what} fp16: the step after the skipped one: skipped {everywhere(skipped)}")

for line in failures:
    print(f"rank {comm.rank}: {line}", flush=True)
if comm.all_reduce(np.array([len(failures)]))[0]:
    sys.exit(1)
if comm.rank == 0:
    print(f"mixed precision on TP, PP, CP and EP grids OK on {comm.size} ranks")
