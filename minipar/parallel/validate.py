"""One validation of a run: every problem of a configuration, from plain numbers.

A ``RunConfig`` describes a run: the job's size, the grid, the model's shape, the pipeline
schedule, the batch, sequence and context parallelism and ZeRO. ``problems(cfg)`` returns every rule it
breaks, one line each, naming the field (or the caller's flag for it) and the fix;
``resolve(cfg)`` also fills in what the sizes imply: DP from the world size, the micro-batches
from the batch. Nothing here communicates or allocates, so every rank finds the same problems
before any message. The CLI, the lessons and the constructors (``ProcessGrid``, ``GPT``,
``GPTConfig``, ``PipelineExecutor``, the schedules) all ask this module, and keep no size rules of
their own.

A field left None is not part of the question: ``GPT`` asks about the model on its grid without a
batch, the executor about its schedule without the model's width. A field whose own value is bad
(``tp=0``) is reported once and left out of the rules that would divide by it.

``names`` maps fields to what the caller calls them: the CLI passes its flags (``{"tp": "--tp"}``),
so a problem reads ``--n-head 3 is not divisible by --tp 2``; a constructor passes nothing and
reads ``n_head=3 is not divisible by TP=2``.

``RunConfig``, the names its fields may take and the rules of single fields are in
``run_config.py``; this module holds the rules between fields, and re-exports the rest.
"""

import math
import numbers
from dataclasses import fields, replace

from minipar.parallel.run_config import (  # noqa: F401  RunConfig and the names: re-exported, asked of validate
    CP_COMM_TYPES, DEFERS_HEAD, DTYPES, MAX_TAG, NAMES, SCHEDULES, SPLIT_BACKWARD, RunConfig, Say, field_problems)


def _pipeline_layers_problems(cfg, say, pp, v, known):
    """An uneven split: one count per global chunk (pp x v of them), each at least one layer,
    together n_layer."""
    layers, out = cfg.pipeline_layers, []
    if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in layers):
        out.append(f"{say.name('pipeline_layers')} {list(layers)}: every pipeline chunk needs at least one layer")
    if known("pp", "virtual_stages") and len(layers) != pp * v:
        out.append(f"{say.name('pipeline_layers')} {list(layers)} has {len(layers)} counts: give one per pipeline "
                   f"chunk, {say.name('pp')} x {say.name('virtual_stages')} = {pp} x {v}")
    if known("n_layer") and not out and sum(layers) != cfg.n_layer:
        out.append(f"{say.name('pipeline_layers')} {list(layers)} sums to {sum(layers)}, not {say('n_layer')}: "
                   f"give counts that add up to {cfg.n_layer}")
    return out


FIELDS = tuple(f.name for f in fields(RunConfig))


def resolve(cfg, names=None):
    """(cfg with ``dp``, ``micro_batches`` and ``micro_batch_size`` filled in where the other sizes
    determine them, every problem as a list of one-line strings)."""
    dp, m, mbs, out = _resolve(cfg, names)
    return replace(cfg, dp=dp, micro_batches=m, micro_batch_size=mbs), out


