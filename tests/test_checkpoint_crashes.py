"""A save that fails or is killed part-way keeps the previous checkpoint loadable: a full disk at
any file, a failed rename, a kill between any two steps of publishing (each step synced to disk
before the next names it), and the leftovers a crashed save or a pruned checkpoint leaves, which
the next start removes, and only those."""

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import numpy
import pytest

from minipar.checkpoint import sharded
from minipar.checkpoint.sharded import CheckpointError
from test_checkpoint_adversary import _load, _make, _saved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _fail_writes_to(monkeypatch, directory, name):
    """os.write raises ENOSPC for the temporary file of ``name`` under ``directory``, as on a full disk."""
    write = os.write

    def full(fd, data):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(str(directory)) and os.path.basename(path).startswith(f".{name}."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr(os, "write", full)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file a write is for")
@pytest.mark.parametrize("name", ["rank_00000.safetensors", "rank_00000.json", "index.json", "latest"])
def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(name, tmp_path, monkeypatch):
    save = _saved(tmp_path)
    model, opt, grid = _make()
    opt.step_count = 7  # so that which checkpoint loads shows
    _fail_writes_to(monkeypatch, tmp_path, name)
    with pytest.raises(CheckpointError) as caught:
        sharded.save(save, 2, model, opt, grid, {})
    monkeypatch.undo()
    message = str(caught.value)
    assert message.startswith("checkpoint iter_0000002 was not saved: No space left on device") and name in message
    assert "the previous checkpoint and " + os.path.join(save, "latest") + " are unchanged" in message
    # no partial files, no temporaries, no partial folder: every rank had finished writing into it
    # when rank 0 removed it
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest"]
    assert _load(save) == {"iteration": 1, "optimizer_steps": 0}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file a write is for")
def test_a_full_disk_at_the_first_save_does_not_promise_an_earlier_checkpoint(tmp_path, monkeypatch):
    save = str(tmp_path / "ckpt")
    model, opt, grid = _make()
    _fail_writes_to(monkeypatch, tmp_path, "index.json")
    with pytest.raises(CheckpointError, match="iter_0000001 was not saved: No space left on device .*; no earlier "
                       "checkpoint was saved there: free space"):
        sharded.save(save, 1, model, opt, grid, {})


def test_a_save_refused_permission_says_to_make_the_folder_writable_not_to_free_space(tmp_path):
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "iter_0000003.partial"))
    message = str(sharded._not_saved(str(tmp_path), str(tmp_path / "iter_0000003"), denied))
    assert "was not saved: Permission denied" in message and "make it writable" in message, message
    assert "free space" not in message


def test_a_resave_that_fails_between_its_renames_keeps_the_previous_one(tmp_path, monkeypatch):
    save = _saved(tmp_path)
    model, opt, grid = _make()
    opt.step_count = 7
    replace = os.replace

    def failing(src, dst):
        if str(src).endswith(".partial"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), src)
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(CheckpointError, match="iter_0000001 was not saved: Input/output error"):
        sharded.save(save, 1, model, opt, grid, {})
    monkeypatch.undo()
    assert sorted(os.listdir(save)) == ["iter_0000001.old", "latest"]  # stopped between the two renames
    assert sharded.find(save).endswith("iter_0000001.old") and _load(save) == {"iteration": 1, "optimizer_steps": 0}
    sharded.save(save, 1, model, opt, grid, {})  # the same iteration again, whole this time
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest"] and _load(save) == {"optimizer_steps": 7}


TMPFS_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint_adversary import _make
    from minipar.checkpoint import sharded
    save = os.path.join(sys.argv[1], "save")
    model, opt, grid = _make()
    sharded.save(save, 1, model, opt, grid, {})
    with open(os.path.join(sys.argv[1], "filler"), "wb", buffering=0) as f:  # fill the disk
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass
    try:
        sharded.save(save, 2, model, opt, grid, {})
    except sharded.CheckpointError as exc:
        print(exc)
    print(sorted(os.listdir(save)), sharded.load(save, *_make()))
