"""Edges of the mixture of experts on a grid, float64, against the single-device MoE GPT.

    run_mpi.sh -n N tests/mpi/moe_edges.py whole              # EP = N
    run_mpi.sh -n N tests/mpi/moe_edges.py layout KEY=VALUE...

``whole``: a rank of an expert-parallel group holds E/EP experts, so ``GPT.full_state_dict()``
(which promises the single-device state dict) and ``load_full_state_dict`` must refuse on every
rank, before any communication, rather than return (or expect) this rank's experts only.

``layout``: one step through the executor against one device routing the same groups
(``RoutingGroups``): every gradient, the balancing and z-losses, the slots per expert and the
dropped slots. Keys: ep tp pp (sizes), nl (layers), freq (moe_layer_freq), M (micro-batches),
cap (capacity factor), ties (1: the router's weight zero, so every logit ties), dup (1: every row
of the batch the same sequence, no dropout, so tokens tie for capacity across rows).
"""

import sys

import numpy as np

import minipar
from minipar.comm import world
from minipar.models import GPT, GPTConfig
from minipar.models.moe import RoutingGroups, step_statistics
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.parallel.pipeline.executor import PipelineExecutor
from minipar.parallel.tensor import local_shard

minipar.set_default_dtype("float64")
comm = world()
mode, opts = sys.argv[1], dict(a.split("=") for a in sys.argv[2:])


def whole():
    config = GPTConfig(n_layer=2, n_head=4, n_embd=16, block_size=16, vocab_size=64, num_experts=2 * comm.size)
    model = GPT(config, ProcessGrid(ep=comm.size))
    state = GPT(config).state_dict()
    for what, call in (("full_state_dict", model.full_state_dict), ("load_full_state_dict",
                                                                      lambda: model.load_full_state_dict(state))):
        try:
            call()
        except RuntimeError as exc:
            assert "expert-parallel" in str(exc) and "gather_full_state" in str(exc), exc
        else:
            raise AssertionError(f"rank {comm.rank}: {what}() on EP={comm.size} gave this rank's experts only")
    comm.barrier()
    if comm.rank == 0:
        print(f"whole-model calls refused on EP={comm.size}", flush=True)


def layout():
    ep, tp, pp, M = (int(opts.get(k, d)) for k, d in (("ep", 1), ("tp", 1), ("pp", 1), ("M", 2)))
    dp, B, T = comm.size // (tp * pp), 8, 16
    ties, dup = opts.get("ties") == "1", opts.get("dup") == "1"
    config = GPTConfig(n_layer=int(opts.get("nl", 2 * pp)), n_head=4, n_embd=16, block_size=T, vocab_size=64,
                       dropout=0.0 if dup else 0.1, num_experts=4, moe_router_topk=2,
                       moe_layer_freq=int(opts.get("freq", 1)), moe_expert_capacity_factor=float(opts["cap"]),
                       moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 64, (B, T)), rng.integers(0, 64, (B, T))
    if dup:
        x, y = np.repeat(x[:1], B, 0), np.repeat(y[:1], B, 0)

    def built(model):
        if ties:
            for name, p in model.named_parameters():
                p.data[...] = 0.0 if ".router." in name else p.data
        model.rng.iteration = 0
        model.moe.reset()
        return model

    minipar.manual_seed(1)
    serial = built(GPT(config, moe_routing=RoutingGroups(rows=B // (M * dp))))
    serial(x, y)[1].backward()
    want, grads = step_statistics(serial), {n: p.grad for n, p in serial.named_parameters()}
    minipar.manual_seed(1)
    grid = ProcessGrid(tp=tp, pp=pp, ep=ep)
    model = built(GPT(config, grid))
    opt = make_optimizer(model, grid, 0, lr=1e-2)
    worst = [0.0]

    def compare():
        opt.finish_gradients()
        for n, p in model.named_parameters():
            ref = local_shard(p, grads[n], grid)
            worst[0] = max(worst[0], float(np.abs(p.grad - ref).max() / max(np.abs(ref).max(), 1e-30)))

    PipelineExecutor(model, grid, "1f1b", micro_batches=M, optimizer=opt).step(x, y, optimizer_step=compare)
    got = step_statistics(model, comm)
    problems = [f"{k}: {got[k]} vs one device's {want[k]}" for k in ("tokens_per_expert", "dropped")
                if not np.array_equal(got[k], want[k])]
    problems += [f"{k}: {got[k]} vs one device's {want[k]}" for k in ("aux_loss", "z_loss")
                 if not abs(got[k] - want[k]) <= 1e-12 * abs(want[k])]
    if not worst[0] <= 1e-12:
        problems.append(f"gradients: relative error {worst[0]:.1e}")
    if not want["dropped"].any():
        problems.append("nothing was dropped: the capacity factor is not exercised")
    bad = comm.all_reduce(np.array([len(problems)]))[0]
    for line in problems:
        print(f"rank {comm.rank}: {line}", flush=True)
    comm.barrier()
    if comm.rank == 0:
        print(f"layout {' '.join(sys.argv[2:])}: " + ("FAILED" if bad else f"OK, dropped {want['dropped'].tolist()}"),
              flush=True)
    return 1 if bad else 0


sys.exit(whole() if mode == "whole" else layout())
