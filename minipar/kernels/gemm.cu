// minipar's matrix multiply: C[b] = op(A[b]) op(B[b]) for a batch of row-major matrices.
//
//   op(A) is M x K, op(B) is K x N, C is M x N (row stride ldc).
//   TRANS_A = false: A is stored M x K, element (m, k) at A[m * lda + k]
//   TRANS_A = true:  A is stored K x M, element (m, k) at A[k * lda + m]   (A^T without a copy)
//   TRANS_B = false: B is stored K x N, element (k, n) at B[k * ldb + n]
//   TRANS_B = true:  B is stored N x K, element (k, n) at B[n * ldb + k]
//   batch b (the grid's z) starts at A + b * stride_a, B + b * stride_b, C + b * stride_c; a
//   stride of 0 shares one matrix across the batch.
//
// Why tiles. A naive kernel (gemm_naive below: one thread per C element) reads a row of A and a
// column of B from global memory for every element of C: 2 M N K loads. Here a block of THREADS
// threads computes a BM x BN tile of C. It walks K in slabs of depth BK: the block copies the
// BM x BK slab of A and the BK x BN slab of B into shared memory once, then every thread reads
// them from there. Each element of A is now loaded from global memory N / BN times, each element
// of B M / BM times: M N K (1/BN + 1/BM) loads, 128x fewer with 128 x 128 tiles.
//
// Why registers. Shared memory is fast but not free. Each thread computes a TM x TN sub-tile of C
// (2D register blocking): per step k of a slab it reads TM values of A and TN values of B into
// registers and does TM x TN multiply-adds with them, TM TN / (TM + TN) = 4 per shared load with
// 8 x 8. The accumulators acc[TM][TN] stay in registers for the whole walk over K.
//
// One thread's work (fp32 tiles: BM = BN = 128, BK = 8, TM = TN = 8, 256 threads): thread t of
// block (bx, by) owns C rows by*128 + (t / 16)*8 .. +8 and columns bx*128 + (t % 16)*8 .. +8. For
// each of the K / 8 slabs it loads one run of 4 consecutive elements of A and one of B into shared
// memory (one 16-byte load each where aligned), waits for the block, does 8 x 64 multiply-adds,
// and waits again before the next slab overwrites the tiles. At the end it writes its 64 values.
//
// Bounds: any M, N, K. Loads outside the matrices read as 0 (they add nothing to a dot product);
// stores outside C are skipped. Vector loads are used only where the run is whole and aligned.
//
// 16-bit inputs (mixed precision): bfloat16 and float16 tiles are loaded and kept in shared memory
// as 16 bits (half the bytes of float32: twice the elements per 16-byte load, so BK = 16), each
// element is widened to float32 as a thread reads it into registers, the products are summed in
// float32 (a product of two 16-bit values is exact in float32: 8 x 8 or 11 x 11 significant bits),
// and the sum is rounded to 16 bits once, when C is written. Megatron's bf16 GEMMs on tensor cores
// do the same: 16-bit operands, an fp32 accumulator.
//
// GEMM_TRACE and GEMM_SHARED are empty on the GPU; the CPU emulator (emulate.cpp) defines them.

#ifndef GEMM_TRACE
// A load of `count` elements of one operand starting at its element (i, k), i the row of op(A) or
// the column of op(B), the run going along k or along i.
#define GEMM_TRACE(operand, i, k, along_k, count)
#endif
#ifndef GEMM_SHARED
// Where the emulator fills a block's shared memory with NaN (a GPU's starts undefined).
#define GEMM_SHARED(array)
#endif

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// The 16-bit formats as their bits: the kernel only converts them, so it needs neither
// cuda_fp16.h nor cuda_bf16.h (NVRTC does not always find them). T{} is +0 in every format.
struct bfloat16 { unsigned short bits; };  // float32's top 16 bits: 8 exponent, 7 mantissa
struct float16 { unsigned short bits; };   // IEEE binary16: 5 exponent, 10 mantissa

