"""Every rank reads the same checkpoint and corpus, and one run writes a save directory: the
adversary's cases (``minipar/run_inputs.py``, ``minipar/checkpoint/lock.py``)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from types import SimpleNamespace

import pytest
from mpi_run import ROOT, run_mpi
from test_train import TINY, reseal, saved_index, train

from minipar import run_inputs
from minipar.checkpoint.lock import SaveDirectoryBusy, SaveLock
from minipar.cli import FlagError
from minipar.data import Dataset
from minipar.lr_schedule import learning_rate


def one_line(run, message):
    lines = run.stderr.strip().splitlines()
    return run.returncode == 2 and len(lines) == 1 and message in lines[0]


def test_a_save_directory_has_one_writer_and_a_crash_frees_it(tmp_path, corpus):
    save = str(tmp_path / "ckpt")
    holder = subprocess.Popen([sys.executable, "-c", f"from minipar.checkpoint.lock import SaveLock\n"
                               f"SaveLock({save!r}).acquire(); print('held', flush=True)\n"
                               "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        run = train(*TINY, "--data", corpus, "--max-iters", "2", "--save", save)
        assert one_line(run, f"--save {save} is in use by another run (pid {holder.pid} on "), run.stderr
        with pytest.raises(SaveDirectoryBusy):
            SaveLock(save).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no clean-up runs
        holder.wait()
    SaveLock(save).acquire().release()  # the kernel dropped the dead run's lock
    assert train(*TINY, "--data", corpus, "--max-iters", "2", "--save", save).returncode == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")
def _open_on(path):
    """How many of this process's descriptors are open on ``path`` (not a count of all of them,
    which a garbage collection of an earlier test's files could change meanwhile)."""
    fds = "/proc/self/fd"
    found = 0
    for fd in os.listdir(fds):
        try:
            found += os.readlink(os.path.join(fds, fd)) == os.path.realpath(path)
        except OSError:  # closed since listed (the listing's own descriptor among them)
            pass
    return found


def test_a_refused_lock_keeps_no_descriptor_and_a_released_one_is_free_at_once(tmp_path):
    """In one process: a second SaveLock on a held directory is refused (flock locks belong to the
    open file, not the process) without leaking its descriptor; ``release`` frees the directory for
    the next run; the holder's line replaces whatever the lock file held before."""
    save = str(tmp_path / "ckpt")
    os.makedirs(save)
    with open(os.path.join(save, ".lock"), "w") as f:
        f.write("pid 1 on a host whose name was far longer than this one's, since long ago\n" * 3)
    held = SaveLock(save).acquire()
    with open(os.path.join(save, ".lock")) as f:
        lines = f.read().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pid {os.getpid()} on "), lines
    with pytest.raises(SaveDirectoryBusy, match=f"in use by another run \\(pid {os.getpid()} on [^,]*, since [^)]*\\)"):
        SaveLock(save).acquire()
    assert _open_on(os.path.join(save, ".lock")) == 1  # the holder's: the refused attempt closed its own
    held.release()
    SaveLock(save).acquire().release()


def test_a_run_does_not_write_over_checkpoints_it_does_not_continue(tmp_path, corpus):
    save = str(tmp_path / "ckpt")
    assert train(*TINY, "--data", corpus, "--max-iters", "4", "--save", save).returncode == 0
    other_model = train(*TINY, "--data", corpus, "--max-iters", "2", "--n-embd", "32", "--save", save)
    assert one_line(other_model, f"--save {save} already holds checkpoints (iter_0000004) that this run "
                                 "does not continue"), other_model.stderr
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "iter_0000004"  # latest did not move backwards
    told = train(*TINY, "--data", corpus, "--max-iters", "2", "--save", save, "--overwrite-checkpoints")
    assert told.returncode == 0, told.stderr
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "iter_0000002"


