"""ProcessGrid: which rank does which part of the work, by rank arithmetic alone.

The world's ranks form a TP x CP x DP x PP grid in Megatron-core's order, tensor-parallel rank
fastest:

    global = tp_rank + cp_rank * TP + dp_rank * TP * CP + pp_rank * TP * CP * DP

so the TP ranks of a group are neighbours (on one node, where their per-layer all-reduces need the
fastest links), the context-parallel ranks next (they pass keys and values every layer), then the
DP replicas of a stage, and pipeline stages furthest apart. Each rank belongs to one group of each
kind, made with ``Comm.Split``:

    tp group      same (cp, dp, pp), tp = 0..TP-1   splits every layer's matrices
    cp group      same (tp, dp, pp), cp = 0..CP-1   splits every sequence (context parallelism)
    dp group      same (tp, cp, pp), dp = 0..DP-1   holds replicas; splits the batch
    pp group      same (tp, cp, dp), pp = 0..PP-1   the stages one micro-batch flows through
    dp_cp group   same (tp, pp): DP x CP ranks      sum the gradients (every one of them saw
                                                    other tokens of the same weights)
    embedding     first and last stage of a pp group: both hold the tied token embedding

Expert parallelism is carved out of DP x CP (Megatron-core's rule: an MLP's tokens are
independent of one another, so the ranks that split a sequence can hold different experts as well
as those that split the batch), EP fastest within it, as the expert layers' order tp-ep-dp-pp
places EP right after TP, where the dense order has CP:

    i = cp_rank + CP * dp_rank              (the dp_cp index)
    ep group      same (tp, pp, i // EP), the EP consecutive DP x CP ranks around it: each holds
                  E/EP experts, and the group's tokens travel to them by all-to-all
    edp group     same (tp, pp, i % EP): the DP x CP / EP ranks that hold the same experts, over
                  which an expert's gradient is summed ("expert data parallel"); without expert
                  parallelism it is the dp_cp group

With TP=2, PP=4 on 16 ranks (DP=2): tp groups [0,1] [2,3] ..., dp groups [0,2] [1,3] [4,6] ...,
pp groups [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]. With CP=2 too on 8 ranks (TP=2, DP=2):
cp groups [0,2] [1,3] [4,6] [5,7], dp groups [0,4] [1,5] [2,6] [3,7], dp_cp groups [0,2,4,6] [1,3,5,7].
With DP=4, EP=2 on 4 ranks: ep groups [0,1] [2,3], edp groups [0,2] [1,3]. With CP=2, EP=2 on 2
ranks: one ep group [0,1], the two halves of every sequence sending their tokens to each other's experts.
"""

from dataclasses import dataclass
from typing import NamedTuple

from minipar.parallel.validate import RunConfig, check

KINDS = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp", "embedding")


