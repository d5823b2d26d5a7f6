"""Time one training step (forward + backward + AdamW) of the GPT, against PyTorch if installed.

    python bench/step_time.py                 # n_layer=4 n_head=4 n_embd=256 T=128 batch 8
    python bench/step_time.py --threads 2

Both frameworks run the same model from the same weights at the same thread count; the first loss
of each is printed so you can see they compute the same thing. PyTorch runs twice: "pytorch" with
attention written out as minipar's is (scores, mask, softmax, product: each its own kernel), and
"pytorch-sdpa" with ``scaled_dot_product_attention(is_causal=True)``, one fused kernel (flash
attention on the CPU too), as nanoGPT calls it. Steps alternate between the two in
rounds, so a slow spell of a shared machine hits both. PyTorch is optional
(``pip install torch==2.13.0``, a CPU wheel); without it only minipar is timed.

Beside each step time stands its matmul floor: the step's matrix products alone (the shapes of
``step_products``, the operands transposed as backward reads them), on random operands, through the
framework's own matmul (NumPy's BLAS for minipar, PyTorch's for PyTorch). No step can be faster;
step / floor says how much a framework adds around its products.

With ``--ops``, --steps more steps of each framework are then timed op by op, to show where the
two differ: minipar's by ``minipar.op_times`` (each op's forward and backward), PyTorch's by its
profiler (each kernel's own time; its products are ``aten::mm`` and ``aten::addmm``).
"""

import argparse
import os
import sys
import time


def parse_args():
    # plain argparse and plain checks: minipar's flag types (bench/flags.py) would import minipar,
    # and NumPy with it, before BLAS's thread count is set below
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--n-layer", 4), ("--n-head", 4), ("--n-embd", 256), ("--block-size", 128),
                          ("--batch-size", 8), ("--vocab-size", 256)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--steps", type=int, default=10, help="timed steps per framework per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="BLAS / intra-op threads for both")
    p.add_argument("--ops", action="store_true", help="then time --steps more steps op by op (below)")
    args = p.parse_args()
    for flag, value in vars(args).items():
        if flag != "ops" and value < 1:
            p.error(f"argument --{flag.replace('_', '-')}: must be >= 1, got {value}")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    return args


ARGS = parse_args()
# BLAS reads its thread count when it loads, so this must come before NumPy is imported.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import numpy  # noqa: E402

import minipar  # noqa: E402
from minipar.models import GPT, GPTConfig  # noqa: E402
from minipar.optim import AdamW  # noqa: E402

try:
    import torch
except ImportError:
    torch = None


def step_products(cfg, batch):
    """The matrix products of one step as (m, k, n, a transposed, b transposed, count): a is m x k,
    b is k x n, "transposed" when backward reads it as the transpose of a stored array, count the
    independent products of that shape (a batch). Linear layers (N rows, W stored out x in):
    y = x W^T, dx = g W, dW = g^T x. Attention per sequence and head (T x D): S = q k^T, y = P v;
    backward dP = dy v^T, dv = P^T dy, dq = dS k, dk = dS^T q (``step_flops`` counts them)."""
    C, T, L, V = cfg.n_embd, cfg.block_size, cfg.n_layer, cfg.vocab_size
    N, D, heads = batch * T, C // cfg.n_head, batch * cfg.n_head

    def linear(n_in, n_out):
        return [(N, n_in, n_out, False, True, 1), (N, n_out, n_in, False, False, 1),
                (n_out, N, n_in, True, False, 1)]

    layer = linear(C, 3 * C) + linear(C, C) + linear(C, 4 * C) + linear(4 * C, C)
    layer += [(T, D, T, False, True, heads), (T, T, D, False, False, heads),
              (T, D, T, False, True, heads), (T, T, D, True, False, heads),
              (T, T, D, False, False, heads), (T, T, D, True, False, heads)]
    return layer * L + linear(C, V)


def step_flops(products):
    """Matmul FLOPs of one step, 2mnk per product: per token and layer, forward, qkv 6C^2, attention
    projection 2C^2, MLP 16C^2, q k^T and P v 2TC each; the tied head 2CV; backward twice that."""
    return sum(2 * m * k * n * count for m, k, n, _, _, count in products)


def matmul_floor(products, matmul, rand, transpose):
    """A step of nothing but ``products`` with ``matmul`` on operands from ``rand(shape)``."""
    def operand(batch, rows, cols, transposed):
        shape = ((batch,) if batch > 1 else ()) + ((cols, rows) if transposed else (rows, cols))
        return transpose(rand(shape)) if transposed else rand(shape)

    pairs = [(operand(c, m, k, ta), operand(c, k, n, tb)) for m, k, n, ta, tb, c in products]

    def step():
        for a, b in pairs:
            matmul(a, b)

    return step


def minipar_runner(cfg, x, y):
    model = GPT(cfg)
    opt = AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step():
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return model, step


