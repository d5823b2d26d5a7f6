"""What a pipeline schedule is made of: the instructions, and the pipeline's shape (which rank
holds which chunk of the model).

An instruction is one of

    recv_act  (mb, chunk)    receive the input activation of micro-batch mb for this chunk
    forward   (mb, chunk)    run the chunk; keep what backward needs
    send_act  (mb, chunk)    send its output to the rank holding the next chunk (non-blocking)
    recv_grad (mb, chunk)    receive the gradient of that output
    backward  (mb, chunk)    backpropagate it through the chunk
    send_grad (mb, chunk)    send the gradient of the chunk's input back (non-blocking)
    backward_input  (mb, chunk)   B: the backward's half that computes the input's gradient only
    backward_weight (mb, chunk)   W: the other half, the weights' gradients (no message)
    head_weight     (mb, chunk)   the output head's weight gradient, left by a backward for the
                                  pipeline's flush (Megatron-LM's deferred embedding wgrad), with
                                  the last linear layers' under ``defer_wgrad_linears``
    step                     the optimizer step, after everything

A pipeline of p ranks runs m micro-batches through p*v chunks of the model's layers, v per rank,
placed round-robin (Megatron-LM: rank r holds global chunks r, p + r, 2p + r, ..., so a
micro-batch visits ranks 0, 1, ..., p-1, 0, 1, ... v times) or, for ZB-V, in a V (rank r holds
chunks r and 2p - 1 - r: a micro-batch goes down the ranks and back up, and rank 0 holds both the
first chunk and the last).
"""

from dataclasses import dataclass

FORWARD, BACKWARD = "forward", "backward"
# the zero-bubble split of BACKWARD (Qi et al. 2024): B, the input's gradient, and W, the weights'
BACKWARD_INPUT, BACKWARD_WEIGHT = "backward_input", "backward_weight"
BACKWARDS = (BACKWARD, BACKWARD_INPUT)  # what receives an output's gradient and sends its input's
# the tied head's weight gradient, dlogits^T x, taken out of the last chunk's backwards and run at
# the flush, where the last stage waits for the first (Megatron-LM's defer_embedding_wgrad_compute)
HEAD_WEIGHT = "head_weight"
COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, HEAD_WEIGHT)
RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD, STEP = "recv_act", "send_act", "recv_grad", "send_grad", "step"


@dataclass(frozen=True)
class Instruction:
    op: str
    mb: int = -1
    chunk: int = 0

    def __str__(self):
        return self.op if self.op == STEP else f"{self.op}({self.mb},{self.chunk})"


@dataclass(frozen=True)
class Pipeline:
    """The shape of a pipeline: p ranks, v chunks per rank, m micro-batches per step, the chunks
    placed ``shape`` "round-robin" or "v" (v = 2)."""

    p: int
    m: int
    v: int = 1
    shape: str = "round-robin"

    def global_chunk(self, rank, chunk):
        if self.shape == "v":
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        return chunk * self.p + rank

    def place(self, global_chunk):
        """(rank, local chunk) holding a global chunk."""
        if self.shape == "v":
            return (global_chunk, 0) if global_chunk < self.p else (2 * self.p - 1 - global_chunk, 1)
        return global_chunk % self.p, global_chunk // self.p

    @property
    def n_chunks(self):
        return self.p * self.v


LETTERS = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W", HEAD_WEIGHT: "H"}  # as in the papers' figures
