"""ZeRO stage 2: the gradients sharded too, reduce-scattered while backward runs.

Stage 1 (``zero1.py``) lets backward accumulate whole gradients, 4P bytes, and reduce-scatters them
afterwards. Stage 2 sends each group of parameters as soon as backward has finished all of its
gradients (the same gradient hooks as data parallelism's buckets), sums what comes back into this
rank's piece, and drops the whole gradients at once: a rank holds its 4P/N shard plus a group or
two in flight. The price: with k micro-batches a step sends every micro-batch's gradients, (k+1)
passes over the model instead of 2, since there is no whole buffer to accumulate into.

Some gradients are not finished when backward reaches them: sequence parallelism leaves each TP
rank part of the LayerNorms', the row-parallel biases' and the position embedding's, and a
pipeline's first and last stages each part of the tied embedding's. The model adds those after
backward (``finalize_grads``), so stage 2 lays them out in groups of their own, last, keeps them
whole until then and sends them with ``finish_gradients``: small, except the tied embedding.

The layout, the sharded AdamW, the pending reduce-scatters and the step's all-gather are
``zero.ShardedAdamW``'s; what is stage 2's own is ``reduce_scatter_group``.
"""

from minipar.parallel.zero import ShardedAdamW


class ZeRO2(ShardedAdamW):
    """ZeRO stage 2: gradients sharded too. Each group's gradients are reduce-scattered from the
    gradient hook as soon as backward has finished the group (``reduce_scatter_group``), and
    dropped: backward never holds more than a group or two of whole gradients, besides the ones
    held for the model's sums. The ledger counts each whole gradient from the hook that first
    finds it until it is dropped (``plan.zero12`` plans the most of it)."""

    stage = 2

    def __init__(self, model, comm, **hyper):
        super().__init__(model, comm, **hyper)
        # per group, its parameters whose gradients backward has finished since its last send: a
        # set, not a count, since a parameter of a chunk may finish again (the next micro-batch's
        # backward of that chunk) before another chunk's parameters of the same group finish once
        self._ready = {id(g): set() for g in self.groups}
        self._sent = set()  # groups sent this step
        self._whole = {}  # id(p) -> bytes of its whole gradient, held until its group is sent
        self._group_of = {id(p): g for g in self.groups for p in g.params}
        for p in (q for g in self.groups for q in g.params):  # no buffer to sum into: widened as backward starts it
            p.accumulate_dtype = self.grad_dtype if self.grad_dtype != p.dtype else None

    def _gradient_ready(self, p):
        super()._gradient_ready(p)
        if p.grad is not None and id(p) not in self._whole:  # a micro-batch after the first adds to it
            self._whole[id(p)] = p.grad.nbytes
            self.ledger.add("gradients", p.grad.nbytes)
        g = self._group_of[id(p)]
        if id(g) in self._later:  # whole until the model has summed them (finish_gradients), then sent
            return
        self._ready[id(g)].add(id(p))
        if len(self._ready[id(g)]) == len(g.params):
            self.reduce_scatter_group(g)

    def reduce_scatter_group(self, g):
        """ZeRO-2's communication: send a finished group's whole gradients (None counts as
        zeros) to be summed into the owners' pieces, and drop them."""
        self.reduce_scatter(g, g.flatten([q.grad for q in g.params], self.grad_dtype))
        for q in g.params:
            self.ledger.remove("gradients", self._whole.pop(id(q), 0))
            q.grad = None
        self._ready[id(g)] = set()
        self._sent.add(id(g))

    def _send_rest(self):
        """Groups not sent (some parameter got no gradient) or with gradients that came after
        their last send (a micro-batch that left some of the group's parameters unused): send
        them now, in order."""
        for g in self.groups:
            if id(g) not in self._sent or self._ready[id(g)]:
                self.reduce_scatter_group(g)
        self._sent.clear()

    def zero_grad(self):
        super().zero_grad()
        self._ready = {key: set() for key in self._ready}
        self._sent.clear()
        for g in self.groups:  # a step dropped before finish_gradients: groups it never sent
            for q in g.params:
                q.grad = None
        for nbytes in self._whole.values():
            self.ledger.remove("gradients", nbytes)
        self._whole = {}
