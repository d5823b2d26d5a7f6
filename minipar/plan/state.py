"""Parameters, gradients and AdamW state on one rank: counted exactly, as the optimizer's
``state_bytes()`` reports them.

A rank of pipeline stage r holds the blocks of its chunks (global chunks c p + r, each L/(p v)
blocks), the first stage also the embeddings and the last the final LayerNorm and its copy of the
tied embedding (``GPT.units``). Tensor parallelism splits the matrices and the biases of the
column-parallel layers; LayerNorms and the row-parallel biases stay whole on every TP rank. Per
block, with h the hidden size and t the TP size (GPT-2's shapes, ``memory.parameter_count``):

    attention  c_attn 3h^2/t + 3h/t,  c_proj h^2/t + h,  two LayerNorms 4h
    MLP        c_fc 4h^2/t + 4h/t,    c_proj 4h^2/t + h
    = 12 h^2/t + 7 h/t + 6 h           (memory.py's 12 h^2 + 13 h when t = 1)

The token embedding holds V'/t rows of h, V' the vocabulary padded to a multiple of t
(``tensor.padded_vocab``); positions T h; the final LayerNorm 2 h. A mixture-of-experts block
replaces its MLP by a router (E h, whole on every TP rank) and E/EP whole experts of
``memory.mlp_parameters`` (8 h^2 + 5 h) each.

AdamW keeps four arrays of the parameters' size: the parameters, their gradients and two moments
(in mixed precision, ``shapes.PRECISIONS``, 2 + 4 + 12 bytes per parameter).
ZeRO shards them over the N = DP x CP ranks that sum the dense gradients (experts' over N / EP):
the moments (stage 1), the gradients too (2), the parameters too (3). ZeRO pads each flat group to
a multiple of N (``shards.py``); the count here is exact when every parameter's size is a
multiple of N (h a multiple of N), and under it by less than N values per group otherwise.
"""

from dataclasses import replace
from functools import lru_cache

from minipar.parallel.tensor import padded_vocab

from .shapes import PRECISIONS, Layout


def stage_chunks(layout, stage):
    """The global chunks pipeline rank ``stage`` holds: c p + stage (Megatron's round-robin), or in
    ZB-V's V chunks stage and 2p - 1 - stage (``pipeline.instructions.Pipeline``)."""
    p, v = layout.pp, layout.vpp
    return [stage, 2 * p - 1 - stage] if layout.schedule == "zb-v" else [c * p + stage for c in range(v)]


def edges(layout, stage):
    """(first, last): whether rank ``stage`` holds the first chunk (the embeddings) and the last
    (ln_f and the head); in a V rank 0 holds both."""
    chunks = stage_chunks(layout, stage)
    return 0 in chunks, layout.pp * layout.vpp - 1 in chunks


