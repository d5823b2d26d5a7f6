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

* every whole gradient backward has finished and whose group is not sent yet: the group being
  sent, what backward has finished of the groups after it in the hooks' order, and the held
  groups' (summed after backward), from the backward that first makes them to the flush;
* the group being sent, copied into a flat buffer, and the 1/N piece that receives the sum;
* the previous send, its buffer and piece, when it has not finished (``IN_FLIGHT`` = 1 pending).

Which gradients are whole at a send depends on the order the hooks fire, which the replay
(``_replay``) follows parameter by parameter: modules from the output back, a module's weight
before its bias (a group cut between them holds the weight's gradient while the bias completes
the group before it), an MoE layer's router before its experts (last to first), the tied
embedding last where one rank holds both its uses and first on a pipeline's last stage (the head's
backward), where ``--defer-embedding-wgrad-compute`` makes it at the flush instead. With the sends
left pending as long as the optimizer allows (the worst case, which runs reach) the replay's most is
the ledger's exactly on a rank of one chunk (tests/mpi/plan_counts.py), whatever m. A rank of
several chunks has groups that span chunks, completed by one chunk's backward of a micro-batch and
another's of the next (and then sent again): it is taken to hold every gradient whole beside two
sends of its largest group, an upper bound. Every parameter is taken to get its gradient in every
backward, as in ``zero3_peak.py``.
"""

from dataclasses import replace
from functools import lru_cache

from . import state
from .shapes import PRECISIONS
from .traffic import BUCKET


def _modules(model, layout, stage):
    """[(module kind, [(values, comm, held)] in the model's order)] on a rank of ``stage``: comm
    "edp" for an expert's weights under expert parallelism ("dp" otherwise), held when the model
    sums the gradient after backward (``protocol.finished_by_model``)."""
    h, t, E = model.hidden_size, layout.tp, model.num_experts
    sp = layout.sequence_parallel and t > 1
    first, last = state.edges(layout, stage)
    expert = "edp" if layout.ep > 1 else "dp"
    norm = ("norm", [(h, "dp", sp)] * 2)
    out = []
    if first or last:  # the tied embedding (a copy on each end, summed over "embedding")
        out.append(("wte", [(state.token_embedding(model, layout), "dp", layout.pp > 1 and not (first and last))]))
    if first:
        out.append(("wpe", [(model.seq_length * h, "dp", sp)]))
    for layer in state.stage_layers(model, layout, stage):  # ln_1, c_attn, c_proj (its bias whole), ln_2
        out += [norm, ("linear", [(3 * h * h // t, "dp", False), (3 * h // t, "dp", False)]),
                ("linear", [(h * h // t, "dp", False), (h, "dp", sp)]), norm]
        if model.is_moe(layer):  # the router, whole on every TP rank; then this rank's whole experts
            out.append(("router", [(E * h, "dp", sp)]))
            out += [("expert", [(4 * h * h, expert, sp), (4 * h, expert, sp), (4 * h * h, expert, sp),
                                (h, expert, sp)])] * (E // layout.ep)  # memory.mlp_parameters(h) each
        else:
            out += [("linear", [(4 * h * h // t, "dp", False), (4 * h // t, "dp", False)]),
                    ("linear", [(4 * h * h // t, "dp", False), (h, "dp", sp)])]
    if last:
        out.append(norm)
    return out


def parameter_list(model, layout, stage):
    """[(values, comm, held)] for each parameter a rank of ``stage`` holds, in the model's order
    (``state.rank_parameters`` counts them)."""
    return [p for _, params in _modules(model, layout, stage) for p in params]


def hook_order(model, layout, stage):
    """The indices of ``parameter_list`` in the order one chunk's backward finishes them (the
    module docstring's order), without the tied embedding's where it is made at the flush."""
    modules, at = [], 0
    for kind, params in _modules(model, layout, stage):
        modules.append((kind, list(range(at, at + len(params)))))
        at += len(params)
    first, last = state.edges(layout, stage)
    order, experts = [], []
    for kind, index in reversed(modules):
        if kind == "expert":  # its c_proj, then its c_fc
            experts += index[2:] + index[:2]
        elif kind == "router":
            order += index + experts
            experts = []
        elif kind != "wte" or first:  # on both ends the lookup's part comes last
            order += index
    if last and not first and not layout.defer_embedding_wgrad:  # the head's backward comes first
        order.insert(0, 0)  # (deferred, its W comes at the flush)
    return order


def rank_groups(model, layout, stage, dtype="float32", members=False):
    """[(values, ranks it is sharded over, held)]: the rank's ZeRO groups in their order (with
    ``members``, each group's indices into ``parameter_list`` appended)."""
    n, z, weight = layout.dp * layout.cp, layout.zero_stage, PRECISIONS[dtype].param
    params = list(enumerate(parameter_list(model, layout, stage)))
    if z != 2:  # only stage 2 holds some back
        params = [(i, (v, comm, False)) for i, (v, comm, _) in params]
    params = [p for p in params if not p[1][2]] + [p for p in params if p[1][2]]
    groups, run, size = [], [], 0
    for i, (values, comm, held) in params:
        if run and (comm != run[0][1][1] or held != run[0][1][2]):  # a group never mixes two of either
            groups.append((size, run))
            run, size = [], 0
        run.append((i, (values, comm, held)))
        size += values
        if size * weight >= BUCKET:  # the parameter that fills the bucket closes it
            groups.append((size, run))
            run, size = [], 0
    if run:
        groups.append((size, run))
    out = []
    for size, run in groups:
        _, (_, comm, held) = run[0]
        out.append((size, n // layout.ep if comm == "edp" else n, held) + ((tuple(i for i, _ in run),) if members else ()))
    return out


def transient_bytes(model, layout, stage, dtype="float32", micro_batches=None):
    """Bytes ZeRO stage 1 or 2 holds at its fullest moment of a step beyond ``state_bytes`` (the
    module docstring's count; 0 for other stages). From the second micro-batch on each repeats
    the last, so m is taken as at most 2, and as 2 when None: the most for any m."""
    if layout.zero_stage not in (1, 2):
        return 0
    # the planner asks for many layouts that differ only in what the groups do not depend on
    same = replace(layout, micro_batch_size=1, recompute=False, selective_recompute=False, cp_comm_type="p2p",
                   schedule="zb-v" if layout.schedule == "zb-v" else "1f1b")
    return _transient(model, same, stage, dtype, 2 if micro_batches is None else min(micro_batches, 2))


@lru_cache(maxsize=4096)
def _transient(model, layout, stage, dtype, m):
    grad = PRECISIONS[dtype].grad
    groups = rank_groups(model, layout, stage, dtype, members=True)
    piece = [-(-values // n) for values, n, _, _ in groups]
    if layout.zero_stage == 1:
        return grad * max(piece)
    sent = [grad * (p * n + p) for p, (_, n, _, _) in zip(piece, groups)]  # the flat buffer and the piece
    if len(state.stage_chunks(layout, stage)) > 1:  # a group may span chunks (and go out twice in a row):
        return grad * sum(values for values, _, _, _ in groups) + 2 * max(sent)  # every gradient whole at once
    return _replay(parameter_list(model, layout, stage), groups, sent, hook_order(model, layout, stage), grad, m)


def _replay(params, groups, sent, order, grad, m):
    """The most a ZeRO-2 rank of one chunk holds beyond its state over ``m`` micro-batches' backwards
    (the second repeats every later one) and the flush, every send pending until the next one."""
    group_of = {i: k for k, (_, _, _, members) in enumerate(groups) for i in members}
    whole, ready, pending, most = set(), [0] * len(groups), 0, 0

    def send(k):
        nonlocal pending, most
        most = max(most, grad * sum(params[i][0] for i in whole) + sent[k] + pending)
        pending = sent[k]
        whole.difference_update(groups[k][3])

    for _ in range(m):
        for i in order:
            whole.add(i)
            k = group_of[i]
            if not groups[k][2]:  # held: sent at the flush
                ready[k] += 1
                if ready[k] == len(groups[k][3]):
                    ready[k] = 0
                    send(k)
    whole.update(i for i in group_of if params[i][2])  # the flush: the head's deferred W made, if any
    for k, (_, _, held, _) in enumerate(groups):
        if held:
            send(k)
    return most
