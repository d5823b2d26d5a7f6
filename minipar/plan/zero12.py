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
(``_replay``) follows parameter by parameter over the rank's schedule (``zero3_peak.rank_passes``:
each chunk's backward, or a split one's W, in turn): within a chunk, modules from the output back,
a module's weight before its bias (a group cut between them holds the weight's gradient while
the bias completes the group before it), an MoE layer's router before its experts (last to
first); the tied embedding's part last in the embeddings' chunk and first in the head's, where
``--defer-embedding-wgrad-compute`` makes it at the flush instead. A group that spans two chunks
is complete once every parameter's hook has fired since its last send. With the sends left pending
as long as the optimizer allows (the worst case, which runs reach) the replay's most is the
ledger's exactly (tests/mpi/plan_counts.py). One chunk repeats from its second micro-batch on, so
m is walked up to 2; several chunks up to 3p, as ZeRO-3's. Every parameter is taken to get its
gradient in every backward, as in ``zero3_peak.py``.
"""

from array import array
from functools import lru_cache
from itertools import accumulate

from minipar.parallel.pipeline.instructions import BACKWARD, BACKWARD_WEIGHT, HEAD_WEIGHT, STEP

from . import state
from .shapes import BUCKET, PRECISIONS
from .zero3_peak import rank_passes


@lru_cache(maxsize=64)  # the groups, the parameters and the hooks' order all read it: made once
def _modules(model, layout, stage):
    """((module kind, local chunk, ((values, comm, held), ...)), ...) on a rank of ``stage``, in the
    model's order: comm "edp" for an expert's weights under expert parallelism ("dp" otherwise), held
    when the model sums the gradient after backward (``protocol.finished_by_model``)."""
    h, sp = model.hidden_size, layout.sequence_parallel and layout.tp > 1
    chunks, end = state.stage_chunks(layout, stage), layout.pp * layout.vpp - 1
    first, last = 0 in chunks, end in chunks
    norm = ((h, "dp", sp),) * 2
    out = []
    if first or last:  # the tied embedding (a copy on each end, summed over "embedding")
        tied = layout.pp > 1 and not (first and last)
        out.append(("wte", chunks.index(0 if first else end), ((state.token_embedding(model, layout), "dp", tied),)))
    if first:
        out.append(("wpe", chunks.index(0), ((model.seq_length * h, "dp", sp),)))
    for c, chunk in enumerate(chunks):
        for layer in state.chunk_layers(model, layout, chunk):  # an expert's gradient, too, is summed over TP
            out += [(kind, c, tuple((v, "edp" if expert and layout.ep > 1 else "dp", sp and (partial or expert))
                                    for v, expert, partial in params))
                    for kind, params in state.block_modules(model, layout, layer)]
    if last:
        out.append(("norm", chunks.index(end), norm))
    return tuple(out)


def parameter_list(model, layout, stage):
    """[(values, comm, held)] for each parameter a rank of ``stage`` holds, in the model's order
    (``state.rank_parameters`` counts them)."""
    return [p for _, _, params in _modules(model, layout, stage) for p in params]


def hook_order(model, layout, stage):
    """{local chunk: the indices of ``parameter_list`` in the order that chunk's backward (or W)
    finishes them} (the module docstring's order), without the head's tied embedding where its
    W comes at the flush, nor the weights of the last ``defer_wgrad_linears`` linear layers; and
    {HEAD_WEIGHT: the indices each deferred W at the flush finishes, the head's first}."""
    modules, at = [], 0
    for kind, c, params in _modules(model, layout, stage):
        modules.append((kind, c, list(range(at, at + len(params)))))
        at += len(params)
    chunks, end = state.stage_chunks(layout, stage), layout.pp * layout.vpp - 1
    embed = chunks.index(0) if 0 in chunks else None
    head = chunks.index(end) if end in chunks else None
    order, experts = {c: [] for c in range(len(chunks))}, []
    for kind, c, index in reversed(modules):
        if kind == "expert":  # its c_proj, then its c_fc
            experts += index[2:] + index[:2]
        elif kind == "router":
            order[c] += index + experts
            experts = []
        elif kind != "wte" or embed is not None:  # the lookup's part: last in the embeddings' chunk
            order[c] += index
    if head not in (None, embed) and not layout.defer_embedding_wgrad:  # the head's part: first in its chunk
        order[head].insert(0, 0)  # (deferred, its W comes at the flush)
    elif head is not None and layout.defer_embedding_wgrad:  # at the flush: the head's part, then the
        # weights of the linear layers nearest it (the MLP's output projection first)
        linears = [index[0] for kind, c, index in reversed(modules) if kind == "linear" and c == head]
        order[HEAD_WEIGHT] = [0] + linears[:layout.defer_wgrad_linears]
        order[head] = [i for i in order[head] if i not in order[HEAD_WEIGHT]]
    return order


def rank_groups(model, layout, stage, dtype="float32", members=False):
    """[(values, ranks it is sharded over, held)]: the rank's ZeRO groups in their order (with
    ``members``, each group's indices into ``parameter_list`` appended)."""
    return list(_rank_groups(model, layout, stage, dtype, members))


@lru_cache(maxsize=256)  # asked again by each replay of the rank (one for each m)
def _rank_groups(model, layout, stage, dtype, members):
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
    return tuple(out)


def transient_bytes(model, layout, stage, dtype="float32", micro_batches=None):
    """Bytes ZeRO stage 1 or 2 holds at its fullest moment of a step beyond ``state_bytes`` (the
    module docstring's count; 0 for other stages). m is walked up to 2 micro-batches on a rank of
    one chunk (each repeats the second), 3p on one of several, and that far when None: the most
    for any m."""
    if layout.zero_stage not in (1, 2):
        return 0
    most = 2 if len(state.stage_chunks(layout, stage)) == 1 else 3 * layout.pp
    m = most if micro_batches is None else min(micro_batches, most)
    return _transient(model, state.sharded(layout), stage, dtype, m)  # (what the groups and the replay read)


@lru_cache(maxsize=4096)
def _transient(model, layout, stage, dtype, m):
    grad = PRECISIONS[dtype].grad
    groups = rank_groups(model, layout, stage, dtype, members=True)
    piece = [-(-values // n) for values, n, _, _ in groups]
    if layout.zero_stage == 1:
        return grad * max(piece)
    sent = [grad * (p * n + p) for p, (_, n, _, _) in zip(piece, groups)]  # the flat buffer and the piece
    passes = rank_passes(layout.schedule, layout.pp, m, layout.vpp, layout.defer_embedding_wgrad, stage)
    return _replay(parameter_list(model, layout, stage), groups, sent, hook_order(model, layout, stage), passes, grad)


def group_sends(model, layout, stage, m, dtype="float32"):
    """[(values, ranks, reduce-scatters)] of each ZeRO-2 group in a step of m micro-batches, by the
    replay: one a micro-batch, a held group's one at the step; a group whose last hook a deferred
    W at the flush fires (``defer_wgrad_linears``), there, and once more at the step if m > 1 (the
    later W's add to one weight of it, after its send)."""
    groups = rank_groups(model, layout, stage, dtype, members=True)
    passes = rank_passes(layout.schedule, layout.pp, m, layout.vpp, layout.defer_embedding_wgrad, stage)
    count = [0] * len(groups)
    _replay(parameter_list(model, layout, stage), groups, [0] * len(groups), hook_order(model, layout, stage),
            passes, 0, count)
    return [(values, n, sends) for (values, n, _, _), sends in zip(groups, count)]


def _replay(params, groups, sent, order, passes, grad, count=None):
    """The most a ZeRO-2 rank holds beyond its state over ``passes`` (its schedule's, then the
    step), every send pending until the next one: ``ZeRO2``'s hooks and ledger, replayed
    (``count``: each group's sends added to it). The walk (``_moves``) reads which parameters
    each group holds and when their hooks fire, not their sizes: the layouts that share those
    share it (the 1T model's 1,860 replays take 531 walks); the sizes weigh its moves here."""
    changes, sent_groups, sent_at = _moves(tuple((held, members) for _, _, held, members in groups),
                                           tuple((c, tuple(hooks)) for c, hooks in order.items()), passes)
    signed = [x for values, _, _ in params for x in (values, -values)]  # a gradient made whole, and sent
    whole = list(accumulate(map(signed.__getitem__, changes), initial=0))  # the whole ones' values, after each change
    most = pending = 0
    # at each send (ZeRO2.reduce_scatter_group): the whole gradients, its buffer and piece, the one pending
    for k, at in zip(sent_groups, sent_at):
        most = max(most, grad * whole[at] + sent[k] + pending)
        pending = sent[k]
        if count is not None:
            count[k] += 1
    return most


@lru_cache(maxsize=1024)
def _moves(groups, order, passes):
    """(changes, sent groups, sent at) of the replay: each parameter's gradient made whole (2 i) or
    sent (2 i + 1), in order, and each send's group and the changes before it (compact arrays: the
    planner keeps hundreds)."""
    group_of = {i: k for k, (_, members) in enumerate(groups) for i in members}
    whole, ready, done, changes, sends = set(), [set() for _ in groups], set(), [], []
    order = dict(order)

    def send(k):  # ZeRO2.reduce_scatter_group
        sends.append((k, len(changes)))
        for i in groups[k][1]:
            if i in whole:
                whole.remove(i)
                changes.append(2 * i + 1)
        ready[k] = set()
        done.add(k)

    def hook(i):  # ZeRO2._gradient_ready: a held group waits for the flush
        if i not in whole:
            whole.add(i)
            changes.append(2 * i)
        k = group_of[i]
        if not groups[k][0]:
            ready[k].add(i)
            if len(ready[k]) == len(groups[k][1]):
                send(k)

    for op, c in passes:
        if op in (BACKWARD, BACKWARD_WEIGHT):  # a whole backward's hooks, or a split one's W's
            for i in order[c]:
                hook(i)
        elif op == HEAD_WEIGHT:  # the head's W deferred to the flush: the tied embedding's part (and
            for i in order[HEAD_WEIGHT]:  # the last linear layers' weights)
                hook(i)
        elif op == STEP:  # finish_gradients: what is not sent, or came after its send, in order
            for k in range(len(groups)):
                if k not in done or ready[k]:
                    send(k)
    return array("I", changes), array("I", (k for k, _ in sends)), array("I", (at for _, at in sends))
