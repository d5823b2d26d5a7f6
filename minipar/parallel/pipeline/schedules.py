"""Pipeline schedules as data: for each rank, the list of instructions it executes in one step.

A pipeline of p ranks runs m micro-batches. With ``v`` virtual stages (model chunks) per rank, the
model's layers are cut into p*v chunks placed round-robin (Megatron-LM): rank r holds global chunks
r, p + r, 2p + r, ... so a micro-batch visits ranks 0, 1, ..., p-1, 0, 1, ... v times. Local chunk c
of rank r is global chunk ``c*p + r`` (in ZB-V's V, chunks r and 2p - 1 - r).

The schedules differ only in the order of forwards and backwards (the communication is put
around them by the same rule); what an instruction is, and which rank holds which chunk, is
``instructions.py``:

* ``gpipe`` (Huang et al. 2019): every forward, then every backward. All m micro-batches'
  activations are alive at once.
* ``one_f_one_b`` (PipeDream-Flush, Narayanan et al. 2021): rank r runs p - r - 1 warm-up forwards,
  then alternates one forward and one backward, then drains the remaining backwards. At most
  p - r micro-batches are alive: the memory of p micro-batches, whatever m is. Same bubble as GPipe.
* ``one_f_one_b_slack``: 1F1B with one more warm-up forward on every rank but the last. With equal
  and steady stages it runs exactly as 1F1B (the same bubble); the extra forward is slack: a
  stage that runs a little late no longer makes its neighbour wait at once. In 1F1B's steady state
  each stage's next forward and next backward both wait on a message its neighbour sends only
  just in time, so a late instruction there idles the other stage; with a forward queued ahead,
  the next stage always has one to run. The price is one more micro-batch's activations on ranks 0 to
  p - 2 (p - r + 1 instead of p - r). docs/pipeline_parallel.md measures what it buys.
* ``interleaved_one_f_one_b`` (Narayanan et al. 2021, Megatron-LM): 1F1B over v chunks per rank;
  each step of the pipeline is 1/v as long, so the fill and drain shrink v-fold.
* ``zb_h1``, ``zb_h2``, ``zb_v`` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward
  split into B and W, W moved into the bubble; their orders are ``zero_bubble.py``.
* ``pipedream_2bw`` (PipeDream-2BW, Narayanan et al. 2021): 1F1B with no flush between batches: the
  next batch's forwards fill what would be the drain. Its weights are stashed (``weight_stash.py``)
  and its executor runs across steps (``pipedream.py``).

``build(..., defer_head=True)`` adds Megatron-LM's deferred embedding wgrad to a schedule whose
backwards are whole (``defer_head_weight``).

Sends never block (a send only starts) and receives do, so a schedule is free of deadlock exactly
when replaying the sends and receives in order always lets some rank move on: ``simulate.py``
checks that, and measures each schedule's bubble with unit costs.
"""

from functools import lru_cache

from minipar.parallel import validate
from minipar.parallel.pipeline import zero_bubble
from minipar.parallel.pipeline.instructions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT,  # noqa: F401 (re-exported)
                                                    BACKWARDS, COMPUTE, FORWARD, HEAD_WEIGHT, LETTERS, RECV_ACT,
                                                    RECV_GRAD, SEND_ACT, SEND_GRAD, STEP, Instruction, Pipeline)

NAMES = {"pp": "p", "micro_batches": "m", "virtual_stages": "v"}  # a message's words for the sizes


def check(p, m, v=1, n_layer=None, interleaved=False, schedule=None):
    """Raise a ValueError naming every requirement the sizes break (call it on every rank before
    any communication). The rules are the run's (``minipar.parallel.validate``), asked in this
    module's letters: p ranks, m micro-batches, v chunks per rank."""
    schedule = schedule or ("interleaved" if interleaved else "1f1b")
    validate.check(validate.RunConfig(pp=p, micro_batches=m, virtual_stages=v, n_layer=n_layer, schedule=schedule),
                   names=NAMES, what="pipeline schedule")


