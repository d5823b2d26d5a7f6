"""A corpus the token cache lacks is tokenized once, on rank 0, and its ids sent to every rank.

    python shared_tokens.py TOKENIZER_DIR WORK_DIR all-miss    one corpus file, no cache: rank 0 alone
                                                               encodes, and writes the cache every rank maps
    python shared_tokens.py TOKENIZER_DIR WORK_DIR some-miss   a copy of the corpus per rank, rank 0's
                                                               cached (hosts without a shared disk):
                                                               nobody encodes, each other rank writes its own
    python shared_tokens.py TOKENIZER_DIR WORK_DIR trainer     ``minipar.train`` on a corpus with no cache:
                                                               one encode in the whole job

Each rank counts its tokenizer's encodes and checks the ids it ends with against the corpus
encoded here, after the run, on rank 0. Prints "ok" on rank 0.
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
encodes = []
plain_encode = BPETokenizer.encode
BPETokenizer.encode = lambda self, t: encodes.append(1) or plain_encode(self, t)


def encodes_per_rank():
    return [int(c[0]) for c in comm.all_gather(numpy.array([len(encodes)], numpy.int64))]


def mapped_caches():
    """The token caches this process maps, as Linux lists them ("(deleted)": a file renamed over)."""
    with open("/proc/self/maps") as fh:
        return sorted({line.split(None, 5)[-1].strip() for line in fh if ".tokens" in line})


if mode == "trainer":
    from minipar import train

    if comm.rank == 0:
        os.makedirs(work)
        with open(os.path.join(work, "corpus.txt"), "w") as fh:
            fh.write(text)
    comm.barrier()
    code = train.main(["--tokenizer", tokenizer_dir, "--data", os.path.join(work, "corpus.txt"), "--n-layer", "1",
                       "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--global-batch-size", "6",
                       "--max-iters", "1", "--eval-iters", "1", "--sample", "0", "--plot", ""])
    made = encodes_per_rank()
    assert code == 0 and made == [1] + [0] * (comm.size - 1), (code, made)
    if comm.rank == 0:
        shutil.rmtree(work)
        print("ok")
    sys.exit(0)

shared = mode == "all-miss"
copy = os.path.join(work, "all" if shared else f"rank{comm.rank}", "corpus.txt")
if comm.rank == 0:
    for r in ["all"] if shared else [f"rank{r}" for r in range(comm.size)]:
        os.makedirs(os.path.join(work, r))
        with open(os.path.join(work, r, "corpus.txt"), "w") as fh:
            fh.write(text)
    if mode == "some-miss":  # rank 0's copy already has its cache
        Dataset(text.encode(), tokenizer=BPETokenizer(tokenizer_dir), path=copy)
        encodes.clear()
comm.barrier()

data = Dataset(text.encode(), tokenizer=BPETokenizer(tokenizer_dir), path=copy, defer_cache=True, share_tokens=True)
cached = data.splits is not None
assert cached == (mode == "some-miss" and comm.rank == 0), (comm.rank, cached)
data.share_tokens(comm)
assert isinstance(data.splits["train"], numpy.memmap) == cached, comm.rank  # a rank with a cache keeps its map
data.keep_cache(comm)
assert isinstance(data.splits["train"], numpy.memmap), comm.rank  # the ids now paged in from the cache
ids = numpy.concatenate([data.splits["train"], data.splits["val"]])

made = encodes_per_rank()
caches = [f for f in os.listdir(os.path.dirname(copy)) if f.endswith(".tokens")]
assert len(caches) == 1, (comm.rank, caches)
maps = comm.all_gather(numpy.frombuffer(" ".join(mapped_caches()).encode().ljust(512), numpy.uint8).copy())
if comm.rank == 0:
    expected = plain_encode(BPETokenizer(tokenizer_dir), text)
    assert made == ([1] + [0] * (comm.size - 1) if shared else [0] * comm.size), made
    maps = {bytes(m).decode().strip() for m in maps}
    # one file for the ranks that share a corpus path, mapped by all of them, none of it renamed over
    assert all("(deleted)" not in m for m in maps) and len(maps) == (1 if shared else comm.size), maps
mine = numpy.array(ids, numpy.int64)
first = comm.broadcast(mine.copy())  # rank 0's ids, compared on every rank
assert numpy.array_equal(mine, first), comm.rank
if comm.rank == 0:
    assert numpy.array_equal(mine, expected)
    shutil.rmtree(work)
    print("ok")
