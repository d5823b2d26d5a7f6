"""The planner's activation memory against the measured peak, on 4 ranks: for each layout, every
rank's most bytes held by the autograd graphs between forward and backward over a step
(``bench/memory_breakdown.py``'s measurement, less the batch's token ids, which the caller holds
whole) is within its row's tolerance (``tolerance``) of ``plan.activations.rank_bytes`` (without
the transient layer a recomputing backward adds, which that walk cannot see): 0.2% for a dense
model, where the formula counts what the graphs keep, 10% for MoE, where it assumes a uniform
router. The MoE layouts (4 experts, top-2, dropless or with capacity factor 1, expert-parallel over
EP ranks), the recomputing ones, the other schedules and the uneven splits measure the same walk
on a GPT built here; the rows with the head's weight gradients deferred
(--defer-embedding-wgrad-compute) and the zero-bubble rows add what waits for a W, which no graph
holds, after every forward and backward (a backward frees a graph but parks what its W needs).

    run_mpi.sh -n 4 tests/mpi/plan_activations.py
"""

import argparse
import os
import sys

import numpy

import minipar
from minipar.comm import world
from minipar.data import Dataset, load_corpus
from minipar.plan import activations, bubble
from minipar.plan.shapes import Layout, Model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from memory_breakdown import HYPER, MeasuringExecutor, batch_arrays, graph_bytes, measure  # noqa: E402
from minipar.models import GPT, GPTConfig  # noqa: E402
from minipar.parallel import ProcessGrid  # noqa: E402
from minipar.parallel.optimizers import make_optimizer  # noqa: E402
from minipar.parallel.run_config import SPLIT_BACKWARD  # noqa: E402

LAYOUTS = [  # (name, tp, cp, pp, zero stage, sequence parallel), as memory_breakdown.layouts
    ("DP4", 1, 1, 1, 0, False), ("TP2 DP2", 2, 1, 1, 0, False), ("TP4 SP", 4, 1, 1, 0, True),
    ("PP4", 1, 1, 4, 0, False), ("CP2 DP2", 1, 2, 1, 0, False), ("TP2 PP2 SP Z1", 2, 1, 2, 1, True),
    ("DP4 ZeRO-3", 1, 1, 1, 3, False),
]
MORE_LAYOUTS = [  # (name, tp, pp, ep, sequence parallel, experts, capacity factor, recomputation: True selective, schedule)
    ("DP4 EP2 MoE", 1, 1, 2, False, 4, None, False, "1f1b"), ("DP4 EP4 MoE c1", 1, 1, 4, False, 4, 1.0, False, "1f1b"),
    ("TP2 DP2 EP2 MoE", 2, 1, 2, False, 4, None, False, "1f1b"), ("TP2 SP EP2 MoE", 2, 1, 2, True, 4, None, False, "1f1b"),
    ("PP2 DP2 EP2 MoE", 1, 2, 2, False, 4, None, False, "1f1b"), ("DP4 selective", 1, 1, 1, False, 0, None, True, "1f1b"),
    ("TP2 PP2 SP sel.", 2, 2, 1, True, 0, None, True, "1f1b"), ("DP4 EP2 MoE sel.", 1, 1, 2, False, 4, None, True, "1f1b"),
    ("PP2 DP2 ZB-V", 1, 2, 1, False, 0, None, False, "zb-v"), ("TP2 PP2 ZB-V sel", 2, 2, 1, True, 0, None, True, "zb-v"),
    ("PP2 DP2 interl.", 1, 2, 1, False, 0, None, False, "interleaved"),
    ("PP2 DP2 ZB-H1", 1, 2, 1, False, 0, None, False, "zb-h1"), ("PP4 ZB-H2", 1, 4, 1, False, 0, None, False, "zb-h2"),
    ("TP2 PP2 SP ZB-H1", 2, 2, 1, True, 0, None, False, "zb-h1"), ("PP2 EP2 MoE ZB-H2", 1, 2, 2, False, 4, None, False, "zb-h2"),
    ("TP2 PP2 SP MoE ZB-H1", 2, 2, 1, True, 4, None, False, "zb-h1"),
    ("DP4 full", 1, 1, 1, False, 0, None, "full", "1f1b"), ("TP2 PP2 SP full", 2, 2, 1, True, 0, None, "full", "1f1b"),
    ("PP2 DP2 ZB-H1 full", 1, 2, 1, False, 0, None, "full", "zb-h1"),
]
UNEVEN = [("PP2 DP2 3,1", (3, 1)), ("PP2 DP2 1,3", (1, 3))]  # --pipeline-layers, 1F1B
ULYSSES = [("CP2 DP2 a2a", 1, False), ("CP2 TP2 a2a", 2, False), ("CP2 DP2 a2a sel.", 1, True)]  # (name, tp, selective)
DEFERRED = [("PP2 DP2 defer", 1, False, 0), ("TP2 PP2 SP defer", 2, True, 0),  # (name, tp, sequence parallel,
            ("PP2 DP2 defer+5", 1, False, 5), ("TP2 PP2 SP defer+3", 2, True, 3)]  # linears deferred too), 1F1B
