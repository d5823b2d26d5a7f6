"""Ctrl-C ends a run with one line that says where it stopped and what checkpoint survives, and
exit status 130, on one rank and on many; a rank interrupted alone says so itself."""

import os
import re
import signal
import subprocess
import sys

import pytest

from mpi_run import LAUNCHER, ROOT, _kill_session
from test_train import TINY

LONG = [*TINY, "--max-iters", "100000", "--log-interval", "1", "--eval-interval", "100000"]


def _started(command, cwd, **popen):
    """``command`` running in a session of its own, once it has printed its first progress line."""
    # a shell that ran these tests in the background may have left SIGINT ignored: undo that here
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)
    line = run.stdout.readline()
    while not line.startswith("iter"):  # printed after the step's checkpoint was saved
        if not line:
            run.kill()
            raise AssertionError(f"the run ended before its first progress line: {run.stderr.read()}")
        line = run.stdout.readline()
    return run


def _ended(run, session=False):
    try:
        out, err = run.communicate(timeout=60)
    finally:
        try:
            _kill_session(run.pid) if session else run.kill()
        except ProcessLookupError:  # the launcher's session is gone already
            pass
    return run.returncode, [line for line in err.splitlines() if not line.startswith("Abort(")]  # MPI's own


@pytest.mark.parametrize("save", [False, True])
def test_ctrl_c_ends_the_run_with_one_line_and_status_130(save, tmp_path):
    args = [*LONG, "--save", str(tmp_path / "ckpt"), "--save-interval", "1"] if save else LONG
    run = _started([sys.executable, "-m", "minipar.train", *args], tmp_path)
    run.send_signal(signal.SIGINT)
    code, lines = _ended(run)
    assert code == 130 and len(lines) == 1 and "Traceback" not in lines[0], lines
    # a signal that lands between a step's save and the next step is said after the saved step
    said = re.match(r"python -m minipar\.train: interrupted (at|after) iteration (\d+)", lines[0])
    assert said and (save or said[1] == "at"), lines[0]
    if save:
        kept = int(said[2]) + 1 if said[1] == "after" else None
        assert f"the last checkpoint in {tmp_path / 'ckpt'} (iteration {kept or ''}" in lines[0], lines[0]
        assert "--load" in lines[0], lines[0]
    else:
        assert "checkpoint" not in lines[0]


def _rank_process(launcher, rank):
    """The pid of MPI rank ``rank`` among the launcher's descendants (MPICH's launcher starts each
    rank in a session of its own, and names its rank in PMI_RANK)."""
    parent, environ = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ[int(pid)] = f.read().split(b"\0")
        except OSError:
            continue
    for pid, env in environ.items():
        ancestor = pid
        while ancestor in parent and ancestor != launcher:
            ancestor = parent[ancestor]
        if ancestor == launcher and f"PMI_RANK={rank}".encode() in env:
            return pid
    return None


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks' processes in /proc")
@pytest.mark.parametrize("whole_job", [True, False])
def test_ctrl_c_to_a_job_prints_one_line_and_a_rank_interrupted_alone_its_own(whole_job, tmp_path):
    run = _started([LAUNCHER, "-n", "2", "-m", "minipar.train", *LONG], ROOT, start_new_session=True,
                   env=dict(os.environ, PYTHON=sys.executable))
    if whole_job:  # as a terminal's Ctrl-C: the launcher's whole process group
        os.killpg(run.pid, signal.SIGINT)
    else:
        pid = _rank_process(run.pid, 1)
        if pid is None:
            _kill_session(run.pid)
            pytest.skip("no process with PMI_RANK=1: not MPICH's launcher")
        os.kill(pid, signal.SIGINT)
    code, lines = _ended(run, session=True)
    ours = [line for line in lines if line.startswith("python -m minipar.train:")]
    assert code != 0 and len(ours) == 1 and "Traceback" not in "".join(lines), lines
    # the whole job: rank 0 speaks, unless the signal found it inside MPI waiting for rank 1
    who = "(rank 1: )?" if whole_job else "rank 1: "
    assert re.match(f"python -m minipar.train: {who}interrupted at iteration ", ours[0]), ours


def test_an_interruption_between_a_save_and_the_next_step_is_said_after_the_saved_step(monkeypatch):
    """Stopped after iteration 143's checkpoint (144) was written, before 144 began: "at iteration
    143" beside a checkpoint of 144 read as if the checkpoint held a step the run never finished."""
    from types import SimpleNamespace

    from minipar import train, train_report

    monkeypatch.setattr(train_report, "last_checkpoint", lambda save: 144)
    args = SimpleNamespace(save="ckpt")
    assert train.interrupted(args, 143).startswith("interrupted after iteration 143; the last checkpoint in ckpt "
                                                   "(iteration 144) is kept")
    assert train.interrupted(args, 150).startswith("interrupted at iteration 150;")
    assert train.interrupted(args, 5).startswith("interrupted at iteration 5;")  # a resume from an older one
