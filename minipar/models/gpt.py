"""The GPT: GPT-2's architecture at any size, with GPT-2's parameter names.

    x = wte[idx] + wpe[0..T)                       token + learned position embeddings
    for each block:  x = x + attn(ln_1(x))         pre-LayerNorm residual blocks
                     x = x + mlp(ln_2(x))          mlp = c_proj(gelu(c_fc(.))), 4x wide
    logits = ln_f(x) @ wte^T                       the output head is the token embedding (tied)

Names follow nanoGPT/GPT-2 (``transformer.h.0.attn.c_attn.weight``), weights are (out, in), so a
state_dict maps one to one onto those checkpoints. The tied head has no separate ``lm_head.weight``
entry: it *is* ``transformer.wte.weight``, and its gradient is the sum of both uses.

One definition serves every layout. ``GPT(config)`` is the single-device model. ``GPT(config,
grid)`` on a grid with TP > 1 builds the same model from tensor-parallel layers (``_Layers`` picks
them): attention heads, MLP columns and the vocabulary split across the TP group, the same
parameter names holding shards, the same initial values. ``sequence_parallel=True`` also shards
the LayerNorm and dropout regions along the sequence.
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
from minipar.parallel import tensor
from minipar.parallel.collectives import gather_from_region
from minipar.parallel.cross_entropy import vocab_parallel_cross_entropy
from minipar.rng import RNGTracker


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
        for p in ln.parameters():
            p.sequence_parallel_grad = self.sp
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
    def __init__(self, config, layers):
        self.ln_1 = layers.layer_norm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config, layers)
        self.ln_2 = layers.layer_norm(config.n_embd, config.bias)
        self.mlp = MLP(config, layers)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(Module):
    def __init__(self, config, grid=None, sequence_parallel=False):
        self.config = config
        self.tp = grid.tp_group if grid is not None and grid.tp > 1 else None
        self.dp = grid.dp_group if grid is not None and grid.dp > 1 else None
        if grid is not None:
            grid.layout.check_model(config.n_head, config.n_embd, config.n_layer)
        if sequence_parallel and self.tp is None:
            raise ValueError("sequence parallelism shards along a TP group: it needs TP > 1")
        self.sequence_parallel = bool(sequence_parallel)
        self.rng = RNGTracker()
        layers = _Layers(self.tp, self.dp, self.sequence_parallel, self.rng)
        self.transformer = ModuleDict(
            wte=layers.vocab_embedding(config.vocab_size, config.n_embd),
            wpe=Embedding(config.block_size, config.n_embd),
            drop=layers.dropout(config.dropout),
            h=ModuleList(Block(config, layers) for _ in range(config.n_layer)),
            ln_f=layers.layer_norm(config.n_embd, config.bias),
        )
        # each rank of a sequence-parallel group uses the rows of its own positions
        self.transformer.wpe.weight.sequence_parallel_grad = self.sequence_parallel
        # drawn after the weights, so the weights do not depend on it
        self.rng.seed = int(default_generator().integers(0, 2**62))

    def _positions(self, T):
        if not self.sequence_parallel:
            return xp.arange(T)
        if T % self.tp.size:
            raise ValueError(f"sequence parallelism splits the sequence: length {T} is not "
                             f"divisible by TP={self.tp.size}")
        n = T // self.tp.size
        return xp.arange(self.tp.rank * n, (self.tp.rank + 1) * n)

    def forward(self, idx, targets=None):
        """``idx`` (B, T) integer ids -> logits (B, T, vocab) and, given targets, the mean loss.
        Under tensor parallelism the logits are this rank's vocabulary columns (see
        ``gather_logits``); the loss is the whole model's, the same on every rank."""
        x = self.embed(idx)
        for block in self.transformer.h:
            x = block(x)
        logits = self.logits(x)
        return logits, (self.loss(logits, targets) if targets is not None else None)

    # The forward in its pieces (ZeRO-3 wraps each one to gather its parameters just in time).
    def embed(self, idx):
        """Token and position embeddings of the ids (B, T), then dropout."""
        idx = xp.asarray(idx)
        if idx.ndim != 2:
            raise ValueError(f"GPT input must be (batch, time) token ids, got shape {idx.shape}")
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        tr = self.transformer
        positions = self._positions(T)  # checks T against sequence parallelism before any communication
        return tr.drop(tr.wte(idx) + tr.wpe(positions))

    def logits(self, x):
        """The final LayerNorm and the tied output head."""
        tr = self.transformer
        x = tr.ln_f(x)
        return F.linear(x, tr.wte.weight) if self.tp is None else tr.wte.logits(x)

    def loss(self, logits, targets):
        if self.tp is None:
            return F.cross_entropy(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, self.tp, self.transformer.wte.start,
                                            self.config.vocab_size)

    def gather_logits(self, logits):
        """The whole vocabulary's logits (B, T, V) from this rank's columns (a collective)."""
        if self.tp is None:
            return logits
        return gather_from_region(logits, self.tp)[..., : self.config.vocab_size]

    def finalize_grads(self):
        """Finish the gradients once after the last backward of a step, before the optimizer:
        with sequence parallelism, sum the ones each rank holds only part of."""
        if self.sequence_parallel:
            tensor.finalize_grads(self, self.tp)

    def full_state_dict(self):
        """The single-device state dict, gathered from the shards (a collective on TP ranks)."""
        return tensor.full_parameters(self) if self.tp is not None else self.state_dict()

    def load_full_state_dict(self, state):
        """Load a single-device state dict; each rank keeps its shards."""
        tensor.load_full_parameters(self, state) if self.tp is not None else self.load_state_dict(state)

    def generate(self, idx, max_new_tokens, temperature=1.0, generator=None):
        """Sample ``max_new_tokens`` continuations of ``idx`` (B, T), one token at a time."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if self.sequence_parallel:
            raise ValueError("generate() adds one token at a time, which sequence parallelism cannot "
                             "split; sample from a model built without sequence_parallel")
        generator = generator or default_generator()
        idx = numpy.asarray(idx)
        was_training = self.training
        self.eval()
        with no_grad():
            for _ in range(max_new_tokens):
                logits = self.gather_logits(self(idx[:, -self.config.block_size :])[0])
                probs = F.softmax(logits[:, -1, :] * (1.0 / temperature)).numpy().astype(numpy.float64)
                probs /= probs.sum(axis=1, keepdims=True)  # exactly 1 in float64, as choice() wants
                nxt = numpy.array([generator.choice(probs.shape[1], p=row) for row in probs])
                if self.tp is not None:  # the TP ranks must continue the same text
                    self.tp.broadcast(nxt, root=0)
                idx = numpy.concatenate([idx, nxt[:, None]], axis=1)
        self.train(was_training)
        return idx
