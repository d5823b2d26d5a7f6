"""Which parallelism, when: a planner that predicts a layout's memory, traffic, bubble and step time.

Layer 7, no MPI. One concept per file:

    shapes.py       the model's and the layout's plain numbers (Megatron's names), the presets
    state.py        parameters a rank holds and their bytes with AdamW and ZeRO (exact)
    activations.py  one layer's activation bytes (the formula bench/activation_memory.py measures),
                    times the layers and the schedule's in-flight micro-batches
    traffic.py      bytes each group sends per rank per step, as the communicators count them
    zero12.py       ZeRO-1's and 2's groups and the most they hold during a step
    zero3.py        ZeRO-3's gathers and reduce-scatters per parameter group, over the rank's schedule
    zero3_peak.py   the most ZeRO-3 holds during a step: its ledger replayed over the schedule
    bubble.py       the pipeline bubble and the in-flight micro-batches, from the schedule simulator
    overhead.py     per-launch, per-call and shared-core time beyond the FLOPs and bytes
    cost.py         step time: compute at peak x efficiency, an alpha-beta model per link
    enumerate.py    every layout of a machine, why each invalid one fails, ranked by step time
    hetero.py       layers per stage balanced over stages of unequal speed, and over the head's FLOPs
    commands.py     the trainer's command for a plan; the heterogeneous-GPU section that prints one
    __main__.py     ``python -m minipar.plan``
"""
