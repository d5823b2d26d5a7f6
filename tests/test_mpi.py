"""Communicators, the process grid and region collectives, each under mpiexec on several ranks."""

import os
import re
import subprocess
import sys
import sysconfig
import time

import pytest

from mpi_run import PYTHON, ROOT, check_mpi, run_mpi


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_communicator_operations(n):
    assert f"comm ops OK on {n} ranks" in check_mpi(n, "comm_ops.py")


@pytest.mark.parametrize("n,tp,pp,cp", [(8, 2, 2, 1), (8, 1, 4, 1), (4, 2, 1, 1), (4, 1, 1, 1), (2, 2, 1, 1),
                                        (8, 2, 1, 2)])
def test_process_grid_groups_match_the_rank_arithmetic(n, tp, pp, cp):
    assert "grid OK" in check_mpi(n, "grid.py", tp, pp, cp)


@pytest.mark.parametrize("n", [2, 4])
def test_region_collectives_match_the_serial_computation(n):
    assert f"region collectives OK on {n} ranks" in check_mpi(n, "region_collectives.py")


def test_a_failing_rank_ends_the_whole_job():
    code, out, seconds = run_mpi(4, "one_rank_fails.py", timeout=60)
    assert code != 0 and "rank 1 fails on purpose" in out
    assert seconds < 20, f"the job took {seconds:.1f} s to end"


def test_a_rank_failing_before_mpi_starts_ends_the_whole_job():
    code, out, seconds = run_mpi(4, "fails_before_mpi.py", timeout=60)
    assert code != 0 and "import of minipar.autograd halted" in out
    assert seconds < 20, f"the job took {seconds:.1f} s to end"


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_lesson(n):
    out = check_mpi(n, os.path.join(ROOT, "lessons", "00_collectives.py"), "--size", "30000")
    assert "equals MPI's all-reduce" in out


def test_ring_all_reduce_lesson_fails_on_a_planted_bug():
    code, out, _ = run_mpi(4, os.path.join(ROOT, "lessons", "00_collectives.py"), "--plant-bug")
    assert code != 0 and "MISMATCH" in out


def test_lesson_runs_under_a_hand_typed_mpirun():
    mpirun = os.path.join(sysconfig.get_path("scripts"), "mpirun")
    if not os.path.exists(mpirun):
        pytest.skip("no mpirun next to this Python (MPI not from the mpich wheel)")
    lesson = os.path.join(ROOT, "lessons", "00_collectives.py")
    code, out, _ = run_mpi(2, lesson, command=[mpirun, "-n", "2", PYTHON, lesson, "--size", "1000"])
    assert code == 0 and "equals MPI's all-reduce" in out, out


@pytest.mark.parametrize("args,message", [
    ([], "usage"),
    (["-n", "2"], "usage"),
    (["-n", "0", "x.py"], "positive number of ranks"),
    (["-n", "2", "missing.py"], "no such script"),
])
def test_launcher_usage_errors(args, message):
    code, out, _ = run_mpi(0, "", command=[os.path.join(ROOT, "run_mpi.sh"), *args], timeout=30)
    assert code == 2 and message in out


def test_comm_edge_checks():
    assert "comm checks OK on 4 ranks" in check_mpi(4, "comm_ops.py")


def test_oversubscribed_ranks_wait_politely():
    from minipar.comm.mpi import usable_cores

    out = check_mpi(8, "wait_mode.py")
    assert f"polite={8 > usable_cores()}" in out
    code, out, _ = run_mpi(2, "wait_mode.py", timeout=60,
                           command=["env", "MINIPAR_WAIT=polite", os.path.join(ROOT, "run_mpi.sh"),
                                    "-n", "2", os.path.join(ROOT, "tests", "mpi", "wait_mode.py")])
    assert code == 0 and "polite=True" in out


def test_minipar_wait_given_to_one_rank_only_is_agreed_on():
    """A hand-typed job that sets MINIPAR_WAIT for one rank alone: that rank skipped the node
    split (a collective) the other made, and both waited forever in different collectives."""
    script = os.path.join(ROOT, "tests", "mpi", "wait_mode.py")
    code, out, _ = run_mpi(2, "", timeout=60, command=["mpiexec", "-n", "1", "-env", "MINIPAR_WAIT", "polite",
                                                       sys.executable, script, ":", "-n", "1", sys.executable, script])
    assert code == 0 and "polite=True size=2 every rank polite: [1.0, 1.0]" in out, out


