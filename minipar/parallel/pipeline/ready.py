"""When a chunk's gradients are complete for the step: the instruction after which the executor
lets data parallelism's hooks send them (every earlier one runs under ``optimizer.no_sync()``).

A chunk's gradients are complete after its last backward, or, with the backward split, after its
last W (``weight_grad``); the tied head's weight, whose gradients a deferred schedule leaves for the
flush (``schedules.defer_head_weight``), after the last ``head_weight`` instruction.
"""

from minipar.parallel.pipeline.instructions import BACKWARD, BACKWARD_WEIGHT, HEAD_WEIGHT


def last_backwards(instructions, chunks, n_chunks):
    """{local chunk: the micro-batch of its last backward (or W)} in this rank's ``instructions``;
    ``chunks``: the rank's global chunks. The tied embedding is used by the first global chunk and
    by the last: where one rank holds both (rank 0 of a V), its gradient is complete only after the
    later of their last backwards, so the earlier chunk maps to None and stays quiet throughout
    (``finish_gradients`` sends its part)."""
    last = {ins.chunk: (k, ins.mb) for k, ins in enumerate(instructions) if ins.op in (BACKWARD, BACKWARD_WEIGHT)}
    ends = [c for c, g in enumerate(chunks) if g in (0, n_chunks - 1)]
    if len(ends) == 2:
        last[min(ends, key=lambda c: last[c][0])] = (None, None)
    return {c: mb for c, (_, mb) in last.items()}


def last_heads(instructions):
    """{local chunk: the micro-batch of its last deferred head W}: the chunk whose backwards leave
    the head's weight gradient for the flush (none without ``defer_embedding_wgrad``)."""
    return {ins.chunk: ins.mb for ins in instructions if ins.op == HEAD_WEIGHT}
