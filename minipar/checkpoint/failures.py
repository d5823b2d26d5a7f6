"""A checkpoint read or write that failed on some ranks ends on all of them, with one line.

Each rank reads or writes its own files, so a full disk or a damaged box may be found by some
ranks and not others. Before anything communicates again, every rank votes (one all-reduce that
every rank reaches, failed or not); if any failed, every rank raises CheckpointError, and only the
lowest failing rank's says why (``CheckpointError.speaks``): a damage every rank finds is one line,
not one per rank, and no rank waits for one that gave up.
"""

import numpy

from minipar.checkpoint.index import CheckpointError


def first_failure(world, failed):
    """(the lowest rank whose ``failed`` is not None, how many such ranks), or None: one
    all-reduce that every rank reaches, whether or not its own part failed."""
    votes = numpy.zeros(world.size, numpy.int64)  # a host array: MPI moves it on any device
    votes[world.rank] = failed is not None
    if world.size > 1:
        votes = world.all_reduce(votes)
    return (int(numpy.argmax(votes)), int(votes.sum())) if votes.any() else None


def agree_on_failure(world, failed, what):
    """Raise on every rank if any rank's ``failed`` (a CheckpointError, or None) is one: the lowest
    such rank's own, which speaks, the others' saying only where to look (``CheckpointError.speaks``),
    so that a damage every rank reads is one line, not one per rank. ``what``: what failed."""
    found = first_failure(world, failed)
    if found is None:
        return
    first = found[0]
    error = failed if world.rank == first else CheckpointError(f"{what} (rank {first} says why)")
    error.speaks = world.rank == first
    raise error
