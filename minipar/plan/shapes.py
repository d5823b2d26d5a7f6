"""The plain numbers a plan reads: the model's shape, the layout and the machine (Megatron's names).

``Model`` is a GPT of minipar's architecture (GPT-2's: learned positions, biases, the output head
tied to the token embedding), optionally with a mixture of experts in every moe_layer_freq-th
block. ``Layout`` is one way to run it. ``Machine`` is the hardware the step time is predicted on.
The presets are the published shapes (GPT-2: Radford et al. 2019; GPT-3: Brown et al. 2020, Table
2.1; 1T: Narayanan et al. 2021, Table 1).
"""

from dataclasses import dataclass

from minipar.parallel import validate



@dataclass(frozen=True)
class Precision:
    """Bytes per value: a parameter, its gradient, the optimizer's state per parameter, an activation."""

    param: int
    grad: int
    optimizer: int
    activation: int


# minipar's float runs hold everything in one dtype (AdamW's m and v: 2 values per parameter). Mixed
# precision (Micikevicius et al. 2018) keeps bf16 weights and activations and, in the optimizer,
# fp32 master weights and the two moments (12 bytes, which ZeRO-1 shards). Its gradients: "bf16" is
# minipar's --bf16 (bf16 gradients, summed in bf16: 2 + 2 + 12 bytes per parameter);
# "bf16-fp32-grads" adds --accumulate-allreduce-grads-in-fp32 (fp32 main gradients: 2 + 4 + 12,
# Megatron's usual setting and the one its papers' memory counts assume).
PRECISIONS = {"float32": Precision(4, 4, 8, 4), "float64": Precision(8, 8, 16, 8), "bf16": Precision(2, 2, 12, 2),
              "bf16-fp32-grads": Precision(2, 4, 12, 2)}
BUCKET = 4 << 20  # DataParallelAdamW's bucket_bytes: data parallelism's buckets and ZeRO's groups


@dataclass(frozen=True)
class Model:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int = 256  # minipar's byte tokenizer
    num_experts: int = 0  # 0: dense MLPs
    moe_router_topk: int = 2
    moe_layer_freq: int = 1
    moe_expert_capacity_factor: float = None  # None: dropless
    dropout: float = 0.0

    def is_moe(self, layer):
        """As ``GPTConfig.is_moe``: every moe_layer_freq-th block from the first."""
        return self.num_experts > 0 and layer % self.moe_layer_freq == 0


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1  # virtual stages (model chunks) per pipeline rank
    zero_stage: int = 0
    micro_batch_size: int = 1
    recompute: bool = False  # full recomputation: keep each block's input only
    selective_recompute: bool = False  # --recompute-granularity selective: keep all but attention's T x T
    sequence_parallel: bool = False
    cp_comm_type: str = "p2p"
    schedule: str = "1f1b"
    pipeline_layers: tuple = None  # layers of each global chunk, in order (--pipeline-layers); None: L/(p v) each
    defer_embedding_wgrad: bool = False  # the head's weight gradients at the flush: the last rank parks their inputs
    defer_wgrad_linears: int = 0  # and its last k linear layers' (--defer-wgrad-linears)

    @property
    def world_size(self):
        return self.tp * self.cp * self.dp * self.pp

    @property
    def ring_attention(self):
        """Context parallelism by ring attention (``parallel/ring_attention.py``), not Ulysses."""
        return self.cp > 1 and self.cp_comm_type == "p2p"

    @property
    def selective(self):
        """Selective recomputation that drops something: ring attention keeps no T x T part for it
        to drop (its backward rebuilds the probabilities from the log-sum-exp whether or not it is
        asked), so there the flag runs the same code (``context.ring_attention``)."""
        return self.selective_recompute and not self.ring_attention


