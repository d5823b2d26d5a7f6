"""ZeRO (Rajbhandari et al. 2020): data parallelism that does not keep N copies of everything.

Plain data parallelism keeps on every rank, per parameter, 4 bytes of weight, 4 of gradient and 8
of Adam moments (m and v, fp32): 16P bytes for P parameters. ZeRO shards those across the N ranks
of the data-parallel group, in three stages:

    stage 1  optimizer state sharded      4P + 4P + 8P/N  = 8P + 8P/N
    stage 2  + gradients sharded          4P + (4P + 8P)/N = 4P + 12P/N
    stage 3  + parameters sharded         16P/N

Layout. The parameters are grouped in order into groups (buckets; in stage 3 one per layer), each
laid out flat and padded to a multiple of N, so it cuts into N equal pieces: rank r owns piece r of
every group. Its shard, the pieces it owns one after the other, is one contiguous buffer for its
Adam moments and gradients, and AdamW updates it piece by piece, with the same arithmetic as the
unsharded optimizer (segments of pieces, each flagged for weight decay by its parameter's ndim).

A step, per stage (N ranks, S the bytes of all gradients):

    1, 2  reduce-scatter the gradients (rank r gets the sum of piece r)        (N-1)/N S
          update own pieces; all-gather them into every rank's parameters    (N-1)/N S
    3     all-gather each layer's parameters before its forward, and again before its backward,
          reduce-scatter its gradients after: 3 (N-1)/N S, 1.5x plain data parallelism

Stage 1 reduce-scatters a full gradient buffer after backward (all-reducing it would move 1.5x
as much for nothing: each rank only updates its pieces). Stage 2 reduce-scatters each group as soon
as backward has finished it and frees the group's gradients at once. Stage 3 keeps only its pieces of
the parameters: ``zero3.py`` gathers each layer's just in time.
"""

from minipar.autograd import Tensor
from minipar.backend import xp
from minipar.optim import AdamW


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
        """(decays, start, stop in the flat group, start in own piece) for the parts of
        parameters that fall in this rank's piece."""
        lo, hi = self.own()
        for decays, offset, size in zip(self.decays, self.offsets, self.sizes):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                yield decays, a, b, a - lo

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


def group_parameters(params, comm, bucket_bytes):
    """Consecutive parameters in groups of about ``bucket_bytes`` (a bigger one alone)."""
    groups, current, size, offset = [], [], 0, 0
    for p in params:
        current.append(p)
        size += p.data.nbytes
        if size >= bucket_bytes:
            groups.append(Group(current, comm, offset))
            offset += groups[-1].piece
            current, size = [], 0
    if current:
        groups.append(Group(current, comm, offset))
    return groups


