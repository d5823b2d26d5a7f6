"""PipeDream-2BW's executor (Narayanan et al. 2021): 1F1B across batches, with no flush.

A flushed schedule (GPipe, 1F1B) lets the pipeline drain before every optimizer step: the
(p - 1) forwards and backwards of fill and drain are the bubble. PipeDream-2BW never drains: while
a stage runs the last backwards of batch t, it already runs the first forwards of batch t+1, so
one call of ``step`` is given the batch it steps and the one that follows (``following``):

    step(x_t, y_t, following=(x_t1, y_t1))   batch t's backwards, each after the forwards 1F1B keeps
                                             ahead of it (some of them batch t+1's), then batch t's
                                             update; batch t+1 stays in flight for the next call
    step(x_t1, y_t1, following=None)         its backwards, and a drain: the stream ends

The order is ``schedules.two_bw_order``; the maths is ``weight_stash.WeightStash``'s delayed update
W(t+1) = W(t) - lr * grad f(W(t-1)): every forward and backward of batch t runs inside
``optimizer.weights(version of t)``. Each batch in flight has its own ``StepState``, so the
handlers of ``PipelineExecutor`` run unchanged on the micro-batch's index within its batch; what
this class adds is which batch, version and dropout iteration an instruction belongs to, and
message tags that keep the two batches in flight (and an evaluation between them) apart. A call's
receives are posted one of each kind ahead over its whole stream of instructions, as a flushed
step's are (``receives.py``), each on its own batch's state and tag band.
"""

import contextlib

from minipar.backend import xp
from minipar.parallel.data import token_count
from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline.executor import MAX_TAG, PipelineExecutor
from minipar.parallel.pipeline.receives import PostedReceives, progress
from minipar.parallel.pipeline.state import StepState
from minipar.parallel.pipeline.weight_stash import WeightStash


