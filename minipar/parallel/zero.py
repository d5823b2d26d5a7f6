"""ZeRO (Rajbhandari et al. 2020): data parallelism that does not keep N copies of everything.

Plain data parallelism keeps on every rank, per parameter, 4 bytes of weight, 4 of gradient and 8
of Adam moments (m and v, fp32): 16P bytes for P parameters. ZeRO shards those across the N ranks
of the data-parallel group, in three stages:

    stage 1  optimizer state sharded      4P + 4P + 8P/N  = 8P + 8P/N
    stage 2  + gradients sharded          4P + (4P + 8P)/N = 4P + 12P/N
    stage 3  + parameters sharded         16P/N

These are minipar's fp32 counts. The paper counts mixed precision (2 bytes of fp16 weight, 2 of
fp16 gradient, 12 of fp32 master weight, m and v), so its stages 1 and 2 are 4P + 12P/N and
2P + 14P/N (docs/zero.md has both).

Layout (``shards.py``): groups of parameters, each flat and padded into N equal pieces; rank r owns
piece r of every group, and its pieces one after another are its shard, one contiguous buffer each
for its gradients and Adam moments. AdamW updates the shard piece by piece with the same arithmetic
as the unsharded optimizer (segments of pieces, each flagged for weight decay by its parameter).

A step, per stage (N ranks, S the bytes of all gradients):

    1, 2  reduce-scatter the gradients (rank r gets the sum of piece r)        (N-1)/N S
          update own pieces; all-gather them into every rank's parameters    (N-1)/N S
    3     all-gather each layer's parameters before its forward, and again before its backward,
          reduce-scatter its gradients after: 3 (N-1)/N S, 1.5x plain data parallelism (a little
          less: the embeddings' backward reads no table, so theirs are not gathered again)

Stage 1 reduce-scatters a full gradient buffer after backward (all-reducing it would move 1.5x
as much for nothing: each rank only updates its pieces). Stage 2 reduce-scatters each group as soon
as backward has finished it and frees the group's gradients at once. Stage 3 keeps only its pieces of
the parameters: ``zero3.py`` gathers each layer's just in time.

The classes follow the step protocol (``protocol.py``). ``ShardedAdamW`` (here) holds what the
stages share: the layout, the sharded AdamW, the pending reduce-scatters, the norm, the step's
all-gather. Each stage's own communication is one method: ``ZeRO1.reduce_scatter_gradients``
(``zero1.py``, after backward), ``ZeRO2.reduce_scatter_group`` (``zero2.py``, from the gradient hook during
backward), and ``ZeRO3.gather_parameters`` / ``release_parameters`` / ``reduce_scatter_group``
(``zero3.py``, around each unit of the model).
"""

from minipar.autograd import Tensor
from minipar.backend import sum_of_squares, xp
from minipar.optim import AdamW, check_hyperparameters
from minipar.parallel.data import sync_replicas
from minipar.parallel.grad_norm import norm_over_groups
from minipar.parallel.protocol import DistributedOptimizer, check_same_layout, finished_by_model, gradient_group
from minipar.parallel.shards import Ledger, group_parameters
from minipar.placement import is_primary
from minipar.precision import check_policy


