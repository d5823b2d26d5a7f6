"""What a step costs beyond its FLOPs and bytes: per-call overheads and cores shared by ranks.

The alpha-beta model (``cost.py``) prices a step by its FLOPs and its bytes. A small model's step
is mostly neither: each layer's forward and backward is a few dozen kernel launches (in minipar,
Python calls into NumPy, each some microseconds whatever its size), and each collective or message
a fixed cost before its first byte moves. And where more ranks run on a node than it has cores,
they take turns. Three terms, each calibrated by a micro-benchmark (lesson 11 measures them):

  launches   m x (layers of the stage x (1 + 1/3 per recomputed forward) x layer_overhead
             + the embedding and the head's edge_overhead): a layer pass is a forward and a
             backward (3 forwards' worth of launches, Narayanan et al.'s FLOP ratio, so a
             recomputed forward adds 1/3).
             Ring attention computes a layer's attention in CP passes, one per K,V block, forward
             and backward, where one device makes one: (CP - 1) x (forwards + 1) passes more per
             layer and micro-batch, each ring_pass_overhead.
  calls      every collective call or message (``traffic.group_calls``) x call_overhead, on top of
             the alpha of each of its latency steps (Hockney's latency; ``traffic.latency_steps``).
  sharing    with R ranks on a node of C cores (R > C) and waits that give the core away
             (``comm.base.wait_without_spinning``), a step cannot be shorter than the node's busy
             work over its cores: R / C x one rank's busy time (compute and launches). A pipeline's
             bubble then costs nothing: an idle stage's core runs another rank.

On a GPU the launches overlap the kernels of earlier launches and the terms default to 0 (the
Machine's ``layer_overhead_us``, ``edge_overhead_us``, ``call_overhead_us``, ``cores_per_node``).
"""

from .shapes import micro_batches
from .state import edges, stage_layers
from .traffic import group_calls


def layer_passes(model, layout, global_batch, stage):
    """(layer passes, edge passes) one rank of ``stage`` runs per step, in forward-and-backward
    units: a recomputed forward (full recomputation) adds 1/3."""
    m = micro_batches(layout, global_batch)
    again = 1 / 3 if layout.recompute else 0.0
    layers = len(stage_layers(model, layout, stage))
    return m * layers * (1 + again), m * sum(edges(layout, stage))


def ring_passes(model, layout, global_batch, stage):
    """The ring attention passes one rank of ``stage`` makes in a step beyond one per attention
    forward and backward (module docstring); 0 without a CP ring."""
    if not layout.ring_attention:
        return 0
    forwards = 2 if layout.recompute else 1
    layers = len(stage_layers(model, layout, stage))
    return micro_batches(layout, global_batch) * layers * (layout.cp - 1) * (forwards + 1)


def launch_seconds(model, layout, machine, global_batch, stage):
    """One rank's per-launch overhead in a step: layer, edge and ring passes x their calibrated costs."""
    if not (machine.layer_overhead_us or machine.edge_overhead_us or machine.ring_pass_overhead_us):
        return 0.0  # a GPU's launches overlap its kernels: nothing to count
    layers, edges = layer_passes(model, layout, global_batch, stage)
    passes = ring_passes(model, layout, global_batch, stage)
    return (layers * machine.layer_overhead_us + edges * machine.edge_overhead_us
            + passes * machine.ring_pass_overhead_us) * 1e-6


def call_seconds(model, layout, machine, global_batch, stage, dtype="float32"):
    """{group: calls x call_overhead}: the fixed cost of each collective call or message."""
    calls = group_calls(model, layout, global_batch, stage, dtype)
    return {g: n * machine.call_overhead_us * 1e-6 for g, n in calls.items()}


def core_share(layout, machine):
    """Ranks per core on a node: R / C when a node runs more ranks R than it has cores C, else 1."""
    if not machine.cores_per_node:
        return 1.0
    ranks = min(machine.gpus_per_node, layout.world_size)
    return max(1.0, ranks / machine.cores_per_node)