def _with_communication(pipe, rank, compute):
    """Put the receives before and the sends after each forward and backward. The first global
    chunk reads token ids, the last computes the loss: those need no activation or gradient."""
    last = pipe.n_chunks - 1
    out = []
    for op, mb, c in compute:
        g = pipe.global_chunk(rank, c)
        if op == FORWARD:
            if g > 0:
                out.append(_instruction(RECV_ACT, mb, c))
            out.append(_instruction(FORWARD, mb, c))
            if g < last:
                out.append(_instruction(SEND_ACT, mb, c))
        elif op in BACKWARDS:
            if g < last:
                out.append(_instruction(RECV_GRAD, mb, c))
            out.append(_instruction(op, mb, c))
            if g > 0:
                out.append(_instruction(SEND_GRAD, mb, c))
        else:  # W: the weights' gradients, local
            out.append(_instruction(op, mb, c))
    out.append(Instruction(STEP))
    return out


# every rank's list holds the same (op, mb, chunk) instructions, which are frozen: each made once
# (making them was half of a build, and the planner builds hundreds of schedules)
_instruction = lru_cache(maxsize=65536)(Instruction)


def gpipe(p, m, rank):
    check(p, m)
    return _with_communication(Pipeline(p, m), rank, gpipe_order(m))


def gpipe_order(m):
    return [(FORWARD, i, 0) for i in range(m)] + [(BACKWARD, i, 0) for i in range(m)]


def one_f_one_b(p, m, rank, slack=0):
    """1F1B; with ``slack`` = k, every rank but the last runs k more warm-up forwards (1F1B-slack)."""
    check(p, m)
    return _with_communication(Pipeline(p, m), rank, one_f_one_b_order(p, m, rank, slack))


