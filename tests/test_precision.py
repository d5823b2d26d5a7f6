"""Mixed precision on one device: the loss scaler's state machine, fp32 master weights through
every stage of the step protocol, skipped steps, and the float64-everywhere policy against the
plain float64 run."""

import contextlib

import numpy as np
import pytest

import minipar
from minipar.dtypes import bfloat16, float16
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import BY_STAGE, make_optimizer
from minipar.precision import ConstantLossScaler, DynamicLossScaler, Policy

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.1)
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)


# ---- the scaler's state machine -----------------------------------------------------------------
def test_dynamic_scaler_backs_off_after_hysteresis_and_grows_after_a_window():
    s = DynamicLossScaler(initial_scale=2.0**10, min_scale=4.0, growth_interval=3, hysteresis=2)
    assert not s.at_floor()
    assert s.update(found_inf=True) and s.scale == 2.0**10  # skipped, but the hysteresis absorbs it
    assert not s.update(False)  # a clean step does not refill the hysteresis ...
    assert s.update(True) and s.scale == 2.0**9  # ... so the second overflow halves
    assert s.update(True) and s.scale == 2.0**8  # and every later one, until a growth
    for _ in range(2):
        assert not s.update(False)
    assert s.scale == 2.0**8
    assert not s.update(False) and s.scale == 2.0**9  # three clean steps in a row: doubled
    assert s.hysteresis_tracker == 2  # refilled by the growth
    assert s.update(True) and s.scale == 2.0**9
    assert not s.update(False) and not s.update(False)
    assert s.update(True) and s.scale == 2.0**8  # the window restarts after an overflow
    for _ in range(10):
        s.update(True)
    assert s.scale == 4.0 and s.at_floor()  # never below min_scale
    state = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict(state)
    assert t.state_dict() == state


def test_constant_scaler_skips_but_never_moves():
    s = ConstantLossScaler(128.0)
    assert s.update(True) and not s.update(False) and s.scale == 128.0 and s.at_floor()
    with pytest.raises(ValueError, match="positive"):
        ConstantLossScaler(0.0)


@pytest.mark.parametrize("make", [lambda: ConstantLossScaler(1e-30), lambda: DynamicLossScaler(2.0**16, 1e-30)])
def test_a_scale_below_float16s_smallest_number_is_refused(make):
    """Every scaled gradient up to 1 would be 0: the run's loss turned to nan a step later, and the
    error named the learning rate."""
    with pytest.raises(ValueError, match=r"below 2\^-24, float16's smallest number"):
        make()


def test_a_scaler_resumes_only_its_own_kinds_state():
    """A constant scale is the run's flag: a checkpoint's scale did override --loss-scale. A
    dynamic scale resumed from a constant one's checkpoint failed with a KeyError."""
    dynamic = DynamicLossScaler(initial_scale=2.0**16, growth_interval=3)
    dynamic.update(False)
    constant = ConstantLossScaler(1024.0)
    constant.load_state_dict(dynamic.state_dict())
    assert constant.scale == 1024.0
    fresh = DynamicLossScaler(initial_scale=2.0**10, growth_interval=3)
    fresh.load_state_dict(ConstantLossScaler(8.0).state_dict())
    assert fresh.state_dict() == DynamicLossScaler(initial_scale=2.0**10, growth_interval=3).state_dict()
    fresh.load_state_dict(dynamic.state_dict())
    assert fresh.state_dict() == dynamic.state_dict()


def test_policy_refuses_what_would_lose_updates():
    with pytest.raises(ValueError, match="master weights must be float32"):
        Policy("bfloat16", "bfloat16", "bfloat16")
    assert Policy.of("bfloat16").bytes_per_parameter() == (2, 2, 12)
    assert Policy.of("float16", accumulate_in_main=True).grads == np.float32


# ---- masters through the step protocol ----------------------------------------------------------
def _batches(steps, rows=4, repeat=False):
    rng = np.random.default_rng(0)
    out = [(rng.integers(0, 32, (rows, 8)), rng.integers(0, 32, (rows, 8))) for _ in range(steps)]
    return [out[0]] * steps if repeat else out  # repeated: a batch to learn by heart


def _train(stage, dtype, policy=None, scaler=None, steps=3, max_norm=0.05, plant=None, repeat=False):
    """The trainer's loop (two micro-batches) on one device; ``plant``: the step at which one
    gradient is set to inf after backward; ``max_norm=None``: no clipping, so the step unscales
    on its own (a tuple: each step's). Returns (optimizer, model, losses, skipped)."""
    minipar.set_default_dtype(dtype)
    minipar.manual_seed(0)
    grid = ProcessGrid(1, 1)
    model = GPT(CONFIG, grid)
    opt = make_optimizer(model, grid, stage, bucket_bytes=600, policy=policy, scaler=scaler, **HYPER)
    losses, skipped = [], []
    for it, (x, y) in enumerate(_batches(steps, repeat=repeat)):
        model.rng.iteration = it
        total = 0.0
        for i, rows in enumerate((slice(0, 2), slice(2, 4))):
            with opt.no_sync() if i == 0 else contextlib.nullcontext(), model.rng.at(rows=np.arange(4)[rows]):
                _, loss = model(x[rows], y[rows])
                total += loss.item() / 2
                (loss * (0.5 * opt.loss_scale)).backward()
        opt.finish_gradients()
        if it == plant:
            opt._gradients()[0][0] = np.inf
        norm = max_norm[it] if isinstance(max_norm, tuple) else max_norm
        if norm is not None:
            opt.clip_grad_norm(norm)
        opt.step()
        skipped.append(opt.skipped_step)
        opt.zero_grad()
        losses.append(total)
    return opt, model, losses, skipped