def _resolve(cfg, names):
    """(DP, micro-batches, their size, the problems): ``resolve`` without the new config, which
    ``problems`` does not need (the planner asks about hundreds of thousands of layouts)."""
    say = Say(cfg, names)
    out, bad = field_problems(cfg, say)
    unknown = bad | {f for f in FIELDS if getattr(cfg, f) is None}

    def known(*wanted):  # given, and of a value the other rules can use
        return unknown.isdisjoint(wanted)

    tp, pp, v, dp = cfg.tp, cfg.pp, cfg.virtual_stages, cfg.dp if known("dp") else None
    cp = cfg.cp if known("cp") else 1
    # the grid: TP x CP x DP x PP ranks
    if known("world_size", "tp", "pp"):
        n, grid = cfg.world_size, tp * cp * pp
        kinds = ("tp", "cp", "pp") if cp > 1 else ("tp", "pp")  # CP named only where it is used

        def product(*extra):
            names, sizes = kinds + extra, [getattr(cfg, k) if k != "dp" else dp for k in kinds + extra]
            return f"{' x '.join(k.upper() for k in names)} = {' x '.join(map(str, sizes))}"

        if cfg.dp is None and n % grid:
            out.append(f"{n} ranks do not split into {product()} groups: launch a multiple "
                       f"of {grid} ranks or change {say.change(*kinds)}")
        elif cfg.dp is None:
            dp = n // grid
        elif dp is not None and grid * dp != n:
            out.append(f"{product('dp')} = {grid * dp} ranks, but the job has {n}: "
                       f"launch with -n {grid * dp} or change the sizes")
            dp = None  # no batch rule on a grid that cannot be
    # the model, and the model on the grid
    if known("n_embd", "n_head") and cfg.n_embd % cfg.n_head:
        out.append(f"{say('n_embd')} is not divisible by {say('n_head')}: every head needs "
                   f"n_embd / n_head dimensions")
    if known("n_head", "tp") and cfg.n_head % tp:
        out.append(f"{say('n_head')} is not divisible by {say('tp')}: each TP rank needs whole heads; "
                   f"choose {say.name('tp')} among the divisors of {say.name('n_head')}")
    if known("n_embd", "tp") and cfg.n_embd % tp:
        out.append(f"{say('n_embd')} is not divisible by {say('tp')}: each TP rank holds "
                   f"n_embd / TP columns; choose {say.name('tp')} among its divisors")
    if cfg.pipeline_layers is not None:  # an uneven split (a balancer's, for stages of unequal speed)
        out += _pipeline_layers_problems(cfg, say, pp, v, known)
    elif known("n_layer", "pp", "virtual_stages") and cfg.n_layer < pp * v:
        out.append(f"{say('n_layer')} is fewer than {say.name('pp')} x {say.name('virtual_stages')} = {pp} x {v}: "
                   "every pipeline chunk needs a layer")
    elif known("n_layer", "pp", "virtual_stages") and cfg.n_layer % (pp * v):
        uneven = f", or give {say.name('pipeline_layers')}" if say.offers("pipeline_layers") else ""
        out.append(f"{say('n_layer')} is not divisible by {say.name('pp')} x {say.name('virtual_stages')} "
                   f"= {pp} x {v}: every pipeline chunk needs the same number of layers{uneven}")
    # One rank can run its chunks in turn, so the schedules allow v > 1 with p = 1; a job that asks
    # for virtual stages without a pipeline is a mistake, so a run (its world size given) may not.
    one_rank = known("world_size") and pp == 1
    other = known("schedule") and cfg.schedule not in ("interleaved", "zb-v")
    if known("pp", "virtual_stages") and v > 1 and (one_rank or other):
        needs = [f"{say.name('pp')} > 1"] * one_rank + [say("schedule", "interleaved") + " or zb-v"] * other
        out.append(f"{say('virtual_stages')} needs {' and '.join(needs)}")
    if known("world_size", "schedule", "virtual_stages") and cfg.schedule == "interleaved" and v == 1:
        out.append(f"{say('schedule', 'interleaved')} takes turns between each rank's chunks: with "
                   f"{say('virtual_stages', 1)} it is 1F1B; give {say.name('virtual_stages')} 2 or more, "
                   f"or {say('schedule', '1f1b')}")
    if known("schedule", "virtual_stages") and cfg.schedule == "zb-v" and v != 2:
        needs, given = say("virtual_stages", 2), f"{v}"
        if one_rank:  # v = 2 alone would be refused next for p = 1: name both
            needs, given = f"{needs} and {say.name('pp')} > 1", f"{say('virtual_stages', v)}, {say('pp')}"
        out.append(f"{say('schedule', 'zb-v')} places two chunks per rank in a V: it needs {needs}, got {given}")
    _context(cfg, say, known, out)
    _experts(cfg, say, known, dp, out)
    m, mbs = _batch(cfg, say, known, dp, out)
    _schedule(cfg, say, known, dp, m, mbs, out)
    # sequence parallelism and ZeRO
    if cfg.sequence_parallel and known("tp") and tp == 1:
        out.append(f"{say('sequence_parallel')} splits along the tensor-parallel group: it needs "
                   f"{say.name('tp')} > 1")
    if cfg.sequence_parallel and known("tp", "block_size") and cfg.block_size % tp:
        out.append(f"{say('sequence_parallel')} splits the sequence: {say('block_size')} is not "
                   f"divisible by {say('tp')}")
    if known("zero_stage", "schedule") and cfg.schedule == "pipedream-2bw" and cfg.zero_stage > 0:
        out.append(f"{say('schedule', 'pipedream-2bw')} stashes a second copy of the weights it updates "
                   f"whole: it needs {say('zero_stage', 0)}")
    return dp, m, mbs, out


