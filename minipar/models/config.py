"""The GPT's hyperparameters: GPT-2's shape, and the mixture of experts in place of some MLPs.

Its shape rules are the run's (``minipar.parallel.validate``), asked about the model alone, so a
config that cannot be built fails here with the same one-line reason the CLI gives.
"""

from dataclasses import dataclass

from minipar.parallel.validate import RunConfig, check


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    vocab_size: int = 256
    dropout: float = 0.0
    bias: bool = True
    # a mixture of experts in place of the MLP of every moe_layer_freq-th block (0: dense); names
    # as Megatron-core's flags (models/moe.py)
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_layer_freq: int = 1
    moe_expert_capacity_factor: float = None  # None: dropless
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_router_pre_softmax: bool = False  # True: the weights are p[e_j] (no renormalisation over the k)

    def __post_init__(self):
        # the shape rules are the run's (minipar.parallel.validate), asked about the model alone
        moe = self.num_experts != 0
        check(RunConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, block_size=self.block_size,
                        vocab_size=self.vocab_size, dropout=self.dropout,
                        num_experts=self.num_experts if moe else None, moe_router_topk=self.moe_router_topk if moe else None,
                        moe_layer_freq=self.moe_layer_freq, moe_expert_capacity_factor=self.moe_expert_capacity_factor,
                        moe_loss_coeffs=(self.moe_aux_loss_coeff, self.moe_z_loss_coeff)), what="GPTConfig")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            setattr(self, name, int(getattr(self, name)))  # a NumPy integer becomes a plain one
        self.dropout = float(self.dropout)

    def is_moe(self, layer):
        """Whether block ``layer`` has a mixture of experts (Megatron-core: every moe_layer_freq-th)."""
        return self.num_experts > 0 and layer % self.moe_layer_freq == 0
