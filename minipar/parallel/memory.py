"""What one rank of a run holds, from the run's sizes alone, so that a model too large for the
machine is refused before anything is allocated (``python -m minipar.train`` asks ``problem``).

A rank holds a 1/(TP x PP) part of the parameters, their gradients and AdamW's two moments: four
arrays of the parameters' size. ZeRO shards them over the DP (x CP) group stage by stage: the moments
(stage 1), then the gradients (2), then the parameters (3). PipeDream-2BW (ZeRO 0 only) holds two
more: the stashed weight version and a batch's gradients set aside until its update. Of what a
step allocates beside that, the step's token ids are counted, and the activations: the caller's
count (the trainer gives the planner's of its fullest stage, ``plan.activations.stage_peak``,
which depends on the schedule and recomputation), or without one a floor the batch alone
decides, one micro-batch's logits (``batch_bytes``). It imports nothing from minipar, like
``validate``, which resolves the sizes it reads (a refusal alone asks ``comm.shm_orphans``,
itself plain Python, what dead MPI jobs hold in /dev/shm).

A mixture-of-experts block holds a router (E h) and E experts of the MLP's 8 h^2 + 5 h in place of
its MLP. Each rank holds E/EP whole experts (not split over TP) of the blocks of its stage, and
ZeRO shards them over their own group, the DP x CP / EP ranks that hold the same experts.
"""

import functools

BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def bytes_per_parameter(dtype, fp32_grads=False):
    """(weight, gradient, optimizer state) bytes per parameter of a model in ``dtype``: 16-bit
    models keep fp32 master weights beside the moments (the ZeRO paper's 2 + 2 + 12; gradients
    accumulated in fp32, ``fp32_grads``, make it 2 + 4 + 12)."""
    b = BYTES[dtype]
    return (b, 4 if fp32_grads else b, 12) if b == 2 else (b, b, 2 * b)


def parameter_count(n_layer, n_embd, block_size, vocab_size=256):
    """The GPT's parameters (GPT-2's shapes, biases, the output head tied to the token embedding):
    per block 12 h^2 + 13 h (attention 4 h^2 + 4 h, MLP 8 h^2 + 5 h, two LayerNorms 4 h), the token
    and position embeddings (V + T) h, the final LayerNorm 2 h."""
    h = n_embd
    return (vocab_size + block_size) * h + n_layer * (12 * h * h + 13 * h) + 2 * h


def mlp_parameters(h):
    return 8 * h * h + 5 * h


def moe_layers(cfg):
    """Blocks with experts: every moe_layer_freq-th from the first."""
    return len(range(0, cfg.n_layer, cfg.moe_layer_freq or 1)) if cfg.num_experts else 0


def total_parameters(cfg):
    """``parameter_count`` with each MoE block's MLP replaced by its router and E experts."""
    h, E = cfg.n_embd, cfg.num_experts or 0
    dense = parameter_count(cfg.n_layer, h, cfg.block_size, cfg.vocab_size or 256)
    return dense + moe_layers(cfg) * ((E - 1) * mlp_parameters(h) + E * h)


def state_bytes(cfg):
    """Bytes of parameters, gradients and AdamW's moments on one rank of ``cfg`` (a resolved
    ``validate.RunConfig``: its DP known)."""
    h, E, ep = cfg.n_embd, cfg.num_experts or 0, cfg.ep or 1
    experts = moe_layers(cfg) * E * mlp_parameters(h)
    per_rank = (total_parameters(cfg) - experts) / (cfg.tp * cfg.pp)  # dense: split over TP and PP
    stage = cfg.zero_stage

    weight, grad, optimizer = bytes_per_parameter(cfg.dtype, cfg.fp32_grads)

    def arrays(n):  # bytes of parameter, gradient and optimizer state, ZeRO-sharded over n ranks
        return (weight * (1 / n if stage >= 3 else 1) + grad * (1 / n if stage >= 2 else 1)
                + optimizer * (1 / n if stage >= 1 else 1))

    dp = (cfg.dp or 1) * (cfg.cp or 1)  # ZeRO shards dense state over DP x CP, experts' over DP x CP / EP
    held = per_rank * arrays(dp) + experts / ep / cfg.pp * arrays(dp / ep)
    if cfg.schedule == "pipedream-2bw":  # its stash: the weights again, and a batch's gradients set aside
        held += (per_rank + experts / ep / cfg.pp) * (weight + grad)
    return held


def gb(n, digits=1):
    return f"{n / 1e9:,.{digits}f} GB"


