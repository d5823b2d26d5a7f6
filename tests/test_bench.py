"""The benchmark runs (timings themselves are never asserted: this machine is shared)."""

import importlib.util
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "step_time.py")


def test_step_time_benchmark_runs_and_reports():
    run = subprocess.run([sys.executable, BENCH, "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                          "--block-size", "16", "--batch-size", "2", "--steps", "1", "--rounds", "1", "--ops"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    first = dict(line.replace(":", "").split()[2:] for line in run.stdout.splitlines() if line.startswith("first loss"))
    assert "minipar" in first and "GFLOP/s" in run.stdout and "step/floor" in run.stdout
    ops = run.stdout.split("minipar, op by op")[1].splitlines()
    assert {"Linear", "CausalAttention", "GELU", "LayerNorm", "(outside"} <= {line.split()[0] for line in ops[2:] if line}
    if "pytorch" in first:  # every model computed the same first loss, attention fused or not
        assert first.keys() == {"minipar", "pytorch", "pytorch-sdpa"}
        assert "minipar / pytorch:" in run.stdout and "minipar / pytorch-sdpa:" in run.stdout
        assert "pytorch-sdpa, kernel by kernel" in run.stdout and "aten::mm" in run.stdout


@pytest.mark.parametrize("script,ranks,args,message", [  # an audit found each a traceback, a hang or a table of nan
    ("collectives.py", 2, ["--min-size", "0"], "argument --min-size: must be a size of at least 1 byte"),  # hung
    ("context_parallel.py", 2, ["--block-size", "15"], "--block-size 15 is not divisible by 4"),
    ("hetero_pipeline.py", 2, ["--slowdown", "nan"], "argument --slowdown: must be a finite number >= 0, got nan"),
    ("memory_breakdown.py", 2, ["--layouts", "3D"], "3D: 2 ranks do not split into TP x PP = 2 x 2 groups"),
    ("scaling.py", 1, ["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    # refused by the trainer after a dozen launches
    ("scaling.py", 1, ["--ranks", "4", "--only", "dp,zb-v"], "--only zb-v on --ranks 4: --n-layer 4 is fewer than"),
    ("activation_memory.py", 1, ["--n-embd", "16", "--n-head", "3"], "--n-embd 16 is not divisible by --n-head 3"),
    ("step_time.py", 1, ["--threads", "0"], "argument --threads: must be >= 1, got 0"),
])
def test_a_benchmarks_bad_flag_is_one_line_before_anything_is_measured(script, ranks, args, message):
    from mpi_run import run_mpi

    path = os.path.join(os.path.dirname(BENCH), script)
    if ranks > 1:
        code, out, _ = run_mpi(ranks, path, *args, timeout=60)
    else:
        run = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=60)
        code, out = run.returncode, run.stdout + run.stderr
    errors = [line for line in out.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in out, out


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is here: gpu_check.sh runs these")
def test_gpu_benchmarks_say_clearly_when_there_is_no_gpu():
    bench = os.path.dirname(BENCH)
    for script in ("gemm.py", "gpu_step.py"):
        run = subprocess.run([sys.executable, os.path.join(bench, script)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and "needs CuPy and a GPU" in run.stdout and "nothing timed" in run.stdout


def _base_python():
    """The interpreter this environment was made from: a Python without minipar installed."""
    base = getattr(sys, "_base_executable", None)
    if not base or sys.prefix == sys.base_prefix:  # not in a virtual environment: no such Python
        return None
    probe = subprocess.run([base, "-c", "import numpy, minipar"], capture_output=True, text=True, timeout=60, cwd="/")
    return base if "No module named 'minipar'" in probe.stderr else None


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is here: the preflight would pass")
@pytest.mark.skipif(_base_python() is None, reason="needs a base Python with NumPy and without minipar")
def test_gpu_check_runs_from_the_checkout_and_stops_at_the_first_missing_piece(tmp_path):
    """As on the lent machine: an interpreter with nothing of minipar installed, no wheels carried.
    minipar imports from the checkout; the first thing missing (mpi4py's MPI, or CuPy) stops the
    run at once with one line, before any step."""
    script = os.path.join(os.path.dirname(BENCH), "gpu_check.sh")
    env = dict(os.environ, PYTHON=_base_python(), GPU_WHEELS=str(tmp_path / "no-wheels"))
    env.pop("PYTHONPATH", None)
    run = subprocess.run(["bash", script, str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert run.returncode == 3, run.stdout + run.stderr
    root = os.path.dirname(os.path.dirname(BENCH))
    assert f"ok   minipar: from {root}" in run.stdout
    failed = [line for line in run.stdout.splitlines() if line.startswith("preflight: FAILED")]
    assert len(failed) == 1 and ("FAILED: MPI" in failed[0] or "FAILED: CuPy" in failed[0]), run.stdout
    results = (tmp_path / "out" / "results.md").read_text()
    assert "stopped at the preflight" in results and "| check |" not in results  # no step ran


def test_memory_breakdown_counts_a_layer_as_the_activation_benchmark_does():
    """The breakdown's graph walk, on one layer: minipar's formula (bench/activation_memory.py,
    which tracemalloc confirms) plus the layer's input, which the breakdown counts as held."""
    sys.path.insert(0, os.path.dirname(BENCH))
    from activation_memory import formula
    from memory_breakdown import graph_bytes

    import numpy as np

    import minipar
    from minipar.autograd import Tensor
    from minipar.models import GPT, GPTConfig

    s, b, h, a = 70, 2, 16, 2  # a full and a partial query block
    minipar.set_default_dtype("float32")
    minipar.manual_seed(0)
    block = GPT(GPTConfig(n_layer=1, n_head=a, n_embd=h, block_size=s, dropout=0.1)).transformer.h[0]
    x = Tensor(np.random.default_rng(0).standard_normal((b, s, h)).astype(np.float32), requires_grad=True)
    out = block(x)
    assert graph_bytes([out], block.parameters()) == sum(formula(s, b, h, a, 4, True).values()) + x.data.nbytes


@pytest.mark.parametrize("n", [2, 4])
def test_memory_breakdown_accounting_adds_up(n):
    from mpi_run import check_mpi

    assert f"memory breakdown accounting OK on {n} ranks" in check_mpi(n, "memory_breakdown.py")


def test_memory_breakdown_prints_its_table_and_draws_it(tmp_path):
    from mpi_run import check_mpi

    figure = tmp_path / "breakdown.png"
    out = check_mpi(4, BENCH.replace("step_time", "memory_breakdown"), "--layouts", "DP", "ZeRO-3", "3D",
                    "--n-layer", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "8",
                    "--micro-batches", "2", "--plot", figure)
    assert "DP4 ZeRO-3" in out and "TP2 PP2 DP1 Z1" in out and figure.stat().st_size > 0


def test_scaling_benchmark_runs_and_takes_pipelines_ideal_from_the_simulator():
    sys.path.insert(0, os.path.dirname(BENCH))
    try:
        import scaling
    finally:
        sys.path.pop(0)
    from fractions import Fraction
    # m = 8 micro-batches on p = 2: (p-1)/(m+p-1) for 1F1B, (p-1)/(6m+p-1) for ZB-V (Qi et al.)
    best, equal, by_flops = scaling.ideal("1f1b", 2, 4, 128)
    assert (best, equal) == (2 * (1 - Fraction(1, 9)), Fraction(1, 9))
    # the last stage's head (6 V h = 196,608 FLOPs a token) on 2 blocks of 72 h^2 + 12 T h: 1/14 more
    assert by_flops == Fraction(9, 67) and float(by_flops) == pytest.approx(0.134, abs=5e-4)
    for deferred in ("1f1b+defer", "1f1b-slack+defer"):  # the head's W at the flush: off the critical path
        assert scaling.ideal(deferred, 2, 4, 128)[1] == equal
        assert float(scaling.ideal(deferred, 2, 4, 128)[2]) == pytest.approx(0.117, abs=5e-4)
    # and the last block's MLP products' W's (8 h^2 a token each): the last stage's cycle shorter,
    # its drain filled; with both, it becomes the shorter stage and the drain the longer
    assert float(scaling.ideal("1f1b+defer+1", 2, 4, 128)[2]) == pytest.approx(0.079, abs=5e-4)
    assert float(scaling.ideal("1f1b+defer+2", 2, 4, 128)[2]) == pytest.approx(0.098, abs=5e-4)
    assert scaling.ideal("zb-v", 2, 4, 128)[1] == Fraction(1, 49) and scaling.ideal("dp", 4, 4, 128) == (4, None, None)
    # PipeDream-2BW never flushes: only the imbalance, stage 0 idle 1/15 of the time: 1/30 of all
    assert scaling.ideal("pipedream-2bw", 2, 4, 128) == (2, 0, Fraction(1, 30))
    # EP: each layer's busiest rank's slots, over all; a router that balances allows N exactly
    assert scaling.busiest_share([[3, 1, 2, 2], [5, 1, 1, 1]], 2) == (4 + 6) / 16
    assert scaling.routing_bound(0.5, 2, 4, 128) == pytest.approx(2.0)
    # experts 48 h^2 x top-2 a layer: 6,291,456 of 8,859,648 FLOPs a token; all slots on one rank
    f = 6_291_456 / 8_859_648
    assert scaling.routing_bound(1.0, 2, 4, 128) == pytest.approx(1 / ((1 - f) / 2 + f))
    run = subprocess.run([sys.executable, os.path.join(os.path.dirname(BENCH), "scaling.py"), "--only", "dp,1f1b,pipedream-2bw,ep",
                          "--rounds", "1", "--steps", "3", "--skip", "1", "--n-layer", "2", "--n-embd", "32"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines()[3:] if line.strip()}
    assert set(rows) == {"dp", "1f1b", "pipedream-2bw", "ep"} and rows["1f1b"][4] == "1.78x", run.stdout
    ep = rows["ep"]  # the routing's bound, from the run's logged slots: 1/N to all of them
    assert ep[6:8] == ["busiest", "rank"] and 0.5 <= float(ep[8]) <= 1.0, run.stdout
    assert 1.0 < float(ep[-1].rstrip("x")) <= 2.0, run.stdout
    two_bw = rows["pipedream-2bw"]  # its stream is not replayed: no compute-alone bubble
    assert two_bw[4] == "2.00x" and two_bw[6] == "0.000," and two_bw[8] == "-,", run.stdout


def test_op_times_takes_every_ranks_step_apart():
    """A pipeline of 2 stages: the loss is the last stage's op, the embedding the first's, and a
    stage's ops and what ran outside them add up to the step the trainer logged."""
    from mpi_run import check_mpi

    out = check_mpi(2, BENCH.replace("step_time", "op_times"), "--pp", "2", "--micro-batch-size", "2",
                    "--n-layer", "2", "--n-embd", "32", "--max-iters", "3")
    table = out[out.index("ms per iteration"):].splitlines()
    assert table[2].split() == ["op", "rank", "0", "rank", "1"], out
    rows = {line.rsplit(None, 2)[0]: [float(v) for v in line.split()[-2:]] for line in table[3:-1]}
    assert rows["CrossEntropy"][0] == 0 < rows["CrossEntropy"][1] and rows["Embedding"][1] == 0 < rows["Embedding"][0]
    step = float(table[-1].split()[-1])
    for rank in (0, 1):
        assert sum(row[rank] for row in rows.values()) == pytest.approx(step, abs=0.005 * (len(rows) + 1))  # rounding


def test_dp_breakdown_takes_the_speed_up_apart_and_times_the_last_buckets_wait():
    from mpi_run import check_mpi

    out = check_mpi(2, BENCH.replace("step_time", "dp_breakdown"), "--n-layer", "1", "--n-embd", "32",
                    "--rounds", "1", "--steps", "1", "--buckets", "4M,4K")
    rows = {line[:22].strip(): line[22:].split() for line in out.splitlines() if line.startswith(("full", "half", "DP"))}
    assert list(rows) == ["full, alone", "half, alone", "half, both", "DP, bucket 4,194,304", "DP, bucket 4,096"], out
    one, few = rows["DP, bucket 4,194,304"], rows["DP, bucket 4,096"]
    # the whole model in one bucket, started at the last gradient; 4 KiB buckets, each at its own
    assert one[3:6] == ["1", "of", "1;"] and int(few[3]) == int(few[5].rstrip(";")) > 1, out
    # the wait after backward, timed: a sum over MPI takes microseconds at the least
    assert float(one[6]) > 0 and float(few[6]) > 0 and "ideal 2x = halving" in out, out


def test_scaling_checks_each_layout_on_the_model_it_will_run():
    """Interleaved needs pp x v chunks of at least a layer: 4 ranks refuse 4 layers, not 8."""
    from types import SimpleNamespace

    sys.path.insert(0, os.path.dirname(BENCH))
    import scaling

    four, eight = (SimpleNamespace(ranks=4, n_layer=n, n_embd=128) for n in (4, 8))
    assert scaling.layout_problems(["interleaved", "dp"], eight) == []
    assert [line.split(":")[0] for line in scaling.layout_problems(["interleaved", "dp"], four)] == [
        "--only interleaved on --ranks 4"]


def test_zero_memory_fits_the_worse_step_and_shows_stage_3s_prefetch():
    """bench/zero_memory.py on 2 ranks, width 32: stage 3 alone prefetches, in its second step,
    which holds more; each stage's fit is of the worse of the two steps (the 3-layer model's:
    its rest plus 3 layers), its depth the budget's, its parameters a GPT of that depth's."""
    from mpi_run import check_mpi

    from minipar.models import GPT, GPTConfig

    budget_mb = 1
    out = check_mpi(2, BENCH.replace("step_time", "zero_memory"), "--n-embd", "32", "--budget-mb", str(budget_mb))
    lines = out.splitlines()

    def table(header, width):  # {stage: its numbers} of the 4 rows below the header line
        at = next(i for i, line in enumerate(lines) if line.split()[:len(header)] == header) + width
        return {int(line.split()[0]): [float(v.replace(",", "")) for v in line.split()[1:]] for line in lines[at:at + 4]}

    fit = table(["stage", "bytes/layer"], 2)
    steps = table(["stage", "step", "1"], 1)
    assert set(fit) == set(steps) == {0, 1, 2, 3}, out
    for stage in (0, 1, 2):
        assert steps[stage][2] == 0, out
    first, second, prefetched = steps[3]
    assert prefetched > 0 and second > first, out
    for stage, (per_layer, _, rest, depth, params) in fit.items():
        assert rest + 3 * per_layer == max(steps[stage][:2]), out
        assert depth == (budget_mb * 2**20 - rest) // per_layer >= 1, out
        config = GPTConfig(n_layer=int(depth), n_head=4, n_embd=32, block_size=16)  # zero_memory's model
        assert params == GPT(config).num_parameters(), out
