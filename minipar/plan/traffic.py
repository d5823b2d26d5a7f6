"""Bytes each rank sends per step, per group: the numbers the communicators count (``group.stats``).

Every collective is charged as ``comm.stats`` charges it (``ring_bytes``: the ring algorithm's
bytes per rank, NCCL's "bus bandwidth" convention: an all-reduce of S over N ranks 2 (N-1)/N S, a
reduce-scatter or all-gather (N-1)/N S, an all-to-all (N-1)/N of its input, applied to the bytes
of all of a step's calls of one op in one group together), so a prediction and a measurement are
the same arithmetic. Per micro-batch, with b its sequences, s = T/CP the
positions of a rank, h the hidden size, t the TP size, d the bytes of a value and S = b s h d the
activation of one micro-batch:

  tp   Megatron's f and g (Shoeybi et al. 2019): per dense block 2 all-reduces of S forward (after
       attention's and the MLP's row-parallel layer) and 2 backward (before the column-parallel
       ones), one more of each per recomputed forward; the vocabulary-parallel embedding forward
       and the head's input backward, one each; the cross-entropy 2 over the tokens (the row
       maximum, b s values, and the sums with the target logits, 2 b s). Sequence parallelism
       (Korthikanti et al. 2022) turns each all-reduce into a reduce-scatter and an all-gather of
       the same S (the same bytes) and adds, once per step, the all-reduce of the partial gradients
       of what every TP rank holds whole: positions T h, 6 h per block, 2 h for ln_f.
  dp   DP x CP ranks ("dp_cp" when CP > 1). ZeRO stage 0: each gradient once, all-reduced in
       buckets (after the last micro-batch); stage 1: one reduce-scatter and one all-gather of the
       parameters' bytes P d (Rajbhandari et al. 2020); stage 2: the reduce-scatter every
       micro-batch; stage 3: each unit's parameters all-gathered before its forward and before
       its backward (or B) for the groups that backward reads (not the embeddings' lookups), and
       its gradients reduce-scattered every micro-batch unless the model sums them after
       backward (``zero3.py``). Experts' gradients
       go over "edp", the N / EP ranks that hold the same experts (with EP 1, over DP x CP with
       the rest, in the same buckets and groups).
  pp   per micro-batch, each chunk sends its output forward (unless it is the model's last) and
       its input's gradient back (unless it is the first): S, divided by t under sequence
       parallelism. The tied embedding's two gradients are all-reduced over "embedding" once.
  cp   ring attention (Liu et al. 2023): per block, CP - 1 passes of the K,V block (2 b s h/t d)
       forward and, backward, CP - 1 passes of K,V and CP - 1 of the dK,dV accumulators; Ulysses
       (Jacobs et al. 2023): all-to-alls of qkv (3 S/t) and of the output (S/t), forward and
       backward. Before any K,V moves, every attention forward all-gathers a 9-number header (HEADER)
       and the ranks' positions (int64).
  ep   per MoE block, an all-to-all of the counts per expert (int64) and four all-to-all-vs of the
       token rows (dispatch and combine, forward and backward). The rows depend on the router:
       for a uniform one, of the b s k token-slots a rank routes, (EP-1)/EP leave. This term is
       an expectation, not a count.
  the gradient norm adds one float64 over TP and PP (and DP for ZeRO, EP for experts) per step.
"""

from collections import Counter
from dataclasses import replace
from functools import lru_cache

from minipar.comm.stats import ring_bytes
from minipar.parallel.context import HEADER

from . import zero3, zero12
from .shapes import BUCKET, PRECISIONS, micro_batches
from .state import (edges, partial_sums, rank_parameters, split_layers, split_of, stage_chunks, stage_layers,
                    token_embedding)

NORM = 8  # the gradient norm's partial sum: one float64


def group_bytes(model, layout, global_batch, stage=0, dtype="float32"):
    """{group: bytes one rank of pipeline stage ``stage`` sends in one training step}; groups of
    one rank send nothing and are left out."""
    return group_traffic(model, layout, global_batch, stage, dtype)[0]


