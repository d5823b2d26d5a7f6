"""Lessons are programs a reader runs: each must pass as shipped and fail when its subject breaks."""

import importlib
import importlib.util
import os
import re
import statistics
import subprocess
import sys

import numpy
import pytest

from mpi_run import check_mpi, run_mpi, run_together

from minipar.dtypes import as_dtype

NEEDS_NO_CUPY = pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                                   reason="CuPy is installed: --device cuda is not an error here")
LESSONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lessons")


def run_lesson(name, *args):
    return subprocess.run([sys.executable, os.path.join(LESSONS, name), *args],
                          capture_output=True, text=True, timeout=300)


# The single-process lessons' runs read by the tests below, ~4-8 s of one core each.
SOLO_RUNS = (("01_autograd.py",), ("01_autograd.py", "--plant-bug"), ("07_gemm_kernel.py",),
             ("07_gemm_kernel.py", "--plant-bug"))


@pytest.fixture(scope="module")
def solo_runs():
    """{(lesson, *args): its finished run} for SOLO_RUNS, side by side."""
    return run_together({run: [sys.executable, os.path.join(LESSONS, run[0]), *run[1:]] for run in SOLO_RUNS})


def test_autograd_lesson_passes(solo_runs):
    run = solo_runs["01_autograd.py",]
    assert run.returncode == 0, run.stdout + run.stderr
    passed = re.search(r"(\d+)/(\d+) checks passed", run.stdout)
    assert passed and passed.group(1) == passed.group(2) and int(passed.group(2)) > 60
    assert "control was caught" in run.stdout


def test_autograd_lesson_fails_on_a_planted_bug(solo_runs):
    """Every GPT row with a GELU between it and the loss fails, the LayerNorms' small gradients
    (~5e-5, 1e-9 off) too, which an atol of 1e-8 let pass; the rows after the last GELU stay ok
    (exercise 2)."""
    run = solo_runs["01_autograd.py", "--plant-bug"]
    assert run.returncode == 1
    assert "FAIL" in run.stdout and "MISMATCH" in run.stdout
    verdicts = dict(re.findall(r"^  (transformer\.\S+) .* (ok|FAIL)$", run.stdout, re.M))
    assert len(verdicts) == 28, run.stdout
    last = ("transformer.h.1.mlp.c_proj.", "transformer.ln_f.")  # no GELU after them
    assert {n for n, v in verdicts.items() if v == "ok"} == {n for n in verdicts if n.startswith(last)}, run.stdout
    assert verdicts["transformer.h.0.ln_1.bias"] == verdicts["transformer.h.1.ln_1.weight"] == "FAIL"


class OneRank:
    """What lesson.finish asks of a communicator, for one rank without MPI."""
    rank, size = 0, 1

    def all_reduce(self, array, op="sum"):
        return array

    def barrier(self):
        pass


def test_lesson_scaffolding_prints_the_table_and_exits_1_on_a_mismatch(monkeypatch, capsys):
    """Each row ends in its verdict, and a mismatch's last line names the rows that failed, with
    their columns (it once said "see the rows above", and no row was marked)."""
    monkeypatch.syspath_prepend(LESSONS)  # as a lesson script finds it: its folder first on sys.path
    lesson = importlib.import_module("lesson")
    runs = {"SP off": {"loss": 1e-7, "gradients (worst tensor)": 3e-5},
            "SP on": {"loss": 2e-7, "gradients (worst tensor)": 4e-7}}
    for failed, runs_shown, last in (
            (False, {None: runs["SP on"]}, "all equal"),
            (True, runs, "MISMATCH: see the rows above marked FAIL: gradients (worst tensor) [SP off]; bytes")):
        failures = lesson.failed_rows(1e-5, runs_shown) + ["bytes"] * failed
        assert bool(lesson.failed_rows(1e-5, runs_shown)) == failed
        code = lesson.finish(OneRank(), failures, lambda: lesson.print_errors(runs_shown, 1e-5, width=12), "all equal")
        out = capsys.readouterr().out
        assert code == int(failed) and out.endswith(f"\n\n{last}\n"), out
        assert "relative error against the single-device run (tolerance 1e-05)\n" in out
        assert ("SP off       SP on\n" in out) == failed  # a heading row only for named runs
    assert "  gradients (worst tensor)         3.0e-05     4.0e-07  FAIL\n" in out
    assert "  loss                             1.0e-07     2.0e-07  ok\n" in out
    assert lesson.failed_rows(1e-5, {None: {"loss": float("nan")}}, where=" (2.)") == [  # NaN: a mismatch
        "see the rows above marked FAIL (2.): loss"]
    assert lesson.failed_rows(1e-5, {}) == []  # no runs (lesson 4 with PipeDream-2BW alone): nothing failed