def test_a_resume_from_an_older_checkpoint_keeps_the_newer_ones(tmp_path, corpus):
    """Its checkpoints at the newer ones' iterations would replace them (and --keep-checkpoints
    prune them), holding other training: refused unless --overwrite-checkpoints says so. Nor may
    an output land on a checkpoint's files."""
    save = str(tmp_path / "ckpt")
    assert train(*TINY, "--data", corpus, "--max-iters", "4", "--save", save, "--save-interval", "2").returncode == 0
    older = os.path.join(save, "iter_0000002")
    run = train(*TINY, "--data", corpus, "--max-iters", "4", "--load", older, "--save", save)
    assert one_line(run, f"--load {older} is not the newest checkpoint of --save {save} (iter_0000004 came after "
                         "it)"), run.stderr
    log, index = saved_index(save, 4)
    run = train(*TINY, "--data", corpus, "--max-iters", "6", "--load", save, "--save", save, "--log-json", log,
                "--override-opt_param-scheduler")
    assert one_line(run, f"--log-json {log} would write into the checkpoints of --save {save}"), run.stderr
    assert saved_index(save, 4)[1] == index
    best = os.path.join(save, "best")  # a copy under another name: its iteration is its index's
    shutil.copytree(older, best)
    with pytest.raises(FlagError, match=r"--load \S+best is not the newest checkpoint of --save \S+ \(iter_0000004 came"):
        run_inputs.claim_save_directory(SimpleNamespace(save=save, load=best, overwrite_checkpoints=False), 0)
    told = train(*TINY, "--data", corpus, "--max-iters", "4", "--load", older, "--save", save, "--exit-interval", "3",
                 "--overwrite-checkpoints")
    assert told.returncode == 0, told.stderr
    # latest is now iter_3: the abandoned iter_4 beyond it is no newer checkpoint to refuse for
    again = train(*TINY, "--data", corpus, "--max-iters", "4", "--load", save, "--save", save)
    assert again.returncode == 0, again.stderr


def test_a_resume_from_a_checkpoint_put_aside_as_old_continues_it(tmp_path):
    """``find`` resolves ``latest`` to ``iter_N.old`` where a save of the same iteration stopped
    between its two renames: its iteration is N, not a name to refuse (it raised a ValueError)."""
    for name in ("iter_0000002", "iter_0000004.old"):
        os.makedirs(tmp_path / name)
    args = SimpleNamespace(save=str(tmp_path), load=str(tmp_path / "iter_0000004.old"), overwrite_checkpoints=False)
    run_inputs.claim_save_directory(args, 0).release()


def test_a_resume_on_another_corpus_is_refused(tmp_path, corpus):
    save, other = str(tmp_path / "ckpt"), tmp_path / "other.txt"
    other.write_text(open(corpus).read() + "x")
    assert train(*TINY, "--data", corpus, "--max-iters", "2", "--save", save).returncode == 0
    run = train(*TINY, "--data", str(other), "--max-iters", "4", "--load", save)
    assert one_line(run, "--load: the checkpoint was trained on a corpus of "), run.stderr
    assert "the data would differ from the run it continues" in run.stderr


def test_ranks_launched_with_different_flags_all_stop_in_one_line(tmp_path):
    code, out, _ = run_mpi(3, "run_inputs.py", "flags", tmp_path, timeout=60)
    line = ("run_inputs: error: rank 1 was launched with other flags than rank 0 (--seed 7, rank 0's 1; "
            "--zero-stage 1, rank 0's 0): launch every rank with the same command line")
    assert code == 2 and out.count(line) == 1 and "loads" not in out, out


def test_ranks_that_found_other_checkpoints_all_take_rank_0s_schedule(tmp_path, corpus):
    """--use-checkpoint-opt_param-scheduler while `latest` moves as the job starts: each rank read
    another checkpoint (here each its own folder, saved with another --lr). Every rank goes on with
    rank 0's, its schedule included; each taking its own used to read as launched with other flags."""
    for lr in ("0.01", "0.02"):
        assert train(*TINY, "--data", corpus, "--max-iters", "4", "--exit-interval", "2", "--lr", lr,
                     "--save", str(tmp_path / lr)).returncode == 0
    log = str(tmp_path / "log.jsonl")
    rank = [sys.executable, "-m", "minipar.train", *TINY, "--data", corpus, "--max-iters", "4",
            "--use-checkpoint-opt_param-scheduler", "--log-json", log, "--load"]
    code, out, _ = run_mpi(2, "", timeout=120, command=["mpiexec", "-n", "1", *rank, str(tmp_path / "0.01"), ":",
                                                        "-n", "1", *rank, str(tmp_path / "0.02")])
    assert code == 0 and "resuming at iteration 2" in out, out
    with open(log) as fh:
        rates = [json.loads(line)["lr"] for line in fh]
    schedule = SimpleNamespace(lr=0.01, min_lr=3e-4, warmup_iters=50, lr_decay_iters=4)
    assert rates == [learning_rate(it, schedule) for it in (2, 3)]


def test_ranks_that_read_different_corpora_all_stop_in_one_line(tmp_path):
    code, out, _ = run_mpi(4, "run_inputs.py", "corpus", tmp_path, timeout=60)
    assert code == 2 and out.count("run_inputs: error: --data (default corpus): rank 1 read 1,151 bytes") == 1, out
    assert "loads" not in out  # no rank went on


