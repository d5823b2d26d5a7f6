"""What a run is, as ``parallel/validate.py`` asks about it: ``RunConfig``, the names its fields may
take, and the rules of single fields (a positive size, a known schedule) that come before the rules
between fields. ``Say`` words a field the way the caller knows it (docs in ``validate``).
"""

import math
import numbers
from dataclasses import dataclass
from typing import Optional

MAX_TAG = 32767  # the largest tag MPI promises (MPI_TAG_UB is at least this)
SCHEDULES = ("gpipe", "1f1b", "1f1b-slack", "interleaved", "zb-h1", "zb-h2", "zb-v", "pipedream-2bw")  # the names pipeline/schedules.py builds
SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zb-v")  # schedules that run the weights' gradients (W) apart from B
DEFERS_HEAD = ("gpipe", "1f1b", "1f1b-slack", "interleaved")  # flushed, with whole backwards: the head's W can wait for the flush
DTYPES = ("float32", "float64", "bfloat16", "float16")  # the last two: mixed precision's model dtypes
CP_COMM_TYPES = ("p2p", "a2a")  # ring attention, DeepSpeed-Ulysses (parallel/context.py)
NAMES = {"tp": "TP", "pp": "PP", "dp": "DP", "cp": "CP", "ep": "EP"}  # a field's name in a message when the caller gives none


@dataclass(frozen=True)
class RunConfig:
    world_size: Optional[int] = None
    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None  # None: world_size / (tp x cp x pp)
    cp: int = 1  # context parallel: ranks that split each sequence
    cp_comm_type: Optional[str] = None  # how they attend across it: "p2p" (the default) or "a2a"
    ep: int = 1  # expert parallel: ranks of DP that split the experts
    num_experts: Optional[int] = None  # None: dense MLPs
    moe_router_topk: Optional[int] = None  # experts per token
    moe_layer_freq: Optional[int] = None  # every moe_layer_freq-th block has experts
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_loss_coeffs: tuple = ()  # the auxiliary losses' coefficients
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    schedule: Optional[str] = None  # one of SCHEDULES
    global_batch: Optional[int] = None  # sequences per step, over all data-parallel ranks
    micro_batch_size: Optional[int] = None  # None: rows per DP rank / micro_batches
    micro_batches: Optional[int] = None  # None: rows per DP rank / micro_batch_size, or PP if neither
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    block_size: Optional[int] = None
    vocab_size: Optional[int] = None
    dropout: Optional[float] = None
    sequence_parallel: bool = False
    zero_stage: int = 0
    recompute: bool = False  # no rule of its own; part of the run's description
    fp32_grads: bool = False  # 16-bit runs: gradients accumulated and reduced in fp32 (memory counts them)
    pipeline_layers: Optional[tuple] = None  # layers of each global pipeline chunk; None: n_layer / (pp x v) each
    defer_embedding_wgrad: bool = False  # the head's weight gradients run at the pipeline's flush
    defer_wgrad_linears: int = 0  # and those of the last stage's last linear layers (validate._deferred_head);
    # "balanced": a count the trainer chooses (plan.hetero.balanced_linears)
    dtype: str = "float32"


POSITIVE = ("world_size", "tp", "pp", "dp", "cp", "ep", "num_experts", "moe_router_topk", "moe_layer_freq", "virtual_stages", "global_batch", "micro_batch_size",
            "micro_batches", "n_layer", "n_head", "n_embd", "block_size", "vocab_size")


class Say:
    """How a message names a field: ``--tp 2`` for a flag, ``TP=2`` otherwise."""

    def __init__(self, cfg, names):
        self.cfg, self.names = cfg, {**NAMES, **(names or {})}

    def name(self, field):
        return self.names.get(field, field)

    def __call__(self, field, value=None):
        value = getattr(self.cfg, field) if value is None else value
        name = self.name(field)
        if isinstance(value, bool):
            return name if value else f"no {name}"
        return f"{name} {value}" if name.startswith("-") else f"{name}={value!r}"

    def offers(self, field):
        """Whether the caller can set ``field``: a flag of its own, or any field when it speaks in
        fields, not flags (a lesson has flags for some fields only)."""
        return self.name(field).startswith("-") or not any(n.startswith("-") for n in self.names.values())

    def change(self, *fields):
        """The fields a fix may change: the caller's flags among them, or all of them if none is."""
        flags = [self.name(f) for f in fields if self.name(f).startswith("-")]
        return " or ".join(flags or [self.name(f) for f in fields])


def field_problems(cfg, say):
    """Problems of single values; returns (problems, the fields the other rules must skip)."""
    out, bad = [], set()
    for field in POSITIVE:
        value = getattr(cfg, field)
        if value is not None and not (type(value) is int and value >= 1) and (  # (a plain int asks no ABC)
                isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            out.append(f"{say.name(field)} must be a positive integer, got {value!r}")
            bad.add(field)
    k = cfg.defer_wgrad_linears
    if k != "balanced" and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0):
        out.append(f"{say.name('defer_wgrad_linears')} must be a whole number of linear layers, 0 or more, got {k!r}")
        bad.add("defer_wgrad_linears")
    if cfg.zero_stage not in (0, 1, 2, 3) or isinstance(cfg.zero_stage, bool):
        out.append(f"{say.name('zero_stage')} must be 0, 1, 2 or 3, got {cfg.zero_stage!r}")
        bad.add("zero_stage")
    if cfg.cp_comm_type is not None and cfg.cp_comm_type not in CP_COMM_TYPES:
        out.append(f"{say('cp_comm_type')} is not a context-parallel communication: choose one of "
                   f"{', '.join(CP_COMM_TYPES)}")
        bad.add("cp_comm_type")
    if cfg.schedule is not None and cfg.schedule not in SCHEDULES:
        out.append(f"{say('schedule')} is not a pipeline schedule: choose one of {', '.join(SCHEDULES)}")
        bad.add("schedule")
    if cfg.dtype not in DTYPES:
        out.append(f"{say('dtype')} is not a floating dtype minipar runs: choose {' or '.join(DTYPES)}")
    d = cfg.dropout
    if d is not None and (isinstance(d, bool) or not isinstance(d, numbers.Real) or not math.isfinite(d)
                          or not 0 <= d < 1):
        out.append(f"{say.name('dropout')} must be a number in [0, 1), got {d!r}")
    return out, bad