def test_a_lessons_batches_are_counted_against_the_host_when_it_runs_on_a_gpu(monkeypatch):
    """A lesson makes every step's batch on the host first; on a GPU only one is on the device.
    So many steps are refused for the host's memory, not for the GPU's."""
    monkeypatch.syspath_prepend(LESSONS)
    lesson = importlib.import_module("lesson")
    from minipar import backend
    from minipar.parallel.validate import RunConfig

    memories = {False: (80e9, 1, "free memory of the GPU"), True: (100e9, 8, "MemAvailable")}
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    monkeypatch.setattr(backend, "free_memory", lambda host=False: memories[host])
    run = RunConfig(world_size=8, global_batch=16, n_layer=4, n_head=4, n_embd=128, block_size=64, dtype="float32")
    names = {"n_layer": "--n-layer", "global_batch": "--batch-size"}
    assert lesson.memory_problems(run, names, 500_000) == []  # 8 ranks x 8.2 GB of batches: the host holds them
    (line,) = lesson.memory_problems(run, names, 1_000_000)  # 8 x 16.4 GB: it does not
    assert "of MemAvailable, which is 100.0 GB here for 8 ranks" in line and "fix: fewer --steps or fewer" in line
    monkeypatch.setattr(backend, "on_gpu", lambda: False)  # a CPU: the same batches in the device's memory
    monkeypatch.setattr(backend, "free_memory", lambda host=False: (24e9, 8, "MemAvailable"))
    assert "fix: fewer --steps" in lesson.memory_problems(run, names, 500_000)[0]


class Broadcasts:
    """Rank ``rank`` of ``size`` whose broadcasts from another rank receive what that rank sent
    (``sent``, shared by the ranks): ranks of one job, run one after the other."""

    def __init__(self, rank, sent, size=2):
        self.rank, self.sent, self.size = rank, sent, size

    def broadcast(self, x, root=0):
        assert self.size > 1, "a world of one has no one to broadcast to"
        if self.rank == root:
            self.sent.append(x.copy())
        else:
            source = self.sent.pop(0)
            assert x.shape == source.shape and x.dtype == source.dtype, (x.shape, x.dtype, source.shape, source.dtype)
            x[...] = source
        return x


