"""What the trainer asks the planner (``minipar.plan``) before a run: whether the run fits this
machine's memory, counted as the planner counts a layout, and the layers per pipeline chunk of
``--pipeline-layers balanced`` and the count of ``--defer-wgrad-linears balanced``."""

from minipar.train_checks import FLAGS


BALANCED_UP_TO = 1 << 20
PLANNED_UP_TO = 1 << 16  # layers x experts the memory check counts one by one


def memory_problem(args, run):
    """A line if the run would not fit in this machine's memory (``parallel.memory.problem``): the
    fullest stage's state at its most and the activations its fullest rank keeps, as the planner
    counts them; past PLANNED_UP_TO layers x experts, which it lists one by one, a floor by
    arithmetic alone (the average stage's state and the batch) refuses what is far too large first."""
    from minipar import backend
    from minipar.parallel.memory import BYTES, problem
    from minipar.plan import activations, shapes, state

    free = backend.free_memory()
    if args.n_layer * max(1, args.num_experts or 1) > PLANNED_UP_TO:
        rough = problem(run, free, FLAGS)
        if rough or free is None:  # memory not known: nothing to refuse, and no count of 10^29 layers
            return rough
    model, layout, m = shapes.from_run_config(run, args.recompute_granularity == "selective")
    precision = run.dtype if BYTES[run.dtype] > 2 else "bf16-fp32-grads" if run.fp32_grads else "bf16"
    # stage by stage: 2BW's stash, ZeRO's gathered weights and gradients in flight
    peaks = [state.stage_peak_bytes(model, layout, s, precision, m) for s in range(layout.pp)]
    args.planned_state_peaks = peaks  # --report prints them beside the optimizer's ledger
    # the fullest stage's state and activations together, as the planner counts a layout: the
    # fullest state (the first stage's embedding) and the most activations (the first stage's
    # micro-batches in flight, the last's logits) need not be one stage's
    kept = [activations.stage_peak(model, layout, m, BYTES[run.dtype], s) for s in range(layout.pp)]
    fullest = max(range(layout.pp), key=lambda s: peaks[s] + kept[s])
    return problem(run, free, FLAGS, kept[fullest], peaks[fullest])


def balanced_layers(args):
    """--pipeline-layers balanced as counts (``plan.hetero.balance``: the last chunk's head counted
    in blocks' FLOPs); a problem where there is nothing to balance."""
    if args.pipeline_layers != "balanced":
        return []
    from minipar.parallel.pipeline import schedules
    from minipar.plan import hetero, shapes

    chunks = args.pp * args.vpp
    args.pipeline_layers = None  # what the problems below leave: the even split, for the checks that follow
    if chunks == 1:
        return ["--pipeline-layers balanced splits the layers between pipeline chunks, and --pp x --vpp is 1: "
                "give --pp > 1, or drop it"]
    if args.n_layer < chunks or (args.schedule == "zb-v" and args.vpp != 2):
        return []  # validate says it: every chunk needs a layer; ZB-V's V is two chunks a rank
    if args.n_layer > BALANCED_UP_TO:  # the greedy places one layer at a time
        return [f"--pipeline-layers balanced splits up to {BALANCED_UP_TO:,} layers, and --n-layer is "
                f"{args.n_layer:,}: give the counts of the split yourself"]
    model = shapes.Model(args.n_layer, args.n_embd, args.n_head, args.block_size, args.vocab_size,
                         args.num_experts or 0, args.moe_router_topk, args.moe_layer_freq)
    head = hetero.head_in_blocks(model, args.recompute)
    shape = schedules.shape_of(args.schedule)
    args.pipeline_layers = tuple(hetero.chunk_layers(args.n_layer, args.pp, args.vpp, head, shape))
    return []


def balanced_linears(args, run):
    """--defer-wgrad-linears balanced as a count (``plan.hetero.balanced_linears``) for the resolved
    ``run`` (its micro-batches and layers per chunk known)."""
    from minipar.plan import hetero, shapes

    model, layout, m = shapes.from_run_config(run)
    return hetero.balanced_linears(model, layout.pp, m, layout.schedule, layout.vpp, layout.pipeline_layers,
                                   layout.recompute)
