"""Prints how this job's ranks wait: polite (more ranks than cores) or blocking."""

from minipar.comm import world

comm = world()
if comm.rank == 0:
    print(f"polite={comm.polite} size={comm.size}")
