"""Parallelism on MPI communicators: the process grid and autograd-aware collectives."""

from minipar.parallel.topology import Layout, ProcessGrid

__all__ = ["Layout", "ProcessGrid"]
