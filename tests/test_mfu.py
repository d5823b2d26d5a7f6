"""MFU: the model's FLOPs per token from its shape, and the machine's measured matrix-product peak."""

import json
import types

import numpy
import pytest

from mpi_run import run_mpi

import minipar.mfu as mfu
from minipar.comm.mpi import world
from minipar.mfu import flops_per_token, measured_peak, model_flops_per_token
from minipar.models import GPT, GPTConfig


def test_flops_per_token_are_six_per_weight_of_every_matrix_product_plus_attention():
    config = GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=16, vocab_size=64)
    model = GPT(config)
    # every weight a token meets in a matrix product: the blocks' matrices and the tied head
    weights = sum(p.size for n, p in model.named_parameters() if n.endswith(".weight") and p.ndim == 2
                  and "wpe" not in n)
    attention = 2 * 2 * config.block_size * config.n_embd * config.n_layer  # q k^T and P v, forward
    assert flops_per_token(3, 32, 16, 64) == 6 * weights + 3 * attention


def test_the_peak_is_a_rate_of_matrix_products():
    peak = measured_peak(world(), "float64", n=64, repeats=2)
    assert 1e6 < peak < 1e15  # FLOP/s: above a slow interpreter, below any one machine


class _Ranks:
    """A world of ``size`` ranks seen from one of them: barriers pass at once, and the max
    all-reduce answers ``slowest`` (the slowest rank's time), the sum one what it is given."""

    def __init__(self, size, slowest=None):
        self.size, self.slowest = size, slowest

    def barrier(self):
        pass

    def all_reduce(self, value, op="sum"):
        return numpy.array([self.slowest]) if op == "max" and self.slowest is not None else value


def _clock(monkeypatch, *readings):
    """minipar.mfu's perf_counter reads ``readings`` in turn (a round's start, then its end)."""
    ticks = iter(readings)
    monkeypatch.setattr(mfu, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))


def test_the_peak_is_every_ranks_products_over_the_slowest_ranks_time(monkeypatch):
    """The peak is the job's: 4 ranks' products all count, and they took the slowest rank's time
    (this rank's 0.25 s is not the job's 0.5 s)."""
    _clock(monkeypatch, 10.0, 10.25)
    peak = measured_peak(_Ranks(4, slowest=0.5), "float64", n=8, repeats=2, rounds=1)
    assert peak == 4 * 2 * (2 * 8**3) / 0.5


def test_the_peak_is_timed_by_the_fastest_round(monkeypatch):
    """Other work on the machine only slows a round: the fastest of them (0.25 s) is the nearest
    the machine's rate, not the slowest (1 s) nor the first (0.5 s)."""
    _clock(monkeypatch, 0.0, 0.5, 10.0, 10.25, 20.0, 21.0)
    peak = measured_peak(_Ranks(1), "float64", n=8, repeats=2, rounds=3)
    assert peak == 2 * (2 * 8**3) / 0.25


@pytest.mark.parametrize("experts,top_k", [(4, 2), (8, 1), (4, 3)])
def test_a_mixture_of_experts_costs_six_flops_per_active_weight_plus_attention(experts, top_k):
    """A token meets k of the E experts' weights (not E of them, and its block has no dense MLP
    besides), the router's, the dense blocks' and the tied head's: 6 FLOPs each in training,
    plus attention's 12 T h per layer. Counted here from the model's own parameters."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, num_experts=experts,
                       moe_router_topk=top_k, moe_layer_freq=2)  # block 0 a mixture, block 1 dense
    matrices = {n: p.size for n, p in GPT(config).named_parameters()
                if n.endswith(".weight") and p.ndim == 2 and "wpe" not in n}
    of_experts = sum(size for n, size in matrices.items() if ".experts." in n)
    assert of_experts % experts == 0
    active = sum(size for n, size in matrices.items() if ".experts." not in n) + top_k * of_experts // experts
    attention = 3 * 2 * 2 * config.block_size * config.n_embd * config.n_layer
    assert model_flops_per_token(config) == 6 * active + attention


# The trainer's peak, patched in each rank: a busy machine at the start, a quiet one at the first
# evaluation, busy ones at the two after it (after iterations 1, 3 and 5 of 6, --eval-interval 2).
PEAKS = [1e6, 1e15, 1.0, 1.0]
PATCHED = f"""import sys
import minipar.trainer
peaks = iter({PEAKS!r})
minipar.trainer.measured_peak = lambda world, dtype: next(peaks)
from minipar.train import main
sys.exit(main(sys.argv[1:]))
"""
RUN = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
       "--eval-iters", "1", "--sample", "0", "--plot", "", "--max-iters", "6", "--eval-interval", "2"]


@pytest.fixture(scope="module")
def dp2_rows(tmp_path_factory):
    """The --log-json rows of 6 iterations on 2 data-parallel ranks with the peaks above: one
    launch for the tests that read them."""
    tmp = tmp_path_factory.mktemp("mfu_rows")
    corpus, script, log = tmp / "corpus.txt", tmp / "peaks.py", tmp / "log.jsonl"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(400)))
    script.write_text(PATCHED)
    code, out, _ = run_mpi(2, str(script), *RUN, "--dp", "2", "--data", corpus, "--log-json", log, timeout=180)
    assert code == 0, out
    with open(log) as f:
        return [json.loads(line) for line in f]


def test_the_log_rows_are_numbered_by_iteration_from_zero(dp2_rows):
    """A row's "iter" is the iteration it is of (resumed runs and plots join rows by it)."""
    assert [row["iter"] for row in dp2_rows] == list(range(6))


def test_a_rows_mfu_is_the_whole_batchs_model_flops_per_second_over_the_peak(dp2_rows):
    """MFU = every DP rank's tokens (the global batch, 4 x 16) x FLOPs per token over the step's
    seconds (its ms / 1e3), over the peak in force: the first measurement until the first
    evaluation, the highest of all so far after it."""
    for row, peak in zip(dp2_rows, [1e6, 1e6, 1e15, 1e15, 1e15, 1e15], strict=True):
        want = 4 * 16 * flops_per_token(2, 16, 16, 256) / (row["ms"] / 1e3) / peak
        assert abs(row["mfu"] - want) <= 1e-9 * want, (row["iter"], row["mfu"], want)


def test_a_peak_measured_on_a_busy_machine_does_not_replace_a_higher_one(dp2_rows):
    """The evaluations after iterations 3 and 5 measure 1 FLOP/s: the 1e15 of the first one stays,
    so no MFU after it is anywhere near 1 (with the last measurement in force it is ~1e8)."""
    assert all(row["mfu"] < 1e-3 for row in dp2_rows[2:]), [row["mfu"] for row in dp2_rows]