@pytest.mark.parametrize("stage", sorted(BY_STAGE))
def test_float64_policy_equals_the_plain_float64_run_bit_for_bit(stage):
    """Masters, widening, unscaling by a loss scale of 1 and clipping folded into the update: all
    of it in float64 changes no bit of the plain float64 run."""
    plain = _train(stage, "float64")[0].full_state_dict()
    mixed_opt = _train(stage, "float64", Policy.of("float64", main="float64"), ConstantLossScaler(1.0))[0]
    mixed = mixed_opt.full_state_dict()
    assert mixed_opt.step_count == 3 and mixed_opt.stage == stage
    for name, value in plain.items():
        np.testing.assert_array_equal(mixed[name], value, err_msg=f"stage {stage}: {name}")


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("max_norm", [0.05, None, (0.05, None, None)])
def test_a_growing_scale_unscales_each_step_by_the_scale_its_backward_used(stage, max_norm):
    """The scale doubles after every clean step (a window of 1): each step's gradients carry the
    scale before that update, and dividing by it (a power of two: exact) leaves every bit of the
    plain float64 run, with clipping (which unscales), without (the step unscales), and without
    after a step with (what the clip kept for its step is not kept for the next)."""
    plain = _train(stage, "float64", max_norm=max_norm)[0].full_state_dict()
    opt = _train(stage, "float64", Policy.of("float64", main="float64"), DynamicLossScaler(4.0, growth_interval=1),
                 max_norm=max_norm)[0]
    assert opt.loss_scale == 4.0 * 2**3  # grown after each of the 3 steps
    mixed = opt.full_state_dict()
    for name, value in plain.items():
        np.testing.assert_array_equal(mixed[name], value, err_msg=f"stage {stage}: {name}")


def test_gradients_read_after_the_overflow_check_carry_the_scale_backward_used():
    """The check grows the scale (a window of 1); the gradients it checked were made with the
    scale before, which the unscaled copies for checks against one device divide by."""
    grads = []
    for policy, scaler in ((None, None), (Policy.of("float64", main="float64"), DynamicLossScaler(4.0, growth_interval=1))):
        minipar.set_default_dtype("float64")
        minipar.manual_seed(0)
        grid = ProcessGrid(1, 1)
        model = GPT(CONFIG, grid)
        opt = make_optimizer(model, grid, 0, policy=policy, scaler=scaler, **HYPER)
        x, y = _batches(1)[0]
        (model(x, y)[1] * opt.loss_scale).backward()
        if scaler is not None:
            assert not opt.check_overflow() and opt.loss_scale == 8.0
        grads.append(list(opt.full_gradients().values()))
    for plain, mixed in zip(*grads):
        np.testing.assert_array_equal(mixed, plain)


