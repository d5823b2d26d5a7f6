"""A step's receives, each posted one receive of its kind ahead of where the schedule waits for it.

MPICH moves a message only while this rank is inside an MPI call (it runs no progress thread of
its own), not while it computes in Python. A receive posted early is matched, and its message
taken in, at the first MPI call this rank makes after the message has arrived: the start of one of
its sends, the executor's tests after each instruction (``progress``: of its pending sends and of
these receives), the wait of another receive, or at the latest its own wait. (Checked with two ranks: a
posted 16 KiB to 1 MiB receive was still empty after 50 ms of compute without an MPI call, and
complete after one test of an unrelated request.)

What that buys depends on how MPI moves a large message, by rendezvous: the sender's data cannot
leave before the receiver has matched it to a posted receive. MPICH on one node then copies it in
one step the receiver runs alone, inside that call (cross-memory attach, where the system allows
it): posting early moves the copy to an earlier MPI call between instructions, it does not hide it
behind compute. Without it (``MPIR_CVAR_CH4_CMA_ENABLE=0``) the data moves in pieces during both
ranks' MPI calls, and a receive posted early lets the first of them go at this rank's earlier call
instead of at its wait (``bench/sender_computes.py``). Megatron posts ahead too, batching each
send with the next receive (``send_forward_recv_backward``).

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

    def test(self):
        """Let MPI move the posted receives now."""
        for request in self._posted.values():
            request.test()


def progress(sends, receives):
    """MPI moves data only inside MPI calls: test the sends in flight and the receives posted ahead
    (which the sends' tests move too, but only while one is pending). Returns the sends unfinished."""
    if receives is not None:
        receives.test()
    return [request for request in sends if not request.test()]
