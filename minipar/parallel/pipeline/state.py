"""What one run of a schedule holds between its instructions, and what it reports.

The executor's handlers (one per instruction kind) share nothing but a ``StepState``: each takes
what an earlier instruction left in it and leaves what a later one needs, always under the key
``(micro-batch, local chunk)`` the two instructions name. A schedule that is correct (``simulate``
checks that every backward follows its forward and every receive has its send) therefore finds
every entry where it looks, and leaves every dictionary empty at its end.
"""

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    """What one step did on this rank. ``timeline``: (op, mb, chunk, start, end) for every
    instruction, in seconds of ``time.perf_counter``; ``loss``: the sum of this rank's scaled
    micro-batch losses (the last stage; None elsewhere); ``peak_alive``: the most chunk
    activations held at once (until the backward, or, split, until its W); ``peak_weight_bytes``:
    the most bytes the parked W's (and deferred head W's) kept alive at once (0 without either)."""

    timeline: list = field(default_factory=list)
    loss: float = None
    peak_alive: int = 0
    peak_weight_bytes: int = 0


@dataclass
class StepState:
    """One step (or one evaluation) in flight on this rank.

    micro           this rank's (ids, targets) of each micro-batch
    rows            the step's whole batch (every rank holds it): micro-batches' rows are cut from it
    tokens          the step's target tokens over the whole batch (every rank counts them alike)
    shape           of every activation and gradient message: agreed, never sent
    optimizer_step  what the step instruction calls, or None
    inputs          received activations, each waiting for its forward
    kept            (input, output) of each forward, its graph kept for the backward
    output_grads    received gradients of chunk outputs, each waiting for its backward
    input_grads     gradients of chunk inputs, each waiting to be sent back
    weight_grads    the W half of each split backward (``WeightGradients``), waiting for its W
    head_grads      the head's weight gradient left by each backward of the last chunk, waiting for
                    the flush (``defer_embedding_wgrad``)
    sends           requests of the sends still in flight
    receives        the step's receives, posted ahead (``receives.PostedReceives``)
    loss            the sum of the scaled micro-batch losses computed here so far
    record          the StepRecord returned: timeline and peak activations
    """

    micro: list
    rows: int
    tokens: int
    shape: tuple
    optimizer_step: object = None
    inputs: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)
    output_grads: dict = field(default_factory=dict)
    input_grads: dict = field(default_factory=dict)
    weight_grads: dict = field(default_factory=dict)
    head_grads: dict = field(default_factory=dict)
    sends: list = field(default_factory=list)
    receives: object = None
    loss: float = 0.0
    record: StepRecord = field(default_factory=StepRecord)

    def count_parked(self):
        """Record the bytes the parked W's (and deferred head W's) keep alive now, if a new peak."""
        held = sum(w.nbytes() for w in (*self.weight_grads.values(), *self.head_grads.values()))
        self.record.peak_weight_bytes = max(self.record.peak_weight_bytes, held)