def latency_steps(op, size):
    """The latency terms (alpha) of one call, as MPI libraries run a latency-bound collective
    (Thakur, Rabenseifner & Gropp 2005): a reduce-scatter by recursive halving and an all-gather by
    recursive doubling, ceil(log2 N) steps each, an all-reduce both (2 ceil(log2 N)), an all-to-all
    N - 1 pairwise exchanges, a message 1. (Its bytes stay the ring's: ``ring_bytes``.)"""
    log = (size - 1).bit_length()  # ceil(log2 N)
    return {"all_reduce": 2 * log, "reduce_scatter": log, "all_gather": log, "send": 1}.get(op, size - 1)


def group_traffic(model, layout, global_batch, stage=0, dtype="float32"):
    """({group: bytes sent}, {group: latency steps}) of one rank of ``stage`` in one step."""
    sent, steps, _ = _count(model, counted(layout), global_batch, stage, dtype)
    return dict(sent), dict(steps)


def group_calls(model, layout, global_batch, stage=0, dtype="float32"):
    """{group: communication calls} one rank of ``stage`` makes in one step, as ``group.stats``
    counts them: a collective is one call, a point-to-point message two (its send here and its
    receive on the peer, each rank doing both), an all-to-all-v one. What a per-call overhead
    (``overhead.py``) multiplies."""
    return dict(_count(model, counted(layout), global_batch, stage, dtype)[2])


@lru_cache(maxsize=1024)  # asked for the bytes and the calls of every stage of a layout
def counted(layout):
    """``layout`` with what the count does not read set alike, so that the layouts the planner tries
    share a count where they differ only there: selective recomputation (no message of its own) and
    the schedule, of which it reads where the chunks are (every schedule but ZB-V's places them
    round-robin), unless ZeRO-2 replays a step's deferred W's (``zero12.group_sends``)."""
    schedule = layout.schedule if layout.schedule == "zb-v" or layout.defer_wgrad_linears else "1f1b"
    return replace(layout, selective_recompute=False, schedule=schedule)


