"""The layers of a GPT block, plain or tensor-parallel: attention, MLP and the pre-LayerNorm block.

``_Layers`` decides, for the whole model at once, whether each linear layer, embedding, LayerNorm
and dropout is the single-device one or its tensor-/sequence-parallel counterpart; the block code
below is then the same for every layout.
"""

import enum
import math

import minipar.functional as F
from minipar.nn import Dropout, Embedding, LayerNorm, Linear, Module
from minipar.models.moe import MoEMLP
from minipar.parallel import context, tensor


class Site(enum.IntEnum):
    """Where a dropout sits in its layer. With the layer's index it names the dropout in every
    mask's key (see ``minipar.rng``), so a pipeline stage or a recomputed block draws the same
    masks as the whole model on one device, however many dropouts ran before it."""

    EMBEDDING = 0  # token + position embeddings (layer 0: the pair (layer, site) stays unique)
    ATTENTION_PROBS = 1  # the attention probabilities, per head
    ATTENTION_OUTPUT = 2  # the attention block's output projection
    MLP_OUTPUT = 3  # the MLP's output projection


class _Layers:
    """Makes each layer plain (no tensor parallelism) or split across the TP group ``tp``; ``rng``
    is the model's DropoutRNG, which every dropout shares. ``cp``: the context-parallel group
    (None without), whose ranks attend across it by ``cp_comm_type``: "p2p" (ring attention) or
    "a2a" (Ulysses)."""

    def __init__(self, tp, sequence_parallel, rng, cp=None, cp_comm_type="p2p", ep=None, moe_step=None,
                 moe_routing=None):
        self.tp, self.sp, self.rng, self.cp = tp, sequence_parallel, rng, cp
        self.context_attention = {"p2p": context.ring_attention, "a2a": context.ulysses_attention}[cp_comm_type]
        self.ep, self.moe_step, self.moe_routing = ep, moe_step, moe_routing

    def column(self, n_in, n_out, bias, chunks=1, rank_order=False):
        """``rank_order``: under sequence parallelism, leave the gathered tokens in the order the
        all-gather stacks them (for a consumer that treats each token alone: no copy)."""
        if self.tp is None:
            return Linear(n_in, n_out, bias)
        return tensor.ColumnParallelLinear(n_in, n_out, self.tp, bias, chunks=chunks, sequence_parallel=self.sp,
                                           rank_order=rank_order and self.sp)

    def row(self, n_in, n_out, bias, std, rank_order=False):
        if self.tp is None:
            return Linear(n_in, n_out, bias, std=std)
        return tensor.RowParallelLinear(n_in, n_out, self.tp, bias, std=std, sequence_parallel=self.sp,
                                        rank_order=rank_order and self.sp)

    def vocab_embedding(self, vocab, dim):
        if self.tp is None:
            return Embedding(vocab, dim)
        return tensor.VocabParallelEmbedding(vocab, dim, self.tp, sequence_parallel=self.sp)

    def layer_norm(self, dim, bias):
        """With sequence parallelism each rank normalises its own positions only: the weight
        gradients are partial sums, added up over the TP group by ``GPT.finalize_grads``."""
        ln = LayerNorm(dim, bias)
        if self.sp:
            for p in ln.parameters():
                p.placement = p.placement.also(grad_sum="tp")
        return ln

    def mixture_of_experts(self, config, layer):
        """Block ``layer``'s MoE in place of its MLP. Its tokens are this rank's: with tensor
        parallelism and no sequence parallelism every TP rank routes the same tokens through
        whole experts (the same work, the same gradients); with sequence parallelism each routes
        its own positions, so the router's and experts' gradients are partial sums over TP. The
        MLP's dropout follows the combined output."""
        moe = MoEMLP(config, config.num_experts, config.moe_router_topk, config.moe_expert_capacity_factor,
                     normalize=False if config.moe_router_pre_softmax else None,
                     aux_loss_coeff=config.moe_aux_loss_coeff, z_loss_coeff=config.moe_z_loss_coeff,
                     routing=self.moe_routing, ep=self.ep, rng=self.rng, step=self.moe_step, layer=layer,
                     dropout=self.dropout(config.dropout, layer, Site.MLP_OUTPUT))
        if self.sp:
            for p in moe.parameters():
                p.placement = p.placement.also(grad_sum="tp")
        return moe

    def dropout(self, p, layer, site):
        """The dropout at ``site`` of layer ``layer``. Each rank drops its part of the whole
        batch's mask: its rows (the model's DropoutRNG knows them) and, in a sequence-parallel
        region, its slice of the sequence."""
        return Dropout(p, self.rng, layer, site, shards=[(1, self.tp)] if self.sp else [])


