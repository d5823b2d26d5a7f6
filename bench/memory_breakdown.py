"""Memory per rank, measured, for several layouts of the same GPT on the same ranks.

    ./run_mpi.sh -n 8 bench/memory_breakdown.py                  # the table, and the figure
    ./run_mpi.sh -n 8 bench/memory_breakdown.py --plot docs/figures/memory_breakdown.png
    ./run_mpi.sh -n 4 bench/memory_breakdown.py --layouts DP ZeRO-3 TPxDP

Every layout trains the same GPT one step on the same global batch (the trainer's step: the
pipeline executor over --micro-batches, the optimizer from ``make_optimizer``) and each rank
measures four things:

    parameters, gradients, optimizer   the optimizer's ``state_bytes()`` after the step, as the
                                       trainer's --report prints them
    activations                        the most bytes the autograd graphs held at once: after every
                                       forward of the step, the graphs of all the micro-batches
                                       still waiting for their backward are walked from their
                                       outputs, and every distinct array a node keeps (its
                                       context, its input tensors) is added once, parameters left
                                       out (as bench/activation_memory.py measures one layer)

Why walk the graph rather than ask tracemalloc for the step's peak: the graph is exactly what is
held between a forward and its backward, and nothing else. tracemalloc's peak would add transient
buffers (a backward's temporaries, gradient buckets in flight, ZeRO-3's gathered unit, message
buffers) that belong to no one column; ``docs/activation_memory.md`` shows the two agree to the
byte where only the graph is alive. The chart shows the rank whose four columns add up to the
most ("the fullest rank"): that is the one that must fit.

Layout names: DP (all ranks data-parallel), ZeRO-1/2/3 (the same with ZeRO), TPxDP (TP 2),
3D (TP 2 x PP 2, ZeRO-1), PPxDP (PP 4 where 8 divides the ranks, else 2), CPxDP (CP 2, ring
attention), TP-SP (TP over every rank, sequence parallel).
"""

import os
import sys

import numpy as np

import minipar
from activation_memory import _root, held_buffers  # the graph walk: a script beside this one
from minipar.comm import world
from minipar.data import Dataset, load_corpus
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.cli import Parser, parse, positive_int

from flags import run_problems  # a script beside this one

FLAGS = {"n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd", "block_size": "--block-size",
         "global_batch": "--batch-size", "micro_batches": "--micro-batches"}

KINDS = ("parameters", "gradients", "optimizer", "activations")
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def layouts(n):
    """{name: (label, tp, cp, pp, zero stage, sequence parallel)} for n ranks (DP is the rest)."""
    pp = 4 if n % 8 == 0 else 2
    return {"DP": (f"DP{n}", 1, 1, 1, 0, False),
            "ZeRO-1": (f"DP{n} ZeRO-1", 1, 1, 1, 1, False),
            "ZeRO-2": (f"DP{n} ZeRO-2", 1, 1, 1, 2, False),
            "ZeRO-3": (f"DP{n} ZeRO-3", 1, 1, 1, 3, False),
            "TPxDP": (f"TP2 DP{n // 2}", 2, 1, 1, 0, False),
            "3D": (f"TP2 PP2 DP{n // 4} Z1", 2, 1, 2, 1, False),
            "PPxDP": (f"PP{pp} DP{n // pp}", 1, 1, pp, 0, False),
            "CPxDP": (f"CP2 DP{n // 2}", 1, 2, 1, 0, False),
            "TP-SP": (f"TP{n} SP", n, 1, 1, 0, True)}


def graph_bytes(outputs, params, batch=(), parked=()):
    """Bytes of the distinct arrays the graphs of ``outputs`` keep (outputs included), and the
    ``parked`` W's (``weight_grad.WeightGradients``: a split backward's, or the head's for the
    flush), less the parameters' (whose memory the optimizer's columns count) and the step's
    ``batch`` arrays (token ids and targets, which the caller holds whole and the embedding looks into)."""
    skip = {id(_root(a)) for a in [p.data for p in params] + list(batch)}
    held = held_buffers(outputs)
    for pending in parked:
        held.update(pending.buffers())
    return sum(a.nbytes for key, a in held.items() if key not in skip)


def batch_arrays(state):
    """The step's token ids and targets, as the executor's micro-batches look into them."""
    return [a for pair in state.micro for a in pair]


class MeasuringExecutor(PipelineExecutor):
    """The pipeline executor, which after every forward adds up what all the graphs kept for a
    backward hold; ``peak`` is the most over the step."""

    peak = 0

    def _forward(self, state, ins):
        super()._forward(state, ins)
        outputs = [out for _, out in state.kept.values()]
        self.peak = max(self.peak, graph_bytes(outputs, self.model.parameters(), batch_arrays(state)))