class ZeroAdamW:
    """AdamW over a data-parallel group with ZeRO stage 1 or 2 (stage 3: ``zero3.Zero3``).

    Replaces both the optimizer and DataParallel: after the backward(s) of a step call
    ``step()`` (or ``clip_grad_norm`` then ``step()``), then ``zero_grad()`` before the next
    backward. Parameters are broadcast from DP rank 0 first, so replicas start equal.
    """

    def __init__(self, model, comm, stage, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 bucket_bytes=4 << 20, groups=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.model, self.comm, self.stage = model, comm, stage
        self.ledger = Ledger()
        params = model.parameters()
        self.dtype = params[0].dtype
        self.groups = groups or group_parameters(params, comm, bucket_bytes)
        self.pending, self._summed = [], False
        if stage < 3:
            self._flat_parameters(params)
        if stage == 1:  # own piece of each whole gradient buffer: summed there by the reduce-scatter
            self.grad_pieces = [flat[slice(*g.own())] for g, flat in zip(self.groups, self.flat_grads)]
        else:  # stages 2 and 3 keep only the pieces: one shard, accumulated over micro-batches
            shard = xp.zeros(sum(g.piece for g in self.groups), self.dtype)
            self.ledger.add("gradients", shard.nbytes)
            self.grad_pieces = [shard[g.shard] for g in self.groups]
        if stage == 2:
            self._ready = {id(g): 0 for g in self.groups}
            self._group_of = {id(p): g for g in self.groups for p in g.params}
        for p in params:
            p.register_grad_hook(self._gradient_ready)
        self.optimizer = self._sharded_adamw(lr, betas, eps, weight_decay)

    # ---- layout -----------------------------------------------------------------------------
    def _flat_parameters(self, params):
        """Stages 1 and 2 keep whole parameters (views into one flat buffer per group), and
        stage 1 whole gradients the engine accumulates into."""
        for p in params:
            self.comm.broadcast(p.data, root=0)
        self.flat_params, self.flat_grads = [], []
        for g in self.groups:
            flat = g.flatten([p.data for p in g.params], self.dtype)
            for p, part in zip(g.params, g.unflatten(flat)):
                p.data = part.reshape(p.shape)
            self.flat_params.append(flat)
            self.ledger.add("parameters", flat.nbytes)
            if self.stage == 1:
                grads = xp.zeros(g.padded, self.dtype)
                for p, part in zip(g.params, g.unflatten(grads)):
                    p.grad = part.reshape(p.shape)
                self.flat_grads.append(grads)
                self.ledger.add("gradients", grads.nbytes)

    def master_pieces(self):
        """This rank's pieces of the parameters, which its optimizer updates."""
        return [flat[slice(*g.own())] for g, flat in zip(self.groups, self.flat_params)]

    def _sharded_adamw(self, lr, betas, eps, weight_decay):
        """AdamW over segments: the parts of each parameter in this rank's pieces."""
        segments, decay = [], []
        for g, master, grad in zip(self.groups, self.master_pieces(), self.grad_pieces):
            for decays, a, b, at in g.segments():
                seg = Tensor._wrap(master[at : at + b - a], requires_grad=True)
                seg.grad = grad[at : at + b - a]
                segments.append(seg)
                decay.append(decays)
        optimizer = AdamW(segments, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decay=decay)
        self.ledger.add("optimizer", sum(m.nbytes + v.nbytes for m, v in zip(optimizer.m, optimizer.v)))
        return optimizer

    # ---- gradients ----------------------------------------------------------------------------
    def _gradient_ready(self, p):
        if self._summed:
            raise RuntimeError("a backward after step() or clip_grad_norm(): call zero_grad() first")
        if self.stage != 2:
            return
        g = self._group_of[id(p)]
        self._ready[id(g)] += 1
        if self._ready[id(g)] == len(g.params):
            self._ready[id(g)] = 0
            # measure what backward holds now: this group's and unfinished groups' gradients
            alive = sum(q.grad.nbytes for q in self.model.parameters() if q.grad is not None)
            self.ledger.add("gradients", alive)
            self.reduce_scatter(g, g.flatten([q.grad for q in g.params], self.dtype))
            self.ledger.remove("gradients", alive)
            for q in g.params:  # stage 2 keeps no whole gradient once its group is sent
                q.grad = None

    IN_FLIGHT = 1  # groups sent but not yet summed in: bounds the gradient memory of stages 2 and 3

    def reduce_scatter(self, g, flat, counted=False):
        """Start sending a group's flat gradients (a buffer made for the purpose, already in the
        ledger if ``counted``). Finished sends are summed into the shard and their buffers
        dropped as we go; beyond ``IN_FLIGHT`` pending groups we wait for the oldest, so that
        backward never holds them all."""
        self.ledger.add("gradients", (0 if counted else flat.nbytes) + flat.nbytes // self.comm.size)
        self.pending.append((g, self.comm.ireduce_scatter(flat), flat.nbytes))
        self._collect(keep=self.IN_FLIGHT)

    def _collect(self, keep=0):
        """Sum finished (and, beyond ``keep`` pending, the oldest) sends into the shard."""
        still = []
        for i, (g, request, nbytes) in enumerate(self.pending):
            if request.test() or len(self.pending) - i > keep:
                self.grad_pieces[self.groups.index(g)] += request.wait()
                self.ledger.remove("gradients", nbytes + nbytes // self.comm.size)
            else:
                still.append((g, request, nbytes))
        self.pending = still

    def finish_gradients(self):
        """Sum every group's gradients over the group into this rank's pieces (once per step)."""
        if self._summed:
            return
        if self.stage == 1:  # each whole buffer goes out once; the sum of its own piece comes back
            for g, flat in zip(self.groups, self.flat_grads):
                piece = xp.empty(g.piece, self.dtype)
                self.ledger.add("gradients", piece.nbytes)
                self.comm.reduce_scatter(flat, out=piece)
                flat[slice(*g.own())] = piece
                self.ledger.remove("gradients", piece.nbytes)
        self._collect()
        self._summed = True

    def full_gradients(self):
        """{id(parameter): whole flat gradient}, gathered from the pieces (a collective)."""
        self.finish_gradients()
        out = {}
        for g, piece in zip(self.groups, self.grad_pieces):
            whole = self.comm.all_gather(piece.copy()).reshape(-1)
            out.update({id(p): a for p, a in zip(g.params, g.unflatten(whole))})
        return out

    # ---- the step -----------------------------------------------------------------------------
    def grad_norm(self):
        """The global gradient norm: every rank's sum of squares over its pieces, summed."""
        self.finish_gradients()
        local = xp.asarray([sum(float(xp.vdot(piece, piece)) for piece in self.grad_pieces)])
        return float(self.comm.all_reduce(local)[0]) ** 0.5

    def clip_grad_norm(self, max_norm):
        """Scale the gradients by min(1, max_norm / ||g||) over the whole model; returns ||g||."""
        total = self.grad_norm()
        if max_norm > 0 and total > max_norm:
            for piece in self.grad_pieces:
                piece *= max_norm / (total + 1e-6)
        return total

    def step(self):
        self.finish_gradients()
        self.optimizer.step()
        if self.stage < 3:  # every rank gets everyone's updated pieces
            for g, flat in zip(self.groups, self.flat_params):
                mine = flat[slice(*g.own())].copy()
                self.comm.all_gather(mine, out=flat.reshape(self.comm.size, g.piece))

    def zero_grad(self):
        for piece in self.grad_pieces:
            piece[...] = 0
        for flat in getattr(self, "flat_grads", ()):
            flat[...] = 0
        self._summed = False
