"""Pipeline parallelism under mpiexec: every schedule, with tied weights across the first and last
stage, against the single-device run; with data and tensor parallelism; bad sizes refused on every
rank; and the lesson."""

import os

import pytest

from mpi_run import ROOT, check_mpi, run_mpi


@pytest.mark.parametrize("n,args", [
    (2, ["--pp", "2", "--schedule", "gpipe", "--m", "3"]),
    (2, ["--pp", "2", "--schedule", "1f1b", "--m", "4", "--recompute"]),
    (2, ["--pp", "2", "--schedule", "interleaved", "--v", "2", "--m", "2"]),
    (4, ["--pp", "4", "--schedule", "gpipe", "--m", "4", "--recompute"]),
    (4, ["--pp", "4", "--schedule", "1f1b", "--m", "6"]),
    (4, ["--pp", "4", "--schedule", "1f1b-slack", "--m", "6"]),
    (4, ["--pp", "4", "--schedule", "interleaved", "--v", "2", "--m", "8", "--recompute"]),
    (4, ["--pp", "2", "--schedule", "1f1b", "--m", "2", "--bucket-bytes", "1"]),  # PP 2 x DP 2, a bucket a parameter
    (4, ["--pp", "2", "--tp", "2", "--schedule", "interleaved", "--v", "2", "--m", "2"]),
    (4, ["--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "1f1b", "--recompute"]),
    # the head's W's at the flush (Megatron-LM's deferred embedding wgrad): DP's sums started by
    # hooks, a bucket a parameter, the tied embedding's from its last head W, interleaved with the
    # last 3 linear layers' W's (of the last rank's second chunk); with TP, SP, recompute and 3; with ZeRO-2's groups sent from the flush's W's
    (4, ["--pp", "2", "--schedule", "interleaved", "--v", "2", "--m", "2", "--bucket-bytes", "1",
         "--defer-embedding-wgrad", "--defer-wgrad-linears", "3"]),
    (4, ["--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "gpipe", "--m", "3", "--recompute",
         "--defer-embedding-wgrad", "--defer-wgrad-linears", "3"]),
    (4, ["--pp", "2", "--schedule", "1f1b", "--m", "3", "--zero-stage", "2", "--bucket-bytes", "1",
         "--defer-embedding-wgrad", "--defer-wgrad-linears", "5"]),
    (4, ["--pp", "2", "--schedule", "1f1b", "--m", "3", "--zero-stage", "3", "--defer-embedding-wgrad",
         "--defer-wgrad-linears", "2"]),
    # experts in every second block from the first: the last block's four, dense, deferred
    (2, ["--pp", "2", "--schedule", "1f1b", "--m", "4", "--defer-embedding-wgrad", "--defer-wgrad-linears", "4",
         "--experts", "4", "--moe-layer-freq", "2"]),
    # ZeRO-2 and 3 hold back what the model sums after backward: the tied embedding's two parts,
    # sequence parallelism's partial sums
    (4, ["--pp", "2", "--schedule", "interleaved", "--v", "2", "--m", "2", "--zero-stage", "2", "--bucket-bytes", "1"]),
    (4, ["--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "1f1b", "--m", "2", "--zero-stage", "2",
         "--recompute"]),
    (4, ["--pp", "1", "--tp", "2", "--sequence-parallel", "--m", "3", "--zero-stage", "3", "--recompute"]),
    # ZeRO-3 across a pipeline: each chunk's units gathered per micro-batch, the tied embedding held back
    (4, ["--pp", "2", "--schedule", "interleaved", "--v", "2", "--m", "4", "--zero-stage", "3", "--recompute"]),
])
def test_pipeline_matches_the_single_device_run(n, args):
    out = check_mpi(n, "pipeline.py", *args, timeout=180)
    assert out.count("OK (layers") == n


@pytest.mark.parametrize("n,args", [
    (2, ["--pp", "2", "--schedule", "zb-h1", "--m", "4"]),
    (4, ["--pp", "4", "--schedule", "zb-h1", "--m", "6", "--recompute"]),
    (4, ["--pp", "4", "--schedule", "zb-h2", "--m", "8"]),
    (4, ["--pp", "2", "--schedule", "zb-h2", "--m", "4", "--zero-stage", "1", "--recompute"]),  # PP 2 x DP 2
    (4, ["--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "zb-h1", "--m", "3", "--recompute"]),
    (2, ["--pp", "2", "--schedule", "zb-v", "--v", "2", "--m", "4"]),
    (4, ["--pp", "4", "--schedule", "zb-v", "--v", "2", "--m", "8", "--recompute"]),
    (4, ["--pp", "2", "--schedule", "zb-v", "--v", "2", "--m", "3", "--zero-stage", "1"]),  # PP 2 x DP 2
    # ZeRO-2 sends each group from W's hooks, the tied embedding's and SP's partial sums at the end
    (4, ["--pp", "2", "--schedule", "zb-v", "--v", "2", "--m", "4", "--zero-stage", "2", "--bucket-bytes", "1"]),
    (4, ["--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "zb-h1", "--m", "3", "--zero-stage", "2"]),
    # ZeRO-3: W reads no weight (dW = g^T x), so the units are released after B; a group an earlier
    # W sent gets a new buffer for the next W's gradients
    (4, ["--pp", "2", "--schedule", "zb-v", "--v", "2", "--m", "3", "--zero-stage", "3"]),
    # DP's sums start from W's hooks, one parameter at a time: the tied embedding's only when its
    # second use (the last chunk's, on the same rank in a V) has added its part
    (4, ["--pp", "2", "--schedule", "zb-v", "--v", "2", "--m", "4", "--bucket-bytes", "1"]),
    (4, ["--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "zb-v", "--v", "2", "--m", "4"]),
])
def test_zero_bubble_pipeline_matches_the_single_device_run(n, args):
    """B and W apart (Qi et al. 2024): the same loss, gradients and parameters as one device, with
    data parallelism and ZeRO-1, tensor and sequence parallelism, and recompute; W's memory counted.
    ZB-V's V puts the first and the last chunk (the tied embedding's two uses) on rank 0."""
    out = check_mpi(n, "pipeline.py", *args, timeout=180)
    assert out.count("OK (layers") == n and "W held 0 bytes" not in out


@pytest.mark.parametrize("args", [["--schedule", "zb-h1"], ["--schedule", "zb-v", "--v", "2"],
                                  ["--schedule", "1f1b", "--defer-embedding-wgrad", "--defer-wgrad-linears", "2"]])
def test_a_skipped_w_is_caught(args):
    code, out, _ = run_mpi(2, "pipeline.py", "--pp", "2", "--m", "4", "--plant-bug", *args, timeout=60)
    assert code != 0 and "gradient of" in out and "off by" in out, out


@pytest.mark.parametrize("args,message", [
    (["--schedule", "interleaved", "--v", "2", "--m", "3"], "micro_batches=3 is not divisible by PP=2"),
    (["--schedule", "1f1b", "--v", "2"], "virtual_stages=2 needs schedule='interleaved'"),
    (["--schedule", "zb-v", "--v", "3", "--m", "2"], "'v' (with virtual_stages=2), got 'v' with virtual_stages=3"),
])
def test_bad_pipeline_sizes_end_the_job_with_the_reason(args, message):
    code, out, _ = run_mpi(2, "pipeline.py", "--pp", "2", *args, timeout=60)
    assert code == 3 and out.count("refused: ") == 2 and message in out, out  # on both ranks


LESSON_4 = os.path.join(ROOT, "lessons", "04_pipeline_parallel.py")


@pytest.mark.parametrize("n,args,layout", [(4, [], "PP=4 x DP=1"), (8, [], "PP=4 x DP=2"),
                                           (2, ["--dtype", "float64", "--micro-batches", "4", "--n-layer", "4"],
                                            "PP=2 x DP=1")])
def test_pipeline_lesson(n, args, layout, tmp_path):
    """With its defaults at 4 and 8 ranks (at 8, 16 chunks of 8 blocks cannot be: PP = 4, DP = 2),
    and at 2 in float64, its tightest tolerance, with half the layers (16 s against 24)."""
    out = check_mpi(n, LESSON_4, "--out", str(tmp_path), *args, timeout=300)
    assert "equals the single-device run, PipeDream-2BW its delayed rule" in out and out.startswith(layout)
    assert "sim, step" in out and "measured costs of a stage" in out and "zb-v" in out
    assert max(len(line) for line in out.splitlines() if str(tmp_path) not in line) < 100, out
    drawn = {f"{name}_{kind}" for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")
             for kind in ("measured.png", "simulated.png", "trace.json")}
    assert {f.name for f in tmp_path.iterdir()} >= drawn | {"pipedream_2bw_loss.png"}


def test_pipeline_lesson_defers_the_head_ws(tmp_path):
    """Exercise 8: 1F1B with the head's W's (and the last MLP's) at the flush, against one device,
    H's in the table."""
    out = check_mpi(2, LESSON_4, "--out", str(tmp_path), "--schedule", "1f1b", "--defer-embedding-wgrad-compute",
                    "--defer-wgrad-linears", "2", "--n-layer", "4", "--micro-batches", "4", "--show-schedules",
                    timeout=300)
    assert "the head's weight gradients at the flush (H)" in out and "1f1b equals the single-device run" in out
    assert "with them the weight gradients of the last 2 linear layers" in out
    assert " H3\n" in out and (tmp_path / "1f1b_measured.png").stat().st_size > 0, out


@pytest.mark.parametrize("args", [["--schedule", "1f1b"], ["--schedule", "pipedream-2bw"],
                                  ["--schedule", "gpipe", "--defer-embedding-wgrad-compute"]])
def test_pipeline_lesson_fails_on_a_planted_bug(args, tmp_path):
    """1F1B (and GPipe with the head's W's deferred): the tied embedding's parts never added;
    PipeDream-2BW: the weights updated in place."""
    code, out, _ = run_mpi(2, LESSON_4, "--out", str(tmp_path), "--plant-bug", *args, timeout=300)
    assert code != 0 and "MISMATCH" in out, out


@pytest.mark.parametrize("n,args", [(2, ["--pp", "2", "--m", "3"]),
                                    (4, ["--pp", "4", "--m", "4"]),
                                    (4, ["--pp", "2", "--m", "2", "--recompute"])])  # PP 2 x DP 2
def test_pipedream_2bw_follows_the_delayed_update(n, args):
    """PipeDream-2BW (no flush, weights stashed) equals one device running W(t+1) = W(t) -
    AdamW(grad f(W(t-1))) to ~1e-13 in float64, and is not synchronous training."""
    out = check_mpi(n, "pipedream.py", *args, timeout=120)
    assert out.count("pipedream-2bw OK") == n and "from synchronous" in out


def test_pipedream_2bw_with_experts_is_not_moved_by_an_evaluation_between_steps():
    """The forwards of the batch in flight weigh their auxiliary losses by their own batch's tokens,
    not by an evaluation's of half as many, run between the steps (which moved them by 0.16)."""
    out = check_mpi(2, "pipedream_moe.py", timeout=120)
    assert out.count("pipedream-2bw with experts OK") == 2


def test_pipedream_2bw_without_its_stash_is_caught():
    """A step that updates in place the weights the in-flight forwards read: their backwards then
    run on the next version, and the run leaves the delayed rule."""
    code, out, _ = run_mpi(2, "pipedream.py", "--pp", "2", "--m", "3", "--plant-bug", timeout=60)
    assert code != 0 and "off by" in out, out
