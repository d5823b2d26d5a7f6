"""A layout's predicted memory, traffic and step time on a machine.

Compute. The FLOPs of a step are minipar's own count (``mfu.flops_per_token``: 72 L h^2 + 12 L T h
+ 6 V h per token, Narayanan et al. 2021) and, with full recomputation, one more forward of the
blocks (24 L h^2 + 4 L T h): the sum is the paper's 96 B s l h^2 (1 + s/6h + V/16lh) exactly. Every
rank does 1/(TP CP PP DP) of it, at the peak times an efficiency (the share of peak the kernels
reach, calibrated by a micro-benchmark), and the pipeline stretches it by 1 / (1 - bubble). A layout
that runs weight gradients at the flush (``--defer-embedding-wgrad-compute``, ``--defer-wgrad-linears
K``) takes its bubble from ``deferred.py``, its schedule replayed with each chunk's FLOPs, where the
stages' imbalance is part of the replay and not multiplied in again.

Communication. Each group's bytes (``traffic.group_traffic``) cross one kind of link: inside a
node (NVLink) or between nodes (InfiniBand), as Megatron's rank order places the group's ranks
(``link``). A group's time is alpha x its latency steps + bytes / bandwidth (Hockney's model).
Where the technique overlaps its messages with compute, only the excess shows: data parallelism's
buckets (and ZeRO-2's reduce-scatters) run during backward (2/3 of the compute), ring attention's
K,V passes during the attention they feed. Tensor parallelism's collectives, Ulysses' and the
experts' all-to-alls and the pipeline's messages wait on the compute and are added in full.

Overheads (``overhead.py``): each layer pass and each communication call costs a fixed time beyond
its FLOPs and bytes, and ranks beyond a node's cores take turns: the step is at least R / C times
one rank's busy time. All zero unless the Machine sets them (a CPU run calibrates them).

The update (``update.py``): after the pipeline's flush each rank takes the gradient norm and
AdamW's step over what it holds (ZeRO: its pieces), per array and per element; it follows the
bubble rather than stretching with it, and shares the cores as the compute does. Zero unless the
Machine sets it.

Memory: the state at its fullest during a step (``state.stage_peak_bytes``: ZeRO's gathered
weights and gradients in flight too) and the activations (``activations.rank_bytes``) of the first,
the second and the last stage (every stage of an uneven split), the fullest of them.
"""

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import lru_cache

from minipar.mfu import flops_per_token

from . import activations, bubble, deferred, overhead, state, traffic, update
from .shapes import PRECISIONS, Layout, micro_batches



def stage_imbalance(model, layout):
    """The busiest pipeline rank's training FLOPs over the ranks' mean (1 without a pipeline): a
    pipeline runs at its slowest stage's pace, and the last chunk also runs the head, 6 V h a token
    (GPT-2's: 4.5 blocks), while each block costs its own (an MoE block more), a third more under
    full recomputation. ``layout.pipeline_layers`` (``--pipeline-layers balanced``) evens it out,
    as far as whole layers allow (it counts an MoE model's blocks at their mean, so with
    ``moe_layer_freq`` > 1 some imbalance it leaves is seen here)."""
    if layout.pp == 1:
        return 1.0
    # what it reads of the layout alone, so that the layouts that differ elsewhere (TP, DP, ZeRO, ...) share it
    return _imbalance(model, layout.pp, layout.vpp, layout.schedule, layout.recompute, layout.pipeline_layers)


@lru_cache(maxsize=4096)
def _imbalance(model, pp, vpp, schedule, recompute, pipeline_layers):
    layout = Layout(pp=pp, vpp=vpp, schedule=schedule, recompute=recompute, pipeline_layers=pipeline_layers)
    args = (model.hidden_size, model.seq_length, 0)
    again = Fraction(4, 3) if layout.recompute else 1
    block = [flops_per_token(1, *args, int(model.is_moe(i)), model.moe_router_topk, model.num_experts) * again
             for i in range(model.num_layers)]
    head = flops_per_token(0, model.hidden_size, model.seq_length, model.vocab_size)
    last = layout.pp * layout.vpp - 1
    loads = [sum(block[i] for g in state.stage_chunks(layout, r) for i in state.chunk_layers(model, layout, g))
             + head * (last in state.stage_chunks(layout, r)) for r in range(layout.pp)]
    return float(max(loads) * layout.pp / sum(loads))


