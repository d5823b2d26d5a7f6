"""Where a parameter lives across the ranks, declared once, on the parameter (``p.placement``).

Every technique that cuts or copies a parameter says so here, and everything that must know reads
it: the gradient norm (each element counted once), ZeRO (which of its pieces count), checkpoints
(who writes what; where a local array lies in the whole tensor), resharding. A placement names
groups, not communicators: "tp", "cp", "dp", "pp", "embedding", "ep", "edp", which the grid
resolves (``ProcessGrid.group``, ``Layout.ranks``), so this layer knows nothing of MPI.

    split     how the local array is cut from the whole tensor: along ``axis``, which holds
              ``chunks`` equal blocks (3 for the fused q, k, v) each cut separately, after padding
              the axis to ``padded`` entries (the vocabulary), one part per rank of ``group``.
              None: the local array is the whole tensor.
    copies    the groups across whose ranks the local arrays are equal copies: every data-parallel
              replica ("dp") and every context-parallel rank ("cp": they hold other positions of
              the same sequences); every TP rank, for a weight not split over TP ("tp"); the first
              and the last pipeline stage, for the tied token embedding ("embedding"); the ranks
              that hold the same experts ("edp", expert data parallel, in place of "dp").
    grad_sum  the groups over which the gradient is summed before the step: "dp" always (the
              optimizer sums over DP x CP, the "dp_cp" group, when there is context parallelism); "tp" for
              the partial sums sequence parallelism leaves (each rank saw only its positions);
              "embedding" for the tied embedding's two uses (input on the first stage, output head
              on the last); "edp" in place of "dp" for an expert's weights (its EP group's
              tokens already came to it by all-to-all; see ``parallel/experts.py``).

Of the equal copies, one is counted in a norm and written in a checkpoint: the copy on index 0 of
every group in ``copies``. ``is_primary`` is that rule, the only place it is written.
"""

from dataclasses import dataclass, replace

from minipar.backend import xp


@dataclass(frozen=True)
class Split:
    """The local array is part ``index`` of ``n`` of the whole along ``axis`` (Megatron's
    ``partition_dim``), ``n`` being the size of ``group``; see the module docstring."""

    group: str
    axis: int
    size: int  # the whole tensor's length along axis, without padding
    chunks: int = 1
    padded: int = None  # None: no padding (= size)

    def __post_init__(self):
        if self.padded is None:
            object.__setattr__(self, "padded", self.size)
        if not isinstance(self.group, str) or not self.group:
            raise ValueError(f"Split.group must be a group name such as 'tp', got {self.group!r}")
        if self.axis < 0 or self.size < 1 or self.chunks < 1 or self.padded < self.size:
            raise ValueError(f"Split needs axis >= 0, size >= 1, chunks >= 1 and padded >= size, got {self}")
        if self.padded % self.chunks:
            raise ValueError(f"Split: {self.padded} entries along axis {self.axis} do not form {self.chunks} "
                             "equal blocks; pad the axis to a multiple of the blocks")

    def whole_shape(self, local_shape):
        shape = list(local_shape)
        shape[self.axis] = self.size
        return tuple(shape)

    def part_length(self, n):
        """Entries of one block that each of ``n`` ranks holds along the axis."""
        if self.padded % (self.chunks * n):
            raise ValueError(f"Split: {self.padded // self.chunks} entries per block along axis {self.axis} "
                             f"do not divide among {n} ranks of '{self.group}'")
        return self.padded // self.chunks // n

    def shard(self, whole, index, n):
        """Part ``index`` of ``n`` of the whole array: its share of every block, padding included."""
        self.part_length(n)  # checks that the parts are equal
        if self.padded != self.size:
            pad = [(0, 0)] * whole.ndim
            pad[self.axis] = (0, self.padded - self.size)
            whole = xp.pad(whole, pad)
        blocks = xp.split(whole, self.chunks, axis=self.axis)
        mine = [xp.split(b, n, axis=self.axis)[index] for b in blocks]
        return xp.ascontiguousarray(xp.concatenate(mine, axis=self.axis))

    def unshard(self, parts):
        """The whole array from every rank's part, in rank order; padding removed."""
        per_rank = [xp.split(part, self.chunks, axis=self.axis) for part in parts]
        blocks = [xp.concatenate([p[c] for p in per_rank], axis=self.axis) for c in range(self.chunks)]
        whole = xp.concatenate(blocks, axis=self.axis)
        return xp.take(whole, xp.arange(self.size), axis=self.axis) if self.padded != self.size else whole


def _names(value, what):
    names = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"Placement.{what} must be group names such as ('dp', 'tp'), got {value!r}")
    return names


def _union(old, new):
    return old + tuple(n for n in _names(new, "also") if n not in old)


@dataclass(frozen=True)
class Placement:
    """How one parameter is cut, copied and summed across the grid (see the module docstring).
    ``Placement()`` is a parameter every rank that holds it holds whole."""

    split: Split = None
    copies: tuple = ("tp", "cp", "dp")
    grad_sum: tuple = ("dp",)

    def __post_init__(self):
        object.__setattr__(self, "copies", _names(self.copies, "copies"))
        object.__setattr__(self, "grad_sum", _names(self.grad_sum, "grad_sum"))
        if self.split is not None and self.split.group in self.copies:
            raise ValueError(f"Placement: the parts of a tensor split over '{self.split.group}' are not "
                             f"copies of each other; drop '{self.split.group}' from copies")

    def also(self, copies=(), grad_sum=()):
        """This placement with more groups holding copies or summing the gradient."""
        return replace(self, copies=_union(self.copies, copies), grad_sum=_union(self.grad_sum, grad_sum))


REPLICATED = Placement()


def split_over(group, axis, size, chunks=1, padded=None):
    """A parameter cut over ``group``: its parts are different, and every other group that holds
    it holds copies (a TP-split weight is still copied on every DP replica)."""
    split = Split(group, axis, size, chunks, padded)
    return Placement(split, copies=tuple(g for g in REPLICATED.copies if g != group))


def is_primary(placement, ranks):
    """Whether this rank's copy of a parameter is the one counted in a norm and written in a
    checkpoint: the copy on index 0 of every group that holds copies of it.

    ``ranks``: this rank's index in each group, by name (``ProcessGrid.ranks()``); a group it does
    not name counts as index 0, so a single device passes ``{}``. A caller whose arrays differ
    across a group (ZeRO's pieces across "dp"), or that combines nothing over it (a norm every DP
    replica computes whole), passes index 0 for that group: there, every rank's copy is its own."""
    return all(ranks.get(group, 0) == 0 for group in placement.copies)


__all__ = ["Split", "Placement", "REPLICATED", "split_over", "is_primary"]
