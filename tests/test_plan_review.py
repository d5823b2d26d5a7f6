"""The planner's defects found in review, each pinned: what a user typed or a layout the trainer
runs, and what the planner said before (in each test's docstring).

Run under MPI (``run_mpi.sh -n 2 tests/test_plan_review.py ring-selective``, ``run_mpi.sh -n 4
tests/test_plan_review.py counts``) this file measures what two of its tests compare the plan with."""

import json
import sys

import pytest

from minipar.plan import activations, bubble, cost
from minipar.plan.shapes import Layout, Machine, Model
from mpi_run import check_mpi, run_together
from test_plan_cli import SMALL_FLAGS, run_plan

# ---- ring attention with selective recomputation --------------------------------------------------------------------

RING = dict(n_layer=4, n_head=8, n_embd=64, block_size=64, batch=16, micro_batches=4)  # CP2 on 2 ranks, dropout 0.1


def ring_model():
    return Model(RING["n_layer"], RING["n_embd"], RING["n_head"], RING["block_size"], dropout=0.1)


def ring_layout(selective):
    return Layout(cp=2, cp_comm_type="p2p", selective_recompute=selective,
                  micro_batch_size=RING["batch"] // RING["micro_batches"])


def test_selective_recomputation_changes_nothing_under_ring_attention():
    """Ring attention keeps no T x T part (only the log-sum-exp, which its backward rebuilds the
    probabilities from), so ``--recompute-granularity selective`` runs the same code
    (``context.ring_attention``: "changes nothing"). The plan dropped the log-sum-exp and added the
    mask coordinates instead (0.4% under the measured peak, beyond the 0.2% a dense row is held to),
    and charged a recomputed q k^T that never runs: a layout planned smaller and slower than the same
    run without the flag."""
    model, machine = ring_model(), Machine(gpus=2)
    for ring in (True, False):
        comm = "p2p" if ring else "a2a"
        plain, selective = (Layout(cp=2, cp_comm_type=comm, selective_recompute=s, micro_batch_size=4) for s in (0, 1))
        same = activations.layer_bytes(model, plain, 4) == activations.layer_bytes(model, selective, 4)
        assert same == ring, comm  # Ulysses keeps the T x T part of its heads: selective drops it
        times = [cost.predict(model, lay, machine, 16).step_time_s for lay in (plain, selective)]
        assert (times[0] == times[1]) == ring, comm
    peaks = bubble.in_flight("1f1b", 1, RING["micro_batches"], 1, 0)
    planned = [activations.rank_bytes(model, ring_layout(s), 0, peaks, 4, transient=False) for s in (False, True)]
    assert planned[0] == planned[1]


def test_ring_attention_with_selective_recomputation_is_planned_as_measured_on_2_ranks():
    """The graphs a CP2 ring step keeps, with and without selective recomputation, measured (this
    file run on 2 ranks): the same bytes, and the plan within 0.2% of them."""
    out = check_mpi(2, __file__, "ring-selective", timeout=120)
    measured = json.loads(out.strip().splitlines()[-1])
    assert measured["plain"] == measured["selective"]
    assert abs(measured["planned"] / measured["selective"] - 1) < 0.002, measured


def measure_ring_selective():
    """One step of a CP2 GPT (ring attention) with and without selective recomputation: the most
    bytes its graphs held (``bench/memory_breakdown.py``'s walk); rank 0 prints them with the plan."""
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import minipar
    from memory_breakdown import HYPER, MeasuringExecutor
    from minipar.comm import world
    from minipar.data import Dataset, load_corpus
    from minipar.models import GPT, GPTConfig
    from minipar.parallel import ProcessGrid
    from minipar.parallel.optimizers import make_optimizer

    comm = world()
    minipar.set_default_dtype("float32")
    batch = Dataset(load_corpus()).batch("train", 0, RING["batch"], RING["block_size"], 0)
    peaks = {}
    for name, granularity in (("plain", None), ("selective", "selective")):
        minipar.manual_seed(0)
        grid = ProcessGrid(1, 1, 1, comm, cp=2)
        config = GPTConfig(n_layer=RING["n_layer"], n_head=RING["n_head"], n_embd=RING["n_embd"],
                           block_size=RING["block_size"], dropout=0.1)
        gpt = GPT(config, grid, recompute_granularity=granularity, cp_comm_type="p2p")
        opt = make_optimizer(gpt, grid, 0, bucket_bytes=64 << 10, **HYPER)
        run = MeasuringExecutor(gpt, grid, "1f1b", RING["micro_batches"], optimizer=opt)
        gpt.rng.iteration = 0
        run.step(*batch, optimizer_step=opt.finish_gradients)
        peaks[name] = int(run.peak)
    peaks["planned"] = activations.rank_bytes(ring_model(), ring_layout(True), 0,
                                              bubble.in_flight("1f1b", 1, RING["micro_batches"], 1, 0), 4,
                                              transient=False)
    if comm.rank == 0:
        print(json.dumps(peaks))


# ---- ZeRO-3 over a pipeline, and experts without expert parallelism: counted as a real step sends ------------------

COUNTED = [  # (the trainer's flags, the same as a plan Layout, experts); 4 ranks
    ("--zero-stage 3 --pp 2 --micro-batch-size 1", dict(pp=2, dp=2, zero_stage=3, micro_batch_size=1), 0),
    ("--zero-stage 3 --pp 2 --schedule zb-h1 --micro-batch-size 1",
     dict(pp=2, dp=2, zero_stage=3, schedule="zb-h1", micro_batch_size=1), 0),
    ("--zero-stage 3 --pp 2 --schedule zb-v --vpp 2 --micro-batch-size 1",
     dict(pp=2, dp=2, vpp=2, zero_stage=3, schedule="zb-v", micro_batch_size=1), 0),
    ("--zero-stage 3 --pp 2 --defer-embedding-wgrad-compute --micro-batch-size 1",
     dict(pp=2, dp=2, zero_stage=3, defer_embedding_wgrad=True, micro_batch_size=1), 0),
    ("--num-experts 4 --zero-stage 1 --micro-batch-size 2", dict(dp=4, zero_stage=1, micro_batch_size=2), 4),
    ("--num-experts 4 --tp 2 --sequence-parallel --zero-stage 2 --micro-batch-size 2",
     dict(tp=2, dp=2, zero_stage=2, sequence_parallel=True, micro_batch_size=2), 4),
]


def test_zero3_over_a_pipeline_and_experts_without_ep_are_counted_as_sent_on_4_ranks():
    """Every group's bytes and calls of one trainer step equal ``traffic``'s (this file run on 4
    ranks, as tests/mpi/plan_counts.py runs its layouts). Since ZeRO-3 runs with a pipeline (and the
    planner offers it), it was planned as on one stage: the tied embedding sent every micro-batch
    (it is held for the "embedding" sum), the L + 3 groups of a stage with both ends, every group
    gathered 2m times (a split backward's B then left it whole for the next forward, and the
    deferred head's W the tied embedding): PP2 x DP2 10-22% off in bytes, 40% in calls. With
    experts and EP 1 the experts' gradients were counted over an "edp" group of their own, in their
    own buckets: the trainer sums them over DP x CP with the rest (DP4 ZeRO-1: 11 + 8 calls planned
    for 3)."""
    out = check_mpi(4, __file__, "counts", timeout=240)
    assert "plan review counts OK" in out, out


def test_zero3_gathers_and_sends_under_a_split_backward_as_under_1f1b():
    """B releases the units it gathered, as a whole backward does (FSDP's post-backward), and W
    reads no weight (dW = g^T x): under ZB-H1 and ZB-H2 every group is gathered and sent as often
    as under 1F1B, on every rank, whatever m. (A B left its chunk whole until W, so rank r gathered
    min(r, m - 1) (ZB-H2: min(2r, m - 1)) times less than 2m, in closed form, and held up to its
    chunk's weights and buffers more: ZB-H1's last stage of PP 2 x DP 2 peaked 26% over 1F1B's.)"""
    from minipar.plan import traffic

    model = Model(4, 16, 4, 16)
    for schedule in ("zb-h1", "zb-h2"):
        for p in (2, 4):
            for m in (1, 2, 3, p, 2 * p - 1, 2 * p + 3):
                split, whole = (Layout(pp=p, dp=2, zero_stage=3, schedule=name, micro_batch_size=1)
                                for name in (schedule, "1f1b"))
                for rank in range(p):
                    for count in (traffic.group_bytes, traffic.group_calls):
                        assert count(model, split, 2 * m, rank) == count(model, whole, 2 * m, rank), \
                            (schedule, p, m, rank)


def test_the_trainers_memory_check_counts_what_zero3_holds_during_a_step(monkeypatch):
    """ZeRO-3 over DP 4 of a 4-block GPT of width 1024 keeps shards of 0.2 GB a rank, but during a
    block's backward it also holds that block and the one before whole, the block's gradient buffer
    and the block after's still being sent: 0.42 GB (``plan.zero3_peak.peak_bytes``; tests/mpi/plan_counts.py
    measures it). The memory check planned the shards alone and let the run start in 0.3 GB."""
    from minipar import backend
    from minipar.cli import FlagError
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    flags = ["--n-layer", "4", "--n-embd", "1024", "--n-head", "8", "--block-size", "64", "--batch-size", "8",
             "--micro-batch-size", "2", "--zero-stage", "3"]
    monkeypatch.setattr(backend, "free_memory", lambda host=False: (0.3e9, 1, "test memory"))
    with pytest.raises(FlagError) as refusal:
        check_args(build_parser().parse_args(flags), 4)
    (line,) = refusal.value.lines
    assert line.startswith("this run needs about 0.5 GB on each rank: 0.4 GB for a model of 50,714,624 parameters")
    monkeypatch.setattr(backend, "free_memory", lambda host=False: (0.5e9, 1, "test memory"))
    check_args(build_parser().parse_args(flags), 4)


def measure_counts():
    """Rank 0 prints every mismatch of COUNTED's layouts on any rank, then OK or MISMATCH."""
    import numpy

    from minipar.comm import world
    from minipar.plan.state import state_bytes
    from minipar.plan.traffic import group_bytes, group_calls
    from minipar.train import build, build_parser
    from minipar.train_checks import check_args
    from minipar.train_report import gather_text
    from minipar.trainer import Trainer

    comm, parser, bad = world(), build_parser(), []
    base = ["--n-layer", "4", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
            "--plot", "", "--sample", "0", "--dropout", "0.1"]
    for flags, fields, experts in COUNTED:
        args = parser.parse_args(base + flags.split())
        check_args(args, comm.size)
        data, config = build(parser, args)
        trainer = Trainer(args, config, data, comm)
        grid, named, seen = trainer.grid, {}, set()
        for name in ("tp", "cp", "dp", "pp", "dp_cp", "embedding", "ep", "edp"):  # each communicator once
            group = getattr(grid, f"{name}_group")
            if group is not None and group.size > 1 and id(group) not in seen:
                named[name] = group
                seen.add(id(group))
                group.stats.reset()
        trainer.step(0)
        sent = {k: g.stats.total().bytes_sent for k, g in named.items() if g.stats.total().bytes_sent}
        calls = {k: named[k].stats.total().calls for k in sent}
        model, layout = Model(4, 16, 4, 16, num_experts=experts), Layout(**fields)
        planned = (group_bytes(model, layout, 8, grid.pp_rank), group_calls(model, layout, 8, grid.pp_rank),
                   state_bytes(model, layout, grid.pp_rank))
        if (sent, calls, trainer.opt.state_bytes()) != planned:
            bad.append(f"rank {comm.rank} {flags}: measured {sent} {calls} {trainer.opt.state_bytes()}, planned {planned}")
    report = gather_text(comm, "\n".join(bad))
    ok = comm.all_reduce(numpy.array([len(bad)]))[0] == 0
    if comm.rank == 0:
        print("\n".join(r for r in report if r))
        print(f"plan review counts {'OK' if ok else 'MISMATCH'}")


# ---- the command line: what the trainer refuses, refused as it words it ---------------------------------------------

MODEL_ONLY = ["--global-batch-size", "16", "--gpus", "8"]


@pytest.mark.parametrize("args,message", [
    (["--num-layers", "4", "--hidden-size", "63", "--num-attention-heads", "4", "--seq-length", "32"],
     "--hidden-size 63 is not divisible by --num-attention-heads 4: every head needs n_embd / n_head dimensions"),
    (["--preset", "gpt2", "--num-attention-heads", "5"],
     "--hidden-size 768 is not divisible by --num-attention-heads 5"),
    (["--preset", "gpt2", "--num-experts", "8", "--moe-router-topk", "9"],  # validate's words, as the trainer's
     "--moe-router-topk 9 exceeds --num-experts 8: a token can choose at most every expert"),
])
def test_a_model_no_layout_can_run_is_one_line_before_anything_is_planned(args, message):
    """A model's own problem (the trainer's --n-embd 63 --n-head 4: one line, exit 2) made every
    layout fail for the same reason: 7,428 layouts tried, 0 fit, exit 1, after the whole enumeration."""
    run = run_plan(*args, *MODEL_ONLY)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and message in lines[0] and run.stdout == "", run.stderr


def test_why_a_layout_fails_names_the_flags_that_change_it():
    """The reasons named fields in Python's words ("use ZeRO stage=2", "cp_comm_type='a2a'", "give
    pipeline_layers", "schedule='pipedream-2bw'") and a flag no program takes (--virtual-stages):
    the trainer's flags (Megatron's where it has them, which the trainer takes too)."""
    from minipar.parallel import validate
    from minipar.plan.enumerate import FLAGS, plan
    from minipar.plan.shapes import run_config

    model = Model(4, 64, 4, 32)
    result = plan(model, Machine(gpus=8), 16)
    reasons = " | ".join(result.examples.values())
    for words in ("--cp-comm-type a2a (Ulysses)", "--virtual-pipeline-model-parallel-size = 2 x 4",
                  "every pipeline chunk needs a layer"):
        assert words in reasons, words
    uneven = validate.problems(run_config(Model(6, 64, 4, 32), Layout(pp=4, dp=2), 16), FLAGS)
    assert any(p.endswith("or give --pipeline-layers") for p in uneven), uneven
    stash = validate.problems(run_config(model, Layout(pp=2, dp=4, schedule="pipedream-2bw", zero_stage=1), 16), FLAGS)
    assert stash == ["--schedule pipedream-2bw stashes a second copy of the weights it updates whole: it needs "
                     "--zero-stage 0"]
    for python in ("--virtual-stages", "ZeRO stage=", "give pipeline_layers", "cp_comm_type", "schedule="):
        assert python not in reasons + stash[0], python


def test_a_json_run_that_fits_nothing_says_why_on_stderr():
    """--json printed [] and exited 1, with not a word of why (the table's run lists the reasons)."""
    run = run_plan(*SMALL_FLAGS, "--json", "--gpu-memory-gb", "1e-6")
    assert run.returncode == 1 and json.loads(run.stdout) == []
    assert "no layout fits" in run.stderr and "does not fit: " in run.stderr, run.stderr


def test_does_not_fit_says_a_need_larger_than_what_is_there():
    """Rounded to 0.1 GB, a small model's need read "0.0 GB per GPU needed, 1e-06 GB available"."""
    import re

    run = run_plan(*SMALL_FLAGS, "--gpu-memory-gb", "1e-6")
    need, have = re.search(r"does not fit: (\S+) GB per GPU needed, (\S+) GB available", run.stdout).groups()
    assert float(need) > float(have) == 1e-6, (need, have)
    from minipar.plan.enumerate import rounded_up

    assert [f"{rounded_up(x):.3g}" for x in (80.04, 80.0, 1.2345e-7, 999.5, 0.0)] == ["80.1", "80", "1.24e-07", "1e+03", "0"]


def test_the_dp_rule_of_thumb_does_not_call_context_parallelism_dp():
    """With DP = 1 and CP > 1 the gradients are summed over the CP group ("dp_cp"), and the rule
    read its link as DP's: "DP outermost: DP=1, its group inter-node: agrees"."""
    from minipar.plan.__main__ import rules_of_thumb
    from minipar.plan.enumerate import Result

    model, machine = Model(4, 64, 4, 32), Machine(gpus=16, gpus_per_node=8)
    layout = Layout(cp=16)
    lines = rules_of_thumb(Result([(layout, cost.predict(model, layout, machine, 8))]), machine)
    assert "DP outermost (DP scales out across nodes): no data parallelism here (DP=1)" in lines
    layout = Layout(cp=2, dp=8)  # DP x CP over both nodes: DP's own group is what crosses them
    lines = rules_of_thumb(Result([(layout, cost.predict(model, layout, machine, 8))]), machine)
    assert any(line.startswith("DP outermost") and "DP=8" in line and "agrees" in line for line in lines), lines


def test_the_balanced_plans_command_trains_in_the_plans_precision(monkeypatch):
    """The plan's memory is bf16's (2 + 2 + 12 bytes a parameter, 2-byte activations), and the
    printed command trained in float32, which holds more than the plan said would fit."""
    from minipar import backend
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    monkeypatch.setattr(backend, "free_memory", lambda host=False: None)
    cases = {"bf16": (["--precision", "bf16"], {"bf16": True, "accumulate_allreduce_grads_in_fp32": False}),
             "fp32-grads": (["--precision", "bf16", "--accumulate-allreduce-grads-in-fp32"],
                            {"bf16": True, "accumulate_allreduce_grads_in_fp32": True}),
             "float64": (["--precision", "float64"], {"bf16": False, "dtype": "float64"})}
    small = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--global-batch-size", "16", "--gpus", "16", "--node-speeds", "1,0.5"]
    runs = run_together({k: [sys.executable, "-m", "minipar.plan", *small, *flags] for k, (flags, _) in cases.items()})
    for key, (precision, flags) in cases.items():
        run = runs[key]
        assert run.returncode == 0, run.stderr
        (line,) = [l for l in run.stdout.splitlines() if "to run it on" in l]
        ranks, command = line.split("to run it on ")[1].split(" ranks: ./run_mpi.sh -n ")
        n, command = command.split(" -m minipar.train ")
        assert n == ranks
        args = build_parser().parse_args(command.split())
        assert {k: getattr(args, k) for k in flags} == flags, (precision, command)
        check_args(args, int(ranks))


def test_a_global_batch_the_planner_would_walk_for_hours_is_one_line():
    """--global-batch-size 100000000 on 8 GPUs: 12 GB and still running after a minute (a
    pipeline's order is walked micro-batch by micro-batch; 10^6 took 70 s), as --num-layers 100000
    and --gpus 10^12 did before their limits."""
    run = run_plan(*SMALL_FLAGS, "--global-batch-size", "100000000")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().endswith("--global-batch-size 100000000: the planner takes at most 65,536 sequences a step")
    from minipar.plan.__main__ import MAX_BATCH, parser, problems

    for batch, found in ((MAX_BATCH, 0), (MAX_BATCH + 1, 1)):  # (the limit itself: 4.3-4.9 s of planning on these flags, 2026-12-06)
        assert len(problems(parser().parse_args([*SMALL_FLAGS, "--global-batch-size", str(batch)]))) == found


def test_the_balanced_plan_is_one_the_trainer_can_run_or_the_reason_it_is_not():
    """--node-speeds balanced the fastest pipelined plan through the schedules' own builder, which
    holds the run to MPI's tag limit: a traceback ("m=8192 x 2 pipeline chunks need 32768 message
    tags") where the plans (which leave that limit out) had 8,192 micro-batches on 2 stages. The
    balanced plan is the fastest the trainer can run; with none, one line says why."""
    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--gpus", "2", "--gpus-per-node", "1", "--node-speeds", "1,0.5", "--top", "1"]
    runs = run_together({batch: [sys.executable, "-m", "minipar.plan", *flags, "--global-batch-size", batch]
                         for batch in ("65536", "4096")})  # 4096: 512 micro-batches of 8, within the limit
    run = runs["65536"]
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "no plan with a pipeline of one chunk per stage that the trainer can run" in run.stdout
    assert "message tags" in run.stdout.split("heterogeneous GPUs:")[1]
    assert runs["4096"].returncode == 0 and "to run it on 2 ranks" in runs["4096"].stdout, runs["4096"].stderr


if __name__ == "__main__":  # under MPI: what a test compares the plan with
    {"ring-selective": measure_ring_selective, "counts": measure_counts}[sys.argv[1]]()
