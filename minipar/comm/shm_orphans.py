"""Shared-memory segments left behind by MPI jobs that died, and their removal.

MPICH keeps the buffers its ranks on one host share in a file under /dev/shm (``mpich_shm_*``)
and unlinks it in MPI_Finalize. A job that ends any other way (MPI_Abort after an uncaught
exception, a rank killed, a timeout's SIGKILL) leaves the file behind, and /dev/shm is memory:
each such job keeps 2-8 MB of RAM until the host reboots. A few thousand failed test runs once
held 21 GB of a 24 GB machine, and a later run then refused to start for want of memory. Removing
them is the launcher's job (a cluster's resource manager does it after every job), so run_mpi.sh
and the tests' launcher call ``remove_orphans`` after each job.

A segment is an orphan when no process has it open or mapped. A live job's ranks map it from
MPI_Init until MPI_Finalize, and whoever creates it holds it open until it is mapped, so there is
no moment at which a live job's segment is neither. Only segments owned by this user are touched,
and only on this host: the other hosts of a --hostfile run keep theirs until the next job there.

This file imports nothing from minipar (run_mpi.sh runs it by path, before any rank starts):

    python minipar/comm/shm_orphans.py            # list them
    python minipar/comm/shm_orphans.py --remove   # and remove them (--quiet: say nothing)
"""

import os
import sys

SHM_DIR = "/dev/shm"
# MPICH's segments; Open MPI's shared-memory transports name theirs these ways.
PREFIXES = ("mpich_shm_", "vader_segment.", "sm_segment.")


def _in_use():
    """Every path under SHM_DIR that a process readable to this user has open or mapped."""
    used = set()
    marker = SHM_DIR + "/"
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


def orphans():
    """[(path, bytes)] of this user's MPI segments under SHM_DIR that no process holds."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIXES)]
    except OSError:  # no /dev/shm (not Linux): nothing to find
        return []
    if not names:
        return []
    used = _in_use()
    found = []
    for name in sorted(names):
        path = os.path.join(SHM_DIR, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_uid == os.getuid() and path not in used:
            found.append((path, info.st_size))
    return found


def remove_orphans():
    """Remove the orphans; returns (how many, bytes freed). A file that vanished meanwhile (its
    job finalized, or another launcher removed it first) is simply not counted."""
    count = freed = 0
    for path, size in orphans():
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
            print(f"removed {count} shared-memory segment(s), {freed / 2**20:.0f} MiB in {SHM_DIR}, "
                  "left by MPI jobs that ended without MPI_Finalize", file=sys.stderr)
        return 0
    for path, size in orphans():
        print(f"{path}\t{size}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
