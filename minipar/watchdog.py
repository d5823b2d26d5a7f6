"""A hang becomes an error: a training iteration that does not end in time ends the job.

An exception on one rank aborts every rank (``start.py``), but some failures raise nothing. A rank
that stops early without an error (a bug that returns from the loop on one rank, a process
killed in a way its launcher misses) leaves the others waiting in a collective it will never
join; two ranks that disagree on the order of their collectives wait for each other. MPICH's
blocking calls spin while they wait, so such a job burns its cores until someone kills it.

Megatron-LM gives torch.distributed a timeout (``--distributed-timeout-minutes``, 10 by default):
NCCL's watchdog ends a collective that has not completed by then. A collective on MPI cannot be
given a deadline, so this watchdog times each training iteration as a whole (its step, and the
evaluation and checkpoint that follow it). A thread wakes once a second; when the iteration armed
last has run past its deadline, it prints which iteration, and where this rank's threads are
(``faulthandler``: the frame it waits in names the collective), then aborts the job. Every rank
that waits does the same, so the report shows each rank's place. The thread can run while the
main thread waits, since mpi4py releases the GIL inside MPI calls (and our polite waits sleep).
"""

import faulthandler
import os
import sys
import threading
import time

from minipar.start import let_output_through


class Watchdog:
    """``arm(what)`` at the start of each piece of work that must end within ``seconds``;
    ``close()`` when there is no more. ``seconds`` 0: never fires. ``flag``: the setting, as the
    message names it. ``abort``: what ends the job (by default MPI_Abort on every rank, or the
    process alone without MPI)."""

    def __init__(self, seconds, flag, abort=None):
        self.seconds, self.flag, self.abort = seconds, flag, abort or _abort
        self.deadline, self.what = None, None
        self.stop = threading.Event()
        self.thread = None
        if seconds > 0:
            self.thread = threading.Thread(target=self._watch, name="minipar-watchdog", daemon=True)
            self.thread.start()

    def arm(self, what):
        self.what, self.deadline = what, time.monotonic() + self.seconds

    def close(self):
        self.stop.set()
        if self.thread is not None:
            self.thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _watch(self):
        while not self.stop.wait(min(1.0, self.seconds / 4)):
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fire()
                return

    def _fire(self):
        print(f"error: {self.what} has not ended after {self.seconds:g} s ({self.flag}): a rank stopped, "
              "or waits for a message or collective that never comes. Where this rank is:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.abort()


def _abort():
    """End every rank: MPI_Abort, once the launcher has read what this rank printed."""
    let_output_through()
    if "mpi4py.MPI" in sys.modules:
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)
    os._exit(1)
