"""A step's receives, each posted ahead of the compute that comes before it.

MPI moves a large message by rendezvous: the sender's data cannot leave before the receiver has
posted the matching receive, and then only while one of the two is inside an MPI call (MPICH on
one node copies it in one step the receiver runs alone, cross-memory attach, where the system
allows it; without it the receiver also waits for the sender's next MPI call:
``bench/sender_computes.py``). Posted at
the moment the schedule needs the message, a receive starts that handshake only then, and the
rank waits for the whole transfer on top of whatever idle time the schedule has. Posted one
receive of its kind ahead (the next activation while this one's forward runs, the next gradient
while this one's backward runs), the transfer overlaps the compute between them; Megatron does
the same by batching each send with the next receive (``send_forward_recv_backward``).

One receive of each kind is outstanding besides the one being waited on: at most two extra
message buffers per rank, whatever the number of micro-batches. Each message has its own tag, so a
receive posted early can only match the message it is for.
"""

from collections import deque

from minipar.parallel.pipeline.instructions import RECV_ACT, RECV_GRAD

KINDS = (RECV_ACT, RECV_GRAD)


def _key(ins):
    return ins.op, ins.mb, ins.chunk


class PostedReceives:
    """The receives of ``instructions`` (one rank's schedule for one step); ``post(ins)`` starts
    the receive of instruction ``ins`` and returns its Request."""

    def __init__(self, instructions, post):
        self._post = post
        self._queues = {kind: deque(ins for ins in instructions if ins.op == kind) for kind in KINDS}
        self._posted = {}
        for kind in KINDS:
            self._post_next(kind)

    def _post_next(self, kind):
        if self._queues[kind]:
            ins = self._queues[kind].popleft()
            self._posted[_key(ins)] = self._post(ins)

    def take(self, ins):
        """The received array of ``ins``, the next receive of its kind in the schedule; the one
        after it is posted before this one is waited on."""
        request = self._posted.pop(_key(ins), None)
        if request is None:  # receives are taken in schedule order, which is the order they are posted in
            raise RuntimeError(f"receive {_key(ins)} taken out of the schedule's order")
        self._post_next(ins.op)
        return request.wait()

    def pending(self):
        """Receives posted and not yet taken (none once the step's schedule has run)."""
        return len(self._posted) + sum(len(q) for q in self._queues.values())
