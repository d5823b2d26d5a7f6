"""The planner's mixed-precision state against a real bf16 ZeRO-1 step: ``plan.state.state_bytes``
with precision "bf16" (minipar's --bf16: bf16 weights and gradients, fp32 masters and moments)
and "bf16-fp32-grads" (with --accumulate-allreduce-grads-in-fp32: fp32 gradients) equal the
optimizer's ``state_bytes()`` after one step, on every rank.

    run_mpi.sh -n 2 tests/mpi/plan_bf16_state.py
"""

import numpy

from minipar.comm import world
from minipar.plan.shapes import Layout, Model
from minipar.plan.state import state_bytes
from minipar.train import build, build_parser
from minipar.train_checks import check_args
from minipar.train_report import gather_text
from minipar.trainer import Trainer

MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
         "--plot", "", "--sample", "0", "--zero-stage", "1", "--bf16"]

comm = world()
parser = build_parser()
failures, lines = [], []
for extra, precision in (([], "bf16"), (["--accumulate-allreduce-grads-in-fp32"], "bf16-fp32-grads")):
    args = parser.parse_args(MODEL + extra)
    check_args(args, comm.size)
    data, config = build(parser, args)
    trainer = Trainer(args, config, data, comm)
    trainer.step(0)
    held = trainer.opt.state_bytes()
    planned = state_bytes(Model(2, 16, 4, 16), Layout(dp=comm.size, zero_stage=1, micro_batch_size=8 // comm.size),
                          dtype=precision)
    line = f"rank {comm.rank} {precision}: held {held} planned {planned}"
    lines.append(line)
    if held != planned:
        failures.append(line)
everything = gather_text(comm, "\n".join(lines))
ok = comm.all_reduce(numpy.array([len(failures)]))[0] == 0
if comm.rank == 0:
    print("\n".join(everything))
    print(f"plan bf16 state {'OK' if ok else 'MISMATCH'} on {comm.size} ranks")
raise SystemExit(0 if ok else 1)
