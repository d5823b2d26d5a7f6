"""Lesson 7: the matrix multiply every GPU op of minipar uses, written by us, from naive to tiled.

    python lessons/07_gemm_kernel.py                 # in the CPU emulator: no GPU needed
    python lessons/07_gemm_kernel.py --device cuda   # plus the real kernel against cuBLAS
    python lessons/07_gemm_kernel.py --plant-bug     # a wrong tile index: the checks fail

The kernel is minipar/kernels/gemm.cu (read its header first). Here it runs, unchanged, in the CPU
emulator (minipar/kernels/emulate.cpp: one OS thread per CUDA thread, a real barrier for
__syncthreads()), which records every load from global memory. The lesson shows:
1. one thread's walk over K: which runs of A and B it copies into shared memory, slab by slab;
2. the loads of the naive and the tiled kernel counted, against 2MNK and MNK(1/BN + 1/BM);
3. the tiled kernel's results against float64, for odd shapes and all four transpose cases;
4. why the two barriers are there: without one, threads read tiles that are not ready;
5. bfloat16 and float16 inputs: 16-bit tiles, a float32 accumulator (mixed precision's GEMM), held
   to the error bound of exact float32 accumulation, which a 16-bit accumulator breaks;
6. on a GPU, GFLOP/s against cuBLAS.
Any mismatch exits non-zero.

What to look at: section 2's counts beside their formulas, and section 4, where each barrier taken
out must make the result wrong.

Exercises (predict first, then run the command and read the section named):
1. Predict the tiled kernel's loads for M = N = K = 256 from MNK (1/BN + 1/BM) with BM = BN = 128,
   and the ratio to the naive 2MNK: python lessons/07_gemm_kernel.py (section 2).
2. --plant-bug drops the "* VEC" from a run's place in the slab, so a 16-byte load starts at an
   element that is not a multiple of 4. Predict what the emulator does, as a GPU would:
   python lessons/07_gemm_kernel.py --plant-bug
3. Predict what --device cuda does on a machine without CuPy (one line, exit status 2, or a
   traceback?): python lessons/07_gemm_kernel.py --device cuda; echo $?
"""

import statistics
import textwrap

import numpy as np

import lesson
from minipar.backend import add_device_flag
from minipar.cli import Parser, device_problems
from minipar.kernels import emulator, gemm

TILES = gemm.TILES["float32"]
BM, BN, BK, TM, TN = (TILES[k] for k in ("BM", "BN", "BK", "TM", "TN"))
THREADS = gemm.threads(TILES)
PLANTED = ("const int i = r / RUN_STEPS, k = (r % RUN_STEPS) * VEC;",  # a run's place in the slab
           "const int i = r / RUN_STEPS, k = (r % RUN_STEPS);")


def relative_error(c, ref):
    """The worst element's error relative to the largest; infinite if an element was never written
    (the output starts as NaN) or is not finite."""
    return float(np.abs(c - ref).max() / np.abs(ref).max()) if np.isfinite(c).all() else np.inf


def run_text(operand, i, k, along_k, count):
    """The elements one load instruction read, in op(A) / op(B) coordinates."""
    if operand == 0:  # A: element (m, k)
        where = f"A[{i}, {k}:{k + count}]" if along_k else f"A[{i}:{i + count}, {k}]"
    else:  # B: element (k, n), i = n
        where = f"B[{k}:{k + count}, {i}]" if along_k else f"B[{k}, {i}:{i + count}]"
    return where + (" (one 16-byte load)" if count == 4 else f" ({count} elements)")


