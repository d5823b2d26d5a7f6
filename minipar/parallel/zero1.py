"""ZeRO stage 1: the optimizer state sharded; whole gradients, reduce-scattered after backward.

Backward accumulates into whole gradient buffers, one per group of ``shards.py``'s layout (the
engine writing into them, across micro-batches too). After it, and after the model's own sums
(``finalize_grads``), each buffer is reduce-scattered once: rank r keeps the sum of piece r, the
only piece its AdamW updates. The layout, the sharded AdamW, the norm and the step's all-gather
are ``zero.ShardedAdamW``'s; what is stage 1's own is ``reduce_scatter_gradients``.
"""

from minipar.backend import xp
from minipar.parallel.zero import ShardedAdamW


class ZeRO1(ShardedAdamW):
    """ZeRO stage 1: optimizer state sharded. Backward accumulates into whole gradient buffers
    (one per group, the engine writing into them); after it, ``reduce_scatter_gradients``."""

    stage = 1

    def _gradient_storage(self):
        """Whole gradient buffers the engine accumulates into; this rank's piece of each is where
        the reduce-scatter leaves the sum."""
        self.flat_grads = []
        for g in self.groups:
            grads = xp.zeros(g.padded, self.grad_dtype)
            for p, part in zip(g.params, g.unflatten(grads)):
                p.grad = part.reshape(p.shape)
            self.flat_grads.append(grads)
            self.ledger.add("gradients", grads.nbytes)
        return [flat[slice(*g.own())] for g, flat in zip(self.groups, self.flat_grads)]

    def finish_gradients(self):
        """The model's own sums first (the tied embedding's parts on the first and last stage,
        sequence parallelism's partial sums), into the whole buffers; then the reduce-scatter, after
        which only this rank's piece is summed."""
        if self._summed:
            return
        self.model.finalize_grads()
        self.reduce_scatter_gradients()
        self._summed = True

    def reduce_scatter_gradients(self):
        """ZeRO-1's communication: each whole buffer goes out once, over its group (DP x CP, or
        an expert's edp); the sum of this rank's piece comes back (an all-reduce would move 2x for
        values this rank never uses)."""
        for g, flat in zip(self.groups, self.flat_grads):
            piece = xp.empty(g.piece, self.grad_dtype)
            self.ledger.add("gradients", piece.nbytes)
            g.comm.reduce_scatter(flat, out=piece)
            flat[slice(*g.own())] = piece
            self.ledger.remove("gradients", piece.nbytes)

    def zero_grad(self):
        for flat in self.flat_grads:
            flat[...] = 0
        super().zero_grad()