def chunk_layers(model, layout, chunk):
    """The blocks of global pipeline chunk ``chunk``: the next L/(p v), or the chunk's count of
    ``layout.pipeline_layers`` (an uneven split) after those of the chunks before it."""
    sizes = layout.pipeline_layers or (model.num_layers // (layout.pp * layout.vpp),) * (layout.pp * layout.vpp)
    start = sum(sizes[:chunk])
    return range(start, start + sizes[chunk])


def stage_layers(model, layout, stage):
    """The blocks pipeline rank ``stage`` holds, in order: its chunks' runs of blocks."""
    return list(split_layers(model, split_of(layout), stage))


def split_of(layout):
    """What the split of the blocks over the stages reads of ``layout`` (``stage_chunks``,
    ``chunk_layers``): (PP, v, chunks in a V, the counts), a cache key the layouts the planner
    tries share where they differ elsewhere (a tuple: a Layout made at every call cost 10%)."""
    return layout.pp, layout.vpp, layout.schedule == "zb-v", layout.pipeline_layers


@lru_cache(maxsize=4096)  # asked for every stage of every layout the planner tries
def sharded(layout, recompute=False):
    """``layout`` with what ZeRO's groups and replays do not read set alike, a cache key that the
    layouts the planner tries share where they differ only there: DP and CP but as the DP x CP
    ranks that shard the state (a grid's CP choices), the micro-batch size, selective
    recomputation, CP's communication and, unless ``recompute`` (ZeRO-3's replay, in which it
    changes when a backward completes a group), full recomputation."""
    return replace(layout, dp=layout.dp * layout.cp, cp=1, micro_batch_size=1, recompute=recompute and layout.recompute,
                   selective_recompute=False, cp_comm_type="p2p")


@lru_cache(maxsize=256)
def split_layout(split):
    """A Layout of ``split_of``'s tuple, holding no more than it."""
    pp, vpp, v_shape, counts = split
    return Layout(pp=pp, vpp=vpp, schedule="zb-v" if v_shape else "1f1b", pipeline_layers=counts)


@lru_cache(maxsize=4096)  # the planner asks for every stage of every layout it tries
def split_layers(model, split, stage):
    """``stage_layers`` of a split (``split_of``), as a tuple."""
    layout = split_layout(split)
    return tuple(layer for g in stage_chunks(layout, stage) for layer in chunk_layers(model, layout, g))


def block_modules(model, layout, layer):
    """Block ``layer``'s parameters on one rank, module by module in the model's order: [(kind,
    [(values, expert, partial)])], kind "norm", "linear", "router" or "expert" (this rank's whole
    experts, ``memory.mlp_parameters`` each), ``partial`` for what every TP rank holds whole and
    sequence parallelism leaves each a part of the gradient of (the LayerNorms, the row-parallel
    biases, the router)."""
    return _block(model, layer, layout.tp, layout.ep)[0]


def _block(model, layer, tp=1, ep=1):
    """(``block_modules``, its (dense, experts, partial) sums): one computation per kind of block."""
    experts = model.num_experts if model.is_moe(layer) else 0
    return _block_modules(model.hidden_size, tp, experts, experts // ep)


@lru_cache(maxsize=1024)  # the planner asks for every block of every layout it tries
def _block_modules(h, t, experts, local):
    norm = ("norm", ((h, False, True),) * 2)
    out = (norm, ("linear", ((3 * h * h // t, False, False), (3 * h // t, False, False))),  # ln_1, c_attn,
           ("linear", ((h * h // t, False, False), (h, False, True))), norm)  # c_proj (its bias whole), ln_2
    if not experts:
        out += (("linear", ((4 * h * h // t, False, False), (4 * h // t, False, False))),
                ("linear", ((4 * h * h // t, False, False), (h, False, True))))
    else:  # an expert's c_fc and c_proj, whole: memory.mlp_parameters(h) = 8 h^2 + 5 h
        expert = ("expert", ((4 * h * h, True, False), (4 * h, True, False), (4 * h * h, True, False),
                             (h, True, False)))
        out += (("router", ((experts * h, False, True),)),) + (expert,) * local
    values = [p for _, params in out for p in params]
    return out, (sum(v for v, e, _ in values if not e), sum(v for v, e, _ in values if e),
                 sum(v for v, _, partial in values if partial))


def block_parameters(model, layout, layer):
    """(dense, experts) parameters block ``layer`` puts on one rank."""
    return _block(model, layer, layout.tp, layout.ep)[1][:2]


def token_embedding(model, layout):
    """The parameters of one TP rank's token embedding (and of the last stage's tied copy): V'/t
    rows of h, V' the vocabulary padded to a multiple of t."""
    return padded_vocab(model.vocab_size, layout.tp) // layout.tp * model.hidden_size


def partial_sums(model, layer):
    """The parameters of block ``layer`` whole on every TP rank, whose gradients sequence
    parallelism leaves each TP rank a part of: the LayerNorms, c_proj's bias and the MLP's (a MoE
    block has none: its router, E h, instead)."""
    return _block(model, layer)[1][2]  # (whole on every TP rank: the same for any TP)


def rank_parameters(model, layout, stage=0):
    """(dense, experts) parameters a rank of pipeline stage ``stage`` holds."""
    return _rank_parameters(model, layout.tp, layout.ep, split_of(layout), stage)


@lru_cache(maxsize=4096)
def _rank_parameters(model, tp, ep, split, stage):  # all it reads of a layout: TP, EP and the split
    layout = replace(split_layout(split), tp=tp, ep=ep)
    h = model.hidden_size
    layers = stage_layers(model, layout, stage)
    kinds = {}  # is it MoE -> [a block of that kind, how many]: every block of a kind holds the same
    for layer in layers:
        kinds.setdefault(model.is_moe(layer), [layer, 0])[1] += 1
    dense = experts = 0
    for layer, count in kinds.values():
        d, e = block_parameters(model, layout, layer)
        dense, experts = dense + count * d, experts + count * e
    wte = token_embedding(model, layout)
    first, last = edges(layout, stage)
    if first:
        dense += wte + model.seq_length * h
    if last:
        dense += 2 * h + (wte if not first else 0)  # the last stage's copy of the tied embedding
    return dense, experts


def state_bytes(model, layout, stage=0, dtype="float32"):
    """{"parameters", "gradients", "optimizer"}: bytes a rank of ``stage`` holds after a step, as
    ``DistributedOptimizer.state_bytes()`` reports them (AdamW's two moments are "optimizer"), and
    PipeDream-2BW's "stash": its second weight version and a batch's gradients set aside
    (``WeightStash.stash_bytes``, ZeRO 0)."""
    dense, experts = rank_parameters(model, layout, stage)
    n = layout.dp * layout.cp  # the ranks ZeRO shards the dense state over
    z, d = layout.zero_stage, PRECISIONS[dtype]

    def held(count, shards):
        return {"parameters": d.param * count // (shards if z >= 3 else 1),
                "gradients": d.grad * count // (shards if z >= 2 else 1),
                "optimizer": d.optimizer * count // (shards if z >= 1 else 1)}

    a, b = held(dense, n), held(experts, n // layout.ep)
    out = {k: a[k] + b[k] for k in a}
    if layout.schedule == "pipedream-2bw":
        out["stash"] = out["parameters"] + out["gradients"]
    return out


def stage_peak_bytes(model, layout, stage=0, dtype="float32", micro_batches=None):
    """The most state bytes a rank of ``stage`` holds during a step (``peak_state_bytes()`` of its
    optimizer). ZeRO-3 holds more than its shards then: whole parameters gathered and prefetched,
    gradient buffers, sends in flight (``zero3_peak.peak_bytes``, the worst case of when sends finish:
    an upper bound that some runs reach, exact under that timing). Stages 1 and 2 add the group they
    are sending and the one before it, and stage 2 every whole gradient not sent yet
    (``zero12.transient_bytes``); stage 0 holds no more than after a step. ``micro_batches``
    unknown (None) is taken as the most for any m (ZeRO-3: 3p; stages 1 and 2: 2, or 3p on a rank
    of several chunks; tested)."""
    # all it reads of a layout is ``sharded``'s (with recomputation for ZeRO-3's replay): one count
    # for the layouts the planner tries that differ elsewhere
    return _stage_peak_bytes(model, sharded(layout, layout.zero_stage == 3), stage, dtype, micro_batches)


@lru_cache(maxsize=65536)
def _stage_peak_bytes(model, layout, stage, dtype, micro_batches):
    if layout.zero_stage == 3:
        from .zero3_peak import peak_bytes  # (it reads this module's counts)

        return peak_bytes(model, layout, micro_batches, stage, dtype)["total"]
    from .zero12 import transient_bytes  # (as zero3_peak)

    extra = transient_bytes(model, layout, stage, dtype, micro_batches)
    return sum(state_bytes(model, layout, stage, dtype).values()) + extra


def peak_state_bytes(model, layout, dtype="float32", micro_batches=None):
    """The fullest stage's most state bytes during a step (the one that must fit)."""
    return max(stage_peak_bytes(model, layout, s, dtype, micro_batches) for s in range(layout.pp))
