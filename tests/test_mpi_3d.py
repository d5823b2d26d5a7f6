"""The training CLI on a TP x PP x DP grid, as a user runs it: equal to one device, checkpoints that
reshard onto other layouts and resume exactly, damaged checkpoints and bad flags refused, divergence
stopped; and lesson 6."""

import json
import os
import re
import shutil

import pytest

from mpi_run import ROOT, check_mpi, run_mpi, run_train

from minipar.checkpoint.sharded import read_index
from minipar.models import GPT, GPTConfig

SMALL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "32", "--block-size", "16", "--global-batch-size", "8",
         "--sample", "0", "--plot", "", "--eval-interval", "1000", "--log-interval", "1000"]


def train(n, *args, timeout=180):
    return run_train(n, *SMALL, *args, timeout=timeout)


def losses(path):
    with open(path) as f:
        return {r["iter"]: r["loss"] for r in map(json.loads, f)}


def close(a, b, tol=1e-5):
    return set(a) <= set(b) and all(abs(a[i] - b[i]) <= tol * abs(b[i]) for i in a)


def rows(log):
    with open(log) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def single_log(tmp_path_factory):
    """The single-device run the layouts are compared with: 20 steps, evaluated after the last."""
    log = str(tmp_path_factory.mktemp("single") / "log.jsonl")
    code, out, _ = train(1, "--max-iters", "20", "--log-json", log)
    assert code == 0, out
    return log


@pytest.fixture(scope="module")
def single(single_log):
    return losses(single_log)


def report_rows(out):
    """--report's table: each rank's row as {column: bytes}."""
    lines = out.splitlines()
    names = next(line.split()[4:-1] for line in lines if line.startswith("rank  tp  dp  pp"))
    rows = [line.split() for line in lines if re.match(r"\s+\d+(\s+\d+){3}\s+[\d,]+\s", line)]
    return [dict(zip(names, (int(n.replace(",", "")) for n in row[4:4 + len(names)]))) for row in rows]


def test_3d_layout_trains_the_single_device_model(single, single_log, tmp_path):
    log = str(tmp_path / "log.jsonl")
    code, out, _ = train(8, "--max-iters", "20", "--tp", "2", "--pp", "2", "--zero-stage", "1",
                         "--log-json", log, "--report")
    assert code == 0, out
    assert "TP 2 x PP 2 x DP 2" in out and "bubble" in out and out.count(" tp ") >= 8  # a report line per rank
    report = report_rows(out)  # ZeRO-1 holds its received piece beside its state: the plan is exact
    assert len(report) == 8 and all(r["peak"] == r["planned"] > r["parameters"] + r["gradients"] + r["optimizer"]
                                    for r in report), report
    assert len(losses(log)) == 20 and close(losses(log), single)
    # and its validation loss, the shares of the ranks that report the loss added over the world
    val, val_single = rows(log)[-1]["val_loss"], rows(single_log)[-1]["val_loss"]
    assert close({0: val}, {0: val_single}), (val, val_single)


