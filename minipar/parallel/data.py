"""Data parallelism: every rank holds the whole model, sees its own slice of the batch, and the
gradients are summed over the ranks before each optimizer step.

How the sum is made cheap (as PyTorch DDP and Megatron do):

* **Buckets.** Gradients live in a few flat buffers ("buckets" of about ``bucket_bytes``), filled in
  the reverse order of the parameters, roughly the order backward produces them. One all-reduce
  per bucket instead of one per tensor: a handful of large messages, each near the bandwidth
  limit, instead of hundreds of latency-bound small ones.
* **Overlap.** Each parameter tells us (a gradient hook) when its gradient for this backward is
  complete. When a bucket's last gradient is in, its all-reduce starts, non-blocking, while
  backward goes on computing earlier layers. ``finish_gradients`` waits for the rest.
* **Gradient accumulation.** Inside ``no_sync()`` nothing is sent: micro-batches add their
  gradients into the buckets, and the backward after the block sends the sum once.

The batch mean. The loss of a step is the mean over all its counted tokens (targets that are not
``ignore_index``), on every rank and in every micro-batch:

    L = (1/N) * sum over all ranks' tokens of l_i,        N = the step's count of counted targets

So each rank sums its tokens' losses (``reduction="sum"``) and ``scale_loss`` divides that sum by
N, the global count, before backward; the all-reduce then *sums* the gradients, giving dL/dw. That
is exact however unevenly the ignored targets fall, and a rank (or micro-batch) whose targets are
all ignored adds a zero, where a mean of its own tokens would be a mean of nothing. The pipeline
executor does the same with each micro-batch's share.

``DataParallelAdamW`` is the buckets and AdamW in one object, following the step protocol the ZeRO
stages follow too (``protocol.py``); its communication is ``all_reduce_bucket``.
"""

import contextlib
import hashlib

import numpy

from minipar.backend import array_of, to_numpy, xp
from minipar.autograd import Tensor
from minipar.optim import AdamW
from minipar.precision import check_policy
from minipar.parallel.grad_norm import grad_norm
from minipar.parallel.protocol import STATE_KINDS, DistributedOptimizer, gradient_group


def token_count(targets, ignore_index=-1, comm=None):
    """Targets that count in the loss (not ``ignore_index``); with ``comm``, each rank passes its
    own and gets the sum over the ranks of ``comm`` (one all-reduce)."""
    count = int((xp.asarray(array_of(targets)) != ignore_index).sum())
    if comm is None:
        return count
    return int(comm.all_reduce(numpy.array([count], numpy.int64))[0])


def scale_loss(loss_sum, total):
    """This rank's share of the step's mean loss, L = (1/N) * sum over all ranks' tokens of l_i:
    ``loss_sum``, the sum of l_i over this rank's tokens (``reduction="sum"``), over ``total``, N.

    N is the whole step's count: ``token_count(y)`` of the global batch, which every rank holds
    and counts alone (no message), or ``token_count(ys, comm=dp)`` of each rank's own targets.
    N = 0, every target of the step ignored, leaves L undefined: every rank holds the same N, so
    every rank raises here, before backward starts any sum."""
    if total < 1:
        raise ValueError(f"scale_loss: the step counts N = {total} targets (they all equal ignore_index), "
                         "so its mean loss is undefined: give each step at least one target to learn")
    return loss_sum * (1.0 / total)


def sync_replicas(model, comm):
    """Make every replica start from rank 0's weights and use rank 0's dropout seed. A weight's
    replicas are the ranks its gradient is summed over: an expert comes from the first rank that
    holds the same experts (rank 0 of ``comm`` holds others)."""
    for p in model.parameters():
        gradient_group(p, model.grid, comm).broadcast(p.data, root=0)
    rng = getattr(model, "rng", None)
    if rng is not None:
        state = comm.broadcast(numpy.array([rng.seed, rng.iteration], numpy.int64), root=0)
        rng.seed, rng.iteration = int(state[0]), int(state[1])


def split_batch(x, y, comm):
    """This rank's rows of a global batch. All ranks must get the same number: a data-parallel
    model's dropout takes its rows to be this equal slice unless told otherwise (see minipar.rng)."""
    if len(x) % comm.size:
        raise ValueError(f"a global batch of {len(x)} does not split evenly over {comm.size} "
                         "data-parallel ranks: choose a batch size that is a multiple of DP")
    n = len(x) // comm.size
    rows = slice(comm.rank * n, (comm.rank + 1) * n)
    return x[rows], y[rows]