def test_one_rank_that_must_wait_politely_makes_every_rank_polite():
    """Rank 0 keeps a single core: it alone outnumbers its cores. Had rank 1 waited in MPI's
    blocking calls, the all-reduce that follows would never match rank 0's non-blocking one."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    out = check_mpi(2, "wait_mode.py", "--pin-rank-0", timeout=60)
    assert "polite=True size=2 every rank polite: [1.0, 1.0]" in out


def test_a_failing_rank_ends_a_hand_typed_mpirun_job_too():
    mpirun = os.path.join(sysconfig.get_path("scripts"), "mpirun")
    if not os.path.exists(mpirun):
        pytest.skip("no mpirun next to this Python (MPI not from the mpich wheel)")
    script = os.path.join(ROOT, "tests", "mpi", "one_rank_fails.py")
    code, out, seconds = run_mpi(4, script, command=[mpirun, "-n", "4", PYTHON, script], timeout=60)
    assert code != 0 and "rank 1 fails on purpose" in out
    assert seconds < 20, f"the job took {seconds:.1f} s to end"


def test_launcher_runs_modules_keeps_arguments_and_works_from_anywhere(tmp_path):
    launcher = os.path.join(ROOT, "run_mpi.sh")
    code, out, _ = run_mpi(2, "", command=[launcher, "-n", "2", "-m", "minipar.train", "--help"], timeout=60)
    assert code == 0 and out.count("usage: python -m minipar.train") == 1  # rank 0 speaks for all
    script = tmp_path / "args.py"
    script.write_text("import sys\nfrom minipar.comm import world\n"  # one write per line: no interleaving
                      "sys.stdout.write(f'{world().rank} {world().size} {sys.argv[1:]}\\n')\n")
    proc = subprocess.run([launcher, "-n", "2", "args.py", "a b", "$HOME", 'c"d'],
                                        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "0 2 ['a b', '$HOME', 'c\"d']" in proc.stdout and "1 2 ['a b'" in proc.stdout


def test_launcher_explains_a_python_without_mpi(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named mpi4py' >&2\nexit 1\n")
    fake.chmod(0o755)
    script = os.path.join(ROOT, "tests", "mpi", "comm_ops.py")
    code, out, _ = run_mpi(2, "", timeout=30, command=[
        "env", "-u", "PYTHON", f"PATH={tmp_path}:/usr/bin:/bin", os.path.join(ROOT, "run_mpi.sh"), "-n", "2", script])
    assert code == 2 and "No module named mpi4py" in out and 'pip install -e ".[dev]"' in out
    # PYTHON names the interpreter outright, whatever PATH holds (a machine with only python3)
    code, out, _ = run_mpi(2, "", timeout=30, command=[
        "env", f"PYTHON={fake}", os.path.join(ROOT, "run_mpi.sh"), "-n", "2", script])
    assert code == 2 and "No module named mpi4py" in out
    code, out, _ = run_mpi(2, "", timeout=30, command=[
        "env", f"PYTHON={tmp_path}/nothing", os.path.join(ROOT, "run_mpi.sh"), "-n", "2", script])
    assert code == 2 and f"no python at PYTHON={tmp_path}/nothing" in out


@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_layers_and_gpt_match_their_serial_twins(n):
    assert f"tensor parallel OK on {n} ranks" in check_mpi(n, "tensor_parallel.py", timeout=180)


LESSON_3 = os.path.join(ROOT, "lessons", "03_tensor_parallel.py")


@pytest.mark.parametrize("n,args", [(8, []), (8, ["--tp", "4"]), (4, ["--dtype", "float64"]), (1, [])])
def test_tensor_parallel_lesson(n, args):
    out = check_mpi(n, LESSON_3, *args, timeout=300)
    assert "equals the single-device GPT" in out and ("SP on" in out or n == 1)


def test_tensor_parallel_lesson_fails_on_a_planted_bug():
    code, out, _ = run_mpi(4, LESSON_3, "--plant-bug", timeout=300)
    assert code != 0 and "MISMATCH" in out


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_matches_the_single_device_run(n):
    assert f"data parallel OK on {n} ranks" in check_mpi(n, "data_parallel.py", timeout=180)


@pytest.mark.parametrize("n", [2, 4])
def test_zero_stages_match_the_single_device_run(n):
    assert f"zero OK on {n} ranks" in check_mpi(n, "zero.py", timeout=180)


@pytest.mark.parametrize("n", [3])  # 3: every stage pads its flat buffers
def test_mixed_precision_agrees_on_overflows_and_holds_the_papers_bytes(n):
    """One rank's overflow skips the step on every rank (state bit-identical, scale halved); bf16
    with fp32 masters holds 16P, 4P + 12P/N, 2P + 14P/N, 16P/N; float64 policy = float64 run."""
    assert f"mixed precision OK on {n} ranks" in check_mpi(n, "mixed_precision.py", timeout=120)


LESSON_2 = os.path.join(ROOT, "lessons", "02_data_parallel.py")
LESSON_5 = os.path.join(ROOT, "lessons", "05_zero.py")


@pytest.mark.parametrize("n,args", [(4, []), (4, ["--micro-batches", "2", "--bucket-kb", "16"]),
                                    (2, ["--dtype", "float64"])])
def test_data_parallel_lesson(n, args):
    out = check_mpi(n, LESSON_2, *args, timeout=300)
    assert "holds and sends what the formulas say" in out
    # the MFU line is there (its value is a timing: never checked)
    assert re.search(r"^MFU \d+\.\d%: [\d.]+ GFLOP per step in \d+ ms", out, re.M), out


@pytest.mark.parametrize("n,args", [(4, []), (2, ["--dtype", "float64"]),
                                    (3, ["--batch-size", "6", "--micro-batches", "2"])])
def test_zero_lesson(n, args):
    out = check_mpi(n, LESSON_5, *args, timeout=300)
    assert "Every stage equals the single-device run and holds and sends what the formulas say" in out


@pytest.mark.parametrize("lesson", [LESSON_2, LESSON_5])
def test_data_parallel_lessons_fail_on_a_planted_bug(lesson):
    code, out, _ = run_mpi(2, lesson, "--plant-bug", timeout=300)
    assert code != 0 and "MISMATCH" in out


LESSON_8 = os.path.join(ROOT, "lessons", "08_context_parallel.py")


def test_context_parallel_lesson():
    out = check_mpi(4, LESSON_8, timeout=300)
    assert "CP4 p2p" in out and "CP2xTP2 p2p" in out and "CP4 a2a" in out
    assert "Context parallelism equals the single-device run, and sends what the formulas say" in out


def test_context_parallel_lesson_fails_on_a_planted_bug():
    code, out, _ = run_mpi(4, LESSON_8, "--plant-bug", timeout=300)
    assert code == 1 and "PLANTED BUG" in out and "MISMATCH" in out


@pytest.mark.parametrize("bench,args,expected", [
    ("collectives.py", ["--max-size", "64K", "--rounds", "1"], "lowest throughput ratio"),
    ("collectives.py", ["--wrappers", "--rounds", "1"], "its Python alone"),
    ("waiting.py", ["--seconds", "0.2"], "polite"),
    ("zero_memory.py", ["--n-embd", "64", "--budget-mb", "16"], "deepest GPT"),
    ("sender_computes.py", ["--compute-ms", "20", "--sizes", "128K", "--repeats", "1"],
     "waited for the sender's compute"),
])
def test_benchmarks_run(bench, args, expected):
    assert expected in check_mpi(2, os.path.join(ROOT, "bench", bench), *args, timeout=300)


# Python runs a sitecustomize module found on PYTHONPATH as it starts, before the script: here it
# makes NumPy fail to import on rank 1 alone, as on a node where it is missing or broken.
BROKEN_NUMPY_ON_RANK_1 = """import os, sys
if "1" in (os.environ.get("PMI_RANK"), os.environ.get("OMPI_COMM_WORLD_RANK")):
    class BrokenNumPy:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "numpy":
                raise ImportError("numpy is broken on this node (planted by the test)")
    sys.meta_path.insert(0, BrokenNumPy())
