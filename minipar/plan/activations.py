"""Activation memory: one layer's bytes (minipar's formula, which ``bench/activation_memory.py``
measures to the byte; docs/activation_memory.md), and a rank's, from the layers it holds and the
micro-batches its schedule keeps in flight.

One layer, s positions, b sequences, h hidden, a heads, d bytes per value (``formula`` below):

    s b h (26 d + 2) + 2 f s b + 2 d a b K(s)    with dropout    (Korthikanti et al.: s b h (34 + 5 a s/h)
                                                                  with 2-byte values and 1-byte masks)

with f = max(d, 4): the LayerNorms' 1/sigma, one per row, stays float32 in a 16-bit model
(``functional/widen.py``), where every other saved value is 16-bit.

On a rank of a layout (``layer_bytes``): tensor parallelism divides what lives inside attention and
the MLP (q, k, v, the attention output, GELU's values, the T x T part: the heads and the MLP's
columns are split); the LayerNorms, the residual stream, the row-parallel layers' outputs and the
dropouts stay whole (h wide), unless sequence parallelism splits them along s too (the LayerNorm
outputs, gathered before the column-parallel layers, stay whole). The collectives' autograd nodes
keep their own inputs: Megatron's g sums the row-parallel layer's partial output in place (nothing
else reads it), and that sum before the bias is 2 s b h more per layer (f passes the LayerNorm
output on as a view, which holds nothing of its own; with sequence parallelism the partial sums,
2 s b h, and the shards before the gathers and after the reduce-scatters, 4 s b h / t). Context
parallelism gives each rank s = T/CP positions, and its queries see about 1/CP of the causal
T x T pairs. Full
recomputation keeps each layer's input (s b h, split by SP) and, while one layer's backward
runs, that layer's whole set once more.

Selective recomputation (Korthikanti et al. 2022) keeps all but the T x T part, and the int64
coordinates that draw its dropout mask again: ``formula(..., "selective")``; under ring attention,
which keeps no T x T part, it changes nothing (``Layout.selective``).

A mixture-of-experts block (``moe_bytes``, from models/moe.py, parallel/experts.py and
functional/routing.py; N tokens a rank routes, k of E experts, S = N k token-slots kept, or
E ceil(c N k / E) under a capacity factor c, R the rows that reach this rank's experts, S for a
uniform router) keeps, in place of the dense MLP's 12 s b h:

    router (float32)     logits and probabilities 2 x 4 N E, the top-k's argsort 8 N E and the
                         row numbers 8 N, the k weights 4 N k (renormalised, k > 1: twice, and
                         their sum); a 16-bit model's tokens cast to float32, 4 N h,
                         the weights back in 16 bits and N E 16-bit values more, d N (k + E)
    permute, unpermute   the permuted rows d S h, the slots 8 S, the experts' combined output
                         d S h, and unpermute's placed rows d N k h (dropped slots included)
    experts              per row: c_fc's output, GELU's tanh and output (4 h each), c_proj's
                         output h: 13 d R h
    all-to-alls (EP)     the rows received and put in expert order, the outputs put back in
                         source order, 3 d R h, the two orders 16 R, combine's output d S h

Tensor parallelism without SP gives every TP rank all the tokens and whole experts; an MoE block
has no MLP g (2 s b h fewer); with SP its tokens are the rank's s/t positions and its
LayerNorm output is not gathered. Exact on one device (dropless, no auxiliary losses, whose
graphs hold a few N E more; in float32, and in bfloat16 too); on ranks within 10%
(``tests/mpi/plan_activations.py``).

Ring attention keeps no T x T part, only the log-sum-exp, 4 b a s (its backward rebuilds the
probabilities from it); Ulysses keeps it for all T positions and a/(t CP) heads.

A rank holds (``rank_bytes``), for each micro-batch its schedule keeps in one of its chunks at
its peak (``bubble.in_flight``: 1F1B p on the first stage, GPipe m; with v chunks a count per
chunk), that chunk's layers' activations (each block's output among them; under full
recomputation each block's input and the chunk's output; a chunk frees its output once it is sent
on, as Megatron's deallocate_output_tensor does, so only the just-run forward's is held), its input
and its edge. The first chunk's input is the embeddings' dropout output, beside the token rows,
their sum with the position rows (s h, one set for the whole micro-batch) and the 1-byte mask:
3 s b h + s h (without dropout the sum is the input, and there is no mask: 2 s b h + s h), plus
under TP the int64 ids of the rank's rows and which are not its own (with one device the batch's
ids, which the caller holds whole and memory.batch_bytes counts). Every other chunk's input is the
one received, s b h. The last chunk adds ln_f's xhat and output (the head's input), 2 s b h, the
logits with their softmax, 2 b s V/t d, and the loss's targets, row numbers and masks. With
sequence parallelism the edge terms are split by t, but the vocabulary-parallel embedding's rows,
looked up whole before their reduce-scatter, and the head's input, gathered whole, are s b h more
each. With the head's weight gradients deferred to the flush (``Layout.defer_embedding_wgrad``)
the last chunk's rank also parks, from each backward of that chunk until the flush, the
micro-batch's head input (whole, s b h) and the logits' gradient (b s V/t): one count more in
``in_flight``'s vectors; with ``defer_wgrad_linears`` also its last linear layers' (``linears_parked``).
A zero-bubble schedule's B frees a micro-batch's graph but parks its W's inputs (``parked_bytes``:
20 s b h a block on one device), counted apart in ``in_flight``'s vectors (v counts more). The
per-layer formula is exact on one device; a rank's peak is within 0.07% of the measured one for
every dense layout measured (TP, SP, CP, PP, each schedule, recomputation, the head's W and the
last linear layers' deferred), and within 10% for MoE, whose router is not uniform
(``tests/mpi/plan_activations.py``).
"""

