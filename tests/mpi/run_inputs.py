"""Ranks that read different inputs, as they can when files change while a job starts.

    flags DIR    rank 1 was launched with another seed and ZeRO stage: every rank must stop, one line
    corpus DIR   rank 1 reads one more byte of corpus than the others: every rank must stop, one line
    weights DIR  every rank names its own copy of the initial weights (and took its flags from its
                 own copy of a snapshot), and rank 2's differs in one number: every rank must stop,
                 one line, rank 2's (the lowest rank with a problem prints: rank 1's equal copy
                 under another name is none)
    no-weights DIR  the same, but rank 2 was launched without --init-weights
    latest DIR   ranks resolved ``latest`` of DIR at different moments (iter 2 on rank 0, iter 4 on
                 the others): every rank must load rank 0's, and say which
"""

import os
import sys
from types import SimpleNamespace

import numpy

from minipar.cli import agree
from minipar.comm.mpi import world
from minipar.data import Dataset
from minipar.run_inputs import same_inputs

mode, directory = sys.argv[1], sys.argv[2]
comm = world()
corpus = b"def f(x):\n    return x\n" * 50
args = SimpleNamespace(data=None, load=None, init_weights=None, seed=1, zero_stage=0)
weights = None
if mode == "flags" and comm.rank == 1:
    args.seed, args.zero_stage = 7, 1
if mode == "corpus" and comm.rank == 1:
    corpus += b"\n"
if mode in ("weights", "no-weights") and not (mode == "no-weights" and comm.rank == 2):
    args.init_weights = os.path.join(directory, f"copy_on_host_{comm.rank}.safetensors")
    args.taken_from = {"n_layer": f"{directory}/snapshot_on_host_{comm.rank}/config.json's n_layer"}  # not a flag
    weights = {"wte.weight": numpy.ones((4, 3), numpy.float32), "ln_f.bias": numpy.zeros(3, numpy.float32)}
    if mode == "weights" and comm.rank == 2:
        weights["wte.weight"][2, 1] = numpy.nextafter(numpy.float32(1), numpy.float32(2))
if mode == "latest":
    args.load = os.path.join(directory, "iter_0000002" if comm.rank == 0 else "iter_0000004")
agree(comm, same_inputs(comm, args, Dataset(corpus), weights), "run_inputs")
print(f"rank {comm.rank} loads {os.path.basename(args.load or '-')}", flush=True)
