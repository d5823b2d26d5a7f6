"""Where this process sits on its node, as the launcher says: its rank among the node's processes
(which picks its GPU) and how many processes the node runs (which share its memory). Every
launcher says it under its own names; the first one set is read. And the size of a core's L2
cache, as Linux says it. Standard library only."""

import os

# Launchers tell each process its rank on its node under one of these names.
_LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                         "SLURM_LOCALID", "LOCAL_RANK")
# ... and how many processes run on the node.
_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                         "SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE")


def local_rank():
    """This process's rank among the processes of its node (0 without a launcher)."""
    for name in _LOCAL_RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def local_size():
    """How many processes of the job run on this node (1 where no launcher says)."""
    for name in _LOCAL_SIZE_VARIABLES:
        if os.environ.get(name, "").isdigit() and int(os.environ[name]) > 0:
            return int(os.environ[name])
    return 1


def l2_cache_bytes(base="/sys/devices/system/cpu/cpu0/cache", default=512 * 1024):
    """The first core's L2 cache, as Linux's sysfs under ``base`` gives it, or ``default``."""
    try:
        for index in sorted(os.listdir(base)):
            with open(os.path.join(base, index, "level")) as fh:
                if fh.read().strip() != "2":
                    continue
            with open(os.path.join(base, index, "size")) as fh:
                text = fh.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
            return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return default
