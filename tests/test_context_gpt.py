"""The GPT with context parallelism: against one device through the executor the trainer uses
(``tests/mpi/context_gpt.py``), and through ``python -m minipar.train``: the same losses, and
checkpoints that reshard across CP sizes."""


import pytest
from mpi_run import check_mpi, logged_losses as losses, run_train


@pytest.mark.parametrize("n,args", [
    (2, "2 1 p2p"),                # the ring on the whole sequence
    (4, "4 1 a2a"),                # Ulysses, a head per rank
    (4, "2 2 p2p sp"),             # with tensor and sequence parallelism
    (4, "2 1 a2a zero1 selective"),  # with DP = 2, ZeRO-1 over DP x CP, selective recomputation
    (2, "2 1 p2p zero3"),          # ZeRO-3 over DP x CP: here the CP ranks alone shard the state
    (4, "2 1 p2p pp2"),            # with two pipeline stages
])
def test_the_gpt_on_a_context_parallel_grid_equals_one_device(n, args):
    out = check_mpi(n, "context_gpt.py", *args.split(), timeout=180)
    assert out.count(" OK (") == n, out


@pytest.mark.parametrize("n,args", [
    (2, "2 1 p2p full ignore eval"),      # whole-block recomputation: the ring runs again in backward
    (4, "4 1 a2a full ignore eval"),      # targets of -1 at every chunk edge and a whole chunk ignored
    (4, "2 2 p2p sp full"),               # with TP and SP
    (4, "2 1 p2p pp2 SCHEDULE=interleaved M=4 ignore"),  # ring messages of 4 micro-batches, 2 chunks a rank
    (4, "2 1 a2a pp2 SCHEDULE=zb-v M=4 selective"),     # backward split into B and W, in a V
])
def test_the_gpt_with_cp_in_more_layouts_equals_one_device(n, args):
    """Gradients of the first step, parameters after two, the evaluation loss."""
    out = check_mpi(n, "context_gpt.py", *args.split(), timeout=180)
    assert out.count(" OK (") == n, out


SMALL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", "32", "--global-batch-size", "4",
         "--eval-interval", "100", "--eval-iters", "1", "--sample", "0", "--plot", "", "--dropout", "0.1",
         "--dtype", "float64"]


def train(n, *args):
    return run_train(n, *SMALL, *args)


def test_training_with_cp_follows_one_device_and_its_checkpoints_reshard(tmp_path):
    single, save = str(tmp_path / "single.jsonl"), str(tmp_path / "ckpt")
    assert train(1, "--max-iters", "6", "--log-json", single)[0] == 0
    log = str(tmp_path / "cp.jsonl")
    # ZeRO-1 over DP x CP (here the 2 CP ranks): each CP rank saves its own piece of the Adam state
    code, out, _ = train(4, "--max-iters", "6", "--cp", "2", "--tp", "2", "--zero-stage", "1", "--save", save,
                         "--save-interval", "3", "--exit-interval", "3", "--log-json", log)
    assert code == 0 and "x CP 2 (p2p)" in out and "ZeRO stage 1" in out, out
    for n, layout in ((4, ["--cp", "4", "--cp-comm-type", "a2a"]), (1, [])):
        resumed = str(tmp_path / f"resumed{n}.jsonl")
        code, out, _ = train(n, "--max-iters", "6", *layout, "--load", save, "--log-json", resumed)
        assert code == 0, out
        assert losses(log) + losses(resumed) == pytest.approx(losses(single), rel=1e-12)


@pytest.mark.parametrize("args,message", [
    (["--cp", "3"], "--block-size 32 is not divisible by 6; choose a multiple of 6"),
    (["--cp", "4", "--cp-comm-type", "a2a", "--n-head", "2"], "--n-head 2 is not divisible by TP x CP = 4"),
])
def test_context_parallel_sizes_that_cannot_be_are_one_line(args, message):
    n = 6 if "3" in args else 4
    code, out, _ = train(n, "--max-iters", "1", *args)
    assert code == 2 and out.count(message) == 1, out
