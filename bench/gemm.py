"""GFLOP/s of minipar's GEMM kernel against cuBLAS (and the naive kernel), side by side.

    python bench/gemm.py                          # square 1024 .. 8192 and a GPT's own products
    python bench/gemm.py --sizes 2048 --markdown out.md

Each product is timed with CUDA events around ``--repeats`` launches after ``--warmup`` untimed
ones; the table shows the median of ``--trials`` such timings. cuBLAS is ``cupy.matmul``: it
appears here, and in the tests, only as the baseline. The GPT's products are taken as the engine
issues them: the backward products read a transposed operand in place.
"""

import argparse
import os
import statistics
import sys


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--naive-up-to", type=int, default=4096, help="largest square size to time the naive kernel at")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--markdown", help="also write the table to this file")
    return p.parse_args()


def gpt_products(xp, dtype, tokens=8192, C=768, T=1024, heads=12, vocab=50304):
    """(name, a, b) for the products of one GPT-2-small layer and its head, batch 8 x 1024."""
    rand = lambda *shape: xp.random.standard_normal(shape, dtype=dtype)  # noqa: E731
    x, g = rand(tokens, C), rand(tokens, 4 * C)
    w_fc = rand(4 * C, C)
    q = rand(tokens // T * heads, T, C // heads)
    return [
        ("fc forward    x W^T", x, w_fc.T),
        ("fc backward   g W", g, w_fc),
        ("fc backward   g^T x", g.T, x),
        ("attention     q k^T", q, q.transpose(0, 2, 1)),
        ("head forward  x E^T", x, rand(vocab, C).T),
    ]


def time_ms(cupy, fn, args):
    for _ in range(args.warmup):
        fn()
    trials = []
    for _ in range(args.trials):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(args.repeats):
            fn()
        stop.record()
        stop.synchronize()
        trials.append(cupy.cuda.get_elapsed_time(start, stop) / args.repeats)
    return statistics.median(trials)


def flops(a, b):
    batch = a.size // (a.shape[-2] * a.shape[-1])
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def main():
    args = parse_args()
    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, or CUDA's error without a driver
        print(f"bench/gemm.py needs CuPy and a GPU ({exc.__class__.__name__}: {exc}); nothing timed")
        return 2
    if gpus == 0:
        print("bench/gemm.py needs a GPU: CuPy sees none; nothing timed")
        return 2
    from minipar.backend import gpu_name
    from minipar.kernels import gemm

    name = gpu_name(0)
    cases = [(f"square {n}", cupy.random.standard_normal((n, n), dtype=args.dtype),
              cupy.random.standard_normal((n, n), dtype=args.dtype)) for n in args.sizes]
    cases += gpt_products(cupy, args.dtype)
    rows = []
    for label, a, b in cases:
        ours = gemm.matmul(a, b)
        reference = cupy.matmul(a, b)
        error = float(cupy.abs(ours - reference).max() / cupy.abs(reference).max())
        out = cupy.empty_like(ours)
        t_ours = time_ms(cupy, lambda: gemm.matmul(a, b, out=out), args)
        t_blas = time_ms(cupy, lambda: cupy.matmul(a, b, out=out), args)
        naive = label.startswith("square") and a.shape[0] <= args.naive_up_to
        t_naive = time_ms(cupy, lambda: gemm.matmul(a, b, out=out, naive=True), args) if naive else None
        gf = lambda ms: flops(a, b) / ms / 1e6  # noqa: E731  (GFLOP/s from milliseconds)
        rows.append((label, gf(t_ours), gf(t_blas), gf(t_naive) if naive else None, t_ours, error))
        print(f"  {label:<22} ours {gf(t_ours):>9,.0f}  cuBLAS {gf(t_blas):>9,.0f} GFLOP/s  "
              f"ratio {t_blas / t_ours:5.2f}", flush=True)

    tf32 = os.environ.get("CUPY_TF32", "0")  # CuPy's default is 0: cuBLAS computes in full FP32, as ours does
    lines = [f"GEMM on {name}, {args.dtype}, median of {args.trials} x {args.repeats} launches (CUDA events), "
             f"CUPY_TF32={tf32}{' (cuBLAS rounds inputs to TF32: not a like-for-like baseline)' if tf32 != '0' else ''}",
             "", "| product | ours GFLOP/s | cuBLAS GFLOP/s | ours / cuBLAS | naive GFLOP/s | ours ms | max rel. diff |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, ours, blas, naive, ms, error in rows:
        naive_cell = f"{naive:,.0f}" if naive is not None else "-"
        lines.append(f"| {label} | {ours:,.0f} | {blas:,.0f} | {ours / blas:.2f} | {naive_cell} | {ms:.3f} | {error:.1e} |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
