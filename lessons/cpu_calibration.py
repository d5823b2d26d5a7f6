"""Lesson 11's micro-benchmarks: what the planner's Machine needs to predict a step on this CPU.

One round of them (``calibrate``): the FLOP rate of a core with every rank running
(``mfu.measured_peak``), beta by a 1 MB ping-pong, ``overheads``: a layer pass's and the
embedding and head's launch cost, alpha and a per-call cost of a collective issued between steps,
and ``update_costs``: AdamW's step and the gradient norm per array and per element.
The lesson runs a round before each round of layout steps and takes each number's median.
"""

import statistics
import time

import numpy as np

from minipar.autograd import Tensor
from minipar.functional.blockwise import Block, OnlineSoftmax, attend, attend_backward
from minipar.mfu import measured_peak
from minipar.models import GPT, GPTConfig
from minipar.nn import Parameter
from minipar.optim import AdamW
from minipar.parallel.grad_norm import grad_norm
from minipar.parallel.collectives import reduce_from_region
from minipar.plan.traffic import latency_steps
from minipar.rng import context_positions


def calibrate(comm, model, cores, repeats):
    """(FLOP/s of a core, all running; beta; layer, edge, alpha, call, ring pass; AdamW's and the
    norm's seconds per array and per element, ``update_costs``): one round's micro-benchmarks."""
    rate = measured_peak(comm, np.float32, rounds=1) / cores
    one_way, beta = alpha_beta(comm) if comm.size > 1 else (0.0, 0.0)
    mine = np.zeros(5)
    if comm.rank == 0:
        mine[0] = median_times([ring_pass(model, min(comm.size, 4))], 2 * repeats)[0]
        mine[1:] = update_costs(repeats)
    comm.barrier()
    ring, *update = comm.all_reduce(mine, op="max")
    return (rate, beta, *overheads(comm, model, repeats, one_way), float(ring), *map(float, update))


def update_costs(repeats, counts=(8, 32), sizes=(64, 4096)):
    """(AdamW per array, per element, the norm per array, per element) in seconds, on one core:
    minipar's ``AdamW.step`` and ``grad_norm`` timed on ``counts`` arrays of each of ``sizes``
    float32 elements (all within one cache block, as a small model's tensors are), and each fitted
    by least squares as t = arrays x a + elements x b (``plan.update``'s model). The sizes span a
    lesson's tensors (h = 32: 32 to 8,192 elements): the small arrays are mostly the per-array cost,
    the large ones mostly the per-element one."""
    runs, shapes = [], []
    for count in counts:
        for size in sizes:
            rng = np.random.default_rng(size + count)
            params = [Parameter(rng.standard_normal(size).astype(np.float32)) for _ in range(count)]
            for p in params:
                p.grad = rng.standard_normal(size).astype(np.float32)
            runs += [AdamW(params).step, lambda params=params: grad_norm(params)]
            shapes.append((count, count * size))
    times = median_times(runs, 4 * repeats)
    design = np.array(shapes, dtype=np.float64)
    fit = [np.linalg.lstsq(design, np.array(times[k::2]), rcond=None)[0] for k in (0, 1)]
    return tuple(max(0.0, float(v)) for pair in fit for v in pair)


def ring_pass(model, cp):
    """One pass of ring attention without its messages (``parallel/ring_attention.py``): a K,V
    block's attention forward and backward for the queries of a rank of ``cp``, on one sequence,
    at the model's heads and T / CP positions per rank (the launches of each pass beyond a layer's own)."""
    heads, size = model.num_attention_heads, model.hidden_size // model.num_attention_heads
    length = model.seq_length // cp
    q, k, v, dy = np.random.default_rng(0).standard_normal((4, 1, heads, length, size)).astype(np.float32)
    queries, keys = Block(context_positions(length, (cp - 1, cp))), Block(context_positions(length, (0, cp)))
    scale = size ** -0.5

    def run():
        state = OnlineSoftmax(q)
        attend(state, q, k, v, queries, keys, scale, None)
        y, lse = state.result()
        attend_backward(q, k, v, dy, lse, (dy * y).sum(-1), queries, keys, scale, None, np.zeros_like(q),
                        np.zeros((2,) + k.shape, k.dtype))
    return run


