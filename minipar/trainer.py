"""The training loop on a TP x CP x DP x PP grid: what ``python -m minipar.train`` runs after its flags
are checked.

One step, on every layout (a 1 x 1 x 1 grid is the single-device run):

    batch      the step's global batch from (seed, iteration); every rank draws the same one
    schedule   the pipeline executor runs this rank's forwards and backwards over its micro-batches
               (PP = 1: one stage; gradient accumulation over micro-batches)
    gradients  summed over DP (x CP) and finished by ``model.finalize_grads()`` (sequence-parallel sums,
               the tied embedding's two parts): the optimizer's ``finish_gradients()``
    clip       by the whole model's gradient norm, across TP and PP groups (and DP, for ZeRO's pieces)
    step       AdamW, or its ZeRO-sharded form

The optimizer is a step-protocol object (``parallel/protocol.py``) made from ``--zero-stage`` by
``make_optimizer``; after that the step is the same calls for every stage, and which order its
sum and ``finalize_grads`` need is the optimizer's business, not the loop's.

A gradient norm that is not finite stops the run before the optimizer step: every rank sees the
same global norm, so every rank stops, and the ranks name the tensors that went bad.
"""

import contextlib
import functools
import json
import math
import os
import time

import numpy

import minipar
from minipar import precision
from minipar.checkpoint import full
from minipar.checkpoint.files import write_all
from minipar.lr_schedule import learning_rate
from minipar.mfu import measured_peak, model_flops_per_token
from minipar.models import GPT
from minipar.models.moe import step_statistics
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.pipeline.pipedream import PipeDream2BW
from minipar.parallel.pipeline.weight_stash import WeightStash
from minipar.parallel.pipeline import stage_times
from minipar.parallel.pipeline.schedules import shape_of
from minipar.train_paths import trim_log
from minipar.train_checks import PROG
from minipar.train_checkpoints import Checkpoints
from minipar.train_report import STUCK_STEPS, Reports
from minipar.watchdog import Watchdog