class Coords(NamedTuple):
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Layout:
    """The grid's arithmetic, with no communicator: every rank computes the same answer. (Whether a
    model or a run fits a grid is ``minipar.parallel.validate``'s question.)"""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1  # expert parallel, carved out of DP x CP

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.upper()} size must be an integer >= 1, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"expert parallelism is carved out of DP x CP: EP={self.ep} does not divide "
                             f"DP x CP = {self.dp} x {self.cp}")

    @property
    def world_size(self):
        return self.tp * self.cp * self.dp * self.pp

    def coords(self, rank):
        """Coords(tp, cp, dp, pp) of a global rank."""
        tp, cp, dp = self.tp, self.cp, self.dp
        return Coords(rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp))

    def rank(self, *, tp=0, cp=0, dp=0, pp=0):
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def _along(self, rank, *kinds):
        """The ranks that differ from ``rank`` only in the coordinates ``kinds``, in rank order."""
        out = [rank]
        for kind in kinds:
            out = [self.rank(**dict(self.coords(r)._asdict(), **{kind: i})) for r in out
                   for i in range(getattr(self, kind))]
        return sorted(out)

    def tp_group(self, rank):
        return self._along(rank, "tp")

    def cp_group(self, rank):
        return self._along(rank, "cp")

    def dp_group(self, rank):
        return self._along(rank, "dp")

    def pp_group(self, rank):
        return self._along(rank, "pp")

    def dp_cp_group(self, rank):
        return self._along(rank, "cp", "dp")

    def _dp_cp_index(self, rank):
        c = self.coords(rank)
        return c.cp + self.cp * c.dp

    def ep_group(self, rank):
        """The EP consecutive DP x CP ranks of ``rank``'s block (dp_cp index // EP the same)."""
        i = self._dp_cp_index(rank) // self.ep
        return [r for r in self.dp_cp_group(rank) if self._dp_cp_index(r) // self.ep == i]

    def edp_group(self, rank):
        """The DP x CP ranks with ``rank``'s EP rank: they hold the same experts."""
        i = self._dp_cp_index(rank) % self.ep
        return [r for r in self.dp_cp_group(rank) if self._dp_cp_index(r) % self.ep == i]

    def embedding_group(self, rank):
        """The first and last stage of this rank's pipeline (one rank when PP = 1); None for a
        rank in a middle stage."""
        stages = self.pp_group(rank)
        group = sorted({stages[0], stages[-1]})
        return group if rank in group else None

    def ranks(self, rank):
        """{group name: index of ``rank`` in that group}: how a parameter's ``Placement`` (which
        names groups) resolves on this rank. "embedding" only on the first and last stage."""
        c = self.coords(rank)
        i = self._dp_cp_index(rank)
        out = {"tp": c.tp, "cp": c.cp, "dp": c.dp, "pp": c.pp, "dp_cp": i, "ep": i % self.ep, "edp": i // self.ep}
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
        kinds = [k for k in ("tp", "cp", "dp", "pp") if k != "cp" or self.cp > 1]
        sizes = " x ".join(f"{k.upper()}={getattr(self, k)}" for k in kinds)
        lines = [f"{self.world_size} ranks as {sizes}", f"{'rank':>6}" + "".join(f"{k:>5}" for k in kinds)]
        lines += [f"{r:>6}" + "".join(f"{getattr(self.coords(r), k):>5}" for k in kinds) for r in range(self.world_size)]
        extra = (["dp_cp"] if self.cp > 1 else []) + (["ep", "edp"] if self.ep > 1 else [])
        if self.ep > 1:
            lines[0] += f" (EP={self.ep} within DP x CP)"
        for kind in kinds + extra + ["embedding"]:
            lines.append(f"{kind + ' groups':<17}" + " ".join(str(g) for g in self.groups(kind)))
        return "\n".join(lines)


class ProcessGrid:
    """The grid on a live communicator: this rank's coordinates, its groups and its neighbours.

    ``ProcessGrid(tp, pp, dp)`` checks the sizes against the world on every rank before it makes
    any group, so a bad layout is an error everywhere, not a hang. ``dp=None`` infers DP from the
    world size. A 1 x 1 x 1 grid is the single-device run and needs no launcher. ``ep``: the
    expert-parallel size, a divisor of DP x CP.
    """

    def __init__(self, tp=1, pp=1, dp=None, world=None, cp=1, ep=1):
        if world is None:
            from minipar.comm import world as world_communicator

            world = world_communicator()
        # the sizes against the world, on every rank before any group is made (the run's rules)
        dp = check(RunConfig(world_size=world.size, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep), what="ProcessGrid").dp
        self.layout = lay = Layout(tp, pp, dp, cp, ep)
        self.world = world
        self.rank = world.rank
        self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank = lay.coords(world.rank)
        # Split's colour names the group (any number its members share: here its first rank); the
        # key orders it (this rank's index in it).
        index = lay.ranks(world.rank)
        self.ep_rank = index["ep"]
        for kind in ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp"):
            members = getattr(lay, f"{kind}_group")(world.rank)
            if kind == "dp_cp" and cp == 1:  # the DP group itself: no second communicator of it
                self.dp_cp_group = self.dp_group
                continue
            if kind == "edp" and ep == 1:  # without expert parallelism, experts sum like the rest
                self.edp_group = self.dp_cp_group
                continue
            setattr(self, f"{kind}_group", world.split(members[0], index[kind], kind))
        embedding = lay.embedding_group(world.rank)
        self.embedding_group = world.split(embedding[0] if embedding else None, self.pp_rank, "embedding")

    tp = property(lambda self: self.layout.tp)
    pp = property(lambda self: self.layout.pp)
    dp = property(lambda self: self.layout.dp)
    cp = property(lambda self: self.layout.cp)
    ep = property(lambda self: self.layout.ep)

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage(self):
        """Global rank of the previous pipeline stage (None on the first)."""
        return None if self.is_first_stage else self._stage(self.pp_rank - 1)

    @property
    def next_stage(self):
        """Global rank of the next pipeline stage (None on the last)."""
        return None if self.is_last_stage else self._stage(self.pp_rank + 1)

    def _stage(self, pp):
        return self.layout.rank(tp=self.tp_rank, cp=self.cp_rank, dp=self.dp_rank, pp=pp)

    def ranks(self):
        """This rank's index in each group, by name (``Layout.ranks``)."""
        return self.layout.ranks(self.rank)

    def group(self, name):
        """The communicator a group name of a ``Placement`` stands for (None: this rank is in no
        such group, as a middle stage is in no "embedding" group)."""
        groups = {kind: getattr(self, f"{kind}_group") for kind in KINDS}
        if name not in groups:
            raise ValueError(f"no group named {name!r} on this grid: a Placement names one of {sorted(groups)}")
        return groups[name]

    def groups(self):
        return [g for g in (self.tp_group, self.cp_group, self.dp_group, self.pp_group, self.embedding_group) if g]

    def describe(self):
        return self.layout.table()
