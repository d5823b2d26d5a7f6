"""The executor: run one rank's schedule on its pipeline stage of a GPT, with real messages.

A schedule (``schedules.py``) is a list of instructions; the executor keeps a table from each
instruction kind to the one method that carries it out, and everything a step holds between
instructions lives in one ``StepState`` (``state.py``). The methods:

    _recv_act   wait politely for the activation, received into a buffer of the agreed shape (each
                receive is posted one ahead, before the compute before it: ``receives.py``)
    _forward    ``model.chunk_forward`` on it (token ids for the first chunk), keeping the graph
    _send_act   start a non-blocking send of the output
    _recv_grad  receive the gradient of that output
    _backward   backpropagate it through the kept graph; the input's gradient is left in its .grad
    _send_grad  start a non-blocking send of the input's gradient
    _step       wait for the sends still in flight, then the caller's optimizer step

and, with the backward split in two (``minipar.weight_grad``),

    _backward_input   B of the zero-bubble schedules (Qi et al. 2024): the input's gradient only,
                      which the previous stage waits for; the weights' half is parked in the state
    _backward_weight  W: the parked half, where the schedule puts it, in what was the bubble
    _head_weight      the tied head's weight gradient, parked by each backward of the last chunk
                      under ``defer_embedding_wgrad`` (``schedules.defer_head_weight``), at the flush

so a chunk's gradients are complete after its last W, not its last backward (``last_backward``).
A new instruction is one method and one entry in ``self._handlers``, plus its place in the schedules.
ZB-V places the chunks in a V (``instructions.Pipeline``): the model must be built in the same
shape (checked), and rank p - 1 hands its chunk 0's output to its own chunk 1 by a message to
itself, like any other.

Shapes are agreed, not sent: every rank computes (micro-batch rows, positions, n_embd) from the
batch it is given and the model, so a message is only its bytes. Each message has its own tag,
(micro-batch, sending chunk, kind), so a receive can only match the message it expects.

What makes the pipelined run equal to one device:

* Micro-batch i is rows i*B..(i+1)*B of the step's batch (then cut across data-parallel ranks), and
  its loss, summed over its tokens, is divided by the step's count of them before backward: the
  shares add up to the mean over the whole batch (one whose targets are all ignored adds 0), not
  to a sum of per-micro-batch means.
* Dropout draws the single-device masks (``_dropout_context``, the only code here that touches
  the model's dropout keys): masks are keyed by layer and by the tokens' global rows
  (see minipar.rng), so each forward runs inside ``model.rng.at(rows=...)`` with its micro-batch's
  rows on this data-parallel rank, and the iteration is the caller's (``model.rng.iteration``).
* A mixture of experts' auxiliary losses join backward on whatever stage they are made, each
  forward's as its share of the step's tokens (``model.moe.tokens``, set here to the batch's).
* The tied embedding's two gradient parts (first and last stage) are added by
  ``model.finalize_grads()``, which the optimizer's ``finish_gradients()`` runs in the caller's
  step, in the order its data-parallel sum needs (see ``parallel/protocol.py``). Only the last
  backward of each chunk counts its gradients as ready (the others run under
  ``optimizer.no_sync()``); a bucket is sent when all of its parameters are ready, which for a
  bucket spanning two chunks is the later one's.

``evaluate`` runs the forwards alone (every micro-batch through every chunk, in the schedule's
forward order) without recording a graph: the validation loss of a pipelined model.
"""

import contextlib
import time

from minipar.autograd import Tensor, is_grad_enabled, no_grad
from minipar.backend import on_gpu, xp
from minipar.parallel import validate
from minipar.parallel.data import split_batch, token_count
from minipar.parallel.pipeline import ready
from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline.receives import PostedReceives, progress
from minipar.parallel.pipeline.simulate import message_key, peer
from minipar.parallel.pipeline.state import StepRecord, StepState
from minipar.parallel.validate import MAX_TAG  # re-exported: the tag limit is one of the run's rules
from minipar.rng import rows_of
from minipar.weight_grad import backward_input

__all__ = ["MAX_TAG", "PipelineExecutor", "StepRecord"]


