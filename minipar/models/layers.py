"""The layers of a GPT block, plain or tensor-parallel: attention, MLP and the pre-LayerNorm block.

``_Layers`` decides, for the whole model at once, whether each linear layer, embedding, LayerNorm
and dropout is the single-device one or its tensor-/sequence-parallel counterpart; the block code
below is then the same for every layout.
"""

import math

import minipar.functional as F
from minipar.nn import Dropout, Embedding, LayerNorm, Linear, Module
from minipar.parallel import tensor


class _Layers:
    """Makes each layer plain (no tensor parallelism) or split across the TP group ``tp``; ``dp``
    is the data-parallel group (or None), whose ranks each hold a slice of the batch."""

    def __init__(self, tp, dp, sequence_parallel, rng):
        self.tp, self.dp, self.sp, self.rng = tp, dp, sequence_parallel, rng

    def column(self, n_in, n_out, bias, chunks=1):
        if self.tp is None:
            return Linear(n_in, n_out, bias)
        return tensor.ColumnParallelLinear(n_in, n_out, self.tp, bias, chunks=chunks, sequence_parallel=self.sp)

    def row(self, n_in, n_out, bias, std):
        if self.tp is None:
            return Linear(n_in, n_out, bias, std=std)
        return tensor.RowParallelLinear(n_in, n_out, self.tp, bias, std=std, sequence_parallel=self.sp)

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

    def dropout(self, p):
        """Each rank drops its part of the whole batch's mask: its slice of the batch (data
        parallel) and, in a sequence-parallel region, its slice of the sequence."""
        shards = ([(0, self.dp)] if self.dp is not None else []) + ([(1, self.tp)] if self.sp else [])
        return Dropout(p, self.rng, shards=shards)


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

    def __init__(self, config, layers):
        tp = layers.tp.size if layers.tp is not None else 1
        self.n_head = config.n_head // tp  # heads on this rank
        self.head_offset = layers.tp.rank * self.n_head if layers.tp is not None else 0
        self.dp = layers.dp
        self.dropout, self.rng = config.dropout, layers.rng
        self.c_attn = layers.column(config.n_embd, 3 * config.n_embd, config.bias, chunks=3)
        # GPT-2 scales the init of projections into the residual stream by 1/sqrt(2 n_layer):
        # 2 n_layer of them add up along the residual path.
        self.c_proj = layers.row(config.n_embd, config.n_embd, config.bias,
                                 std=0.02 / math.sqrt(2 * config.n_layer))
        self.resid_dropout = layers.dropout(config.dropout)

    def forward(self, x):
        p = self.dropout if self.training else 0.0
        key = self.rng.next_key() if p > 0 else None
        # which sequences of the step's whole batch these are: micro-batch-major, then DP rank
        micro = self.rng.micro[0]
        dp_rank, dp_size = (self.dp.rank, self.dp.size) if self.dp is not None else (0, 1)
        batch_offset = x.shape[0] * (micro * dp_size + dp_rank)
        y = F.causal_attention(self.c_attn(x), self.n_head, p, key=key, batch_offset=batch_offset,
                               head_offset=self.head_offset)
        return self.resid_dropout(self.c_proj(y))


class MLP(Module):
    def __init__(self, config, layers):
        self.c_fc = layers.column(config.n_embd, 4 * config.n_embd, config.bias)
        self.c_proj = layers.row(4 * config.n_embd, config.n_embd, config.bias,
                                 std=0.02 / math.sqrt(2 * config.n_layer))
        self.dropout = layers.dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(Module):
    # dropout keys a block draws per forward in training (attention probabilities, attention
    # output, MLP output): a pipeline stage starts its first block at the single-device call number
    DROPOUT_CALLS = 3

    def __init__(self, config, layers):
        self.ln_1 = layers.layer_norm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config, layers)
        self.ln_2 = layers.layer_norm(config.n_embd, config.bias)
        self.mlp = MLP(config, layers)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
