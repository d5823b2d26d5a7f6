"""The flat layout ZeRO shards: parameters in groups, each flat and padded into N equal pieces.

A group's parameters are laid out one after another in a flat buffer, padded to a multiple of N so
that it cuts into N equal pieces; rank r owns piece r of every group. Its shard, its pieces one
after another, is a contiguous buffer for its gradients and Adam moments. N is the size of the
group's communicator, the one that sums its gradients: the DP (x CP) group, or for experts' weights
the edp group (the ranks holding the same experts). ``Ledger`` keeps count of the bytes a ZeRO
optimizer holds, now and at the peak.
"""

from minipar.backend import xp


class Ledger:
    """Bytes held per kind ("parameters", "gradients", "optimizer"), now and at the peak."""

    def __init__(self):
        self.now, self.peak = {}, {}
        self.peak_total = 0

    def add(self, kind, nbytes):
        self.now[kind] = self.now.get(kind, 0) + int(nbytes)
        self.peak[kind] = max(self.peak.get(kind, 0), self.now[kind])
        self.peak_total = max(self.peak_total, sum(self.now.values()))

    def remove(self, kind, nbytes):
        self.now[kind] -= int(nbytes)

    def restart_peak(self):
        """From now on, the peak of what follows alone (a step's, measured step by step)."""
        self.peak, self.peak_total = dict(self.now), sum(self.now.values())


class Group:
    """Parameters laid out flat, padded to ``comm.size`` equal pieces."""

    def __init__(self, params, comm, shard_offset):
        self.params, self.comm = params, comm
        self.offsets, self.sizes, total = [], [p.size for p in params], 0
        self.decays = [p.ndim >= 2 for p in params]  # AdamW's rule, kept while ZeRO-3 empties p
        for size in self.sizes:
            self.offsets.append(total)
            total += size
        self.size = total
        self.piece = -(-total // comm.size)
        self.padded = self.piece * comm.size
        self.shard = slice(shard_offset, shard_offset + self.piece)  # this rank's piece in its shard

    def own(self):
        """(start, stop) of this rank's piece in the group's flat index space."""
        start = self.comm.rank * self.piece
        return start, start + self.piece

    def segments(self):
        """(parameter index, start, stop in the flat group, start in own piece) for the parts of
        parameters that fall in this rank's piece."""
        lo, hi = self.own()
        for i, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                yield i, a, b, a - lo

    def flatten(self, arrays, dtype):
        """The group's padded flat buffer from per-parameter arrays (None: zeros)."""
        flat = xp.zeros(self.padded, dtype)
        for offset, size, a in zip(self.offsets, self.sizes, arrays):
            if a is not None:
                flat[offset : offset + size] = a.reshape(-1)
        return flat

    def unflatten(self, flat):
        """Per-parameter views of a flat buffer of this group."""
        return [flat[o : o + n] for o, n in zip(self.offsets, self.sizes)]


def group_parameters(params, comm_of, bucket_bytes, kind=lambda p: None):
    """Consecutive parameters in groups of about ``bucket_bytes`` (a bigger one alone), each
    sharded over ``comm_of(p)`` of its parameters (the group that sums their gradients: a group
    never mixes two, nor two ``kind``s)."""
    groups, current, size, offset = [], [], 0, 0

    def close():
        groups.append(Group(current, comm_of(current[0]), offset))
        return offset + groups[-1].piece, [], 0

    for p in params:
        if current and (comm_of(p) is not comm_of(current[0]) or kind(p) != kind(current[0])):
            offset, current, size = close()
        current.append(p)
        size += p.data.nbytes
        if size >= bucket_bytes:
            offset, current, size = close()
    if current:
        close()
    return groups