"""


def test_a_rank_that_fails_before_numpy_loads_ends_the_job(tmp_path):
    """``import minipar`` starts MPI before NumPy (start.py), so one rank's failing import aborts
    the job. When the start still came after NumPy, rank 0 waited for rank 1 until killed."""
    (tmp_path / "sitecustomize.py").write_text(BROKEN_NUMPY_ON_RANK_1)
    script = tmp_path / "barrier.py"
    script.write_text("import minipar\nfrom minipar.comm import world\nworld().barrier()\nprint('past the barrier')\n")
    code, out, seconds = run_mpi(2, str(script), timeout=60, env={"PYTHONPATH": str(tmp_path)})
    assert code != 0 and "numpy is broken on this node" in out and "past the barrier" not in out, out
    assert seconds < 30, seconds


def test_an_uncaught_exception_names_the_rank_it_ended(tmp_path):
    """Every rank's traceback reads alike: the line before it says whose it is."""
    script = tmp_path / "raises.py"
    script.write_text("import minipar\nfrom minipar.comm import world\ncomm = world()\nif comm.rank == 1:\n"
                      "    raise ValueError('planted on one rank')\ncomm.barrier()\n")
    code, out, seconds = run_mpi(2, str(script), timeout=60)
    assert code != 0 and "rank 1 of 2 ends the job:\nTraceback" in out and "ValueError: planted" in out, out