def measure(layout, args, comm, batch):
    """This rank's {kind: bytes} after one training step of ``layout``, and the optimizer."""
    _, tp, cp, pp, stage, sp = layout
    minipar.manual_seed(0)
    grid = ProcessGrid(tp, pp, comm.size // (tp * cp * pp), comm, cp=cp)
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                       dropout=0.1)
    model = GPT(config, grid, sequence_parallel=sp)
    opt = make_optimizer(model, grid, stage, bucket_bytes=args.bucket_kb << 10, **HYPER)
    run = MeasuringExecutor(model, grid, "1f1b", args.micro_batches, optimizer=opt)

    def update():
        opt.finish_gradients()
        opt.clip_grad_norm(1.0)
        opt.step()

    model.rng.iteration = 0
    run.step(*batch, optimizer_step=update)
    opt.zero_grad()
    held = opt.state_bytes()
    return {**{k: held.get(k, 0) for k in KINDS[:3]}, "activations": run.peak}, opt


def mb(nbytes):
    return f"{nbytes / 1e6:>8.3f}"


def fullest(comm, numbers):
    """On rank 0: (rank, its numbers) of the rank whose numbers add up to the most, and the most
    of each number over the ranks; None elsewhere."""
    every = comm.gather_to_root(np.array(numbers, np.int64), tag=7301)
    if every is None:
        return None
    every = np.stack(every)
    rank = int(np.argmax(every[:, :4].sum(axis=1)))
    return rank, every[rank], every.max(axis=0)


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    labels = [label for label, _, _, _ in rows]
    bottom = np.zeros(len(rows))
    for i, (kind, color) in enumerate(zip(KINDS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52"))):
        values = np.array([numbers[i] for _, _, numbers, _ in rows]) / 1e6
        ax.bar(labels, values, bottom=bottom, label=kind, color=color)
        bottom += values
    ax.set_ylabel("MB held by the fullest rank")
    ax.set_title(title, fontsize=10)
    ax.legend(frameon=False)
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # (checked with the flags, not made)
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", help="names from the module docstring (default: all that fit the ranks)")
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-head", type=positive_int, default=8)
    p.add_argument("--n-embd", type=positive_int, default=64)
    p.add_argument("--block-size", type=positive_int, default=64)
    p.add_argument("--batch-size", type=positive_int, default=32, help="the global batch of the step")
    p.add_argument("--micro-batches", type=positive_int, default=4)
    # the trainer's 4 MiB would hold this 0.9 MB model in one bucket (one ZeRO-2 group): nothing
    # could be sent, or dropped, before the whole backward is done
    p.add_argument("--bucket-kb", type=positive_int, default=64, help="gradient bucket (stage 0) / ZeRO group size (1-2)")
    p.add_argument("--plot", help="write the stacked bars here (PNG)")
    comm = world()
    chosen = layouts(comm.size)

    def problems_of(a, name):
        _, tp, cp, pp, stage, sp = chosen[name]
        return run_problems(FLAGS, world_size=comm.size, tp=tp, cp=cp, pp=pp, zero_stage=stage, sequence_parallel=sp,
                            n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size,
                            global_batch=a.batch_size, micro_batches=a.micro_batches)

    def check(a):
        from minipar.checkpoint.files import folder_problem
        from minipar.plots import path_problem

        unknown = [name for name in a.layouts or [] if name not in chosen]
        if unknown:
            return [f"--layouts: unknown {', '.join(unknown)}; choose from {', '.join(chosen)}"]
        found = [f"{name}: {line}" for name in a.layouts or [] for line in problems_of(a, name)]
        if a.plot:
            why = path_problem(a.plot) or folder_problem(os.path.dirname(os.path.abspath(a.plot)))
            found += [f"--plot {a.plot}: {why}"] * bool(why)
        return found

    args = parse(p, comm, check, argv)
    # by default every layout that fits this many ranks and this model
    names = args.layouts or [name for name in chosen if not problems_of(args, name)]
    if not names:
        raise SystemExit(f"no layout fits {comm.size} rank(s) with these sizes: {problems_of(args, 'DP')}")
    minipar.set_default_dtype("float32")
    batch = Dataset(load_corpus()).batch("train", 0, args.batch_size, args.block_size, 0)
    rows = []
    for name in names:
        numbers, opt = measure(chosen[name], args, comm, batch)
        found = fullest(comm, [numbers[k] for k in KINDS] + [opt.peak_state_bytes()])
        if found is not None:
            rows.append((chosen[name][0], *found))
    if comm.rank != 0:
        return 0
    title = (f"{comm.size} ranks, GPT {args.n_layer} layers, h {args.n_embd}, {args.n_head} heads, T {args.block_size}, "
             f"batch {args.batch_size} in {args.micro_batches} micro-batches, float32, 1 step")
    print(title)
    print("MB (1e6 bytes) held by the fullest rank; the last columns: the most over all ranks\n")
    print(f"{'layout':<16}{'rank':>5}{'params':>9}{'grads':>9}{'optim':>9}{'activ':>9}{'total':>9}"
          f" |{'max param':>10}{'max activ':>10}{'peak state':>11}")
    for label, rank, numbers, most in rows:
        print(f"{label:<16}{rank:>5}" + "".join(mb(v) for v in numbers[:4]) + mb(numbers[:4].sum())
              + f" |{mb(most[0]):>10}{mb(most[3]):>10}{mb(most[4]):>11}")
    if args.plot:
        plot(rows, args.plot, title)
        print(f"\nfigure written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