def tile_walk(source, thread=17):
    M, N, K = 130, 130, 3 * BK
    a, b = np.ones((M, K), np.float32), np.ones((K, N), np.float32)
    ty, tx = thread // (BN // TN), thread % (BN // TN)
    print(f"1. One thread's walk: C = A B with M = N = {M}, K = {K};\n   blocks of {THREADS} threads own "
          f"{BM} x {BN} tiles of C")  # (the heading first: a kernel the emulator stops is reported under it)
    print(f"   block (0, 0), thread {thread} accumulates C[{ty * TM}:{ty * TM + TM}, {tx * TN}:{tx * TN + TN}] "
          f"in {TM * TN} registers")
    emulator.watch("float32", thread, source)
    emulator.matmul(a, b, source=source)
    rows, _ = emulator.trace("float32", source)
    for slab in range(K // BK):
        loads = [run_text(*r) for r in rows[2 * slab : 2 * slab + 2]]
        print(f"   slab k = {slab * BK}..{slab * BK + BK - 1}: copies {loads[0]}\n   {'':<17}and {loads[1]} to shared memory")
        print(f"      waits for the block; then {BK} outer products of {TM} x {TN} from shared memory")
    print("   and at the end writes its 64 values. The block's 256 threads together copy the whole slabs.")
    return len(rows) == 2 * (K // BK)


def load_counts(source):
    n = 256
    a, b = np.ones((n, n), np.float32), np.ones((n, n), np.float32)
    print(f"\n2. Loads from global memory for M = N = K = {n} (counted in the emulator | formula)")
    counts = {}
    for name, naive in (("naive", True), ("tiled", False)):
        emulator.watch("float32", -1, source)
        emulator.matmul(a, b, naive=naive, source=source)
        counts[name] = emulator.trace("float32", source)[1]
    expected = {"naive": 2 * n**3, "tiled": int(n**3 * (1 / BN + 1 / BM))}
    for name in counts:
        instructions, elements = counts[name]
        formula = "2 M N K" if name == "naive" else "M N K (1/BN + 1/BM)"
        print(f"   {name:<6} {elements:>12,} elements in {instructions:>12,} loads | {formula} = {expected[name]:,}")
    print(f"   tiling reads each element {expected['naive'] // expected['tiled']}x less often; the tiled "
          "kernel's loads are 16 bytes wide")
    return all(counts[k][1] == expected[k] for k in expected)


def correctness(source):
    rng = np.random.default_rng(0)
    print("\n3. Results against float64 (relative error of the worst element)")
    worst = 0.0
    for M, N, K in ((33, 47, 19), (1, 130, 7), (129, 5, 41)):
        cells = []
        for ta in (False, True):
            for tb in (False, True):
                a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
                b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
                a, b = (a.T if ta else a), (b.T if tb else b)
                ref = a.astype(np.float64) @ b.astype(np.float64)
                error = relative_error(emulator.matmul(a, b, out=np.full((M, N), np.nan, np.float32), source=source), ref)
                worst = max(worst, error)
                cells.append(f"{'A^T' if ta else 'A'} {'B^T' if tb else 'B'} {error:.1e}")
        print(f"   {M:>3} x {N:>3} x {K:>3}:  " + "   ".join(cells))
    return worst < 1e-5


def barriers(source):
    a = np.random.default_rng(1).standard_normal((40, 300)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal((300, 40)).astype(np.float32)
    ref = a.astype(np.float64) @ b
    print("\n4. The barriers, tested one thread at a time in reverse order (deterministic)")
    ok = True
    for which, why in (("first", "computes from a slab its neighbours have not copied yet"),
                       ("second", "overwrites a slab its neighbours are still reading")):
        at = source.index("__syncthreads();") if which == "first" else source.rindex("__syncthreads();")
        broken = source[:at] + source[at + len("__syncthreads();"):]
        error = relative_error(emulator.matmul(a, b, source=broken, mode="reversed"), ref)
        print(f"   without the {which} __syncthreads(): relative error {error:.2f}\n     (a thread {why})")
        ok &= error > 0.1
    error = relative_error(emulator.matmul(a, b, source=source, mode="reversed"), ref)
    print(f"   with both:                           relative error {error:.1e}")
    return ok and error < 1e-5


ACCUMULATE = "for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];  // an outer product"
ACCUMULATE_16 = "for (int j = 0; j < TN; ++j) { T r; narrow(acc[i][j] + a[i] * b[j], r); acc[i][j] = widen(r); }"


def sixteen_bits(source):
    """The worst error of a 16-bit product over its bound: the float64 product of the 16-bit inputs
    themselves, then float32 accumulation (gamma_K |A||B|) and one rounding to 16 bits (u16 |C|)."""
    from minipar.dtypes import bfloat16, float16

    rng = np.random.default_rng(3)
    M, N, K = 9, 9, 2049
    print(f"\n5. 16-bit inputs, {M} x {N} x {K}: worst |error| / bound (<= 1 passes), bound = u16 |C| + "
          "gamma_K |A||B|")
    ok = True
    for dtype, u16 in ((bfloat16, 2.0**-8), (float16, 2.0**-11)):
        a, b = rng.standard_normal((M, K)).astype(dtype), rng.standard_normal((K, N)).astype(dtype)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        gamma = K * 2.0**-24 / (1 - K * 2.0**-24)
        bound = u16 * np.abs(a64 @ b64) + (1 + u16) * gamma * (np.abs(a64) @ np.abs(b64))
        cells = []
        for name, text in (("float32 accumulator", source), ("16-bit accumulator", source.replace(ACCUMULATE, ACCUMULATE_16))):
            c = emulator.matmul(a, b, source=text)
            excess = float((np.abs(c.astype(np.float64) - a64 @ b64) / bound).max())
            cells.append(f"{name} {excess:5.2f}")
            ok &= c.dtype == dtype and (excess <= 1) == (name.startswith("float32"))
        print(f"   {np.dtype(dtype).name:<9} " + "   ".join(cells))
    print("   (a product of two 16-bit values is exact in float32; only the float32 sums round)")
    return ok


def on_the_gpu():
    import cupy

    def ms(fn, repeats=10):
        fn()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        timings = []
        for _ in range(3):
            start.record()
            for _ in range(repeats):
                fn()
            stop.record()
            stop.synchronize()
            timings.append(cupy.cuda.get_elapsed_time(start, stop) / repeats)
        return statistics.median(timings)

    print("\n6. On the GPU: GFLOP/s, float32 (bench/gemm.py has the full table)")
    ok = True
    for n in (1024, 2048, 4096):
        a, b = cupy.random.standard_normal((n, n), dtype="float32"), cupy.random.standard_normal((n, n), dtype="float32")
        error = float(cupy.abs(gemm.matmul(a, b) - cupy.matmul(a, b)).max() / cupy.abs(cupy.matmul(a, b)).max())
        ok &= error < 1e-4
        speed = {name: 2 * n**3 / ms(fn) / 1e6 for name, fn in (
            ("naive", lambda: gemm.matmul(a, b, naive=True)), ("tiled", lambda: gemm.matmul(a, b)),
            ("cuBLAS", lambda: cupy.matmul(a, b)))}
        print(f"   {n:>5}: naive {speed['naive']:>8,.0f}   tiled {speed['tiled']:>8,.0f}   cuBLAS "
              f"{speed['cuBLAS']:>8,.0f}   tiled / cuBLAS {speed['tiled'] / speed['cuBLAS']:.2f}")
    return ok


def main():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--plant-bug", action="store_true", help="a wrong index in the emulated kernel's tile copy")
    add_device_flag(p)
    args = lesson.parse_one_process(p, device_problems)  # a bad flag (or several ranks): one line and exit 2
    if emulator.compiler() is None:
        print("this lesson runs the kernel in a CPU emulator built with g++ (C++20): install g++")
        return 2
    source = gemm.SOURCE.read_text()
    if args.plant_bug:
        source = source.replace(*PLANTED)
        print(f"planted: {PLANTED[1]}\n")
    sections = [tile_walk, load_counts, correctness, barriers, sixteen_bits]
    checks = []
    for section in sections:
        try:
            checks.append(section(source))
        except emulator.EmulatorError as exc:  # what a GPU would stop the kernel for
            print("\n" + textwrap.fill(f"the kernel was stopped: {exc}", 95, initial_indent="   ",
                                        subsequent_indent="   "))
            checks.append(False)
    if args.device == "cuda":
        checks.append(on_the_gpu())
    failed = [str(number) for number, passed in enumerate(checks, 1) if not passed]
    print(f"\nMISMATCH: section{'s' * (len(failed) > 1)} {', '.join(failed)} failed (see above)" if failed else
          f"\nThe tiled kernel computes the product with {2 * BN * BM // (BN + BM)}x fewer loads than the naive\n"
          "one, and both barriers are needed.")
    return int(bool(failed))


if __name__ == "__main__":
    lesson.end(main())
