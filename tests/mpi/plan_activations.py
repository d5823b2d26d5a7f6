"""The planner's activation memory against the measured peak, on 4 ranks: for each layout, every
rank's most bytes held by the autograd graphs between forward and backward over a 1F1B step
(``bench/memory_breakdown.py``'s measurement) is within 10% of ``plan.activations.rank_bytes``
(without the transient layer a recomputing backward adds, which that walk cannot see).

    run_mpi.sh -n 4 tests/mpi/plan_activations.py
"""

import argparse
import os
import sys

import numpy

import minipar
from minipar.comm import world
from minipar.data import Dataset, load_corpus
from minipar.plan import activations, bubble, state
from minipar.plan.shapes import Layout, Model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from memory_breakdown import measure  # noqa: E402

LAYOUTS = [  # (name, tp, cp, pp, zero stage, sequence parallel), as memory_breakdown.layouts
    ("DP4", 1, 1, 1, 0, False), ("TP2 DP2", 2, 1, 1, 0, False), ("TP4 SP", 4, 1, 1, 0, True),
    ("PP4", 1, 1, 4, 0, False), ("CP2 DP2", 1, 2, 1, 0, False), ("TP2 PP2 SP Z1", 2, 1, 2, 1, True),
    ("DP4 ZeRO-3", 1, 1, 1, 3, False),
]
comm = world()
minipar.set_default_dtype("float32")
args = argparse.Namespace(n_layer=4, n_head=8, n_embd=64, block_size=64, batch_size=32, micro_batches=4, bucket_kb=64)
batch = Dataset(load_corpus()).batch("train", 0, args.batch_size, args.block_size, 0)
model = Model(4, 64, 8, 64, dropout=0.1)
worst, rows = 0.0, []
for name, tp, cp, pp, zero, sp in LAYOUTS:
    dp = comm.size // (tp * cp * pp)
    numbers, _ = measure((name, tp, cp, pp, zero, sp), args, comm, batch)
    layout = Layout(tp=tp, cp=cp, pp=pp, dp=dp, zero_stage=zero, sequence_parallel=sp,
                    micro_batch_size=args.batch_size // dp // args.micro_batches)
    stage = comm.rank // (tp * cp * dp)  # Megatron's order: PP slowest
    alive = bubble.pipeline("1f1b", pp, args.micro_batches)[1][stage]
    planned = activations.rank_bytes(model, layout, len(state.stage_layers(model, layout, stage)), alive,
                                     stage == 0, stage == pp - 1, 4, transient=False)
    ratio = planned / numbers["activations"]
    worst = max(worst, abs(ratio - 1))
    every = comm.gather_to_root(numpy.array([numbers["activations"], planned]), tag=7401)
    if every is not None:
        rows.append(f"{name:<15}" + "  ".join(f"{m / 1e6:.3f}/{p / 1e6:.3f}" for m, p in every))
worst = float(comm.all_reduce(numpy.array([worst]), op="max")[0])
if comm.rank == 0:
    print("activation MB per rank, measured/planned\n" + "\n".join(rows))
    print(f"worst relative error {worst:.3f}")
    print(f"plan activations {'within 10%' if worst <= 0.10 else 'OFF BY MORE THAN 10%'} on {comm.size} ranks")
raise SystemExit(0 if worst <= 0.10 else 1)