EVERY_OP_ONE_MS = """import sys
import numpy
from minipar.parallel.pipeline import stage_times
stage_times.summary = lambda timeline, p, v, m: numpy.full(stage_times.width(p, v, m), 1e-3)
from minipar.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_pipelines_description_and_stage_times_are_the_whole_models(tmp_path):
    """On PP 2 x DP 2: the parameter count is the whole model's (each tensor once, wherever it
    lives), micro-batches are counted per DP rank, and a stage's logged times are the mean over its
    ranks (every op 1 ms on every rank: 1.0 ms)."""
    script, log = tmp_path / "one_ms.py", str(tmp_path / "log.jsonl")
    script.write_text(EVERY_OP_ONE_MS)
    code, out, _ = run_mpi(4, str(script), *SMALL, "--max-iters", "1", "--pp", "2", "--micro-batch-size", "1",
                           "--log-json", log)
    assert code == 0, out
    whole = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=32, block_size=16, vocab_size=256)).parameters()
    assert f"model: {sum(p.size for p in whole):,} parameters" in out, out
    assert "4 micro-batch(es) of 1 per DP rank" in out, out  # a batch of 8 over DP 2, one sequence each
    assert rows(log)[0]["stage_ms"]["forward"] == [[1.0], [1.0]]


@pytest.mark.parametrize("schedule", [["zb-h2"], ["zb-v", "--num-virtual-stages", "2"]])
def test_zero_bubble_schedule_from_the_command_line(single, tmp_path, schedule):
    """A zero-bubble schedule on PP 2 x DP 2: the backward split into B and W (in ZB-V's V, the
    loss on pipeline rank 0) trains the single-device model."""
    log = str(tmp_path / "log.jsonl")
    code, out, _ = train(4, "--max-iters", "20", "--pp", "2", "--schedule", *schedule, "--log-json", log)
    assert code == 0 and f"schedule {schedule[0]}" in out, out
    assert len(losses(log)) == 20 and close(losses(log), single)
    # each row: the bubble against the makespan and the bubble of its compute alone, B and W apart
    v = 2 if schedule[0] == "zb-v" else 1
    for row in rows(log):
        assert 0 <= row["bubble_expected"] < 1 and 0 <= row["bubble"] < 1
        assert all(len(row["stage_ms"][kind]) == 2 and all(len(c) == v and min(c) > 0 for c in row["stage_ms"][kind])
                   for kind in ("forward", "backward", "weight")), row["stage_ms"]


def test_pipedream_2bw_from_the_command_line(single, tmp_path):
    """PipeDream-2BW on PP 2 x DP 2: step 0 is the single-device step (W(-1) = W(0)), later steps
    follow the delayed update and so leave the synchronous curve; the stash is reported."""
    log = str(tmp_path / "log.jsonl")
    code, out, _ = train(4, "--max-iters", "20", "--pp", "2", "--schedule", "pipedream-2bw", "--report",
                         "--log-json", log)
    assert code == 0 and "schedule pipedream-2bw" in out and "stash" in out, out
    got = losses(log)
    assert len(got) == 20 and close({0: got[0]}, single) and not close(got, single)
    assert not any("bubble_expected" in row for row in rows(log))  # its step spans two batches: no replay


@pytest.mark.parametrize("precision,resume_on,tol", [("--dtype float64", ["--tp", "2"], 1e-12), ("--bf16", [], 0)])
def test_a_pipedream_2bw_checkpoint_holds_both_weight_versions(tmp_path, precision, resume_on, tol):
    """The stream drains where a checkpoint is saved (here after steps 2 and 3), and the checkpoint
    holds the stash W(t-1) beside W(t): resumed (in float64 on TP 2 x PP 2), every loss is the
    uninterrupted run's, where without the stash the first resumed batch runs on the newest version
    (1.9e-3 off). In bf16 the newest version is the fp32 masters', the stash 16-bit: bit for bit."""
    args = ["--max-iters", "6", "--pp", "2", "--schedule", "pipedream-2bw", *precision.split(), "--dropout", "0.1"]
    whole, parts, resumed, save = (str(tmp_path / name) for name in ("whole.jsonl", "parts.jsonl", "resumed.jsonl", "ckpt"))
    assert train(2, *args, "--log-json", whole)[0] == 0
    code, out, _ = train(2, *args, "--save", save, "--save-interval", "2", "--exit-interval", "3", "--log-json", parts)
    assert code == 0 and "stopped after 3 iterations" in out, out
    code, out, _ = train(2 * (1 + bool(resume_on)), *args, *resume_on, "--load", save, "--log-json", resumed)
    assert code == 0, out
    assert sorted(losses(resumed)) == [3, 4, 5] and close({**losses(parts), **losses(resumed)}, losses(whole), tol)