""")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("mount"),
                    reason="a real full disk needs root, unshare and mount (a private tmpfs)")
def test_a_really_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "script.py"
    script.write_text(TMPFS_SCRIPT)
    here = os.path.dirname(os.path.abspath(__file__))
    command = f"mount -t tmpfs -o size=512k tmpfs {disk} && {sys.executable} {script} {disk} {here}"
    run = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    if run.returncode != 0 and "mount" in run.stderr and "Traceback" not in run.stderr:
        pytest.skip(f"no private tmpfs here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("checkpoint iter_0000002 was not saved: No space left on device")
    # the shard did not fit, and nothing of the save is left
    assert lines[1] == "['iter_0000001', 'latest'] {'optimizer_steps': 0}", lines


def test_every_file_of_a_checkpoint_has_the_users_mode_and_no_temporary_is_left(tmp_path):
    umask = os.umask(0o027)
    try:
        save = _saved(tmp_path, iterations=(1, 1))  # the same iteration again replaces it whole
    finally:
        os.umask(umask)
    step = os.path.join(save, "iter_0000001")
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest"]
    assert sorted(os.listdir(step)) == ["index.json", "rank_00000.json", "rank_00000.safetensors"]
    for path in [os.path.join(save, "latest")] + [os.path.join(step, f) for f in os.listdir(step)]:
        assert os.stat(path).st_mode & 0o777 == 0o640, path


def test_remove_stale_partials_removes_only_what_crashed_saves_left(tmp_path):
    save = _saved(tmp_path, iterations=(1, 2))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    shutil.copytree(os.path.join(save, "iter_0000002"), os.path.join(save, "iter_0000003.partial"))
    shutil.copytree(os.path.join(save, "iter_0000001"), os.path.join(save, "iter_0000001.old"))
    shutil.copytree(os.path.join(save, "iter_0000001"), os.path.join(save, "iter_0000005.old"))  # put back
    os.symlink(outside, os.path.join(save, "iter_0000004.partial"))
    open(os.path.join(save, ".latest.abc123.tmp"), "w").write("iter_00")
    open(os.path.join(save, "notes.partial"), "w").write("mine")
    removed = sharded.remove_stale_partials(save)
    assert removed == [".latest.abc123.tmp", "iter_0000001.old", "iter_0000003.partial", "iter_0000004.partial"]
    assert sorted(os.listdir(save)) == ["iter_0000001", "iter_0000002", "iter_0000005", "latest", "notes.partial"]
    assert os.listdir(outside) == ["keep"] and sharded.remove_stale_partials(str(tmp_path / "none")) == []
    assert _load(save) == {"iteration": 2, "optimizer_steps": 0}


def test_prune_keeps_the_newest_and_never_what_latest_names(tmp_path):
    save = _saved(tmp_path, iterations=(1, 2, 3, 4, 5))
    shutil.copytree(os.path.join(save, "iter_0000001"), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(save, "iter_0000000"))  # not a plain directory
    os.mkdir(os.path.join(save, "iter_0000009"))  # no index: not a complete checkpoint
    os.mkdir(os.path.join(save, "iter_12"))  # not a name a save writes
    assert sharded.prune(save, 7) == []  # fewer than 7 there: none goes
    assert sharded.prune(save, 3) == ["iter_0000001", "iter_0000002"]
    open(os.path.join(save, "latest"), "w").write("iter_0000003\n")  # a run resumed from an older one
    assert sharded.prune(save, 2) == ["iter_0000004"]
    assert sorted(os.listdir(save)) == ["iter_0000000", "iter_0000003", "iter_0000005", "iter_0000009", "iter_12",
                                        "latest"]
    assert os.listdir(tmp_path / "elsewhere") and sharded.prune(save, 1) == ["iter_0000005"]
    assert _load(save) == {"iteration": 3, "optimizer_steps": 0}
    open(os.path.join(save, "latest"), "w").write("../elsewhere")
    assert sharded.prune(save, 1) == []  # which one to keep is unknown: nothing goes
    with pytest.raises(ValueError, match="keep=0 must be a whole number >= 1"):
        sharded.prune(save, 0)


def test_an_old_checkpoint_beside_an_incomplete_one_of_its_iteration_is_kept(tmp_path):
    """remove_stale_partials removes iter_N.old only once iter_N is a complete checkpoint: beside an
    iter_N without an index it may be the only good copy of that iteration."""
    save = _saved(tmp_path)
    step = os.path.join(save, "iter_0000001")
    os.rename(step, step + ".old")
    os.mkdir(step)
    assert sharded.remove_stale_partials(save) == []
    assert sorted(os.listdir(save)) == ["iter_0000001", "iter_0000001.old", "latest"]


def test_prune_syncs_the_rename_of_a_checkpoint_before_removing_it(tmp_path, monkeypatch):
    """A crash while a pruned checkpoint is removed must leave an iter_N.partial (the next start
    removes it), never a half-removed iter_N: the rename reaches the disk before the removal starts."""
    from minipar.checkpoint import retention

    save = _saved(tmp_path, iterations=(1, 2))
    events, replace, fsync_dir, remove = [], os.replace, retention.fsync_dir, retention.remove

    def logged(name, call):
        def run(*paths):
            events.append((name, *(os.path.relpath(p, save) for p in paths)))
            return call(*paths)
        return run

    monkeypatch.setattr(os, "replace", logged("replace", replace))
    monkeypatch.setattr(retention, "fsync_dir", logged("fsync_dir", fsync_dir))
    monkeypatch.setattr(retention, "remove", logged("remove", remove))
    assert sharded.prune(save, 1) == ["iter_0000001"]
    assert events == [("remove", "iter_0000001.partial"), ("replace", "iter_0000001", "iter_0000001.partial"),
                      ("fsync_dir", "."), ("remove", "iter_0000001.partial")], events




def test_each_step_of_publishing_a_save_is_on_disk_before_the_next_names_it(tmp_path, monkeypatch):
    """A kill at any moment leaves a loadable checkpoint that latest names: the index's entry is
    synced before its folder is renamed into place, that rename before latest is written, latest
    before the run goes on; a re-save keeps the previous iter_N (as .old) until latest is written."""
    save = _saved(tmp_path)
    events = []

    def logged(name, call):
        def run(*args):
            paths = [a for a in args if isinstance(a, str)]
            if not any(os.path.basename(p).startswith(".") for p in paths):  # write_file's temporaries
                events.append((name, *(os.path.relpath(p, save) for p in paths)))
            return call(*args)
        return run

    monkeypatch.setattr(os, "replace", logged("replace", os.replace))
    for name in ("write_file", "fsync_dir", "remove"):
        monkeypatch.setattr(sharded, name, logged(name, getattr(sharded, name)))
    model, opt, grid = _make()
    sharded.save(save, 1, model, opt, grid, {})  # the same iteration again
    partial = "iter_0000001.partial"
    assert events == [("remove", partial), ("write_file", f"{partial}/rank_00000.safetensors"),
                      ("write_file", f"{partial}/rank_00000.json"), ("write_file", f"{partial}/index.json"),
                      ("fsync_dir", partial), ("remove", "iter_0000001.old"),
                      ("replace", "iter_0000001", "iter_0000001.old"), ("replace", partial, "iter_0000001"),
                      ("fsync_dir", "."), ("write_file", "latest"), ("fsync_dir", "."),
                      ("remove", "iter_0000001.old")], events


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file a write is for")
def test_a_resave_whose_latest_cannot_be_written_keeps_the_previous_one(tmp_path, monkeypatch):
    """Saving an iteration again replaces it only once latest is written: a full disk at latest puts
    the previous checkpoint of that iteration back under its name."""
    save = _saved(tmp_path)
    model, opt, grid = _make()
    opt.step_count = 7  # so that which checkpoint loads shows
    _fail_writes_to(monkeypatch, tmp_path, "latest")
    with pytest.raises(CheckpointError, match="iter_0000001 was not saved: No space left on device"):
        sharded.save(save, 1, model, opt, grid, {})
    monkeypatch.undo()
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest"]
    assert _load(save) == {"iteration": 1, "optimizer_steps": 0}


class _World:
    """A stand-in for the world of ``size`` ranks, as rank ``rank`` sees it, where ``failing``
    ranks could not write: its all-reduce returns what MPI's would."""

    def __init__(self, rank, size, failing):
        self.rank, self.size, self.failing = rank, size, failing

    def all_reduce(self, votes):
        assert list(votes) == [int(r == self.rank and r in self.failing) for r in range(self.size)]
        return numpy.array([int(r in self.failing) for r in range(self.size)])