# A rank that leaves training early without an error, as a bug could make it: the other waits in
# the step's collectives for a rank that is gone. (Without the watchdog the job spun until killed.)
STOPS_ON_RANK_1 = """import sys
from minipar import train, trainer
from minipar.comm import world

original = trainer.Trainer._start  # what the loop runs of each step


def start(self, it):
    if it == 2 and world().rank == 1:
        raise SystemExit(0)
    return original(self, it)


trainer.Trainer._start = start
sys.exit(train.main(sys.argv[1:]))
"""


def _watched(tmp_path, program, *flags):
    """``program`` (a script that makes a rank stop) run on 2 ranks of a tiny GPT under a 6 s watchdog."""
    script = tmp_path / "stops.py"
    script.write_text(program)
    return run_mpi(2, str(script), "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
                   "--batch-size", "4", "--sample", "0", "--plot", "", "--distributed-timeout-minutes", "0.1", *flags,
                   timeout=90)


def test_a_hang_ends_the_job_saying_which_iteration_and_where_each_rank_waits(tmp_path):
    code, out, seconds = _watched(tmp_path, STOPS_ON_RANK_1, "--max-iters", "50")
    assert code != 0 and re.search(r"python -m minipar.train: error: rank [01]: the step of iteration 2 has not "
                                   r"ended after 6 s \(--distributed-timeout-minutes 0.1\)", out), out
    assert "Where this rank is:" in out and 'File "' in out and seconds < 60, out


# rank 1 stops for good as the save of iteration 2 begins: the save never ends on any rank
STOPS_IN_A_SAVE = """import sys, time
from minipar import train
from minipar.checkpoint import sharded
from minipar.comm import world

original = sharded.save


def save(directory, iteration, *args):
    if iteration == 2 and world().rank == 1:
        time.sleep(600)
    return original(directory, iteration, *args)


sharded.save = save  # looked up at each save (train_checkpoints.py)
sys.exit(train.main(sys.argv[1:]))
"""


def test_a_save_that_hangs_says_whether_it_was_published(tmp_path):
    code, out, _ = _watched(tmp_path, STOPS_IN_A_SAVE, "--max-iters", "4", "--save", str(tmp_path / "ckpt"),
                            "--save-interval", "1")
    assert code != 0 and "the checkpoint of iteration 2 (not published: latest names the one before) has not " \
        "ended after 6 s" in out, out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pipe's unread bytes are asked of Linux (FIONREAD)")
def test_an_abort_waits_until_the_launcher_has_read_the_error():
    """The launcher reads a rank's output from a pipe; MPI_Abort while the error is still in the
    pipe would lose it. Here the "launcher" reads only after a pause: the wait must outlast it,
    and end when the pipe is empty, not at its limit. Nobody reading: it gives up at the limit."""
    import threading

    from minipar.start import let_output_through, unread_bytes

    read_end, write_end = os.pipe()
    os.write(write_end, b"rank 1: the error\n")
    got = []

    def launcher():
        time.sleep(0.3)
        got.append(os.read(read_end, 100))

    thread = threading.Thread(target=launcher)
    thread.start()
    assert let_output_through(limit=60.0, linger=0.0, fds=(write_end,)), "waited out its limit"
    assert unread_bytes(write_end) == 0, "returned before the launcher read the pipe"
    thread.join()
    assert got == [b"rank 1: the error\n"]
    os.write(write_end, b"nobody reads this\n")
    assert not let_output_through(limit=0.2, linger=0.0, fds=(write_end,)), "said it was read"
    assert unread_bytes(write_end) > 0
    os.close(read_end), os.close(write_end)


