"""Where a training run's time goes, op by op and rank by rank: the trainer under ``minipar.op_times``.

    ./run_mpi.sh -n 2 bench/op_times.py --pp 2 --micro-batch-size 2 --schedule 1f1b
    ./run_mpi.sh -n 2 bench/op_times.py --cp 2 --cp-comm-type p2p
    ./run_mpi.sh -n 1 bench/op_times.py            # one rank: the reference

Every flag goes to ``python -m minipar.train``, after these defaults: the model and batch of
``bench/scaling.py`` (4 heads, 128 tokens, a global batch of 16, seed 0), 12 iterations, one
evaluation batch at the end, no sample, no plot. Printed: each op's forward and backward
milliseconds per iteration on every rank, averaged over all iterations (the first ones, which
build caches, included; evaluations are not timed), the mean step time the trainer logged, and
the difference: what runs outside every op, the optimizer, the engine's
bookkeeping, a pipeline's executor and its waits for other stages (an op's own waits, a collective
inside a tensor-parallel region or a ring's messages, are the op's). Set two runs side by side to see
where a layout's step goes: ``bench/scaling.py`` says how much it loses, this says in what.
"""

import contextlib
import json
import os
import sys
import tempfile

from minipar import train
from minipar.comm import world
from minipar.op_times import OpTimes
from minipar.run_inputs import broadcast_text
from minipar.train_report import gather_text
from minipar.trainer import Trainer

DEFAULTS = ["--n-head", "4", "--block-size", "128", "--global-batch-size", "16", "--seed", "0", "--max-iters", "12",
            "--eval-interval", "1000", "--eval-iters", "1", "--sample", "0", "--plot", "", "--log-interval", "1000"]


@contextlib.contextmanager
def untimed_evaluations(times):
    """The trainer's evaluations run with the timer paused: the table is the training steps'."""
    evaluate = Trainer.evaluate

    def untimed(self):
        with times.paused():
            return evaluate(self)

    Trainer.evaluate = untimed
    try:
        yield
    finally:
        Trainer.evaluate = evaluate


def main(argv):
    comm = world()
    folder = broadcast_text(comm, tempfile.mkdtemp(prefix="op_times_") if comm.rank == 0 else "")
    parser = train.build_parser()
    typed = parser.typed(argv)  # a default the user gave under any of its names gives way
    dest = {flag: parser._option_string_actions[flag].dest for flag in DEFAULTS[::2]}  # noqa: SLF001
    defaults = [word for flag, value in zip(DEFAULTS[::2], DEFAULTS[1::2]) if dest[flag] not in typed
                for word in (flag, value)]
    given = defaults + ["--log-json", os.path.join(folder, "log.json")] + argv  # one command line on all ranks
    with OpTimes() as times, untimed_evaluations(times):
        status = train.main(given)
    if status:
        return status
    args = train.build_parser().parse_args(given)  # the run took them: they parse
    iterations, log = args.max_iters, args.log_json
    rows = {name: (forward + backward) / iterations for name, forward, backward, _, _ in times.rows()}
    texts = gather_text(comm, json.dumps(rows))  # on rank 0
    if texts is None:
        return 0
    tables = [json.loads(t) for t in texts]
    with open(log) as f:
        step = sum(json.loads(line)["ms"] for line in f) / 1e3 / iterations
    names = sorted({n for t in tables for n in t}, key=lambda n: -max(t.get(n, 0) for t in tables))
    ranks = range(len(tables))
    print(f"{' '.join(argv) or 'one rank'}: ms per iteration, each op's forward + backward\n")
    print(f"{'op':<24}" + "".join(f"{'rank ' + str(r):>10}" for r in ranks))
    for name in names:
        print(f"{name:<24}" + "".join(f"{1e3 * t.get(name, 0):>10.2f}" for t in tables))
    print(f"{'(outside every op)':<24}" + "".join(f"{1e3 * (step - sum(t.values())):>10.2f}" for t in tables))
    print(f"{'(step)':<24}{1e3 * step:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
