"""The expert-parallel MoE MLP against the single-device MoE MLP on every rank's tokens (float64).

The EP group is the world: rank r holds experts r E/N ... (r+1) E/N - 1 and its own T tokens.
"The same as one device" means: one device holding all N T tokens (rank 0's first, in rank order)
and all E experts. Then each rank's outputs and input gradients are the reference's rows of its
tokens; the router, a dense parameter every rank holds, gets the reference's gradient once the
ranks' gradients are summed (what data parallelism's all-reduce does); an expert's gradient is the
sum over every token routed to it, which its one holder already has (the expert-data-parallel
group is a single rank here), so it equals the reference's with no sum.

With a capacity factor each rank drops slots among its own T tokens; the reference routes the same
groups: ``RoutingGroups(rows=B)`` gives each block of B rows (one rank's) its own capacity ceil(c B T k / E).

Bytes: all-to-all-v per rank over forward and backward = 2 (rows out + rows in) h 8, with rows out
the rank's kept slots routed to other ranks' experts and rows in the slots other ranks route to
its experts (from the single-device layer run on each rank's block); plus one all-to-all of the
counts forward, E 8 bytes, charged (N-1)/N of it.

    --plant-bug   combine skips undoing the sort by local expert (the wrong permutation): must fail
"""

import sys
from types import SimpleNamespace

import numpy as np

import minipar
from minipar import Tensor
from minipar.autograd import no_grad
from minipar.comm import world
from minipar.models.moe import MoEMLP, RoutingGroups
from minipar.parallel import experts as ep_module
from minipar.verify import rel_err

if "--plant-bug" in sys.argv:
    ep_module.inverse = lambda order: np.arange(len(order))

minipar.set_default_dtype("float64")
comm = world()
N, r = comm.size, comm.rank
if N < 2:
    sys.exit("experts.py needs 2 or more ranks: one rank holds every expert and starves none")
H, E, K, B, T = 8, 2 * N, 2, 2, 5  # each rank: B x T tokens
CONFIG = SimpleNamespace(n_embd=H, bias=True, n_layer=2)
TOL = 1e-10
failures = []


def check(what, error, tol=TOL):
    if not error <= tol:
        failures.append(f"rank {r}: {what}: MISMATCH, relative error {error:.2e}")
    return error


def inputs(seed, starve):
    """Every rank's tokens and upstream gradients, (N, B, T, H). ``starve``: feature 0 is a
    constant 5 and the router weight gives the last rank's experts -10 on it, so they get no token
    and the last rank receives nothing."""
    rng = np.random.default_rng(seed)
    x, g = rng.standard_normal((N, B, T, H)), rng.standard_normal((N, B, T, H))
    if starve:
        x[..., 0] = 5.0
    return x, g


