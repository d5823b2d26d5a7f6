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

Stages of equal speed are unequal too when the model's ends are: the last stage also runs the
output head, 6 V h training FLOPs a token against a block's 72 h^2 + 12 T h (``minipar.mfu``), and
for GPT-2 (V = 50257, h = 768, T = 1024) that is 4.5 blocks. ``balance``'s ``last`` is that extra
work, in blocks; ``head_in_blocks`` counts it, and ``--pipeline-layers balanced`` runs the split it
gives (Megatron-LM's ``--account-for-loss-in-pipeline-split`` counts the loss as one whole layer
instead). The embedding's lookup is no FLOPs, so the first stage carries nothing extra.
"""

from fractions import Fraction

from minipar.mfu import flops_per_token
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.instructions import Pipeline
from minipar.parallel.pipeline.simulate import simulate
from minipar.parallel.run_config import SPLIT_BACKWARD
from minipar.parallel.validate import dense_tail

from . import deferred


def balance(num_layers, speeds, last=0, least=1):
    """Layers per stage (each at least ``least``) minimising max((layers_i + extra_i) / speed_i),
    where the last stage's extra is ``last`` layers' worth of work (the head) and the others' none.
    The greedy stays optimal with the extra: stage i's k-th layer would end at (k + extra_i) /
    speed_i, and it takes the num_layers soonest of those ends, all stages' first ``least`` among them."""
    if least * len(speeds) > num_layers or any(s <= 0 for s in speeds):
        raise ValueError(f"{len(speeds)} stages of speeds {speeds} cannot share {num_layers} layers: "
                         f"each stage needs {'a layer' if least == 1 else f'{least} layers'} and a positive speed")
    speeds = [Fraction(s) for s in speeds]
    extra = [Fraction(0)] * (len(speeds) - 1) + [Fraction(last)]
    layers = [least] * len(speeds)
    for _ in range(num_layers - least * len(speeds)):
        i = min(range(len(speeds)), key=lambda k: ((layers[k] + 1 + extra[k]) / speeds[k], k))
        layers[i] += 1
    return layers


def chunk_layers(num_layers, pp, vpp=1, last=0, shape="round-robin"):
    """Layers of each global pipeline chunk, ``pp`` ranks of ``vpp`` chunks placed ``shape``
    (``Pipeline``), the last chunk carrying ``last`` layers' worth of work more (the head): first
    each rank's share, balanced over the ranks (a rank runs all its chunks in turn, so its total is
    its pace), then each rank's share over its own chunks, the head's chunk taking fewer. On one
    chunk per rank that is ``balance``'s split; interleaved over 2 ranks, GPT-2's 12 layers and head
    go 4, 3, 4, 1 (ranks 8 and 4 + 4.5) where balancing the chunks alone gives 4, 4, 3, 1 (7 and 9.5)."""
    pipe = Pipeline(pp, 1, vpp, shape)
    head_rank = next((r for r in range(pp) if pipe.global_chunk(r, vpp - 1) == pp * vpp - 1), None)
    if head_rank is None:  # a V of other than two chunks a rank puts the head in no rank's last chunk
        raise ValueError(f"{pp} ranks of {vpp} chunks in a {shape!r} shape: no rank's last chunk is the head's")
    order = list(range(pp)) if head_rank == pp - 1 else list(range(pp))[::-1]  # the head's rank last
    share = dict(zip(order, balance(num_layers, [1] * pp, last, least=vpp)))
    counts = [0] * (pp * vpp)
    for r in range(pp):  # a rank's chunks in global order: the head's, if it has it, is its last
        for c, n in enumerate(balance(share[r], [1] * vpp, last if r == head_rank else 0)):
            counts[pipe.global_chunk(r, c)] = n
    return counts


def head_in_blocks(model, recompute=False):
    """The output head's training FLOPs per token in units of one of ``model``'s blocks (a
    ``plan.shapes.Model``; ``minipar.mfu``'s count, a mixture of experts' blocks at their mean), as
    a Fraction; full recomputation runs each block's forward again (a third more) and not the head's."""
    h, T, L = model.hidden_size, model.seq_length, model.num_layers
    moe = sum(model.is_moe(i) for i in range(L))
    blocks = Fraction(flops_per_token(L, h, T, 0, moe, model.moe_router_topk, model.num_experts), L)
    return flops_per_token(0, h, T, model.vocab_size) / (blocks * (Fraction(4, 3) if recompute else 1))


def step(layers, speeds, micro_batches, schedule="1f1b", last=0):
    """(makespan, mean bubble) of a one-chunk schedule (1F1B, GPipe, ZB-H1, ...) with stage i's
    forward (layers_i + extra_i) / speed_i, the last stage's extra ``last`` (``balance``), backward
    2x (split: B and W 1x each, as the planner takes them)."""
    p = len(layers)
    forward = {(r, 0): (layers[r] + Fraction(last) * (r == p - 1)) / Fraction(speeds[r]) for r in range(p)}
    split = schedule in SPLIT_BACKWARD
    sim = simulate(schedules.build(schedule, p, micro_batches), micro_batches, forward=forward,
                   backward={k: (1 if split else 2) * v for k, v in forward.items()}, weight=forward if split else None)
    return sim.makespan, sum(sim.bubble.values()) / p


def compare(num_layers, speeds, micro_batches, schedule="1f1b", last=0):
    """{"even": (layers, makespan, bubble), "balanced": (...)}: the even split against ``balance``,
    the last stage carrying ``last`` layers' worth of work more in both."""
    p = len(speeds)
    if num_layers % p:
        raise ValueError(f"{num_layers} layers do not split evenly over {p} stages")
    out = {}
    for name, layers in (("even", [num_layers // p] * p), ("balanced", balance(num_layers, speeds, last))):
        out[name] = (layers, *step(layers, speeds, micro_batches, schedule, last))
    return out


def stage_speeds(layout, gpus_per_node, node_speeds):
    """Each pipeline stage's speed: the slowest node among its ranks' (Megatron's order puts stage
    r on ranks r TCD .. (r+1) TCD - 1)."""
    per_stage = layout.tp * layout.cp * layout.dp
    if len(node_speeds) * gpus_per_node < layout.world_size:
        raise ValueError(f"{len(node_speeds)} node speeds for {layout.world_size} GPUs of {gpus_per_node} per node")
    return [min(node_speeds[rank // gpus_per_node] for rank in range(r * per_stage, (r + 1) * per_stage))
            for r in range(layout.pp)]


def balanced_linears(model, pp, m, schedule="1f1b", vpp=1, layers=None, recompute=False):
    """``--defer-wgrad-linears balanced``: the number K of the last chunk's linear layers whose
    weight gradients, run at the flush beside the head's (``GPT.last_linear_weights``), leave the
    least bubble when the schedule is replayed with each chunk costing its training FLOPs a token
    (forward a third, backward two thirds, a recomputed block's forward once more; the head's W
    a third of its 6 V h, a linear layer's W 2 x its weights): the smallest such K on a tie. Too
    few and the last stage still sets the pace of the steady state; too many and it idles while
    its drain grows. ``layers``: each global chunk's (an even split when None). K stays within the
    dense blocks that end the last chunk (a block with experts has no MLP products of its own)."""
    n = pp * vpp
    counts = list(layers) if layers else [model.num_layers // n] * n
    dense = dense_tail(model.num_layers, counts[-1], model.num_experts, model.moe_layer_freq)
    layers = tuple(layers) if layers else None

    def bubble(k):
        return deferred.bubble(model, pp, m, schedule, vpp, layers, recompute, k)

    return min(range(4 * dense + 1), key=lambda k: (bubble(k), k))
