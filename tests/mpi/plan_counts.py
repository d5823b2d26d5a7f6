"""The planner's predictions against one training step of the real trainer, on 4 ranks: every
group's bytes sent equal ``plan.traffic.group_bytes`` exactly (the experts' all-to-all-v, which
depends on the router, within 10% of a uniform router's), and the optimizer's ``state_bytes()``
equal ``plan.state.state_bytes`` exactly, on every rank of every layout. Under ZeRO-3 two more
steps (the first records the order the next ones prefetch in) check the most its ledger holds
during a step, which the trainer's memory check plans (``plan.state.stage_peak_bytes``): with the
sends finishing as they do, between the planned least (every send done at once) and the planned
most; with every send left pending until the optimizer must wait for it (``Late``), the planned
most exactly, in total and per kind. Under ZeRO-1 and 2 the same two steps check
``stage_peak_bytes`` (``plan.zero12``): the ledger's peak with every send pending equals it, the
peak as sent lies under it.

    run_mpi.sh -n 4 tests/mpi/plan_counts.py
"""

import json

import numpy

from minipar.comm import world
from minipar.plan import zero3_peak
from minipar.plan.shapes import Layout, Model
from minipar.plan.state import stage_peak_bytes, state_bytes
from minipar.plan.traffic import group_bytes, group_calls
from minipar.train import build, build_parser
from minipar.train_checks import check_args
from minipar.train_report import gather_text
from minipar.trainer import Trainer

MODEL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
         "--plot", "", "--sample", "0", "--dropout", "0.1"]