import math
from functools import lru_cache
from itertools import starmap
from operator import attrgetter, mul

from minipar.parallel.run_config import SPLIT_BACKWARD

from . import bubble, state


def kept_pairs(s, query_block):
    """K(s): the (key, query) pairs the fused attention keeps per sequence and head. Block i of n
    full blocks of q queries keeps (i + 1) q keys for each, q^2 n (n + 1) / 2 in all; a last block
    of r < q queries keeps all s keys for each."""
    n, r = divmod(s, query_block)
    return query_block * query_block * n * (n + 1) // 2 + s * r


def formula(s, b, h, a, d, dropout, granularity=None, query_block=64):
    """minipar's activation bytes of one layer, {term: bytes} (see bench/activation_memory.py);
    ``d`` bytes per value, 2 in bfloat16 and float16, whose per-row statistics stay float32."""
    sbh = s * b * h
    stat = max(d, 4)
    if granularity == "full":
        return {"the layer's output (the next layer's kept input)": d * sbh,
                "checkpoint's anchor, an empty array": 1}
    masks = 1 if dropout else 0
    terms = {
        "LayerNorms: xhat, 1/sigma": d * 2 * sbh + stat * 2 * s * b,
        "LayerNorm outputs (qkv, c_fc inputs)": d * 2 * sbh,
        "q, k, v": d * 3 * sbh,
        "attention output (c_proj input)": d * sbh,
        "GELU input and tanh": d * 8 * sbh,
        "GELU output (c_proj input)": d * 4 * sbh,
        "dropout masks (1-byte survivors)": 2 * masks * sbh,
        "residual stream: output, x + attn": d * 2 * sbh,
        "c_proj outputs (dropout inputs)": d * 2 * sbh,
        "dropout outputs (residual inputs)": d * 2 * masks * sbh,
    }
    if granularity == "selective":
        terms["mask coordinates (int64)"] = 8 * (b + a + s) * masks
    else:
        terms["T x T: probabilities P"] = d * a * b * kept_pairs(s, query_block)
        terms["T x T: dropout mask R"] = d * a * b * kept_pairs(s, query_block) * masks
    return terms


def korthikanti(s, b, h, a, granularity=None):
    """The paper's bytes per layer (16-bit values, 1-byte masks; Table 2)."""
    return {None: s * b * h * (34 + 5 * a * s / h), "selective": 34 * s * b * h, "full": 2 * s * b * h}[granularity]


SPLIT_BY_TP = ("q, k, v", "attention output", "GELU", "T x T")  # inside the heads and the MLP's columns
WHOLE_UNDER_SP = ("LayerNorm outputs",)  # gathered to the full sequence before the column-parallel layers


