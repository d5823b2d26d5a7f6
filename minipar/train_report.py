"""What ``python -m minipar.train`` prints about its run, beside the loop (``trainer.py``): the
run's description at the start, each iteration's --log-json row, the messages of a run that
diverged or whose fp16 steps are all skipped, and ``--report``'s tables of each rank's memory,
traffic and host, and of the routing of a mixture of experts. ``Reports`` is a mixin of
``Trainer``: it reads the trainer's args, grid, model, optimizer and world, and sends nothing but
the gathers its tables need (the hostnames once, at the start).
"""

import math
import socket
import sys

import numpy

from minipar.checkpoint import full
from minipar.checkpoint.boxes import volume
from minipar.checkpoint.pieces import pieces
from minipar.models import GPT
from minipar.parallel.pipeline import stage_times
from minipar.train_checks import PROG

STUCK_STEPS = 10  # fp16 steps skipped in a row at the lowest loss scale before the run stops


def last_checkpoint(save):
    """The iteration of the checkpoint that ``latest`` names in the folder ``save``, or None (no
    --save, or nothing saved yet)."""
    from minipar.checkpoint.sharded import CheckpointError, read_index

    if not save:
        return None
    try:
        return read_index(save)["iteration"]
    except CheckpointError:
        return None


def kept(save):
    """The sentence a failed run ends with about its checkpoints ("" without --save)."""
    if not save:
        return ""
    iteration = last_checkpoint(save)
    if iteration is None:
        return f" No checkpoint was saved in {save} yet."
    return f" The last checkpoint in {save} (iteration {iteration}) is kept."


def gather_text(world, text):
    """Every rank's ``text`` on rank 0, in rank order (None elsewhere): bytes, no pickle."""
    parts = world.gather_to_root(numpy.frombuffer(text.encode(), numpy.uint8), tag=7101)
    return None if parts is None else [part.tobytes().decode() for part in parts]


def groups_across_hosts(layout, hosts):
    """{group kind: the groups of that kind whose ranks run on more than one host}, for every kind
    of ``layout`` with groups of more than one rank; ``hosts[r]`` is rank r's hostname."""
    kinds = [k for k in ("tp", "cp", "dp", "pp") if getattr(layout, k) > 1] + ["embedding"] * (layout.pp > 1)
    return {kind: [g for g in layout.groups(kind) if len({hosts[r] for r in g}) > 1] for kind in kinds}


def host_lines(layout, hosts):
    """The report's lines on hosts: which ranks run where, and which groups cross hosts (the
    launcher's order of ranks onto hosts decides it, as the hostfile lists them)."""
    where = {}
    for rank, host in enumerate(hosts):
        where.setdefault(host, []).append(rank)
    lines = ["hosts: " + "; ".join(f"{h}: ranks {' '.join(map(str, rs))}" for h, rs in where.items())]
    if len(where) > 1:
        for kind, crossing in groups_across_hosts(layout, hosts).items():
            total = len(layout.groups(kind))
            lines.append(f"  {kind} groups across hosts: {len(crossing)} of {total}"
                         + (": " + " ".join(str(g) for g in crossing[:4]) + (" ..." if len(crossing) > 4 else "")
                            if crossing else ""))
    return lines


def tp_warning(layout, hosts):
    """One line when a TP group spans hosts, else None: Megatron's placement rule keeps TP, whose
    all-reduces sit inside every layer's forward and backward, on the fast links of one node."""
    crossing = groups_across_hosts(layout, hosts).get("tp", [])
    if not crossing:
        return None
    return (f"warning: {len(crossing)} of {len(layout.groups('tp'))} TP groups span hosts (e.g. ranks {crossing[0]} "
            f"on {', '.join(sorted({hosts[r] for r in crossing[0]}))}): TP's all-reduces in every layer go "
            "over the network; give each host a multiple of TP ranks, in rank order (docs/multi_node.md)")


def _power_of_two(x):
    """A loss scale as the power of two it is (2^16), or as a number if it is not one."""
    exponent = math.log2(x) if x > 0 else 0.5
    return f"2^{int(exponent)}" if exponent.is_integer() else f"{x:g}"


class Reports:
    def _progress(self, it, record, val_loss, tokens_per_second):
        """The progress line of iteration ``it`` (``record``: its --log-json row)."""
        val = f"{val_loss:.4f}" if val_loss is not None else "  -   "
        line = (f"iter {it:>5} | loss {record['loss']:.4f} | val {val} | lr {record['lr']:.2e} | "
                f"{tokens_per_second:>8,.0f} tok/s | {record['ms']:7.1f} ms/iter | bubble {record['bubble']:.2f} | "
                f"MFU {100 * record['mfu']:4.1f}%")
        if self.routing is not None:
            line += f" | aux {self.routing['aux_loss']:.4f}"
        if self.scaler is not None:  # fp16: the scale this step's loss was multiplied by
            line += f" | scale {_power_of_two(self.loss_scale)}" + (", skipped: overflow" if self.opt.skipped_step else "")
        return line

    def _describe(self):
        n_params = self.model_parameters()  # a collective: before the rank check
        self.hosts = gather_text(self.world, socket.gethostname())  # once: rank 0 alone reads it
        if not self.speaks:
            return
        a, g = self.args, self.grid
        print(f"model: {n_params:,} parameters, {a.n_layer} layers, {a.n_head} heads, "
              f"{a.n_embd} hidden, context {a.block_size}, {self.model.parameters()[0].dtype.name}")
        cp = f" x CP {g.cp} ({a.cp_comm_type})" if g.cp > 1 else ""
        ep = f" (EP {g.ep} of DP x CP)" if g.ep > 1 and g.cp > 1 else f" (EP {g.ep})" if g.ep > 1 else ""
        print(f"layout: {self.world.size} ranks = TP {g.tp}{cp} x PP {g.pp} x DP {g.dp}{ep}; {a.micro_batches} "
              f"micro-batch(es) of {a.batch_size // g.dp // a.micro_batches} per DP rank; schedule {a.schedule}"
              + (f", {a.vpp} virtual stages" if a.vpp > 1 else "")
              + (f", layers per chunk {','.join(map(str, a.pipeline_layers))}" if a.pipeline_layers else "")
              + (", the head's weight gradients at the flush" if a.defer_embedding_wgrad else "")
              + (f" with those of the last {a.defer_wgrad_linears} linear layer{'s' * (a.defer_wgrad_linears > 1)}"
                 if a.defer_wgrad_linears else "")
              + f"; ZeRO stage {self.opt.stage}"
              + (f"; {self.opt.policy.params.name}, fp32 master weights" if self.opt.policy is not None else "")
              + (", sequence parallel" if a.sequence_parallel else "") + (", recompute" if a.recompute else "")
              + (", selective recompute" if a.recompute_granularity == "selective" else ""))
        c = self.config
        if c.num_experts:
            layers = sum(c.is_moe(i) for i in range(c.n_layer))
            capacity = (f"capacity factor {c.moe_expert_capacity_factor}" if c.moe_expert_capacity_factor
                        else "dropless")
            print(f"experts: {layers} MoE layers of {c.num_experts} experts, top-{c.moe_router_topk}, {capacity}; "
                  f"EP {g.ep} ({c.num_experts // g.ep} experts per rank); aux loss x {c.moe_aux_loss_coeff}, "
                  f"z-loss x {c.moe_z_loss_coeff}")
        unit = "tokens" if self.args.tokenizer is not None else "bytes"  # (the splits hold token ids)
        print(f"data: {sum(len(s) for s in self.data.splits.values()):,} {unit} "
              f"({a.data or 'Python standard library'}), {a.batch_size * a.block_size:,} tokens per step"
              + (f"; resuming at iteration {self.start} from {a.load}" if a.load else ""))
        warning = tp_warning(g.layout, self.hosts)
        if warning:
            print(warning, file=sys.stderr, flush=True)

    def _record(self, it, loss, norm, bubble, ms, mfu):
        """Iteration ``it``'s row of --log-json (and of the progress line)."""
        args = self.args
        record = {"iter": it, "loss": loss, "lr": self.rates.pop(it), "grad_norm": norm, "ms": ms, "bubble": bubble,
                  "mfu": mfu}
        # the bubble of this step's compute alone (stage_times): a replay of up to 4096
        # chunk-passes, 0.1 s at that size, so only for a log; on every rank alike, so that
        # every rank starts the next step together
        m = args.micro_batches
        expected = stage_times.expected(args.schedule, self.v, m, self.stages,
                                        args.defer_embedding_wgrad) if args.log_json else None
        if expected is not None:
            record.update(bubble_expected=expected, stage_ms=stage_times.costs_ms(self.stages, self.v, m))
        if self.opt.policy is not None:  # mixed precision: the scale the step's loss was multiplied by
            record.update(loss_scale=self.loss_scale, skipped=self.opt.skipped_step)
            if self.opt.skipped_step:  # the scaled gradients overflowed: no norm (JSON has no inf)
                record["grad_norm"] = None
        if self.routing is not None:  # per MoE layer, over the whole step
            r = self.routing
            record.update(aux_loss=r["aux_loss"], z_loss=r["z_loss"], moe_layers=r["layers"],
                          tokens_per_expert=r["tokens_per_expert"].tolist(), dropped=r["dropped"].tolist())
        return record

    def _diverged(self, it, loss, norm, bad):
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        lines = gather_text(self.world, f"rank {self.world.rank}: {', '.join(bad[:3])}{more}" if bad else "")
        if self.speaks:
            named = "; ".join(line for line in lines if line) or "none found (the loss itself)"
            print(f"{PROG}: error: at iter {it} the loss is {loss} and the gradient norm {norm}: training diverged; "
                  f"non-finite gradients: {named}. Lower --lr or raise --warmup-iters.{kept(self.args.save)}",
                  file=sys.stderr, flush=True)
        self.world.barrier()  # a rank's non-zero exit aborts the job: not before rank 0 has spoken
        return 1

    def _stuck(self, it):
        """The run's last STUCK_STEPS steps overflowed at the lowest scale fp16 may use: stop."""
        if self.speaks:
            a = self.args
            fix = (f"lower --loss-scale {a.loss_scale:g}" if a.loss_scale else
                   f"lower --min-loss-scale {self.loss_scale:g}")
            print(f"{PROG}: error: at iter {it} the last {STUCK_STEPS} steps were all skipped: every one's fp16 "
                  f"gradients overflowed at the loss scale {self.loss_scale:g}, which cannot go lower, so "
                  f"the weights no longer change: {fix}, or train in --bf16.{kept(a.save)}", file=sys.stderr,
                  flush=True)
        self.world.barrier()  # as _diverged: rank 0 speaks before the non-zero exit aborts the job
        return 1

    def _report(self):
        held = self.opt.state_bytes()
        g, sent = self.grid, self.sent
        planned = getattr(self.args, "planned_state_peaks", None)  # train_checks' memory check
        numbers = [held.get(k, 0) for k in ("parameters", "gradients", "optimizer")] + (
            [held["stash"]] if "stash" in held else []) + [self.opt.peak_state_bytes()] + (
            [planned[g.pp_rank]] if planned else [])
        line = (f"{self.world.rank:>4} {g.tp_rank:>3} {g.dp_rank:>3} {g.pp_rank:>3}"  # a space before each number:
                + "".join(f" {n:>14,}" for n in numbers)  # 10^12 bytes still stand apart
                + "  " + ", ".join(f"{k} {v:,}" for k, v in sent.items()))
        lines = gather_text(self.world, line)
        if self.speaks:
            print("\nper rank: bytes held (parameters, gradients, optimizer state) after the last step, the most "
                  "held during the run" + (" and the most planned for a step (the memory check's)" if planned else "")
                  + ", bytes sent in the last step")
            names = ["parameters", "gradients", "optimizer"] + (["stash"] if "stash" in held else []) + (
                ["peak"] + (["planned"] if planned else []))  # stash: PipeDream-2BW's second version
            print(f"{'rank':>4} {'tp':>3} {'dp':>3} {'pp':>3}" + "".join(f" {n:>14}" for n in names) + "  sent")
            print("\n".join(lines))
            print("\n".join(host_lines(g.layout, self.hosts)))
            if self.routing is not None:
                self._report_routing()

    def _report_routing(self):
        r = self.routing
        slots = r["tokens_per_expert"].sum(axis=1) + r["dropped"]
        print(f"\nrouting in the last step (token-slots per expert; aux loss {r['aux_loss']:.5f}, "
              f"z-loss {r['z_loss']:.5f})")
        for layer, loads, dropped, total in zip(r["layers"], r["tokens_per_expert"], r["dropped"], slots):
            print(f"  layer {layer:>3}: {' '.join(f'{n:>6}' for n in loads)}   dropped {dropped} of {total}")

    def model_parameters(self):
        """Parameters of the whole model: every rank counts what it would save (each element
        exactly once over the world) and the counts are added (a collective, on first call)."""
        if self._n_params is None:
            mine = sum(volume(start, stop) for piece in pieces(self.model, self.opt, self.grid)
                       if piece.kind == "param" and piece.write for start, stop, _ in piece.global_boxes())
            self._n_params = int(self.world.all_reduce(numpy.array([mine], numpy.int64))[0])
        return self._n_params

    def _finish(self, history, val_history):
        """What a finished run writes: its weights, a Hugging Face snapshot, the loss curve, a
        sample. Returns the run's exit status: 1 when the weights to write are not finite."""
        args = self.args
        needed = args.export_weights or args.export_hf or args.sample > 0
        weights = full.gather_full_state(self.model, self.opt, self.grid) if needed else None
        if not self.speaks:
            return 0
        if weights is not None and not all(numpy.isfinite(w).all() for w in weights.values()):
            print(f"{PROG}: error: the weights after the last step are not finite: its update diverged (the loss "
                  "logged was computed before it), so nothing is exported or sampled. Lower --lr or raise "
                  "--warmup-iters.", file=sys.stderr, flush=True)
            return 1
        if args.export_weights:
            from minipar.checkpoint import save_weights

            save_weights(weights, args.export_weights)
            print(f"weights written to {args.export_weights}")
        if args.export_hf:
            from minipar.checkpoint.hf import save_snapshot

            tokenizer = args.tokenizer.files if args.tokenizer is not None else ()
            save_snapshot(weights, self.config, args.export_hf, args.dropout, args.hf_token_ids, tokenizer)
            print(f"Hugging Face snapshot written to {args.export_hf}")
        if args.plot and history:
            from minipar.plots import plot_loss

            plot_loss(history, val_history, args.plot, title=f"GPT {self.model_parameters():,} params",
                      first=self.start)  # a resumed run's losses from its first iteration, as its evaluations
            print(f"loss curve written to {args.plot}")
        if args.sample > 0:
            from minipar import data

            encode, decode = (args.tokenizer.encode, args.tokenizer.decode) if args.tokenizer is not None else (
                data.encode, data.decode)  # BPE ids, or bytes
            serial = GPT(self.config)
            dtype = serial.parameters()[0].dtype  # a 16-bit model samples from its masters' rounding
            serial.load_state_dict({name: w.astype(dtype, copy=False) for name, w in weights.items()})
            prompt = encode(args.prompt)[None, :].astype(numpy.int64)
            rng = numpy.random.default_rng(args.seed)
            try:
                print("sample:\n" + decode(serial.generate(prompt, args.sample, temperature=0.8, generator=rng)[0]))
            except FloatingPointError as exc:
                print(f"{PROG}: error: --sample: {exc}", file=sys.stderr, flush=True)
                return 1
        return 0
