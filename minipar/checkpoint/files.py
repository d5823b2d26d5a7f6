"""Writing a checkpoint's files: whole or not at all, never through a link someone planted.

``write_file`` creates a fresh temporary file beside the target (``tempfile.mkstemp``: O_CREAT |
O_EXCL | O_NOFOLLOW, so an existing name, a symbolic link included, is never opened), writes and
flushes it, and renames it over the target. A rename replaces a link named like the target rather
than writing where it points, and a crash leaves the old file or the new one, never half of one.

Every file gets the mode any file the user writes gets (0666 less the umask, as ``weights.py``'s),
not mkstemp's private 0600: a checkpoint's shards and its index are read alike.
"""

import os
import shutil
import stat
import tempfile


def umask():
    mask = os.umask(0)  # the only way to read it is to set it, so put it straight back
    os.umask(mask)
    return mask


def file_mode():
    return 0o666 & ~umask()


def write_all(fd, data):
    """Write all of the buffer ``data`` to the file descriptor ``fd`` and return its length in
    bytes: ``os.write`` may take only part of it (a disk filling up, a signal, over 2 GiB)."""
    view = memoryview(data).cast("B")
    size = len(view)
    while view:
        view = view[os.write(fd, view):]
    return size


def write_file(path, data):
    """Write the bytes ``data`` (or a list of C-contiguous buffers, one after the other) to ``path``
    atomically and durably; return how many bytes were written. An OSError (the disk is full) leaves no
    temporary file behind and names ``path``."""
    directory, name = os.path.split(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory or ".")
    except OSError as exc:
        exc.filename = path  # mkstemp's error names the temporary it could not make
        raise
    written = 0
    try:
        try:
            os.fchmod(fd, file_mode())
            for part in data if isinstance(data, list) else [data]:
                written += write_all(fd, part)
            os.fsync(fd)  # the bytes are on disk before the rename can name them
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return written
    except OSError as exc:
        remove(tmp)
        exc.filename = path  # os.write's error names no file, and the temporary's name is ours
        raise
    except BaseException:
        remove(tmp)
        raise


def cannot_create_in(directory):
    """Why no file can be created in ``directory`` (its OSError's words), or None if one can: a file
    is created and removed, since permission bits say yes where a read-only mount or a kernel file
    system (/proc) says no."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".minipar-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(probe)
    return None


def folder_problem(folder):
    """Why files cannot be written into ``folder`` (which the writer makes, with its parents, if
    missing), in words, or None: asked before a run that writes there at its end. Nothing is left
    behind, so a refused run changes nothing: a missing folder is judged by the nearest folder
    above it that exists, where the writer will have to make it."""
    folder = os.path.abspath(folder)
    existing = folder
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is {'a file' if os.path.exists(existing) else 'a link to nothing'}, not a folder"
    why = cannot_create_in(existing)
    if why is None:
        return None
    made = "" if existing == folder else f" (to make {os.path.relpath(folder, existing)} there)"
    return f"cannot create a file in {existing}{made} ({why})"


def fsync_dir(path):
    """Make the renames inside directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_plain(path, kind):
    """Whether ``path`` is a real ``kind`` ("dir" or "file") and not a symbolic link to one."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return stat.S_ISDIR(mode) if kind == "dir" else stat.S_ISREG(mode)


def remove(path):
    """Remove whatever ``path`` is, if anything: a link is unlinked (what it names is untouched),
    a directory is removed with its contents. Errors are ignored: this is cleaning up."""
    try:
        if is_plain(path, "dir"):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass
