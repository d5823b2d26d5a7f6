"""Each bad input to the training CLI and the launcher is one line and exit status 2, never a
traceback, and is found before training starts (issue 12)."""

import os
import subprocess

import pytest

from mpi_run import ROOT
from test_train import TINY, train

PROG = "python -m minipar.train: error: "
ONE_STEP = [*TINY, "--max-iters", "1", "--eval-iters", "1"]


def refused(run, *words):
    """The run ended with status 2 and one error line holding every word, before any step."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert all(w in lines[0] for w in words), (words, lines[0])
    assert "iter " not in run.stdout, run.stdout
    return lines[0]


@pytest.mark.parametrize("ranks", ["99999999999999999999", "1000001"])
def test_the_launcher_refuses_more_ranks_than_it_can_count(ranks):
    run = subprocess.run(["env", "PYTHON=/bin/false", os.path.join(ROOT, "run_mpi.sh"), "-n", ranks, __file__],
                         capture_output=True, text=True, timeout=30)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and f"-n {ranks}: at most 1000000 ranks" in lines[0], run.stderr


@pytest.mark.parametrize("plot,words", [("out/loss.xyz", ["--plot out/loss.xyz", "cannot write a .xyz file", ".png"]),
                                        ("foo", ["--plot foo", "no extension", "would write foo.png"])])
def test_a_plot_matplotlib_cannot_write_is_refused_before_training(plot, words, tmp_path):
    refused(train(*ONE_STEP, "--plot", plot, cwd=tmp_path), PROG, *words)
    assert not (tmp_path / "out" / "loss.xyz").exists()
