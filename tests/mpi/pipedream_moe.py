"""PipeDream-2BW with a mixture of experts' auxiliary losses: an evaluation of another batch size
between two steps changes nothing. Each forward's auxiliary losses count as its share of its own
batch's tokens; the evaluation's batch once set that share for the forwards of the batch still in
flight, which then ran after it with the wrong weight in their loss.

    run_mpi.sh -n 2 tests/mpi/pipedream_moe.py
"""

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.pipedream import PipeDream2BW
from minipar.parallel.pipeline.weight_stash import WeightStash
from minipar.verify import rel_err

M = 3
minipar.set_default_dtype("float64")
grid = ProcessGrid(tp=1, pp=2)
config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, num_experts=4,
                   moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
data = np.random.default_rng(0)
batches = [tuple(data.integers(0, 32, (2 * M, 8)) for _ in "xy") for _ in range(2)]
x_eval = data.integers(0, 32, (M, 8))  # half the training batch's rows


def stream(evaluate):
    """Batch 0 with batch 1 following, [an evaluation,] then batch 1 and the drain: the parameters."""
    minipar.manual_seed(3)
    model = GPT(config, grid)
    opt = WeightStash(make_optimizer(model, grid, 0, lr=2e-2))
    run = PipeDream2BW(model, grid, M, opt)
    for t, (x, y) in enumerate(batches):
        model.rng.iteration = t
        run.step(x, y, optimizer_step=opt.step, following=batches[1] if t == 0 else None)
        opt.zero_grad()
        if t == 0 and evaluate:  # batch 1's first forwards have run: it is in flight
            model.eval()
            run.evaluate(x_eval, x_eval)
            model.train()
    return {n: q.data.copy() for n, q in model.named_parameters()}


plain, evaluated = stream(False), stream(True)
worst = max(rel_err(evaluated[n], plain[n]) for n in plain)
rank = world().rank
assert worst < 1e-13, f"rank {rank}: an evaluation between the steps moved the parameters by {worst:.1e}"
print(f"rank {rank}: pipedream-2bw with experts OK (an evaluation between steps: {worst:.1e})", flush=True)