NO_DROPOUT = [("PP2 DP2 p=0", 1, False, None), ("TP2 PP2 SP p=0", 2, True, None),  # (name, tp, sequence parallel,
              ("PP2 DP2 p=0 full", 1, False, "full")]  # recomputation), 1F1B, dropout 0 (the trainer's default)

# The relative error a row may have: 0.2% where rank_bytes counts what the graphs keep (every dense
# layout, within 0.07%: a position embedding's s h, or the first stage's input counted twice, moves
# these rows by 0.3-6%); 10% for MoE, where moe_bytes assumes a uniform router and the real one
# sends unequal rows to each expert (up to 6% off).
TIGHT, ROUTER = 0.002, 0.10


def tolerance(name):
    return ROUTER if "MoE" in name else TIGHT


class ParkingExecutor(MeasuringExecutor):
    """The graphs and what waits for a W (a split backward's, or the head's for the flush), every
    buffer once, after every forward and backward."""

    def _forward(self, state, ins):
        super()._forward(state, ins)
        self._measure(state)

    def _backward(self, state, ins):
        super()._backward(state, ins)
        self._measure(state)

    def _backward_input(self, state, ins):
        super()._backward_input(state, ins)
        self._measure(state)

    def _measure(self, state):
        graphs = [out for _, out in state.kept.values()]
        parked = (*state.weight_grads.values(), *state.head_grads.values())
        self.peak = max(self.peak, graph_bytes(graphs, self.model.parameters(), batch_arrays(state), parked))


def measure_gpt(tp, pp, ep, sp, experts, capacity, selective, schedule, layers=None, defer=False, cp=1, linears=0,
                dropout=0.1, moe_layer_freq=1):
    """This rank's most bytes held by the graphs over a step of ``schedule`` of a GPT with
    ``experts`` experts (top-2), recomputing (``selective``: True selectively, "full" every block), ``layers`` per
    pipeline chunk (None: an even split); ``defer``: and the parked head W's (and ``linears``' W's);
    ``cp``: context parallelism by Ulysses; ``dropout`` 0: no masks, and the embeddings' sum is the first chunk's input."""
    minipar.manual_seed(0)
    grid = ProcessGrid(tp, pp, comm.size // (tp * pp * cp), comm, ep=ep, cp=cp)
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                       dropout=dropout, num_experts=experts, moe_layer_freq=moe_layer_freq, moe_router_topk=2, moe_expert_capacity_factor=capacity)
    v = 2 if schedule in ("interleaved", "zb-v") else 1
    gpt = GPT(config, grid, sequence_parallel=sp, recompute_granularity=("full" if selective == "full" else "selective") if selective else None,
              virtual_stages=v, pipeline_shape="v" if schedule == "zb-v" else "round-robin", layers_per_stage=layers,
              cp_comm_type="a2a")
    opt = make_optimizer(gpt, grid, 0, bucket_bytes=args.bucket_kb << 10, **HYPER)
    parks = defer or schedule in SPLIT_BACKWARD
    run = (ParkingExecutor if parks else MeasuringExecutor)(gpt, grid, schedule, args.micro_batches, optimizer=opt,
                                                            defer_embedding_wgrad=defer, defer_wgrad_linears=linears)
    gpt.rng.iteration = 0
    run.step(*batch, optimizer_step=opt.finish_gradients)
    return run.peak, grid


def planned(model, layout, stage):
    """rank_bytes of pipeline rank ``stage``, with the micro-batches its schedule holds in each chunk."""
    peaks = bubble.in_flight(layout.schedule, layout.pp, args.micro_batches, layout.vpp, stage,
                             layout.defer_embedding_wgrad)
    return activations.rank_bytes(model, layout, stage, peaks, 4, transient=False)


