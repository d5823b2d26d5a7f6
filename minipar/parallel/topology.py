"""ProcessGrid: which rank does which part of the work, by rank arithmetic alone.

The world's ranks form a TP x DP x PP grid in Megatron-LM's order, tensor-parallel rank fastest:

    global = tp_rank + dp_rank * TP + pp_rank * TP * DP

so the TP ranks of a group are neighbours (on one node, where their per-layer all-reduces need the
fastest links), the DP replicas of a stage come next and pipeline stages are furthest apart. Each
rank belongs to one group of each kind, made with ``Comm.Split``:

    tp group   same (dp, pp), tp = 0..TP-1    splits every layer's matrices
    dp group   same (tp, pp), dp = 0..DP-1    holds replicas; averages gradients
    pp group   same (tp, dp), pp = 0..PP-1    the stages one micro-batch flows through
    embedding  first and last stage of a pp group: both hold the tied token embedding

With TP=2, PP=4 on 16 ranks (DP=2): tp groups [0,1] [2,3] ..., dp groups [0,2] [1,3] [4,6] ...,
pp groups [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15].
"""

from dataclasses import dataclass

from minipar.parallel.validate import RunConfig, check


@dataclass(frozen=True)
class Layout:
    """The grid's arithmetic, with no communicator: every rank computes the same answer. (Whether a
    model or a run fits a grid is ``minipar.parallel.validate``'s question.)"""

    tp: int
    pp: int
    dp: int

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.upper()} size must be an integer >= 1, got {value!r}")

    @property
    def world_size(self):
        return self.tp * self.pp * self.dp

    def coords(self, rank):
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank(self, tp_rank, dp_rank, pp_rank):
        return tp_rank + dp_rank * self.tp + pp_rank * self.tp * self.dp

    def tp_group(self, rank):
        _, d, p = self.coords(rank)
        return [self.rank(t, d, p) for t in range(self.tp)]

    def dp_group(self, rank):
        t, _, p = self.coords(rank)
        return [self.rank(t, d, p) for d in range(self.dp)]

    def pp_group(self, rank):
        t, d, _ = self.coords(rank)
        return [self.rank(t, d, p) for p in range(self.pp)]

    def embedding_group(self, rank):
        """The first and last stage of this rank's pipeline (one rank when PP = 1); None for a
        rank in a middle stage."""
        stages = self.pp_group(rank)
        group = sorted({stages[0], stages[-1]})
        return group if rank in group else None

    def ranks(self, rank):
        """{group name: index of ``rank`` in that group}: how a parameter's ``Placement`` (which
        names groups) resolves on this rank. "embedding" only on the first and last stage."""
        t, d, p = self.coords(rank)
        out = {"tp": t, "dp": d, "pp": p}
        embedding = self.embedding_group(rank)
        if embedding is not None:
            out["embedding"] = embedding.index(rank)
        return out

    def groups(self, kind):
        """Every group of one kind, each listed once, in order of its first rank."""
        of = getattr(self, f"{kind}_group")
        seen = {}
        for r in range(self.world_size):
            g = of(r)
            if g is not None:
                seen.setdefault(tuple(g), None)
        return [list(g) for g in seen]

    def table(self):
        """A readable picture of the layout: each rank's coordinates, then every group."""
        lines = [f"{self.world_size} ranks as TP={self.tp} x DP={self.dp} x PP={self.pp}",
                 f"{'rank':>6} {'tp':>4} {'dp':>4} {'pp':>4}"]
        lines += [f"{r:>6} {t:>4} {d:>4} {p:>4}" for r in range(self.world_size)
                  for t, d, p in [self.coords(r)]]
        for kind in ("tp", "dp", "pp", "embedding"):
            lines.append(f"{kind + ' groups':<17}" + " ".join(str(g) for g in self.groups(kind)))
        return "\n".join(lines)


class ProcessGrid:
    """The grid on a live communicator: this rank's coordinates, its groups and its neighbours.

    ``ProcessGrid(tp, pp, dp)`` checks the sizes against the world on every rank before it makes
    any group, so a bad layout is an error everywhere, not a hang. ``dp=None`` infers DP from the
    world size. A 1 x 1 x 1 grid is the single-device run and needs no launcher.
    """

    def __init__(self, tp=1, pp=1, dp=None, world=None):
        if world is None:
            from minipar.comm import world as world_communicator

            world = world_communicator()
        # the sizes against the world, on every rank before any group is made (the run's rules)
        dp = check(RunConfig(world_size=world.size, tp=tp, pp=pp, dp=dp), what="ProcessGrid").dp
        self.layout = Layout(tp, pp, dp)
        self.world = world
        self.rank = world.rank
        self.tp_rank, self.dp_rank, self.pp_rank = self.layout.coords(world.rank)
        t, d, p = self.tp_rank, self.dp_rank, self.pp_rank
        # Split's colour names the group (any number shared by its members); the key orders it.
        self.tp_group = world.split(d + p * dp, t, "tp")
        self.dp_group = world.split(t + p * tp, d, "dp")
        self.pp_group = world.split(t + d * tp, p, "pp")
        in_embedding = self.layout.embedding_group(world.rank) is not None
        self.embedding_group = world.split(t + d * tp if in_embedding else None, p, "embedding")

    tp = property(lambda self: self.layout.tp)
    pp = property(lambda self: self.layout.pp)
    dp = property(lambda self: self.layout.dp)

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage(self):
        """Global rank of the previous pipeline stage (None on the first)."""
        return None if self.is_first_stage else self.layout.rank(self.tp_rank, self.dp_rank, self.pp_rank - 1)

    @property
    def next_stage(self):
        """Global rank of the next pipeline stage (None on the last)."""
        return None if self.is_last_stage else self.layout.rank(self.tp_rank, self.dp_rank, self.pp_rank + 1)

    def ranks(self):
        """This rank's index in each group, by name (``Layout.ranks``)."""
        return self.layout.ranks(self.rank)

    def group(self, name):
        """The communicator a group name of a ``Placement`` stands for (None: this rank is in no
        such group, as a middle stage is in no "embedding" group)."""
        groups = {"tp": self.tp_group, "dp": self.dp_group, "pp": self.pp_group, "embedding": self.embedding_group}
        if name not in groups:
            raise ValueError(f"no group named {name!r} on this grid: a Placement names one of {sorted(groups)}")
        return groups[name]

    def groups(self):
        return [g for g in (self.tp_group, self.dp_group, self.pp_group, self.embedding_group) if g]

    def describe(self):
        return self.layout.table()