@lru_cache(maxsize=256)  # a prediction asks for a stage's bytes and then its calls (overhead.py): one count
def _count(model, layout, global_batch, stage, dtype):
    out, steps, calls = Counter(), Counter(), Counter()
    precision, lay = PRECISIONS[dtype], layout
    d, g, w = precision.activation, precision.grad, precision.param  # activations, gradients, weights
    m, b, h, t = micro_batches(lay, global_batch), lay.micro_batch_size, model.hidden_size, lay.tp
    s = model.seq_length // lay.cp
    S = b * s * h * d  # one micro-batch's activation on a rank
    layers = stage_layers(model, lay, stage)
    moe_ids, partial, per_block, recomputed_once = _layer_counts(model, split_of(lay), stage)
    moe_ids = list(moe_ids)
    moe_layers = len(moe_ids)
    first, last = edges(lay, stage)
    dense, experts = rank_parameters(model, lay, stage)

    ring = Counter()  # (group, op, size): the bytes of the buffers, charged once at the end

    def charge(group, op, nbytes, size, times=1, each=1):  # ``times`` x ``each`` calls of ``nbytes`` in all
        ring[group, op, size] += times * nbytes
        steps[group] += times * each * latency_steps(op, size)
        calls[group] += times * each

    def zero3_charge(kind, group, size):  # each group gathered and sent as often as ``zero3.uses`` says
        gathers, sends = zero3.uses(lay, m, stage, kind)
        charge(group, "all_gather", kind.params * w, size, gathers, kind.groups)
        charge(group, "reduce_scatter", (kind.params - kind.held_params) * g, size, sends, kind.groups - kind.held)
        charge(group, "reduce_scatter", kind.held_params * g, size, 1, kind.held)  # after finalize_grads

    # the LayerNorms, the row-parallel biases (a MoE block's MLP has none) and a MoE block's router:
    # what sequence parallelism leaves each TP rank part of the gradient of
    # tensor parallelism
    if t > 1:
        forwards = 2 if lay.recompute else 1
        # per_block: forward + backward
        recomputed = recomputed_once * (forwards - 1)
        ends = first + last  # the embedding's forward, the head's input backward
        ops = ("reduce_scatter", "all_gather") if lay.sequence_parallel else ("all_reduce",)
        for op in ops:
            charge("tp", op, S, t, m * (per_block + recomputed + ends))
        if last:  # the vocabulary-parallel cross-entropy: max, then the sums with the target logits,
            wide = max(d, 4)  # in float32 for a 16-bit model (functional/widen.py)
            charge("tp", "all_reduce", b * s * wide, t, m)
            charge("tp", "all_reduce", 2 * b * s * wide, t, m)
        if lay.sequence_parallel:  # finalize_grads: what each TP rank holds whole had partial gradients:
            # ``partial``, and this rank's experts (each TP rank routed its own tokens)
            whole = partial + experts + model.seq_length * h * first + 2 * h * last
            charge("tp", "all_reduce", whole * g, t)
        charge("tp", "all_reduce", NORM, t)
    # data parallelism (over DP x CP), ZeRO
    n, dp = lay.dp * lay.cp, "dp_cp" if lay.cp > 1 else "dp"
    sp_experts = experts if lay.sequence_parallel and t > 1 else 0  # summed over TP by the model first
    if lay.ep == 1:  # without expert parallelism the experts' gradients are summed over DP x CP as the
        dense, experts, moe_ids, moe_layers = dense + experts, 0, [], 0  # rest are, in the same buckets
    # the dense gradients' buckets (ZeRO's groups): a bucket never mixes dense and expert
    # gradients, and a MoE block's experts are its last parameters, so each block's experts end a
    # run of dense ones; one more run when dense ones follow the stage's last experts
    tail = not moe_ids or last or any(not model.is_moe(i) for i in layers if i > moe_ids[-1])
    extra_buckets = buckets(dense * g) - 1 + moe_layers + tail - 1
    held, experts_held = 0, False  # ZeRO-2's gradients that the model finishes after backward (ZeRO-3's: zero3.py)
    if lay.zero_stage == 2 and lay.sequence_parallel and t > 1:  # SP's partial sums (LayerNorms, row biases,
        held += partial + model.seq_length * h * first + 2 * h * last  # routers; wpe, ln_f) and the experts
        experts_held = bool(experts)
        held += sp_experts if lay.ep == 1 else 0  # (EP 1: among the dense groups)
    if lay.zero_stage == 2 and lay.pp > 1 and (first or last) and not (first and last):  # the tied embedding
        held += token_embedding(model, lay)
    if n > 1:  # gradients in the gradients' precision, gathered parameters in the weights'
        z = lay.zero_stage
        if z == 0:
            charge(dp, "all_reduce", dense * g, n)
            calls[dp] += extra_buckets
        elif z == 1 or z == 2 and not held:  # one reduce-scatter (a micro-batch's, stage 2) and one all-gather
            # per group, grouped as data parallelism's buckets
            charge(dp, "reduce_scatter", dense * g, n, m if z == 2 else 1)
            charge(dp, "all_gather", dense * w, n)
            calls[dp] += extra_buckets * ((m if z == 2 else 1) + 1)
        elif z == 2 and lay.defer_wgrad_linears:  # some groups sent at the flush: the replay's sends
            for values, ranks, sends in zero12.group_sends(model, lay, stage, m, dtype):
                if ranks == n:  # (with EP the experts' groups, over "edp", below)
                    charge(dp, "reduce_scatter", values * g, ranks, sends)
                    charge(dp, "all_gather", values * w, ranks)
        elif z == 2:  # ZeRO-2 sends what the model sums after backward once, at the end, in groups of its own
            # (zero2.py); with SP the experts are among them, and split the held dense ones into runs
            runs = moe_layers + tail if experts_held else 1
            now = buckets((dense - held) * g) + (0 if experts_held else moe_layers + tail - 1)
            later = buckets(held * g) - 1 + runs
            charge(dp, "reduce_scatter", (dense - held) * g, n, m)
            charge(dp, "reduce_scatter", held * g, n)
            charge(dp, "all_gather", dense * w, n)
            calls[dp] += (now - 1) * m + (later - 1) + (now + later - 1)
        else:  # ZeRO-3: each kind of group as often as the schedule gathers and sends it (plan/zero3.py)
            for kind in zero3.groups(model, lay, stage):
                if kind.comm == "dp":
                    zero3_charge(kind, dp, n)
        if z > 0:
            charge(dp, "all_reduce", NORM, n)
    if experts and n // lay.ep > 1:
        groups = max(moe_layers, buckets(experts * g))  # a bucket (a ZeRO group) per MoE layer at least
        if lay.zero_stage == 0:
            charge("edp", "all_reduce", experts * g, n // lay.ep)
            calls["edp"] += groups - 1
        elif lay.zero_stage < 3:  # each group reduce-scattered (stage 2: each micro-batch's, unless
            sends = m if lay.zero_stage == 2 and not experts_held else 1  # held, SP's) and gathered
            charge("edp", "reduce_scatter", experts * g, n // lay.ep, sends)
            charge("edp", "all_gather", experts * w, n // lay.ep)
            calls["edp"] += (groups - 1) * (sends + 1)
        else:  # ZeRO-3: each MoE block's experts a group (plan/zero3.py)
            for kind in zero3.groups(model, lay, stage):
                if kind.comm == "edp":
                    zero3_charge(kind, "edp", n // lay.ep)
    # pipeline parallelism
    if lay.pp > 1:
        p, v = lay.pp, lay.vpp
        messages = sum((g < p * v - 1) + (g > 0) for g in stage_chunks(lay, stage))
        out["pp"] += m * messages * (S // t if lay.sequence_parallel else S)
        steps["pp"] += m * messages
        calls["pp"] += 2 * m * messages  # each message is a send here and a receive there
        charge("pp", "all_reduce", NORM, p)
        if (first or last) and not (first and last):  # in a V one copy serves both ends
            charge("embedding", "all_reduce", token_embedding(model, lay) * g, 2)
    # context parallelism
    if lay.cp > 1:
        c, forwards = lay.cp, 2 if lay.recompute else 1
        heads, L = h // t, len(layers)  # every block's attention alike: L times one block's
        if lay.cp_comm_type == "p2p":  # K and V, forward (per forward) and backward; dK, dV backward
            out["cp"] += L * m * (c - 1) * 2 * b * s * heads * d * (forwards + 2)
            steps["cp"] += L * m * (c - 1) * (forwards + 2)
            calls["cp"] += L * 2 * m * (c - 1) * (forwards + 2)  # a send and a receive per pass
        else:  # Ulysses: qkv and the output, forward (per forward) and backward
            charge("cp", "all_to_all", 4 * b * s * heads * d, c, L * m * (forwards + 1))
            calls["cp"] += L * m * (forwards + 1)  # the bytes of two calls: qkv's, then the output's
        charge("cp", "all_gather", c * HEADER * 8, c, L * m * forwards)  # the header
        charge("cp", "all_gather", c * s * 8, c, L * m * forwards)  # the positions
    # expert parallelism (an expectation for a uniform router)
    if lay.ep > 1 and model.num_experts:
        e, k = lay.ep, model.moe_router_topk
        tokens = b * s // (t if lay.sequence_parallel else 1)
        moe = sum(model.is_moe(i) for i in layers)
        forwards = 2 if lay.recompute else 1
        charge("ep", "all_to_all", model.num_experts * 8, e, m * moe * forwards)
        out["ep"] += m * moe * (2 * forwards + 2) * tokens * k * (e - 1) // e * h * d
        steps["ep"] += m * moe * (2 * forwards + 2) * (e - 1)
        calls["ep"] += m * moe * (2 * forwards + 2)
        if lay.zero_stage == 0:  # the experts' squares summed over EP; ZeRO's norm sums every piece over DP
            charge("ep", "all_reduce", NORM, e)
    for (group, op, size), nbytes in ring.items():
        out[group] += ring_bytes(op, nbytes, size)[0]
    sent = {g: v for g, v in out.items() if v}
    return sent, {g: v for g, v in steps.items() if g in sent}, {g: v for g, v in calls.items() if g in sent}


@lru_cache(maxsize=4096)
def _layer_counts(model, split, stage):
    """(the stage's MoE blocks, their partial sums (``partial_sums``), TP's all-reduces per micro-batch
    of its blocks, forward and backward, and of one recomputed forward): one count per split."""
    layers = split_layers(model, split, stage)
    return (tuple(i for i in layers if model.is_moe(i)), sum(partial_sums(model, i) for i in layers),
            sum(2 + (0 if model.is_moe(i) else 2) for i in layers), sum(1 + (0 if model.is_moe(i) else 1) for i in layers))


def buckets(nbytes):
    """Data parallelism's all-reduce calls for ``nbytes`` of gradients: ~ one per BUCKET bytes
    (``DataParallelAdamW`` closes a bucket once it holds at least bucket_bytes, so this is exact
    only while the gradients fit one bucket, and close above)."""
    return max(1, -(-nbytes // BUCKET))


EXACT = ("tp", "dp", "dp_cp", "edp", "pp", "embedding", "cp")  # counted; "ep" is an expectation
