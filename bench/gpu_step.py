"""A GPT training step on the GPU with minipar's GEMM kernel, against the same step with cuBLAS.

    python bench/gpu_step.py                      # n_layer 12, n_embd 768, T 1024, batch 8 (GPT-2 small)
    python bench/gpu_step.py --n-layer 4 --n-embd 256 --block-size 256

For the baseline this script (and only it) swaps the kernel's ``matmul`` for ``cupy.matmul``:
the library itself never falls back to cuBLAS. The two variants alternate in rounds, each
timed with CUDA events, and the first loss of each is printed to show they compute the same thing.
"""

import argparse
import os
import statistics
import sys


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--markdown", help="also write the result to this file")
    return p.parse_args()


def main():
    args = parse_args()
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no GPU")
    except Exception as exc:
        print(f"bench/gpu_step.py needs CuPy and a GPU ({exc.__class__.__name__}: {exc}); nothing timed")
        return 2
    import numpy

    import minipar
    from minipar import backend
    from minipar.kernels import gemm
    from minipar.models import GPT, GPTConfig
    from minipar.optim import AdamW

    backend.use_device("cuda")
    ours = gemm.matmul
    variants = {"minipar kernel": ours, "cuBLAS": lambda a, b, out=None: cupy.matmul(a, b, out=out)}
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                    block_size=args.block_size, vocab_size=256, dropout=0.0)
    rng = numpy.random.default_rng(0)
    x = rng.integers(0, 256, (args.batch_size, args.block_size))
    y = rng.integers(0, 256, (args.batch_size, args.block_size))
    runs = {}
    for name in variants:
        minipar.manual_seed(0)
        model = GPT(cfg)
        runs[name] = (model, AdamW(model.parameters(), lr=1e-4), [], [])

    def step(name):
        model, opt, _, losses = runs[name]
        gemm.matmul = variants[name]
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.data))  # a host read: the step is complete

    for name in variants:  # warm-up: compiles the kernels, fills CuPy's memory pool
        step(name)
    for _ in range(args.rounds):
        for name in variants:
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(args.steps):
                step(name)
            stop.record()
            stop.synchronize()
            runs[name][2].append(cupy.cuda.get_elapsed_time(start, stop) / args.steps)
    gemm.matmul = ours

    device = backend.gpu_name()
    ms = {name: statistics.median(run[2]) for name, run in runs.items()}
    lines = [f"GPT step on {device}: {args.n_layer} layers, hidden {args.n_embd}, T {args.block_size}, "
             f"batch {args.batch_size}, float32 (median of {args.rounds} rounds x {args.steps} steps), "
             f"CUPY_TF32={os.environ.get('CUPY_TF32', '0')}", ""]
    for name, run in runs.items():
        lines.append(f"  {name:<15} {ms[name]:9.1f} ms/step   first loss {run[3][0]:.6f}")
    lines.append(f"  minipar kernel / cuBLAS step time: {ms['minipar kernel'] / ms['cuBLAS']:.2f}")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("```\n" + text + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
