"""Every layout of a model on a machine: the valid ones predicted and ranked by step time, the
rest counted by the reason they fail.

A layout is TP x CP x PP x DP = the GPUs (DP the rest), with EP a divisor of DP x CP (experts only),
virtual stages, a ZeRO stage, a micro-batch size, recomputation (none, selective or full), sequence
parallelism (TP > 1) and the CP communication (CP > 1). The schedule is
1F1B, ZB-H1 or ZB-H2 (Qi et al. 2024), interleaved with virtual stages or ZB-V with two: GPipe has 1F1B's bubble and
holds more micro-batches, so it never wins. Why a layout fails is
said by minipar's own rules (``validate.problems``: heads not divisible by TP, layers by PP x v,
Ulysses' heads by TP x CP, ...), then by the planner's two: TP across nodes (its all-reduces on
every layer would cross the slow link; refused as Megatron's guide does) and does not fit (the
fuller stage's state and activations beyond the GPU's memory). Counts are of layouts tried; a grid
refused before its inner choices counts once. One of validate's rules is not asked: the MPI tag
limit (2 m p v tags), a bound of minipar's MPI messages, not of the layout (NCCL has no tags; the
1T model's own layout needs 65,536).
"""

import math
import re
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from operator import attrgetter

from minipar.parallel import validate
from minipar.parallel.pipeline.schedules import shape_of

from . import hetero
from .bubble import NotPlanned
from .cost import memory_bytes, predict
from .shapes import Layout, run_config

CP_SIZES = (1, 2, 4, 8, 16)
MICRO_BATCH_SIZES = (1, 2, 4, 8)
VIRTUAL_STAGES = (1, 2, 4, 8)
# validate's fields as a reason names them: Megatron's flags, and the trainer's where Megatron has none
# (the trainer takes both; ``commands.train_flags`` prints its command)
FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size", "cp": "--context-parallel-size",
         "ep": "--expert-model-parallel-size", "n_head": "--num-attention-heads", "n_embd": "--hidden-size",
         "n_layer": "--num-layers", "block_size": "--seq-length", "vocab_size": "--vocab-size",
         "global_batch": "--global-batch-size", "micro_batch_size": "--micro-batch-size",
         "virtual_stages": "--virtual-pipeline-model-parallel-size", "zero_stage": "--zero-stage",
         "sequence_parallel": "--sequence-parallel", "num_experts": "--num-experts", "moe_router_topk": "--moe-router-topk",
         "moe_layer_freq": "--moe-layer-freq", "cp_comm_type": "--cp-comm-type", "schedule": "--schedule",
         "pipeline_layers": "--pipeline-layers", "defer_embedding_wgrad": "--defer-embedding-wgrad-compute",
         "defer_wgrad_linears": "--defer-wgrad-linears",
         "dropout": "--dropout"}


def divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


@lru_cache(maxsize=4096)  # the same few problems, over and over
def reason(problem):
    """A problem's kind: its words, the numbers left out (the key failures are counted by)."""
    return re.sub(r"\d+(\.\d+)?", "N", problem)


@dataclass
class Result:
    plans: list  # (Layout, Prediction), fastest first
    failures: Counter = field(default_factory=Counter)  # reason -> layouts
    examples: dict = field(default_factory=dict)  # reason -> one full message


