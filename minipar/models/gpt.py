"""The GPT: GPT-2's architecture at any size, with GPT-2's parameter names.

    x = wte[idx] + wpe[0..T)                       token + learned position embeddings
    for each block:  x = x + attn(ln_1(x))         pre-LayerNorm residual blocks
                     x = x + mlp(ln_2(x))          mlp = c_proj(gelu(c_fc(.))), 4x wide
    logits = ln_f(x) @ wte^T                       the output head is the token embedding (tied)

Names follow nanoGPT/GPT-2 (``transformer.h.0.attn.c_attn.weight``), weights are (out, in), so a
state_dict maps one to one onto those checkpoints. The tied head has no separate ``lm_head.weight``
entry: it *is* ``transformer.wte.weight``, and its gradient is the sum of both uses.
"""

import math
import numbers
from dataclasses import dataclass

import numpy

import minipar.functional as F
from minipar.autograd import no_grad
from minipar.backend import default_generator, xp
from minipar.functional.checks import probability
from minipar.nn import Dropout, Embedding, LayerNorm, Linear, Module, ModuleDict, ModuleList


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    vocab_size: int = 256
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
            setattr(self, name, int(value))
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                "every head needs n_embd / n_head dimensions"
            )
        self.dropout = probability(self.dropout, "GPTConfig.dropout")


class CausalSelfAttention(Module):
    """softmax(q k^T / sqrt(d) + causal mask) v over n_head heads, from one fused qkv projection.

    The middle is the fused ``F.causal_attention`` op; written with the basic ops it would read

        q, k, v = F.split(qkv, 3, axis=-1)                        # each (B, T, C)
        q, k, v = (t.reshape(B, T, H, C // H).transpose(0, 2, 1, 3) for t in (q, k, v))
        att = F.masked_fill(q @ k.transpose(0, 1, 3, 2) / sqrt(C // H), causal, -inf)
        y = (dropout(F.softmax(att)) @ v).transpose(0, 2, 1, 3).reshape(B, T, C)

    which tests/test_gpt.py checks it against, values and gradients.
    """

    def __init__(self, config):
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, config.bias)
        # GPT-2 scales the init of projections into the residual stream by 1/sqrt(2 n_layer):
        # 2 n_layer of them add up along the residual path.
        self.c_proj = Linear(
            config.n_embd, config.n_embd, config.bias, std=0.02 / math.sqrt(2 * config.n_layer)
        )
        self.resid_dropout = Dropout(config.dropout)

    def forward(self, x):
        p = self.dropout if self.training else 0.0
        y = F.causal_attention(self.c_attn(x), self.n_head, p)
        return self.resid_dropout(self.c_proj(y))


class MLP(Module):
    def __init__(self, config):
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, config.bias)
        self.c_proj = Linear(
            4 * config.n_embd, config.n_embd, config.bias, std=0.02 / math.sqrt(2 * config.n_layer)
        )
        self.dropout = Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(Module):
    def __init__(self, config):
        self.ln_1 = LayerNorm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(Module):
    def __init__(self, config):
        self.config = config
        self.transformer = ModuleDict(
            wte=Embedding(config.vocab_size, config.n_embd),
            wpe=Embedding(config.block_size, config.n_embd),
            drop=Dropout(config.dropout),
            h=ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=LayerNorm(config.n_embd, config.bias),
        )

    def forward(self, idx, targets=None):
        """``idx`` (B, T) integer ids -> logits (B, T, vocab) and, given targets, the mean loss."""
        idx = xp.asarray(idx)
        if idx.ndim != 2:
            raise ValueError(f"GPT input must be (batch, time) token ids, got shape {idx.shape}")
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        tr = self.transformer
        x = tr.drop(tr.wte(idx) + tr.wpe(xp.arange(T)))
        for block in tr.h:
            x = block(x)
        logits = F.linear(tr.ln_f(x), tr.wte.weight)
        loss = F.cross_entropy(logits, targets) if targets is not None else None
        return logits, loss

    def generate(self, idx, max_new_tokens, temperature=1.0, generator=None):
        """Sample ``max_new_tokens`` continuations of ``idx`` (B, T), one token at a time."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        generator = generator or default_generator()
        idx = numpy.asarray(idx)
        was_training = self.training
        self.eval()
        with no_grad():
            for _ in range(max_new_tokens):
                logits, _ = self(idx[:, -self.config.block_size :])
                probs = F.softmax(logits[:, -1, :] * (1.0 / temperature)).numpy().astype(numpy.float64)
                probs /= probs.sum(axis=1, keepdims=True)  # exactly 1 in float64, as choice() wants
                nxt = [generator.choice(probs.shape[1], p=row) for row in probs]
                idx = numpy.concatenate([idx, numpy.array(nxt)[:, None]], axis=1)
        self.train(was_training)
        return idx
