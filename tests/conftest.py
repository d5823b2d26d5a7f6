import compileall
import pathlib
import py_compile
import sys

import pytest

import minipar
from minipar.comm.shm_orphans import remove_orphans
from minipar.dtypes import get_default_dtype, set_default_dtype


@pytest.fixture(autouse=True)
def fresh_state():
    """Every test starts in float32 with the process generator at seed 0, and leaves it so."""
    dtype = get_default_dtype()
    minipar.manual_seed(0)
    yield
    set_default_dtype(dtype)


def pytest_runtest_teardown(item):
    """Many tests end MPI jobs on purpose (an abort, a timeout's kill), and each such job leaves
    MPICH's shared-memory segment in /dev/shm: memory held until reboot. One suite's worth, run
    a few hundred times, once filled the machine (minipar/comm/shm_orphans.py)."""
    remove_orphans()


@pytest.fixture
def float64():
    set_default_dtype("float64")
    yield


@pytest.fixture
def corpus(tmp_path):
    """A small text corpus for the training command line (python -m minipar.train --data)."""
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(400)))
    return str(path)


def pytest_sessionstart(session):
    """Where Python is told not to write bytecode (PYTHONDONTWRITEBYTECODE, set on the machines CI
    runs on), every process compiles each minipar module it imports from source, about 0.4 s of
    CPU, and an 8-rank launch starts eight such processes on two cores: 0.8 s more per launch,
    about a minute over the suite. So the project's own modules are compiled once, here, into
    their __pycache__ folders (ignored by git); the ranks read them. Each is stamped with its
    source's hash, which Python checks at every import: a stamp of size and whole-second time let
    a module edited within the second, to the same size, run stale (a mutant reverted at once)."""
    if not sys.dont_write_bytecode:
        return  # the first process to import a module caches it, as usual
    root = pathlib.Path(__file__).resolve().parent.parent
    for folder in ("minipar", "lessons", "bench", "tests"):
        compileall.compile_dir(root / folder, quiet=1, workers=2, force=True,
                               invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