LAYOUTS = [  # (flags, the same as a plan Layout, experts[, the plan's precision[, --moe-layer-freq]])
    ("--tp 2 --sequence-parallel --recompute", dict(tp=2, dp=2, sequence_parallel=True, recompute=True, micro_batch_size=4), 0),
    ("--tp 2 --pp 2 --micro-batch-size 2", dict(tp=2, pp=2, micro_batch_size=2), 0),
    ("--pp 2 --schedule interleaved --vpp 2 --micro-batch-size 1 --zero-stage 1",
     dict(pp=2, dp=2, vpp=2, schedule="interleaved", micro_batch_size=1, zero_stage=1), 0),
    ("--pp 2 --schedule zb-v --vpp 2 --micro-batch-size 1 --zero-stage 1",
     dict(pp=2, dp=2, vpp=2, schedule="zb-v", micro_batch_size=1, zero_stage=1), 0),
    ("--pp 2 --schedule interleaved --vpp 2 --micro-batch-size 1 --zero-stage 2",  # a group spans two chunks
     dict(pp=2, dp=2, vpp=2, schedule="interleaved", micro_batch_size=1, zero_stage=2), 0),
    ("--tp 2 --pp 2 --schedule zb-v --vpp 2 --micro-batch-size 2 --sequence-parallel",
     dict(tp=2, pp=2, vpp=2, schedule="zb-v", micro_batch_size=2, sequence_parallel=True), 0),
    ("--zero-stage 2 --micro-batch-size 1", dict(dp=4, zero_stage=2, micro_batch_size=1), 0),
    ("--zero-stage 2 --pp 2 --micro-batch-size 1", dict(pp=2, dp=2, zero_stage=2, micro_batch_size=1), 0),
    ("--zero-stage 2 --pp 2 --defer-embedding-wgrad-compute --defer-wgrad-linears 3 --micro-batch-size 1",
     dict(pp=2, dp=2, zero_stage=2, defer_embedding_wgrad=True, defer_wgrad_linears=3, micro_batch_size=1), 0),
    ("--zero-stage 2 --pp 2 --num-experts 4 --ep 2 --moe-layer-freq 2 --defer-embedding-wgrad-compute "  # the last
     "--defer-wgrad-linears 4 --micro-batch-size 1", dict(pp=2, dp=2, ep=2, zero_stage=2, defer_embedding_wgrad=True,
                                                         defer_wgrad_linears=4, micro_batch_size=1), 4, "float32", 2),
    ("--zero-stage 2 --pp 2 --schedule zb-h1 --micro-batch-size 1",
     dict(pp=2, dp=2, zero_stage=2, schedule="zb-h1", micro_batch_size=1), 0),
    ("--zero-stage 2 --tp 2 --sequence-parallel --micro-batch-size 2",
     dict(tp=2, dp=2, zero_stage=2, sequence_parallel=True, micro_batch_size=2), 0),
    ("--zero-stage 2 --tp 2 --sequence-parallel --num-experts 4 --ep 2 --micro-batch-size 2",
     dict(tp=2, dp=2, ep=2, zero_stage=2, sequence_parallel=True, micro_batch_size=2), 4),
    ("--zero-stage 3 --micro-batch-size 1", dict(dp=4, zero_stage=3, micro_batch_size=1), 0),
    ("--zero-stage 3 --tp 2 --sequence-parallel --micro-batch-size 2",
     dict(tp=2, dp=2, zero_stage=3, sequence_parallel=True, micro_batch_size=2), 0),
    ("--zero-stage 3 --pp 2 --micro-batch-size 1", dict(pp=2, dp=2, zero_stage=3, micro_batch_size=1), 0),
    ("--zero-stage 3 --pp 2 --schedule zb-h1 --micro-batch-size 1",  # B releases its units, W makes the buffers
     dict(pp=2, dp=2, zero_stage=3, schedule="zb-h1", micro_batch_size=1), 0),
    ("--zero-stage 3 --pp 2 --schedule zb-v --vpp 2 --micro-batch-size 1",
     dict(pp=2, dp=2, vpp=2, zero_stage=3, schedule="zb-v", micro_batch_size=1), 0),
    ("--zero-stage 3 --pp 2 --defer-embedding-wgrad-compute --micro-batch-size 1",
     dict(pp=2, dp=2, zero_stage=3, defer_embedding_wgrad=True, micro_batch_size=1), 0),
    ("--zero-stage 3 --schedule zb-h1 --micro-batch-size 1",  # one chunk: its W completes the tied embedding once
     dict(dp=4, zero_stage=3, schedule="zb-h1", micro_batch_size=1), 0),
    ("--zero-stage 3 --pp 2 --schedule zb-h2 --recompute --micro-batch-size 1",
     dict(pp=2, dp=2, zero_stage=3, schedule="zb-h2", recompute=True, micro_batch_size=1), 0),
    # a W's first hooks make the buffers: a block's dense weights', then its partial sums' (SP); the router's first
    ("--zero-stage 3 --tp 2 --pp 2 --sequence-parallel --schedule zb-h1 --micro-batch-size 2",
     dict(tp=2, pp=2, zero_stage=3, sequence_parallel=True, schedule="zb-h1", micro_batch_size=2), 0),
    ("--zero-stage 3 --tp 2 --pp 2 --sequence-parallel --defer-embedding-wgrad-compute --micro-batch-size 2",
     dict(tp=2, pp=2, zero_stage=3, sequence_parallel=True, defer_embedding_wgrad=True, micro_batch_size=2), 0),
    ("--zero-stage 3 --pp 2 --defer-embedding-wgrad-compute --defer-wgrad-linears 5 --micro-batch-size 1",
     dict(pp=2, dp=2, zero_stage=3, defer_embedding_wgrad=True, defer_wgrad_linears=5, micro_batch_size=1), 0),
    ("--zero-stage 3 --tp 2 --pp 2 --sequence-parallel --recompute --defer-embedding-wgrad-compute "
     "--defer-wgrad-linears 2 --micro-batch-size 2", dict(tp=2, pp=2, zero_stage=3, sequence_parallel=True, recompute=True,
                                                        defer_embedding_wgrad=True, defer_wgrad_linears=2, micro_batch_size=2), 0),
    ("--num-experts 4 --ep 2 --pp 2 --zero-stage 3 --schedule zb-h1 --micro-batch-size 1",
     dict(pp=2, dp=2, ep=2, zero_stage=3, schedule="zb-h1", micro_batch_size=1), 4),
    ("--num-experts 4 --tp 2 --pp 2 --sequence-parallel --zero-stage 3 --schedule zb-v --vpp 2 "
     "--micro-batch-size 2", dict(tp=2, pp=2, vpp=2, sequence_parallel=True, zero_stage=3, schedule="zb-v",
                                  micro_batch_size=2), 4),
    ("--cp 2 --recompute", dict(cp=2, dp=2, recompute=True, micro_batch_size=4), 0),
    ("--cp 2 --tp 2 --cp-comm-type a2a", dict(cp=2, tp=2, cp_comm_type="a2a", micro_batch_size=8), 0),
    ("--cp 2 --num-experts 4 --ep 4 --zero-stage 1",  # EP over CP and DP: every edp group one rank
     dict(cp=2, dp=2, ep=4, zero_stage=1, micro_batch_size=4), 4),
    ("--num-experts 4 --ep 2 --moe-router-topk 2", dict(dp=4, ep=2, micro_batch_size=2), 4),
    ("--tp 2 --bf16 --micro-batch-size 4", dict(tp=2, dp=2, micro_batch_size=4), 0, "bf16"),  # the loss's sums in fp32
    ("--num-experts 4 --ep 2 --zero-stage 1 --micro-batch-size 2", dict(dp=4, ep=2, zero_stage=1, micro_batch_size=2), 4),
    ("--num-experts 4 --ep 2 --zero-stage 2 --micro-batch-size 1", dict(dp=4, ep=2, zero_stage=2, micro_batch_size=1), 4),
    ("--num-experts 4 --ep 2 --zero-stage 3 --micro-batch-size 1", dict(dp=4, ep=2, zero_stage=3, micro_batch_size=1), 4),
    ("--num-experts 4 --ep 2 --pp 2 --micro-batch-size 2", dict(pp=2, dp=2, ep=2, micro_batch_size=2), 4),  # stage 0: no dense tail
    ("--num-experts 4 --ep 2 --tp 2 --sequence-parallel --micro-batch-size 4",  # the experts' and router's partial
     dict(tp=2, dp=2, ep=2, sequence_parallel=True, micro_batch_size=4), 4),  # gradients summed over TP
]


