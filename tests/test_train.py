"""The training CLI, run as a user runs it: python -m minipar.train ..."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy
import pytest

import minipar
from minipar.checkpoint import load_weights
from minipar.checkpoint.index import seal

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--eval-iters", "2", "--sample", "0", "--plot", ""]


def train(*args, cwd=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "minipar.train", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)


def losses(path):
    with open(path) as fh:
        return [json.loads(line)["loss"] for line in fh]


def saved_index(save, iteration=2):
    """(path, contents) of the index.json of the checkpoint at ``iteration`` in ``save``."""
    path = os.path.join(save, f"iter_{iteration:07d}", "index.json")
    with open(path) as fh:
        return path, json.load(fh)


def reseal(path, index):
    """Write an edited index back, sealed again as an editor would: the trainer's own checks, not
    the seal, must catch the edit."""
    with open(path, "w") as fh:
        json.dump(seal(index), fh)


def test_same_seed_same_losses_and_another_seed_differs(tmp_path, corpus):
    logs = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        log = str(tmp_path / f"{name}.jsonl")
        run = train(*TINY, "--data", corpus, "--max-iters", "6", "--seed", seed, "--log-json", log)
        assert run.returncode == 0, run.stderr
        logs.append(losses(log))
    assert len(logs[0]) == 6
    assert logs[0] == logs[1]
    assert logs[0] != logs[2]


def test_dropout_runs_are_deterministic_too(tmp_path, corpus):
    logs = []
    for name in ("a", "b"):
        log = str(tmp_path / f"{name}.jsonl")
        run = train(*TINY, "--data", corpus, "--max-iters", "4", "--dropout", "0.2", "--log-json", log)
        assert run.returncode == 0, run.stderr
        logs.append(losses(log))
    assert logs[0] == logs[1]


def test_loss_falls_on_the_default_corpus(tmp_path):
    log = str(tmp_path / "log.jsonl")
    plot = str(tmp_path / "loss.png")
    run = train("--max-iters", "40", "--eval-interval", "20", "--log-json", log, "--plot", plot,
                "--sample", "20")  # loss 2.77, validation 2.79 at iteration 39
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in open(log)]
    assert records[0]["loss"] > 5.0  # ln 256 = 5.55 for a uniform guess
    assert records[-1]["loss"] < 3.2 and records[-1]["val_loss"] < 3.2
    assert "iter    39 | loss" in run.stdout and "tok/s" in run.stdout and "sample:" in run.stdout
    assert open(plot, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_export_then_init_weights(tmp_path, corpus):
    first = str(tmp_path / "first.safetensors")
    second = str(tmp_path / "second.safetensors")
    run = train(*TINY, "--data", corpus, "--max-iters", "3", "--export-weights", first)
    assert run.returncode == 0, run.stderr
    # lr 0 leaves the weights where they started, so the export equals the import
    run = train(*TINY, "--data", corpus, "--max-iters", "2", "--lr", "0", "--min-lr", "0",
                "--init-weights", first, "--export-weights", second, "--dtype", "float64")
    assert run.returncode == 0, run.stderr
    a, b = load_weights(first), load_weights(second)
    assert "transformer.h.1.attn.c_attn.weight" in a and b["transformer.wte.weight"].dtype == numpy.float64
    for name in a:
        numpy.testing.assert_allclose(a[name], b[name], rtol=0, atol=0)


@pytest.mark.parametrize("args,message", [
    (["--n-embd", "10", "--n-head", "4"], "--n-embd 10 is not divisible by --n-head 4"),
    (["--max-iters", "-1"], "must be >= 0"),
    (["--lr", "abc"], "is not a number"),
    (["--dtype", "float16"], "invalid choice"),
    (["--data", "/nonexistent/corpus.txt"], "no such file"),
    (["--init-weights", "w.safetensors"], "no such file"),
    # a corpus shorter than one sequence, with a sequence short enough to fit any machine's memory
    (["--block-size", "400", "--global-batch-size", "1", "--n-layer", "1", "--data", "SHORT_CORPUS"],
     "too few for --block-size"),
    (["--dropout", "1.5"], "in [0, 1)"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--data", "/dev/null"], "neither a regular file nor a directory"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor must be a positive number"),
    (["--num-experts", "4", "--moe-router-topk", "0"], "--moe-router-topk: must be >= 1"),
    (["--fp16", "--initial-loss-scale", "0.5"], "--min-loss-scale 1 (the default) is above --initial-loss-scale 0.5"),
    (["--fp16", "--min-loss-scale", "1e10"], "--min-loss-scale 1e+10 is above --initial-loss-scale 4.29497e+09 (the default)"),
])
def test_bad_values_get_a_one_line_error(args, message, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n    return x\n" * 10)
    args = [str(short) if a == "SHORT_CORPUS" else a for a in args]
    run = train(*(args if "--max-iters" in args else args + ["--max-iters", "1"]), cwd=tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and message in lines[0], run.stderr


def test_every_bad_size_is_reported_at_once_one_line_each(tmp_path):
    run = train("--n-embd", "10", "--n-head", "4", "--sequence-parallel", "--zero-stage", "3", "--schedule", "zb-h1",
                "--num-virtual-stages", "2", "--max-iters", "1", cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and all(line.startswith("python -m minipar.train: error: ") for line in lines), run.stderr
    assert len(lines) == 3, run.stderr
    for message in ("--n-embd 10 is not divisible by --n-head 4",
                    "--num-virtual-stages 2 needs --pp > 1 and --schedule interleaved",
                    "--sequence-parallel splits along the tensor-parallel group: it needs --tp > 1"):
        assert sum(message in line for line in lines) == 1, (message, run.stderr)


def test_every_bad_expert_size_is_reported_at_once_one_line_each(tmp_path):
    run = train("--num-experts", "3", "--ep", "2", "--moe-router-topk", "4", "--max-iters", "1", cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 3, run.stderr
    for message in ("expert parallelism is carved out of DP x CP: --ep 2 does not divide DP=1",
                    "--num-experts 3 is not divisible by --ep 2",
                    "--moe-router-topk 4 exceeds --num-experts 3"):
        assert sum(message in line for line in lines) == 1, (message, run.stderr)
    run = train("--ep", "2", "--max-iters", "1", cwd=tmp_path)
    assert run.returncode == 2 and "--ep 2 splits the experts of mixture-of-experts layers: give --num-experts" in run.stderr


def test_a_mixture_of_experts_run_logs_its_routing(tmp_path, corpus):
    log = str(tmp_path / "log.jsonl")
    run = train(*TINY, "--data", corpus, "--max-iters", "2", "--num-experts", "4", "--moe-layer-freq", "2",
                "--moe-aux-loss-coeff", "0.01", "--moe-expert-capacity-factor", "1.0", "--log-json", log, "--report")
    assert run.returncode == 0, run.stderr
    record = json.loads(open(log).readline())
    assert record["moe_layers"] == [0] and len(record["tokens_per_expert"][0]) == 4
    # every token-slot is taken or dropped: batch 4 x 16 tokens, top-2
    assert sum(record["tokens_per_expert"][0]) + record["dropped"][0] == 4 * 16 * 2
    assert record["aux_loss"] == pytest.approx(0.01, rel=0.5) and record["z_loss"] == 0.0
    assert "experts: 1 MoE layers of 4 experts, top-2, capacity factor 1.0" in run.stdout
    assert "routing in the last step" in run.stdout and "layer   0:" in run.stdout


def test_the_validation_loss_is_the_models_mean_loss_over_the_validation_batches(tmp_path, corpus):
    """val_loss, recomputed from the exported weights: the mean over --eval-iters batches of the
    validation split, in eval mode (dropout off), not training batches or dropped activations."""
    from minipar.autograd import no_grad
    from minipar.data import Dataset, load_corpus
    from minipar.models import GPT, GPTConfig

    weights, log = str(tmp_path / "w.safetensors"), str(tmp_path / "log.jsonl")
    run = train(*TINY, "--data", corpus, "--max-iters", "1", "--eval-iters", "3", "--dropout", "0.1",
                "--dtype", "float64", "--seed", "5", "--export-weights", weights, "--log-json", log)
    assert run.returncode == 0, run.stderr
    with open(log) as fh:
        logged = json.loads(fh.readline())["val_loss"]
    minipar.set_default_dtype("float64")
    try:
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=256, dropout=0.1))
        model.load_state_dict(load_weights(weights))
        model.eval()
        data = Dataset(load_corpus(corpus))
        with no_grad():
            expected = sum(model(*data.batch("val", i, 4, 16, 5))[1].item() for i in range(3)) / 3
    finally:
        minipar.set_default_dtype("float32")
    assert logged == pytest.approx(expected, rel=1e-12)


def test_recompute_granularity_full_is_recompute():
    """Megatron's two spellings of full recomputation set the same run: what the memory check, the
    layout line and the executor read."""
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    for flags in (["--recompute"], ["--recompute-granularity", "full"]):
        args = build_parser().parse_args(flags)
        check_args(args, 1)
        assert args.recompute, flags


def test_help_describes_every_flag():
    run = train("--help")
    assert run.returncode == 0
    for flag in ("--max-iters", "--seed", "--lr", "--batch-size", "--n-layer", "--n-head", "--n-embd",
                 "--block-size", "--data", "--dtype", "--log-json", "--init-weights", "--export-weights"):
        assert flag in run.stdout
    text = " ".join(run.stdout.split())  # argparse wraps at $COLUMNS: "(default:" may end a line
    assert "(default: 0.003)" in text  # a default worth showing is shown; None and False are not
    assert "(default: None)" not in text and "(default: False)" not in text


def test_divergence_stops_with_an_error(corpus):
    run = train(*TINY, "--data", corpus, "--max-iters", "30", "--lr", "1e12", "--warmup-iters", "0",
                "--min-lr", "0", "--grad-clip", "0")
    assert run.returncode == 1
    assert "training diverged" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("flag", ["--log-json", "--export-weights", "--plot"])
def test_unwritable_outputs_fail_before_training(flag, tmp_path, corpus):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = str(blocker / "sub" / "out.safetensors")  # a directory inside a regular file
    run = train(*TINY, "--data", corpus, "--max-iters", "1", flag, path)
    assert run.returncode == 2
    assert "iter" not in run.stdout and flag in run.stderr


def test_weights_of_another_model_are_refused_in_one_line(tmp_path, corpus):
    weights = str(tmp_path / "w.safetensors")
    assert train(*TINY, "--data", corpus, "--max-iters", "1", "--export-weights", weights).returncode == 0
    run = train(*TINY, "--data", corpus, "--max-iters", "1", "--n-layer", "3", "--init-weights", weights)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing: transformer.h.2" in lines[0] and "must match" in lines[0]


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is here: test_gpu.py covers the GPU")
def test_cuda_without_cupy_is_a_one_line_error(corpus):
    run = train(*TINY, "--data", corpus, "--max-iters", "1", "--device", "cuda")
    assert run.returncode == 2 and "--device cuda: the cuda device needs CuPy: pip install" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


PEAKS = """import sys
import minipar.trainer
peaks = iter([1e6, 1e15, 1.0])  # FLOP/s: a busy machine at the start, a quiet one, a busy one again
minipar.trainer.measured_peak = lambda world, dtype, **how: next(peaks)
from minipar.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_peak_is_measured_again_at_each_evaluation_and_the_highest_kept(tmp_path):
    """A peak measured while the machine was busy made the README's run report an MFU of 252%."""
    script, log = tmp_path / "peaks.py", tmp_path / "log.jsonl"
    script.write_text(PEAKS)
    run = subprocess.run([sys.executable, str(script), *TINY, "--max-iters", "4", "--eval-interval", "2",
                          "--log-json", str(log)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    mfu = [json.loads(line)["mfu"] for line in open(log)]
    assert mfu[0] > 1 and mfu[1] > 1 and mfu[2] < 1e-3 and mfu[3] < 1e-3, mfu  # 1e15 from the first evaluation on


def test_the_peak_is_measured_again_before_each_progress_line(tmp_path):
    """Lines at iterations 0, 2, 4 and 6; the evaluation only after the last: the busy start's
    peak misleads iterations 0 and 1 only (the line at 0 needs no new one: it was just measured),
    and the busy measurement at 4 does not replace the quiet one at 2."""
    script, log = tmp_path / "peaks.py", tmp_path / "log.jsonl"
    script.write_text(PEAKS.replace("[1e6, 1e15, 1.0]", "[1e6, 1e15, 1.0, 1.0]"))
    run = subprocess.run([sys.executable, str(script), *TINY, "--max-iters", "7", "--eval-interval", "100",
                          "--log-interval", "2", "--log-json", str(log)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    mfu = [json.loads(line)["mfu"] for line in open(log)]
    assert mfu[0] > 1 and mfu[1] > 1 and all(m < 1e-3 for m in mfu[2:]), mfu
    assert [line.split("|")[-1].strip() for line in run.stdout.splitlines() if line.startswith("iter")][1:] == [
        "MFU  0.0%"] * 3, run.stdout


@pytest.mark.parametrize("lr,message", [
    ("1e39", "python -m minipar.train: error: the weights after the last step are not finite: its update diverged"),  # inf weights
    ("1e38", "python -m minipar.train: error: --sample: the next token's probabilities are not finite"),  # finite, logits overflow
])
def test_a_last_update_that_diverged_is_an_error_not_a_traceback(lr, message, corpus):
    """The divergence check reads each step's loss, computed before its update: the last update's
    weights are checked before anything is written from them, and sampling refuses what overflows."""
    run = train(*TINY, "--data", corpus, "--max-iters", "1", "--warmup-iters", "0", "--lr", lr, "--sample", "10")
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1].startswith(message), run.stderr
    assert "Traceback" not in run.stderr
