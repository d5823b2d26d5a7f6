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
the LayerNorm and dropout regions along the sequence. With PP > 1 each rank keeps only its
pipeline stage's blocks (``virtual_stages`` chunks of them, placed round-robin), still named by
their place in the whole model (``transformer.h.8``); the first stage holds the embeddings, the
last the final LayerNorm, and both the tied ``wte``. ``chunk_forward`` runs one chunk.

Dropout decides every element by its place (see ``minipar.rng``): the seed, ``model.rng.iteration``
(the training loop sets it each step), the layer and site (``layers.Site``), and the global row and
position of its token. A forward that holds other rows than its data-parallel slice of the batch (a
micro-batch) says which inside ``with model.rng.at(rows=...)``.
"""

import minipar.functional as F
from minipar.backend import array_of, xp
from minipar.models.config import GPTConfig  # noqa: F401  re-exported: GPTConfig is asked of gpt
from minipar.models.layers import Block, Site, _Layers
from minipar.models.moe import MoEStep
from minipar.models.whole import WholeModel
from minipar.nn import Embedding, Module, ModuleDict, ModuleList
from minipar.parallel import tensor
from minipar.parallel.collectives import gather_from_region
from minipar.parallel.cross_entropy import vocab_parallel_cross_entropy
from minipar.parallel.pipeline.schedules import Pipeline
from minipar.parallel.recompute import checkpoint
from minipar.parallel.validate import RunConfig, check
from minipar.random import default_generator
from minipar.rng import DropoutRNG, context_positions, part


class GPT(WholeModel, Module):
    tied_sum_elsewhere = False  # see finalize_grads

    def __init__(self, config, grid=None, sequence_parallel=False, virtual_stages=1, cp_comm_type="p2p",
                 recompute_granularity=None, pipeline_shape="round-robin", moe_routing=None, layers_per_stage=None):
        self.config = config
        self.grid = grid  # resolves the group names of the parameters' placements
        self.tp = grid.tp_group if grid is not None and grid.tp > 1 else None
        self.cp = grid.cp_group if grid is not None and grid.cp > 1 else None
        self.dp = grid.dp_group if grid is not None and grid.dp > 1 else None
        self.pp = grid.pp_group if grid is not None and grid.pp > 1 else None
        # the model on its grid (whole heads per TP rank, whole blocks per chunk, SP needs TP > 1),
        # before any group communicates. Not block_size: a sequence parallel model may run shorter
        # sequences, and refuses a length TP does not divide when it sees one (``_positions``).
        n, tp, pp, dp, cp, ep = (grid.layout.world_size, grid.tp, grid.pp, grid.dp, grid.cp, grid.ep) if grid is not None else (1,) * 6
        check(RunConfig(world_size=n, tp=tp, pp=pp, dp=dp, cp=cp, cp_comm_type=cp_comm_type, ep=ep,
                        num_experts=config.num_experts or None, virtual_stages=virtual_stages, n_layer=config.n_layer,
                        n_head=config.n_head, n_embd=config.n_embd, sequence_parallel=bool(sequence_parallel),
                        pipeline_layers=None if layers_per_stage is None else tuple(layers_per_stage)), what="GPT")
        if ep > 1 and not config.num_experts:
            raise ValueError(f"GPT: the grid has EP={ep}, but the model has no experts: set num_experts")
        self.sequence_parallel = bool(sequence_parallel)
        # dropout: by default this model holds its data-parallel rank's slice of the batch's rows
        # and, with context parallelism, its rank's two chunks of every sequence
        self.rng = DropoutRNG(replica=(self.dp.rank, self.dp.size) if self.dp is not None else (0, 1),
                              context=(self.cp.rank, self.cp.size) if self.cp is not None else (0, 1))
        # what its MoE layers share: the step's token count and routing statistics (the executor
        # sets and the trainer reads them); ``moe_routing``: a single-device reference's RoutingGroups
        self.moe = MoEStep()
        ep_group = grid.ep_group if grid is not None and grid.ep > 1 else None
        layers = _Layers(self.tp, self.sequence_parallel, self.rng, self.cp, cp_comm_type,
                         ep=ep_group, moe_step=self.moe, moe_routing=moe_routing)
        if pipeline_shape not in ("round-robin", "v") or (pipeline_shape == "v" and virtual_stages != 2):
            raise ValueError(f"pipeline_shape is 'round-robin' or 'v' (with virtual_stages=2), got "
                             f"{pipeline_shape!r} with virtual_stages={virtual_stages}")
        pipe = Pipeline(grid.pp if grid is not None else 1, 1, virtual_stages, pipeline_shape)
        r = grid.pp_rank if grid is not None else 0
        self.n_chunks = pipe.n_chunks
        # local chunk c is global chunk c*p + r (Megatron's round-robin) or, in ZB-V's V, chunks r
        # and 2p - 1 - r; global chunk g has the layers_per_stage[g] layers after those of chunks
        # 0 .. g-1 (n_layer / (p v) each by default; uneven for stages of unequal speed:
        # ``plan.hetero.balance``). The first global chunk embeds, the last one ends with the head
        # (in a V both are on rank 0). A layer keeps its global index, in names and checkpoints.
        self.chunks = [pipe.global_chunk(r, c) for c in range(virtual_stages)]
        self.pipeline_shape = pipeline_shape
        self.layers_per_stage = None if layers_per_stage is None else tuple(layers_per_stage)
        sizes = self.layers_per_stage or (config.n_layer // self.n_chunks,) * self.n_chunks
        starts = [sum(sizes[:g]) for g in range(self.n_chunks)]
        self.chunk_layers = [list(range(starts[g], starts[g] + sizes[g])) for g in self.chunks]
        first, last = self.chunks[0] == 0, self.chunks[-1] == self.n_chunks - 1
        # Every rank draws the whole model in the single-device order, so each layer gets the
        # single-device weights, and keeps its own layers (construction holds the whole model once).
        wte = layers.vocab_embedding(config.vocab_size, config.n_embd)
        wpe = Embedding(config.block_size, config.n_embd)
        blocks = [Block(config, layers, i) for i in range(config.n_layer)]
        # Korthikanti et al. 2022: "full" keeps each block's input and runs the block again in
        # backward (``chunk_forward``), "selective" only attention's T x T probabilities and mask
        if recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity is None, 'full' or 'selective', got {recompute_granularity!r}")
        self.recompute_granularity = recompute_granularity
        for block in blocks:
            block.attn.recompute = recompute_granularity == "selective"
        mine = [i for layer_ids in self.chunk_layers for i in layer_ids]
        self.transformer = ModuleDict(
            wte=wte if first or last else None,  # the tied head: the first and the last stage
            wpe=wpe if first else None,
            drop=layers.dropout(config.dropout, 0, Site.EMBEDDING) if first else None,
            h=ModuleList([blocks[i] for i in mine], names=mine),
            ln_f=layers.layer_norm(config.n_embd, config.bias) if last else None,
        )
        self._block = dict(zip(mine, self.transformer.h))
        self._runner = None  # how each unit of the forward runs (wrap_units)
        if self.sequence_parallel:  # each rank of the TP group uses the rows of its own positions
            wpe.weight.placement = wpe.weight.placement.also(grad_sum="tp")
        # The tied embedding lives on two stages. Its copies start equal (the first stage's is
        # broadcast, as Megatron-LM does, so they agree even if the ranks were seeded differently)
        # and take equal steps: finalize_grads adds the two gradient parts. The first stage's copy
        # is the one counted in a norm and written in a checkpoint (placement.is_primary).
        # In a V the first and the last chunk are both on rank 0: one copy, used twice, as on one device.
        self.embedding_group = grid.embedding_group if self.pp is not None and pipeline_shape != "v" else None
        if self.embedding_group is not None and self.embedding_group.size > 1:
            self.embedding_group.broadcast(wte.weight.data, root=0)
            wte.weight.placement = wte.weight.placement.also(copies="embedding", grad_sum="embedding")
        # drawn after the weights, so the weights do not depend on it
        self.rng.seed = int(default_generator().integers(0, 2**62))

    def context_positions(self, T):
        """The global positions of the tokens this rank's context-parallel part of a sequence of
        ``T`` holds (all of them without context parallelism)."""
        if self.cp is None:
            return xp.arange(T)
        if T % (2 * self.cp.size):
            raise ValueError(f"context parallelism cuts the sequence into 2 x CP chunks: length {T} is not "
                             f"divisible by {2 * self.cp.size}")
        return context_positions(T // self.cp.size, (self.cp.rank, self.cp.size))

    def _positions(self, T):
        """The global positions of the tokens this rank embeds: its context-parallel part of the
        sequence, and of that its sequence-parallel part."""
        positions = self.context_positions(T)
        if not self.sequence_parallel:
            return positions
        if len(positions) % self.tp.size:
            raise ValueError(f"sequence parallelism splits the sequence: {len(positions)} positions are not "
                             f"divisible by TP={self.tp.size}")
        return part(positions, self.tp.size, self.tp.rank)

    def local_targets(self, targets):
        """The targets of this rank's positions of ``targets`` (B, T): what its loss is a mean over."""
        return targets if self.cp is None else targets[:, self.context_positions(targets.shape[1])]

    def forward(self, idx, targets=None):
        """``idx`` (B, T) integer ids -> logits (B, T, vocab) and, given targets, the mean loss.
        Under tensor parallelism the logits are this rank's vocabulary columns (see
        ``gather_logits``); the loss is the whole model's, the same on every rank."""
        self._whole_model_only("forward() (run the stages with minipar.parallel.pipeline.PipelineExecutor)")
        x = self._run_unit("embed", self.embed, idx)
        for i, block in self._block.items():
            x = self._run_unit(f"h.{i}", block, x)
        logits = self._run_unit("head", self.logits, x)
        return logits, (self.loss(logits, targets) if targets is not None else None)

    # ---- pipeline stages ------------------------------------------------------------------------
    def chunk_forward(self, c, x, targets=None, recompute=False, reduction="mean"):
        """Run local chunk ``c``: token ids (the first chunk) or the previous chunk's activation
        in, the activation (B, T, C) out, or for the last chunk the loss over ``targets`` (their
        mean, or with ``reduction="sum"`` their sum).
        ``recompute``: keep only each block's input, and run the block again in backward (as
        ``recompute_granularity="full"`` does for every call)."""
        g = self.chunks[c]
        recompute = recompute or self.recompute_granularity == "full"
        if g == 0:
            x = self._run_unit("embed", self.embed, x)
        for i in self.chunk_layers[c]:
            block = self._block[i]
            run = (lambda x, b=block: checkpoint(b, x, b.parameters(), rng=self.rng)) if recompute else block
            x = self._run_unit(f"h.{i}", run, x)
        if g < self.n_chunks - 1:
            return x
        logits = self._run_unit("head", self.logits, x)
        return self.loss(logits, targets, reduction) if targets is not None else logits

    def activation_shape(self, batch, T):
        """The shape of what one chunk sends the next: (batch, positions on this rank, n_embd)."""
        positions = T // self.cp.size if self.cp is not None else T
        positions = positions // self.tp.size if self.sequence_parallel else positions
        return (batch, positions, self.config.n_embd)

    def check_batch(self, idx, targets=None):
        """Raise a ValueError naming what is wrong with a batch of ids (B, T) and targets: a
        pipeline calls this on every rank, since only the first stage reads the ids and only the
        last the targets, and a rank that failed alone would leave its neighbours waiting."""
        idx = xp.asarray(idx)
        if idx.ndim != 2 or idx.dtype.kind not in "iu":
            raise ValueError(f"GPT input must be (batch, time) integer token ids, got {idx.dtype} {idx.shape}")
        T, V = idx.shape[1], self.config.vocab_size
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        self.context_positions(T)  # raises if context parallelism cannot cut T
        cp = self.cp.size if self.cp is not None else 1
        if self.sequence_parallel and T % (cp * self.tp.size):
            raise ValueError(f"sequence parallelism splits the sequence: length {T} is not divisible by "
                             f"{'CP x ' if cp > 1 else ''}TP={cp * self.tp.size}")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= V):
            raise ValueError(f"token ids must lie in [0, {V}), got ids from {int(idx.min())} to {int(idx.max())}")
        if targets is not None:
            targets = xp.asarray(targets)
            if targets.shape != idx.shape:
                raise ValueError(f"targets {targets.shape} must have the ids' shape {idx.shape}")
            bad = (targets != -1) & ((targets < 0) | (targets >= V))
            if bool(bad.any()):
                raise ValueError(f"targets must lie in [0, {V}) or be -1 (ignored), got {int(targets[bad][0])}")
            if targets.size and bool((targets == -1).all()):
                raise ValueError("every target is -1 (ignored): the batch's mean loss is undefined")

    # ---- the forward in its units (ZeRO-3 runs each with its parameters gathered just in time) ----
    def units(self):
        """(name, parameters it uses) for each unit of this rank's forward, in order: the
        embeddings, each block, the final LayerNorm with the tied head."""
        tr, out = self.transformer, []
        if tr.wpe is not None:
            out.append(("embed", [tr.wte.weight, tr.wpe.weight]))
        out += [(f"h.{i}", block.parameters()) for i, block in self._block.items()]
        if tr.ln_f is not None:
            out.append(("head", tr.ln_f.parameters() + [tr.wte.weight]))
        return out

    def wrap_units(self, runner):
        """From now on run each unit ``name`` of the forward as ``runner(name, run, x)`` instead of
        ``run(x)``: the hook point a ZeRO-3 optimizer gathers and releases parameters at. A second
        wrap goes around the first (ZeRO-3's gathers around a recomputation's checkpoint)."""
        inner = self._runner
        self._runner = runner if inner is None else (
            lambda name, run, x: runner(name, lambda x: inner(name, run, x), x))

    def _run_unit(self, name, run, x):
        return run(x) if self._runner is None else self._runner(name, run, x)

    def embed(self, idx):
        """Token and position embeddings of the ids (B, T), then dropout."""
        idx = xp.asarray(array_of(idx))  # a Tensor's array as it is (no trip to the host)
        if idx.ndim != 2:
            raise ValueError(f"GPT input must be (batch, time) token ids, got shape {idx.shape}")
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        tr = self.transformer
        positions = self._positions(T)  # checks T against sequence parallelism before any communication
        if self.cp is not None:  # this rank's two chunks of every sequence
            idx = idx[:, self.context_positions(T)]
        return tr.drop(tr.wte(idx) + tr.wpe(positions))

    def logits(self, x):
        """The final LayerNorm and the tied output head."""
        tr = self.transformer
        x = tr.ln_f(x)
        return F.linear(x, tr.wte.weight) if self.tp is None else tr.wte.logits(x)

    @property
    def head_weight(self):
        """The output head's weight, the tied token embedding (this rank's vocabulary rows under TP)."""
        return self.transformer.wte.weight

    def last_linear_weights(self, k):
        """The weights of the k linear layers nearest the head, in the order backward reaches them:
        the last block's MLP output projection, its input projection, attention's output
        projection, its QKV, then the block before's (this rank's last chunk; the dense blocks that
        end it: a block with experts has no MLP products of its own, and validate refuses reaching one)."""
        out, blocks = [], -(-k // 4)  # the blocks it reaches, 4 linear layers each
        for i in reversed(self.chunk_layers[-1][-blocks:] if blocks else []):
            b = self._block[i]
            out += [b.mlp.c_proj.weight, b.mlp.c_fc.weight, b.attn.c_proj.weight, b.attn.c_attn.weight]
        return out[:k]

    def loss(self, logits, targets, reduction="mean"):
        """The mean cross-entropy over this rank's positions of ``targets`` (B, T), or their sum."""
        targets = self.local_targets(xp.asarray(array_of(targets)))
        if self.tp is None:
            return F.cross_entropy(logits, targets, reduction=reduction)
        return vocab_parallel_cross_entropy(logits, targets, self.tp, self.transformer.wte.start,
                                            self.config.vocab_size, reduction=reduction)

    def gather_logits(self, logits):
        """The whole vocabulary's logits (B, T, V) from this rank's columns (a collective)."""
        if self.tp is None:
            return logits
        return gather_from_region(logits, self.tp)[..., : self.config.vocab_size]

    def finalize_grads(self):
        """Finish the gradients once after the last backward of a step, before the optimizer:
        with sequence parallelism, sum the ones each rank holds only part of; with pipeline
        stages, add the tied embedding's two parts (the first stage's use as the input
        embedding, the last stage's as the output head), so both copies take the same step,
        unless ``tied_sum_elsewhere`` (PipeDream-2BW's stash adds them later, on its own copy of
        the gradients: the one sum here between stages, which end a batch at different times).
        A second call before the next backward is refused on every rank (it would add twice)."""
        if not hasattr(self, "_grads_final"):  # any backward through this rank's layers resets it
            self.parameters()[0].register_grad_hook(lambda _: setattr(self, "_grads_final", False))
        elif self._grads_final:
            raise RuntimeError("finalize_grads was already called since the last backward: call it "
                               "once, after the last backward of a step")
        self._grads_final = True
        if self.sequence_parallel:
            tensor.finalize_grads(self, self.tp)
        for p in self.parameters():
            if "embedding" in p.placement.grad_sum and not self.tied_sum_elsewhere:  # the tied embedding, on a pipeline
                if p.grad is None:
                    p.grad = xp.zeros_like(p.data)
                self.embedding_group.all_reduce(p.grad)
