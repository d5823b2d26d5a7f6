"""The orders of the zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism").

Each backward is split in two (``minipar/weight_grad.py``): B, the gradient of the chunk's input,
which the previous stage waits for, and W, the gradients of its weights, which nobody waits for
and which can therefore run wherever a rank would otherwise idle. With T_F, T_B, T_W the costs of
F, B and W on every rank, 1F1B (B and W fused) idles (p - 1)(T_F + T_B + T_W) per step; the
schedules here move W's into that time:

* ``h1``, ZB-H1: 1F1B's order, and memory, with rank r holding back its last r W's for the drain:
  (p - 1)(T_F + T_B - T_W).
* ``h2``, ZB-H2: twice 1F1B's warm-up, so forwards fill the wait for the first gradient, and rank
  r holding back 2r W's: (p - 1)(T_F + T_B - 2 T_W) within each rank's span, for 2p - 1
  micro-batches held.
* ``v``, ZB-V: two chunks per rank in a V (rank r holds chunks r and 2p - 1 - r): 1F1B's memory (2p
  half-size chunk activations) and no bubble in steady state when T_F = T_B = T_W.

Each function returns one rank's compute order, [(op, micro-batch, local chunk)];
``schedules.py`` puts the messages around it. ``simulate.py`` checks them and their idle times.
"""

from minipar.parallel.pipeline.instructions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD


def held_back(m, warmup, kept_w):
    """One chunk per rank: ``warmup`` forwards, then one forward and the oldest B in turn, then the
    remaining B's. After each B the oldest W's run until at most ``kept_w`` are left waiting (those
    fill the drain, where 1F1B waits for gradients); they run last."""
    warmup = min(warmup, m)
    order, waiting = [(FORWARD, i, 0) for i in range(warmup)], []

    def b(i):
        order.append((BACKWARD_INPUT, i, 0))
        waiting.append(i)
        while len(waiting) > kept_w:
            order.append((BACKWARD_WEIGHT, waiting.pop(0), 0))

    for i in range(m - warmup):
        order.append((FORWARD, warmup + i, 0))
        b(i)
    for i in range(m - warmup, m):
        b(i)
    return order + [(BACKWARD_WEIGHT, i, 0) for i in waiting]


def h1(p, m, rank):
    """ZB-H1: 1F1B's warm-up, p - rank - 1 forwards; rank r keeps r W's back. Every rank then holds
    at most p micro-batches (F run, W not yet), as 1F1B's first stage does, and for m >= p and
    T_W <= T_F each idles (p - 1)(T_F + T_B - T_W)."""
    return held_back(m, p - rank - 1, rank)


def h2(p, m, rank):
    """ZB-H2: 2(p - rank - 1) warm-up forwards; rank r keeps 2r W's back. Every rank holds at most
    2p - 1 micro-batches, and for m >= 2p - 1 and T_W <= T_F each idles (p - 1)(T_F + T_B - 2 T_W)
    within the longest rank's span. The spans form a parallelogram (rank r starts r T_F late), so
    consecutive steps interlock only if the optimizer step does not synchronise the ranks (the
    paper's post-validation); with it synchronised, as here, the step takes
    m (T_F + T_B + T_W) + (p - 1) max(T_F, T_F + T_B - 2 T_W)."""
    return held_back(m, 2 * (p - rank - 1), 2 * rank)


def v(p, m, rank):
    """ZB-V for rank r, chunk 0 (global r, on the way down) and chunk 1 (global 2p - 1 - r, on the
    way up), in the phases of the paper's figure (the same construction as PyTorch's
    ScheduleZBVZeroBubble). Built for n = max(m, 2p - 1) micro-batches, then cut to m:

    1. 2(p - r) - 1 forwards of chunk 0: the first micro-batch needs that long to come back up;
    2. r times: a forward of chunk 1, then one of chunk 0;
    3. p - r times: F, B, W of chunk 1 (the last rank's chunk 1 turns round at once);
    4. steady state, until every forward has run: [F of chunk 0,] B, W of chunk 0, F, B, W of
       chunk 1;
    5. the drain: r times B of chunk 0 and of chunk 1; then p - r times B then W of chunk 0;
       then the W's still waiting, chunk 1's first.

    At most 2p chunk activations are held (each half a stage: 1F1B's p micro-batches). With
    T_F = T_B = T_W = T and m >= 2p - 1 every rank is busy from its first instruction to the end
    of the longest span, and a synchronised step idles only the slant, (p - 1) T."""
    n = max(m, 2 * p - 1)
    done = {(op, c): 0 for op in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) for c in (0, 1)}
    order = []

    def run(*steps):  # (op, chunk) pairs, each on the chunk's next micro-batch for that op
        for op, c in steps:
            order.append((op, done[op, c], c))
            done[op, c] += 1

    F, B, W = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT
    run(*[(F, 0)] * (2 * (p - rank) - 1))
    run(*[(F, 1), (F, 0)] * rank)
    run(*[(F, 1), (B, 1), (W, 1)] * (p - rank))
    while done[F, 0] < n or done[F, 1] < done[F, 0]:
        run(*([(F, 0)] if done[F, 0] < n else []), (B, 0), (W, 0), (F, 1), (B, 1), (W, 1))
    run(*[(B, 0), (B, 1)] * rank)
    run(*[(B, 0), (W, 0)] * (p - rank))
    run(*[(W, 1)] * (done[B, 1] - done[W, 1]), *[(W, 0)] * (done[B, 0] - done[W, 0]))
    return [(op, mb, c) for op, mb, c in order if mb < m]