def _context(cfg, say, known, out):
    """Context parallelism cuts every sequence into 2 x CP chunks (rank r holds chunks r and
    2CP-1-r, so causal work is even); Ulysses also gives each rank whole heads."""
    if not known("cp") or cfg.cp == 1:
        return
    cp, tp = cfg.cp, cfg.tp if known("tp") else 1
    if known("block_size") and cfg.block_size % (2 * cp):
        out.append(f"context parallelism cuts each sequence into 2 x {say.name('cp')} chunks: {say('block_size')} "
                   f"is not divisible by {2 * cp}; choose a multiple of {2 * cp}")
    elif cfg.sequence_parallel and known("block_size") and (cfg.block_size // cp) % tp:
        out.append(f"{say('sequence_parallel')} splits each context-parallel rank's {cfg.block_size // cp} "
                   f"positions over {say('tp')}: choose {say.name('block_size')} a multiple of {cp * tp}")
    if cfg.cp_comm_type == "a2a" and known("n_head") and cfg.n_head % (tp * cp):
        out.append(f"{say('cp_comm_type')} (Ulysses) gives each rank whole heads: {say('n_head')} is not "
                   f"divisible by TP x CP = {tp * cp}; use {say.name('cp_comm_type')} p2p or change the sizes")


def _experts(cfg, say, known, dp, out):
    """Expert parallelism is carved out of DP x CP and gives each EP rank E/EP whole experts."""
    if not known("ep"):
        return
    ep, experts = cfg.ep, cfg.num_experts if known("num_experts") else None
    cp = cfg.cp if known("cp") else 1
    if dp is not None and (dp * cp) % ep:
        given = say("dp") if cfg.dp is not None else f"DP={dp}"
        given += f" x {say('cp')}" if cp > 1 else ""
        out.append(f"expert parallelism is carved out of DP x CP: {say('ep')} does not divide "
                   f"{given}; choose {say.name('ep')} among the divisors of DP x CP = {dp * cp}")
    if experts is not None and experts % ep:
        out.append(f"{say('num_experts')} is not divisible by {say('ep')}: each EP rank holds "
                   f"num_experts / EP whole experts")
    if experts is not None and known("moe_router_topk") and cfg.moe_router_topk > experts:
        out.append(f"{say('moe_router_topk')} exceeds {say('num_experts')}: a token can choose at most every expert")
    c = cfg.moe_expert_capacity_factor
    if c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c <= 0):
        out.append(f"{say.name('moe_expert_capacity_factor')} must be a positive number (or none: dropless), got {c!r}")
    for coeff in cfg.moe_loss_coeffs:
        if isinstance(coeff, bool) or not isinstance(coeff, numbers.Real) or not math.isfinite(coeff) or coeff < 0:
            out.append(f"the auxiliary losses' coefficients must be numbers >= 0, got {coeff!r}")


