"""MPI across two hosts: two network namespaces joined by a veth pair (bench/two_hosts_rig.py),
launched through ``run_mpi.sh --hostfile`` as on a cluster. Runs where it may (root, ``ip`` and
``unshare``, namespaces allowed); skips with the reason elsewhere. The rig's namespaces are removed
after the module's tests, and a run killed before that is cleaned by the next."""

import filecmp
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from mpi_run import LAUNCHER, ROOT, logged_losses, run_train

spec = importlib.util.spec_from_file_location("two_hosts_rig", os.path.join(ROOT, "bench", "two_hosts_rig.py"))
rig_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rig_module)

# A short TP2 x PP2 x DP2 training: the same flags on one host and on two.
TRAIN = ["--tp", "2", "--pp", "2", "--max-iters", "3", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
         "--block-size", "32", "--batch-size", "8", "--eval-interval", "1000", "--plot", "", "--sample", "0",
         "--dropout", "0.1", "--report"]


def test_run_mpi_refuses_a_missing_or_empty_hostfile(tmp_path):
    empty = tmp_path / "hosts"
    empty.write_text("# no host yet\n\n")
    for hostfile, says in ((str(tmp_path / "none"), "no such file"), (str(empty), "names no host")):
        run = subprocess.run([LAUNCHER, "--hostfile", hostfile, "-n", "2", "-m", "minipar.train"],
                             capture_output=True, text=True, timeout=30)
        assert run.returncode == 2 and says in run.stderr and len(run.stderr.splitlines()) == 1, run.stderr


@pytest.fixture(scope="module")
def rig():
    why = rig_module.missing()
    if why:
        pytest.skip(f"two hosts: {why}")
    try:
        built = rig_module.TwoHosts()
    except (RuntimeError, subprocess.CalledProcessError) as exc:  # e.g. namespaces refused in a container
        pytest.skip(f"two hosts: the rig cannot be built here: {getattr(exc, 'stderr', '') or exc}")
    with built:
        yield built


def across(rig, per_host, *argv, timeout=120):
    """``run_mpi.sh --hostfile`` from the first host; ``per_host`` slots on each host."""
    env = dict(os.environ, PYTHON=sys.executable)
    code, out = rig.run([LAUNCHER, "--hostfile", rig.hostfile(per_host), *argv], timeout=timeout, env=env, cwd=ROOT)
    assert code is not None, f"{' '.join(argv)} across two hosts did not finish in {timeout} s:\n{out}"
    return code, out


def sent_bytes(out, kinds):
    """The bytes the report's per-rank table says all ranks sent in the groups ``kinds``."""
    total = 0
    for line in out.splitlines():
        if re.match(r"\s+\d+(\s+\d+){3}\s", line):  # a row: rank, tp, dp, pp, ...
            total += sum(int(n.replace(",", "")) for kind, n in re.findall(r"\b([a-z_]+) ([\d,]+)(?=,|$)", line)
                         if kind in kinds)
    return total


def test_lesson_06_on_two_hosts(rig):
    code, out = across(rig, 4, "-n", "8", os.path.join(ROOT, "lessons", "06_3d_parallel.py"))
    assert code == 0 and "The 3D-parallel run equals the single-device run." in out, out


def test_local_rank_agrees_with_the_shared_memory_communicator(rig):
    for per_host, local in ((2, "0 1 0 1"), (1, "0 0 1 1")):  # ranks in blocks, then dealt round
        code, out = across(rig, per_host, "-n", "4", os.path.join(ROOT, "tests", "mpi", "local_rank.py"))
        assert code == 0, out
        found = dict(re.findall(r"rank (\d) on \S+: local rank (\d) of 2 \(MPI_LOCALRANKID\)", out))
        assert " ".join(found.get(str(r), "?") for r in range(4)) == local, out


def test_training_on_two_hosts_equals_one_host(rig, tmp_path):
    """The same losses and weights to the bit, with TP inside the hosts and with TP across them;
    --report names each rank's host and the groups that cross, and warns of the TP that does."""
    runs = {}
    for name in ("one", "inside", "across"):
        runs[name] = [*TRAIN, "--log-json", str(tmp_path / f"{name}.jsonl"),
                      "--export-weights", str(tmp_path / f"{name}.safetensors")]
    code, one, _ = run_train(8, *runs["one"], timeout=120)
    assert code == 0, one
    a, b = rig.hosts
    for name, per_host in (("inside", 4), ("across", 1)):  # 1 slot per host: ranks go round the hosts
        before = rig.link_bytes()
        code, out = across(rig, per_host, "-n", "8", "-m", "minipar.train", *runs[name])
        assert code == 0, out
        # The link carried at least what the groups that cross sent in each of the 3 steps (the
        # report counts the last step's): the ranks of two hosts did not share memory past it.
        crossing = ("tp",) if name == "across" else ("pp", "embedding")
        assert rig.link_bytes() - before >= 3 * sent_bytes(out, crossing) > 0, out
        assert logged_losses(tmp_path / f"{name}.jsonl") == logged_losses(tmp_path / "one.jsonl"), out
        assert filecmp.cmp(tmp_path / f"{name}.safetensors", tmp_path / "one.safetensors", shallow=False), out
        if name == "inside":
            assert f"hosts: {a}: ranks 0 1 2 3; {b}: ranks 4 5 6 7" in out, out
            assert "tp groups across hosts: 0 of 4" in out and "pp groups across hosts: 4 of 4" in out, out
            assert "TP groups span hosts" not in out, out
        else:
            assert f"hosts: {a}: ranks 0 2 4 6; {b}: ranks 1 3 5 7" in out, out
            assert "tp groups across hosts: 4 of 4" in out and "pp groups across hosts: 0 of 4" in out, out
            assert "warning: 4 of 4 TP groups span hosts" in out, out
