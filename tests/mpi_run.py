"""Run a script on N MPI ranks from a test: a subprocess in its own process group, a timeout that
kills the whole group, and every rank's output in the failure message. And single-process runs
started side by side (``run_together``)."""

import os
import signal
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "run_mpi.sh")
MPI_SCRIPTS = os.path.join(ROOT, "tests", "mpi")


def run_mpi(n, script, *args, timeout=120, command=None, env=None):
    """Launch ``script`` (a path, or a file name under tests/mpi/) on ``n`` ranks through
    run_mpi.sh, or through ``command`` (a list, e.g. a hand-typed mpiexec line), with the
    variables of ``env`` added to this process's. Returns (exit code, combined output, seconds)."""
    if command is None and not os.path.isabs(script) and not os.path.exists(script):
        script = os.path.join(MPI_SCRIPTS, script)
    cmd = command or [LAUNCHER, "-n", str(n), script, *[str(a) for a in args]]
    # The ranks run this test's interpreter (run_mpi.sh reads PYTHON), wherever it is installed.
    env = dict(os.environ, **(env or {}), PYTHON=sys.executable,
               PATH=sysconfig.get_path("scripts") + os.pathsep + os.environ.get("PATH", ""))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout} s; output:\n{out}") from None
    return proc.returncode, out, time.monotonic() - start


def run_train(n, *args, timeout=180):
    """``python -m minipar.train`` with ``args`` on ``n`` ranks through run_mpi.sh: (exit code, output, seconds)."""
    return run_mpi(n, None, timeout=timeout, command=[LAUNCHER, "-n", str(n), "-m", "minipar.train", *map(str, args)])


def logged_losses(path):
    """The losses of a --log-json file, in order."""
    import json

    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


def _kill_session(sid):
    """Kill every process of the launcher's session. Killing its process group is not enough:
    Open MPI's launcher puts each rank in a process group of its own (the session stays)."""
    os.killpg(sid, signal.SIGKILL)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run_together(commands, timeout=300):
    """{key: its CompletedProcess} for ``commands`` ({key: argv}), all started at once. For runs
    of one process that keep one core busy each: two cores finish them in about half the time
    they take one after another. Past ``timeout`` (for any one of them) every one is killed."""
    started = {key: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
               for key, argv in commands.items()}
    try:
        outputs = {key: p.communicate(timeout=timeout) for key, p in started.items()}
    finally:
        for p in started.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return {key: subprocess.CompletedProcess(p.args, p.returncode, *outputs[key]) for key, p in started.items()}


def check_mpi(n, script, *args, timeout=120):
    """Run and require exit 0; returns the output."""
    code, out, _ = run_mpi(n, script, *args, timeout=timeout)
    assert code == 0, f"{script} on {n} ranks exited {code}; output of all ranks:\n{out}"
    return out


PYTHON = sys.executable
