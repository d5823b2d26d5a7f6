"""A hang becomes an error: a piece of training that does not end in time ends the job.

An exception on one rank aborts every rank (``start.py``), but some failures raise nothing. A rank
that stops early without an error (a bug that returns from the loop on one rank, a process
killed in a way its launcher misses) leaves the others waiting in a collective it will never
join; two ranks that disagree on the order of their collectives wait for each other. MPICH's
blocking calls spin while they wait, so such a job burns its cores until someone kills it.

Megatron-LM gives torch.distributed a timeout (``--distributed-timeout-minutes``, 10 by default):
NCCL's watchdog ends a collective that has not completed by then. A collective on MPI cannot be
given a deadline, so this watchdog gives one to each piece of training around them: a step, an
evaluation, a checkpoint save, each with the whole limit (a wider net than Megatron's: a piece
that is only slow, past the limit, ends too). A thread wakes once a second; when the piece armed
last has run past its deadline, it prints which piece, and where this rank's threads are
(``faulthandler``: the frame it waits in names the collective), then aborts the job. Every rank
that waits does the same, so the report shows each rank's place. The thread can run while the
main thread waits, since mpi4py releases the GIL inside MPI calls (and our polite waits sleep).
"""

import faulthandler
import sys
import threading
import time
import traceback


class Watchdog:
    """``arm(what)`` at the start of each piece of work that must end within ``seconds``;
    ``close()`` when there is no more. ``seconds`` 0: never fires. ``flag``: the setting, as the
    message names it. ``abort``: what ends the job (the trainer's: its world's ``abort``, which
    lets the launcher read this rank's report first). ``prog``: the command, which starts its error line,
    and ``rank`` this process's, which the line names."""

    def __init__(self, seconds, flag, abort, prog=None, rank=None):
        self.seconds, self.flag, self.abort = seconds, flag, abort
        # how the command's error lines start, naming the rank: every rank that waits reports
        self.said = (f"{prog}: " if prog else "") + "error:" + (f" rank {rank}:" if rank is not None else "")
        self.armed = None  # (what, deadline)
        self.stop = threading.Event()
        self.thread = None
        if seconds > 0:
            self.thread = threading.Thread(target=self._watch, name="minipar-watchdog", daemon=True)
            self.thread.start()

    def arm(self, what):
        """``what``: the work's name, or a function that says it when the watchdog fires (what a
        save had done by then)."""
        self.armed = (what, time.monotonic() + self.seconds)  # one attribute: read whole by the thread

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
            armed = self.armed
            if armed is not None and time.monotonic() > armed[1] and self.armed is armed:  # (not re-armed since)
                self._fire(armed[0])
                return

    def _fire(self, what):
        """Say what has not ended and where this rank is, then end the job, whatever the saying raises."""
        try:
            what = what() if callable(what) else what
            print(f"{self.said} {what} has not ended after {self.seconds:g} s ({self.flag}): a rank stopped, "
                  "or waits for a message or collective that never comes. Where this rank is:",
                  file=sys.stderr, flush=True)
            try:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            except (AttributeError, ValueError, OSError):  # a stream without a file descriptor (captured)
                for frame in sys._current_frames().values():
                    print("".join(traceback.format_stack(frame)), file=sys.stderr, flush=True)
        finally:
            self.abort()