@pytest.mark.parametrize("mode, message", [
    ("weights", "--init-weights {}/copy_on_host_2.safetensors: rank 2 loaded other weights than rank 0"),
    ("no-weights", "rank 2 was launched without --init-weights, rank 0 with")])
def test_ranks_that_loaded_different_initial_weights_all_stop_in_one_line(tmp_path, mode, message):
    """Compared by content: rank 1's equal copy under another name is no problem (the lowest rank
    with a problem is the one that prints)."""
    code, out, _ = run_mpi(3, "run_inputs.py", mode, tmp_path, timeout=60)
    assert code == 2 and out.count("run_inputs: error: " + message.format(tmp_path)) == 1, out
    assert out.count("error:") == 1 and "loads" not in out, out


def _rank_1_against(monkeypatch, rank_0_args, rank_0_data):
    """same_inputs as rank 1 sees it, rank 0's facts broadcast from ``rank_0_*`` (no MPI)."""
    text = json.dumps(run_inputs._facts(rank_0_args, rank_0_data, None))
    monkeypatch.setattr(run_inputs, "broadcast_text", lambda comm, mine, root=0: text)
    return lambda args, data: run_inputs.same_inputs(SimpleNamespace(rank=1), args, data)


def test_corpora_of_the_same_length_are_compared_by_content(monkeypatch):
    args = SimpleNamespace(data="corpus.txt", load=None, seed=1)
    one, other = Dataset(b"abcd" * 100), Dataset(b"abce" * 100)
    problems = _rank_1_against(monkeypatch, args, one)(args, other)
    assert len(problems) == 1 and problems[0].startswith("--data corpus.txt: rank 1 read 400 bytes"), problems
    assert run_inputs.corpus_matches([one.size, one.sha256], other, "--data x").startswith("--load: the checkpoint")
    assert run_inputs.corpus_matches([one.size, one.sha256], one, "--data x") is None


def test_ranks_that_loaded_different_tokenizers_are_refused(monkeypatch):
    """--tokenizer is compared by its files' bytes (the SHA-256 the tokenizer keeps): ranks whose
    hosts hold other vocabularies under the same path would train on different token ids."""
    from minipar.tokenizer import BPETokenizer

    def tokenizer(sha256):  # as train_sources leaves it in args.tokenizer, its files already read
        made = BPETokenizer.__new__(BPETokenizer)
        made.sha256 = sha256
        return made

    data = Dataset(b"x" * 10)
    rank_0 = SimpleNamespace(data=None, load=None, seed=1, tokenizer=tokenizer("a" * 64))
    check = _rank_1_against(monkeypatch, rank_0, data)
    assert check(SimpleNamespace(data=None, load=None, seed=1, tokenizer=tokenizer("a" * 64)), data) == []
    problems = check(SimpleNamespace(data=None, load=None, seed=1, tokenizer=tokenizer("b" * 64)), data)
    assert len(problems) == 1 and problems[0].startswith("rank 1 was launched with other flags than rank 0 "
                                                         "(--tokenizer {'tokenizer sha256': 'bbbb"), problems


def test_a_rank_that_reads_another_index_of_the_checkpoint_is_refused(monkeypatch, tmp_path):
    (tmp_path / "index.json").write_text('{"iteration": 2}')
    args, data = SimpleNamespace(data=None, load=str(tmp_path), seed=1), Dataset(b"x" * 10)
    check = _rank_1_against(monkeypatch, args, data)
    assert check(args, data) == []
    (tmp_path / "index.json").write_text('{"iteration": 4}')  # this host's copy differs
    problems = check(args, data)
    assert len(problems) == 1 and "--load: rank 1 does not see the checkpoint rank 0 loads" in problems[0], problems


def test_the_trainer_compares_the_initial_weights_each_rank_loaded(tmp_path):
    """Through minipar.train: copies under two names train; a copy one number apart stops the job."""
    import numpy

    from minipar.checkpoint import save_weights
    from minipar.models import GPT, GPTConfig

    weights = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16)).state_dict()
    save_weights(weights, str(tmp_path / "w0.safetensors"))
    save_weights(weights, str(tmp_path / "w1.safetensors"))
    flags = [*TINY, "--max-iters", "1", "--init-weights", str(tmp_path / "w{rank}.safetensors")]
    code, out, _ = run_mpi(2, "train_per_rank.py", *flags, timeout=120)
    assert code == 0 and "iter     0" in out, out
    weights["transformer.wte.weight"][3, 2] += numpy.float32(1e-3)
    save_weights(weights, str(tmp_path / "w1.safetensors"))
    code, out, _ = run_mpi(2, "train_per_rank.py", *flags, timeout=120)
    assert code == 2 and "rank 1 loaded other weights than rank 0" in out and "iter" not in out, out


