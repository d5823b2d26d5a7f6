"""Start MPI before anything else when an MPI launcher started this process.

A rank that fails before ``MPI_Init`` (a package missing on one node, no GPU visible to one rank)
cannot abort the job: MPI does not know it yet, and the other ranks wait in ``MPI_Init`` for it
forever (seen with MPICH's launcher). So ``import minipar`` initialises MPI first whenever a
launcher's variables say this process is a rank, and installs a hook that turns an uncaught
exception into an abort of every rank. A plain ``python script.py`` never touches MPI.

This module imports only the standard library (and mpi4py when launched), being the first of
minipar to run, before NumPy. (It sat in ``comm/`` once, whose ``__init__`` imports NumPy: a rank
with a broken NumPy then failed before ``MPI_Init`` and the job hung.)
"""

import os
import stat
import sys
import time

# What MPICH's (and Intel's) launcher, Open MPI's and PMIx-based launchers set in every rank.
LAUNCHER_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_hooked = False


def launched_by_mpi():
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def abort_on_uncaught_exception():
    """An exception that ends one rank ends the job, even when the script was started with a
    plain ``mpirun python script.py`` rather than ``python -m mpi4py``: otherwise the other
    ranks would wait forever for the rank that is gone."""
    global _hooked
    if _hooked:
        return
    from mpi4py import MPI

    previous = sys.excepthook

    def hook(kind, value, traceback):
        try:  # which rank failed: the tracebacks of several ranks read alike
            print(f"rank {MPI.COMM_WORLD.Get_rank()} of {MPI.COMM_WORLD.Get_size()} ends the job:", file=sys.stderr,
                  flush=True)
            previous(kind, value, traceback)
            let_output_through()
        finally:
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook, _hooked = hook, True


def let_output_through(limit=3.0, linger=0.3, fds=(1, 2)):
    """Call before ``MPI_Abort``: wait until the launcher has read what this rank wrote.

    MPICH's launcher reads each rank's stdout and stderr from a pipe, in the same event loop that
    receives the abort. If it handles the abort first, it kills the job with the error message
    still in the pipe: CI once saw a failing job end with exit code 1 and no output at all. So
    wait (at most ``limit`` seconds) until both pipes are empty, then ``linger`` a little so the
    launcher passes the text on, and another rank failing at the same moment can finish its own.
    How many bytes a pipe holds is asked of its write end (FIONREAD), which Linux answers; on
    other systems this only lingers. Never raises: it stands between a failure and the abort.
    Returns whether the launcher read everything in time (False: the limit came first, or the
    pipes could not be asked)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # closed, None (a rank started with its stdout closed), or broken
            pass
    read = False
    if sys.platform.startswith("linux"):
        try:
            read = _wait_for_pipes(fds, time.monotonic() + limit)
        except Exception:
            pass
    time.sleep(linger)
    return read


def _wait_for_pipes(fds, deadline):
    pipes = [fd for fd in fds if _is_pipe(fd)]
    while pipes and time.monotonic() < deadline:
        pipes = [fd for fd in pipes if unread_bytes(fd) > 0]
        if pipes:
            time.sleep(0.01)
    return not pipes


def unread_bytes(fd):
    """Bytes written to the pipe ``fd`` (either end) that its reader has not read yet (Linux)."""
    import fcntl
    import termios

    count = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return int.from_bytes(count, sys.byteorder)


def _is_pipe(fd):
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:  # closed
        return False


def start_mpi_first():
    if not launched_by_mpi():
        return
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        abort_on_uncaught_exception()