def layer_bytes(model, layout, d, query_block=64):
    """One layer's activation bytes for one micro-batch on one rank of ``layout`` (no recompute)."""
    return _layer_bytes(model, LAYER(layout), d, query_block)  # (once for the layouts that share what it reads)


LAYER = attrgetter("tp", "cp", "micro_batch_size", "selective", "ring_attention", "cp_comm_type", "sequence_parallel")


@lru_cache(maxsize=1024)
def _layer_bytes(model, layer, d, query_block):
    t, c, b, selective, ring_attention, cp_comm_type, sequence_parallel = layer
    s = model.seq_length // c
    granularity = "selective" if selective else None  # no T x T terms, their coordinates
    terms = formula(s, b, model.hidden_size, model.num_attention_heads, d, model.dropout > 0, granularity, query_block)
    total = 0
    for name, value in terms.items():
        if name.startswith("T x T") and value and ring_attention:
            # ring attention keeps no probabilities: backward rebuilds them from the log-sum-exp, one
            # float32 a position and head
            value = 4 * b * model.num_attention_heads * s if name.endswith("P") else 0
        elif name.startswith("T x T") and value:  # Ulysses: all T positions, a / (t CP) heads
            value = d * model.num_attention_heads * b * kept_pairs(model.seq_length, query_block) // c
        if name.startswith(SPLIT_BY_TP) or (sequence_parallel and not name.startswith(WHOLE_UNDER_SP)):
            value //= t
        total += value
    sbh = d * s * b * model.hidden_size
    if c > 1 and cp_comm_type == "a2a":  # Ulysses' chain (parallel/ulysses.py): each node keeps
        # its input, so beside the projection's q, k, v the graph holds the all-to-all's output and
        # its copy in position order (3 + 3), the heads' output, its chunks and the all-to-all's
        # answer before the reshape that the output projection reads (1 + 1 + 1); all inside the heads
        total += 9 * sbh // t
    if t > 1 and sequence_parallel:  # the LayerNorms' own (sharded) outputs before the gathers,
        total += 2 * sbh + 4 * sbh // t     # the row-parallel partial sums (whole) and their shards
    elif t > 1:  # g's sums, each in place of its partial sum (f's outputs are views of the LayerNorms')
        total += 2 * sbh
    return total


def expected_slots(model, tokens):
    """S: the token-slots a rank's experts keep from ``tokens`` tokens, for a uniform router."""
    k, E, c = model.moe_router_topk, model.num_experts, model.moe_expert_capacity_factor
    return tokens * k if c is None else min(tokens * k, E * math.ceil(c * tokens * k / E))


def moe_bytes(model, layout, d):
    """One MoE block's bytes for one micro-batch on one rank, less its dense MLP's (module docstring)."""
    t, b, h = layout.tp, layout.micro_batch_size, model.hidden_size
    s, k, E = model.seq_length // layout.cp, model.moe_router_topk, model.num_experts
    sp = layout.sequence_parallel and t > 1
    N = b * s // (t if sp else 1)
    S = R = expected_slots(model, N)
    router = N * (8 * E + 8 * E + 8 + 4 * k + (4 * k + 4 if k > 1 else 0))
    if d < 4:  # the tokens cast to float32, the weights cast back to 16 bits, N E 16-bit values more (read off graphs)
        router += 4 * N * h + d * N * (k + E)
    routing = d * S * h + 8 * S + d * S * h + d * N * k * h
    experts = 13 * d * R * h + ((3 * d * h + 16) * R + d * S * h if layout.ep > 1 else 0)
    sbh = d * s * b * h
    dense = 12 * sbh // t  # GELU's input, tanh and output, split by TP
    if sp:  # ln_2's gathered output, the MLP's partial sum and its reduce-scattered shard
        dense += 2 * sbh + sbh // t
    elif t > 1:  # g's sum, in place of its partial sum (f's output is a view of ln_2's)
        dense += sbh
    return router + routing + experts - dense