def one_f_one_b_order(p, m, rank, slack=0):
    """The (op, mb, chunk) compute order of ``one_f_one_b``'s rank, unchecked, without messages."""
    # the forwards in flight when the first gradient comes back; the last rank's backward needs
    # only its own forward, so more in flight there would only hold memory
    warmup = min(p - rank - 1 + (slack if rank < p - 1 else 0), m)
    compute = [(FORWARD, i, 0) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, then the oldest backward
        compute += [(FORWARD, warmup + i, 0), (BACKWARD, i, 0)]
    return compute + [(BACKWARD, i, 0) for i in range(m - warmup, m)]


def one_f_one_b_slack(p, m, rank):
    return one_f_one_b(p, m, rank, slack=1)


def zb_h1(p, m, rank):
    """ZB-H1 (Qi et al. 2024): 1F1B with the backward split, rank r holding back its last r W's
    (``zero_bubble.h1``): 1F1B's memory, the bubble (p - 1)(T_F + T_B - T_W)."""
    check(p, m, schedule="zb-h1")
    return _with_communication(Pipeline(p, m), rank, zero_bubble.h1(p, m, rank))


def zb_h2(p, m, rank):
    """ZB-H2 (Qi et al. 2024): twice 1F1B's warm-up, rank r holding back its last 2r W's
    (``zero_bubble.h2``): 2p - 1 micro-batches held, no bubble in steady state when T_F + T_B = 2 T_W."""
    check(p, m, schedule="zb-h2")
    return _with_communication(Pipeline(p, m), rank, zero_bubble.h2(p, m, rank))


def zb_v(p, m, rank):
    """ZB-V (Qi et al. 2024): two chunks per rank in a V (``zero_bubble.v``): 1F1B's memory and,
    when T_F = T_B = T_W, no bubble in steady state; messages go both ways."""
    check(p, m, 2, schedule="zb-v")
    return _with_communication(Pipeline(p, m, 2, "v"), rank, zero_bubble.v(p, m, rank))


def two_bw_order(p, m, rank, batch, forwarded, following):
    """PipeDream-2BW's compute for one batch on ``rank``: the backwards of global micro-batches
    batch*m .. (batch+1)*m - 1, each after the forwards 1F1B keeps ahead of it (p - rank - 1), taken
    from the next batch when there is one (``following``), else drained. ``forwarded``: the forwards
    the rank ran so far (global micro-batch indices 0 .. forwarded - 1). Returns (compute, forwarded).
    Over batches that all have a following one this is 1F1B over all their micro-batches: no flush.
    No rank runs a forward of the batch after next, so two weight versions suffice."""
    warmup, limit = p - rank - 1, (batch + 2 if following else batch + 1) * m
    compute = []
    for k in range(batch * m, (batch + 1) * m):
        while forwarded <= min(k + warmup, limit - 1):
            compute.append((FORWARD, forwarded, 0))
            forwarded += 1
        compute.append((BACKWARD, k, 0))
    return compute, forwarded


def two_bw_instructions(p, m, rank, batch, forwarded, following):
    """``two_bw_order`` with its messages and the batch's step: (instructions, forwarded)."""
    compute, forwarded = two_bw_order(p, m, rank, batch, forwarded, following)
    return _with_communication(Pipeline(p, m * (batch + 2)), rank, compute), forwarded


def pipedream_2bw(p, m, rank, batches=1):
    """``batches`` batches of PipeDream-2BW back to back, a step after each one's last backward
    (micro-batch k of the stream is micro-batch k mod m of batch k div m). One batch is 1F1B."""
    check(p, m, schedule="pipedream-2bw")
    out, forwarded = [], 0
    for b in range(batches):
        instructions, forwarded = two_bw_instructions(p, m, rank, b, forwarded, b + 1 < batches)
        out += instructions
    return out


def _mb(k, p, v):
    """The micro-batch of a rank's k-th forward (or backward) in the interleaved order."""
    return (k // (p * v)) * p + k % p


def interleaved_one_f_one_b(p, m, v, rank):
    """Megatron-LM's order. The k-th forward of a rank (k = 0 .. v*m - 1) takes micro-batches in
    groups of p through all v chunks before the next group:

        chunk(k) = (k mod p*v) div p        mb(k) = (k div p*v) * p + k mod p

    and its k-th backward goes through the chunks in reverse (chunk v - 1 - chunk(k)). Warm-up:
    (p - rank - 1) * 2 + (v - 1) * p forwards, enough that the first backward's gradient has
    come back down the v passes of the pipeline by the time it is needed; so a rank holds at most
    warm-up + 1 chunk activations. (Megatron-LM makes every forward a warm-up one when m = p; the
    simulator shows the rule above free of deadlock there too, with the same bubble and fewer
    activations held, so it is used for every m.)"""
    check(p, m, v, interleaved=True)
    return _with_communication(Pipeline(p, m, v), rank, interleaved_order(p, m, v, rank))


def interleaved_order(p, m, v, rank):
    """The (op, mb, chunk) compute order of ``interleaved_one_f_one_b``'s rank, unchecked and
    without its messages (what the planner walks for the chunks in flight, at any size)."""
    total = v * m

    def chunk(k, forward):
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    compute = [(FORWARD, _mb(k, p, v), chunk(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        k = warmup + i
        compute += [(FORWARD, _mb(k, p, v), chunk(k, True)), (BACKWARD, _mb(i, p, v), chunk(i, False))]
    return compute + [(BACKWARD, _mb(k, p, v), chunk(k, False)) for k in range(total - warmup, total)]


def forward_only(p, m, v, rank, shape="round-robin"):
    """Forwards alone, for evaluation: every micro-batch through every chunk, in the interleaved
    forward order (for v = 1 simply micro-batch 0, 1, ...), no backward and no step. In a V, all
    of chunk 0 then all of chunk 1: chunk 1 waits only on the ranks after this one, never on
    this rank's chunk 0 beyond what it has done."""
    check(p, m, v, schedule="zb-v" if shape == "v" else "interleaved" if v > 1 else "1f1b")
    if shape == "v":
        order = [(i, c) for c in range(2) for i in range(m)]
    else:
        order = [(_mb(k, p, v), (k % (p * v)) // p) for k in range(v * m)] if v > 1 else [(i, 0) for i in range(m)]
    return _with_communication(Pipeline(p, m, v, shape), rank, [(FORWARD, mb, c) for mb, c in order])[:-1]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "1f1b-slack": one_f_one_b_slack,
             "interleaved": interleaved_one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2, "zb-v": zb_v,
             "pipedream-2bw": pipedream_2bw}
SHAPES = {"zb-v": "v"}  # how a schedule places the chunks, when not round-robin


def compute_order(name, p, m, v, rank):
    """One rank's (op, mb, local chunk) compute order of a flushed schedule, unchecked and without
    its messages (``build`` checks m against MPI's message tags; the planner walks any size)."""
    if name == "interleaved":
        return interleaved_order(p, m, v, rank)
    if name in ("zb-h1", "zb-h2", "zb-v"):
        return getattr(zero_bubble, name[3:])(p, m, rank)
    return gpipe_order(m) if name == "gpipe" else one_f_one_b_order(p, m, rank, slack=int(name == "1f1b-slack"))


def shape_of(name):
    """How the ``name`` schedule places the chunks on the ranks (``Pipeline.shape``)."""
    return SHAPES.get(name, "round-robin")


def build(name, p, m, v=1, defer_head=False):
    """Every rank's instruction list for a schedule by name: {rank: [Instruction]}; ``defer_head``:
    with the head's weight gradients at the flush (``defer_head_weight``)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if defer_head:
        validate.check(validate.RunConfig(pp=p, schedule=name, defer_embedding_wgrad=True),
                       names=NAMES, what="pipeline schedule")
    if name == "interleaved":
        plans = {r: interleaved_one_f_one_b(p, m, v, r) for r in range(p)}
    elif name == "zb-v":
        check(p, m, v, schedule=name)  # raises unless v = 2
        plans = {r: zb_v(p, m, r) for r in range(p)}
    else:
        if v != 1:
            check(p, m, v)  # raises: virtual stages need the interleaved schedule
        plans = {r: SCHEDULES[name](p, m, r) for r in range(p)}
    return defer_head_weight(plans, Pipeline(p, m, v)) if defer_head else plans


def defer_head_weight(plans, pipe):
    """Megatron-LM's deferred embedding wgrad (``--defer-embedding-wgrad-compute``): the rank
    holding the last chunk leaves out of each of its backwards the tied head's weight gradient,
    dW = dlogits^T x (the head's B keeps dx = dlogits W, which the stage before waits for), and runs
    them all just before the step, as ``head_weight`` instructions in the backwards' order. In a
    flushed schedule the last stage finishes first: its last backward is done while the gradient
    still travels down the other p - 1 stages, so the flush hides the deferred products, and every
    micro-batch's backward on the critical path is shorter by one product of the vocabulary's
    size. The price: each micro-batch's head input and logits' gradient, held until the flush."""
    rank, head = pipe.place(pipe.n_chunks - 1)
    order = plans[rank]
    deferred = [Instruction(HEAD_WEIGHT, ins.mb, ins.chunk) for ins in order
                if ins.op == BACKWARD and ins.chunk == head]
    return {**plans, rank: order[:-1] + deferred + order[-1:]}  # the step stays last


def table(schedules, compute_only=True):
    """The schedule as text, one column per rank: F3.1 is the forward of micro-batch 3 on local
    chunk 1 (the chunk is left out when v = 1), B the backward (or, split, its input half) and W
    the weights' half."""
    def cell(ins):
        tag = LETTERS.get(ins.op, ins.op)
        return tag if ins.op == STEP else f"{tag}{ins.mb}" + (f".{ins.chunk}" if interleaved else "")

    interleaved = any(i.chunk for s in schedules.values() for i in s)
    cols = {r: [cell(i) for i in s if not compute_only or i.op in COMPUTE]
            for r, s in schedules.items()}
    width = max([len(c) for col in cols.values() for c in col] + [len(f"rank {r}") for r in cols]) + 2
    rows = [" " * 5 + "".join(f"rank {r}".ljust(width) for r in cols)]
    for k in range(max(len(c) for c in cols.values())):
        rows.append(f"{k:>3}  " + "".join((col[k] if k < len(col) else "").ljust(width) for col in cols.values()))
    return "\n".join(row.rstrip() for row in rows)