class Bucket:
    """Gradients summed in one all-reduce over ``comm``: all of them over the same group."""

    def __init__(self, params, dtype, comm):
        self.params, self.comm = params, comm
        self.flat = xp.zeros(sum(p.size for p in params), dtype)
        self.ready, self.request = 0, None
        # the same sum of the same array every step: planned once (a persistent collective), and
        # planned in the same order on every rank, as the buckets are made
        self.sum = comm.all_reduce_init(self.flat) if comm.size > 1 else None


class DataParallelAdamW(DistributedOptimizer):
    """AdamW on a model whose replicas live on the ranks of ``comm`` (the DP group; size 1 is the
    single-device run: the same buckets, no hooks, nothing sent).

    On construction the parameters are broadcast from DP rank 0, and each parameter's ``.grad``
    becomes a view into its bucket, so the engine accumulates straight into the buckets. Use this
    ``zero_grad()`` (which keeps the views) instead of ``model.zero_grad()``.

    With a mixed-precision ``policy`` (``minipar.precision``) the buckets hold ``policy.grads``
    (the model's 16 bits, or fp32 with --accumulate-allreduce-grads-in-fp32) and AdamW updates
    fp32 master copies of the weights (``masters``), rounding each into the model's weight as it
    goes: 2 + 2 + 12 bytes per parameter.
    """

    stage = 0  # ZeRO's numbering: nothing sharded

    def __init__(self, model, comm, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 bucket_bytes=4 << 20, policy=None):
        super().__init__(model, comm)
        params = model.parameters()
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"data parallelism buckets need one dtype, the model has {sorted(map(str, dtypes))}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.policy = check_policy(policy, params[0].dtype)
        sync_replicas(model, comm)  # before the masters are copied: every replica's from rank 0's
        if policy is None:
            self.masters = None
            self._adamw = AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        else:
            self.masters = [Tensor._wrap(p.data.astype(policy.main), requires_grad=True) for p in params]
            self._adamw = AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                decay=[p.ndim >= 2 for p in params], copies=[p.data for p in params])
        grad_dtype = params[0].dtype if policy is None else policy.grads
        self.buckets, current, size, group = [], [], 0, None
        for p in reversed(params):  # backward meets the last parameters first
            if current and gradient_group(p, self.grid, comm) is not group:  # one group per all-reduce
                self.buckets.append(Bucket(current, grad_dtype, group))
                current, size = [], 0
            group = gradient_group(p, self.grid, comm)
            current.append(p)
            size += p.data.nbytes
            if size >= bucket_bytes:
                self.buckets.append(Bucket(current, grad_dtype, group))
                current, size = [], 0
        if current:
            self.buckets.append(Bucket(current, grad_dtype, group))
        self._bucket_of = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[p] = bucket
                if bucket.comm.size > 1:  # one rank alone sends nothing: spare the engine counting uses for hooks
                    p.register_grad_hook(self._gradient_ready)
        self._views()
        self._sync, self._finished = True, False
        self.started_in_backward = 0  # buckets whose all-reduce began while backward still ran

    @property
    def adamw(self):
        return self._adamw

    def _views(self):
        """Each parameter's .grad becomes (again) a view into its bucket."""
        for bucket in self.buckets:
            offset = 0
            for p in bucket.params:
                p.grad = bucket.flat[offset : offset + p.size].reshape(p.shape)
                offset += p.size
        for master, p in zip(self.masters or (), self.model.parameters()):
            master.grad = p.grad  # AdamW reads the model's gradient, widening it block by block

    def _gradient_ready(self, p):
        if p.grad is None or p.grad.base is not self._bucket_of[p].flat:
            raise RuntimeError("a gradient left its bucket (model.zero_grad() sets it to None): "
                               "call DataParallelAdamW.zero_grad(), which restores the buckets")
        if self._finished:
            raise RuntimeError("backward after finish_gradients(): call zero_grad() before the next step's backward")
        if not self._sync:
            return
        bucket = self._bucket_of[p]
        bucket.ready += 1
        if bucket.ready > len(bucket.params):  # its sum would have been started without it
            raise RuntimeError("a gradient was reported complete twice in one step: run every backward "
                               "but each parameter's last under no_sync()")
        if bucket.ready == len(bucket.params):
            self.all_reduce_bucket(bucket)
            self.started_in_backward += bucket.request is not None
        for b in self.buckets:  # MPI moves data only inside MPI calls: let started buckets progress
            if b.request is not None:
                b.request.test()

    def all_reduce_bucket(self, bucket):
        """Data parallelism's communication: start summing one bucket over its group, DP (x CP)
        or, for experts, the ranks holding the same ones (non-blocking; one rank alone has
        nothing to sum)."""
        if bucket.sum is not None:
            bucket.request = bucket.sum.start()

    def finish_gradients(self):
        """Wait for every bucket's all-reduce (starting those no hook started), then let the model
        finish its gradients: the sums must be in before ``finalize_grads`` adds to them. Once per
        step: the buckets then hold sums, which must not be summed again."""
        if self._finished:
            return
        self._finished = True
        for bucket in self.buckets:  # the same order on every rank, as collectives require
            if bucket.request is None:
                self.all_reduce_bucket(bucket)
        for bucket in self.buckets:
            if bucket.request is not None:
                bucket.request.wait()
            bucket.ready, bucket.request = 0, None
        self.model.finalize_grads()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro-batches); the next backward outside sends the sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def grad_norm(self):
        """Every replica holds the summed gradients and computes the whole norm itself (adding the
        TP and PP parts: ``grad_norm.py``)."""
        self.finish_gradients()
        return grad_norm(self.model.parameters(), self.grid)

    def _gradients(self):
        return [b.flat for b in self.buckets]

    def step(self, grad_scale=1.0):
        """The AdamW update; ``grad_scale`` multiplies the gradients as AdamW reads them (mixed
        precision: the loss scale's inverse and the clipping factor)."""
        self.finish_gradients()
        self._adamw.step(grad_scale)

    def zero_grad(self):
        for bucket in self.buckets:
            if bucket.request is not None:  # a sum still running writes into the bucket: let it end
                bucket.request.wait()
            bucket.flat[...] = 0
            bucket.ready, bucket.request = 0, None
        self._views()
        self.started_in_backward, self._finished = 0, False

    def state_bytes(self):
        """Bytes this rank holds for training state: parameters, gradient buckets, optimizer."""
        return {"parameters": sum(p.data.nbytes for p in self.model.parameters()),
                "gradients": sum(b.flat.nbytes for b in self.buckets),
                "optimizer": sum(m.nbytes + v.nbytes for m, v in zip(self._adamw.m, self._adamw.v))
                + sum(master.data.nbytes for master in self.masters or ())}

    def full_gradients(self):
        self.finish_gradients()
        return {id(p): p.grad.copy() for p in self.model.parameters()}

    def state_arrays(self):
        """Whole local arrays, the same on every DP replica: each parameter (its fp32 master under
        mixed precision: what a checkpoint keeps), then its m and v."""
        out = []
        for p, weight, m, v in zip(self.model.parameters(), self._adamw.params, self._adamw.m, self._adamw.v):
            out += [(kind, p, array, p.shape, None) for kind, array in zip(STATE_KINDS, (weight.data, m, v))]
        return out

    def masters_to_model(self):
        """Round the master weights into the model's (after a checkpoint wrote the masters)."""
        for master, p in zip(self.masters or (), self.model.parameters()):
            p.data[...] = master.data

    def split_batch(self, x, y):
        return split_batch(x, y, self.comm)

    def check_replicas(self):
        """Raise unless the replicas of every parameter hold bit-identical values: a digest of
        the parameters each group sums (DP, or for experts edp), compared over that group."""
        digests = {}  # by group, in the order of the buckets: the same on every rank
        for bucket in self.buckets:
            group, h = digests.setdefault(id(bucket.comm), (bucket.comm, hashlib.sha256()))
            for p in bucket.params:
                h.update(numpy.ascontiguousarray(to_numpy(p.data)).tobytes())
        for group, h in digests.values():
            mine = numpy.frombuffer(h.digest()[:8], numpy.int64).copy()
            if not (group.all_gather(mine) == mine).all():
                raise RuntimeError("data-parallel replicas have diverged: their parameters differ")
