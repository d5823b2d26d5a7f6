"""The benchmark runs (timings themselves are never asserted: this machine is shared)."""

import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "step_time.py")


def test_step_time_benchmark_runs_and_reports():
    run = subprocess.run([sys.executable, BENCH, "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                          "--block-size", "16", "--batch-size", "2", "--steps", "1", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "first loss  minipar" in run.stdout and "GFLOP/s" in run.stdout
    if "first loss  pytorch" in run.stdout:  # both models computed the same first loss
        assert "minipar / pytorch" in run.stdout
