"""PipeDream-2BW's double-buffered weights (Narayanan et al. 2021, "Memory-Efficient Pipeline-
Parallel DNN Training"), as one more implementation of the step protocol around any stage-0 optimizer.

Without a flush, a stage starts the forwards of the next batch before the backwards of this one are
done, so it updates its weights while micro-batches that ran forward on the old ones still have to
come back. Each micro-batch must run its backward on the weights its forward saw (weight stashing),
and every stage must use the same version for a micro-batch, so the update is delayed by one:

    W(t+1) = W(t) - lr * grad f(W(t-1))        (with AdamW: AdamW's update, fed grad f(W(t-1)))

Batch t runs forward and backward on version t-1; its summed gradient updates version t. Two
versions are alive, never more (the paper's "2BW", two buffered weights):

    newest   W(t): the model's parameters, what the optimizer steps (and batch t+1 runs on)
    stash    W(t-1): the version the batch in flight runs on, a second copy of the parameters

The graph a forward records keeps references to the arrays it read (``Function.apply`` passes
``p.data``), so the backward of a micro-batch reads its forward's version as long as no array is
changed in place while it is in flight. That is what ``step`` is built around: the newest arrays,
which the next batch's early forwards have read, become the stash untouched; the old stash (free:
its batch's backwards are done) receives a copy of them and is what the optimizer updates. The
executor (``pipedream.py``) runs each forward and backward inside ``weights(version)``, which
points the parameters at that version's arrays (recompute reruns a forward in the backward, which
must read the same version).

``plant_bug``: the newest arrays are updated in place instead (the stash gets a copy): a micro-batch
forwarded before the step then runs its backward on the next version's weights, the bug weight
stashing exists to prevent.
"""

import contextlib

from minipar.backend import xp
from minipar.parallel.protocol import DistributedOptimizer


class WeightStash(DistributedOptimizer):
    """``inner``: a stage-0 optimizer over the model's parameters (``DataParallelAdamW``), without
    fp32 masters (those would be a third copy of the weights the stash would have to follow)."""

    def __init__(self, inner, plant_bug=False):
        if inner.stage != 0 or inner.policy is not None:
            raise ValueError("PipeDream-2BW stashes the model's own weights: it needs ZeRO stage 0 and "
                             "no 16-bit policy (fp32 masters would be a third version)")
        super().__init__(inner.model, inner.comm)
        self.inner, self.stage, self.plant_bug = inner, inner.stage, plant_bug
        self.params = inner.model.parameters()
        self.newest = 0  # W(0); the stash is W(-1) := W(0), the version batch 0 runs on
        self.stash = [p.data.copy() for p in self.params]

    @property
    def stashed(self):
        return self.newest - 1

    @contextlib.contextmanager
    def weights(self, version):
        """Run the forward or backward inside on weight ``version`` (the newest or the stashed one)."""
        if version == self.newest:
            yield
            return
        if version != self.stashed:
            raise RuntimeError(f"weight version {version} is not alive: PipeDream-2BW keeps versions "
                               f"{self.stashed} and {self.newest} only")
        newest = [p.data for p in self.params]
        for p, s in zip(self.params, self.stash):
            p.data = s
        try:
            yield
        finally:
            for p, a in zip(self.params, newest):
                p.data = a

    def step(self, grad_scale=1.0):
        """W(t+1) = W(t) - lr * g, g summed from the batch run on W(t-1); W(t) becomes the stash."""
        if self.plant_bug:  # the stash gets a copy, the arrays the in-flight graphs read are updated
            for p, s in zip(self.params, self.stash):
                s[...] = p.data
        else:  # the arrays read so far stay W(t); the freed W(t-1) buffers receive W(t) and are updated
            for p, s in zip(self.params, self.stash):
                xp.copyto(s, p.data)
            self.stash, old = [p.data for p in self.params], self.stash
            for p, a in zip(self.params, old):
                p.data = a
        self.inner.step(grad_scale)
        self.newest += 1

    def stash_bytes(self):
        """The bytes the second version costs: one more copy of this rank's parameters."""
        return sum(s.nbytes for s in self.stash)

    # ---- everything else is the stage's ------------------------------------------------------
    @property
    def adamw(self):
        return self.inner.adamw

    def no_sync(self):
        return self.inner.no_sync()

    def finish_gradients(self):
        self.inner.finish_gradients()

    def grad_norm(self):
        return self.inner.grad_norm()

    def _gradients(self):
        return self.inner._gradients()

    def clip_grad_norm(self, max_norm):
        return self.inner.clip_grad_norm(max_norm)

    def zero_grad(self):
        self.inner.zero_grad()

    def state_bytes(self):
        return {**self.inner.state_bytes(), "stash": self.stash_bytes()}

    def full_gradients(self):
        return self.inner.full_gradients()

    def state_arrays(self):
        return self.inner.state_arrays()