// The accumulator of each input type: float32 for the 16-bit formats, the type itself otherwise.
template <typename T> struct Accumulator { typedef T type; };
template <> struct Accumulator<bfloat16> { typedef float type; };
template <> struct Accumulator<float16> { typedef float type; };

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }
__device__ __forceinline__ void narrow(float x, float& out) { out = x; }
__device__ __forceinline__ void narrow(double x, double& out) { out = x; }
// bfloat16 is float32 cut to its top half: widening shifts the bits back; narrowing rounds to the
// nearest, ties to even (add 0x7FFF plus the last kept bit, then cut), NaN kept a NaN.
__device__ __forceinline__ float widen(bfloat16 x) { return __uint_as_float((unsigned)x.bits << 16); }
__device__ __forceinline__ void narrow(float x, bfloat16& out) {
    const unsigned u = __float_as_uint(x);
    out.bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? (unsigned short)((u >> 16) | 0x40)
                                               : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
#ifndef GEMM_FLOAT16
// float16: the conversion instructions (round to nearest even); the emulator brings its own.
__device__ __forceinline__ float widen(float16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ void narrow(float x, float16& out) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(x));
}
#endif

// 16 bytes of T: the widest load one thread can issue (LDG.128).
template <typename T> struct Vec;
template <> struct Vec<float> { typedef float4 type; static const int size = 4; };
template <> struct Vec<double> { typedef double2 type; static const int size = 2; };
template <> struct Vec<bfloat16> { typedef uint4 type; static const int size = 8; };
template <> struct Vec<float16> { typedef uint4 type; static const int size = 8; };

// r[0..VEC) = p[0..valid), zero beyond. One vector load when the whole run is valid and aligned.
template <typename T>
__device__ __forceinline__ void load_run(const T* p, int valid, bool aligned, T* r) {
    const int VEC = Vec<T>::size;
    if (aligned && valid == VEC) {
        typename Vec<T>::type v = *reinterpret_cast<const typename Vec<T>::type*>(p);
        const T* parts = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) r[j] = parts[j];
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) r[j] = j < valid ? p[j] : T{};
    }
}

// Copies the slab of one operand that the block needs for depth k0 .. k0 + BK into shared
// memory as S[k][i], i = 0 .. BI - 1 running over the block's rows of op(A) (or columns of
// op(B)), so that the inner loop reads TM (TN) neighbours of one k at once.
//   K_CONTIGUOUS: element (i, k) of the operand is P[i * ld + k] (A as stored, or B^T)
//   otherwise:    element (i, k) is P[k * ld + i]                (A^T, or B as stored)
// The threads cut the slab into runs of VEC elements along the contiguous direction, so that
// neighbouring threads read neighbouring addresses (coalesced).
template <typename T, int BI, int BK, int THREADS, bool K_CONTIGUOUS>
__device__ __forceinline__ void load_slab(T (*S)[BI], const T* P, int I, int K, int i0, int k0,
                                          long long ld, bool aligned) {
    const int VEC = Vec<T>::size;
    const int RUN_STEPS = K_CONTIGUOUS ? BK / VEC : BI / VEC;  // runs across the contiguous side
    const int RUNS = BI * BK / VEC;
    static_assert(RUNS % THREADS == 0, "every thread loads the same number of runs");
#pragma unroll
    for (int step = 0; step < RUNS / THREADS; ++step) {
        const int r = threadIdx.x + step * THREADS;
        T v[Vec<T>::size];
        if (K_CONTIGUOUS) {
            const int i = r / RUN_STEPS, k = (r % RUN_STEPS) * VEC;
            const int gi = i0 + i, gk = k0 + k;
            const int valid = gi < I ? imin(VEC, K - gk) : 0;
            load_run(valid > 0 ? P + gi * ld + gk : P, valid, aligned, v);
            GEMM_TRACE(P, gi, gk, true, valid);
#pragma unroll
            for (int j = 0; j < VEC; ++j) S[k + j][i] = v[j];
        } else {
            const int k = r / RUN_STEPS, i = (r % RUN_STEPS) * VEC;
            const int gi = i0 + i, gk = k0 + k;
            const int valid = gk < K ? imin(VEC, I - gi) : 0;
            load_run(valid > 0 ? P + gk * ld + gi : P, valid, aligned, v);
            GEMM_TRACE(P, gi, gk, false, valid);
#pragma unroll
            for (int j = 0; j < VEC; ++j) S[k][i + j] = v[j];
        }
    }
}