def test_the_abort_hook_survives_a_closed_stdout():
    """A rank started with its stdout closed has sys.stdout None: the wait before the abort must
    not raise, or the abort would never be called and the other ranks would wait forever."""
    code = ("import sys; sys.stdout = None; from minipar.start import let_output_through; "
            "let_output_through(limit=0.1, linger=0.0); print('returned', file=sys.stderr)")
    done = subprocess.run([PYTHON, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "returned" in done.stderr, done.stderr


def _files(folder, prefixes):
    return {n for n in os.listdir(folder) if n.startswith(prefixes)} if os.path.isdir(folder) else set()


def _segments():
    from minipar.comm.shm_orphans import PREFIXES, SHM_DIR

    return _files(SHM_DIR, PREFIXES)


def _topology_files():
    from minipar.comm.shm_orphans import TOPOLOGY_DIR, TOPOLOGY_PREFIX

    return _files(TOPOLOGY_DIR, TOPOLOGY_PREFIX)


def _age(folder, names, seconds=120):
    """Make files look ``seconds`` old: the cleanup leaves younger ones to jobs still starting."""
    for name in names:
        stamp = time.time() - seconds
        try:
            os.utime(os.path.join(folder, name), (stamp, stamp))
        except FileNotFoundError:  # another job on this host that ended meanwhile (and cleaned up)
            pass


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")
def test_a_dead_jobs_leftovers_are_removed_and_a_live_jobs_kept(tmp_path):
    """MPICH unlinks its /dev/shm segment in MPI_Finalize only, and its launcher its topology file
    in /tmp at a clean exit: an aborted job leaves both, the segment holding memory until reboot.
    shm_orphans removes them and must never touch a live job's. (Asserted on what remains, not on
    what one call found: another job's launcher on this host may clean up first.)"""
    from minipar.comm.shm_orphans import SHM_DIR, TOPOLOGY_DIR, orphans, remove_orphans, stale_topology_files

    before, topology_before = _segments(), _topology_files()
    code, out, _ = run_mpi(2, "one_rank_fails.py", timeout=60)
    assert code != 0, out
    dead, dead_topology = _segments() - before, _topology_files() - topology_before
    assert dead and dead_topology, "the aborted job left nothing: this MPI cleans up, and the test needs revisiting"
    assert not {os.path.basename(p) for p, _ in orphans()} & dead  # too young: a job starting may own it
    up, go = tmp_path / "up", tmp_path / "go"
    live = subprocess.Popen([os.path.join(sysconfig.get_path("scripts"), "mpiexec"), "-n", "2", PYTHON,
                             os.path.join(ROOT, "tests", "mpi", "holds_its_segment.py"), str(up), str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not up.exists() and live.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert up.exists(), "the live job did not start"
        held, held_topology = _segments() - before - dead, _topology_files() - topology_before - dead_topology
        assert held and held_topology, "the live job has nothing to protect"
        _age(SHM_DIR, dead | held)
        _age(TOPOLOGY_DIR, dead_topology | held_topology)
        # what other jobs on this host held is theirs: the live job's own are still there
        held, held_topology = held & _segments(), held_topology & _topology_files()
        found = {os.path.basename(path) for path, _ in orphans() + stale_topology_files()}
        assert not (held | held_topology) & found, (held, found)
        remove_orphans()
        assert not dead & _segments() and not dead_topology & _topology_files()
        assert held <= _segments() and held_topology <= _topology_files()
        go.touch()
        assert live.wait(timeout=60) == 0, live.stdout.read()
    finally:
        if live.poll() is None:
            os.killpg(live.pid, 9)
            live.wait()
    # run_mpi.sh removes what an earlier job left before it starts the next, saying nothing.
    run_mpi(2, "one_rank_fails.py", timeout=60)
    left = _segments() - before
    _age(SHM_DIR, left)
    code, out, _ = run_mpi(1, "wait_mode.py", timeout=60)
    assert left and code == 0 and not left & _segments() and "removed" not in out, out