@dataclass(frozen=True)
class Machine:
    gpus: int
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    peak_tflops: float = 312.0  # A100 bf16 dense
    intra_node_gbps: float = 2400.0  # NVLink 3 (A100): 300 GB/s per direction
    inter_node_gbps: float = 200.0  # one HDR InfiniBand NIC per GPU
    intra_node_latency_us: float = 5.0  # alpha
    inter_node_latency_us: float = 10.0
    efficiency: float = 0.5  # the share of peak the kernels reach (calibrated by a micro-benchmark)
    # per-call overheads and shared cores (overhead.py); 0: not charged (a GPU, launches overlapped)
    layer_overhead_us: float = 0.0  # one layer's forward and backward launches, beyond their FLOPs
    edge_overhead_us: float = 0.0  # the embedding's and the head's (with the loss), per micro-batch
    call_overhead_us: float = 0.0  # one collective call or message, beyond alpha per latency step
    ring_pass_overhead_us: float = 0.0  # one pass of ring attention (a block's attention, forward or backward)
    cores_per_node: int = 0  # 0: a core (or a GPU) per rank; else ranks beyond it take turns
    # what a step runs after backward (update.py): AdamW's update and the gradient norm, per array the
    # rank walks and per element; 0: not charged (a GPU: a few fused memory-bound kernels)
    update_array_us: float = 0.0
    update_element_ns: float = 0.0
    norm_array_us: float = 0.0
    norm_element_ns: float = 0.0


PRESETS = {  # name: (Model, global batch): GPT-2's vocabulary padded as Megatron pads it
    "gpt2": (Model(12, 768, 12, 1024, 50257), 512),
    "gpt2-medium": (Model(24, 1024, 16, 1024, 50257), 512),
    "gpt2-large": (Model(36, 1280, 20, 1024, 50257), 512),
    "gpt2-xl": (Model(48, 1600, 25, 1024, 50257), 512),
    "gpt3-6.7b": (Model(32, 4096, 32, 2048, 50257), 1024),
    "gpt3-175b": (Model(96, 12288, 96, 2048, 50257), 1536),
    "megatron-1t": (Model(128, 25600, 160, 2048, 51200), 3072),
}


def run_config(model, layout, global_batch, dtype="float32"):
    """The ``validate.RunConfig`` of a model on a layout, so that validate's rules say why it fails."""
    return validate.RunConfig(
        world_size=layout.world_size, tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp,
        cp_comm_type=layout.cp_comm_type if layout.cp > 1 else None, ep=layout.ep,
        num_experts=model.num_experts or None, moe_router_topk=model.moe_router_topk if model.num_experts else None,
        moe_layer_freq=model.moe_layer_freq if model.num_experts else None,
        moe_expert_capacity_factor=model.moe_expert_capacity_factor, virtual_stages=layout.vpp,
        schedule=layout.schedule, global_batch=global_batch, micro_batch_size=layout.micro_batch_size,
        n_layer=model.num_layers, n_head=model.num_attention_heads, n_embd=model.hidden_size,
        block_size=model.seq_length, vocab_size=model.vocab_size, sequence_parallel=layout.sequence_parallel,
        zero_stage=layout.zero_stage, recompute=layout.recompute, pipeline_layers=layout.pipeline_layers,
        defer_embedding_wgrad=layout.defer_embedding_wgrad, defer_wgrad_linears=layout.defer_wgrad_linears,
        dtype=dtype if dtype in validate.DTYPES else "float32")


def from_run_config(run, selective_recompute=False):
    """(Model, Layout, m) of a resolved ``validate.RunConfig`` (its DP and micro-batches known): the
    inverse of ``run_config``."""
    model = Model(run.n_layer, run.n_embd, run.n_head, run.block_size, run.vocab_size or 256,
                  num_experts=run.num_experts or 0, moe_router_topk=run.moe_router_topk or 2,
                  moe_layer_freq=run.moe_layer_freq or 1, moe_expert_capacity_factor=run.moe_expert_capacity_factor,
                  dropout=run.dropout or 0.0)
    layout = Layout(tp=run.tp, pp=run.pp, dp=run.dp, cp=run.cp, ep=run.ep, vpp=run.virtual_stages,
                    zero_stage=run.zero_stage, micro_batch_size=run.micro_batch_size, recompute=run.recompute,
                    selective_recompute=selective_recompute, sequence_parallel=run.sequence_parallel,
                    cp_comm_type=run.cp_comm_type or "p2p", schedule=run.schedule or "1f1b",
                    pipeline_layers=run.pipeline_layers, defer_embedding_wgrad=bool(run.defer_embedding_wgrad),
                    defer_wgrad_linears=run.defer_wgrad_linears)
    return model, layout, run.micro_batches


def micro_batches(layout, global_batch):
    """m: micro-batches per pipeline per step (global batch / DP / micro-batch size)."""
    return global_batch // layout.dp // layout.micro_batch_size


__all__ = ["PRECISIONS", "Precision", "Model", "Layout", "Machine", "PRESETS", "run_config", "from_run_config",
           "micro_batches"]