@lru_cache(maxsize=256)  # every layout asks: one count per model, batch and recomputation
def flops_per_iteration(model, global_batch, recompute=False, selective=False):
    """(model FLOPs, hardware FLOPs) of one step: full recomputation adds a forward of the blocks,
    selective recomputation attention's q k^T again (2 T h per token per layer)."""
    moe = sum(model.is_moe(i) for i in range(model.num_layers))
    args = (model.hidden_size, model.seq_length, model.vocab_size)
    per_token = flops_per_token(model.num_layers, *args, moe, model.moe_router_topk, model.num_experts)
    blocks = per_token - flops_per_token(0, *args)  # the blocks' forward and backward, 3 forwards
    tokens = global_batch * model.seq_length
    again = blocks // 3 if recompute else 2 * model.num_layers * model.seq_length * model.hidden_size if selective else 0
    return tokens * per_token, tokens * (per_token + again)


def group_span(layout, group):
    """(stride, size) of a group's ranks in Megatron's order (EP: consecutive DP x CP ranks; edp:
    the DP x CP ranks EP apart; embedding: the first and last stage)."""
    stride = {"tp": 1, "cp": layout.tp, "dp": layout.tp * layout.cp, "pp": layout.tp * layout.cp * layout.dp}
    if group == "dp_cp":
        return layout.tp, layout.cp * layout.dp
    if group == "ep":
        return stride["cp"], layout.ep
    if group == "edp":
        return stride["cp"] * layout.ep, layout.dp * layout.cp // layout.ep
    if group == "embedding":
        return stride["pp"] * (layout.pp - 1), 2
    return stride[group], getattr(layout, group)


def link(layout, machine, group):
    """"intra" when every group of this kind has its ranks on one node, else "inter". A group of
    stride s and size n holds ranks b, b + s, ..., b + (n-1) s (Megatron's order), so it is on one
    node when its first and last are; the pattern repeats every lcm(s n, GPUs a node) ranks (TP 4
    on nodes of 6: ranks 4-7 cross a node's edge though each group spans only 4)."""
    return _link(*group_span(layout, group), machine.gpus_per_node, layout.world_size)


