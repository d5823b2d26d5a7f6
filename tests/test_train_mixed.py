"""Mixed precision in the training CLI: Megatron's flags, their one-line errors, the loss scale in
--log-json, exact resumption from fp32 masters, and the memory the refusal counts."""

import json
from dataclasses import replace

import numpy
import pytest

from mpi_run import LAUNCHER, run_mpi
from test_train import TINY, train

from minipar.checkpoint import load_weights
from minipar.parallel.memory import parameter_count, state_bytes
from minipar.parallel.validate import RunConfig


def rows(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.parametrize("args,message", [
    (["--bf16", "--fp16"], "--bf16 and --fp16 are two 16-bit formats: give one"),
    (["--bf16", "--dtype", "float64"], "--dtype float64 with --bf16: mixed precision keeps float32 master weights"),
    (["--bf16", "--loss-scale", "8"], "--loss-scale: a loss scale is for --fp16"),
    (["--hysteresis", "3"], "--hysteresis: a loss scale is for --fp16"),
    (["--fp16", "--loss-scale", "8", "--loss-scale-window", "4"], "--loss-scale is a constant scale"),
    (["--fp16", "--initial-loss-scale", "4", "--min-loss-scale", "8"], "--min-loss-scale 8 is above --initial-loss-scale 4"),
    (["--accumulate-allreduce-grads-in-fp32"], "is for --bf16 or --fp16 runs"),
    (["--fp16", "--initial-loss-scale", "1e39"], "1e+39 is above float32's largest number (3.4e38)"),
    (["--fp16", "--loss-scale", "1e300"], "1e+300 is above float32's largest number"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale: must be > 0"),
])
def test_bad_mixed_precision_flags_get_a_one_line_error(args, message, tmp_path):
    run = train(*args, "--max-iters", "1", cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and message in lines[0], run.stderr


def test_fp16_log_rows_carry_the_scale_and_the_skipped_steps(tmp_path):
    """Megatron's start, 2^32, overflows float16: the first steps are skipped, the scale halving
    each time (hysteresis 1), until one fits; then the window's clean steps double it."""
    log = str(tmp_path / "log.jsonl")
    run = train(*TINY, "--fp16", "--hysteresis", "1", "--loss-scale-window", "3", "--max-iters", "24",
                "--log-interval", "1", "--log-json", log, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    # the overflows are the algorithm's, said on the progress lines, not as NumPy's warnings
    assert "Warning" not in run.stderr and "| scale 2^32, skipped: overflow" in run.stdout, run.stderr
    got = rows(log)
    assert all({"loss_scale", "skipped"} <= set(r) for r in got)
    assert got[0]["skipped"] and got[0]["loss_scale"] == 2.0**32 and got[0]["grad_norm"] is None
    for a, b in zip(got, got[1:]):
        if a["skipped"]:
            assert b["loss_scale"] == a["loss_scale"] / 2
    first = next(i for i, r in enumerate(got) if not r["skipped"])
    assert 2.0**10 <= got[first]["loss_scale"] <= 2.0**20 and all(r["skipped"] for r in got[:first])
    assert any(not r["skipped"] for r in got[first:]) and numpy.isfinite(got[-1]["loss"])


@pytest.mark.parametrize("scale,fix", [(["--loss-scale", "1e30"], "lower --loss-scale 1e+30"),
                                       (["--initial-loss-scale", "1e30", "--min-loss-scale", "1e30"],
                                        "lower --min-loss-scale 1e+30")])
def test_fp16_steps_skipped_at_a_scale_that_cannot_go_lower_stop_the_run(scale, fix, tmp_path):
    """Such a run skipped every step and ended with status 0, its weights as they started."""
    run = train(*TINY, "--fp16", *scale, "--max-iters", "30", "--save", "ckpt", cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert lines[0].startswith("python -m minipar.train: error: at iter 9 the last 10 steps were all skipped") and fix in lines[0]
    assert lines[0].endswith("No checkpoint was saved in ckpt yet.")  # (the default --save-interval: 100)


def test_a_stuck_fp16_run_stops_at_the_same_step_when_resumed(tmp_path):
    """The count of steps skipped in a row is in the checkpoint: resumed every 5 iterations (under
    10), such a run went on for ever, training nothing, and ended with status 0."""
    common = [*TINY, "--fp16", "--loss-scale", "1e30", "--max-iters", "30", "--save", "ckpt"]
    first = train(*common, "--exit-interval", "5", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = train(*common, "--load", "ckpt", cwd=tmp_path)
    assert second.returncode == 1 and "at iter 9 the last 10 steps were all skipped" in second.stderr, second.stderr


def test_a_float64_checkpoint_refused_by_a_16_bit_run_names_what_chose_float32(tmp_path):
    """It said "dtype float64 (flags: float32)" to a user who typed --fp16 and no dtype."""
    assert train(*TINY, "--dtype", "float64", "--max-iters", "1", "--save", "ck", cwd=tmp_path).returncode == 0
    run = train(*TINY, "--fp16", "--max-iters", "2", "--load", "ck", cwd=tmp_path)
    assert run.returncode == 2 and ("dtype float64 (flags: float32, the master weights of --fp16, which are "
                                    "float32 always)") in run.stderr, run.stderr


def test_a_bf16_run_resumes_exactly_and_its_checkpoint_starts_a_float32_run(tmp_path):
    common = [*TINY, "--bf16", "--max-iters", "6", "--warmup-iters", "2"]
    whole, parts = str(tmp_path / "whole.safetensors"), str(tmp_path / "parts.safetensors")
    assert train(*common, "--export-weights", whole, cwd=tmp_path).returncode == 0
    save = str(tmp_path / "ck")
    first = train(*common, "--save", save, "--exit-interval", "3", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = train(*common, "--load", save, "--export-weights", parts, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    a, b = load_weights(whole), load_weights(parts)
    assert {v.dtype for v in a.values()} == {numpy.dtype("float32")}  # the masters, not their rounding
    for name in a:
        numpy.testing.assert_array_equal(a[name], b[name], err_msg=name)
    to_fp32 = train(*TINY, "--max-iters", "6", "--warmup-iters", "2", "--load", save, cwd=tmp_path)
    assert to_fp32.returncode == 0 and "resuming at iteration 3" in to_fp32.stdout, to_fp32.stderr
    # and back: a float32 checkpoint starts an fp16 run (its weights become the fp32 masters)
    save32 = str(tmp_path / "ck32")
    assert train(*TINY, "--max-iters", "4", "--exit-interval", "2", "--save", save32, cwd=tmp_path).returncode == 0
    to_fp16 = train(*TINY, "--max-iters", "4", "--fp16", "--load", save32, cwd=tmp_path)
    assert to_fp16.returncode == 0 and "resuming at iteration 2" in to_fp16.stdout, to_fp16.stderr


def test_the_memory_refusal_counts_the_papers_bytes_in_16_bits():
    n = parameter_count(4, 64, 32)
    run = RunConfig(tp=2, pp=2, dp=4, n_layer=4, n_embd=64, block_size=32, dtype="bfloat16")
    P, N = n / 4, 4  # the parameters of one TP x PP part, ZeRO-sharded over DP = 4
    for stage, formula in [(0, 16 * P), (1, 4 * P + 12 * P / N), (2, 2 * P + 14 * P / N), (3, 16 * P / N)]:
        assert state_bytes(replace(run, zero_stage=stage)) == pytest.approx(formula)
    # gradients accumulated in fp32: 2 + 4 + 12, the gradient's 4 bytes sharded from stage 2 on
    for stage, formula in [(0, 18 * P), (1, 6 * P + 12 * P / N), (2, 2 * P + 16 * P / N), (3, 18 * P / N)]:
        assert state_bytes(replace(run, zero_stage=stage, fp32_grads=True)) == pytest.approx(formula)


@pytest.mark.parametrize("model,layout", [
    ([], ["--cp", "2", "--bf16"]), ([], ["--cp", "2", "--cp-comm-type", "a2a", "--bf16"]),
    ([], ["--tp", "2", "--sequence-parallel", "--bf16", "--zero-stage", "1"]),
    ([], ["--pp", "2", "--fp16", "--loss-scale", "1024", "--micro-batch-size", "1"]),
    (["--num-experts", "2", "--moe-aux-loss-coeff", "0.01"], ["--ep", "2", "--bf16", "--zero-stage", "1"]),
    (["--num-experts", "2", "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01"],
     ["--ep", "2", "--fp16", "--loss-scale", "4096"]),
])
def test_16_bit_runs_on_every_kind_of_grid_follow_the_float32_run(model, layout, tmp_path):
    """Context (ring and Ulysses), tensor + sequence, pipeline and expert parallelism in 16 bits:
    the loss curve within a few 16-bit roundings of the single-device float32 one."""
    common = [*TINY, *model, "--max-iters", "4", "--warmup-iters", "2"]
    reference = str(tmp_path / "fp32.jsonl")
    assert train(*common, "--log-json", reference, cwd=tmp_path).returncode == 0
    log = str(tmp_path / "run.jsonl")
    code, out, _ = run_mpi(2, None, timeout=120, command=[LAUNCHER, "-n", "2", "-m", "minipar.train", *common,
                                                          *layout, "--log-json", log])
    assert code == 0, out
    got, ref = [r["loss"] for r in rows(log)], [r["loss"] for r in rows(reference)]
    assert not any(r["skipped"] for r in rows(log))
    assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, ref)) < 0.02, (got, ref)


def test_a_16_bit_run_starts_from_the_weights_it_is_given(tmp_path):
    """--init-weights set the float32 masters, and the 16-bit model the step computes with is their
    rounding: evaluated before any step, it scores what the float32 model scores (to 16-bit
    rounding), far from an untrained model's ln 256 = 5.5."""
    weights = str(tmp_path / "w.safetensors")
    trained = train(*TINY, "--max-iters", "30", "--lr", "1e-2", "--warmup-iters", "0", "--export-weights", weights,
                    cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    val = {}
    for flags in ([], ["--bf16"], ["--fp16"]):
        run = train(*TINY, "--max-iters", "0", "--init-weights", weights, *flags, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        val[" ".join(flags)] = float(run.stdout.split("val loss ")[1].split()[0])
    assert val[""] < 4.5, val  # trained: the check below could not tell an untrained model apart otherwise
    assert val["--bf16"] == pytest.approx(val[""], rel=0.02) and val["--fp16"] == pytest.approx(val[""], rel=0.01), val


def test_skipped_fp16_steps_do_not_advance_the_learning_rate_schedule(tmp_path):
    """A run that starts at a scale of 2^32 skips its first steps. The schedule ran on through
    them, so the warm-up was spent on steps that changed nothing and the first update came at
    several times its rate; it follows the updates taken, as Megatron's scheduler does."""
    log = str(tmp_path / "log.jsonl")
    run = train(*TINY, "--fp16", "--max-iters", "24", "--warmup-iters", "10", "--log-json", log, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    logged = rows(log)
    skipped = [r["skipped"] for r in logged]
    assert skipped[0] and not all(skipped), skipped  # some skipped steps, then updates
    peak = 3e-3  # TINY's --lr (the default)
    updates = 0
    for r in logged:  # warm-up: lr (k + 1) / (warmup + 1) at the k-th update, skipped or not
        assert r["lr"] == pytest.approx(peak * (updates + 1) / 11), (r, updates)
        updates += not r["skipped"]


def test_an_fp16_run_resumes_exactly_with_its_dynamic_loss_scale(tmp_path):
    """Saved at iteration 6, after the scale has grown and just before an overflow: the resumed run
    must go on with the scaler's whole state (its scale, its counts of clean steps and of
    overflows), or its next overflow check, and every update after it, differs from the run that
    did not stop (restarted at 65536, it did not skip iteration 6, and the weights differed by 2e-3)."""
    common = [*TINY, "--fp16", "--initial-loss-scale", "65536", "--hysteresis", "1", "--loss-scale-window", "4",
              "--max-iters", "12", "--warmup-iters", "2"]
    whole, parts = str(tmp_path / "whole.safetensors"), str(tmp_path / "parts.safetensors")
    log_whole, log_parts = str(tmp_path / "whole.jsonl"), str(tmp_path / "parts.jsonl")
    assert train(*common, "--export-weights", whole, "--log-json", log_whole, cwd=tmp_path).returncode == 0
    save = str(tmp_path / "ck")
    first = train(*common, "--save", save, "--exit-interval", "6", "--log-json", log_parts, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = train(*common, "--load", save, "--export-weights", parts, "--log-json", log_parts, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    a, b = rows(log_whole), rows(log_parts)
    scales = [(r["loss_scale"], r["skipped"]) for r in a]
    assert scales[5][0] > scales[0][0] and scales[6][1], scales  # grown before the save, an overflow after
    assert [(r["loss_scale"], r["skipped"], r["lr"]) for r in a] == [(r["loss_scale"], r["skipped"], r["lr"]) for r in b]
    x, y = load_weights(whole), load_weights(parts)
    for name in x:
        numpy.testing.assert_array_equal(x[name], y[name], err_msg=name)
