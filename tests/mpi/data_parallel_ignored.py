"""One data-parallel step against the single-device run (float64), rank 0's targets all ignored
and a few of another's: L = (1/N) * sum over all ranks' tokens of l_i, so that rank adds zero; then
a step whose every target is ignored, refused on every rank alike (tests/test_data_parallel.py).

    run_mpi.sh -n 2 tests/mpi/data_parallel_ignored.py
"""

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.data import DataParallelAdamW, scale_loss, split_batch, token_count


def on_ranks():
    minipar.set_default_dtype("float64")
    world()
    grid = ProcessGrid(tp=1, pp=1)
    dp = grid.dp_group
    config = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab_size=13, dropout=0.1)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 13, (2 * dp.size, 6)), rng.integers(0, 13, (2 * dp.size, 6))
    y[:2] = -1  # rank 0's rows: nothing to count (its own mean would be a mean of nothing)
    y[-1, :3] = -1  # and a few of another rank's
    minipar.manual_seed(0)
    serial = GPT(config)
    replica = GPT(config, grid)
    replica.load_state_dict(serial.state_dict())
    ddp = DataParallelAdamW(replica, dp)
    serial.rng.set_state(replica.rng.state())
    serial(x, y)[1].backward()
    xs, ys = split_batch(x, y, dp)
    # N counted two ways: from the global batch every rank holds, and from each rank's own targets
    for total in (token_count(y), token_count(ys, comm=dp)):
        logits, _ = replica(xs)
        scale_loss(replica.loss(logits, ys, reduction="sum"), total).backward()
        ddp.finish_gradients()
        for (name, p_s), p in zip(serial.named_parameters(), replica.parameters()):
            error = np.abs(p.grad - p_s.grad).max() / max(np.abs(p_s.grad).max(), 1e-300)
            if not error < 1e-12:
                raise AssertionError(f"rank {dp.rank}: gradient of {name}: relative error {error:.1e}")
        ddp.zero_grad()
    # every target ignored: every rank counts N = 0 and refuses, before backward starts any sum
    ys = np.full_like(ys, -1)
    logits, _ = replica(xs)
    try:
        scale_loss(replica.loss(logits, ys, reduction="sum"), token_count(ys, comm=dp))
        raise AssertionError(f"rank {dp.rank}: a step with no counted target was accepted")
    except ValueError as e:
        assert "all equal ignore_index" in str(e), e
    refused = dp.all_reduce(np.array([1], np.int64))[0]  # every rank is still in step
    if dp.rank == 0 and refused == dp.size:
        print(f"ignored-rank data parallel OK on {dp.size} ranks")


if __name__ == "__main__":
    on_ranks()