def rows_of(name, measured, predicted):
    """Gathers the row; returns this rank's relative error as a share of its tolerance (<= 1 passes)."""
    allowed = tolerance(name)
    every = comm.gather_to_root(numpy.array([measured, predicted, allowed]), tag=7401)
    if every is not None:
        rows.append(f"{name:<20}" + "  ".join(f"{m / 1e6:.3f}/{p / 1e6:.3f} ({t:.1%})" for m, p, t in every))
    return abs(predicted / measured - 1) / allowed


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
    worst = max(worst, rows_of(name, numbers["activations"], planned(model, layout, stage)))
for name, tp, pp, ep, sp, experts, capacity, selective, schedule in MORE_LAYOUTS:
    measured, grid = measure_gpt(tp, pp, ep, sp, experts, capacity, selective, schedule)
    dp = comm.size // (tp * pp)
    moe_model = Model(4, 64, 8, 64, num_experts=experts, moe_router_topk=2, moe_expert_capacity_factor=capacity, dropout=0.1)
    layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep, sequence_parallel=sp, selective_recompute=selective is True,
                    recompute=selective == "full", schedule=schedule,
                    vpp=2 if schedule in ("interleaved", "zb-v") else 1, micro_batch_size=args.batch_size // dp // args.micro_batches)
    worst = max(worst, rows_of(name, measured, planned(moe_model, layout, grid.pp_rank)))
for name, tp, selective in ULYSSES:
    measured, grid = measure_gpt(tp, 1, 1, False, 0, None, selective, "1f1b", cp=2)
    dp = comm.size // (tp * 2)
    layout = Layout(tp=tp, cp=2, dp=dp, cp_comm_type="a2a", selective_recompute=selective,
                    micro_batch_size=args.batch_size // dp // args.micro_batches)
    worst = max(worst, rows_of(name, measured, planned(model, layout, grid.pp_rank)))
for name, layers in UNEVEN:
    measured, grid = measure_gpt(1, 2, 1, False, 0, None, False, "1f1b", layers)
    layout = Layout(pp=2, dp=comm.size // 2, micro_batch_size=args.batch_size // (comm.size // 2) // args.micro_batches,
                    pipeline_layers=layers)
    worst = max(worst, rows_of(name, measured, planned(model, layout, grid.pp_rank)))
for name, tp, sp, linears in DEFERRED:
    measured, grid = measure_gpt(tp, 2, 1, sp, 0, None, False, "1f1b", defer=True, linears=linears)
    layout = Layout(tp=tp, pp=2, dp=grid.dp, sequence_parallel=sp, defer_embedding_wgrad=True, defer_wgrad_linears=linears,
                    micro_batch_size=args.batch_size // grid.dp // args.micro_batches)
    worst = max(worst, rows_of(name, measured, planned(model, layout, grid.pp_rank)))
# the last block dense (every second from the first has experts): its 4 linear layers deferred
measured, grid = measure_gpt(1, 2, 2, False, 4, None, False, "1f1b", defer=True, linears=4, moe_layer_freq=2)
layout = Layout(pp=2, dp=grid.dp, ep=2, defer_embedding_wgrad=True, defer_wgrad_linears=4,
                micro_batch_size=args.batch_size // grid.dp // args.micro_batches)
worst = max(worst, rows_of("PP2 EP2 MoE/2 defer+4", measured, planned(
    Model(4, 64, 8, 64, num_experts=4, moe_router_topk=2, moe_layer_freq=2, dropout=0.1), layout, grid.pp_rank)))
for name, tp, sp, recompute in NO_DROPOUT:
    measured, grid = measure_gpt(tp, 2, 1, sp, 0, None, recompute, "1f1b", dropout=0.0)
    layout = Layout(tp=tp, pp=2, dp=grid.dp, sequence_parallel=sp, recompute=recompute == "full",
                    micro_batch_size=args.batch_size // grid.dp // args.micro_batches)
    worst = max(worst, rows_of(name, measured, planned(Model(4, 64, 8, 64), layout, grid.pp_rank)))
worst = float(comm.all_reduce(numpy.array([worst]), op="max")[0])
if comm.rank == 0:
    print("activation MB per rank, measured/planned (tolerance)\n" + "\n".join(rows))
    print(f"worst relative error {worst:.2f} of its row's tolerance")
    print(f"plan activations {'within tolerance' if worst <= 1 else 'OUTSIDE THEIR TOLERANCE'} on {comm.size} ranks")
raise SystemExit(0 if worst <= 1 else 1)