def groups(grid):
    """{name: communicator} of the grid's groups of more than one rank, each once."""
    named = {"tp": grid.tp_group, "cp": grid.cp_group, "dp": grid.dp_group, "pp": grid.pp_group,
             "dp_cp": grid.dp_cp_group, "embedding": grid.embedding_group, "ep": grid.ep_group, "edp": grid.edp_group}
    out, seen = {}, set()
    for name, group in named.items():
        if group is not None and group.size > 1 and id(group) not in seen:
            out[name] = group
            seen.add(id(group))
    return out


class Late:
    """A send that says it is not done until waited for: the optimizer's worst case, every send it
    may leave pending (``ShardedAdamW.IN_FLIGHT``) still in flight when the next one starts."""

    def __init__(self, request):
        self.request = request

    def test(self):
        return False

    def wait(self):
        return self.request.wait()


def step_peak(trainer, it, late=False):
    """(peak total, peak per kind) of the optimizer's ledger over training step ``it``."""
    opt = trainer.opt
    while not hasattr(opt, "ledger"):  # (a mixed-precision wrapper's)
        opt = opt.inner
    ledger = opt.ledger
    ledger.restart_peak()
    if late:
        collect = opt._collect

        def pending_to_the_end(keep=0):
            opt.pending = [(i, r if isinstance(r, Late) else Late(r), n) for i, r, n in opt.pending]
            collect(keep)

        opt._collect = pending_to_the_end
    try:
        trainer.step(it)
    finally:
        opt.__dict__.pop("_collect", None)
    return ledger.peak_total, dict(ledger.peak)


