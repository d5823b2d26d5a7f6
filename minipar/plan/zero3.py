"""ZeRO-3's gathers and reduce-scatters on one pipeline rank, counted per parameter group as
``parallel/zero3.py`` makes and sends them, over the rank's schedule.

The groups (``zero3.unit_groups``): each block one (its experts another, over "edp", with expert
parallelism; without it the experts' gradients go over DP x CP, in the block's group), and under
sequence parallelism its partial sums (LayerNorms, row-parallel biases, the router) a group of
their own, held for the model's sums over TP and sent once after ``finalize_grads``. The edges: on
a stage with both ends the tied embedding is its own group (two units use it), the positions and
ln_f each one (held under SP); on a pipeline's end alone the tied embedding, summed over
"embedding" after backward, is held, with the positions (first) or ln_f (last) in its group under
SP, each a group apart otherwise (the latter sent as the blocks are).

A group is gathered before a unit's forward and its backward unless it is whole already, and
released after the forward; a whole backward sends it as it ends (held: releases it), a split one
(B, then W: zero-bubble schedules) leaves it whole after B, and W sends and releases it. So with a
whole backward a group goes out 2m times a step and is sent m times; with a split one a forward or
B that follows a B of its chunk gathers nothing (ZB-H1 and ZB-H2: rank r's first r or 2r B's, whose
W's it holds back, in closed form; ZB-V walked); the head's weight gradient at the flush
(``--defer-embedding-wgrad-compute``) keeps the tied embedding's group whole from a backward to the
next forward, m + 1 gathers in all. One stage with both ends gathers the tied embedding for each
of its two units' forwards (3m).
"""

from dataclasses import dataclass
from functools import lru_cache

from minipar.parallel.pipeline.instructions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from minipar.parallel.run_config import SPLIT_BACKWARD

from . import state
from .bubble import ZERO_BUBBLE_ORDERS
HELD_BACK_W = {"zb-h1": 1, "zb-h2": 2}  # rank r holds back r or 2r W's (``zero_bubble.held_back``'s kept_w)


@dataclass
class Groups:
    """Parameter groups gathered and sent alike: over ``comm`` ("dp": DP x CP, or "edp"), used by
    the rank's local ``chunks``; how many, how many held (sent once), their parameters and the held
    ones'; ``deferred``: the tied embedding's, whose gradient waits for the flush."""

    comm: str
    chunks: tuple
    deferred: bool = False
    groups: int = 0
    held: int = 0
    params: int = 0
    held_params: int = 0

    def add(self, params, held):
        self.groups, self.params = self.groups + 1, self.params + params
        self.held, self.held_params = self.held + held, self.held_params + params * held


def groups(model, layout, stage):
    """The rank's parameter groups, gathered into kinds that are gathered and sent alike."""
    h, sp = model.hidden_size, layout.sequence_parallel and layout.tp > 1
    chunks, last = state.stage_chunks(layout, stage), layout.pp * layout.vpp - 1
    wte = state.token_embedding(model, layout)
    both = 0 in chunks and last in chunks
    out = [Groups("dp", (chunks.index(0), chunks.index(last)))] if both else []
    if both:
        out[0].add(wte, False)
    for local, c in enumerate(chunks):
        dense, experts = Groups("dp", (local,)), Groups("edp", (local,))
        for layer in state.chunk_layers(model, layout, c):
            params, expert = state.block_parameters(model, layout, layer)
            partial = state.partial_sums(model, layer) if sp else 0
            if layout.ep == 1:  # no expert parallelism: the experts' gradients go over DP x CP too,
                params, partial = params + expert, partial + expert * sp  # in the block's runs
            dense.add(params - partial, False)
            if partial:
                dense.add(partial, True)
            if expert and layout.ep > 1:
                experts.add(expert, sp)  # SP: each TP rank routed its own tokens, summed over TP first
        tied = Groups("dp", (local,), deferred=layout.defer_embedding_wgrad and c == last)
        for end, params in ((c == 0, model.seq_length * h), (c == last, 2 * h)):  # positions; ln_f
            if end and both:
                dense.add(params, sp)
            elif end and sp:  # with the tied embedding: one group
                tied.add(params + wte, True)
            elif end:
                dense.add(params, False)
                tied.add(wte, True)
        out += [kind for kind in (dense, experts, tied) if kind.groups]
    return out


def uses(layout, m, stage, kind):
    """(gathers, sends): how often each group of ``kind`` is all-gathered and reduce-scattered in a
    step (a held group's sends are the one after finalize_grads, whatever this says)."""
    if layout.schedule in HELD_BACK_W:  # B's not followed by a W: the first W's held back, or all of them
        return 2 * m - min(HELD_BACK_W[layout.schedule] * stage, m - 1), m
    if layout.schedule in SPLIT_BACKWARD:
        return _walk(layout.schedule, layout.pp, m, stage)[kind.chunks]
    if kind.deferred:
        return m + 1, m
    # the tied embedding of a stage with both ends (in one chunk: no pipeline) is gathered for both units' forwards
    return (3 * m if len(kind.chunks) > 1 else 2 * m), m


@lru_cache(maxsize=256)
def _walk(schedule, p, m, rank):
    """{chunks: (gathers, sends)} of a group that the rank's local ``chunks`` use (one, or in a V
    both), over its split-backward order: F and B gather it unless a B left it whole; F and W
    release it; W sends it."""
    sets = [(0,), (1,), (0, 1)] if schedule == "zb-v" else [(0,)]
    whole, gathers, sends = dict.fromkeys(sets, False), dict.fromkeys(sets, 0), dict.fromkeys(sets, 0)
    for op, _, chunk in ZERO_BUBBLE_ORDERS[schedule](p, m, rank):
        for chunks in sets:
            if chunk not in chunks:
                continue
            if op in (FORWARD, BACKWARD_INPUT):
                gathers[chunks] += not whole[chunks]
                whole[chunks] = op == BACKWARD_INPUT
            elif op == BACKWARD_WEIGHT:
                sends[chunks], whole[chunks] = sends[chunks] + 1, False
    return {chunks: (gathers[chunks], sends[chunks]) for chunks in sets}
