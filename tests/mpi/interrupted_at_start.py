"""``python -m minipar.train`` whose one rank is interrupted (as by Ctrl-C) before training starts:
``sys.argv[1]`` names where (``build``: while the corpus is read and tokenized; ``trainer``: while
the model is built or a checkpoint loaded), ``sys.argv[2]`` which rank (-1: every rank), the rest
are the run's flags. Runs on one process too (no launcher: rank 0)."""

import os
import sys

from minipar import train, trainer

where, chosen, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rank = int(next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK") if v in os.environ), 0))


def interrupted(original):
    def call(*args, **kwargs):
        if chosen in (-1, rank):
            raise KeyboardInterrupt  # what Python raises for a SIGINT arriving here
        return original(*args, **kwargs)
    return call


if where == "build":
    train.build = interrupted(train.build)
else:
    trainer.Trainer.__init__ = interrupted(trainer.Trainer.__init__)
sys.exit(train.main(flags))
