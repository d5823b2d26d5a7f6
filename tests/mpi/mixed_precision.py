"""Mixed precision over a data-parallel group, every ZeRO stage:

* an overflow planted in one rank's gradients (after the DP sum, where the others cannot see it)
  skips the step on every rank: parameters, masters and moments bit-identical, the scale halved
  everywhere;
* the bytes each rank holds in bf16 with fp32 masters are the ZeRO paper's: 16P, 4P + 12P/N,
  2P + 14P/N, 16P/N (P counting the padding that cuts the flat buffers into N pieces);
* the float64-everywhere policy equals the plain float64 run bit for bit (ZeRO-1 and 2, whose
  masters are pieces).

    run_mpi.sh -n 2 tests/mpi/mixed_precision.py
"""

import hashlib

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.data import split_batch
from minipar.parallel.optimizers import make_optimizer
from minipar.precision import ConstantLossScaler, DynamicLossScaler, Policy

comm = world()
grid = ProcessGrid(tp=1, pp=1)
N, r = grid.dp_group.size, grid.dp_group.rank
config = GPTConfig(n_layer=2, n_head=2, n_embd=6, block_size=6, vocab_size=13)  # sizes that need padding
hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)


def build(stage, dtype, policy=None, scaler=None):
    minipar.set_default_dtype(dtype)
    minipar.manual_seed(0)
    model = GPT(config, grid)
    return model, make_optimizer(model, grid, stage, bucket_bytes=300, policy=policy, scaler=scaler, **hyper)


def train_step(model, opt, it, plant=False):
    rng = np.random.default_rng(it)
    x, y = split_batch(rng.integers(0, 13, (2 * N, 6)), rng.integers(0, 13, (2 * N, 6)), grid.dp_group)
    model.rng.iteration = it
    _, loss = model(x, y)
    (loss * (opt.loss_scale / N)).backward()
    opt.finish_gradients()
    if plant:  # after the sum: only this rank's held gradients see it
        opt._gradients()[-1][0] = np.inf
    opt.clip_grad_norm(1.0)
    opt.step()
    skipped = opt.skipped_step
    opt.zero_grad()
    return skipped


def digest(opt):
    h = hashlib.sha256()
    for kind, _, a, *_ in opt.state_arrays():
        h.update(kind.encode() + np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def everywhere(value):
    """The values every rank holds, gathered."""
    return comm.all_gather(np.array([float(value)]))[:, 0].tolist()


for stage in (0, 1, 2, 3):
    # one rank's overflow skips the step on every rank
    model, opt = build(stage, "float16", Policy.of("float16"), DynamicLossScaler(2.0**8, hysteresis=1))
    train_step(model, opt, 0)
    before = digest(opt)
    skipped = train_step(model, opt, 1, plant=(r == N - 1))
    assert everywhere(skipped) == [1.0] * N, f"stage {stage}: skipped on {everywhere(skipped)}"
    assert everywhere(opt.loss_scale) == [2.0**7] * N and opt.step_count == 1, (stage, opt.loss_scale)
    assert digest(opt) == before, f"rank {r} stage {stage}: a skipped step changed the state"
    assert not train_step(model, opt, 2) and opt.step_count == 2  # and training goes on

    # bytes per parameter, bf16 with fp32 masters: the ZeRO paper's count
    model, opt = build(stage, "bfloat16", Policy.of("bfloat16"))
    train_step(model, opt, 0)
    P = sum(p.size for p in model.parameters()) if stage < 3 else sum(g.size for g in opt.inner.groups)
    P += opt.padding()
    assert stage == 0 or P % N == 0  # the padded flat buffers cut into N equal pieces
    formula = {0: 16 * P, 1: 4 * P + 12 * P // N, 2: 2 * P + 14 * P // N, 3: 16 * P // N}[stage]
    held = sum(opt.state_bytes().values())
    assert held == formula, f"stage {stage}: holds {opt.state_bytes()} = {held}, the paper's count {formula}"

    # the float64-everywhere policy is the plain float64 run, bit for bit
    if stage in (1, 2):
        plain = build(stage, "float64")
        mixed = build(stage, "float64", Policy.of("float64", main="float64"), ConstantLossScaler(1.0))
        for it in range(2):
            train_step(*plain, it)
            train_step(*mixed, it)
        a, b = plain[1].full_state_dict(), mixed[1].full_state_dict()
        assert all(np.array_equal(a[n], b[n]) for n in a), f"stage {stage}: float64 policy differs"

# bf16 with gradients summed in fp32: every stage takes the same steps, bit for bit. ZeRO-2 keeps no
# gradient buffer, and the tied embedding's two parts (lookup and head) were summed in bf16
steps = {}
for stage in (0, 1, 2, 3):
    model, opt = build(stage, "bfloat16", Policy.of("bfloat16", accumulate_in_main=True))
    for it in range(2):
        train_step(model, opt, it)
    state = opt.full_state_dict()
    steps[stage] = {n: state[n].astype(np.float32) for n in sorted(state)}
for stage in (1, 2, 3):
    assert all(np.array_equal(steps[0][n], steps[stage][n]) for n in steps[0]), f"stage {stage} differs from stage 0"

if comm.rank == 0:
    print(f"mixed precision OK on {N} ranks")
