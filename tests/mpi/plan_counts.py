"""The planner's predictions against one training step of the real trainer, on 4 ranks: every
group's bytes sent equal ``plan.traffic.group_bytes`` exactly (the experts' all-to-all-v, which
depends on the router, within 10% of a uniform router's), and the optimizer's ``state_bytes()``
equal ``plan.state.state_bytes`` exactly, on every rank of every layout.

    run_mpi.sh -n 4 tests/mpi/plan_counts.py
"""

import json

import numpy

from minipar.comm import world
from minipar.plan.shapes import Layout, Model
from minipar.plan.state import state_bytes
from minipar.plan.traffic import group_bytes, group_calls
from minipar.train import build, build_parser
from minipar.train_checks import check_args
from minipar.train_report import gather_text
from minipar.trainer import Trainer

MODEL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
         "--plot", "", "--sample", "0", "--dropout", "0.1"]
LAYOUTS = [  # (flags, the same as a plan Layout, experts[, the plan's precision])
    ("--tp 2 --sequence-parallel --recompute", dict(tp=2, dp=2, sequence_parallel=True, recompute=True, micro_batch_size=4), 0),
    ("--tp 2 --pp 2 --micro-batch-size 2", dict(tp=2, pp=2, micro_batch_size=2), 0),
    ("--pp 2 --schedule interleaved --vpp 2 --micro-batch-size 1 --zero-stage 1",
     dict(pp=2, dp=2, vpp=2, schedule="interleaved", micro_batch_size=1, zero_stage=1), 0),
    ("--pp 2 --schedule zb-v --vpp 2 --micro-batch-size 1 --zero-stage 1",
     dict(pp=2, dp=2, vpp=2, schedule="zb-v", micro_batch_size=1, zero_stage=1), 0),
    ("--tp 2 --pp 2 --schedule zb-v --vpp 2 --micro-batch-size 2 --sequence-parallel",
     dict(tp=2, pp=2, vpp=2, schedule="zb-v", micro_batch_size=2, sequence_parallel=True), 0),
    ("--zero-stage 2 --micro-batch-size 1", dict(dp=4, zero_stage=2, micro_batch_size=1), 0),
    ("--zero-stage 2 --pp 2 --micro-batch-size 1", dict(pp=2, dp=2, zero_stage=2, micro_batch_size=1), 0),
    ("--zero-stage 2 --pp 2 --schedule zb-h1 --micro-batch-size 1",
     dict(pp=2, dp=2, zero_stage=2, schedule="zb-h1", micro_batch_size=1), 0),
    ("--zero-stage 2 --tp 2 --sequence-parallel --micro-batch-size 2",
     dict(tp=2, dp=2, zero_stage=2, sequence_parallel=True, micro_batch_size=2), 0),
    ("--zero-stage 2 --tp 2 --sequence-parallel --num-experts 4 --ep 2 --micro-batch-size 2",
     dict(tp=2, dp=2, ep=2, zero_stage=2, sequence_parallel=True, micro_batch_size=2), 4),
    ("--zero-stage 3 --micro-batch-size 1", dict(dp=4, zero_stage=3, micro_batch_size=1), 0),
    ("--zero-stage 3 --tp 2 --sequence-parallel --micro-batch-size 2",
     dict(tp=2, dp=2, zero_stage=3, sequence_parallel=True, micro_batch_size=2), 0),
    ("--cp 2 --recompute", dict(cp=2, dp=2, recompute=True, micro_batch_size=4), 0),
    ("--cp 2 --tp 2 --cp-comm-type a2a", dict(cp=2, tp=2, cp_comm_type="a2a", micro_batch_size=8), 0),
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
    model = Model(4, 16, 4, 16, num_experts=experts, moe_router_topk=2)
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
    lines.append(json.dumps({"layout": flags, "rank": comm.rank, "measured": measured, "predicted": predicted,
                             "state": sum(state.values())}))
report = gather_text(comm, "\n".join(failures) if failures else "")
everything = gather_text(comm, "\n".join(lines))
ok = comm.all_reduce(numpy.array([len(failures)]))[0] == 0
if comm.rank == 0:
    print("\n".join(everything))
    print("\n".join(r for r in report if r))
    print(f"plan counts {'OK' if ok else 'MISMATCH'} on {comm.size} ranks")
raise SystemExit(0 if ok else 1)