class ShardedAdamW(DistributedOptimizer):
    """AdamW over a data-parallel group with its state sharded (ZeRO); ``stage`` is the subclass's.

    Replaces both the optimizer and data parallelism: it owns the parameter and gradient layout.
    Parameters are broadcast from DP rank 0 first, so replicas start equal.

    With a mixed-precision ``policy`` (``minipar.precision``) the parameters stay in the model's
    16 bits, gradients are kept and reduced in ``policy.grads``, and AdamW updates fp32 master
    copies of this rank's pieces (``masters``), rounding each into the 16-bit piece before the
    all-gather: the ZeRO paper's 2 + 2 + 12 bytes per parameter, the 12 sharded.
    """

    def __init__(self, model, comm, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 bucket_bytes=4 << 20, groups=None, policy=None):
        stage = self.stage
        check_hyperparameters(lr, betas)
        if stage < 3:  # ZeRO3 checks its units too, before its first message
            check_same_layout(model, comm, type(self).__name__, [f"bucket_bytes: {bucket_bytes}", f"policy: {policy}"])
        params = model.parameters()
        if len({p.dtype for p in params}) != 1:
            raise ValueError("ZeRO lays all parameters out in flat buffers of one dtype; the model mixes dtypes")
        super().__init__(model, comm)
        # which copies this rank counts in the norm (see placement.is_primary); its pieces differ
        # across the DP (x CP) group, and an expert's across its edp group, so none is a copy there
        self.ranks = dict(self.ranks, dp=0, cp=0, edp=0)
        self.ledger = Ledger()
        self.dtype = params[0].dtype
        self.policy = check_policy(policy, self.dtype)
        self.grad_dtype = self.dtype if policy is None else policy.grads  # gradients, summed in this
        self.main_dtype = self.dtype if policy is None else policy.main  # masters and Adam moments
        if stage < 3:
            sync_replicas(model, comm)
        later = finished_by_model if stage == 2 else (lambda p: False)
        ordered = [p for p in params if not later(p)] + [p for p in params if later(p)]  # in groups of their own, last
        self.groups = groups or group_parameters(ordered, lambda p: gradient_group(p, model.grid, comm),
                                                 bucket_bytes, later)
        # stages 2 and 3 hold these groups back from backward's sends (each group is all or none)
        self._later = {id(g) for g in self.groups if finished_by_model(g.params[0])} if stage >= 2 else set()
        self.pending, self._summed = [], False
        if stage < 3:
            self._flat_parameters()
        self.grad_pieces = self._gradient_storage()
        for p in params:
            p.register_grad_hook(self._gradient_ready)
        self._adamw = self._sharded_adamw(lr, betas, eps, weight_decay)

    @property
    def adamw(self):
        return self._adamw

    # ---- layout -----------------------------------------------------------------------------
    def _flat_parameters(self):
        """Stages 1 and 2 keep whole parameters: views into one flat buffer per group."""
        self.flat_params = []
        for g in self.groups:
            flat = g.flatten([p.data for p in g.params], self.dtype)
            for p, part in zip(g.params, g.unflatten(flat)):
                p.data = part.reshape(p.shape)
            self.flat_params.append(flat)
            self.ledger.add("parameters", flat.nbytes)

    def _gradient_storage(self):
        """Stages 2 and 3 keep only the pieces of the gradients: one shard, accumulated over
        micro-batches. Returns this rank's piece of each group."""
        shard = xp.zeros(sum(g.piece for g in self.groups), self.grad_dtype)
        self.ledger.add("gradients", shard.nbytes)
        return [shard[g.shard] for g in self.groups]

    def master_pieces(self):
        """This rank's pieces of the parameters, which its optimizer updates."""
        return [flat[slice(*g.own())] for g, flat in zip(self.groups, self.flat_params)]

    def shape_of(self, p):
        return p.shape

    def _sharded_adamw(self, lr, betas, eps, weight_decay):
        """AdamW over segments: the parts of each parameter in this rank's pieces. Its moments are
        views into two flat buffers the size of this rank's shard; so are the masters, under mixed
        precision, whose segments are rounded into the model's pieces (``copies``)."""
        pieces = self.master_pieces()
        shard = sum(g.piece for g in self.groups)
        self.masters = None
        if self.policy is not None:
            self.masters = xp.empty(shard, self.main_dtype)
            for g, piece in zip(self.groups, pieces):
                self.masters[g.shard] = piece
            self.ledger.add("optimizer", self.masters.nbytes)
        segments, decay, offsets, copies = [], [], [], []
        for g, piece, grad in zip(self.groups, pieces, self.grad_pieces):
            for i, a, b, at in g.segments():
                where = slice(at, at + b - a)
                weights = piece if self.masters is None else self.masters[g.shard]
                seg = Tensor._wrap(weights[where], requires_grad=True)
                seg.grad = grad[where]
                segments.append(seg)
                copies.append(None if self.masters is None else piece[where])
                decay.append(g.decays[i])
                offsets.append(g.shard.start + at)
        optimizer = AdamW(segments, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decay=decay,
                          copies=copies)
        self.moments = (xp.zeros(shard, self.main_dtype), xp.zeros(shard, self.main_dtype))
        optimizer.m = [self.moments[0][o : o + s.size] for o, s in zip(offsets, segments)]
        optimizer.v = [self.moments[1][o : o + s.size] for o, s in zip(offsets, segments)]
        self.ledger.add("optimizer", self.moments[0].nbytes + self.moments[1].nbytes)
        return optimizer

    # ---- gradients ----------------------------------------------------------------------------
    def _gradient_ready(self, p):
        if self._summed:
            raise RuntimeError("a backward after step() or clip_grad_norm(): call zero_grad() first")

    IN_FLIGHT = 1  # groups sent but not yet summed in: bounds the gradient memory of stages 2 and 3

    def reduce_scatter(self, g, flat, counted=False):
        """Start sending a group's flat gradients (a buffer made for the purpose, already in the
        ledger if ``counted``). Finished sends are summed into the shard and their buffers
        dropped as we go; beyond ``IN_FLIGHT`` pending groups we wait for the oldest, so that
        backward never holds them all."""
        self.ledger.add("gradients", (0 if counted else flat.nbytes) + flat.nbytes // g.comm.size)
        self.pending.append((self.groups.index(g), g.comm.ireduce_scatter(flat), flat.nbytes))
        self._collect(keep=self.IN_FLIGHT)

    def _collect(self, keep=0):
        """Sum finished (and, beyond ``keep`` pending, the oldest) sends into the shard."""
        still = []
        for i, (index, request, nbytes) in enumerate(self.pending):
            if request.test() or len(self.pending) - i > keep:
                self.grad_pieces[index] += request.wait()
                self.ledger.remove("gradients", nbytes + nbytes // self.groups[index].comm.size)
            else:
                still.append((index, request, nbytes))
        self.pending = still

    def finish_gradients(self):
        """Sum every group's gradients over the group into this rank's pieces (once per step).
        The model finishes its gradients first: what that adds to, stages 2 and 3 have held back
        (``protocol.finished_by_model``) and send now, with the rest."""
        if self._summed:
            return
        self.model.finalize_grads()
        self._send_rest()
        self._collect()
        self._summed = True

    def _send_rest(self):
        """What the stage still has to send once backward is over."""

    def full_gradients(self):
        """{id(parameter): whole flat gradient}, gathered from the pieces (a collective)."""
        self.finish_gradients()
        out = {}
        for g, piece in zip(self.groups, self.grad_pieces):
            whole = g.comm.all_gather(piece.copy()).reshape(-1)
            out.update({id(p): a for p, a in zip(g.params, g.unflatten(whole))})
        return out

    def _gradients(self):
        return self.grad_pieces

    def nonfinite_gradients(self):
        bad = super().nonfinite_gradients()
        for g, piece in zip(self.groups, self.grad_pieces):
            for i, a, b, at in g.segments():
                if not bool(xp.isfinite(piece[at : at + b - a]).all()):
                    bad.append(g.params[i])
        return bad

    # ---- the step -----------------------------------------------------------------------------
    def grad_norm(self):
        """The global gradient norm: every rank's sum of squares over its pieces, summed over the
        data-parallel group and, for a model split over TP and PP groups, over those (a parameter
        every TP rank holds whole, and the last stage's copy of the tied embedding, counted once;
        see ``minipar.parallel.grad_norm``). An expert's pieces cut it over its edp group, and the
        edp groups of the EP ranks (which hold different experts) make up the DP (x CP) group:
        that one sum counts every expert once too."""
        self.finish_gradients()
        counted = [piece[at : at + b - a] for g, piece in zip(self.groups, self.grad_pieces)
                   for i, a, b, at in g.segments() if is_primary(g.params[i].placement, self.ranks)]
        return norm_over_groups(sum_of_squares(counted), self.grid, first=(self.comm,))

    def step(self, grad_scale=1.0):
        """The update of this rank's pieces (``grad_scale`` multiplies the gradients as AdamW reads
        them: mixed precision's unscaling and clipping), then the all-gather."""
        self.finish_gradients()
        self._adamw.step(grad_scale)
        self.all_gather_parameters()

    def all_gather_parameters(self):
        """Stages 1 and 2: every rank gets everyone's updated pieces of the whole parameters."""
        for g, flat in zip(self.groups, self.flat_params):
            mine = flat[slice(*g.own())].copy()
            g.comm.all_gather(mine, out=flat.reshape(g.comm.size, g.piece))

    def zero_grad(self):
        self._collect()  # a step dropped before finish_gradients: its sends land before the zeroing
        for piece in self.grad_pieces:
            piece[...] = 0
        self._summed = False

    # ---- accounting and checkpoints -----------------------------------------------------------
    def state_bytes(self):
        return dict(self.ledger.now)

    def peak_state_bytes(self):
        return self.ledger.peak_total

    def padding(self):
        return sum(g.padded - g.size for g in self.groups)

    def _parameter_store(self):
        """The flat buffer of this rank's pieces a checkpoint keeps as the parameters: the fp32
        masters under mixed precision; None where the whole parameters are written instead."""
        return self.masters

    def _stores(self):
        """The flat buffers of this rank's shard, by kind."""
        params = self._parameter_store()
        return ((("param", params),) if params is not None else ()) + (
            ("exp_avg", self.moments[0]), ("exp_avg_sq", self.moments[1]))

    def masters_to_model(self):
        """Round the masters into this rank's 16-bit pieces, then share them (a collective)."""
        if self.masters is None:
            return
        for g, piece in zip(self.groups, self.master_pieces()):
            piece[...] = self.masters[g.shard]
        if self.stage < 3:
            self.all_gather_parameters()

    def state_arrays(self):
        """Stages 1 and 2: the whole parameters (the same on every DP rank; under mixed precision
        this rank's pieces of the fp32 masters instead), then per segment of this rank's pieces
        its m and v (different on every DP rank)."""
        whole = self.stage < 3 and self._parameter_store() is None
        out = [("param", p, p.data, p.shape, None) for p in self.model.parameters()] if whole else []
        for g in self.groups:
            for i, a, b, at in g.segments():
                p, start = g.params[i], g.shard.start + at
                for kind, store in self._stores():
                    out.append((kind, p, store[start : start + b - a], self.shape_of(p),
                                (a - g.offsets[i], b - g.offsets[i])))
        return out
