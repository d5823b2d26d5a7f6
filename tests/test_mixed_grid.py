"""Mixed precision through the pipeline executor on TP, PP, CP and EP grids (``tests/mpi/mixed_grid.py``)."""

from mpi_run import run_mpi


def test_the_loss_scale_is_exact_and_an_overflow_skips_everywhere_on_every_grid():
    code, out, _ = run_mpi(4, "mixed_grid.py", timeout=300)
    assert code == 0, out
    assert "OK on 4 ranks" in out


def test_a_scaler_that_would_agree_over_fewer_ranks_than_the_run_is_refused():
    code, out, _ = run_mpi(2, "mixed_world.py", timeout=120)
    assert code == 0, out
    assert "refused OK" in out