def test_a_save_some_ranks_could_not_write_fails_on_every_rank_and_the_lowest_says_why(tmp_path):
    (tmp_path / "iter_0000003.partial").mkdir()
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "rank_00001.safetensors")
    errors = {}
    for rank in range(4):
        with pytest.raises(CheckpointError) as caught:
            sharded._agree(_World(rank, 4, {1, 3}), full if rank in (1, 3) else None, str(tmp_path),
                           str(tmp_path / "iter_0000003"), str(tmp_path / "iter_0000003.partial"))
        errors[rank] = caught.value
    assert [e.speaks for e in errors.values()] == [False, True, False, False]
    assert str(errors[1]).startswith("checkpoint iter_0000003 was not saved: No space left on device "
                                     "(rank_00001.safetensors) (and 1 more rank could not write theirs)")
    assert str(errors[0]) == "checkpoint iter_0000003 was not saved (rank 1 says why)"
    assert os.listdir(tmp_path) == []  # rank 0 removed the folder every rank had finished with
    sharded._agree(_World(0, 4, set()), None, str(tmp_path), str(tmp_path / "iter_0000004"))  # none failed


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("mount"),
                    reason="a real full disk needs root, unshare and mount (a private tmpfs)")
def test_a_full_disk_under_every_rank_of_a_run_prints_one_line_and_ends_every_rank(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    train = (f"{os.path.join(ROOT, 'run_mpi.sh')} -n 2 -m minipar.train --tp 2 --n-layer 1 --max-iters 1 "
             f"--eval-iters 1 --sample 0 --plot '' --save {disk / 'ckpt'}")
    run = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {disk} && {train}"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PYTHON=sys.executable,
                                  PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]))
    if run.returncode != 0 and "mount" in run.stderr and "Traceback" not in run.stderr:
        pytest.skip(f"no private tmpfs here: {run.stderr.strip()}")
    errors = [line for line in (run.stdout + run.stderr).splitlines() if "error" in line]  # MPI's Abort lines aside
    assert run.returncode == 1 and len(errors) == 1, run.stdout + run.stderr
    assert "--save: checkpoint iter_0000001 was not saved: No space left on device" in errors[0], errors
    assert "(and 1 more rank could not write theirs)" in errors[0], errors


def test_a_resume_from_the_old_name_is_read_by_every_rank_before_it_is_renamed(tmp_path, corpus):
    """find() resumes from iter_N.old when a re-save stopped between its renames, and rank 0 puts
    it back under its own name: only once every rank has read it (here ranks but 0 read late)."""
    from mpi_run import run_mpi, run_train
    from test_train import TINY

    save = str(tmp_path / "ckpt")
    common = [*TINY, "--data", corpus, "--save", save, "--save-interval", "2", "--lr-decay-iters", "3"]
    assert run_train(2, *common, "--max-iters", "2")[0] == 0
    os.rename(os.path.join(save, "iter_0000002"), os.path.join(save, "iter_0000002.old"))
    code, out, _ = run_mpi(2, "resume_old.py", *common, "--max-iters", "3", "--load", save)
    assert code == 0, out
    assert {"iter_0000002", "iter_0000003"} <= set(os.listdir(save)) and "iter_0000002.old" not in os.listdir(save)
