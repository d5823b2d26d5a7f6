"""Lessons are programs a reader runs: each must pass as shipped and fail when its subject breaks."""

import os
import re
import subprocess
import sys

LESSONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lessons")


def run_lesson(name, *args):
    return subprocess.run([sys.executable, os.path.join(LESSONS, name), *args],
                          capture_output=True, text=True, timeout=300)


def test_autograd_lesson_passes():
    run = run_lesson("01_autograd.py")
    assert run.returncode == 0, run.stdout + run.stderr
    passed = re.search(r"(\d+)/(\d+) checks passed", run.stdout)
    assert passed and passed.group(1) == passed.group(2) and int(passed.group(2)) > 60
    assert "control was caught" in run.stdout


def test_autograd_lesson_fails_on_a_planted_bug():
    run = run_lesson("01_autograd.py", "--plant-bug")
    assert run.returncode == 1
    assert "FAIL" in run.stdout and "MISMATCH" in run.stdout


def test_gemm_kernel_lesson_passes():
    run = run_lesson("07_gemm_kernel.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "naive    33,554,432 elements" in run.stdout and "tiled       262,144 elements" in run.stdout
    assert "without the first __syncthreads(): relative error" in run.stdout
    assert "128x fewer loads" in run.stdout


def test_gemm_kernel_lesson_fails_on_a_planted_bug():
    run = run_lesson("07_gemm_kernel.py", "--plant-bug")
    assert run.returncode == 1 and "MISMATCH" in run.stdout, run.stdout + run.stderr