class CausalSelfAttention(Module):
    """softmax(q k^T / sqrt(d) + causal mask) v over n_head heads, from one fused qkv projection.

    The middle is the fused ``F.causal_attention`` op; written with the basic ops it would read

        q, k, v = F.split(qkv, 3, axis=-1)                        # each (B, T, C)
        q, k, v = (t.reshape(B, T, H, C // H).transpose(0, 2, 1, 3) for t in (q, k, v))
        att = F.masked_fill(q @ k.transpose(0, 1, 3, 2) / sqrt(C // H), causal, -inf)
        y = (dropout(F.softmax(att)) @ v).transpose(0, 2, 1, 3).reshape(B, T, C)

    which tests/test_gpt.py checks it against, values and gradients. Under tensor parallelism the
    qkv projection is column-parallel with whole heads per rank (q, k and v of heads
    rank*H/N .. (rank+1)*H/N), attention runs on those heads alone, and the output projection is
    row-parallel: one all-reduce forward, one backward.
    """

    def __init__(self, config, layers, layer):
        tp = layers.tp.size if layers.tp is not None else 1
        self.n_head = config.n_head // tp  # heads on this rank
        self.head_offset = layers.tp.rank * self.n_head if layers.tp is not None else 0
        self.dropout, self.rng, self.layer = config.dropout, layers.rng, layer
        self.cp, self.context_attention = layers.cp, layers.context_attention
        # selective recomputation: hold no T x T probabilities (GPT sets it); with CP, ring attention
        # holds none anyway, and Ulysses passes it on to the attention on its heads
        self.recompute = False
        self.c_attn = layers.column(config.n_embd, 3 * config.n_embd, config.bias, chunks=3)
        # GPT-2 scales the init of projections into the residual stream by 1/sqrt(2 n_layer):
        # 2 n_layer of them add up along the residual path.
        self.c_proj = layers.row(config.n_embd, config.n_embd, config.bias,
                                 std=0.02 / math.sqrt(2 * config.n_layer))
        self.resid_dropout = layers.dropout(config.dropout, layer, Site.ATTENTION_OUTPUT)

    def forward(self, x):
        p = self.dropout if self.training else 0.0
        qkv = self.c_attn(x)  # (B, T, 3C/TP): every position of this rank's part of the context
        key = rows = positions = None
        if p > 0 or self.cp is not None:  # the global rows and positions of these tokens
            rows, positions = self.rng.where(qkv.shape[0], qkv.shape[1])
        if p > 0:  # key the masks
            key = self.rng.key(self.layer, Site.ATTENTION_PROBS)
        if self.cp is None:
            y = F.causal_attention(qkv, self.n_head, p, key=key, rows=rows, positions=positions,
                                   head_offset=self.head_offset, recompute=self.recompute)
        else:  # the keys and values of the other positions are on the other ranks of the CP group
            y = self.context_attention(qkv, self.n_head, self.cp, positions, p, key=key, rows=rows,
                                       head_offset=self.head_offset, recompute=self.recompute)
        return self.resid_dropout(self.c_proj(y))


class MLP(Module):
    """dropout(c_proj(GELU(c_fc(x)))). Each token passes alone, so under sequence parallelism the
    tokens between c_fc and c_proj stay in the order the all-gather stacks them (``rank_order``)."""

    def __init__(self, config, layers, layer):
        self.c_fc = layers.column(config.n_embd, 4 * config.n_embd, config.bias, rank_order=True)
        self.c_proj = layers.row(4 * config.n_embd, config.n_embd, config.bias,
                                 std=0.02 / math.sqrt(2 * config.n_layer), rank_order=True)
        self.dropout = layers.dropout(config.dropout, layer, Site.MLP_OUTPUT)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(Module):
    """Block ``layer`` of the model (its index in the whole model, which keys its dropout masks)."""

    def __init__(self, config, layers, layer):
        self.ln_1 = layers.layer_norm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config, layers, layer)
        self.ln_2 = layers.layer_norm(config.n_embd, config.bias)
        self.mlp = layers.mixture_of_experts(config, layer) if config.is_moe(layer) else MLP(config, layers, layer)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
