"""A one-rank communicator for tests of what an optimizer holds while its sends are on the way."""


class LateSends:
    """Wraps ``comm``: its reduce-scatters say they are still on the way until waited for, as on
    several ranks they may be (a step dropped with sends in flight; the ledger's worst case, the
    previous send pending at every send, as tests/mpi/plan_counts.py's ``Late``)."""

    def __init__(self, comm):
        self.comm = comm

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def ireduce_scatter(self, x):
        request = self.comm.ireduce_scatter(x)
        return type("Request", (), {"test": lambda self: False, "wait": lambda self: request.wait()})()
