"""The step protocol: every data-parallel optimizer offers the same calls, and one training loop
written against them trains every ZeRO stage exactly as one device with AdamW does."""

import contextlib
import inspect
from types import SimpleNamespace

import numpy as np
import pytest

import minipar
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.data import DataParallelAdamW
from minipar.parallel.optimizers import BY_STAGE, make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.protocol import DistributedOptimizer
from minipar.parallel.zero1 import ZeRO1
from minipar.parallel.zero2 import ZeRO2
from minipar.parallel.zero3 import ZeRO3

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab_size=13, dropout=0.1)
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
PROTOCOL = ("no_sync", "finish_gradients", "grad_norm", "clip_grad_norm", "step", "zero_grad", "state_bytes",
            "peak_state_bytes", "padding", "full_gradients", "full_state_dict", "state_arrays",
            "nonfinite_gradients", "lr", "step_count", "stage")
# each class's own communication, the one method a reader looks for
DISTINGUISHING = {DataParallelAdamW: ["all_reduce_bucket"], ZeRO1: ["reduce_scatter_gradients"],
                  ZeRO2: ["reduce_scatter_group"], ZeRO3: ["gather_parameters", "release_parameters",
                                                           "reduce_scatter_group"]}


pytestmark = pytest.mark.usefixtures("float64")  # (tests/conftest.py's)


@pytest.mark.parametrize("stage", sorted(BY_STAGE))
def test_every_stage_offers_the_same_calls_and_names_its_communication(stage):
    cls = BY_STAGE[stage]
    assert issubclass(cls, DistributedOptimizer) and cls.stage == stage
    assert not inspect.isabstract(cls)
    for name in PROTOCOL:
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
    # the signatures callers use are the base class's (no stage takes extra arguments)
    for name in ("finish_gradients", "clip_grad_norm", "step", "zero_grad", "state_bytes", "state_arrays"):
        assert inspect.signature(getattr(cls, name)) == inspect.signature(getattr(DistributedOptimizer, name))
    for name in DISTINGUISHING[cls]:
        assert callable(getattr(cls, name)), f"{cls.__name__}.{name}"


def _batches(steps=2, rows=4):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        x, y = rng.integers(0, 13, (rows, 6)), rng.integers(0, 13, (rows, 6))
        y[0, :2] = -1  # ignored targets: the micro-batches count different numbers of tokens
        out.append((x, y))
    return out


