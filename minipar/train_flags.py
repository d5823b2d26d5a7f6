"""The trainer's flags (``python -m minipar.train --help``): Megatron-LM's names where it has
them, each with its type and default; ``train_checks`` checks what they describe together."""

from minipar.cli import DefaultsHelpFormatter, Parser, non_negative_float, non_negative_int, positive_float, positive_int
from minipar.parallel.validate import SCHEDULES
from minipar.train_checks import PROG, PROMPT, ROUTER_DEFAULTS

DEFAULTS = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=16, max_iters=600,
                lr=3e-3, min_lr=3e-4, warmup_iters=50)


def layer_counts(text):
    """--pipeline-layers 3,1: the layers of each pipeline chunk, comma-separated (validate checks
    their number and sum against --pp x --vpp and --n-layer); or "balanced", which check_args
    turns into counts once the model's shape is known."""
    return "balanced" if text == "balanced" else tuple(positive_int(part) for part in text.split(","))


def linear_count(text):
    """--defer-wgrad-linears 2, or "balanced", which check_args turns into a count once the
    micro-batches are known (``plan.hetero.balanced_linears``)."""
    return "balanced" if text == "balanced" else non_negative_int(text)


OPTIONAL_PATHS = ("data", "tokenizer", "load", "init_weights", "save", "log_json", "export_weights", "export_hf")


class TrainParser(Parser):
    """The training flags, completed from where the run's model and tokens come from: a Hugging
    Face snapshot's config.json, a tokenizer's vocabulary (``minipar.train_sources``)."""

    def parse_args(self, args=None, namespace=None):
        from minipar.train_sources import apply_sources, given_flags

        parsed = super().parse_args(args, namespace)
        for dest in OPTIONAL_PATHS:  # '' is the flag not given, as --plot '' is no plot
            if getattr(parsed, dest) == "":
                setattr(parsed, dest, None)
        apply_sources(parsed, given_flags(self, args))
        return parsed


