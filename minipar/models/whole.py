"""What needs the whole model on one rank: its full state dict, and sampling one token at a time.

``GPT`` takes these from ``WholeModel``. A pipeline stage holds some layers only, an
expert-parallel rank some experts only, and a context-parallel rank some positions only, so they
refuse; ``checkpoint.full`` gathers the whole state from any layout instead.
"""

import numpy

import minipar.functional as F
from minipar.autograd import no_grad
from minipar.backend import array_of, to_numpy
from minipar.parallel import tensor
from minipar.random import default_generator


class WholeModel:
    def _whole_model_only(self, what):
        if self.pp is not None:
            raise RuntimeError(f"{what} needs the whole model, and this GPT is split into pipeline "
                               "stages (each rank holds some layers only)")
        # an expert-parallel rank holds E/EP of each layer's experts: its state_dict() is its own
        # part, which these two would silently pass off as (or require to be) the whole model's
        if self.grid is not None and self.grid.ep > 1 and "state_dict" in what:
            raise RuntimeError(f"{what} needs every expert, and this GPT's experts are spread over an "
                               f"expert-parallel group (EP={self.grid.ep}, each rank holds some experts only): "
                               "use checkpoint.full.gather_full_state / load_full_state (any layout), or "
                               "state_dict() for this rank's part")
        if self.cp is not None and what.startswith("generate"):
            raise RuntimeError("generate() adds one token at a time, which context parallelism cannot "
                               "split; sample from a model built on a grid without CP")

    def full_state_dict(self):
        """The single-device state dict, gathered from the shards (a collective on TP ranks)."""
        self._whole_model_only("full_state_dict()")
        return tensor.full_parameters(self) if self.tp is not None else self.state_dict()

    def load_full_state_dict(self, state):
        """Load a single-device state dict; each rank keeps its shards."""
        self._whole_model_only("load_full_state_dict()")
        tensor.load_full_parameters(self, state) if self.tp is not None else self.load_state_dict(state)

    def generate(self, idx, max_new_tokens, temperature=1.0, generator=None):
        """Sample ``max_new_tokens`` continuations of ``idx`` (B, T), one token at a time."""
        self._whole_model_only("generate()")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if self.sequence_parallel:
            raise ValueError("generate() adds one token at a time, which sequence parallelism cannot "
                             "split; sample from a model built without sequence_parallel")
        generator = generator or default_generator()
        idx = to_numpy(array_of(idx))
        was_training = self.training
        self.eval()
        with no_grad():
            for _ in range(max_new_tokens):
                logits = self.gather_logits(self(idx[:, -self.config.block_size :])[0])
                probs = F.softmax(logits[:, -1, :] * (1.0 / temperature)).numpy().astype(numpy.float64)
                if not numpy.isfinite(probs).all():
                    raise FloatingPointError("the next token's probabilities are not finite: the logits "
                                             "overflow (weights too large) or are nan")
                probs /= probs.sum(axis=1, keepdims=True)  # exactly 1 in float64, as choice() wants
                nxt = numpy.array([generator.choice(probs.shape[1], p=row) for row in probs])
                if self.tp is not None:  # the TP ranks must continue the same text
                    self.tp.broadcast(nxt, root=0)
                idx = numpy.concatenate([idx, nxt[:, None]], axis=1)
        self.train(was_training)
        return idx
