"""A save directory over a run: what crashed saves left is removed, old checkpoints are pruned.

Both are for one process that owns the save directory (the trainer, holding its lock; rank 0),
never called while a save is running: a save's own ``iter_N.partial`` is not stale.

    remove_stale_partials(directory)   every ``iter_N.partial`` a crashed save left, the temporary
                                       files of ``latest``, and an ``iter_N.old`` whose ``iter_N``
                                       is complete (a re-save that stopped before removing it); an
                                       ``iter_N.old`` with no ``iter_N`` is renamed back to it
    prune(directory, keep)             the oldest complete checkpoints, so that at most ``keep``
                                       remain; never the one ``latest`` names

Only names this package writes are touched, and a link is only ever unlinked, never followed.
"""

import os
import re

from minipar.checkpoint.files import fsync_dir, is_plain, remove
from minipar.checkpoint.index import ITER_NAME, CheckpointError, find

_STALE = re.compile(r"iter_[0-9]{7,}\.partial|\.latest\..*\.tmp")
_OLD = re.compile(r"(iter_[0-9]{7,})\.old")


def _complete(directory, name):
    path = os.path.join(directory, name)
    return is_plain(path, "dir") and is_plain(os.path.join(path, "index.json"), "file")


def remove_stale_partials(directory):
    """Remove what crashed saves left in the save directory ``directory``; returns the names
    removed. A directory that does not exist yet has nothing to remove."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        old = _OLD.fullmatch(name)
        if _STALE.fullmatch(name) or (old and _complete(directory, old.group(1))):
            remove(os.path.join(directory, name))
            removed.append(name)
        elif old and _complete(directory, name) and not os.path.lexists(os.path.join(directory, old.group(1))):
            # a re-save stopped between its two renames: this is the checkpoint find() resumes
            # from, and under its own name again pruning sees it (as iter_N.old it stayed for good)
            os.replace(os.path.join(directory, name), os.path.join(directory, old.group(1)))
            fsync_dir(directory)
    return removed


def prune(directory, keep):
    """Remove the oldest complete ``iter_N`` checkpoints of ``directory`` so that at most ``keep``
    (>= 1) remain, always keeping the one ``latest`` names; returns the names removed. Nothing is
    removed while ``latest`` names no usable checkpoint: then which one to keep is unknown."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"prune: keep={keep!r} must be a whole number >= 1 (the checkpoints to keep)")
    try:
        latest = os.path.basename(find(directory)) if os.path.lexists(os.path.join(directory, "latest")) else None
    except CheckpointError:
        latest = None
    if latest is None or not ITER_NAME.fullmatch(latest):
        return []
    others = sorted((int(name[5:]), name) for name in os.listdir(directory)
                    if ITER_NAME.fullmatch(name) and name != latest and _complete(directory, name))
    doomed = [name for _, name in others[: max(0, len(others) - (keep - 1))]]
    for name in doomed:
        # Renamed first, so that a crash half-way through removing it leaves an iter_N.partial
        # (which the next start removes), never a damaged iter_N that looks like a checkpoint.
        path = os.path.join(directory, name)
        trash = path + ".partial"
        remove(trash)
        os.replace(path, trash)
        fsync_dir(directory)
        remove(trash)
    return doomed