def batch_bytes(cfg, logits=True):
    """Bytes of two arrays every step allocates on some rank: the token ids, inputs and targets
    of the whole global batch (int64, (B, T) each: every rank reads the batch, then takes its
    rows), and (``logits``) one micro-batch's logits on the last stage ((rows, T / CP, V / TP) in
    the model's dtype)."""
    rows = cfg.micro_batch_size or cfg.global_batch // ((cfg.dp or 1) * (cfg.micro_batches or 1))
    vocab = -(-(cfg.vocab_size or 256) // cfg.tp)
    ids = 2 * 8 * cfg.global_batch * cfg.block_size
    return ids + (BYTES[cfg.dtype] * rows * (cfg.block_size // cfg.cp) * vocab if logits else 0)


def problem(cfg, free, names, activations=None, state=None):
    """A line saying that ``cfg`` cannot fit in ``free`` (bytes, ranks sharing them, what they are,
    as ``backend.free_memory`` reads them; None: not known), naming the fixes by the caller's
    ``names`` of the fields; None if it fits. ``activations``: the bytes the fullest rank's
    activations take at their peak, where the caller can count them (otherwise one micro-batch's
    logits stand for them, a floor). ``state``: the fullest stage's parameters, gradients and
    optimizer state, where the caller can count them stage by stage (the embedding on the first,
    each stage's own MoE blocks); otherwise ``state_bytes``, the model's average over TP x PP."""
    if free is None:
        return None
    total, ranks, what = free
    held = state_bytes(cfg) if state is None else state
    batch = batch_bytes(cfg, logits=activations is None)
    need, available = held + batch + (activations or 0), total / ranks
    if need <= available:
        return None
    # as many decimals as it takes to show the need above what is available (not "4.0 GB, but 4.0
    # GB is available"), and a model of kilobytes in megabytes' worth of them
    digits = next((d for d in range(1, 10) if round(need / 1e9, d) > round(available / 1e9, d)), 9)
    shown = functools.partial(gb, digits=digits)
    name = names.get
    fixes = [f"fewer {name('n_layer', 'layers')} or a smaller {name('n_embd', 'hidden size')}",
             f"a larger {name('tp', 'TP')} or {name('pp', 'PP')}"]
    shards = (cfg.dp or 1) * (cfg.cp or 1)  # ZeRO's group: DP x CP
    if shards == 1:
        fixes.append(f"more ranks with {name('zero_stage', 'ZeRO')} (it shards over DP)")
    elif cfg.zero_stage < 3:
        over = f"DP={cfg.dp or 1}" if cfg.cp in (None, 1) else f"DP x CP = {cfg.dp or 1} x {cfg.cp}"
        fixes.append(f"{name('zero_stage', 'ZeRO stage')} {cfg.zero_stage + 1} or more (it shards over {over})")
    n = total_parameters(cfg)
    if activations and activations > need / 2:  # long sequences (attention's T x T part), many in flight
        fixes.insert(0, f"fewer activations: a shorter {name('block_size', 'sequence')}, fewer sequences per "
                        f"micro-batch ({name('micro_batch_size', 'micro-batch size')}, {name('global_batch', 'batch')}),"
                        f" recomputation ({name('recompute', 'recompute')}) or {name('cp', 'CP')} to split the sequence")
    if (cfg.vocab_size or 256) * cfg.n_embd > n / 2:  # the embedding (tied with the head) is most of it
        fixes.insert(0, f"a smaller {name('vocab_size', 'vocabulary')}")
    if batch > need / 2:
        fixes.insert(0, f"a smaller {name('global_batch', 'batch')}")
    if what == "MemAvailable":
        from minipar.comm.shm_orphans import SHM_DIR, orphans  # the standard library's only

        dead = orphans()
        if dead:  # memory no process uses, which a reboot or this command frees
            fixes.append(f"free the {shown(sum(size for _, size in dead))} that MPI jobs which died left in "
                         f"{SHM_DIR} ({len(dead)} segments): python minipar/comm/shm_orphans.py --remove "
                         "(run_mpi.sh does it before each launch)")
    state = (", fp32 master weights" if BYTES[cfg.dtype] == 2 else "") + " and AdamW's two moments" + (
        " (and PipeDream-2BW's stashed weights and gradients)" if cfg.schedule == "pipedream-2bw" else "")
    kept = (f"{shown(batch)} for the batch's token ids and a micro-batch's logits (other activations not counted)"
            if activations is None else
            f"{shown(batch)} for the batch's token ids and {shown(activations)} for the activations the fullest rank keeps")
    return (f"this run needs about {shown(need)} on each rank: {shown(held)} for a model of {n:,} parameters "
            f"({cfg.dtype} parameters, gradients{state} on TP x CP x PP x DP = {cfg.tp} x {cfg.cp} x {cfg.pp} x "
            f"{cfg.dp or 1}, ZeRO stage {cfg.zero_stage}) and {kept}, but {shown(available)} is available to each "
            f"({what} {shown(total)} / {ranks} rank{'s' * (ranks > 1)} here); fix: {'; '.join(fixes)}")