def _batch(cfg, say, known, dp, out):
    """The batch over DP ranks and micro-batches; returns (micro-batches, their size) or Nones."""
    m = cfg.micro_batches if known("micro_batches") else None
    mbs = cfg.micro_batch_size if known("micro_batch_size") else None
    if not known("global_batch") or dp is None:
        return m, mbs
    if cfg.global_batch % dp:
        given = say("dp") if cfg.dp is not None else f"DP={dp}"  # DP from the world size names no flag
        out.append(f"{say('global_batch')} does not split over {given} ranks: use a multiple of {dp}")
        return m, mbs
    rows = cfg.global_batch // dp  # sequences per data-parallel rank per step
    if m is None and mbs is None and known("pp"):  # Megatron's default: one micro-batch per stage
        if rows % cfg.pp:
            out.append(f"{rows} sequences per data-parallel rank do not split into micro-batches of the "
                       f"default size (rows / PP): set {say.name('micro_batch_size')} to a divisor of {rows}")
            return None, None
        m = cfg.pp
    if mbs is not None and m is not None and cfg.micro_batches is not None and cfg.micro_batch_size is not None:
        if m * mbs != rows:
            out.append(f"{say('micro_batches')} x {say('micro_batch_size')} is not the {rows} sequences "
                       f"per data-parallel rank ({say('global_batch')} / DP={dp}): give one of the two")
            return m, mbs
    elif mbs is not None:
        if rows % mbs:
            out.append(f"{rows} sequences per data-parallel rank do not split into micro-batches of "
                       f"{mbs}: set {say.name('micro_batch_size')} to a divisor of {rows}")
            return None, mbs
        m = rows // mbs
    elif m is not None:
        if rows % m:
            out.append(f"{say('global_batch')} does not split into {say('micro_batches')} equal "
                       f"micro-batches on each of {dp} data-parallel ranks: use a multiple of {m * dp}")
            return m, None
        mbs = rows // m
    return m, mbs


def _deferred_head(cfg, say, known, out):
    """The head's weight gradients wait for a flush (``schedules.defer_head_weight``): a pipeline,
    and a schedule that flushes with whole backwards. ``defer_wgrad_linears`` moves more of the last
    stage's weight gradients there, those of its last linear layers (``GPT.last_linear_weights``)."""
    _deferred_linears(cfg, say, known, out)
    if not cfg.defer_embedding_wgrad:
        return
    flag = say("defer_embedding_wgrad")
    if known("defer_wgrad_linears") and cfg.defer_wgrad_linears:  # a fix that drops the one drops both
        flag += f" (and {say.name('defer_wgrad_linears')})"
    if known("pp") and cfg.pp == 1:
        out.append(f"{flag} runs the head's weight gradients at the pipeline's flush, while the last "
                   f"stage waits for the first: it needs {say.name('pp')} > 1")
    if known("schedule") and cfg.schedule in SPLIT_BACKWARD:
        out.append(f"{say('schedule', cfg.schedule)} already runs every weight gradient apart (W), the "
                   f"head's among them: drop {flag}")
    elif known("schedule") and cfg.schedule not in DEFERS_HEAD:
        out.append(f"{say('schedule', cfg.schedule)} never flushes, so nothing hides the head's weight "
                   f"gradients: {flag} needs one of {', '.join(DEFERS_HEAD)}")


def dense_tail(n_layer, layers, num_experts, moe_layer_freq):
    """How many of the last chunk's ``layers`` blocks, counted back from the model's last, are dense
    before the first with experts (every moe_layer_freq-th from the first has them): the blocks
    whose linear layers ``defer_wgrad_linears`` may park."""
    if not num_experts:
        return layers
    return next((j for j in range(layers) if (n_layer - 1 - j) % moe_layer_freq == 0), layers)