template <typename T, int BM, int BN, int BK, int TM, int TN, bool TRANS_A, bool TRANS_B>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
gemm_tiled(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K,
           int lda, int ldb, int ldc, long long stride_a, long long stride_b, long long stride_c) {
    typedef typename Accumulator<T>::type Acc;
    const int THREADS = (BM / TM) * (BN / TN);
    const int VEC = Vec<T>::size;
    static_assert(BM % TM == 0 && BN % TN == 0 && BK % VEC == 0 && TN % VEC == 0, "tile shapes");

    __shared__ T As[BK][BM];  // op(A)[m0 + i][k0 + k] at As[k][i]
    __shared__ T Bs[BK][BN];  // op(B)[k0 + k][n0 + j] at Bs[k][j]
    GEMM_SHARED(As);
    GEMM_SHARED(Bs);

    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int ty = threadIdx.x / (BN / TN), tx = threadIdx.x % (BN / TN);  // this thread's sub-tile
    A += blockIdx.z * stride_a;
    B += blockIdx.z * stride_b;
    C += blockIdx.z * stride_c;

    // A run of VEC elements can be one vector load when every run starts on a 16-byte boundary:
    // the matrix starts on one, and rows are a multiple of VEC apart.
    const bool a_aligned = lda % VEC == 0 && reinterpret_cast<unsigned long long>(A) % 16 == 0;
    const bool b_aligned = ldb % VEC == 0 && reinterpret_cast<unsigned long long>(B) % 16 == 0;
    const bool c_aligned = ldc % VEC == 0 && reinterpret_cast<unsigned long long>(C) % 16 == 0;

    Acc acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = Acc(0);

    for (int k0 = 0; k0 < K; k0 += BK) {
        load_slab<T, BM, BK, THREADS, !TRANS_A>(As, A, M, K, m0, k0, lda, a_aligned);
        load_slab<T, BN, BK, THREADS, TRANS_B>(Bs, B, N, K, n0, k0, ldb, b_aligned);
        __syncthreads();  // the whole slab is in shared memory before anyone reads it

#pragma unroll
        for (int k = 0; k < BK; ++k) {
            Acc a[TM], b[TN];  // widened as they leave shared memory
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = widen(As[k][ty * TM + i]);
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = widen(Bs[k][tx * TN + j]);
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];  // an outer product
        }
        __syncthreads();  // everyone is done with this slab before the next one overwrites it
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int m = m0 + ty * TM + i;
        if (m >= M) break;
#pragma unroll
        for (int j = 0; j < TN; j += VEC) {
            const int n = n0 + tx * TN + j;
            const int valid = imin(VEC, N - n);
            T* out = C + m * (long long)ldc + n;
            if (c_aligned && valid == VEC) {
                typename Vec<T>::type v;
                T* parts = reinterpret_cast<T*>(&v);
#pragma unroll
                for (int q = 0; q < VEC; ++q) narrow(acc[i][j + q], parts[q]);  // the one rounding
                *reinterpret_cast<typename Vec<T>::type*>(out) = v;
            } else {
                for (int q = 0; q < valid; ++q) narrow(acc[i][j + q], out[q]);
            }
        }
    }
}

// The baseline the lesson and the benchmark compare with: one thread per element of C, every
// operand read straight from global memory (blocks of 16 x 16 threads).
template <typename T, bool TRANS_A, bool TRANS_B>
__global__ void gemm_naive(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C,
                           int M, int N, int K, int lda, int ldb, int ldc,
                           long long stride_a, long long stride_b, long long stride_c) {
    const int m = blockIdx.y * blockDim.y + threadIdx.y, n = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M || n >= N) return;
    A += blockIdx.z * stride_a;
    B += blockIdx.z * stride_b;
    C += blockIdx.z * stride_c;
    typename Accumulator<T>::type sum = 0;
    for (int k = 0; k < K; ++k) {
        const T a = TRANS_A ? A[k * (long long)lda + m] : A[m * (long long)lda + k];
        const T b = TRANS_B ? B[n * (long long)ldb + k] : B[k * (long long)ldb + n];
        GEMM_TRACE(A, m, k, true, 1);
        GEMM_TRACE(B, n, k, true, 1);
        sum += widen(a) * widen(b);
    }
    narrow(sum, C[m * (long long)ldc + n]);
}
