"""The watchdog that ends a hung training run (minipar/watchdog.py), in one process without MPI."""

import subprocess
import sys

import pytest

PROGRAM = """import os, sys, time
from minipar.watchdog import Watchdog

dog = Watchdog({seconds}, "--limit {seconds}", abort=lambda: os._exit(3))
for it in range(4):
    dog.arm(f"piece {{it}}")
    time.sleep({pause})
dog.close()
print("all pieces ended")
"""


def run(seconds, pause):
    program = PROGRAM.format(seconds=seconds, pause=pause)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)


def test_a_piece_of_work_past_its_deadline_is_reported_with_where_it_waits_then_aborted():
    done = run(0.5, 3)
    assert done.returncode == 3 and "all pieces ended" not in done.stdout, done.stderr
    assert "error: piece 0 has not ended after 0.5 s (--limit 0.5): a rank stopped" in done.stderr
    assert 'line 7 in <module>' in done.stderr  # the main thread's frame: the sleep it waits in


def test_a_stream_without_a_file_descriptor_still_ends_the_job():
    """faulthandler needs a file descriptor; a captured stderr has none, and the job must end anyway."""
    program = PROGRAM.replace("from minipar.watchdog", "import io; sys.stderr = io.StringIO()\nfrom minipar.watchdog")
    done = subprocess.run([sys.executable, "-c", program.format(seconds=0.5, pause=3)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3 and "all pieces ended" not in done.stdout, done.stderr


@pytest.mark.parametrize("seconds", [2, 0])
def test_work_that_ends_in_time_or_no_limit_never_fires(seconds):
    """Each piece takes 0.4 s of a 2 s limit (four of them 1.6 s: the limit is per piece); 0: no limit."""
    done = run(seconds, 0.4)
    assert done.returncode == 0 and "all pieces ended" in done.stdout and done.stderr == "", done.stderr


def test_the_job_ends_even_when_saying_why_fails():
    """A closed stderr makes the message raise; the abort comes anyway (a hung job that cannot
    print must still end)."""
    closed = ("class Closed:\n    def write(self, text):\n        raise OSError('stderr closed')\n"
              "    flush = write\nsys.stderr = Closed()\n")
    program = PROGRAM.replace("from minipar.watchdog", closed + "from minipar.watchdog")
    done = subprocess.run([sys.executable, "-c", program.format(seconds=0.5, pause=3)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3 and "all pieces ended" not in done.stdout


def test_work_named_by_a_function_is_named_when_the_watchdog_fires():
    """A save's name says whether it was published by the time it was found hanging."""
    program = PROGRAM.replace('dog.arm(f"piece {{it}}")', 'state = ["started"]; dog.arm(lambda: f"piece {{it}} ({{state[0]}})"); '
                              'state[0] = "half done"')
    done = subprocess.run([sys.executable, "-c", program.format(seconds=0.5, pause=3)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3 and "error: piece 0 (half done) has not ended after 0.5 s" in done.stderr, done.stderr