def case(name, seed, capacity_factor=None, starve=False):
    minipar.manual_seed(1)
    ref = MoEMLP(CONFIG, E, K, capacity_factor, routing=RoutingGroups(rows=B))
    minipar.manual_seed(1)
    ep = MoEMLP(CONFIG, E, K, capacity_factor, ep=comm)
    state = ref.state_dict()
    for pname, p in ep.named_parameters():  # initialised as one device: same values, same names
        check(f"{name}: initial {pname}", rel_err(p.data, state[pname]), 0)
    if starve:
        for model in (ref, ep):
            model.router.weight.data[:, 0] = 0.0
            model.router.weight.data[-(E // N):, 0] = -10.0
    x_all, g_all = inputs(seed, starve)

    x_ref = Tensor(x_all.reshape(N * B, T, H), requires_grad=True)  # the union: rank 0's rows first
    y_ref = ref(x_ref)
    y_ref.backward(g_all.reshape(N * B, T, H))
    per_rank = []  # each rank's block alone on one device (one capacity group): its slots per expert
    ref.routing = None
    with no_grad():
        for s in range(N):
            ref(Tensor(x_all[s]))
            per_rank.append(ref.tokens_per_expert.copy())
    per_rank = np.array(per_rank)  # (N, E)

    comm.stats.reset()
    x = Tensor(x_all[r], requires_grad=True)
    y = ep(x)
    y.backward(g_all[r])
    mine = ep_module.local_experts(E, comm)
    errors = [check(f"{name}: output", rel_err(y, y_ref.data.reshape(N, B, T, H)[r])),
              check(f"{name}: input gradient", rel_err(x.grad, x_ref.grad.reshape(N, B, T, H)[r])),
              check(f"{name}: router gradient summed over ranks",
                    rel_err(comm.all_reduce(ep.router.weight.grad.copy()), ref.router.weight.grad))]
    ref_grads = dict(ref.named_parameters())
    for pname, p in ep.named_parameters():
        if pname.startswith("experts."):
            errors.append(check(f"{name}: {pname} gradient", rel_err(p.grad, ref_grads[pname].grad)))
    check(f"{name}: tokens per expert", float(np.abs(ep.tokens_per_expert - per_rank[r]).max()), 0)

    out = per_rank[r].sum() - per_rank[r][mine].sum()  # rows this rank sends to other ranks
    into = per_rank[:, mine].sum() - per_rank[r][mine].sum()  # rows the others send to it
    stats = comm.stats.by_op
    expected = 2 * (out + into) * H * 8
    sent, received = stats["all_to_all_v"].bytes_sent, stats["all_to_all_v"].bytes_received
    check(f"{name}: all-to-all-v bytes sent {sent} vs formula {expected}", abs(sent - expected), 0)
    check(f"{name}: all-to-all-v bytes received {received} vs formula {expected}", abs(received - expected), 0)
    check(f"{name}: count exchange bytes", abs(stats["all_to_all"].bytes_sent - (N - 1) * E * 8 // N), 0)
    if starve and r == N - 1:
        check(f"{name}: the last rank receives no rows", float(into + per_rank[r][mine].sum()), 0)
    worst = comm.all_reduce(np.array([max(errors)]), op="max")[0]
    if r == 0:
        dropped = per_rank.sum() - N * B * T * K
        print(f"{name:<28} worst relative error {worst:.1e}   slots kept per rank {per_rank.sum(1).tolist()} "
              f"({-dropped} dropped)   rank 0 sent {sent} B (formula {expected})")


def exchange():
    """all_to_all_v alone: rank s sends (s + d) % 3 rows to rank d (so some runs are empty), and
    the backward sends the gradient rows back where they came from. Every run's rows, and the
    upstream gradient of every run received, are random, drawn from a generator seeded by (sender,
    receiver), so each rank knows the runs the others send and get: rows mixed up within a run fail."""
    send = [(r + d) % 3 for d in range(N)]
    recv = [(s + r) % 3 for s in range(N)]

    def run(what, s, d):  # the rows s sends d (what 0), or their upstream gradient on d (what 1)
        return np.random.default_rng([what, s, d]).standard_normal(((s + d) % 3, 2))

    rows = np.concatenate([run(0, r, d) for d in range(N)])
    x = Tensor(rows, requires_grad=True)
    y = ep_module.all_to_all_v(x, comm, send, recv)
    check("all_to_all_v rows", rel_err(y, np.concatenate([run(0, s, r) for s in range(N)])))
    y.backward(np.concatenate([run(1, s, r) for s in range(N)]))
    check("all_to_all_v backward", rel_err(x.grad, np.concatenate([run(1, r, d) for d in range(N)])))


exchange()
case("dropless", 0)
case("dropless, starved experts", 1, starve=True)
case("capacity factor 1.0", 2, capacity_factor=1.0)
case("capacity 0.5, starved", 3, capacity_factor=0.5, starve=True)
failed = comm.all_reduce(np.array([len(failures)]))[0]
for line in failures:
    print(line, flush=True)
comm.barrier()
if r == 0:
    print(f"experts FAILED on {N} ranks" if failed else f"experts OK on {N} ranks", flush=True)
sys.exit(1 if failed else 0)
