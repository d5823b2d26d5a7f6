"""A pipelined GPT against the single-device GPT (float64, dropout on): the loss, every gradient
the rank holds (the tied embedding's on the first and the last stage), the gradient norm and the
parameters after two clipped AdamW steps, and the evaluation loss, for one schedule; the most
activations the executor held, against the simulator's count for the same schedule; and that the
tied embedding's two copies start equal on ranks seeded differently.

    run_mpi.sh -n 4 tests/mpi/pipeline.py --pp 4 --schedule interleaved --v 2 --m 4 [--recompute]
    run_mpi.sh -n 2 tests/mpi/pipeline.py --pp 2 --layers 3,1        # an uneven split of the layers

``--plant-bug`` (zero-bubble schedules) skips W, the weights' gradients, of micro-batch 1 (with
``--defer-embedding-wgrad``, the head's W): the gradients must then be found wrong.
``--defer-embedding-wgrad``: the head's weight gradients at the flush; none reaches the head before
its first W, and the parked bytes are each micro-batch's head input and logits' gradient.
``--defer-wgrad-linears K`` (with it): the last K linear layers' too, each parking its input and
output gradient.
"""

import argparse
import sys

import numpy as np

import minipar
from minipar.autograd import no_grad
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.optim import AdamW, clip_grad_norm
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.pipeline.simulate import simulate
from minipar.parallel.tensor import local_shard, padded_vocab
from minipar.verify import rel_err