def test_the_heads_weight_gradient_at_the_flush_from_the_command_line(single, tmp_path):
    """--defer-embedding-wgrad-compute on PP 2: the last stage runs the head's W's (its "weight"
    times; the first stage has none) and the run is the single-device one; with
    --defer-wgrad-linears balanced, the count its FLOPs replay chooses (6 of the last chunk's 8
    linear layers for this model at m = 2: plan.hetero.balanced_linears), said in the layout line."""
    log = str(tmp_path / "log.jsonl")
    code, out, _ = train(2, "--max-iters", "20", "--pp", "2", "--schedule", "1f1b",
                         "--defer-embedding-wgrad-compute", "--defer-wgrad-linears", "balanced", "--log-json", log)
    assert code == 0, out
    assert "the head's weight gradients at the flush with those of the last 6 linear layers" in out, out
    assert len(losses(log)) == 20 and close(losses(log), single)
    for row in rows(log):
        first, last = row["stage_ms"]["weight"]
        assert first == [0.0] and last[0] > 0 and 0 <= row["bubble_expected"] < 1, row["stage_ms"]


def test_the_last_dense_blocks_linear_layers_deferred_in_a_mixture_of_experts(tmp_path):
    """--defer-wgrad-linears 4 where every second block from the first has experts: the last block
    is dense and its four W's go to the flush; B then W is the fused backward, so the losses are the
    run's without them, bit for bit."""
    runs = {}
    for k in ("0", "4"):
        log = str(tmp_path / f"log{k}.jsonl")
        code, out, _ = train(2, "--max-iters", "6", "--pp", "2", "--num-experts", "4", "--moe-layer-freq", "2",
                             "--micro-batch-size", "2", "--defer-embedding-wgrad-compute", "--defer-wgrad-linears", k,
                             "--log-json", log)
        assert code == 0, out
        runs[k] = [(r["loss"], r["grad_norm"]) for r in rows(log)]
    assert len(runs["4"]) == 6 and runs["4"] == runs["0"]


def test_checkpoints_reshard_onto_other_layouts(single, tmp_path):
    save = str(tmp_path / "ckpt")
    code, out, _ = train(8, "--max-iters", "20", "--tp", "2", "--pp", "2", "--zero-stage", "1",
                         "--save", save, "--save-interval", "5", "--exit-interval", "10")
    assert code == 0 and "resume with --load" in out, out
    assert sorted(os.listdir(save)) == [".lock", "iter_0000005", "iter_0000010", "latest"]
    for n, layout in ((8, ["--tp", "4"]), (8, ["--pp", "4", "--schedule", "gpipe"]), (1, []),
                      (4, ["--zero-stage", "3"]),  # moments and parameters into flat ZeRO shards of DP=4
                      (4, ["--pp", "2", "--num-virtual-stages", "2", "--schedule", "interleaved", "--micro-batch-size", "2"])):
        log = str(tmp_path / f"resumed{n}{''.join(layout)}.jsonl")
        code, out, _ = train(n, "--max-iters", "20", *layout, "--load", save, "--log-json", log)
        assert code == 0, out
        resumed = losses(log)
        assert sorted(resumed) == list(range(10, 20)) and close(resumed, single), (layout, resumed)


def test_a_zb_v_checkpoint_reshards_onto_round_robin_layouts(single, tmp_path):
    """ZB-V's V puts chunks r and 2p - 1 - r on rank r (the embedding and the head both on rank 0);
    its checkpoint names whole tensors, so one device and interleaved 1F1B's round-robin chunks
    (rank r: chunks r and p + r) resume it and go on as the single-device run."""
    save = str(tmp_path / "ckpt")
    code, out, _ = train(2, "--max-iters", "20", "--pp", "2", "--schedule", "zb-v", "--num-virtual-stages", "2",
                         "--save", save, "--save-interval", "10", "--exit-interval", "10")
    assert code == 0 and "resume with --load" in out, out
    for n, layout in ((1, []), (2, ["--pp", "2", "--num-virtual-stages", "2", "--schedule", "interleaved",
                                    "--micro-batch-size", "2"])):
        log = str(tmp_path / f"resumed{n}.jsonl")
        code, out, _ = train(n, "--max-iters", "20", *layout, "--load", save, "--log-json", log)
        assert code == 0, out
        resumed = losses(log)
        assert sorted(resumed) == list(range(10, 20)) and close(resumed, single), (layout, resumed)


