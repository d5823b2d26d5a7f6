"""One writer per save directory: a lock that a crashed run cannot leave stuck.

Two runs saving into one directory would interleave their checkpoints and move each other's
``latest``. So a run that saves holds ``DIR/.lock`` for its whole life, by ``flock``: the kernel
drops the lock when the process ends, however it ends (a crash, ``kill -9``, a lost node's job
torn down), so there is no stale lock file to delete by hand. The file's text (pid, host, start
time) is only there to name the holder in the error; the lock is the ``flock``, not the file.

Only world rank 0 takes it: rank 0 alone writes ``index.json`` and ``latest``, and every other
rank writes only inside the ``iter_N.partial`` directory rank 0 made for this save.
"""

import datetime
import errno
import fcntl
import os
import socket

LOCK_FILE = ".lock"


class SaveDirectoryBusy(RuntimeError):
    """Another live run holds the save directory."""


class SaveLock:
    """Held from ``acquire`` until ``release`` or the end of the process."""

    def __init__(self, directory):
        self.directory, self.path, self.fd = directory, os.path.join(directory, LOCK_FILE), None

    def acquire(self):
        os.makedirs(self.directory, exist_ok=True)
        # O_NOFOLLOW: a planted symlink named .lock must not make us truncate the file it points to
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SaveDirectoryBusy(f"{self.directory} is in use by another run ({holder}): wait "
                                        "for it to end, or save into another directory") from None
            raise
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None
