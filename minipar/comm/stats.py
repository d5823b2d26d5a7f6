"""How a communicator counts its calls and the bytes they move.

MPI does not say how many bytes its algorithms put on the wire, so each collective is charged
what the bandwidth-optimal ring algorithm moves per rank, the convention of NCCL's "bus
bandwidth" (Patarasuk & Yuan 2009; Thakur et al. 2005), with S the bytes of the full buffer and
N ranks:

    all_reduce      2 (N-1)/N S sent and received  (a reduce-scatter, then an all-gather)
    reduce_scatter    (N-1)/N S                     (S = the input, all N chunks)
    all_gather        (N-1)/N S                     (S = the output, all N chunks)
    all_to_all        (N-1)/N S                     (S = the input: every chunk but one's own
                                                     leaves, and as many arrive)
    all_to_all_v    what actually leaves and arrives: the rows sent to (received from) the
                    other ranks times the bytes of a row (its own rows stay; no ring model)
    broadcast       S received by every rank but the root, S sent by every rank but the last
                    of the chain (a pipelined chain from the root: N-1 links carry S each)
    send / recv     the message itself
    barrier         nothing (counted as a call)

The first four are charged on the bytes of all their calls since the last reset, together
(``CommStats``). ``lessons/00_collectives.py`` builds the ring all-reduce from send/recv, where
every byte is a real message, and shows that its count equals the all_reduce line above.

A call is counted once MPI (or NCCL) has taken it, on every path (plain, non-blocking, a planned
start, point to point): one refused by a check, ours or the library's, sent nothing and counts
nothing. A receive counts what arrived, once, however often it is waited on, a message that did
not fit its buffer too (its sender counted it). ``tests/test_comm_counts.py`` holds them to it.
"""

from collections import defaultdict
from dataclasses import dataclass


@dataclass(slots=True)
class Traffic:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


# the collectives the ring model charges in proportion to their buffers: counted as Tallies
RING_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


@dataclass(slots=True)
class Tally:
    """A ring-model collective's count: its calls and the bytes of their buffers (S). Adding to
    it is all a call pays; ``CommStats`` charges the bytes when they are read."""

    calls: int = 0
    nbytes: int = 0


class CommStats:
    """Per operation kind: calls, bytes sent and bytes received by this rank (see the module
    docstring for what a collective is charged).

    Accounting is on every call's path, and a small collective takes a few microseconds, so a
    call only counts: the collectives of the ring model add their call and their buffer's bytes
    to their ``Tally`` (a communicator's direct paths hold it and add to it themselves), and
    ``by_op`` applies the model when read, to the bytes of all the calls together (rounded down
    once, not once per call). Others are ``record``-ed as the (sent, received) they move."""

    def __init__(self, size):
        self.size = size
        self.tallies = {op: Tally() for op in RING_OPS}  # for the stats' life: hot paths hold them
        self._recorded = defaultdict(Traffic)

    def count(self, op, nbytes, rank=0, root=None):
        """One call of ``op`` on a buffer of ``nbytes`` by ``rank`` of the group: a ring-model
        collective is tallied, the rest (broadcast from ``root``, barrier) charged by ``ring_bytes``
        at once."""
        tally = self.tallies.get(op)
        if tally is None:
            is_root, is_last = root == rank, root is not None and (root - 1) % self.size == rank
            self.record(op, *ring_bytes(op, nbytes, self.size, is_root, is_last))
        else:
            tally.calls += 1
            tally.nbytes += nbytes

    def record(self, op, sent, received):
        t = self._recorded[op]
        t.calls += 1
        t.bytes_sent += sent
        t.bytes_received += received

    @property
    def by_op(self):
        """{op: Traffic} of the operations called since the last reset (a fresh copy; an op
        never called reads as zeros)."""
        out = defaultdict(Traffic)
        for op, t in self._recorded.items():
            out[op] = Traffic(t.calls, t.bytes_sent, t.bytes_received)
        for op, tally in self.tallies.items():
            if tally.calls:
                sent, received = ring_bytes(op, tally.nbytes, self.size)
                t = out[op]
                t.calls += tally.calls
                t.bytes_sent += sent
                t.bytes_received += received
        return out

    def total(self):
        out = Traffic()
        for t in self.by_op.values():
            out.calls += t.calls
            out.bytes_sent += t.bytes_sent
            out.bytes_received += t.bytes_received
        return out

    def reset(self):
        for tally in self.tallies.values():
            tally.calls = tally.nbytes = 0
        self._recorded.clear()


def ring_bytes(op, nbytes, size, is_root=False, is_last=False):
    """(sent, received) bytes per rank that the ring model charges ``op`` on a buffer of
    ``nbytes`` (see the table in the module docstring)."""
    if size == 1 or op == "barrier":
        return 0, 0
    if op == "all_reduce":
        share = 2 * (size - 1) * nbytes // size
        return share, share
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        share = (size - 1) * nbytes // size
        return share, share
    if op == "broadcast":
        # a pipelined chain from the root around the ring: every rank but the root receives S,
        # every rank but the last of the chain (the root's left neighbour) passes S on
        return (0 if is_last else nbytes), (0 if is_root else nbytes)
    raise ValueError(f"no byte model for {op!r}")