class Trainer(Checkpoints, Reports):
    def __init__(self, args, config, data, world, weights=None):
        self.args, self.config, self.data, self.world = args, config, data, world
        dtype, policy, scaler = precision.from_flags(
            args.dtype, args.bf16, args.fp16, args.accumulate_allreduce_grads_in_fp32, args.loss_scale,
            args.initial_loss_scale, args.min_loss_scale, args.loss_scale_window, args.hysteresis)
        self.scaler = scaler
        minipar.set_default_dtype(dtype)  # the model's: 16 bits under --bf16/--fp16
        minipar.manual_seed(args.seed)
        self.grid = grid = ProcessGrid(args.tp, args.pp, args.dp, world, cp=args.cp, ep=args.ep)
        self.model = model = GPT(config, grid, sequence_parallel=args.sequence_parallel, virtual_stages=args.vpp,
                                 cp_comm_type=args.cp_comm_type, pipeline_shape=shape_of(args.schedule),
                                 recompute_granularity="full" if args.recompute else args.recompute_granularity,
                                 layers_per_stage=args.pipeline_layers)
        hyper = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
        self.opt = make_optimizer(model, grid, args.zero_stage, policy=policy, scaler=scaler, **hyper)  # the only place the stage is read
        if args.schedule == "pipedream-2bw":  # no flush: each batch on its stashed weight version
            self.opt = WeightStash(self.opt, max_norm=args.grad_clip)
            self.executor = PipeDream2BW(model, grid, args.micro_batches, self.opt, recompute=args.recompute)
        else:
            self.executor = PipelineExecutor(model, grid, args.schedule, args.micro_batches, optimizer=self.opt,
                                             recompute=args.recompute, defer_embedding_wgrad=args.defer_embedding_wgrad,
                                             defer_wgrad_linears=args.defer_wgrad_linears)
        self.end = args.max_iters  # the run's last iteration + 1 (PipeDream-2BW drains before it)
        # chunks per rank; PipeDream-2BW's step runs the next batch's forwards too: no replay for it
        self.lagged = isinstance(self.executor, PipeDream2BW)  # its results come a step late (_steps)
        self.v, self.replayable = args.vpp, not self.lagged
        self.start, self._n_params, self.rates = 0, None, {}
        self.stuck = 0  # fp16 steps skipped in a row at a scale that cannot go lower (saved: a resume goes on counting)
        if weights is not None:
            full.load_full_state(model, self.opt, weights, grid)
        self.speaks = world.rank == 0
        self._resume(scaler)
        # one copy of each loss share: the rank holding the last chunk (pipeline rank 0 in a V)
        self.reports_loss = model.chunks[-1] == model.n_chunks - 1 and grid.tp_rank == 0

    # ---- one step ---------------------------------------------------------------------------
    def _update(self):
        """The executor's step instruction: finish the gradients, clip, and step (unless bad)."""
        self.opt.finish_gradients()
        self.norm = self.opt.clip_grad_norm(self.args.grad_clip)
        if math.isfinite(self.norm) or self.opt.skipped_step:  # fp16's overflow: step() skips it
            self.opt.step()

    def step(self, it):
        """Train iteration ``it``; returns the loss, gradient norm and bubble (the same on every rank)
        and the names of this rank's non-finite gradients."""
        started = self._start(it)
        if self.lagged:  # waited for at once: the update set aside in this step made now
            self.opt.apply()
        return self._results(started)

    def _start(self, it):
        """Run iteration ``it`` and start the one all-reduce of what it reports: the loss, and every
        stage's summary averaged over the stage's ranks. ``_results`` waits for it."""
        # an fp16 step skipped for an overflow changes no weight and does not advance the schedule
        # (Megatron steps its scheduler after successful updates alone): the rate follows the
        # updates taken, so a run that starts by skipping still warms up from the first update
        updates = self.opt.step_count if self.scaler is not None else it
        self.rates[it] = self.opt.lr = learning_rate(updates, self.args)  # (the log's, by iteration)
        self.model.rng.iteration = it  # dropout masks are keyed by the iteration (and the position)
        x, y = self.data.batch("train", it, self.args.batch_size, self.args.block_size, self.args.seed)
        for _, group in self._groups():
            group.stats.reset()
        self.model.moe.reset(it)  # with what the next batch's early forwards routed (PipeDream-2BW)
        self.loss_scale = self.opt.loss_scale  # this step's, before its overflow check may move it
        self.at_floor = self.scaler is not None and self.scaler.at_floor()  # ... and whether it can go lower
        # fp16's dynamic loss scale overflows on purpose now and then (the step is then skipped and
        # the scale lowered), so NumPy's overflow warnings say nothing the progress line does not
        quiet = numpy.errstate(over="ignore", invalid="ignore") if self.scaler is not None else contextlib.nullcontext()
        with quiet:
            if self.lagged:  # the next batch's forwards run during this step; the stash updates
                following = (self.data.batch("train", it + 1, self.args.batch_size, self.args.block_size,
                                             self.args.seed) if not self._drains(it) else None)
                record = self.executor.step(x, y, optimizer_step=self.opt.step, following=following)
            else:
                record = self.executor.step(x, y, optimizer_step=self._update)
        self.sent = {name: group.stats.total().bytes_sent for name, group in self._groups()}
        # routing over the whole step (a collective of a few numbers per layer)
        routing = step_statistics(self.model, self.world) if self.config.num_experts else None
        bad = [] if self.lagged or math.isfinite(self.norm) or self.opt.skipped_step else self._nonfinite()
        self.opt.zero_grad()
        loss = record.loss if self.reports_loss else 0.0
        g = self.grid
        m = self.args.micro_batches if self.replayable else None  # PipeDream-2BW's: no replay
        table = numpy.zeros((g.pp, stage_times.width(g.pp, self.v, m)))
        table[g.pp_rank] = stage_times.summary(record.timeline, g.pp, self.v, m)
        table /= self.world.size // g.pp
        totals = numpy.concatenate([[loss], table.ravel()])
        return it, self.world.iall_reduce(totals), table.shape, bad, routing

    def _results(self, started):
        """(loss, gradient norm, bubble, non-finite gradients) of a ``_start``: the same on every rank."""
        _, request, shape, bad, self.routing = started
        totals = request.wait()
        self.stages = totals[1:].reshape(shape)
        if self.lagged:  # PipeDream-2BW's, found at its update
            norm, params = self.opt.updates.pop(0)
            bad = self._names(params)
        else:
            norm = self.norm
        return float(totals[0]), norm, stage_times.bubble(self.stages), bad

    def _steps(self, start, end, watchdog):
        """Train iterations start .. end - 1, yielding (iteration, its results, its ms, and None or,
        when an evaluation follows it, a call that returns the validation loss) in order.
        PipeDream-2BW's results come one step late: summed over the stages, which end a batch at
        different times, while the next step runs (``weight_stash.py``), so that no stage waits for
        another; its evaluation runs right after its step all the same (on the weights it made)."""
        lag, queue = int(self.lagged), []  # started steps whose results are not yet taken
        try:
            for it in range(start, end):
                watchdog.arm(f"the step of iteration {it}")
                clock = time.perf_counter()
                started = self._start(it)
                ms = 1e3 * (time.perf_counter() - clock)
                evaluation = None
                if (it + 1) % self.args.eval_interval == 0 or it == self.args.max_iters - 1:
                    evaluation = functools.partial(self._evaluate_after, it, watchdog)
                    if self.lagged:  # on the weights this step made: before the next step moves them
                        evaluation = functools.partial(float, evaluation())
                queue.append((started, ms, evaluation))
                while len(queue) > (0 if self.lagged and self._drains(it) else lag):
                    done, ms, evaluation = queue.pop(0)
                    yield done[0], self._results(done), ms, evaluation
            while queue:
                done, ms, evaluation = queue.pop(0)
                yield done[0], self._results(done), ms, evaluation
        finally:  # a run stopped early (diverged) leaves no sum unwaited and no update pending
            for done, _, _ in queue:
                done[1].wait()
            if self.lagged:
                self.opt.apply()

    def _drains(self, it):
        """Whether PipeDream-2BW's stream ends after iteration ``it``: at the run's end, and where a
        checkpoint is saved, which then holds the two weight versions and nothing in flight (the
        versions each batch runs on are the same with or without the drain: only time is lost)."""
        return it + 1 >= self.end or bool(self.args.save) and (it + 1) % self.args.save_interval == 0

    def _evaluate_after(self, it, watchdog):
        watchdog.arm(f"the evaluation after iteration {it}")
        return self.evaluate()

    def _groups(self):
        g = self.grid
        # each communicator once: with CP the gradients are summed over dp_cp, without it that is dp
        sums = (("dp_cp", g.dp_cp_group),) if g.cp > 1 else ()
        experts = (("ep", g.ep_group), ("edp", g.edp_group)) if g.ep > 1 else ()
        return [(name, group) for name, group in (("tp", g.tp_group), ("cp", g.cp_group), ("dp", g.dp_group), ("pp", g.pp_group),
                                                  ("embedding", g.embedding_group), *sums, *experts) if group is not None]

    def _nonfinite(self):
        """Names of this rank's parameters whose gradient has a NaN or an infinity."""
        return self._names(self.opt.nonfinite_gradients())

    def _names(self, params):
        names = {id(p): n for n, p in self.model.named_parameters()}
        return sorted({names[id(p)] for p in params})

    def evaluate(self):
        """The mean validation loss over --eval-iters batches (forwards only)."""
        self.model.eval()
        total = 0.0
        for i in range(self.args.eval_iters):
            x, y = self.data.batch("val", i, self.args.batch_size, self.args.block_size, self.args.seed)
            record = self.executor.evaluate(x, y)
            total += record.loss if self.reports_loss else 0.0
        self.model.train()
        return float(self.world.all_reduce(numpy.array([total]))[0]) / self.args.eval_iters

    # ---- the run ----------------------------------------------------------------------------
    def run(self):
        args = self.args
        self._describe()
        # --exit-interval N stops once the iterations done are a multiple of N (Megatron-LM's rule),
        # so the same command run again with --load goes on to the next multiple.
        stop = (self.start // args.exit_interval + 1) * args.exit_interval if args.exit_interval else args.max_iters
        end = self.end = min(args.max_iters, stop)
        self.trained = False
        history, val_history, val_loss = [], [], None
        tokens_per_step = args.batch_size * args.block_size
        model_flops = tokens_per_step * model_flops_per_token(self.config)
        dtype = self.model.parameters()[0].dtype
        peak = measured_peak(self.world, dtype)  # a collective, before the clock
        if args.log_json and self.speaks:  # its folder was checked with the flags, not made
            os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
            trim_log(args.log_json, self.start)  # a resumed run's rows from its start on are written again
        # one process cannot wait for another: the watchdog only watches a job of several
        minutes = args.distributed_timeout_minutes if self.world.size > 1 else 0
        # unbuffered: a write that fails (a full disk) fails at once, naming the file below, and
        # leaves nothing for the close to fail on again
        with open(args.log_json if args.log_json and self.speaks else os.devnull, "ab" if self.start else "wb",
                  buffering=0) as log, Watchdog(60 * minutes, f"--distributed-timeout-minutes {minutes:g}",
                                           self.world.abort, PROG, self.world.rank) as watchdog:
            for it, (loss, norm, bubble, bad), ms, evaluation in self._steps(self.start, end, watchdog):
                if not (math.isfinite(loss) and (math.isfinite(norm) or self.opt.skipped_step)):
                    return self._diverged(it, loss, norm, bad)
                # fp16 steps skipped in a row at a scale that cannot go lower train nothing, ever
                self.stuck = self.stuck + 1 if self.opt.skipped_step and self.at_floor else 0
                if self.stuck == STUCK_STEPS:
                    return self._stuck(it)
                last = it == end - 1
                shown = it % args.log_interval == 0 or last  # a progress line, with its MFU
                if shown and it != self.start and evaluation is None:
                    # measured again where a line shows MFU (one round: a few ms every 20 steps), so
                    # that a peak taken while the machine was busy misleads a line or two, not 100 steps
                    peak = max(peak, measured_peak(self.world, dtype, rounds=1))
                record = self._record(it, loss, norm, bubble, ms, model_flops / (ms / 1e3) / peak)
                if evaluation is not None:
                    val_loss = record["val_loss"] = evaluation()
                    val_history.append((it, val_loss))
                    # other work on the machine only slows a measurement: the highest one is the
                    # nearest the peak (one taken while the machine was busy made MFU exceed 100%)
                    peak = max(peak, measured_peak(self.world, dtype))
                if args.save and ((it + 1) % args.save_interval == 0 or last):
                    watchdog.arm(functools.partial(self._save_said, it + 1))
                    self.save(it + 1)
                history.append(loss)
                try:
                    write_all(log.fileno(), (json.dumps(record) + "\n").encode())
                except OSError as exc:  # train.py ends the job in one line naming the file
                    exc.filename = args.log_json
                    raise
                if self.speaks and shown:
                    print(self._progress(it, record, val_loss, tokens_per_step / (ms / 1e3)), flush=True)
        if args.max_iters == 0:  # nothing to train: measure the weights as they came
            val_loss = self.evaluate()
            if self.speaks:
                print(f"val loss {val_loss:.4f} (--max-iters 0: {args.eval_iters} batches of "
                      f"{args.batch_size} x {args.block_size} tokens, nothing trained)", flush=True)
        if args.report:
            self._report()
        if end < args.max_iters:
            if self.speaks:
                print(f"stopped after {end} iterations (--exit-interval {args.exit_interval}); resume with --load {args.save}")
            return 0
        self.trained = True  # what follows writes the outputs of a finished run
        return self._finish(history, val_history)