def test_every_rank_loads_the_checkpoint_rank_0_resolved(tmp_path, corpus):
    save = str(tmp_path / "ckpt")
    assert train(*TINY, "--data", corpus, "--max-iters", "4", "--save-interval", "2", "--save", save).returncode == 0
    code, out, _ = run_mpi(4, "run_inputs.py", "latest", save, timeout=60)
    assert code == 0 and out.count("loads iter_0000002") == 4, out


def test_latest_moving_while_a_tensor_parallel_job_starts(tmp_path, corpus):
    """Before ranks agreed, a `latest` flipping between two iterations made TP ranks combine
    shards of both, run different numbers of steps, and hang."""
    save = str(tmp_path / "ckpt")
    assert train(*TINY, "--data", corpus, "--max-iters", "6", "--save-interval", "2", "--exit-interval", "4",
                 "--save", save).returncode == 0
    stop = threading.Event()

    def flip():
        for n in range(10**9):
            if stop.is_set():
                return
            tmp = os.path.join(save, "latest.flip")
            with open(tmp, "w") as f:
                f.write(f"iter_000000{2 + 2 * (n % 2)}\n")
            os.replace(tmp, os.path.join(save, "latest"))
            time.sleep(0)

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        code, out, _ = run_mpi(2, "", timeout=120, command=[
            os.path.join(ROOT, "run_mpi.sh"), "-n", "2", "-m", "minipar.train", *TINY, "--data", corpus,
            "--tp", "2", "--max-iters", "6", "--eval-interval", "100", "--load", save])
    finally:
        stop.set()
        flipper.join()
    assert code == 0 and "resuming at iteration" in out, out


def test_stale_partials_go_and_only_the_newest_checkpoints_are_kept(tmp_path, corpus):
    save = tmp_path / "ckpt"
    os.makedirs(save / "iter_0000009.partial")  # what a crashed save left
    run = train(*TINY, "--data", corpus, "--max-iters", "8", "--save-interval", "2", "--save", str(save),
                "--keep-checkpoints", "2", "--overwrite-checkpoints")
    assert run.returncode == 0, run.stderr
    assert sorted(os.listdir(save)) == [".lock", "iter_0000006", "iter_0000008", "latest"]


def test_a_trainer_state_without_its_fields_is_one_line(tmp_path, corpus):
    save = str(tmp_path / "ckpt")
    assert train(*TINY, "--data", corpus, "--max-iters", "2", "--save", save).returncode == 0
    index_file, index = saved_index(save)
    del index["trainer"]["rng"]
    index["trainer"]["seed"], index["trainer"]["skipped_in_a_row"] = "1337", -1
    reseal(index_file, index)
    run = train(*TINY, "--data", corpus, "--max-iters", "4", "--load", save)
    assert one_line(run, "its trainer state has no whole number seed, rng.seed, skipped_in_a_row: it was not "
                    "written by"), run.stderr


@pytest.mark.parametrize("change,message", [  # each once a traceback or a run that silently went elsewhere
    (lambda t: t.update(iteration=5), "says iteration 5, the index 2"),  # resumed at 5, or trained nothing
    (lambda t: t["rng"].update(seed=-3), "has a negative rng.seed"),  # NumPy's seeding raised
    (lambda t: t.update(corpus={"a": 1}), "has no corpus [bytes, sha256] (every checkpoint records"),  # a KeyError
    (lambda t: t.pop("corpus"), "has no corpus [bytes, sha256] (every checkpoint records"),  # the check skipped
    (lambda t: t.update(tokenizer=["x"]), 'has a tokenizer that is neither "bytes" nor a SHA-256'),
    (lambda t: t.update(token_recipe="3"), "has a token_recipe that is not a whole number from 1"),
])
def test_a_trainer_state_that_disagrees_with_its_index_is_one_line(change, message, tmp_path, corpus):
    """The index is sealed, but an editor can seal it again: the trainer state must agree with it."""
    save = str(tmp_path / "ckpt")
    assert train(*TINY, "--data", corpus, "--max-iters", "2", "--save", save).returncode == 0
    index_file, index = saved_index(save)
    change(index["trainer"])
    reseal(index_file, index)
    run = train(*TINY, "--data", corpus, "--max-iters", "4", "--load", save)
    assert one_line(run, f"its trainer state {message}"), run.stderr
