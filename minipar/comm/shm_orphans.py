"""What MPI jobs that died leave behind on a host, and its removal.

MPICH keeps the buffers its ranks on one host share in a file under /dev/shm (``mpich_shm_*``)
and unlinks it in MPI_Finalize. A job that ends any other way (MPI_Abort after an uncaught
exception, a rank killed, a timeout's SIGKILL) leaves the file behind, and /dev/shm is memory:
each such job keeps 2-8 MB of RAM until the host reboots. A few thousand failed test runs once
held 21 GB of a 24 GB machine, and a later run then refused to start for want of memory. Its
launcher leaves a copy of the host's topology too (``/tmp/hydra_hwloc_xmlfile_*``, 5 KB of disk
each). Removing them is the launcher's job (a cluster's resource manager does it after every
job), so run_mpi.sh calls ``remove_orphans`` before each job, and the tests after each test.

A file is an orphan when no process has it open or mapped and it is a minute old. A live job's
ranks map its segment from MPI_Init until MPI_Finalize, and whoever creates it holds it open until
it is mapped; the launcher's proxies hold the topology file open from creating it to removing it.
The minute covers what a scan of /proc cannot see: the holders of a job that is starting in
another PID namespace sharing /dev/shm (a container), or processes this user may not inspect.
Removing a segment before every rank has attached it would hang that job; after, it does no harm.
If /proc does not list this process, nothing is removed. Only this user's files are touched, and
only on this host: the other hosts of a --hostfile run keep theirs until the next job there.

This file imports nothing from minipar (run_mpi.sh runs it by path, before any rank starts):

    python minipar/comm/shm_orphans.py            # list them
    python minipar/comm/shm_orphans.py --remove   # and remove them (--quiet: say nothing)
"""

import glob
import os
import sys
import time

SHM_DIR = "/dev/shm"
# MPICH's segments (and a shared-memory window's, before every rank attached it); Open MPI's
# shared-memory transports name theirs these ways.
PREFIXES = ("mpich_shm_", "mpich_shar_tmp", "vader_segment.", "sm_segment.")
TOPOLOGY_DIR, TOPOLOGY_PREFIX = "/tmp", "hydra_hwloc_xmlfile_"  # MPICH's launcher, hydra (it ignores TMPDIR)
MIN_AGE = 60.0  # seconds since a file was last written before it may be an orphan


def _in_use(folder):
    """Every path in ``folder`` that a process readable to this user has open or mapped; None if
    /proc cannot say (absent, or not listing this process: another PID namespace's)."""
    marker = folder + "/"
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    if str(os.getpid()) not in pids:
        return None
    used = set()
    for pid in pids:
        # the open files first, then the mappings: a holder that maps the file and then closes it
        # between the two reads is seen in one of them
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # the process ended meanwhile, or belongs to someone else
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # this descriptor closed meanwhile: the others still count
                continue
            if target.startswith(marker):
                used.add(target)
        # every thread's: a process whose first thread has exited shows no mappings in its own
        for maps in [f"/proc/{pid}/maps"] + glob.glob(f"/proc/{pid}/task/*/maps"):
            try:
                with open(maps) as fh:
                    for line in fh:
                        at = line.find(marker)
                        if at >= 0:
                            used.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
            except OSError:
                continue
    return used


def _unheld(folder, prefixes):
    """[(path, bytes of memory or disk it takes)] of this user's files in ``folder`` named with
    ``prefixes``, MIN_AGE old, that no process holds."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith(prefixes))
    except OSError:  # no such folder (not Linux): nothing to find
        return []
    now, old = time.time(), []
    for name in names:
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_uid == os.getuid() and now - info.st_mtime >= MIN_AGE:
            old.append((path, info.st_blocks * 512))  # a window's file is sparse: its size is not its memory
    used = _in_use(folder) if old else set()  # the scan only when some file is old enough
    return [] if used is None else [(path, size) for path, size in old if path not in used]


def orphans():
    """[(path, bytes)] of this user's MPI segments under SHM_DIR that no process holds: memory."""
    return _unheld(SHM_DIR, PREFIXES)


def stale_topology_files():
    """[(path, bytes)] of hydra's topology files in TOPOLOGY_DIR that no job holds."""
    return _unheld(TOPOLOGY_DIR, TOPOLOGY_PREFIX)


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
    if not set(argv) <= {"--remove", "--quiet"} or len(set(argv)) < len(argv) or argv == ["--quiet"]:
        print(f"usage: python {sys.argv[0]} [--remove [--quiet]]", file=sys.stderr)
        return 2
    if "--remove" in argv:
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
