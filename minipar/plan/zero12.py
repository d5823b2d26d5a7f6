"""ZeRO stages 1 and 2 during a step: the groups they cut the rank's parameters into, and the most
their ledger holds beyond what a step leaves (``state.state_bytes``).

The groups (``shards.group_parameters``): the rank's parameters in ``GPT.parameters()`` order,
consecutive ones in a group until it holds ``BUCKET`` bytes of weights, a group never mixing
two communicators (an expert's weights go over "edp" with expert parallelism) nor, in stage 2, a
gradient the model finishes after backward with one it does not (SP's partial sums, the tied
embedding on a pipeline's end: held, laid out last). Each is padded to N equal pieces.

Stage 1 accumulates whole gradients (counted in its state) and, after backward, reduce-scatters
them group by group into a fresh piece: the most it holds is its state plus the largest piece.

Stage 2 keeps only its shard of the gradients. During a step it also holds, in gradient bytes:

* the held groups' whole gradients, from the backward that first makes them to their send at
  ``finish_gradients``;
* the group being sent: its whole gradients (backward's, ``_alive``), the flat buffer they are
  copied into and the 1/N piece that receives the sum;
* the previous send, its buffer and piece, when it has not finished (``IN_FLIGHT`` = 1 pending).

A backward completes a single chunk's groups last to first (its gradient hooks fire module by
module from the output back), so each send's predecessor is the group after it, or the previous
micro-batch's first group; at the flush the held groups go out in order. With the sends left
pending as long as the optimizer allows (the worst case, which runs reach), the most is

    state + held + max over sends s of (whole_s + flat_s + piece_s + flat_prev + piece_prev)

exact against the ledger when a stage holds one chunk and m > 1 (tests/mpi/plan_counts.py). Two
upper bounds: with m = 1 a held gradient is counted before the backward that makes it; a stage of
several chunks has groups that span chunks, completed by one chunk's backward of a micro-batch and
another's of the next (and then sent again), so it is taken to hold every gradient whole beside
two sends of its largest group.
Every parameter is taken to get its gradient in every backward, as in ``zero3.py``.
"""

from dataclasses import replace
from functools import lru_cache

from . import state
from .shapes import PRECISIONS
from .traffic import BUCKET


def rank_parameters(model, layout, stage):
    """[(values, comm, held)] for each parameter a rank of ``stage`` holds, in the model's order:
    comm "edp" for an expert's weights under expert parallelism ("dp" otherwise), held when the
    model sums its gradient after backward (``protocol.finished_by_model``)."""
    h, t, E = model.hidden_size, layout.tp, model.num_experts
    sp = layout.sequence_parallel and t > 1
    first, last = state.edges(layout, stage)
    expert = "edp" if layout.ep > 1 else "dp"
    out = []
    if first or last:  # the tied embedding (a copy on each end, summed over "embedding")
        out.append((state.token_embedding(model, layout), "dp", layout.pp > 1 and not (first and last)))
    if first:
        out.append((model.seq_length * h, "dp", sp))
    for layer in state.stage_layers(model, layout, stage):
        norm = [(h, "dp", sp)] * 2
        out += norm + [(3 * h * h // t, "dp", False), (3 * h // t, "dp", False),  # ln_1, c_attn
                       (h * h // t, "dp", False), (h, "dp", sp)] + norm  # c_proj (its bias whole), ln_2
        if model.is_moe(layer):  # the router, whole on every TP rank; then this rank's whole experts
            out.append((E * h, "dp", sp))
            mlp = [(4 * h * h, expert, sp), (4 * h, expert, sp), (4 * h * h, expert, sp), (h, expert, sp)]
            out += mlp * (E // layout.ep)  # memory.mlp_parameters(h) each
        else:
            out += [(4 * h * h // t, "dp", False), (4 * h // t, "dp", False), (4 * h * h // t, "dp", False),
                    (h, "dp", sp)]
    if last:
        out += [(h, "dp", sp)] * 2
    return out


def rank_groups(model, layout, stage, dtype="float32"):
    """[(values, ranks it is sharded over, held)]: the rank's ZeRO groups in their order."""
    n, z, weight = layout.dp * layout.cp, layout.zero_stage, PRECISIONS[dtype].param
    params = rank_parameters(model, layout, stage)
    if z != 2:  # only stage 2 holds some back
        params = [(v, comm, False) for v, comm, _ in params]
    params = [p for p in params if not p[2]] + [p for p in params if p[2]]
    groups, run, size = [], [], 0
    for values, comm, held in params + [(0, None, None)]:  # (the sentinel closes the last group)
        if run and (comm != run[0][1] or held != run[0][2]):
            groups.append((size, run[0][1], run[0][2]))
            run, size = [], 0
        if comm is None:
            break
        run.append((values, comm, held))
        size += values
        if size * weight >= BUCKET:
            groups.append((size, comm, held))
            run, size = [], 0
    return [(values, n // layout.ep if comm == "edp" else n, held) for values, comm, held in groups]


def transient_bytes(model, layout, stage, dtype="float32", micro_batches=2):
    """Bytes ZeRO stage 1 or 2 holds at its fullest moment of a step beyond ``state_bytes`` (the
    module docstring's count; 0 for other stages)."""
    if layout.zero_stage not in (1, 2):
        return 0
    # the planner asks for many layouts that differ only in what the groups do not depend on
    same = replace(layout, micro_batch_size=1, recompute=False, selective_recompute=False, cp_comm_type="p2p",
                   schedule="zb-v" if layout.schedule == "zb-v" else "1f1b", defer_embedding_wgrad=False)
    return _transient(model, same, stage, dtype, micro_batches > 1)


@lru_cache(maxsize=4096)
def _transient(model, layout, stage, dtype, several):
    z, grad = layout.zero_stage, PRECISIONS[dtype].grad
    groups = rank_groups(model, layout, stage, dtype)
    piece = [-(-values // n) for values, n, _ in groups]
    if z == 1:
        return grad * max(piece)
    sent = [grad * (p * n + p) for p, (_, n, _) in zip(piece, groups)]  # the flat buffer and the piece
    whole = [grad * values for values, _, _ in groups]
    now = [i for i, (_, _, held) in enumerate(groups) if not held][::-1]  # backward: last group first
    later = [i for i, (_, _, held) in enumerate(groups) if held]
    held = sum(whole[i] for i in later)
    if len(state.stage_chunks(layout, stage)) > 1:  # a group may span chunks (and go out twice in a row):
        return held + sum(whole[i] for i in now) + 2 * max(sent)  # every gradient whole at once
    most = 0
    for k, s in enumerate(now):
        prev = sent[now[k - 1]] if k > 0 or several else 0
        most = max(most, held + whole[s] + sent[s] + prev)
    for k, s in enumerate(later):  # at the flush, in order, after backward's last send
        prev = sent[later[k - 1]] if k > 0 else (sent[now[-1]] if now else 0)
        most = max(most, sum(whole[i] for i in later[k:]) + sent[s] + prev)
    return most