class PipelineExecutor:
    """Runs ``schedule`` (one of ``schedules.SCHEDULES``) with ``micro_batches`` per step on this
    rank's stage of ``model`` (a GPT built on ``grid``). ``optimizer``: the step-protocol object
    (``parallel/protocol.py``) that sums the gradients over the data-parallel group; its
    ``no_sync()`` covers all but each chunk's last backward (or W). It may be left out when DP = 1 and the
    caller sums nothing. ``recompute``: keep only each block's input during forward.
    ``defer_embedding_wgrad``: the head's weight gradients wait for the flush (a flushed schedule
    with whole backwards, PP > 1); ``defer_wgrad_linears``: with them, those of the last stage's
    last k linear layers (``GPT.last_linear_weights``), moving their time from the last stage's
    steady cycles, which the others wait on, into the drain, where it idles."""

    def __init__(self, model, grid, schedule="1f1b", micro_batches=1, optimizer=None, recompute=False,
                 defer_embedding_wgrad=False, defer_wgrad_linears=0):
        v = len(model.chunks)
        # the schedule, its micro-batches and message tags on this grid: the run's rules, before any message
        validate.check(validate.RunConfig(tp=grid.tp, pp=grid.pp, dp=grid.dp, virtual_stages=v, schedule=schedule,
                                          micro_batches=micro_batches, n_layer=model.config.n_layer,
                                          pipeline_layers=model.layers_per_stage,
                                          zero_stage=getattr(optimizer, "stage", 0) or 0,
                                          defer_embedding_wgrad=defer_embedding_wgrad,
                                          defer_wgrad_linears=defer_wgrad_linears,
                                          num_experts=model.config.num_experts or None,
                                          moe_layer_freq=model.config.moe_layer_freq),
                       what="PipelineExecutor")
        if schedule == "pipedream-2bw" and not getattr(self, "runs_across_steps", False):
            raise ValueError("the pipedream-2bw schedule runs across steps on stashed weights: use "
                             "minipar.parallel.pipeline.pipedream.PipeDream2BW, not PipelineExecutor")
        if grid.dp * grid.cp > 1 and optimizer is None:
            raise ValueError("the grid has DP x CP > 1: pass what sums the gradients over it (from "
                             "minipar.parallel.optimizers.make_optimizer) as optimizer=")
        self.model, self.grid, self.optimizer, self.recompute = model, grid, optimizer, recompute
        self.m, self.v, self.name = micro_batches, v, schedule
        self.dtype = model.parameters()[0].dtype  # of every activation and gradient sent
        shape = S.shape_of(schedule)
        self.pipe = S.Pipeline(grid.pp, micro_batches, v, shape)
        # the model's shape, not this rank's chunks: on an odd pipeline the middle rank holds the
        # same chunks in a V as round-robin, and would accept what the others refuse
        if model.pipeline_shape != shape:
            raise ValueError(f"the {schedule!r} schedule places a rank's chunks {shape}, the model was built "
                             f"{model.pipeline_shape}: build the GPT with pipeline_shape={shape!r}")
        placed = [self.pipe.global_chunk(grid.pp_rank, c) for c in range(v)]
        if list(model.chunks) != placed:  # a model built for another grid (PP, v or stage)
            raise ValueError(f"the {schedule!r} schedule places chunks {placed} on pipeline rank {grid.pp_rank}, "
                             f"the model holds {list(model.chunks)}: build the GPT on this grid")
        plans = S.build(schedule, grid.pp, micro_batches, v, defer_embedding_wgrad)  # every rank's, to check them all alike
        self.instructions = plans[grid.pp_rank]
        self.forward_only = S.forward_only(grid.pp, micro_batches, v, grid.pp_rank, shape)
        self.comm = grid.pp_group  # None when PP = 1: then nothing is sent
        self._handlers = {
            S.RECV_ACT: self._recv_act,
            S.FORWARD: self._forward,
            S.SEND_ACT: self._send_act,
            S.RECV_GRAD: self._recv_grad,
            S.BACKWARD: self._backward,
            S.BACKWARD_INPUT: self._backward_input,
            S.BACKWARD_WEIGHT: self._backward_weight,
            S.HEAD_WEIGHT: self._head_weight,
            S.SEND_GRAD: self._send_grad,
            S.STEP: self._step,
        }
        unknown = sorted({ins.op for plan in plans.values() for ins in plan} - set(self._handlers))
        if unknown:  # a schedule ahead of its executor: every rank says so, before any message
            raise ValueError(f"the {schedule!r} schedule has instructions {unknown} that the executor "
                             "has no method for: add one to PipelineExecutor._handlers")
        # the backward (or, split, the W) after which a chunk's gradients are complete for the step,
        # and the chunk whose backwards leave the head's weight gradient, with its last such W
        self.last_backward = ready.last_backwards(self.instructions, model.chunks, self.pipe.n_chunks)
        self.last_head = ready.last_heads(self.instructions)
        self.deferred = [model.head_weight] + model.last_linear_weights(defer_wgrad_linears) if self.last_head else []
        self.weights = model.parameters()  # whose gradients a split backward leaves to W

    def step(self, x, y, optimizer_step=None):
        """One training step on the global batch (x, y) (every rank passes the same one): run the
        schedule, then ``optimizer_step()`` at its step instruction. Returns a StepRecord."""
        self._require_grad()
        return self._run(self.instructions, x, y, optimizer_step)

    @staticmethod
    def _require_grad():
        """Inside ``no_grad()`` no forward would keep its graph, and the first backward would fail
        after messages are sent: every rank refuses at once instead."""
        if not is_grad_enabled():
            raise RuntimeError("a pipeline's training step was called inside no_grad(), where forwards keep no "
                               "graph to backpropagate: call step() outside it, or evaluate() for the loss alone")

    def evaluate(self, x, y):
        """The mean loss over the batch (x, y), forwards only and no graph (call ``model.eval()``
        first to turn dropout off). Returns a StepRecord; its loss is on the last stage."""
        with no_grad():
            return self._run(self.forward_only, x, y, None)

    def _micro_batches(self, x, y):
        """This rank's (ids, targets) of each micro-batch: rows i*B..(i+1)*B of the step's batch,
        then this data-parallel rank's slice. Checked on every rank, before any message."""
        dp = self.grid.dp
        if x.ndim != 2 or x.shape != y.shape:
            raise ValueError(f"a batch is (rows, time) ids and targets of one shape; got {x.shape} and {y.shape}")
        validate.check(validate.RunConfig(dp=dp, global_batch=len(x), micro_batches=self.m),
                       names={"global_batch": "batch rows"}, what="PipelineExecutor.step")
        self.model.check_batch(x, y)
        rows = len(x) // self.m
        micro = [(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) for i in range(self.m)]
        return [split_batch(xs, ys, self.grid.dp_group) for xs, ys in micro] if dp > 1 else micro

    def _run(self, instructions, x, y, optimizer_step):
        x, y = xp.asarray(x), xp.asarray(y)
        micro = self._micro_batches(x, y)
        state = StepState(micro=micro, rows=len(x), tokens=token_count(y),  # the whole batch's: no message
                          shape=self.model.activation_shape(len(micro[0][0]), x.shape[1]),
                          optimizer_step=optimizer_step)
        state.receives = PostedReceives(instructions, lambda ins: self._post_receive(state, ins))
        # a mixture of experts' auxiliary losses: each forward's tokens are its share of all of them,
        # and their gradients carry the loss scale the training loss's do (fp16)
        self.model.moe.tokens = x.size
        self.model.moe.loss_scale = self.optimizer.loss_scale if self.optimizer is not None else 1.0
        for ins in instructions:
            start = self._clock()
            self._handlers[ins.op](state, ins)
            # MPI moves data only inside MPI calls: let the sends and the receives posted progress
            state.sends = progress(state.sends, state.receives)
            state.record.timeline.append((ins.op, ins.mb, ins.chunk, start, self._clock()))
        for request in state.sends:  # forwards only: no step instruction waited for them
            request.wait()
        if self.model.chunks[-1] == self.pipe.n_chunks - 1:
            state.record.loss = state.loss
        return state.record

    # one method per instruction kind; each reads and leaves its data in the state under (mb, chunk)

    def _recv_act(self, state, ins):
        buf = self._receive(state, ins)
        state.inputs[ins.mb, ins.chunk] = Tensor(buf, requires_grad=is_grad_enabled())

    def _forward(self, state, ins):
        unit = (ins.mb, ins.chunk)
        inp = state.inputs.pop(unit, None)  # None: the first chunk, which reads token ids
        ids, targets = state.micro[ins.mb]
        last = self.model.chunks[ins.chunk] == self.pipe.n_chunks - 1
        with self._dropout_context(state, ins):
            out = self.model.chunk_forward(ins.chunk, ids if inp is None else inp,
                                           targets if last else None, recompute=self.recompute, reduction="sum")
        if last:  # this micro-batch's share of the step's mean loss (of its positions, with CP): its sum
            out = out * (1.0 / state.tokens)  # over the step's count; a share with every target ignored adds 0
            state.loss += out.item()
            scaled = self.optimizer is not None and self.optimizer.loss_scale != 1.0
            if scaled and is_grad_enabled():  # fp16's loss scale, for backward alone (not evaluation's)
                out = out * self.optimizer.loss_scale
        state.kept[unit] = (inp, out)
        # a micro-batch's activations are held until its backward, or, split, until its W
        state.record.peak_alive = max(state.record.peak_alive, len(state.kept) + len(state.weight_grads))
        if last and not is_grad_enabled():  # forwards only: its loss is added, nothing waits for it
            del state.kept[unit]

    def _send_act(self, state, ins):
        unit = (ins.mb, ins.chunk)
        kept = state.kept[unit][1]
        out = xp.ascontiguousarray(kept.data)
        if not is_grad_enabled():  # forwards only: nothing waits for a backward
            del state.kept[unit]
        state.sends.append(self.comm.isend(out, self._peer(ins), self._tag(ins)))  # (holds it till sent)
        # backward needs the output's node, shape and dtype, not its values: freed, as Megatron's
        # deallocate_output_tensor does (s b h for each micro-batch in flight on this stage)
        kept.data = xp.broadcast_to(xp.zeros((), kept.dtype), kept.shape)

    def _recv_grad(self, state, ins):
        state.output_grads[ins.mb, ins.chunk] = self._receive(state, ins)

    def _backward(self, state, ins):
        unit = (ins.mb, ins.chunk)
        inp, out = state.kept.pop(unit)  # dropping the graph frees the activations
        grad = state.output_grads.pop(unit, None)  # None: the loss, on the last chunk
        with self._quiet(ins.mb, self.last_backward[ins.chunk]):
            if ins.chunk in self.last_head:  # all but the head's (and the last linear layers') weight
                # gradients, parked for the flush
                state.head_grads[unit] = backward_input(out, self.deferred, grad)
                state.count_parked()
            else:
                out.backward(grad)
        if inp is not None:
            state.input_grads[unit] = inp.grad

    def _backward_input(self, state, ins):
        unit = (ins.mb, ins.chunk)
        inp, out = state.kept.pop(unit)  # the graph's arrays that only B needed are freed
        # no hooks fire in B: every parameter's gradient waits for W
        state.weight_grads[unit] = backward_input(out, self.weights, state.output_grads.pop(unit, None))
        if inp is not None:
            state.input_grads[unit] = inp.grad
        state.count_parked()

    def _backward_weight(self, state, ins):
        pending = state.weight_grads.pop((ins.mb, ins.chunk))
        with self._quiet(ins.mb, self.last_backward[ins.chunk]):
            pending.run()

    def _head_weight(self, state, ins):
        pending = state.head_grads.pop((ins.mb, ins.chunk))
        with self._quiet(ins.mb, self.last_head[ins.chunk]):
            pending.run()

    def _quiet(self, mb, last):
        """Gradients that more micro-batches will add to are not ready: inside ``no_sync()``."""
        quiet = self.optimizer is not None and mb != last
        return self.optimizer.no_sync() if quiet else contextlib.nullcontext()

    def _send_grad(self, state, ins):
        grad = state.input_grads.pop((ins.mb, ins.chunk))
        state.sends.append(self.comm.isend(grad, self._peer(ins), self._tag(ins)))

    def _step(self, state, ins):
        for request in state.sends:
            request.wait()
        if state.optimizer_step is not None:
            state.optimizer_step()

    def _dropout_context(self, state, ins):
        """The only code here that touches the model's dropout keys (``model.rng``): a forward runs
        with the global rows of its micro-batch on this data-parallel rank, so it draws exactly
        those rows of the single-device masks (the iteration is the caller's)."""
        rows = rows_of(state.rows, (ins.mb, self.m), (self.grid.dp_rank, self.grid.dp))
        return self.model.rng.at(rows=rows)

    def _post_receive(self, state, ins):
        return self.comm.irecv(xp.empty(state.shape, self.dtype), self._peer(ins), self._tag(ins))

    def _receive(self, state, ins):
        """An activation or a gradient (both of the agreed shape), from the receive posted ahead
        (PipeDream-2BW's: posted over its call's stream, ``pipedream._BatchReceives``)."""
        return state.receives.take(ins)

    @staticmethod
    def _clock():
        """Now, for the timeline. On a GPU, kernels run after Python queues them: wait for them
        first, or the timeline would show when work was queued, not when it ran."""
        if on_gpu():
            xp.cuda.get_current_stream().synchronize()
        return time.perf_counter()

    def _peer(self, ins):
        """The pipeline-group rank at the other end of a send or receive."""
        return peer(self.pipe, self.grid.pp_rank, ins)

    def _tag(self, ins):
        """A tag per message: (micro-batch, sending global chunk, activation or gradient)."""
        kind, mb, g = message_key(self.pipe, self.grid.pp_rank, ins)
        return 2 * (mb * self.pipe.n_chunks + g) + (kind == "grad")