@lru_cache(maxsize=4096)  # asked for every group of every layout: the layouts share a few spans
def _link(stride, size, gpn, world_size):
    width = stride * size
    upto = min(math.lcm(width, gpn), world_size)
    firsts = (q * width + r for q in range(-(-upto // width)) for r in range(stride))
    # (a start whose last rank is past the world begins no group: the embedding group's stride
    # spans PP - 1 stages, so of its first stride ranks only the first stage's start one)
    last = stride * (size - 1)
    apart = any(b // gpn != (b + last) // gpn for b in firsts if b < upto and b + last < world_size)
    return "inter" if apart else "intra"


def seconds(nbytes, steps, kind, machine):
    """Hockney's alpha-beta model: latency steps x alpha + bytes / bandwidth."""
    gbps = machine.intra_node_gbps if kind == "intra" else machine.inter_node_gbps
    alpha = machine.intra_node_latency_us if kind == "intra" else machine.inter_node_latency_us
    return steps * alpha * 1e-6 + nbytes * 8 / (gbps * 1e9)


@dataclass
class Prediction:
    memory_gb: float
    step_time_s: float
    mfu: float
    bubble: float
    bytes_per_group: dict
    compute_s: float
    comm_s: dict = field(default_factory=dict)  # exposed seconds per group
    links: dict = field(default_factory=dict)
    bubble_source: str = ""
    update_s: float = 0.0  # the norm and AdamW's step after backward (update.py), the busiest stage's


def _stages(layout):
    # even stages: the first and last (the fullest: embedding, head) and one in the middle (it sends
    # on the pipeline both ways, twice an edge's bytes); uneven ones: every stage
    return range(layout.pp) if layout.pipeline_layers else sorted({0, min(1, layout.pp - 1), layout.pp - 1})


def memory_bytes(model, layout, global_batch, dtype="float32", query_block=64):
    """The fullest stage's state at its peak and activations (the Prediction's memory, in bytes);
    raises NotPlanned as ``predict`` does, for a schedule it cannot plan."""
    m = micro_batches(layout, global_batch)
    bubble.check_planned(layout.schedule, layout.pp, m, layout.vpp)
    d = PRECISIONS[dtype].activation
    unsharded = replace(layout, zero_stage=0) if layout.zero_stage else layout  # ZeRO shards the state alone
    memory = 0
    for s in _stages(layout):
        held = state.stage_peak_bytes(model, layout, s, dtype, m)  # ZeRO: what a step holds for a moment too
        memory = max(memory, held + _activations(model, unsharded, m, d, s, query_block))
    return memory


@lru_cache(maxsize=4096)  # every ZeRO stage of a layout keeps the same activations: one count for the four
def _activations(model, layout, m, d, stage, query_block):
    return activations.stage_peak(model, layout, m, d, stage, query_block)


@lru_cache(maxsize=1024)  # one count for the layouts that differ only in what it does not read (``traffic.counted``)
def _traffic(model, layout, global_batch, dtype):
    """({group: bytes}, {group: latency steps}) of each group's busier stage (read, not changed)."""
    sent, steps = {}, {}
    for s in _stages(layout):
        b, n = traffic.group_traffic(model, layout, global_batch, s, dtype)
        for g in b:  # the busier stage's count of each group
            if b[g] >= sent.get(g, 0):
                sent[g], steps[g] = b[g], n[g]
    return sent, steps


def predict(model, layout, machine, global_batch, dtype="float32", query_block=64, memory=None):
    """The Prediction of one valid layout (``enumerate`` checks validity first); ``memory``: its
    ``memory_bytes`` where the caller has them already."""
    m = micro_batches(layout, global_batch)
    bub, _, source = bubble.pipeline(layout.schedule, layout.pp, m, layout.vpp, layout.recompute)
    imbalance = stage_imbalance(model, layout)
    if layout.defer_embedding_wgrad:  # W's moved out of the steady state: the stages' own costs replayed
        bub = deferred.bubble(model, layout.pp, m, layout.schedule, layout.vpp, layout.pipeline_layers,
                              layout.recompute, layout.defer_wgrad_linears)
        imbalance, source = 1.0, "simulator, FLOP costs, W's at the flush"  # (the imbalance is the replay's)
    if memory is None:
        memory = memory_bytes(model, layout, global_batch, dtype, query_block)
    sent, steps = (dict(count) for count in _traffic(model, traffic.counted(layout), global_batch, dtype))
    launches, calls, after = 0.0, {}, 0.0
    for s in _stages(layout):
        launches = max(launches, overhead.launch_seconds(model, layout, machine, global_batch, s))
        after = max(after, update.update_seconds(model, layout, machine, s))
        if machine.call_overhead_us:  # (0 on a GPU: nothing to count)
            for g, v in overhead.call_seconds(model, layout, machine, global_batch, s, dtype).items():
                calls[g] = max(calls.get(g, 0.0), v)
    model_flops, hardware_flops = flops_per_iteration(model, global_batch, layout.recompute, layout.selective)
    rate = machine.peak_tflops * 1e12 * machine.efficiency
    flop_time = hardware_flops / layout.world_size / rate * imbalance
    compute = flop_time + launches
    links = {g: link(layout, machine, g) for g in sent}
    raw = {g: seconds(sent[g], steps[g], links[g], machine) + calls.get(g, 0.0) for g in sent}
    exposed = dict(raw)
    backward = compute * 2 / 3
    for g in ("dp", "dp_cp", "edp"):
        if g in raw and layout.zero_stage == 0:
            exposed[g] = max(0.0, raw[g] - backward)
        elif g in raw and layout.zero_stage == 2:  # the m reduce-scatters overlap, the all-gather not
            overlapped = raw[g] * m / (m + 1)
            exposed[g] = max(0.0, overlapped - backward) + raw[g] - overlapped
    if "cp" in raw and layout.ring_attention:
        per_token = model_flops / (global_batch * model.seq_length)
        attention = 12 * model.num_layers * model.seq_length * model.hidden_size / per_token
        exposed["cp"] = max(0.0, raw["cp"] - flop_time * attention)  # behind attention's FLOPs, not its launches
    # the pipeline stretches compute and its messages by 1 / (1 - bubble), the update after its flush
    # not; ranks sharing cores make the work at least R / C times one rank's (its bubble then lent)
    busy = max(compute / (1 - float(bub)) + after, overhead.core_share(layout, machine) * (compute + after))
    in_pipeline = sum(exposed.get(g, 0.0) for g in ("tp", "cp", "ep", "pp")) / (1 - float(bub))
    step = busy + in_pipeline + sum(v for g, v in exposed.items() if g not in ("tp", "cp", "ep", "pp"))
    mfu = model_flops / (step * layout.world_size * machine.peak_tflops * 1e12)
    return Prediction(memory / 1e9, step, mfu, float(bub), sent, compute, exposed, links, source, after)