@pytest.mark.parametrize("stage", sorted(BY_STAGE))
def test_masters_are_fp32_and_the_model_their_16_bit_rounding(stage):
    opt, model, _, _ = _train(stage, "bfloat16", Policy.of("bfloat16"))
    kinds = {kind: a for kind, _, a, *_ in opt.state_arrays()}
    assert {a.dtype for a in (kinds["param"], kinds["exp_avg"], kinds["exp_avg_sq"])} == {np.dtype("float32")}
    whole = opt.full_state_dict()
    assert {a.dtype for a in whole.values()} == {bfloat16}
    masters = opt.inner.masters
    if stage == 0:
        for master, p in zip(masters, model.parameters()):
            np.testing.assert_array_equal(master.data.astype(bfloat16).view(np.uint16), p.data.view(np.uint16))
    else:  # this rank's pieces of the 16-bit weights are the masters' rounding
        pieces = opt.inner.master_pieces()
        for g, piece in zip(opt.inner.groups, pieces):
            np.testing.assert_array_equal(masters[g.shard].astype(bfloat16).view(np.uint16), piece.view(np.uint16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_training_follows_float32(dtype):
    scaler = DynamicLossScaler(initial_scale=2.0**12, growth_interval=2) if dtype == "float16" else None
    ref = _train(0, "float32", steps=8, max_norm=1.0, repeat=True)[2]
    got = _train(0, dtype, Policy.of(dtype), scaler, steps=8, max_norm=1.0, repeat=True)[2]
    assert got[-1] < got[0] - 0.3  # it learns
    assert max(abs(a - b) for a, b in zip(got, ref)) < 0.05, (got, ref)


@pytest.mark.parametrize("stage", sorted(BY_STAGE))
def test_an_overflow_skips_the_step_leaving_every_bit_and_halves_the_scale(stage):
    policy = Policy.of("float16")
    clean_opt, clean_model, _, _ = _train(stage, "float16", policy, DynamicLossScaler(2.0**8, hysteresis=1), steps=1)
    opt, model, _, skipped = _train(stage, "float16", policy, DynamicLossScaler(2.0**8, hysteresis=1),
                                    steps=2, plant=1)
    assert skipped == [False, True] and opt.step_count == 1 and opt.loss_scale == 2.0**7
    # after the skipped second step every parameter, master and moment is the first step's
    for (kind, _, a, *_), (_, _, b, *_) in zip(opt.state_arrays(), clean_opt.state_arrays()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=kind)
    for name, value in clean_opt.full_state_dict().items():
        np.testing.assert_array_equal(opt.full_state_dict()[name].view(np.uint16), value.view(np.uint16))
    assert float16 == model.parameters()[0].dtype


def test_skipped_steps_count_every_overflow_of_the_run():
    opt, _, _, skipped = _train(0, "float16", Policy.of("float16"), DynamicLossScaler(2.0**8, hysteresis=1),
                                steps=3, plant=1)
    assert skipped == [False, True, False] and opt.skipped_steps == 1


@pytest.mark.parametrize("stage", sorted(BY_STAGE))
def test_gradients_accumulated_in_fp32_hold_2_4_12_bytes_and_follow_the_16_bit_run(stage):
    """--accumulate-allreduce-grads-in-fp32: the engine adds each micro-batch's 16-bit gradients
    into fp32 buffers (2 + 4 + 12 bytes on one device); the run stays near the 16-bit one."""
    opt16, _, losses16, _ = _train(stage, "bfloat16", Policy.of("bfloat16"), steps=4, max_norm=1.0, repeat=True)
    opt, model, losses, _ = _train(stage, "bfloat16", Policy.of("bfloat16", accumulate_in_main=True), steps=4,
                                   max_norm=1.0, repeat=True)
    assert {g.dtype for g in opt._gradients()} == {np.dtype("float32")}
    P = sum(p.size for p in opt16.full_state_dict().values()) + opt.padding()
    held = opt.state_bytes()
    assert (held["parameters"], held["gradients"], held["optimizer"]) == (2 * P, 4 * P, 12 * P)
    assert max(abs(a - b) for a, b in zip(losses, losses16)) < 0.02 and losses[-1] < losses[0] - 0.1


def test_the_wrapper_is_one_more_implementation_of_the_step_protocol():
    import inspect

    from minipar.parallel.mixed_precision import MixedPrecisionOptimizer
    from minipar.parallel.protocol import DistributedOptimizer

    assert issubclass(MixedPrecisionOptimizer, DistributedOptimizer) and not inspect.isabstract(MixedPrecisionOptimizer)
    for name in ("finish_gradients", "clip_grad_norm", "step", "zero_grad", "state_bytes", "state_arrays"):
        assert inspect.signature(getattr(MixedPrecisionOptimizer, name)) == inspect.signature(
            getattr(DistributedOptimizer, name))


def test_a_scaler_needs_a_policy_and_a_policy_its_model_dtype():
    minipar.manual_seed(0)
    grid = ProcessGrid(1, 1)
    model = GPT(CONFIG, grid)
    with pytest.raises(ValueError, match="needs a precision policy"):
        make_optimizer(model, grid, 0, scaler=ConstantLossScaler(2.0))
    with pytest.raises(ValueError, match="policy is for a bfloat16 model"):
        make_optimizer(model, grid, 1, policy=Policy.of("bfloat16"))


def test_the_auxiliary_losses_carry_the_loss_scale():
    """fp16 scales the loss by S before backward; a mixture of experts' balancing loss, attached
    to the graph, must be scaled by S too (``model.moe.loss_scale``), or its share of the router's
    gradient comes out S times too small once unscaled."""
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32, num_experts=4,
                       moe_aux_loss_coeff=10.0)
    x, y = _batches(1)[0]
    grads = {}
    for name, dtype, S, told in (("fp32", "float32", 1.0, 1.0), ("told", "float16", 1024.0, 1024.0),
                                 ("untold", "float16", 1024.0, 1.0)):
        minipar.set_default_dtype(dtype)
        minipar.manual_seed(0)
        model = GPT(config)
        model.moe.loss_scale = told
        _, loss = model(x, y)
        (loss * S).backward()
        grads[name] = model.transformer.h[0].mlp.router.weight.grad.astype(np.float64) / S
    err = {n: np.abs(grads[n] - grads["fp32"]).max() / np.abs(grads["fp32"]).max() for n in ("told", "untold")}
    assert err["told"] < 0.02 and err["untold"] > 0.5, err
