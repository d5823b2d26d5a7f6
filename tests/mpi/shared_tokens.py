"""A corpus the token cache lacks is tokenized once, on rank 0, and its ids sent to every rank.

    python shared_tokens.py TOKENIZER_DIR WORK_DIR all-miss    no rank finds a cache: rank 0 alone encodes
    python shared_tokens.py TOKENIZER_DIR WORK_DIR some-miss   rank 0 finds one, the others do not (hosts
                                                               without a shared disk): nobody encodes

Each rank reads the corpus from its own copy under WORK_DIR (so that a miss on one rank leaves the
others' caches as they are), counts its tokenizer's encodes, and checks the ids it ends with
against the corpus encoded here, after the run, on rank 0. Prints "ok" on rank 0.
"""

import os
import shutil
import sys

import numpy

from minipar.comm.mpi import world
from minipar.data import Dataset
from minipar.tokenizer import BPETokenizer

tokenizer_dir, work, mode = sys.argv[1], sys.argv[2], sys.argv[3]
comm = world()
text = "".join(f"def g{i}(y):\n    return y + {i}\n" for i in range(300))
copy = os.path.join(work, f"rank{comm.rank}", "corpus.txt")
if comm.rank == 0:
    for r in range(comm.size):
        os.makedirs(os.path.dirname(os.path.join(work, f"rank{r}", "corpus.txt")), exist_ok=True)
        with open(os.path.join(work, f"rank{r}", "corpus.txt"), "w") as fh:
            fh.write(text)
    if mode == "some-miss":  # rank 0's copy already has its cache
        Dataset(text.encode(), tokenizer=BPETokenizer(tokenizer_dir), path=copy)
comm.barrier()

tokenizer = BPETokenizer(tokenizer_dir)
encodes = []
plain_encode = tokenizer.encode
tokenizer.encode = lambda t: encodes.append(1) or plain_encode(t)
data = Dataset(text.encode(), tokenizer=tokenizer, path=copy, defer_cache=True, share_tokens=True)
cached = data.splits is not None
assert cached == (mode == "some-miss" and comm.rank == 0), (comm.rank, cached)
data.share_tokens(comm)
data.keep_cache()  # each rank that lacked it writes its own copy's cache
ids = numpy.concatenate([data.splits["train"], data.splits["val"]])

counts = comm.all_gather(numpy.array([len(encodes), len(ids)], numpy.int64))
caches = [f for f in os.listdir(os.path.dirname(copy)) if f.endswith(".tokens")]
assert len(caches) == 1, (comm.rank, caches)
if comm.rank == 0:
    expected = plain_encode(text)
    made = [int(c[0]) for c in counts]
    assert made == ([1] + [0] * (comm.size - 1) if mode == "all-miss" else [0] * comm.size), made
    assert all(int(c[1]) == len(expected) for c in counts), counts
mine = numpy.array(ids, numpy.int64)
first = comm.broadcast(mine.copy())  # rank 0's ids, compared on every rank
assert numpy.array_equal(mine, first), comm.rank
if comm.rank == 0:
    assert numpy.array_equal(mine, expected)
    shutil.rmtree(work)
    print("ok")