class PipeDream2BW(PipelineExecutor):
    """``optimizer``: a ``WeightStash`` around the stage-0 optimizer (it keeps the two versions)."""

    runs_across_steps = True  # PipelineExecutor refuses the schedule to anything else

    def __init__(self, model, grid, micro_batches, optimizer, recompute=False):
        if not isinstance(optimizer, WeightStash):
            raise ValueError("PipeDream-2BW runs each batch on a stashed weight version: pass the "
                             "optimizer wrapped in minipar.parallel.pipeline.weight_stash.WeightStash")
        super().__init__(model, grid, "pipedream-2bw", micro_batches, optimizer, recompute)
        if grid.pp > 1 and 6 * micro_batches * grid.pp > MAX_TAG:
            raise ValueError(f"PipeDream-2BW: {micro_batches} micro-batches need {6 * micro_batches * grid.pp} "
                             f"message tags, more than MPI promises ({MAX_TAG})")
        self.batch = 0  # the stream's index of the next batch to step
        self.forwarded = 0  # forwards run so far in the stream (global micro-batch indices)
        self.in_flight = {}  # stream batch index -> (StepState, weight version, dropout iteration)
        self._tag_batch = None  # the batch whose message is being tagged (None: an evaluation)

    def step(self, x, y, optimizer_step=None, following=None):
        """Batch (x, y)'s backwards and update, with the forwards of ``following`` ((x, y) of the
        next batch, or None to drain) that 1F1B runs meanwhile. The dropout iteration of (x, y) is
        the caller's ``model.rng.iteration``, the following batch's one more. Returns the StepRecord
        of this call (its timeline holds the following batch's early forwards too)."""
        self._require_grad()
        b, m, stash, iteration = self.batch, self.m, self.optimizer, self.model.rng.iteration
        if b not in self.in_flight:  # the stream starts (or starts again after a drain) here
            self.forwarded = b * m
            self.in_flight[b] = (self._state(x, y), stash.stashed, iteration)  # batch t runs on W(t-1)
        elif not (xp.array_equal(self.in_flight[b][0].x, x) and xp.array_equal(self.in_flight[b][0].y, y)):
            raise ValueError("PipeDream-2BW: this batch is not the `following` of the previous step, "
                             "whose forwards have already run")
        state = self.in_flight[b][0]
        state.optimizer_step = optimizer_step
        if following is not None:  # batch t+1 runs on W(t): made by the pending update, the stash after this step
            self.in_flight[b + 1] = (self._state(*following), stash.upcoming, iteration + 1)
        instructions, self.forwarded = S.two_bw_instructions(self.grid.pp, m, self.grid.pp_rank, b, self.forwarded,
                                                            following is not None)
        posted = PostedReceives(instructions, self._post_stream_receive)
        for t, (s, _, _) in self.in_flight.items():
            s.receives = _BatchReceives(posted, t * m)
        try:
            for ins in instructions:
                start = self._clock()
                self._dispatch(ins, state)
                for s, _, _ in self.in_flight.values():  # let the sends and receives progress; forget finished sends
                    s.sends = progress(s.sends, None)
                posted.test()
                state.record.peak_alive = max(state.record.peak_alive,
                                              sum(len(s.kept) for s, _, _ in self.in_flight.values()))
                state.record.timeline.append((ins.op, ins.mb, ins.chunk, start, self._clock()))
        finally:
            self.model.rng.iteration, self._tag_batch = iteration, None
        del self.in_flight[b]
        if following is None:  # the stream ends: the update no forward will ask for is made now
            stash.apply()
        self.batch = b + 1
        if self.model.chunks[-1] == self.pipe.n_chunks - 1:
            state.record.loss = state.loss
        return state.record

    def evaluate(self, x, y):
        """The evaluation of the executor, on the newest weights: those after the last step, the
        update set aside there made first (all stages take part in an evaluation anyway)."""
        self.optimizer.apply()
        return super().evaluate(x, y)

    def _dispatch(self, ins, state):
        """Run a stream instruction on its batch's state, as micro-batch (k mod m) of batch (k div m),
        on that batch's weight version and dropout iteration."""
        if ins.op == S.STEP:
            self._handlers[ins.op](state, ins)
            return
        t, i = divmod(ins.mb, self.m)
        batch_state, version, iteration = self.in_flight[t]
        self.model.rng.iteration, self._tag_batch = iteration, t
        # a forward's auxiliary losses count as its share of its own batch's tokens, not those of
        # the batch made last (the following one) or of an evaluation run since
        self.model.moe.tokens = batch_state.x.size
        local = S.Instruction(ins.op, i, ins.chunk)
        computes = ins.op in (S.FORWARD, S.BACKWARD)
        with self.optimizer.weights(version) if computes else contextlib.nullcontext():
            self._handlers[ins.op](batch_state, local)

    def _post_stream_receive(self, ins):
        """Post a stream instruction's receive (global micro-batch k) on batch k div m's state, as
        its micro-batch k mod m, tagged in that batch's band (restored after: the instruction
        running may be the other batch's)."""
        t, i = divmod(ins.mb, self.m)
        running, self._tag_batch = self._tag_batch, t
        try:
            return self._post_receive(self.in_flight[t][0], S.Instruction(ins.op, i, ins.chunk))
        finally:
            self._tag_batch = running

    def _state(self, x, y):
        x, y = xp.asarray(x), xp.asarray(y)
        micro = self._micro_batches(x, y)
        state = StepState(micro=micro, rows=len(x), tokens=token_count(y),
                          shape=self.model.activation_shape(len(micro[0][0]), x.shape[1]))
        state.x, state.y = x, y  # to check that the next call steps this very batch
        return state

    def _tag(self, ins):
        """Above the tags of an evaluation, a band for each of the two batches in flight."""
        tag = super()._tag(ins)
        if self._tag_batch is None:
            return tag
        return tag + (1 + self._tag_batch % 2) * 2 * self.m * self.pipe.n_chunks


class _BatchReceives:
    """One batch's view of a call's posted receives: its micro-batch i is the stream's first + i."""

    def __init__(self, posted, first):
        self.posted, self.first = posted, first

    def take(self, ins):
        return self.posted.take(S.Instruction(ins.op, self.first + ins.mb, ins.chunk))