p = argparse.ArgumentParser()
p.add_argument("--pp", type=int, required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--schedule", default="1f1b")
p.add_argument("--v", type=int, default=1)
p.add_argument("--m", type=int, default=4)
p.add_argument("--recompute", action="store_true")
p.add_argument("--sequence-parallel", action="store_true")
p.add_argument("--zero-stage", type=int, default=0)
p.add_argument("--plant-bug", action="store_true")
p.add_argument("--defer-embedding-wgrad", action="store_true")
p.add_argument("--defer-wgrad-linears", type=int, default=0)
p.add_argument("--experts", type=int, default=0, help="a mixture of experts (dropless, top-2) in every "
               "--moe-layer-freq-th block from the first")
p.add_argument("--moe-layer-freq", type=int, default=1)
p.add_argument("--bucket-bytes", type=int, default=4 << 20, help="DP's gradient buckets (1: one per parameter, "
               "each sum started by its own gradient's hook)")
p.add_argument("--layers", help="layers of each pipeline chunk, e.g. 3,1 (an uneven split); default 2 each")
args = p.parse_args()
layers = tuple(int(n) for n in args.layers.split(",")) if args.layers else None

minipar.set_default_dtype("float64")
grid = ProcessGrid(tp=args.tp, pp=args.pp)
config = GPTConfig(n_layer=sum(layers) if layers else 2 * args.pp * args.v, n_head=4, n_embd=32, block_size=16, vocab_size=64,
                   dropout=0.1, num_experts=args.experts, moe_layer_freq=args.moe_layer_freq)
minipar.manual_seed(3)
serial = GPT(config)
minipar.manual_seed(3)
hyper = dict(lr=1e-2, weight_decay=0.1)
try:
    model = GPT(config, grid, sequence_parallel=args.sequence_parallel, virtual_stages=args.v,
                pipeline_shape=schedules.shape_of(args.schedule), layers_per_stage=layers)
    opt = make_optimizer(model, grid, args.zero_stage, args.bucket_bytes, **hyper)  # the step protocol: data parallelism + AdamW
    run = PipelineExecutor(model, grid, args.schedule, args.m, optimizer=opt, recompute=args.recompute,
                           defer_embedding_wgrad=args.defer_embedding_wgrad,
                           defer_wgrad_linears=args.defer_wgrad_linears)
except ValueError as e:  # bad sizes: every rank must refuse, before any message (then all meet here)
    print(f"rank {world().rank} refused: {e}", flush=True)
    world().barrier()
    sys.exit(3)
deferred = args.defer_embedding_wgrad
if args.plant_bug:  # W (or the head's W) of micro-batch 1 dropped: its gradients never reach .grad
    op = schedules.HEAD_WEIGHT if deferred else schedules.BACKWARD_WEIGHT
    parked = "head_grads" if deferred else "weight_grads"

    def skip_w(state, ins, keep=run._handlers[op]):
        getattr(state, parked).pop((ins.mb, ins.chunk)) if ins.mb == 1 else keep(state, ins)
    run._handlers[op] = skip_w
if deferred:  # the head's weight (and the deferred linears') gets no gradient from a backward, only from W
    assert len(run.deferred) == (1 + args.defer_wgrad_linears) * bool(run.last_head), run.deferred

    def backward_leaves_the_head(state, ins, keep=run._handlers[schedules.BACKWARD]):
        keep(state, ins)
        for w in run.deferred if ins.chunk in run.last_head else ():  # (a middle stage's hold none)
            assert w.grad is None or not w.grad.any(), f"rank {rank}: {ins} reached a deferred weight"
    run._handlers[schedules.BACKWARD] = backward_leaves_the_head
opt_s = AdamW(serial.parameters(), **hyper)
rank = world().rank
batch = 2 * args.m * grid.dp
data = np.random.default_rng(0)
mine = dict(model.named_parameters())
worst = {"gradient": 0.0, "parameter": 0.0}  # the largest relative errors against one device
MAX_NORM = 0.05  # below the gradient norm: clipping is active


def shard(name, value):
    """This TP rank's part of a serial parameter (the model may hold a shard of it)."""
    return local_shard(mine[name], value, grid)


for step in range(2):
    x = data.integers(0, config.vocab_size, (batch, config.block_size))
    y = data.integers(0, config.vocab_size, (batch, config.block_size))
    y[0, :3] = -1  # ignored targets: micro-batches count different numbers of tokens
    _, loss_s = serial(x, y)
    loss_s.backward()
    grads = {n: p.grad.copy() for n, p in serial.named_parameters() if n in mine}
    norm_s = clip_grad_norm(serial.parameters(), MAX_NORM)

    def check_grads_then_step():
        opt.finish_gradients()  # the DP all-reduce (ZeRO-1: reduce-scatter), then model.finalize_grads()
        full = opt.full_gradients() if args.zero_stage else None  # ZeRO-1 sums only this rank's piece
        for n, g in grads.items():
            got = mine[n].grad if full is None else full[id(mine[n])].reshape(opt.shape_of(mine[n]))
            err = rel_err(got, shard(n, g))
            worst["gradient"] = max(worst["gradient"], err)
            assert err < 1e-10, f"rank {rank} step {step}: gradient of {n} off by {err:.1e}"
        try:
            model.finalize_grads()
            raise AssertionError("a second finalize_grads() was not refused")
        except RuntimeError as e:
            assert "already called" in str(e), e
        norm = opt.clip_grad_norm(MAX_NORM)
        assert abs(norm / norm_s - 1) < 1e-12 and norm > MAX_NORM, f"rank {rank}: norm {norm} vs {norm_s}"
        opt.step()

    record = trained = run.step(x, y, optimizer_step=check_grads_then_step)
    if record.loss is not None:  # the rank holding the last chunk (rank 0 in a V)
        loss = grid.dp_group.all_reduce(np.array([record.loss]))[0] if grid.dp > 1 else record.loss
        assert rel_err(loss, loss_s.item()) < 1e-12, f"rank {rank}: loss {loss} vs {loss_s.item()}"
    opt_s.step()
    opt_s.zero_grad()
    opt.zero_grad()

serial.eval()
model.eval()
x = data.integers(0, config.vocab_size, (batch, config.block_size))
with no_grad():
    loss_s = serial(x, x)[1].item()
record = run.evaluate(x, x)
# forwards only: a micro-batch's activations go once sent on, or, on the last chunk, once its loss is added
assert record.peak_alive == 1, f"rank {rank}: an evaluation held {record.peak_alive} micro-batches' activations"
if record.loss is not None:  # the rank holding the last chunk (rank 0 in a V)
    loss = grid.dp_group.all_reduce(np.array([record.loss]))[0] if grid.dp > 1 else record.loss
    assert rel_err(loss, loss_s) < 1e-12, f"rank {rank}: evaluation loss {loss} vs {loss_s}"

reference = serial.state_dict()
held = opt.full_state_dict() if args.zero_stage == 3 else {n: p.data for n, p in mine.items()}  # ZeRO-3: gathered
for n, p in mine.items():
    err = rel_err(held[n], shard(n, reference[n]))
    worst["parameter"] = max(worst["parameter"], err)
    assert err < 1e-10, f"rank {rank}: parameter {n} off by {err:.1e} after 2 steps"
plans = schedules.build(args.schedule, grid.pp, args.m, args.v, deferred)
held = simulate(plans, args.m, args.v, weight=1, shape=schedules.shape_of(args.schedule)).peak_alive[grid.pp_rank]
assert trained.peak_alive == held, f"rank {rank}: held {trained.peak_alive} activations, the simulator {held}"
if deferred:  # the last chunk's rank parks every micro-batch's head input (whole under SP) and logits' gradient
    rows = batch // args.m // grid.dp
    vocab = padded_vocab(config.vocab_size, args.tp) // args.tp  # the head's rows here (ZeRO-3 released them)
    h, t = config.n_embd, args.tp  # each deferred linear's input and output gradient, from the MLP's c_proj back
    linears = sum([4 * h // t + h, h + 4 * h // t, h // t + h, h + 3 * h // t][i % 4] for i in range(args.defer_wgrad_linears))
    head = args.m * rows * config.block_size * (config.n_embd + vocab + linears) * 8 if run.last_head else 0
    assert trained.peak_weight_bytes == head, f"rank {rank}: {trained.peak_weight_bytes}, not {head}"
else:
    assert (trained.peak_weight_bytes > 0) == args.schedule.startswith("zb-"), trained.peak_weight_bytes

# The tied embedding's copies start equal even on ranks seeded differently: the first stage's copy
# is broadcast to the last (as Megatron-LM), not left to the seeds agreeing
minipar.manual_seed(100 + rank)
other = GPT(config, grid, virtual_stages=args.v, pipeline_shape=schedules.shape_of(args.schedule), layers_per_stage=layers)
if other.embedding_group is not None and other.embedding_group.size > 1:
    copy = dict(other.named_parameters())["transformer.wte.weight"].data
    first = copy.copy()
    other.embedding_group.broadcast(first, root=0)
    assert np.array_equal(first, copy), f"rank {rank}: the tied embedding's copies differ when seeded differently"

layers = sorted(int(n.split(".")[2]) for n in mine if n.startswith("transformer.h."))
print(f"rank {rank}: pipeline {args.schedule} OK (layers {sorted(set(layers))}, peak alive {trained.peak_alive}, "
      f"W held {trained.peak_weight_bytes} bytes, max error gradient {worst['gradient']:.1e} "
      f"parameter {worst['parameter']:.1e})")
