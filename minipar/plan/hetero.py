"""Pipeline stages on GPUs of unequal speed (HeteroG's idea, Yi et al. 2020, simply): give each
stage a number of layers in proportion to its speed, so that the stages take equal time.

A pipeline runs at the pace of its slowest stage: with layers split evenly, a stage half as fast
takes twice as long per micro-batch and every other stage waits for it, so its slowness shows up
as bubble on all the others. ``balance`` picks layers per stage to minimise the slowest stage's
time, layers_i / speed_i (adding layers one at a time to the stage that would finish soonest with
one more is optimal for this min-max: the classic greedy for identical jobs on related machines).
``compare`` runs both splits through the schedule simulator with each stage's forward costing
layers_i / speed_i (backward twice that) and returns the step times and bubbles: what the
balancing saves. The plan runs: ``--pipeline-layers`` (GPT's ``layers_per_stage``) takes the
balanced split, and bench/hetero_pipeline.py measures it against the even one on a slowed stage.
"""

from fractions import Fraction

from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.simulate import simulate
from minipar.parallel.run_config import SPLIT_BACKWARD


def balance(num_layers, speeds):
    """Layers per stage (each at least one) minimising max(layers_i / speed_i)."""
    if len(speeds) > num_layers or any(s <= 0 for s in speeds):
        raise ValueError(f"{len(speeds)} stages of speeds {speeds} cannot share {num_layers} layers: "
                         "each stage needs a layer and a positive speed")
    speeds = [Fraction(s) for s in speeds]
    layers = [1] * len(speeds)
    for _ in range(num_layers - len(speeds)):
        i = min(range(len(speeds)), key=lambda k: ((layers[k] + 1) / speeds[k], k))
        layers[i] += 1
    return layers


def step(layers, speeds, micro_batches, schedule="1f1b"):
    """(makespan, mean bubble) of a one-chunk schedule (1F1B, GPipe, ZB-H1, ...) with stage i's
    forward layers_i / speed_i, backward 2x (split: B and W 1x each, as the planner takes them)."""
    p = len(layers)
    forward = {(r, 0): Fraction(layers[r]) / Fraction(speeds[r]) for r in range(p)}
    split = schedule in SPLIT_BACKWARD
    sim = simulate(schedules.build(schedule, p, micro_batches), micro_batches, forward=forward,
                   backward={k: (1 if split else 2) * v for k, v in forward.items()}, weight=forward if split else None)
    return sim.makespan, sum(sim.bubble.values()) / p


def compare(num_layers, speeds, micro_batches, schedule="1f1b"):
    """{"even": (layers, makespan, bubble), "balanced": (...)}: the even split against ``balance``."""
    p = len(speeds)
    if num_layers % p:
        raise ValueError(f"{num_layers} layers do not split evenly over {p} stages")
    out = {}
    for name, layers in (("even", [num_layers // p] * p), ("balanced", balance(num_layers, speeds))):
        out[name] = (layers, *step(layers, speeds, micro_batches, schedule))
    return out


def stage_speeds(layout, gpus_per_node, node_speeds):
    """Each pipeline stage's speed: the slowest node among its ranks' (Megatron's order puts stage
    r on ranks r TCD .. (r+1) TCD - 1)."""
    per_stage = layout.tp * layout.cp * layout.dp
    if len(node_speeds) * gpus_per_node < layout.world_size:
        raise ValueError(f"{len(node_speeds)} node speeds for {layout.world_size} GPUs of {gpus_per_node} per node")
    return [min(node_speeds[rank // gpus_per_node] for rank in range(r * per_stage, (r + 1) * per_stage))
            for r in range(layout.pp)]
