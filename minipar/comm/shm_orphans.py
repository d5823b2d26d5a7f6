"""What MPI jobs that died leave behind on a host, and its removal.

MPICH keeps the buffers its ranks on one host share in a file under /dev/shm (``mpich_shm_*``)
and unlinks it in MPI_Finalize. A job that ends any other way (MPI_Abort after an uncaught
exception, a rank killed, a timeout's SIGKILL) leaves the file behind, and /dev/shm is memory:
each such job keeps 2-8 MB of RAM until the host reboots. A few thousand failed test runs once
held 21 GB of a 24 GB machine, and a later run then refused to start for want of memory. Its
launcher leaves a copy of the host's topology too (``/tmp/hydra_hwloc_xmlfile_*``, 5 KB of disk
each). Removing them is the launcher's job (a cluster's resource manager does it after every
job), so run_mpi.sh calls ``remove_orphans`` before each job, and the tests after each test.

A segment is an orphan when no process has it open or mapped. A live job's ranks map it from
MPI_Init until MPI_Finalize, and whoever creates it holds it open until it is mapped, so there is
no moment at which a live job's segment is neither. A topology file is held open by the job's
proxies, but not between the launcher writing it and the proxies opening it: one is an orphan
when no process has it open and it is a minute old. Only this user's files are touched, and only
on this host: the other hosts of a --hostfile run keep theirs until the next job there.

This file imports nothing from minipar (run_mpi.sh runs it by path, before any rank starts):

    python minipar/comm/shm_orphans.py            # list them
    python minipar/comm/shm_orphans.py --remove   # and remove them (--quiet: say nothing)
"""

import os
import sys
import time

SHM_DIR = "/dev/shm"
# MPICH's segments; Open MPI's shared-memory transports name theirs these ways.
PREFIXES = ("mpich_shm_", "vader_segment.", "sm_segment.")
TOPOLOGY_DIR, TOPOLOGY_PREFIX = "/tmp", "hydra_hwloc_xmlfile_"  # MPICH's launcher, hydra
TOPOLOGY_MIN_AGE = 60.0  # seconds: older than any launch's gap between writing it and opening it


def _in_use(folder):
    """Every path in ``folder`` that a process readable to this user has open or mapped."""
    used = set()
    marker = folder + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    at = line.find(marker)
                    if at >= 0:
                        used.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(marker):
                    used.add(target)
        except OSError:  # the process ended meanwhile, or belongs to someone else
            continue
    return used


def _unheld(folder, prefixes, min_age):
    """[(path, bytes)] of this user's files in ``folder`` named with ``prefixes``, at least
    ``min_age`` seconds old, that no process holds."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith(prefixes))
    except OSError:  # no such folder (not Linux): nothing to find
        return []
    if not names:
        return []
    used = _in_use(folder)
    found, now = [], time.time()
    for name in names:
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_uid == os.getuid() and path not in used and now - info.st_mtime >= min_age:
            found.append((path, info.st_size))
    return found


def orphans():
    """[(path, bytes)] of this user's MPI segments under SHM_DIR that no process holds: memory."""
    return _unheld(SHM_DIR, PREFIXES, 0.0)


def stale_topology_files():
    """[(path, bytes)] of hydra's topology files in TOPOLOGY_DIR that no job holds."""
    return _unheld(TOPOLOGY_DIR, TOPOLOGY_PREFIX, TOPOLOGY_MIN_AGE)


def remove_orphans():
    """Remove the orphaned segments and topology files; returns (how many, bytes freed). A file
    that vanished meanwhile (its job finalized, or another launcher removed it first) is not counted."""
    count = freed = 0
    for path, size in orphans() + stale_topology_files():
        try:
            os.unlink(path)
        except OSError:
            continue
        count += 1
        freed += size
    return count, freed


def main(argv):
    if argv not in ([], ["--remove"], ["--remove", "--quiet"]):
        print(f"usage: python {sys.argv[0]} [--remove [--quiet]]", file=sys.stderr)
        return 2
    if argv:
        count, freed = remove_orphans()
        if count and "--quiet" not in argv:
            print(f"removed {count} file(s), {freed / 2**20:.0f} MiB, that MPI jobs which ended without "
                  f"MPI_Finalize left in {SHM_DIR} and {TOPOLOGY_DIR}", file=sys.stderr)
        return 0
    for path, size in orphans() + stale_topology_files():
        print(f"{path}\t{size}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
