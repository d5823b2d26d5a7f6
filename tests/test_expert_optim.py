"""Every optimizer path (ZeRO 0 to 3, the gradient norm, sharded checkpoints resharded across EP
sizes) with expert parameters against one device on 4 ranks (tests/mpi/expert_optim.py; EP over DP
ranks, and over CP ranks too), and the same script failing when expert gradients are summed over
all of DP."""

from mpi_run import check_mpi, run_mpi


def test_expert_parameters_train_and_reshard_as_on_one_device():
    out = check_mpi(4, "expert_optim.py", timeout=60)
    assert "expert optimizers OK on 4 ranks" in out
    assert out.count("ZeRO-2 ") == out.count("ZeRO-3 ") == 7 and out.count("checkpoint -> EP=") == 8


def test_expert_gradients_summed_over_all_of_dp_fail():
    code, out, _ = run_mpi(4, "expert_optim.py", "--plant-bug", timeout=60)
    assert code != 0 and "expert optimizers FAILED on 4 ranks" in out, out