def alpha_beta(comm, repeats=20):
    """(alpha seconds, beta seconds per byte) from a ping-pong between ranks 0 and 1 (one-way times)."""
    one_way = []
    for nbytes in (8, 1 << 20):
        buf = np.zeros(nbytes // 8)
        best = float("inf")
        for _ in range(repeats):
            comm.barrier()
            start = time.perf_counter()
            if comm.rank == 0:
                comm.send(buf, 1, tag=11)
                comm.recv(buf, 1, tag=12)
            elif comm.rank == 1:
                comm.recv(buf, 0, tag=11)
                comm.send(buf, 0, tag=12)
            best = min(best, (time.perf_counter() - start) / 2)
        one_way.append(best)
    mine = np.array(one_way if comm.rank == 0 else [0.0, 0.0])
    small, large = comm.all_reduce(mine)
    return small, max(large - small, 1e-12) / ((1 << 20) - 8)


def median_times(fns, repeats, comm=None):
    """The median seconds of each of ``fns`` over ``repeats`` calls (after one warm-up call each),
    taken in turn, so that a load that comes and goes weighs on each alike; with ``comm``, each
    call starts at a barrier."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, mine in zip(fns, times):
            if comm is not None:
                comm.barrier()
            start = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def tiny_gpt(model, n_layer):
    """``model``'s GPT with ``n_layer`` layers and a step of it (forward and backward) on one 8-token
    sequence: so few FLOPs that its time is the launches' (Python's and NumPy's per-call cost)."""
    config = GPTConfig(n_layer=n_layer, n_head=model.num_attention_heads, n_embd=model.hidden_size,
                       block_size=model.seq_length, vocab_size=model.vocab_size, dropout=model.dropout)
    model, idx = GPT(config), Tensor(np.zeros((1, 8), dtype=np.int64))
    return lambda: model.forward(idx, idx)[1].backward()


def overheads(comm, model, repeats=15, one_way=0.0, block=4):
    """(layer, edge, alpha, call) in seconds; ``one_way``: ``alpha_beta``'s 8-byte one-way time.

    Launches: rank 0 alone times a 1- and a 5-layer GPT on 8 tokens (the others wait at a barrier
    without spinning): layer = (t5 - t1) / 4, edge = t1 - layer, one rank's cost on a core of its
    own (``plan.overhead`` adds the sharing of cores).
    Calls: what a collective costs inside a step, where the ranks it waits for are computing (and,
    sharing cores, may not be running): every rank runs a 1-layer GPT step ``block`` times, alone
    (t_0), then each followed by 4 all-reduces of 8 bytes over the world (t_N, 2 log2 N steps each,
    as ``plan.traffic.latency_steps`` counts them) and over pairs (t_2, 2 steps). Each is made as a
    step makes its collectives, through autograd (``reduce_from_region`` and its backward: a graph
    node made and then walked, and the communicator's checks and accounting), not as a bare MPI
    call: the Python around a call is most of its cost when the ranks have a core each. Per
    all-reduce a_N = (t_N - t_0) / 4 block, so alpha = (a_N - a_2) / (2 (log2 N - 1)) and
    call = a_2 - 2 alpha. With N = 2 the world is the pair and cannot tell alpha from the call:
    alpha is then ``one_way``, the ping-pong's one-way time of 8 bytes, the call the rest of a_2."""
    mine = np.zeros(4)
    if comm.rank == 0:
        one, five = median_times([tiny_gpt(model, 1), tiny_gpt(model, 5)], 2 * repeats)
        mine[:2] = (five - one) / 4, one - (five - one) / 4
    comm.barrier()
    x, one = np.zeros(1, np.float32), np.ones(1, np.float32)
    pair, work = comm.split(comm.rank // 2, comm.rank, "pair"), tiny_gpt(model, 1)

    def steps(group):
        def run():
            for _ in range(block):
                work()
                for _ in range(4 if group is not None else 0):
                    reduce_from_region(Tensor(x, requires_grad=True), group).backward(one)
        return run
    if comm.size > 1:
        alone, over_world, over_pairs = median_times([steps(None), steps(comm), steps(pair)], repeats, comm)
        mine[2] = (over_world - alone) / (4 * block)
        mine[3] = (over_pairs - alone) / (4 * block)
    layer, edge, world, pairs = comm.all_reduce(mine, op="max")
    if comm.size == 1:
        return layer, edge, 0.0, 0.0
    if comm.size == 2:
        return layer, edge, one_way, max(0.0, pairs - 2 * one_way)
    alpha = max(0.0, world - pairs) / (latency_steps("all_reduce", comm.size) - 2)
    return layer, edge, alpha, max(0.0, pairs - 2 * alpha)
