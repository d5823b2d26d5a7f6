"""The mixture-of-experts GPT: against one device on grids with expert parallelism composed with
DP, ZeRO-1, TP (with sequence parallelism), CP and PP (``tests/mpi/moe_gpt.py``, float64), its
lesson, and ``python -m minipar.train`` with experts: the same losses at every EP size, and
checkpoints that reshard across EP sizes."""

import json
import os

import pytest
from mpi_run import ROOT, check_mpi, logged_losses as losses, run_mpi, run_train

LESSON_9 = os.path.join(ROOT, "lessons", "09_mixture_of_experts.py")


@pytest.mark.parametrize("args", [
    "2 1 1 1 zero1 capacity",       # EP x DP with ZeRO-1 and a capacity factor
    "2 2 1 1 sp capacity",          # EP x TP with sequence parallelism: each TP rank routes its positions
    "2 1 2 1 capacity",             # EP x CP: each CP rank routes its two chunks
    "2 1 1 2 recompute capacity",   # EP x PP with recomputation: the auxiliary losses on both stages
    "2 1 1 2 zb-h1 zero1",          # EP x PP on the zero-bubble schedule (the backward split into B and W)
])
def test_the_moe_gpt_on_an_expert_parallel_grid_equals_one_device(args):
    out = check_mpi(4, "moe_gpt.py", *args.split(), timeout=180)
    assert ": OK; worst relative errors" in out, out
    assert "capacity" not in args or "dropped [0, 0]" not in out, out  # the capacity factor did drop slots


def test_the_moe_gpt_fails_when_combine_uses_the_wrong_permutation():
    code, out, _ = run_mpi(4, "moe_gpt.py", "2", "1", "1", "1", "plant-bug", timeout=180)
    assert code != 0 and "relative error" in out, out


def test_the_lesson_passes_on_four_ranks():
    out = check_mpi(4, LESSON_9, timeout=300)
    assert "EP=2" in out and "EP=4" in out and "1/4 of them (1/EP)" in out
    assert "Expert parallelism equals the single-device mixture of experts, and sends what the routing says" in out


def test_the_lesson_passes_with_every_expert_on_one_rank():
    """EP = 1 (one rank, or no EP dividing the ranks): the lesson once counted no expert bytes
    there, as it found experts by their gradients' group, which only EP > 1 gives them."""
    out = check_mpi(1, LESSON_9, "--steps", "2", timeout=120)
    assert "EP=1   2,117,632 bytes = 1/1 of them (1/EP)" in out, out


def test_the_lesson_fails_on_a_planted_bug():
    code, out, _ = run_mpi(2, LESSON_9, "--plant-bug", timeout=300)
    assert code == 1 and "PLANTED BUG" in out and "MISMATCH" in out


SMALL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", "32", "--global-batch-size", "8",
         "--eval-interval", "100", "--eval-iters", "1", "--sample", "0", "--plot", "", "--dropout", "0.1",
         "--dtype", "float64", "--num-experts", "4", "--moe-z-loss-coeff", "0.01"]


def train(n, *args):
    return run_train(n, *SMALL, *args)


def test_training_with_experts_follows_one_device_and_its_checkpoints_reshard(tmp_path):
    """Dropless routing without the balancing loss (which is a mean over each rank's tokens) is the
    same whoever routes which tokens: one device and EP = 2, 4 give the same losses, and a run
    saved at EP = 2 goes on at EP = 4 or on one device."""
    single, save = str(tmp_path / "single.jsonl"), str(tmp_path / "ckpt")
    assert train(1, "--max-iters", "4", "--log-json", single)[0] == 0
    log = str(tmp_path / "ep2.jsonl")
    code, out, _ = train(4, "--max-iters", "4", "--ep", "2", "--zero-stage", "1", "--save", save,
                         "--save-interval", "2", "--exit-interval", "2", "--log-json", log)
    assert code == 0 and "(EP 2)" in out and "2 experts per rank" in out, out
    for n, layout in ((4, ["--ep", "4"]), (1, [])):
        resumed = str(tmp_path / f"resumed{n}.jsonl")
        code, out, _ = train(n, "--max-iters", "4", *layout, "--load", save, "--log-json", resumed)
        assert code == 0, out
        assert losses(log) + losses(resumed) == pytest.approx(losses(single), rel=1e-12)


def test_pipedream_2bw_counts_each_batchs_routing_to_its_own_step(tmp_path):
    """PipeDream-2BW runs the next batch's first forwards during a step: what they route is that
    batch's, logged with its own step as on one device (which runs each batch's forwards in its step)."""
    rows = {}
    for n, layout in ((1, []), (2, ["--pp", "2"])):
        log = str(tmp_path / f"pp{n}.jsonl")
        code, out, _ = train(n, "--max-iters", "3", "--schedule", "pipedream-2bw", "--micro-batch-size", "2",
                             "--moe-aux-loss-coeff", "0.01", *layout, "--log-json", log)
        assert code == 0, out
        with open(log) as f:
            rows[n] = [json.loads(line) for line in f]
    for one, two in zip(rows[1], rows[2], strict=True):
        assert two["tokens_per_expert"] == one["tokens_per_expert"] and two["dropped"] == one["dropped"]
        assert (two["aux_loss"], two["z_loss"]) == pytest.approx((one["aux_loss"], one["z_loss"]), rel=1e-12)