def layouts(model, machine, global_batch):
    """Every candidate grid and its choices: yields (Layout, grid-level problem or None)."""
    n = machine.gpus
    for tp in divisors(n):
        for cp in (c for c in CP_SIZES if (n // tp) % c == 0):
            for pp in divisors(n // (tp * cp)):
                dp = n // (tp * cp * pp)
                if tp > machine.gpus_per_node:
                    yield Layout(tp=tp, cp=cp, pp=pp, dp=dp), (
                        f"TP={tp} spans nodes of {machine.gpus_per_node} GPUs: every layer's all-reduces would "
                        "cross the inter-node link; keep TP within a node")
                    continue
                yield from _choices(model, global_batch, tp, cp, pp, dp)


def _choices(model, global_batch, tp, cp, pp, dp):
    rows = global_batch // dp if global_batch % dp == 0 else 0
    for ep in (divisors(dp * cp) if model.num_experts else [1]):
        for vpp in (VIRTUAL_STAGES if pp > 1 else (1,)):
            for mbs in tuple(b for b in MICRO_BATCH_SIZES if rows and rows % b == 0) or (1,):  # (1,): refused, with why
                for zero in ((0, 1, 2, 3) if dp * cp > 1 else (0,)):  # ZeRO shards over DP x CP: one rank, nothing
                    for recompute in (None, "selective", "full"):
                        for sp in ((False, True) if tp > 1 else (False,)):
                            for comm in (("p2p", "a2a") if cp > 1 else ("p2p",)):
                                for schedule in schedules(pp, vpp):
                                    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=vpp, zero_stage=zero,
                                                    micro_batch_size=mbs, recompute=recompute == "full",
                                                    selective_recompute=recompute == "selective",
                                                    sequence_parallel=sp, cp_comm_type=comm, schedule=schedule)
                                    if layout.selective_recompute and not layout.selective:
                                        continue  # ring attention: the same run as none (Layout.selective)
                                    yield layout, None


def schedules(pp, vpp):
    """Interleaved with virtual stages, and ZB-V with two (in a V); else 1F1B and the zero-bubble
    ZB-H1 and ZB-H2."""
    if pp == 1:
        return ("1f1b",)
    return ("1f1b", "zb-h1", "zb-h2") if vpp == 1 else ("interleaved", "zb-v") if vpp == 2 else ("interleaved",)


def plan(model, machine, global_batch, dtype="float32"):
    """Every layout tried: the valid ones that fit, ranked by predicted step time, and the reasons
    the rest fail."""
    result = Result([])

    def fail(why):
        key = reason(why)
        result.failures[key] += 1
        result.examples.setdefault(key, why)

    def fits(layout):
        # the memory first: a layout that does not fit is not timed (the same Prediction's memory)
        try:
            memory = memory_bytes(model, layout, global_batch, dtype)
        except NotPlanned as e:
            return fail(str(e))
        if memory / 1e9 > machine.gpu_memory_gb:
            return fail(f"does not fit: {rounded_up(memory / 1e9):.3g} GB per GPU needed, "
                        f"{machine.gpu_memory_gb:g} GB available")
        result.plans.append((layout, predict(model, layout, machine, global_batch, dtype, memory=memory)))

    for layout, problem in layouts(model, machine, global_batch):
        if problem:
            fail(problem)
            continue
        problem = _problem(model, ASKED(layout), global_batch, dtype)
        if problem:
            fail(problem)
            continue
        fits(layout)
        layers = balanced(model, layout)
        if layers is not None:  # a valid pipeline tried with the head's stage lighter too: faster, its first stage fuller
            fits(replace(layout, pipeline_layers=layers))
    result.plans.sort(key=lambda lp: (lp[1].step_time_s, lp[1].memory_gb))  # a tie: the smaller footprint
    return result


# what validate is asked of a layout: its fields but recomputation, of which validate has no rule
# (``RunConfig.recompute``: "no rule of its own"; selective recomputation is not in the config at
# all), so that a layout's three choices are one question
ASKED_FIELDS = tuple(f.name for f in fields(Layout) if f.name not in ("recompute", "selective_recompute"))
ASKED = attrgetter(*ASKED_FIELDS)


@lru_cache(maxsize=1024)
def _problem(model, asked, global_batch, dtype):
    """The first of validate's problems of the layout of fields ``asked`` (``ASKED``), but the MPI
    tag limit (minipar's MPI bound, not the layout's: the module docstring), or None."""
    layout = Layout(**dict(zip(ASKED_FIELDS, asked)))
    return next((p for p in validate.problems(run_config(model, layout, global_batch, dtype), FLAGS)
                 if "message tags" not in p), None)


def rounded_up(x, digits=3):
    """``x`` > 0 rounded up to ``digits`` significant digits: a need never reads as less than it is
    (80.04 GB, which does not fit 80, is "80.1")."""
    step = 10 ** (math.floor(math.log10(x)) - digits + 1) if x > 0 else 1
    return math.ceil(x / step) * step


def balanced(model, layout):
    """The layers per chunk of ``--pipeline-layers balanced`` (``hetero.chunk_layers``: the head
    counted in blocks), or None where that is the even split, or where the even split is refused
    (the planner tries an uneven split only as the balance of an even one)."""
    if layout.pp == 1 or model.num_layers % (layout.pp * layout.vpp):
        return None
    head = _head(model, layout.recompute)
    layers = _balanced(model.num_layers, layout.pp, layout.vpp, head, shape_of(layout.schedule))
    return None if len(set(layers)) == 1 else layers


@lru_cache(maxsize=64)
def _head(model, recompute):
    return hetero.head_in_blocks(model, recompute)


@lru_cache(maxsize=1024)
def _balanced(num_layers, pp, vpp, head, shape):
    return tuple(hetero.chunk_layers(num_layers, pp, vpp, head, shape))


def as_json(layout, prediction):
    """One plan as the issue's JSON object (Megatron's names where they exist)."""
    # (the fields' own values, in their order: asdict's deep copy of each is the same JSON)
    named = ("tp", "pp", "dp", "cp", "ep", "zero_stage", "micro_batch_size", "recompute", "selective_recompute",
             "sequence_parallel", "cp_comm_type", "schedule", "pipeline_layers")
    out = {f.name: getattr(layout, f.name) for f in fields(layout) if f.name in named}
    out["vpp"] = layout.vpp
    out.update(memory_gb=round(prediction.memory_gb, 3), step_time_s=prediction.step_time_s, mfu=prediction.mfu,
               bytes_per_group=prediction.bytes_per_group, bubble=prediction.bubble,
               bubble_source=prediction.bubble_source, links=prediction.links)
    return out
