"""Edges of the pipeline executors found by review: a training step called inside no_grad() is
refused before any message (it used to fail with a KeyError at the first backward, after sends);
PipeDream-2BW's stash follows weights set after it is built (--init-weights), where batch 0 used
to run on the weights the model was built with; the deferred head's W's on a pipeline with middle
stages, which hold no head."""

import numpy as np
import pytest

import minipar
from minipar.checkpoint import full
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.pipeline.pipedream import PipeDream2BW
from minipar.parallel.pipeline.weight_stash import WeightStash
from mpi_run import check_mpi

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.1)


def _batch():
    return np.random.default_rng(0).integers(0, 32, (4, 8))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "pipedream-2bw"])
def test_a_training_step_inside_no_grad_is_refused_before_anything_runs(schedule):
    grid = ProcessGrid(1, 1)
    minipar.manual_seed(0)
    model = GPT(CONFIG, grid)
    if schedule == "pipedream-2bw":
        opt = WeightStash(make_optimizer(model, grid, 0, lr=1e-2))
        run, call = PipeDream2BW(model, grid, 2, opt), {"following": None}
    else:
        run, call = PipelineExecutor(model, grid, schedule, micro_batches=2), {}
    x = _batch()
    with minipar.no_grad(), pytest.raises(RuntimeError, match=r"inside no_grad\(\).*evaluate\(\) for the loss alone"):
        run.step(x, x, **call)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert run.step(x, x, **call).loss > 0  # and the executor is left as it was


def test_pipedream_2bw_runs_batch_0_on_weights_loaded_after_it_was_built(float64):
    """--init-weights loads the weights after the optimizer (and its stash) is built: batch 0 runs
    on W(-1) := W(0), which must be the loaded weights, not the seed's."""
    grid = ProcessGrid(1, 1)
    minipar.manual_seed(5)
    loaded = GPT(CONFIG)
    minipar.manual_seed(3)
    model = GPT(CONFIG, grid)
    opt = WeightStash(make_optimizer(model, grid, 0, lr=1e-2))
    run = PipeDream2BW(model, grid, 2, opt)
    full.load_full_state(model, opt, loaded.state_dict(), grid)
    x = _batch()
    loaded.rng.seed, model.rng.iteration, loaded.rng.iteration = model.rng.seed, 0, 0  # the same dropout masks
    want = loaded(x, x)[1].item()
    assert abs(run.step(x, x, opt.step).loss - want) < 1e-12
    with pytest.raises(RuntimeError, match="set after its first step"):
        full.load_full_state(model, opt, loaded.state_dict(), grid)


@pytest.mark.parametrize("grads", ["bfloat16", "float32"])
def test_pipedream_2bw_in_bf16_keeps_the_masters_newest_and_the_16_bit_older_version_stashed(grads):
    """With fp32 masters the newest version W(t) is theirs, the model's 16-bit weights its rounding,
    the stash the 16-bit W(t-1). Each update swaps the arrays the model reads, so the masters must
    round into the new newest ones, not into the stash an in-flight backward reads."""
    from minipar.dtypes import bfloat16
    from minipar.precision import Policy

    grid = ProcessGrid(1, 1)
    minipar.set_default_dtype(bfloat16)
    try:
        minipar.manual_seed(0)
        model = GPT(CONFIG, grid)
    finally:
        minipar.set_default_dtype("float32")
    policy = Policy(bfloat16, "float32", grads)
    opt = WeightStash(make_optimizer(model, grid, 0, policy=policy, lr=1e-2))
    run, x, y = PipeDream2BW(model, grid, 2, opt), _batch(), _batch()[::-1]
    run.step(x, y, opt.step, following=(y, x))  # batch 0's update, set aside (one stage: no forward of batch 1 yet)
    opt.apply()  # made now, as batch 1's first forward would: W(1)
    after_one = [p.data.copy() for p in model.parameters()]
    masters = [m.data.copy() for m in opt.inner.masters]
    assert all(np.array_equal(p.data, m.astype(bfloat16)) for p, m in zip(model.parameters(), masters))
    run.step(y, x, opt.step)  # batch 1 (on W(1)), then a drain: its update makes W(2)
    assert all(np.array_equal(s, w) for s, w in zip(opt.stash, after_one))  # W(1), the 16-bit one
    assert all(np.array_equal(p.data, m.data.astype(bfloat16)) for p, m in zip(model.parameters(), opt.inner.masters))
    assert not all(np.array_equal(m.data, old) for m, old in zip(opt.inner.masters, masters))


@pytest.mark.parametrize("args", [["--pp", "3", "--schedule", "1f1b-slack", "--m", "2"],
                                  ["--pp", "3", "--schedule", "interleaved", "--v", "2", "--m", "3"]])
def test_the_deferred_head_with_a_middle_stage_matches_one_device(args):
    """A middle stage holds no head (model.head_weight is None there): its backwards are whole."""
    out = check_mpi(3, "pipeline.py", *args, "--defer-embedding-wgrad", timeout=180)
    assert out.count("OK (layers") == 3