@pytest.mark.parametrize("root", [0, 1])
def test_computed_once_sends_the_roots_tree_to_the_other_ranks(monkeypatch, root):
    """Arrays of every dtype a lesson holds (bfloat16 too), 0-d and empty ones, numbers, NaN, None,
    strings and tuples, in dicts and lists: every rank, the root too, gets them equal, in their
    dtypes, as arrays of its own; the same on a world of one, which broadcasts nothing."""
    monkeypatch.syspath_prepend(LESSONS)
    computed_once = importlib.import_module("computed_once").computed_once
    rng = numpy.random.default_rng(0)
    tree = {"losses": [5.5, float("nan"), 1 / 3], "logits": rng.standard_normal((2, 3, 5)).astype(numpy.float32),
            "params": {"h.0.w": rng.standard_normal((4, 3)), "tiny": numpy.array(2.5),
                       "none": numpy.zeros((0, 7), numpy.int64), "half": numpy.arange(6).astype(as_dtype("bfloat16"))},
            "routing": {"layers": (1, 3), "tokens": numpy.arange(6).reshape(2, 3), "aux": numpy.float32(0.25),
                        "dropped": numpy.int64(3)},
            "nothing": None, "name": "ref", "view": rng.standard_normal((6, 4))[:, 1::2]}

    def same(a, b):
        if isinstance(b, dict):
            assert type(a) is dict and list(a) == list(b)
            return all(same(a[k], b[k]) for k in b)
        if isinstance(b, (list, tuple)):
            return type(a) is list and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(b, numpy.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and a.flags.owndata and a is not b
            return numpy.array_equal(a.reshape(-1).view(numpy.uint8), b.reshape(-1).copy().view(numpy.uint8))  # bits
        if isinstance(b, numpy.generic):
            return type(a) is type(b.item()) and a == b.item()
        return type(a) is type(b) and (a == b or (a != a and b != b))

    sent, calls = [], []
    ranks = sorted((0, 1), key=lambda r: r != root)  # the root first: it fills ``sent``
    got = {r: computed_once(Broadcasts(r, sent), lambda: calls.append(1) or tree, root=root) for r in ranks}
    assert calls == [1] and not sent and all(same(got[r], tree) for r in ranks)
    assert same(computed_once(Broadcasts(0, [], size=1), lambda: tree), tree)
    for size in (1, 2):  # refused alike on one rank and on two
        with pytest.raises(TypeError, match="string keys"):
            computed_once(Broadcasts(0, [], size=size), lambda: {1: numpy.ones(2)})


def test_lesson_4s_activation_formulas_equal_the_simulator(monkeypatch):
    """The "activations held" column of lesson 4, formula by formula, against the simulator's
    count, for every schedule it runs (1F1B-slack only on request, so no MPI test reaches it)."""
    monkeypatch.syspath_prepend(LESSONS)
    formulas = importlib.import_module("pipeline_formulas")
    from minipar.parallel.pipeline import schedules
    from minipar.parallel.pipeline.simulate import simulate
    for name in ("gpipe", "1f1b", "1f1b-slack", "interleaved", "zb-h1", "zb-h2", "zb-v"):
        v = 2 if name in ("interleaved", "zb-v") else 1
        for p, m in ((2, 4), (4, 8), (3, 2)):
            if name == "interleaved" and m % p:
                continue
            sim = simulate(schedules.build(name, p, m, v), m, v, shape=schedules.shape_of(name),
                           **formulas.unit_costs(name))
            held, _ = formulas.held(name, p, m, v)
            assert held in (None, [sim.peak_alive[r] for r in range(p)]), (name, p, m, held, sim.peak_alive)


def test_gemm_kernel_lesson_passes(solo_runs):
    run = solo_runs["07_gemm_kernel.py",]
    assert run.returncode == 0, run.stdout + run.stderr
    assert "naive    33,554,432 elements" in run.stdout and "tiled       262,144 elements" in run.stdout
    assert "without the first __syncthreads(): relative error" in run.stdout
    assert "128x fewer loads" in run.stdout
    assert "bfloat16  float32 accumulator" in run.stdout  # section 5: the 16-bit inputs' bound held


def test_gemm_kernel_lesson_fails_on_a_planted_bug(solo_runs):
    """Every section keeps its heading when the emulator stops the kernel (1 and 2 once lost theirs),
    and the last line names the sections that failed."""
    run = solo_runs["07_gemm_kernel.py", "--plant-bug"]
    assert run.returncode == 1 and "MISMATCH: sections 1, 2, 3, 4, 5 failed" in run.stdout, run.stdout + run.stderr
    walk, loads = run.stdout.index("1. One thread's walk"), run.stdout.index("2. Loads from global memory")
    assert walk < run.stdout.index("the kernel was stopped") < loads, run.stdout


# Every MPI lesson runs with its defaults at 2, 4 and 8 ranks (lesson 6 also at 16, by hand: too
# many ranks for CI's two cores). Each case below once ended in a traceback from every rank;
# the rest are covered by each lesson's own tests.

@pytest.mark.parametrize("lesson,ranks,args,verdict", [
    # padding sent in each of stage 3's 24 passes: 342 bytes, where a bound of 3 passes allowed 160
    ("05_zero.py", 3, ["--batch-size", "24", "--micro-batches", "8", "--steps", "1", "--n-layer", "1"],
     "Every stage equals the single-device run"),
    # a scale of 1 cannot be halved below the scaler's floor of 1: the check expected 0.5
    ("10_mixed_precision.py", 2, ["--fp16-initial-scale", "1", "--plot", "", "--steps", "2", "--overflow-step", "1",
                                  "--n-layer", "1"], "scale 1 -> [1.0]"),
])
def test_valid_flags_an_audit_found_reported_as_mismatches_now_pass(lesson, ranks, args, verdict):
    assert verdict in check_mpi(ranks, os.path.join(LESSONS, lesson), *args, timeout=120)


def test_3d_lesson_defaults_fit_two_ranks():
    out = check_mpi(2, os.path.join(LESSONS, "06_3d_parallel.py"), timeout=180)
    assert "2 ranks as TP=1 x DP=1 x PP=2" in out and "equals the single-device run" in out


@pytest.mark.parametrize("lesson,args,message,lines", [
    ("04_pipeline_parallel.py", ["--pp", "3"], "2 ranks do not split into TP x PP = 1 x 3 groups", 4),  # v = 1 and 2
    ("04_pipeline_parallel.py", ["--virtual-stages", "3"], "--n-layer 8 is not divisible by --pp x --virtual-stages = 2 x 3", 1),
    ("04_pipeline_parallel.py", ["--schedule", "gpipe", "--virtual-stages", "3"],  # once ignored
     "--virtual-stages 3 is the interleaved schedule's chunks per rank, and --schedule gpipe places one", 1),
    ("06_3d_parallel.py", ["--tp", "2", "--pp", "2"], "2 ranks do not split into TP x PP = 2 x 2 groups", 1),
    ("02_data_parallel.py", ["--micro-batches", "3"], "--batch-size 8 does not split into --micro-batches 3", 1),
    ("05_zero.py", ["--steps", "two"], "argument --steps: invalid int value: 'two'", 1),  # argparse's own
    ("08_context_parallel.py", ["--block-size", "30"], "--block-size 30 is not divisible by 4", 1),
    ("08_context_parallel.py", ["--cp-comm-type", "a2a", "--n-head", "3", "--n-embd", "48"],
     "--n-head 3 is not divisible by TP x CP = 2", 1),
    ("04_pipeline_parallel.py", ["--schedule", "zb"], "--schedule zb is not a pipeline schedule", 1),
    ("04_pipeline_parallel.py", ["--defer-embedding-wgrad-compute"], "add --schedule with one of gpipe, 1f1b", 1),
    ("04_pipeline_parallel.py", ["--schedule", "1f1b", "--defer-wgrad-linears", "2"],
     "--defer-wgrad-linears 2 parks linear layers' weight gradients beside the head's", 1),
    ("04_pipeline_parallel.py", ["--defer-embedding-wgrad-compute", "--schedule", "zb-h2"],
     "--schedule zb-h2 already runs every weight gradient apart (W)", 1),
    ("09_mixture_of_experts.py", ["--topk", "9"], "--topk 9 exceeds --num-experts 8", 1),
    ("09_mixture_of_experts.py", ["--ep", "4"], "--ep 4 does not divide DP=2", 1),
    ("10_mixed_precision.py", ["--overflow-step", "99"], "--overflow-step 99 is not one of the 12 steps", 1),
    ("06_3d_parallel.py", ["--n-layer", "3"], "--n-layer 3 is not divisible by --pp x --virtual-stages", 1),
    ("06_3d_parallel.py", ["--schedule", "interleaved", "--micro-batches", "3"],
     "the interleaved schedule runs micro-batches in groups of --pp", 2),
    ("02_data_parallel.py", ["--seed", "-1"], "--seed must be >= 0, got -1", 1),  # these four: once tracebacks
    ("09_mixture_of_experts.py", ["--aux-loss-coeff", "nan"], "must be finite and >= 0", 1),
    ("10_mixed_precision.py", ["--fp16-initial-scale", "0"], "--fp16-initial-scale must be finite and >= 1, got 0.0", 1),
    ("06_3d_parallel.py", ["--schedule", "zb-v", "--virtual-stages", "3"], "it needs --virtual-stages 2, got 3", 2),
    ("11_which_parallelism.py", ["--steps", "0", "--require-spearman", "nan"], "a rank correlation lies in [-1, 1]", 2),
    ("08_context_parallel.py", ["--cp", "0"], "--cp must be a positive integer, got 0", 1),  # once taken as the default
    # sizes far beyond the machine: once a MemoryError traceback from every rank
    ("03_tensor_parallel.py", ["--n-embd", "65536"], "fix: fewer --n-layer or a smaller --n-embd", 1),
    ("02_data_parallel.py", ["--batch-size", "100000000"], "fix: a smaller --batch-size", 1),
    ("02_data_parallel.py", ["--steps", "1000000000000"], "fix: fewer --steps", 1),  # every batch is made first
    ("03_tensor_parallel.py", ["--block-size", "1000000000000"], "a smaller --block-size", 1),
    ("00_collectives.py", ["--size", "1000000000000"], "fix: a smaller --size", 1),
    ("08_context_parallel.py", ["--tp", "2", "--cp-comm-type", "a2a"],  # ran as "CP1 a2a", sending nothing
     "--cp-comm-type a2a is how context-parallel ranks communicate, and CP is 1 here", 1),
    ("10_mixed_precision.py", ["--dtype", "float64"], "invalid choice: 'float64' (choose from 'float32')", 1),
    ("11_which_parallelism.py", ["--dtype", "float64"], "invalid choice: 'float64' (choose from 'float32')", 1),
    # --steps alone: the default overflow step named (it once refused an --overflow-step never given)
    ("10_mixed_precision.py", ["--steps", "1"], "--steps 1: section 3 plants an overflow at step 2 (--overflow-step's", 1),
    # one stage: once a TypeError from the report
    ("04_pipeline_parallel.py", ["--pp", "1", "--schedule", "1f1b"], "--pp 1 is one stage, not a pipeline", 1),
    ("06_3d_parallel.py", ["--schedule", "pipedream-2bw"], "lesson 4 runs it", 1),  # once: "it needs zero_stage=0"
    # planted bugs that cannot show in these layouts, which once passed
    ("03_tensor_parallel.py", ["--tp", "1", "--plant-bug"], "TP=1 runs no sequence parallelism: give --tp 2", 1),
    ("09_mixture_of_experts.py", ["--ep", "2", "--num-experts", "2", "--plant-bug"], "EP=2 with 2 experts gives no such rank", 1),
    ("04_pipeline_parallel.py", ["--out", "/dev/null"], "--out /dev/null: /dev/null is a file, not a folder", 1),
    ("10_mixed_precision.py", ["--plot", "/dev/null/loss.png"], "/dev/null is a file, not a folder", 1),  # once after the run
    pytest.param("02_data_parallel.py", ["--device", "cuda"], "--device cuda: the cuda device needs CuPy", 1,
                 marks=NEEDS_NO_CUPY),  # once a traceback from every rank, after the flags were agreed
])
def test_bad_flags_are_one_line_each_from_one_rank_before_any_message(lesson, args, message, lines):
    """Every lesson validates its flags through minipar.parallel.validate and minipar.cli: each
    problem one line, printed once (by one rank), exit status 2, no traceback and no usage text."""
    code, out, _ = run_mpi(2, os.path.join(LESSONS, lesson), *args, timeout=60)
    errors = [line for line in out.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == lines == len(set(errors)) and "Traceback" not in out, out
    assert sum(message in e for e in errors) == 1 and "usage:" not in out, out


@NEEDS_NO_CUPY
@pytest.mark.parametrize("script", ["01_autograd.py", "07_gemm_kernel.py"])
def test_single_process_lessons_refuse_a_missing_gpu_in_one_line(script):
    run = run_lesson(script, "--device", "cuda")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stdout + run.stderr
    assert run.stderr.count("error: --device cuda:") == 1 and run.stdout == "", run.stdout + run.stderr


def test_mixed_precision_lesson_passes_and_fails_on_a_planted_bug(tmp_path):
    """Lesson 10 at 2 ranks: the bytes by stage and precision, the three curves, the planted
    overflow skipped everywhere, the float64 policy exact; --plant-bug (each rank trusts its own
    overflow check) must fail."""
    lesson = os.path.join(LESSONS, "10_mixed_precision.py")
    out = check_mpi(2, lesson, "--steps", "6", "--plot", str(tmp_path / "curves.png"), timeout=120)
    assert "skipped on 2 of 2 ranks; state unchanged on 2" in out and "0 of 28 tensors differ" in out, out
    assert os.path.exists(tmp_path / "curves.png")
    code, out, _ = run_mpi(2, lesson, "--steps", "4", "--plot", "", "--plant-bug", timeout=120)
    assert code == 1 and "skipped on 1 of 2 ranks" in out and "MISMATCH" in out, out


@pytest.mark.parametrize("lesson,args,message", [
    ("00_collectives.py", ["--plant-bug"], "one rank's ring has no steps: run it on 2 or more ranks"),
    ("02_data_parallel.py", ["--plant-bug"], "with one rank those are its rows: run it on 2 or more ranks"),
    ("05_zero.py", ["--plant-bug"], "with one rank those are the global rows: run it on 2 or more ranks"),
    ("09_mixture_of_experts.py", ["--plant-bug"], "EP=1 with 8 experts gives no such rank"),
    ("10_mixed_precision.py", ["--plant-bug"], "one rank's decision is every rank's: run it on 2 or more ranks"),
    ("11_which_parallelism.py", ["--plant-bug"], "1 rank(s) have no layout with TP > 1"),
    ("04_pipeline_parallel.py", ["--schedule", "gpipe"], "a pipeline needs 2 or more stages, a rank each"),
])
def test_what_one_rank_cannot_show_is_refused_in_one_line(lesson, args, message):
    """A planted bug that one rank cannot show (each of these exited 0), and a pipeline of one
    stage (a TypeError from the report): one line, exit status 2, before any run."""
    code, out, _ = run_mpi(1, os.path.join(LESSONS, lesson), *args, timeout=60)
    errors = [line for line in out.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in out, out


@pytest.mark.parametrize("script", ["01_autograd.py", "07_gemm_kernel.py"])
def test_single_process_lessons_refuse_several_ranks_in_one_line(script):
    """Every rank ran the whole lesson and printed it, interleaved with the others."""
    code, out, _ = run_mpi(2, os.path.join(LESSONS, script), timeout=60)
    errors = [line for line in out.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "this lesson runs in one process, and 2 ranks started it" in errors[0], out
    assert "checks passed" not in out and "One thread's walk" not in out, out


def test_a_planted_bug_names_the_rows_that_failed():
    """Lesson 6's planted bug at 2 ranks (PP = 2): each failing row marked, and named last (the
    lessons once ended a mismatch with "see the rows above", no row marked)."""
    code, out, _ = run_mpi(2, os.path.join(LESSONS, "06_3d_parallel.py"), "--plant-bug", "--steps", "2", timeout=120)
    assert code == 1 and re.search(r"^  gradients \(worst tensor\) +\S+  FAIL$", out, re.M), out
    assert "\nMISMATCH: see the rows above marked FAIL: loss (worst step), gradients (worst tensor), parameters " \
        "after 2 steps\n" in out, out


def test_lesson_11_ranks_only_the_layouts_its_measurement_tells_apart(monkeypatch):
    """Three layouts within 2% of each other (as at 2 ranks) have no measured order, so the
    predicted one stands among them, whatever order the noise put them in; layouts measured far
    apart and predicted the wrong way round still fail the ranking."""
    monkeypatch.syspath_prepend(LESSONS)
    which = importlib.import_module("11_which_parallelism")
    rounds = [[10.0, 10.0, 10.1], [10.1, 10.1, 10.2], [10.2, 10.2, 10.0], [20.0, 21.0, 20.5], [40.0, 41.0, 39.0]]
    predicted = [3.0, 2.0, 1.0, 4.0, 5.0]  # the three close ones predicted in reverse
    places, groups = which.measured_order(rounds, predicted)
    assert groups[1:] == [[3], [4]] and sorted(groups[0]) == [0, 1, 2]
    assert places == [2, 1, 0, 3, 4] and which.spearman(places, predicted) == 1.0
    assert which.spearman([statistics.median(r) for r in rounds], predicted) == pytest.approx(0.6)  # what once failed the lesson
    swapped = [3.0, 2.0, 1.0, 5.0, 0.5]  # the slowest layout predicted the fastest: a real misprediction
    places, _ = which.measured_order(rounds, swapped)
    assert which.spearman(places, swapped) < 0.8
    # eight layouts each 8% slower than the one before (1.7x end to end), predicted in reverse: no
    # two neighbours are told apart, but the group ends where its first one is, and the order fails
    chain = [[10.0 * 1.08**k * f for f in (0.99, 1.0, 1.01)] for k in range(8)]
    backwards = [8.0 - k for k in range(8)]
    places, groups = which.measured_order(chain, backwards)
    assert len(groups) > 1 and which.spearman(places, backwards) < 0.8