comm = world()
parser = build_parser()
failures, lines = [], []
for flags, fields, experts, *precision in LAYOUTS:
    dtype = precision[0] if precision else "float32"
    args = parser.parse_args(MODEL + flags.split())
    check_args(args, comm.size)
    data, config = build(parser, args)
    trainer = Trainer(args, config, data, comm)
    grid = trainer.grid
    measured_groups = groups(grid)
    for group in measured_groups.values():
        group.stats.reset()
    trainer.step(0)
    measured = {name: g.stats.total().bytes_sent for name, g in measured_groups.items()}
    measured = {k: v for k, v in measured.items() if v}
    model = Model(4, 16, 4, 16, num_experts=experts, moe_router_topk=2, moe_layer_freq=precision[1] if precision[1:] else 1)
    layout = Layout(**fields)
    predicted = group_bytes(model, layout, 8, grid.pp_rank, dtype)
    state, planned = trainer.opt.state_bytes(), state_bytes(model, layout, grid.pp_rank, dtype)
    bad = [k for k in set(measured) | set(predicted) if k != "ep" and measured.get(k) != predicted.get(k)]
    # the calls too (what plan.overhead's per-call cost multiplies); the experts' are a count as well
    calls = {name: g.stats.total().calls for name, g in measured_groups.items() if name in measured}
    planned_calls = group_calls(model, layout, 8, grid.pp_rank, dtype)
    bad += [f"{k} calls" for k in set(calls) | set(planned_calls) if calls.get(k) != planned_calls.get(k)]
    if "ep" in predicted and not abs(measured.get("ep", 0) - predicted["ep"]) <= 0.1 * predicted["ep"]:
        bad.append("ep")
    if bad or state != planned:
        failures.append(f"rank {comm.rank} {flags}: groups {sorted(bad)} measured {measured} predicted {predicted}; "
                        f"calls {calls} predicted {planned_calls}; "
                        f"state measured {state} predicted {planned}")
    if layout.zero_stage == 3:  # the most it holds in a step: as sends finish, and all pending to the end
        m = args.micro_batches
        most = stage_peak_bytes(model, layout, grid.pp_rank, dtype, m)
        kinds = zero3_peak.peak_bytes(model, layout, m, grid.pp_rank, dtype)
        least = zero3_peak.peak_bytes(model, layout, m, grid.pp_rank, dtype, in_flight=0)["total"]
        real, late = step_peak(trainer, 1), step_peak(trainer, 2, late=True)
        if not least <= real[0] <= most or late != (most, {k: kinds[k] for k in late[1]}):
            failures.append(f"rank {comm.rank} {flags}: ZeRO-3's peak {real[0]} as sent, {late} all pending; "
                            f"planned {least} to {most}, {kinds}; shards alone {sum(state.values())}")
    if layout.zero_stage in (1, 2):  # the group being sent and the one before it, held gradients (plan.zero12)
        most = stage_peak_bytes(model, layout, grid.pp_rank, dtype, args.micro_batches)
        real, late = step_peak(trainer, 1), step_peak(trainer, 2, late=True)
        if not real[0] <= late[0] == most:
            failures.append(f"rank {comm.rank} {flags}: ZeRO-{layout.zero_stage}'s peak {real[0]} as sent, "
                            f"{late[0]} all pending; planned {most}")
    lines.append(json.dumps({"layout": flags, "rank": comm.rank, "measured": measured, "predicted": predicted,
                             "state": sum(state.values()),
                             **({"peak": real[0], "peak all pending": late[0]} if layout.zero_stage else {})}))
report = gather_text(comm, "\n".join(failures) if failures else "")
everything = gather_text(comm, "\n".join(lines))
ok = comm.all_reduce(numpy.array([len(failures)]))[0] == 0
if comm.rank == 0:
    print("\n".join(everything))
    print("\n".join(r for r in report if r))
    print(f"plan counts {'OK' if ok else 'MISMATCH'} on {comm.size} ranks")
raise SystemExit(0 if ok else 1)