def build_parser():
    from minipar import backend

    p = TrainParser(prog=PROG, formatter_class=DefaultsHelpFormatter,
                     description="Train a GPT on text (by default the Python standard library's source, as "
                                 "bytes, or as GPT-2's tokens with --tokenizer), on one device or on a TP x CP x "
                                 "DP x PP grid of MPI ranks; start from or export Hugging Face GPT-2 snapshots.")
    m = p.add_argument_group("model")
    m.add_argument("--n-layer", "--num-layers", type=positive_int, default=DEFAULTS["n_layer"], help="transformer blocks")
    m.add_argument("--n-head", "--num-attention-heads", type=positive_int, default=DEFAULTS["n_head"], help="attention heads")
    m.add_argument("--n-embd", "--hidden-size", type=positive_int, default=DEFAULTS["n_embd"], help="hidden size")
    m.add_argument("--block-size", "--seq-length", type=positive_int, default=DEFAULTS["block_size"], help="context length in tokens")
    m.add_argument("--vocab-size", type=positive_int, help="tokens in the vocabulary (default: 256 bytes, or --tokenizer's)")
    m.add_argument("--dropout", type=non_negative_float, default=0.0, help="dropout probability")
    e = p.add_argument_group("mixture of experts (Megatron-core's flags)")
    e.add_argument("--num-experts", type=positive_int, help="experts in each MoE layer (default: dense MLPs)")
    e.add_argument("--moe-router-topk", type=positive_int, default=ROUTER_DEFAULTS["moe_router_topk"],
                   help="experts each token is routed to")
    e.add_argument("--moe-router-pre-softmax", action="store_true", help="weigh each chosen expert by its softmax probability over all experts, not renormalised over the top-k (the default for top-k > 1)")
    e.add_argument("--moe-layer-freq", type=positive_int, default=ROUTER_DEFAULTS["moe_layer_freq"],
                   help="every N-th block (from the first) has experts")
    e.add_argument("--moe-expert-capacity-factor", type=float, help="token-slots an expert takes: factor x tokens x topk / experts, the most probable ones (default: dropless)")
    e.add_argument("--moe-aux-loss-coeff", type=non_negative_float, default=ROUTER_DEFAULTS["moe_aux_loss_coeff"],
                   help="weight of the load-balancing loss (Switch/GShard)")
    e.add_argument("--moe-z-loss-coeff", type=non_negative_float, default=ROUTER_DEFAULTS["moe_z_loss_coeff"],
                   help="weight of the router z-loss (ST-MoE)")
    g = p.add_argument_group("parallelism (DP = ranks / (TP x CP x PP))")
    g.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=positive_int, default=1, help="tensor-parallel size")
    g.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=positive_int, default=1, help="pipeline stages")
    g.add_argument("--context-parallel-size", "--cp", dest="cp", type=positive_int, default=1, help="context-parallel size: ranks that split every sequence (2 x CP chunks, load-balanced)")
    g.add_argument("--cp-comm-type", choices=("p2p", "a2a"), default="p2p", help="how context-parallel ranks attend across the sequence: p2p (ring attention) or a2a (Ulysses: whole heads per rank)")
    g.add_argument("--dp", type=positive_int, help="data-parallel size, checked against the number of ranks (default: the ranks / (TP x CP x PP))")
    g.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=positive_int, default=1, help="expert-parallel size: DP x CP ranks that split the experts (a divisor of DP x CP, CP ranks first)")
    g.add_argument("--pipeline-layers", type=layer_counts, help="layers of each pipeline chunk in order, e.g. 3,1 "
                   "(an uneven split for stages of unequal speed: python -m minipar.plan --node-speeds), or "
                   "'balanced': fewer layers where the output head runs, as many fewer as its training FLOPs are "
                   "worth in blocks; "
                   "default: --n-layer / (--pp x --vpp) each")
    g.add_argument("--num-virtual-stages", "--virtual-pipeline-model-parallel-size", "--vpp", dest="vpp", type=positive_int, default=1, help="model chunks per pipeline rank (interleaved schedule; 2 for zb-v)")
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (1f1b-slack: 1F1B with one more forward in flight, which absorbs uneven instruction times; zb-h1, zb-h2, zb-v: zero bubble, the backward split into B and W; zb-v places --num-virtual-stages 2 in a V; pipedream-2bw: no flush, weights stashed, the update one step delayed)")
    g.add_argument("--defer-embedding-wgrad-compute", dest="defer_embedding_wgrad", action="store_true", help="run the output head's weight gradients at the pipeline's flush, off the last stage's critical path (gpipe, 1f1b, 1f1b-slack, interleaved; PP > 1)")
    g.add_argument("--defer-wgrad-linears", type=linear_count, default=0, metavar="K", help="with --defer-embedding-wgrad-compute, also run the weight gradients of the last stage's last K linear layers (its last block's MLP output projection first) at the flush: balances a last stage the head makes slower (dense blocks); 'balanced': the K whose schedule, replayed with each chunk costing its FLOPs, idles least")
    g.add_argument("--micro-batch-size", type=positive_int, help="sequences per micro-batch per DP rank (default: the global batch / DP / PP)")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage of the data-parallel optimizer")
    g.add_argument("--sequence-parallel", action="store_true", help="split LayerNorm and dropout along the sequence (TP > 1)")
    g.add_argument("--recompute", "--recompute-activations", dest="recompute", action="store_true", help="keep only each block's input; recompute it in backward")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), help="full: as --recompute; selective: keep all but attention's T x T probabilities and dropout mask, which backward recomputes (default: neither, unless --recompute)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--max-iters", "--train-iters", dest="max_iters", type=non_negative_int, default=DEFAULTS["max_iters"], help="training steps in total (0: only evaluate, sample and export the weights given)")
    o.add_argument("--global-batch-size", "--batch-size", dest="batch_size", type=positive_int, default=DEFAULTS["batch_size"], help="sequences per step")
    o.add_argument("--lr", type=non_negative_float, default=DEFAULTS["lr"], help="peak learning rate")
    o.add_argument("--min-lr", type=non_negative_float, default=DEFAULTS["min_lr"], help="final learning rate of the cosine decay")
    o.add_argument("--warmup-iters", "--lr-warmup-iters", dest="warmup_iters", type=int, default=DEFAULTS["warmup_iters"], help="linear warm-up steps")
    o.add_argument("--lr-decay-iters", type=positive_int, help="steps of the cosine decay, after which the rate stays at --min-lr (default: --max-iters)")
    o.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler", action="store_true",
                   help="--load: take the learning-rate schedule (and weight decay) the checkpoint was trained on, whatever these flags say")
    o.add_argument("--override-opt_param-scheduler", "--override-lr-scheduler", action="store_true",
                   help="--load: follow these flags' schedule from the resume step on, not the checkpoint's (by default they must match)")
    o.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="AdamW decoupled weight decay (matrices only)")
    o.add_argument("--grad-clip", "--clip-grad", dest="grad_clip", type=non_negative_float, default=1.0, help="max global gradient norm (0: off)")
    o.add_argument("--seed", type=int, default=1337, help="seed of the weights, the batches and dropout")
    o.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="floating dtype of the whole run")
    o.add_argument("--device", type=backend.device_flag, choices=backend.DEVICES, default=backend.device_from_environment(),
                   help="where the arrays live: cuda runs every op on CuPy arrays, matrix products with "
                        "minipar's own kernel, collectives on NCCL; rank r uses GPU r %% GPUs of its node")
    x = p.add_argument_group("mixed precision (Megatron's flags): 16-bit weights, activations and gradients; fp32 master weights")
    x.add_argument("--bf16", action="store_true", help="train in bfloat16 (float32's range: no loss scale)")
    x.add_argument("--fp16", action="store_true", help="train in float16, with a dynamic loss scale")
    x.add_argument("--loss-scale", type=positive_float, help="fp16: a constant loss scale instead of the dynamic one")
    x.add_argument("--initial-loss-scale", type=positive_float, help="fp16: the dynamic scale's start (default 2^32)")
    x.add_argument("--min-loss-scale", type=positive_float, help="fp16: the dynamic scale's floor (default 1)")
    x.add_argument("--loss-scale-window", type=positive_int, help="fp16: clean steps before the scale doubles (default 1000)")
    x.add_argument("--hysteresis", type=positive_int, help="fp16: overflows tolerated before the scale halves (default 2)")
    x.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", help="keep and sum gradients over DP in fp32")
    d = p.add_argument_group("data, output and checkpoints")
    d.add_argument("--data", metavar="PATH", help="text file or directory (default: the Python standard library)")
    d.add_argument("--eval-interval", type=positive_int, default=100, help="steps between validation estimates")
    d.add_argument("--eval-iters", type=positive_int, default=10, help="batches per validation estimate")
    d.add_argument("--log-interval", type=positive_int, default=20, help="steps between progress lines")
    d.add_argument("--log-json", metavar="FILE", help="write one JSON object per step (iter, loss, lr, ms, ...)")
    d.add_argument("--tokenizer", metavar="DIR", help="GPT-2's byte-level BPE from DIR (tokenizer.json, or vocab.json and merges.txt; "
                   "needs the tokenizers package); 'bytes' is the default")
    d.add_argument("--init-weights", metavar="PATH", help="start from these weights: a .safetensors file with GPT-2 names "
                   "(minipar's or Hugging Face's layout), or a Hugging Face snapshot directory, whose config.json sets the model flags")
    d.add_argument("--export-hf", metavar="DIR", help="save the final weights as a Hugging Face GPT-2 snapshot (config.json, model.safetensors)")
    d.add_argument("--export-weights", metavar="FILE", help="save the final weights (.safetensors, GPT-2 names)")
    d.add_argument("--save", metavar="DIR", help="write sharded checkpoints here (every --save-interval steps and at the end)")
    d.add_argument("--save-interval", type=positive_int, help="steps between checkpoints (default 100)")
    d.add_argument("--keep-checkpoints", metavar="N", type=positive_int, help="keep only the N newest checkpoints in --save (default: all)")
    d.add_argument("--overwrite-checkpoints", action="store_true", help="let this run write into a --save directory that holds checkpoints it does not continue")
    d.add_argument("--load", metavar="DIR", help="continue from the latest checkpoint in DIR (or a checkpoint directory)")
    d.add_argument("--exit-interval", type=positive_int, help="stop when the iterations done are a multiple of this (as Megatron-LM: a planned interruption; needs --save, resume with --load)")
    d.add_argument("--distributed-timeout-minutes", type=non_negative_float, default=10.0,
                   help="end a job of several ranks when a training step, an evaluation or a checkpoint save takes "
                   "longer, each waiting rank printing where it waits: a hang ends instead of spinning forever "
                   "(Megatron-LM's name, there a limit per collective; 0: never)")
    d.add_argument("--report", action="store_true", help="print every rank's memory and bytes sent per step at the end")
    d.add_argument("--plot", metavar="FILE", default="out/loss.png", help="loss-curve picture ('' for none)")
    d.add_argument("--sample", type=int, default=200, help="tokens to generate after training (0: none)")
    d.add_argument("--prompt", default=PROMPT, help="the text the sample continues")
    return p