def _reference(batches, max_norm):
    minipar.manual_seed(0)
    model = GPT(CONFIG)
    opt = AdamW(model.parameters(), **HYPER)
    for it, (x, y) in enumerate(batches):
        model.rng.iteration = it
        model(x, y)[1].backward()
        clip_grad_norm(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("stage", sorted(BY_STAGE))
def test_one_loop_trains_every_stage_as_one_device(stage):
    """The trainer's path, written once: micro-batches under no_sync, finish, clip, step, zero_grad
    (here on a data-parallel group of one rank, where every stage must equal plain AdamW)."""
    batches, max_norm = _batches(), 0.05  # below the gradient norm: clipping is active
    expected = _reference(batches, max_norm)
    minipar.manual_seed(0)
    grid = ProcessGrid(1, 1)
    model = GPT(CONFIG, grid)
    opt = make_optimizer(model, grid, stage, bucket_bytes=500, **HYPER)
    for it, (x, y) in enumerate(batches):
        opt.lr = HYPER["lr"]  # what the schedule does every step
        model.rng.iteration = it
        for i, rows in enumerate((slice(0, 2), slice(2, 4))):
            with opt.no_sync() if i == 0 else contextlib.nullcontext(), model.rng.at(rows=np.arange(4)[rows]):
                _, loss = model(x[rows], y[rows])
                (loss * (int((y[rows] != -1).sum()) / int((y != -1).sum()))).backward()
        opt.finish_gradients()
        assert opt.clip_grad_norm(max_norm) > max_norm
        opt.step()
        opt.zero_grad()
    assert opt.step_count == len(batches)
    got = opt.full_state_dict()
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=1e-14, err_msg=f"stage {stage}: {name}")
    held = opt.state_bytes()
    assert set(held) == {"parameters", "gradients", "optimizer"} and opt.peak_state_bytes() >= sum(held.values())
    assert {kind for kind, *_ in opt.state_arrays()} == {"param", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("stage", (0, 1))
def test_the_executor_takes_any_stage(stage):
    """The pipeline executor calls the protocol (no_sync around all but each chunk's last backward)
    and the trainer's step is the same for each stage."""
    minipar.manual_seed(0)
    grid = ProcessGrid(1, 1)
    model = GPT(CONFIG, grid)
    opt = make_optimizer(model, grid, stage, **HYPER)
    run = PipelineExecutor(model, grid, "1f1b", micro_batches=2, optimizer=opt)

    def update():
        opt.finish_gradients()
        opt.clip_grad_norm(1.0)
        opt.step()

    (x, y), = _batches(1)
    assert np.isfinite(run.step(x, y, optimizer_step=update).loss)
    opt.zero_grad()
    assert opt.step_count == 1


class QuietRecorder:
    """The optimizer as the executor sees it, noting whether each gradient hook fires under no_sync."""

    stage, loss_scale, quiet = 0, 1.0, False

    @contextlib.contextmanager
    def no_sync(self):
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_executor_lets_only_each_chunks_last_backward_send(schedule):
    """Every backward (split: every W) but a chunk's last runs under no_sync, so that data
    parallelism's sums start from the last one's hooks while the step goes on. (All of them under
    no_sync would still give the right sums, every one of them left to finish_gradients.)"""
    minipar.manual_seed(0)
    grid = ProcessGrid(1, 1)
    model = GPT(CONFIG, grid)
    opt, fired = QuietRecorder(), []
    for p in model.parameters():
        p.register_grad_hook(lambda _: fired.append(opt.quiet))
    run = PipelineExecutor(model, grid, schedule, micro_batches=3, optimizer=opt)
    (x, y), = _batches(1, rows=6)
    run.step(x, y)
    n = len(model.parameters())
    assert fired == [True] * 2 * n + [False] * n  # three micro-batches, each parameter's hook once in each


def test_the_executor_needs_what_sums_over_cp_too():
    """With context parallelism alone (DP = 1) each rank still holds only its positions' part of
    every gradient: without an optimizer to sum them it would step on that part."""
    model = GPT(CONFIG, ProcessGrid(1, 1))
    cp_only = SimpleNamespace(tp=1, pp=1, dp=1, cp=2)  # all the check reads of a CP = 2 grid
    with pytest.raises(ValueError, match="DP x CP > 1"):
        PipelineExecutor(model, cp_only, "1f1b", micro_batches=1)


def test_finish_gradients_finalizes_the_model_once():
    """finish_gradients runs model.finalize_grads itself (callers no longer know the order), once."""
    calls = []
    minipar.manual_seed(0)
    grid = ProcessGrid(1, 1)
    for stage in sorted(BY_STAGE):
        model = GPT(CONFIG, grid)
        model.finalize_grads = lambda: calls.append(stage)
        opt = make_optimizer(model, grid, stage, **HYPER)
        (x, y), = _batches(1)
        model(x, y)[1].backward()
        opt.finish_gradients()
        opt.finish_gradients()
        opt.step()
    assert calls == sorted(BY_STAGE)


def test_make_optimizer_refuses_a_bad_stage_and_another_grid():
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3"):
        make_optimizer(GPT(CONFIG), ProcessGrid(1, 1), 4)
    with pytest.raises(ValueError, match="built on another grid"):
        make_optimizer(GPT(CONFIG), ProcessGrid(1, 1), 0)  # GPT(CONFIG) is the single-device model
