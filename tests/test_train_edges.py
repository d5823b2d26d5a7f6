"""Unusual but plausible uses of ``python -m minipar.train``: each ends in one line naming the fix,
before any training, or does what it says."""

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

from mpi_run import MPI_SCRIPTS, run_mpi
from test_train import TINY, train

SCRIPT = os.path.join(MPI_SCRIPTS, "interrupted_at_start.py")


def test_a_prompt_that_is_not_utf8_is_refused_before_training(tmp_path, corpus):
    """A prompt of bytes that are no UTF-8 (a Latin-1 terminal) reaches Python as lone surrogates,
    which no encoder takes: found with the flags, not as a traceback after the whole run."""
    run = subprocess.run([sys.executable, "-m", "minipar.train", *TINY, "--data", corpus, "--max-iters", "2",
                          "--sample", "5", b"--prompt", b"caf\xe9"], capture_output=True, text=True, timeout=300)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "iter" not in run.stdout, run.stderr
    assert "--prompt" in lines[0] and "not UTF-8" in lines[0], lines


def test_a_decay_that_ends_within_the_warm_up_is_refused_when_the_run_passes_it():
    """--lr-decay-iters at or below --warmup-iters leaves the steps after the warm-up a cosine of no
    steps (Megatron-LM refuses it); a run that ends within its warm-up never meets it."""
    from minipar.lr_schedule import flag_problems

    def flags(**changes):
        values = dict(lr=0.01, min_lr=0.001, warmup_iters=5, lr_decay_iters=2, max_iters=8,
                      use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False, load=None)
        return argparse.Namespace(**{**values, **changes})

    (line,) = flag_problems(flags())
    assert "--lr-decay-iters 2" in line and "--warmup-iters 5" in line and "above --warmup-iters" in line
    assert flag_problems(flags(lr_decay_iters=5)) != []  # the cosine's 0 steps: refused too
    assert flag_problems(flags(max_iters=5)) == []  # all of it warm-up
    assert flag_problems(flags(lr_decay_iters=6)) == []


def test_a_resumed_runs_loss_curve_starts_at_its_first_iteration(tmp_path, corpus, monkeypatch):
    """The picture puts each loss at its iteration: a run resumed at iteration 2 plots its train
    losses from 2, where its validation points are, not from 0."""
    from minipar import plots, train as cli

    drawn = []
    monkeypatch.setattr(plots, "plot_loss", lambda losses, vals, path, title, first=0: drawn.append((first, losses, vals)))
    save = str(tmp_path / "ckpt")
    common = [*TINY, "--data", corpus, "--max-iters", "4", "--eval-interval", "1", "--eval-iters", "1",
              "--plot", str(tmp_path / "loss.png"), "--warmup-iters", "1"]
    assert cli.main([*common, "--exit-interval", "2", "--save", save]) == 0
    assert cli.main([*common, "--load", save]) == 0
    (first, losses, vals), = drawn
    assert first == 2 and len(losses) == 2 and [it for it, _ in vals] == [2, 3]


@pytest.mark.parametrize("where", ["build", "trainer"])
def test_ctrl_c_before_training_starts_is_one_line_and_status_130(where, tmp_path, corpus):
    """Reading and tokenizing a corpus, building the model and loading a checkpoint take a while
    too: a Ctrl-C then ends the run as during training, one line and status 130, no traceback."""
    save = str(tmp_path / "ckpt")
    run = subprocess.run([sys.executable, SCRIPT, where, "-1", *TINY, "--data", corpus, "--max-iters", "2",
                          "--save", save], capture_output=True, text=True, timeout=300)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 130 and len(lines) == 1, run.stderr
    assert lines[0].startswith("python -m minipar.train: interrupted before training started"), lines
    if where == "trainer":  # the save directory was claimed by then: say what it holds
        assert f"no checkpoint was saved in {save} yet" in lines[0], lines


@pytest.mark.parametrize("where", ["build", "trainer"])
def test_a_rank_interrupted_alone_before_training_ends_the_job_in_one_line(where, corpus):
    """Rank 1 interrupted while rank 0 goes on into the ranks' first collective: rank 1 says so
    itself and its exit ends the job, rank 0 waiting in MPI included."""
    code, out, _ = run_mpi(2, SCRIPT, where, "1", *TINY, "--data", corpus, "--max-iters", "2", timeout=120)
    ours = [line for line in out.splitlines() if line.startswith("python -m minipar.train:")]
    assert code != 0 and "Traceback" not in out, out
    assert ours == ["python -m minipar.train: rank 1: interrupted before training started"], out


def test_a_resumed_runs_log_has_each_iteration_once(tmp_path, corpus):
    """A run that went on past its last checkpoint (here: killed after iteration 3, its checkpoint
    of iteration 4 lost) logged rows its resume writes again: the log keeps each iteration once."""
    log, save = str(tmp_path / "log.jsonl"), str(tmp_path / "ckpt")
    common = [*TINY, "--data", corpus, "--max-iters", "4", "--save", save, "--save-interval", "2", "--log-json", log]
    assert train(*common).returncode == 0
    shutil.rmtree(os.path.join(save, "iter_0000004"))  # the crash: back to the checkpoint of iteration 2
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("iter_0000002\n")  # as sharded.save writes it
    with open(log, "a") as f:
        f.write("not a row\n")  # a line no run wrote whole: kept as it is
    run = train(*common, "--load", save)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line)["iter"] for line in open(log) if line.startswith("{")]
    assert rows == [0, 1, 2, 3] and "not a row\n" in open(log).read()
