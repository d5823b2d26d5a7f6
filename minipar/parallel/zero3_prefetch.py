"""ZeRO-3's gathers of a unit's parameters: on demand, or prefetched by a recorded order.

Prefetch (DeepSpeed's): the all-gather of the next unit starts as soon as this one's parameters
are whole. Which unit runs next depends on the schedule (micro-batches, the backward after the
forward), so it is not guessed: every training step records the units in the order it gathers
them, each with the groups it gathers, and the next step follows that record, one unit ahead (one
more unit's parameters held: the bound). The last unit's forward is followed by its own backward,
so its gather starts again as its forward frees it. A step that departs from the record (another
number of micro-batches) waits for what it prefetched, drops it, and records afresh; an optimizer
step changes the parameters, so nothing is prefetched across one; evaluation (no graph) neither
records nor prefetches.

Started is not travelling: MPICH moves a message only inside an MPI call of its process (it has
no thread of its own), and an all-gather over more than two ranks takes several rounds, each sent
once the last has arrived. In backward ZeRO-3 tests the prefetched requests at every gradient hook
(``_progress_prefetch``, as data parallelism does for its buckets), so the gather moves while the
unit's backward runs. A forward unit makes no MPI call while it computes: there the next unit's
gather goes as far as its start carried it (a message small enough to be sent eagerly, whole),
the rest at its wait.
"""

from minipar.autograd import is_grad_enabled
from minipar.backend import xp


class PrefetchingGather:
    """The gathering half of ``ZeRO3`` (a base class of it): ``gather_parameters`` and the
    prefetch around it. It uses the optimizer's ``master`` pieces, its ``ledger`` and ``_whole``
    (the groups whole now, which ``ZeRO3.release_parameters`` empties)."""

    def _start_prefetching(self):
        self._prefetched = {}  # id(group) -> (the all-gather's Request, its whole buffer)
        self._record, self._plan, self._next = [], None, 0  # (unit, groups) gathered this step; the last step's
        self.unit_gathers = {"prefetched": 0, "on demand": 0}  # how the units' gathers came, so far
        self.prefetch_peak = 0  # the most bytes prefetched and not yet taken at once, so far (its cost)

    def _gather_unit(self, name, groups):
        """Gather ``groups`` of a unit, those not whole (from their prefetch, if one is on the
        way), then start the next recorded unit's."""
        if is_grad_enabled():
            self._record.append((name, groups))
            if self._plan is not None and self._plan[self._next:self._next + 1] == [(name, groups)]:
                self._next += 1
            elif self._plan is not None:  # another order than the last step's: record afresh
                self._drop_prefetched()
                self._plan = None
        todo = [g for g in groups if id(g) not in self._whole]
        if todo:  # a unit whose groups are all whole already gathers nothing, of either kind
            self.unit_gathers["prefetched" if all(id(g) in self._prefetched for g in todo) else "on demand"] += 1
        self.gather_parameters(todo)
        self._prefetch_next()

    def _prefetch_next(self):
        """Start the all-gathers of the next recorded unit's groups that are not whole already."""
        if self._plan is None or self._next >= len(self._plan) or not is_grad_enabled():
            return
        for g in self._plan[self._next][1]:
            if id(g) not in self._whole and id(g) not in self._prefetched:
                whole = xp.empty((g.comm.size, g.piece), self.master.dtype)
                self._prefetched[id(g)] = (g.comm.iall_gather(self.master[g.shard].copy(), out=whole), whole)
                self.ledger.add("parameters", whole.nbytes)
        self.prefetch_peak = max(self.prefetch_peak, sum(whole.nbytes for _, whole in self._prefetched.values()))

    def _progress_prefetch(self):
        """Let MPI move the prefetched gathers along (see the module docstring)."""
        for request, _ in self._prefetched.values():
            request.test()

    def _drop_prefetched(self):
        for request, whole in self._prefetched.values():
            request.wait()  # every rank started it: every rank completes it
            self.ledger.remove("parameters", whole.nbytes)
        self._prefetched = {}

    def _follow_record(self):
        """At a step's end: what it gathered, in order, is the next step's plan."""
        self._drop_prefetched()
        self._plan = self._record if self._record else self._plan
        self._record, self._next = [], 0

    def gather_parameters(self, groups):
        """ZeRO-3's communication before a unit runs: all-gather the groups' parameters (or wait
        for their prefetch) into whole buffers the parameters point into."""
        for g in groups:
            if id(g) in self._whole:
                raise RuntimeError("a ZeRO-3 group was gathered twice without being released")
            if id(g) in self._prefetched:
                request, whole = self._prefetched.pop(id(g))
                request.wait()
            else:
                whole = xp.empty((g.comm.size, g.piece), self.master.dtype)
                g.comm.all_gather(self.master[g.shard].copy(), out=whole)
                self.ledger.add("parameters", whole.nbytes)
            self._whole[id(g)] = whole
            for p, part in zip(g.params, g.unflatten(whole.reshape(-1))):
                p.data = part.reshape(self.shapes[id(p)])