def _deferred_linears(cfg, say, known, out):
    """More weight gradients at the flush: beside the head's, in the dense blocks that end the last
    chunk (a block with experts has no MLP products of its own; every moe_layer_freq-th is one)."""
    k = cfg.defer_wgrad_linears
    if not known("defer_wgrad_linears") or not k:
        return
    flag = say("defer_wgrad_linears")
    single = known("pp") and cfg.pp == 1
    if not cfg.defer_embedding_wgrad and (single or known("schedule") and cfg.schedule not in DEFERS_HEAD):
        # (with the head's deferral asked for too, its own rules say the same)
        out.append(f"{flag} needs a pipeline that flushes with whole backwards ({', '.join(DEFERS_HEAD)}; "
                   f"{say.name('pp')} > 1), not {say('pp') if single else say('schedule')}: drop it")
    elif not cfg.defer_embedding_wgrad:
        out.append(f"{flag} parks linear layers' weight gradients beside the head's, which go to the flush "
                   f"first: add {say.name('defer_embedding_wgrad')}")
    if cfg.pipeline_layers is not None and all(isinstance(n, numbers.Integral) for n in cfg.pipeline_layers):
        layers = cfg.pipeline_layers[-1]
    elif known("n_layer", "pp", "virtual_stages") and cfg.n_layer % (cfg.pp * cfg.virtual_stages) == 0:
        layers = cfg.n_layer // (cfg.pp * cfg.virtual_stages)
    else:
        return
    freq = cfg.moe_layer_freq if known("moe_layer_freq") else 1
    if known("num_experts", "n_layer") and cfg.num_experts:  # the dense blocks that end the last chunk
        dense = dense_tail(cfg.n_layer, layers, cfg.num_experts, freq)
        if k == "balanced" and not dense or k != "balanced" and k > 4 * dense:
            fix = f"park at most {4 * dense}" if dense else "drop it"
            out.append(f"{flag} parks the linear layers of dense blocks, and block {cfg.n_layer - 1 - dense} has "
                       f"experts (every {say.name('moe_layer_freq')}-th block from the first, {freq}): {fix}")
    elif k != "balanced" and k > 4 * layers:
        out.append(f"{flag} is more than the last pipeline chunk's {4 * layers} linear layers (4 per block): "
                   f"park at most {4 * layers}")


def _schedule(cfg, say, known, dp, m, mbs, out):
    """The schedule's own requirements of the micro-batches."""
    _deferred_head(cfg, say, known, out)
    if m is None or not known("pp", "virtual_stages"):
        return
    p, v = cfg.pp, cfg.virtual_stages
    given = cfg.micro_batches is not None  # else the caller set them through the batch
    size = say("micro_batch_size", mbs) if known("micro_batch_size") else f"{mbs} (rows / PP, the default)"
    count = say("micro_batches", m) if given else f"{m} micro-batches ({say('global_batch')} / (DP={dp} x {size}))"
    if known("schedule") and cfg.schedule == "interleaved" and m % p:
        fix = (f"choose {say.name('micro_batches')} among the multiples of {p}" if given else
               f"set {say.name('micro_batch_size')} so that the micro-batches are a multiple of {p}")
        out.append(f"the interleaved schedule runs micro-batches in groups of {say.name('pp')}: {count} is not "
                   f"divisible by {say('pp')}; {fix}")
    # PipeDream-2BW has two batches in flight, each with its own tags above evaluation's
    tags = 2 * m * p * v * (3 if known("schedule") and cfg.schedule == "pipedream-2bw" else 1)
    if p > 1 and tags > MAX_TAG and not (known("n_layer") and cfg.n_layer < p * v):  # (said: too few layers)
        fewer = f"fewer {say.name('micro_batches')}" if given else f"a larger {say.name('micro_batch_size')}"
        fix = f"use {fewer} or fewer pipeline chunks ({say.name('pp')} x {say.name('virtual_stages')})"
        out.append(f"{count} x {p * v} pipeline chunks need {tags} message tags, more than MPI "
                   f"promises ({MAX_TAG}): {fix}")


def problems(cfg, names=None):
    """Every problem of ``cfg``, one line each ([] for a run that can be)."""
    return _resolve(cfg, names)[3]


def check(cfg, names=None, what=None):
    """``resolve`` for a constructor: the resolved config, or a ValueError with every problem."""
    resolved, found = resolve(cfg, names)
    if found:
        raise ValueError((f"{what}: " if what else "") + "; ".join(found))
    return resolved