def test_zero_3_with_a_pipeline_trains_saves_and_reshards(single, tmp_path):
    """ZeRO-3 on PP 2 x DP 2 (each stage's units gathered per micro-batch, the tied embedding's
    two parts summed before its group is sent): the single-device run, and its checkpoint resumes
    on one device."""
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "zero3.jsonl")
    code, out, _ = train(4, "--max-iters", "20", "--pp", "2", "--zero-stage", "3", "--micro-batch-size", "2",
                         "--save", save, "--save-interval", "10", "--exit-interval", "10", "--log-json", log)
    assert code == 0 and "resume with --load" in out, out
    assert sorted(losses(log)) == list(range(10)) and close(losses(log), single)
    resumed = str(tmp_path / "resumed.jsonl")
    code, out, _ = train(1, "--max-iters", "20", "--load", save, "--log-json", resumed)
    assert code == 0, out
    assert sorted(losses(resumed)) == list(range(10, 20)) and close(losses(resumed), single)


def test_resume_is_exact_on_the_same_layout(tmp_path):
    args = ["--max-iters", "8", "--tp", "2", "--pp", "2", "--dtype", "float64", "--dropout", "0.1", "--zero-stage", "1"]
    whole, parts, save = str(tmp_path / "whole.jsonl"), str(tmp_path / "parts.jsonl"), str(tmp_path / "ckpt")
    assert train(8, *args, "--log-json", whole)[0] == 0
    assert train(8, *args, "--save", save, "--save-interval", "4", "--exit-interval", "4", "--log-json", parts)[0] == 0
    code, out, _ = train(8, *args, "--load", save, "--log-json", parts)
    assert code == 0, out
    assert losses(parts) == losses(whole)  # bit for bit in float64


def test_a_damaged_shard_ends_the_job_naming_the_file(tmp_path):
    save = str(tmp_path / "ckpt")
    assert train(4, "--max-iters", "4", "--exit-interval", "2", "--pp", "2", "--save", save)[0] == 0
    assert sorted(f for f in os.listdir(os.path.join(save, "iter_0000002")) if f.endswith(".safetensors")) == [
        "rank_00000.safetensors", "rank_00002.safetensors"]  # the DP replicas 1 and 3 save nothing
    shard = os.path.join(save, "iter_0000002", "rank_00002.safetensors")
    raw = bytearray(open(shard, "rb").read())
    raw[-5] ^= 0xFF
    open(shard, "wb").write(bytes(raw))
    code, out, seconds = train(4, "--max-iters", "4", "--pp", "2", "--load", save)
    # both DP replicas of stage 1 read the damage: one line says it (sharded.agree_on_failure)
    assert code != 0 and out.count("rank_00002.safetensors is damaged") == 1 and seconds < 60, out
    shutil.rmtree(os.path.join(save, "iter_0000002"))
    code, out, _ = train(4, "--max-iters", "4", "--pp", "2", "--load", save)
    assert code == 2 and "has no index.json" in out


def test_a_damage_only_one_rank_reads_ends_the_job_before_zero_gathers(tmp_path):
    """ZeRO-1's fp32 masters are pieces each DP rank reads alone; the ranks agree on the reads
    before masters_to_model all-gathers them (a rank that found the damage had gone to the vote
    while the other waited in the gather, for ever)."""
    save, args = str(tmp_path / "ckpt"), ["--zero-stage", "1", "--bf16"]
    assert train(2, "--max-iters", "4", "--exit-interval", "2", "--save", save, *args)[0] == 0
    shard = os.path.join(save, "iter_0000002", "rank_00001.safetensors")
    raw = bytearray(open(shard, "rb").read())
    raw[-5] ^= 0xFF  # the last piece of the file: DP rank 1's own
    open(shard, "wb").write(bytes(raw))
    code, out, seconds = train(2, "--max-iters", "4", "--load", save, *args, timeout=60)
    assert code == 1 and out.count("rank_00001.safetensors is damaged") == 1 and seconds < 60, out


