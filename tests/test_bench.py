"""The benchmark runs (timings themselves are never asserted: this machine is shared)."""

import importlib.util
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "step_time.py")


def test_step_time_benchmark_runs_and_reports():
    run = subprocess.run([sys.executable, BENCH, "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                          "--block-size", "16", "--batch-size", "2", "--steps", "1", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "first loss  minipar" in run.stdout and "GFLOP/s" in run.stdout
    if "first loss  pytorch" in run.stdout:  # both models computed the same first loss
        assert "minipar / pytorch" in run.stdout


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is here: gpu_check.sh runs these")
def test_gpu_benchmarks_say_clearly_when_there_is_no_gpu():
    bench = os.path.dirname(BENCH)
    for script in ("gemm.py", "gpu_step.py"):
        run = subprocess.run([sys.executable, os.path.join(bench, script)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and "needs CuPy and a GPU" in run.stdout and "nothing timed" in run.stdout
