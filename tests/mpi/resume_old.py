"""The trainer resuming from iter_N.old (a re-save that stopped between its two renames), with
every rank but 0 reading it late: rank 0 puts it back under its own name, which must wait until
every rank has read it (ranks that read after the rename found their files gone)."""

import sys
import time

from minipar import train
from minipar.checkpoint import sharded
from minipar.comm import world

if world().rank != 0:
    load = sharded.load

    def late(*args, **kwargs):
        time.sleep(1.5)
        return load(*args, **kwargs)

    sharded.load = late
sys.exit(train.main(sys.argv[1:]))