@pytest.mark.parametrize("n,args,message", [
    (4, ["--tp", "3"], "4 ranks do not split into TP x PP = 3 x 1"),
    (4, ["--tp", "2", "--dp", "3"], "TP x PP x DP = 2 x 1 x 3 = 6 ranks, but the job has 4"),
    (2, ["--tp", "2", "--n-head", "3", "--n-embd", "33"], "--n-head 3 is not divisible by --tp 2"),
    (2, ["--pp", "2", "--n-layer", "3"], "--n-layer 3 is not divisible by --pp x --num-virtual-stages"),
    (2, ["--global-batch-size", "5"], "does not split over DP=2"),
    (2, ["--num-virtual-stages", "2"], "needs --pp > 1 and --schedule interleaved"),
    (2, ["--sequence-parallel"], "needs --tp > 1"),
    (2, ["--pp", "2", "--schedule", "zb-h1", "--num-virtual-stages", "2"], "needs --schedule interleaved"),
    (2, ["--pp", "2", "--schedule", "zb-v"], "--schedule zb-v places two chunks per rank in a V: it needs --num-virtual-stages 2"),
    (4, ["--pp", "2", "--schedule", "interleaved", "--micro-batch-size", "4"], "is not divisible by --pp 2"),
    (2, ["--pp", "2", "--schedule", "pipedream-2bw", "--zero-stage", "1"], "pipedream-2bw stashes a second copy"),
    (2, ["--pp", "2", "--schedule", "pipedream-2bw", "--fp16"], "pipedream-2bw with --fp16"),
    (2, ["--defer-embedding-wgrad-compute"], "--defer-embedding-wgrad-compute runs the head's weight gradients"),
])
def test_bad_layouts_get_one_line(n, args, message):
    """Each problem is one line, printed by one rank (a layout may have several: all are named)."""
    code, out, _ = train(n, "--max-iters", "1", *args, timeout=60)
    errors = [line for line in out.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == len(set(errors)) and sum(message in e for e in errors) == 1, out


def test_divergence_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    code, out, _ = train(4, "--max-iters", "30", "--pp", "2", "--tp", "2", "--lr", "1e12", "--warmup-iters", "0",
                         "--min-lr", "0", "--grad-clip", "0", "--save", save, "--save-interval", "1")
    assert code != 0 and "training diverged; non-finite gradients: rank" in out
    diverged_at = int(re.search(r"at iter (\d+) the loss", out).group(1))
    kept = read_index(save)  # what `latest` names is whole: every shard there, at its size
    assert "The last checkpoint in" in out and kept["iteration"] == diverged_at


def test_a_diverged_pipedream_2bw_run_stops_in_one_line_a_step_late():
    """Its results come a step late (the stages' sums finish during the next step): the run still
    stops on the diverged step, in one line, with its pending update made and its sums waited for."""
    code, out, _ = train(2, "--max-iters", "30", "--pp", "2", "--schedule", "pipedream-2bw", "--lr", "1e12",
                         "--warmup-iters", "0", "--min-lr", "0", "--grad-clip", "0")
    lines = [line for line in out.splitlines() if "training diverged" in line]
    assert code != 0 and len(lines) == 1 and "non-finite gradients: rank" in lines[0] and "Traceback" not in out, out


LESSON_6 = os.path.join(ROOT, "lessons", "06_3d_parallel.py")


def test_3d_lesson():
    out = check_mpi(8, LESSON_6, timeout=180)
    # rank 3 = tp 1 + dp 1 x 2: the second half of every matrix, the second piece of the Adam state
    row = r"^\s+3\s+1\s+1\s+0\s+h\.0-1\s+wte\+wpe\s+heads 2-3, cols 128-255, vocab 128-255\s+1/2: [\d,]+$"
    assert "equals the single-device run" in out and re.search(row, out, re.M), out
    # the parallel steps' model FLOPs utilisation (its value is a timing: never asserted)
    assert re.search(r"^MFU \d+\.\d%: 0\.705 GFLOP per step in \d+ ms, peak [\d.]+ GFLOP/s", out, re.M), out


def test_3d_lesson_fails_on_a_planted_bug():
    code, out, _ = run_mpi(8, LESSON_6, "--plant-bug", timeout=180)
    assert code != 0 and "MISMATCH" in out