def parked_bytes(model, layout, d):
    """What one block parks for its W (``weight_grad.py``) after a split backward's B, for one
    micro-batch on one rank: each weight's op keeps its input and output gradient, a LayerNorm its
    normalised input, 1/sigma and output gradient. One device, 20 s b h values and 2 s b statistics:
    the LayerNorms 2 (2 + 0) + 2 rows, the linear layers' inputs 1 + 1 + 1 + 4 and output gradients
    3 + 1 + 4 + 1 (read off ``WeightGradients.nbytes``, which the tests check to the byte). Under TP the
    inputs of the column-parallel layers and the output gradients of the row-parallel ones stay
    whole, the rest is split: 8 + 12/t; under SP the LayerNorms' terms are split too, the
    column-parallel inputs are the gathered (whole) rows, and each row-parallel bias, added after
    the reduce-scatter, parks its own (split) output gradient: 4 + 18/t. An MoE block parks in place
    of its dense MLP's (2 + 8/t, SP 2 + 9/t) the experts' 10 d R h and its router's: in float32 the gate's input
    and the logits' gradient, d N (h + E); in 16 bits the router's weight is cast to float32, so the
    cast's output gradient, 4 E h, is what waits (the product's gradient is B's)."""
    t, b, h = layout.tp, layout.micro_batch_size, model.hidden_size
    s = model.seq_length // layout.cp
    sbh, rows = d * s * b * h, max(d, 4) * s * b
    sp = layout.sequence_parallel and t > 1
    dense = 4 * sbh + (18 * sbh + 2 * rows) // t if sp else 8 * sbh + 12 * sbh // t + 2 * rows
    if not model.num_experts:
        return dense, 0
    N = b * s // (t if sp else 1)
    R = expected_slots(model, N)
    router = d * N * (h + model.num_experts) if d >= 4 else 4 * model.num_experts * h
    return dense, router + 10 * d * R * h - (2 * sbh + (9 if sp else 8) * sbh // t)


def linears_parked(model, layout, d):
    """What one micro-batch of the last chunk keeps for the flush with the weight gradients of its
    last ``layout.defer_wgrad_linears`` linear layers deferred (``GPT.last_linear_weights``): each
    layer's input and output gradient, in s b h per layer from the MLP's output projection back,
    4/t + 1, 1 + 4/t, 1/t + 1, 1 + 3/t (a column-parallel input and a row-parallel output gradient
    whole, gathered under SP; the rest split by TP)."""
    t, sbh = layout.tp, d * (model.seq_length // layout.cp) * layout.micro_batch_size * model.hidden_size
    block = (4 * sbh // t + sbh, sbh + 4 * sbh // t, sbh // t + sbh, sbh + 3 * sbh // t)
    return sum(block[i % 4] for i in range(layout.defer_wgrad_linears))


def rank_bytes(model, layout, stage, peaks, d, query_block=64, transient=True):
    """Activation bytes at the peak on pipeline rank ``stage``: its chunks (``state.stage_chunks``,
    their blocks ``state.chunk_layers``) times the micro-batches its schedule holds in each at its peaks
    (``peaks``: ``bubble.in_flight``'s count vectors, one count per local chunk), the largest sum.
    Each micro-batch in a chunk keeps its blocks' activations, and the chunk's edge terms: the
    first chunk's embeddings, the last's head and logits, any other's input received from the
    stage before. Full recomputation keeps each recomputed layer's input only; ``transient``: add
    the one layer whose forward is run again inside its backward (a graph walked between forward
    and backward, as ``bench/memory_breakdown.py`` walks it, does not see it). ZeRO-3 keeps what
    the same layout without it keeps: its graph holds the parameters by reference, not their
    gathered copies. With ``defer_embedding_wgrad`` the last chunk's rank's vectors have one count
    more, the head W's parked (``bubble.in_flight(..., defer_head=True)``); with a zero-bubble
    schedule v more, the micro-batches whose W waits in each chunk (``parked_bytes`` and the
    chunk's edge: the embeddings' output gradients, ln_f's and the head's W inputs)."""
    b, s, t = layout.micro_batch_size, model.seq_length // layout.cp, layout.tp
    sbh = d * s * b * model.hidden_size
    shard = t if layout.sequence_parallel else 1
    recompute = layout.recompute
    one = layer_bytes(model, layout, d, query_block)
    moe = any(map(model.is_moe, state.stage_layers(model, layout, stage)))
    experts = moe_bytes(model, layout, d) if moe else 0  # an MoE block's bytes beyond a dense one's
    logits = 2 * b * s * -(-model.vocab_size // t) * d  # the head's output and the loss's softmax
    last = layout.pp * layout.vpp - 1

    def chunk_bytes(chunk):  # one micro-batch's: its blocks' activations, its input and its edge
        blocks = state.chunk_layers(model, layout, chunk)
        if recompute:  # each block's kept input, the first's the chunk's input (below), and the chunk's output
            extra = len(blocks) * sbh // shard
        else:  # each block's terms, its output among them
            extra = len(blocks) * one + sum(map(model.is_moe, blocks)) * experts
        ids = 9 * b * s if t > 1 else 0  # TP: the int64 ids of this rank's rows and which are not (one device: the batch's)
        if chunk == 0:  # the token rows, the position rows (s h, one set for the batch), their sum,
            # dropout's 1-byte mask and output (the chunk's input; without dropout the sum is); under
            # SP the token rows looked up whole before the reduce-scatter; the ids, and the positions' (8 s)
            edge = (3 * sbh + sbh // d) if model.dropout > 0 else 2 * sbh
            extra += (edge + d * s * model.hidden_size) // shard + ids + 8 * s + (sbh if shard > 1 else 0)
        else:  # the input received, kept for the backward
            extra += sbh // shard
        if chunk != last:  # its output, sent on, is freed (the executor keeps its node: Megatron's
            extra -= sbh // shard  # deallocate_output_tensor); ``held``'s last counts add the unsent one
        if chunk == last:  # ln_f's xhat, 1/sigma and output (the head's input; under SP gathered whole too),
            # the logits and their softmax, the loss's targets, row numbers and masks (a second under TP)
            extra += (2 * sbh + max(d, 4) * s * b) // shard + logits + (17 + (t > 1)) * b * s + (sbh if shard > 1 else 0)
        return extra

    def parked(chunk):  # one micro-batch's W set: its blocks' and the chunk's edge's (parked_bytes)
        blocks = state.chunk_layers(model, layout, chunk)
        extra = len(blocks) * dense_w + sum(map(model.is_moe, blocks)) * experts_w
        if chunk == 0:  # the token and position embeddings' output gradients (the latter summed over the
            # batch), their int64 ids (the positions' whole, a slice's base), TP's 1-byte mask of ids elsewhere
            extra += sbh + 8 * b * s + (b * s if t > 1 else 0) + d * s * model.hidden_size // shard + 8 * s
        if chunk == last:  # ln_f's xhat, 1/sigma and output gradient, the head's input and the logits' gradient
            extra += (2 * sbh + max(d, 4) * s * b) // shard + sbh + logits // 2
        return extra

    chunks = state.stage_chunks(layout, stage)
    held = [chunk_bytes(c) for c in chunks]
    if layout.schedule in SPLIT_BACKWARD:  # in_flight's counts of micro-batches whose W waits
        dense_w, experts_w = parked_bytes(model, layout, d)
        held += [parked(c) for c in chunks]
    if layout.defer_embedding_wgrad and last in chunks:  # a parked head W: its input (whole under SP),
        held.append(sbh + logits // 2 + linears_parked(model, layout, d))  # and the logits' gradient (one
        # of the two logits-sized arrays), and the deferred linear layers' inputs and output gradients
    held += [0 if c == last else sbh // shard for c in chunks]  # the just-run forward's output, until sent
    kept = max(sum(starmap(mul, zip(peak, held, strict=True))) for peak in peaks)  # (each count x its bytes)
    return kept + (one + max(experts, 0) if recompute and transient else 0)


def stage_peak(model, layout, m, d, stage, query_block=64):
    """The activation bytes pipeline rank ``stage`` keeps at its peak (``rank_bytes`` with the
    transient layer), with m micro-batches a step (``bubble.in_flight``: every schedule's counts
    at any size)."""
    peaks = bubble.in_flight(layout.schedule, layout.pp, m, layout.vpp, stage, layout.defer_embedding_wgrad)
    return rank_bytes(model, layout, stage, peaks, d, query_block)


def peak_bytes(model, layout, m, d, query_block=64):
    """The most activation bytes any pipeline rank keeps at its peak: the first or last stage's,
    or with uneven ``pipeline_layers`` any stage's (``stage_peak``)."""
    stages = range(layout.pp) if layout.pipeline_layers else {0, layout.pp - 1}
    return max(stage_peak(model, layout, m, d, s, query_block) for s in stages)
