"""The planner's command line (``python -m minipar.plan``): the ranked plans as JSON, the reasons
the rest fail, and one line for each bad flag before anything is planned."""

import json
import subprocess
import sys

import pytest

from minipar.plan import bubble, cost
from minipar.plan.enumerate import as_json
from minipar.plan.shapes import Layout, Machine, Model

JSON_KEYS = {"tp", "pp", "dp", "cp", "ep", "vpp", "zero_stage", "micro_batch_size", "recompute", "memory_gb",
             "step_time_s", "mfu", "bytes_per_group", "bubble"}


def run_plan(*args):
    return subprocess.run([sys.executable, "-m", "minipar.plan", *args], capture_output=True, text=True, timeout=120)


def test_the_command_line_prints_the_ranked_plans_as_json():
    run = run_plan("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                   "--global-batch-size", "16", "--gpus", "8", "--json", "--top", "4")
    assert run.returncode == 0, run.stderr
    plans = json.loads(run.stdout)
    assert len(plans) == 4 and all(JSON_KEYS <= set(p) for p in plans)
    assert [p["step_time_s"] for p in plans] == sorted(p["step_time_s"] for p in plans)
    for p in plans:  # the bubble is the simulator's
        m = 16 // p["dp"] // p["micro_batch_size"]
        assert p["bubble"] == float(bubble.pipeline(p["schedule"], p["pp"], m, p["vpp"], p["recompute"])[0])
    first = plans[0]
    assert first["tp"] * first["pp"] * first["dp"] * first["cp"] == 8
    layout = Layout(**{k: first[k] for k in ("tp", "pp", "dp", "cp", "ep", "vpp", "zero_stage", "micro_batch_size",
                                             "recompute", "sequence_parallel", "cp_comm_type", "schedule")})
    again = as_json(layout, cost.predict(Model(4, 64, 4, 32), layout, Machine(gpus=8), 16))
    assert json.loads(json.dumps(again)) == first


def test_the_command_line_explains_failures_and_the_rules_of_thumb():
    run = run_plan("--preset", "gpt2", "--gpus", "16", "--top", "2")
    assert run.returncode == 0, run.stderr
    for words in ("layouts tried", "why the rest fail", "not divisible by --tensor-model-parallel-size",
                  "rules of thumb", "TP inside a node", "ZeRO before PP"):
        assert words in run.stdout, words
    bad = run_plan("--hidden-size", "64", "--gpus", "8")
    assert bad.returncode == 2 and "--num-layers" in bad.stderr


SMALL_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--global-batch-size", "16", "--gpus", "8"]


@pytest.mark.parametrize("args,message", [  # each once a traceback, a table of nan or negative times, or ignored
    (["--intra-node-gbps", "0"], "--intra-node-gbps must be a finite number > 0, got 0.0"),
    (["--peak-tflops", "nan"], "--peak-tflops must be a finite number > 0, got nan"),
    (["--efficiency", "inf"], "--efficiency is the share of the peak the kernels reach: in (0, 1], got inf"),
    (["--efficiency", "1e-320"], "--peak-tflops 312.0 x --efficiency 1e-320 is less than 1 FLOP/s"),  # steps of inf s
    (["--inter-node-gbps", "1e-300"], "--inter-node-gbps 1e-300 is less than 1 byte/s"),
    (["--layer-overhead-us", "1e308"], "--layer-overhead-us 1e+308 is more than 1e+09 us (1,000 s)"),  # steps of inf s
    (["--gpus-per-node", "0"], "--gpus-per-node must be >= 1, got 0"),
    (["--top", "0"], "--top must be >= 1, got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["--moe-router-topk", "5"], "--moe-router-topk 5 routes to experts, and this model has none"),
    (["--num-experts", "8", "--moe-router-topk", "9"], "--moe-router-topk 9 exceeds --num-experts 8"),
    (["--node-speeds", "1,inf"], "--node-speeds 1,inf: each speed must be a finite number > 0"),
    (["--node-speeds", "1,1"], "--node-speeds gives 2 speeds, and --gpus 8 at --gpus-per-node 8 make 1 node"),
    (["--node-speeds", "1", "--json"], "--node-speeds adds a table to the printed plans, and --json prints them"),
    (["--gpus", "1000000000000"], "--gpus must be 1 to 1,000,000"),  # hung
    (["--num-layers", "100000"], "the planner takes at most 1,024 blocks"),  # hung
    (["--num-experts", str(10**20)], "--num-experts 100000000000000000000 in each of 4 layers: the planner counts "
                                      "at most 16,384 experts in all"),  # an OverflowError; 10^6 ran for minutes
    (["--gpus", "16", "--node-speeds", "1e-320,1"], "--node-speeds 1e-320,1: the fastest node is more than 1e+06 "
                                                   "times the slowest"),  # an OverflowError after the whole plan
    (["--nope", "1"], "unrecognized arguments: --nope 1"),  # after the whole usage text
    (["--dropout", "1"], "--dropout must be a number in [0, 1), got 1.0"),
    (["--dropout", "nan"], "--dropout must be a number in [0, 1), got nan"),
])
def test_bad_planner_flags_are_one_line_before_anything_is_planned(args, message):
    run = run_plan(*SMALL_FLAGS, *args)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and message in lines[0] and run.stdout == "", run.stderr


def test_the_ring_pass_overhead_flag_reaches_the_cost_model():
    """It was parsed and never passed on: plans with context parallelism cost the same with it."""
    times = [{(p["tp"], p["cp"], p["pp"], p["dp"], p["zero_stage"], p["micro_batch_size"], p["recompute"],
               p["sequence_parallel"], p["cp_comm_type"], p["schedule"], p["vpp"]): p["step_time_s"]
              for p in json.loads(run_plan(*SMALL_FLAGS, "--json", "--top", "100000", "--ring-pass-overhead-us", us).stdout)}
             for us in ("0", "1000")]
    assert times[0].keys() == times[1].keys()
    ring = [k for k in times[0] if k[1] > 1 and k[8] == "p2p"]
    assert ring and all(times[1][k] > times[0][k] for k in ring)
    assert all(times[1][k] == times[0][k] for k in times[0] if k[1] == 1)


def test_dropout_reaches_the_activations():
    """Its masks and outputs are kept for backward: the same layouts need more memory with it, as
    ``activations.formula`` counts them (full recomputation keeps the blocks' inputs alone), and
    take the same time."""
    wider = SMALL_FLAGS + ["--hidden-size", "512", "--seq-length", "512"]  # memory_gb has 3 decimals
    plans = [{(p["tp"], p["cp"], p["pp"], p["dp"], p["zero_stage"], p["micro_batch_size"], p["recompute"],
               p["selective_recompute"], p["sequence_parallel"], p["cp_comm_type"], p["schedule"], p["vpp"]): p
              for p in json.loads(run_plan(*wider, "--json", "--top", "100000", *extra).stdout)}
             for extra in ((), ("--dropout", "0.1"))]
    assert plans[0].keys() == plans[1].keys()
    assert all(plans[1][k]["memory_gb"] > plans[0][k]["memory_gb"] for k in plans[0] if not k[6])
    assert all(plans[1][k]["memory_gb"] >= plans[0][k]["memory_gb"] for k in plans[0])
    assert all(plans[1][k]["step_time_s"] == plans[0][k]["step_time_s"] for k in plans[0])


def test_plans_the_trainer_refuses_for_message_tags_are_marked():
    """The planner keeps layouts whose pipeline needs more MPI tags than the standard promises (a
    bound of minipar's messages, not of the layout): the README's best 1T plan was one, listed as
    the best with nothing to say the trainer refuses it."""
    from minipar.plan.__main__ import tags_refused
    from minipar.plan.shapes import Layout, Model

    model = Model(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32)
    assert tags_refused(model, Layout(pp=2, micro_batch_size=1), 32768)  # 32,768 micro-batches
    assert not tags_refused(model, Layout(pp=2, micro_batch_size=16), 32768)
    assert not tags_refused(model, Layout(dp=2, micro_batch_size=1), 32768)  # no pipeline, no tags
    run = subprocess.run([sys.executable, "-m", "minipar.plan", "--num-layers", "4", "--hidden-size", "64",
                          "--num-attention-heads", "4", "--seq-length", "32", "--global-batch-size", "32768",
                          "--gpus", "2", "--top", "100000"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    (note,) = [line for line in run.stdout.splitlines() if "minipar's trainer refuses plan" in line]
    rows = run.stdout.split("the best ")[1].split("\n  minipar's")[0].splitlines()[2:]
    listed = [int(n) for n in note.split("refuses plan")[1].lstrip("s ").split(" as listed")[0].split(", ")]
    assert listed
    for n, row in enumerate(rows, 1):  # a tag per (micro-batch, chunk, activation or gradient): 2 m chunks
        pp, v, dp, mbs = (int(row.split()[i]) for i in (2, 3, 4, 7))
        assert (n in listed) == (pp > 1 and 2 * (32768 // dp // mbs) * pp * v > 32767), row
