"""bench/memory_breakdown.py's accounting, on a tiny GPT: the columns are the optimizer's own
state bytes, DP holds a whole model's weights, gradients and two Adam moments, ZeRO-1 and ZeRO-3
hold 1/DP of what they shard (padding included), and recomputing ZeRO-3 keeps less graph.

    run_mpi.sh -n 4 tests/mpi/memory_breakdown.py
"""

import argparse
import os
import sys

import minipar
from minipar.comm import world
from minipar.data import Dataset, load_corpus
from minipar.models import GPT, GPTConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from memory_breakdown import layouts, measure  # noqa: E402

comm = world()
N = comm.size
minipar.set_default_dtype("float32")
args = argparse.Namespace(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=8, micro_batches=2, bucket_kb=4)
batch = Dataset(load_corpus()).batch("train", 0, args.batch_size, args.block_size, 0)
whole = 4 * GPT(GPTConfig(n_layer=2, n_head=4, n_embd=16, block_size=16)).num_parameters()  # float32 bytes

got = {}
for name in ("DP", "ZeRO-1", "ZeRO-3", "TPxDP"):
    numbers, opt = measure(layouts(N)[name], args, comm, batch)
    state = opt.state_bytes()
    assert sum(numbers[k] for k in ("parameters", "gradients", "optimizer")) == sum(state.values()), (name, numbers)
    assert opt.peak_state_bytes() >= sum(state.values()), name
    assert numbers["activations"] > 0, name
    got[name] = numbers, 4 * opt.padding()

dp, _ = got["DP"]
assert dp["parameters"] == dp["gradients"] == whole and dp["optimizer"] == 2 * whole, dp
zero1, pad1 = got["ZeRO-1"]
assert zero1["parameters"] == zero1["gradients"] == whole and N * zero1["optimizer"] == 2 * (whole + pad1), zero1
zero3, pad3 = got["ZeRO-3"]
assert N * zero3["parameters"] == whole + pad3 and N * zero3["optimizer"] == 2 * (whole + pad3), zero3
assert zero3["activations"] == dp["activations"], (zero3, dp, "ZeRO-3's graph keeps what DP's does, "
                                                   "its parameters by reference")
tp, _ = got["TPxDP"]
assert tp["parameters"] < dp["parameters"], "TP splits the matrices"
if comm.rank == 0:
    print(f"memory breakdown accounting OK on {N} ranks")
