"""The checks a lesson makes of its flags before any message: the folder its files go to, that
the run fits this machine's memory, counts of at least one. ``lesson`` re-exports them, so a
lesson asks ``lesson.memory_problems``; one line each, as ``minipar.cli`` prints them.
"""

from minipar import backend
from minipar.checkpoint.files import folder_problem
from minipar.parallel.memory import BYTES, gb, total_parameters


def output_problems(flag, given, folder):
    """[the line saying why the files a lesson writes at its end cannot go into ``folder``] (for
    ``flag``'s value ``given``), or []: asked with the flags, not found after the whole run."""
    why = folder_problem(folder)
    return [] if why is None else [f"{flag} {given}: {why}"]


def memory_problems(run, names, steps, reference=True):
    """[a line] if the lesson cannot fit in this machine's memory, else []: asked with the flags
    (sizes far too big once ended in a MemoryError traceback from every rank). ``run`` is the
    lesson's ``validate.RunConfig``, ``names`` its flags by field, ``steps`` how many it trains.
    The count is a floor, so that no run that fits is refused, of what the ranks sharing this
    memory (a host, or a GPU) hold at once: every rank's batches for all the steps (``batches``,
    on the host: on a GPU, they are counted against the host's memory, and one against the GPU's);
    with a ``reference`` run (``reference_run``), its model with gradients and AdamW's two moments
    on the root while it runs, then on every rank its weights, first gradients and logits beside
    the rank's share of the parallel model and its state; without (a lesson that trains every
    rank's model whole at ZeRO stage 0), that model and its state on every rank. Activations are
    not counted."""
    free = backend.free_memory()
    if free is None:
        return []
    total, sharing, what = free
    size, n = BYTES[run.dtype], total_parameters(run)
    tokens = run.global_batch * run.block_size
    ids, batches = steps * 2 * 8 * tokens, "every step's batch"  # x and y, int64, made on the host
    if backend.on_gpu():  # the host holds them all, the GPU one step's
        host = backend.free_memory(host=True)
        found = too_big(host[1] * ids, host, "every rank makes every step's batch first", ["fewer --steps"]) if host else []
        if found:
            return found
        ids, batches = ids // max(steps, 1), "a step's batch"
    logits, state = tokens * (run.vocab_size or 256) * size, 4 * n * size  # state: weights, gradients, moments
    if reference:
        need = max(state + logits, sharing * (2 * n * size + logits + state / run.world_size)) + sharing * ids
        held = (f"the single-device run it checks against holds a model of {n:,} parameters ({run.dtype}) "
                "with its gradients and AdamW's two moments, and every rank keeps that run's weights, first "
                f"gradients and logits beside its share of the parallel model, and {batches}")
    else:
        need = sharing * (state + ids)
        held = (f"every rank holds a model of {n:,} parameters ({run.dtype}) with its gradients and AdamW's two "
                f"moments, and {batches}")
    has = lambda *fields: [names[f] for f in fields if f in names]  # noqa: E731 (the flags this lesson has)
    # the fixes for what takes the most: the batches, one batch's logits, or the model
    batch = sharing * logits * reference
    parts = {"steps": sharing * ids, "batch": batch, "model": need - sharing * ids - batch}
    most = max(parts, key=parts.get)
    if most == "steps":
        fixes = ["fewer --steps"]
    elif most == "batch":
        fixes = [f"a smaller {flag}" for flag in has("global_batch", "block_size")]
    else:  # (the position embedding: block_size x n_embd)
        fixes = [f"fewer {flag}" for flag in has("n_layer")] + [f"a smaller {flag}" for flag in has("n_embd")]
        fixes += [f"a smaller {flag}" for flag in has("block_size") if run.block_size * run.n_embd > n / 2]
    return too_big(need, free, held, fixes)


def too_big(need, free, held, fixes):
    """[the line refusing a lesson that needs ``need`` bytes of the memory ``free`` describes
    (``backend.free_memory()``: bytes, ranks sharing them, what they are), saying what is ``held``
    and the ``fixes``], or [] if it fits."""
    total, sharing, what = free
    if need <= total:
        return []
    fixes = fixes + ["fewer ranks on this machine"] * (sharing > 1)
    return [f"this lesson needs at least {gb(need)} of {what}, which is {gb(total)} here for {sharing} "
            f"rank{'s' * (sharing > 1)}: {held}; fix: {' or '.join(fixes)}"]


def at_least_one(args, *flags):
    """A problem line for each of ``flags`` (as typed, "--bucket-kb") whose value is below 1."""
    return [f"{flag} must be >= 1" for flag in flags if getattr(args, flag[2:].replace("-", "_")) < 1]