def torch_runner(cfg, state, x, y, fused):
    nn, F = torch.nn, torch.nn.functional
    C, H = cfg.n_embd, cfg.n_head

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, h):
            B, T, _ = h.shape
            q, k, v = self.c_attn(self.ln_1(h)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            if fused:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
                mask = torch.ones(T, T, dtype=torch.bool).triu(1)
                y = att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
            h = h + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
            return h + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab_size, C)
            self.wpe = nn.Embedding(cfg.block_size, C)
            self.h = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, idx, targets):
            h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                h = block(h)
            logits = self.ln_f(h) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    model = TorchGPT()
    rename = {"transformer.": "", "attn.c_attn": "c_attn", "attn.c_proj": "attn_proj",
              "mlp.c_fc": "c_fc", "mlp.c_proj": "mlp_proj"}
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in state.items():
            for old, new in rename.items():
                name = name.replace(old, new)
            params[name].copy_(torch.from_numpy(value))
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95))  # decay as ours: matrices only
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        loss = model(tx, ty)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def timed(step, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def main():
    cfg = GPTConfig(n_layer=ARGS.n_layer, n_head=ARGS.n_head, n_embd=ARGS.n_embd,
                    block_size=ARGS.block_size, vocab_size=ARGS.vocab_size)
    minipar.manual_seed(0)
    rng = numpy.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (ARGS.batch_size, cfg.block_size))
    y = rng.integers(0, cfg.vocab_size, (ARGS.batch_size, cfg.block_size))
    model, ours = minipar_runner(cfg, x, y)
    runners = {"minipar": ours}
    products = step_products(cfg, ARGS.batch_size)
    rng32 = numpy.random.default_rng(1)
    floors = {"minipar": matmul_floor(products, numpy.matmul, lambda s: rng32.standard_normal(s, numpy.float32),
                                      lambda a: a.swapaxes(-1, -2))}
    if torch is not None:
        torch.set_num_threads(ARGS.threads)
        torch_floor = matmul_floor(products, torch.matmul, lambda s: torch.randn(s), lambda a: a.transpose(-1, -2))
        for name, fused in (("pytorch", False), ("pytorch-sdpa", True)):
            runners[name] = torch_runner(cfg, model.state_dict(), x, y, fused)
            floors[name] = torch_floor  # the same products: timed again beside each step
    print(f"config: n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} "
          f"block_size={cfg.block_size} batch={ARGS.batch_size} vocab={cfg.vocab_size}, "
          f"{model.num_parameters():,} parameters, threads={ARGS.threads}")
    first = {name: step() for name, step in runners.items()}  # also the warm-up step
    for name, loss in first.items():
        print(f"first loss {name:>12}: {loss:.6f}")
    for name in runners:
        if abs(first[name] - first["minipar"]) > 1e-5 * abs(first["minipar"]):
            print(f"{name} and minipar disagree on the first loss: the comparison would be meaningless")
            return 1
    for floor in floors.values():
        floor()  # warm-up
    times = {name: [] for name in runners}
    floor_times = {name: [] for name in runners}
    for _ in range(ARGS.rounds):
        for name, step in runners.items():
            times[name] += timed(step, ARGS.steps)
            floor_times[name] += timed(floors[name], ARGS.steps)

    flops = step_flops(products)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    floor = {name: sorted(t)[len(t) // 2] for name, t in floor_times.items()}
    print(f"\n{'framework':<12} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'GFLOP/s':>8} "
          f"{'floor ms':>9} {'step/floor':>10}")
    for name, t in times.items():
        print(f"{name:<12} {1e3 * median[name]:>10.1f} {1e3 * min(t):>8.1f} {1e3 * max(t):>8.1f} "
              f"{flops / median[name] / 1e9:>8.1f} {1e3 * floor[name]:>9.1f} {median[name] / floor[name]:>9.2f}x")
    print(f"matmul FLOPs per step: {flops / 1e9:.2f} G; floor: the step's products alone, medians")
    if torch is None:
        print("PyTorch not installed: pip install torch==2.13.0 to compare")
    for name in runners:
        if name != "minipar":
            print(f"step time minipar / {name}: {median['minipar'] / median[name]:.2f}x")
    if ARGS.ops:
        op_by_op(runners, ARGS.steps)
    return 0


def op_by_op(runners, steps):
    """Each framework's step taken apart, in milliseconds per step."""
    from minipar.op_times import OpTimes

    with OpTimes() as times:
        timed(runners["minipar"], steps)
    print(f"\nminipar, op by op (forward and backward of each op; {steps} steps)\n{times.table(steps)}")
    if torch is None:
        return
    from torch.profiler import ProfilerActivity, profile

    for name in ("pytorch", "pytorch-sdpa"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timed(runners[name], steps)
        kernels = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in kernels)
        print(f"\n{name}, kernel by kernel (its profiler's own time of each; {steps} steps)")
        print(f"{'kernel':<60}{'ms':>9}{'calls':>8}")
        for e in kernels[:12]:
            print(f"{e.key[:59]:<60}{e.self_cpu_time_total / 1e3 / steps:>9.2f}{e.count // steps:>8}")
        rest = total - sum(e.self_cpu_time_total for e in kernels[:12])
        print(f"{'(the rest)':<60}{rest / 1e3 / steps:>9.2f}\n{'(all: the profiler slows the step)':<60}"
              f"{total / 1e3 / steps:>9.2f}")


if __name__ == "__main__":
    sys.exit(main())
