// Runs gemm.cu, unchanged, on the CPU: what CI (which has no GPU) uses to test the kernel.
//
// The shims below give the CUDA source what it expects from the hardware:
//   * one OS thread per CUDA thread of a block; blocks run one after another, on the same threads;
//   * __shared__ becomes `static`: every thread of the running block sees the same array, which is
//     exactly shared memory when only one block runs at a time;
//   * __syncthreads() is a real barrier.
// Two ways to schedule a block's threads:
//   * PARALLEL: all threads run at once and meet at a std::barrier (races happen as on a GPU, by
//     chance);
//   * SERIAL: one thread runs at a time, from one barrier to the next, in an adversarial order
//     (reversed, or shuffled by a seed). A missing __syncthreads() then fails every time: some
//     thread reads a tile its neighbours have not written yet, or already overwrote.
// In every mode a block whose threads passed different numbers of barriers, or met at different
// __syncthreads() calls, is reported (undefined behaviour on a GPU).
// Built by emulator.py with g++ -std=c++20; the tile shapes come in as -D flags.

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <semaphore>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
// The 16-byte vector types. A GPU faults on a vector load or store at an address that is not
// 16-byte aligned; here the copy that does the load or store checks the address instead (and the
// types keep their elements' alignment, so the CPU itself never faults first).
static std::atomic<bool> g_misaligned{false};
static void check_aligned(const void* address) {
    if (reinterpret_cast<std::uintptr_t>(address) % 16 != 0) g_misaligned = true;
}
template <typename E, int N>
struct Vector16 {
    E e[N];
    Vector16() = default;
    Vector16(const Vector16& other) {  // a load: *reinterpret_cast<const float4*>(p)
        check_aligned(&other);
        for (int j = 0; j < N; ++j) e[j] = other.e[j];
    }
    Vector16& operator=(const Vector16& other) {  // a store: *reinterpret_cast<float4*>(p) = v
        check_aligned(this);
        for (int j = 0; j < N; ++j) e[j] = other.e[j];
        return *this;
    }
};
using float4 = Vector16<float, 4>;
using double2 = Vector16<double, 2>;
using uint4 = Vector16<unsigned, 4>;  // 8 bfloat16 or float16 values

// CUDA's reinterpretations of a float's bits, which the bfloat16 conversions use.
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
static inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
#define GEMM_FLOAT16  // float16's conversions are the PTX cvt instructions: here g++'s _Float16 below

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __restrict__ __restrict
#define __shared__ static

// Shared memory starts undefined on a GPU. Here each shared array registers itself the first time
// a kernel runs (GEMM_SHARED), and every block starts with all of them full of NaN: a block that
// reads what it never wrote fails, even when an earlier block left the right values behind.
static std::mutex g_shared_mutex;
static std::vector<std::pair<void*, std::size_t>> g_shared;
static void register_shared(void* array, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(g_shared_mutex);
    for (const auto& known : g_shared)
        if (known.first == array) return;
    g_shared.emplace_back(array, bytes);
}
static void poison_shared() {
    for (const auto& [array, bytes] : g_shared) std::memset(array, 0xFF, bytes);  // 0xFF..: NaN
}
#define GEMM_SHARED(array) register_shared(&(array), sizeof(array))

// The loads of one chosen thread (the lesson prints its walk), and every load counted.
struct Load {
    int operand, i, k, along_k, count;
};
static const void* g_operand_a = nullptr;
static int g_watch_thread = -1;  // linear thread id in the launch; -1: watch none
static thread_local int t_linear_id = 0;
static std::mutex g_trace_mutex;
static std::vector<Load> g_trace;
static std::atomic<long long> g_loads{0}, g_elements{0};

static void trace_load(const void* operand, int i, int k, bool along_k, int count) {
    g_loads += 1;
    g_elements += count > 0 ? count : 0;
    if (t_linear_id == g_watch_thread) {
        std::lock_guard<std::mutex> lock(g_trace_mutex);
        // operand: 0 = A, 1 = B (the kernel has already moved A to its batch; batch 0 is watched)
        g_trace.push_back({operand == g_operand_a ? 0 : 1, i, k, along_k ? 1 : 0, count});
    }
}
#define GEMM_TRACE(operand, i, k, along_k, count) trace_load(operand, i, k, along_k, count)

void __syncthreads();
#include "gemm.cu"

// float16 <-> float32 by g++'s _Float16: IEEE conversions rounding to nearest even, as cvt.rn does.
// (Found by argument-dependent lookup when the kernel templates are instantiated below.)
static inline float widen(float16 x) {
    _Float16 h;
    std::memcpy(&h, &x.bits, sizeof h);
    return float(h);
}
static inline void narrow(float x, float16& out) {
    const _Float16 h = _Float16(x);
    std::memcpy(&out.bits, &h, sizeof h);
}

// ---- scheduling a block's threads --------------------------------------------------------------
enum Mode { PARALLEL = 0, SERIAL_REVERSED = 1, SERIAL_SHUFFLED = 2 };

struct Scheduler {
    Mode mode;
    int n;
    std::unique_ptr<std::barrier<>> barrier;
    // SERIAL: the thread `order[pos]` runs; every other thread waits on its own semaphore, so a
    // hand-over wakes exactly one thread.
    std::mutex mu;
    std::vector<std::unique_ptr<std::binary_semaphore>> turn;
    std::vector<int> order;
    int pos = 0, arrived = 0, exited = 0;
    bool divergent = false;
    std::mt19937 rng;
    // the barriers each thread passed, and a hash of where each was called from: its own slot,
    // read once the block is over
    std::vector<int> passed;
    std::vector<std::uint64_t> sites;

    Scheduler(Mode m, int threads, unsigned seed)
        : mode(m), n(threads), order(threads), rng(seed), passed(threads, 0), sites(threads, 0) {
        if (mode == PARALLEL) {
            barrier = std::make_unique<std::barrier<>>(threads);
            return;
        }
        for (int t = 0; t < n; ++t) turn.push_back(std::make_unique<std::binary_semaphore>(0));
        new_phase();
    }
    void new_phase() {
        std::iota(order.begin(), order.end(), 0);
        if (mode == SERIAL_REVERSED) std::reverse(order.begin(), order.end());
        if (mode == SERIAL_SHUFFLED) std::shuffle(order.begin(), order.end(), rng);
        pos = arrived = 0;
        turn[order[0]]->release();
    }
    void start(int tid) {
        if (mode != PARALLEL) turn[tid]->acquire();
    }
    // This thread reached a barrier (exit = false) or the end of the kernel (exit = true).
    void arrive(int tid, bool exit, const void* site = nullptr) {
        if (!exit) {
            ++passed[tid];
            sites[tid] = sites[tid] * 1099511628211ULL ^ reinterpret_cast<std::uintptr_t>(site);
        }
        if (mode == PARALLEL) {
            if (exit) barrier->arrive_and_drop(); else barrier->arrive_and_wait();
            return;
        }
        bool wait_for_turn;
        {
            std::lock_guard<std::mutex> lock(mu);
            exit ? ++exited : ++arrived;
            if (divergent) return;
            if (++pos < n) {
                turn[order[pos]]->release();
            } else if (exited > 0 && arrived > 0) {  // some threads skipped a barrier: let all run
                divergent = true;
                for (auto& t : turn) t->release();
            } else if (exited == 0) {
                new_phase();
            }
            wait_for_turn = !exit && !divergent;  // read under the lock: another thread may set it
        }
        if (wait_for_turn) turn[tid]->acquire();
    }
    // Whether the block's threads met at different numbers of barriers, or at different calls. In
    // PARALLEL mode a thread that ends leaves the std::barrier and the others go on without it (as
    // a GPU may), and no mode sees which call a thread waits at: only the counts and the sites tell
    // (the serial modes also catch a missing arrival as it happens: `divergent`).
    bool uneven() const {
        for (int t = 1; t < n; ++t)
            if (passed[t] != passed[0] || sites[t] != sites[0]) return true;
        return false;
    }
};

static Scheduler* g_scheduler = nullptr;
static thread_local int t_tid = 0;
// Not inlined, so that its return address names the call: threads that meet at barriers the
// same number of times but at different __syncthreads() calls are reported too.
__attribute__((noinline)) void __syncthreads() { g_scheduler->arrive(t_tid, false, __builtin_return_address(0)); }

template <typename Kernel>
static int launch(Kernel kernel, dim3 grid, dim3 block, Mode mode, unsigned seed) {
    gridDim = grid;
    blockDim = block;
    const int threads = block.x * block.y * block.z;
    // Blocks run one at a time; in the serial modes in an adversarial order too (a GPU promises no
    // order between blocks: a block that reads what another writes is a race).
    std::vector<dim3> blocks;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) blocks.push_back({bx, by, bz});
    if (mode == SERIAL_REVERSED) std::reverse(blocks.begin(), blocks.end());
    if (mode == SERIAL_SHUFFLED) std::shuffle(blocks.begin(), blocks.end(), std::mt19937(seed));
    // One OS thread per CUDA thread, made once per launch and given block after block: starting
    // and joining threads for every block cost ~80 us each, 5 s for the 65,536 threads of a naive
    // 256 x 256 product. `gate` (the threads and this one) opens a block and closes it; in between
    // the block runs exactly as on its own threads, and its thread-locals are set afresh.
    std::barrier<> gate(threads + 1);
    std::unique_ptr<Scheduler> scheduler;
    dim3 current;
    bool done = false;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
            for (;;) {
                gate.arrive_and_wait();  // a block is set up, or the launch is over
                if (done) return;
                const long long block_id = current.x + grid.x * (current.y + (long long)grid.y * current.z);
                t_tid = t;
                t_linear_id = int(block_id * threads + t);
                threadIdx = {unsigned(t % block.x), unsigned(t / block.x % block.y),
                             unsigned(t / (block.x * block.y))};
                blockIdx = current;
                scheduler->start(t);
                kernel();
                scheduler->arrive(t, true);
                gate.arrive_and_wait();  // the block is done
            }
        });
    int code = 0;
    for (const dim3 b : blocks) {
        poison_shared();
        scheduler = std::make_unique<Scheduler>(mode, threads, seed + b.x + 7919 * b.y + 104729 * b.z);
        g_scheduler = scheduler.get();
        current = b;
        gate.arrive_and_wait();  // run it
        gate.arrive_and_wait();  // wait for it
        code = scheduler->divergent || scheduler->uneven() ? 2 : g_misaligned ? 3 : 0;
        if (code) break;
    }
    done = true;
    gate.arrive_and_wait();
    for (auto& th : pool) th.join();
    return code;
}

template <typename T, bool TA, bool TB>
static int run(bool naive, const void* A, const void* B, void* C, int M, int N, int K, int lda, int ldb,
               int ldc, long long sa, long long sb, long long sc, int batch, Mode mode, unsigned seed) {
    const T* a = static_cast<const T*>(A);
    const T* b = static_cast<const T*>(B);
    T* c = static_cast<T*>(C);
    g_operand_a = A;
    g_misaligned = false;
    if (naive) {
        dim3 grid{unsigned((N + 15) / 16), unsigned((M + 15) / 16), unsigned(batch)}, block{16, 16, 1};
        return launch([=] { gemm_naive<T, TA, TB>(a, b, c, M, N, K, lda, ldb, ldc, sa, sb, sc); },
                      grid, block, mode, seed);
    }
    const int threads = (EMU_BM / EMU_TM) * (EMU_BN / EMU_TN);
    static bool registered = false;  // this kernel's shared arrays, before its first real block
    if (!registered) {
        launch([=] { gemm_tiled<T, EMU_BM, EMU_BN, EMU_BK, EMU_TM, EMU_TN, TA, TB>(a, b, c, 0, 0, 0, lda, ldb, ldc, 0, 0, 0); },
               dim3{1, 1, 1}, dim3{unsigned(threads), 1, 1}, PARALLEL, 0);
        registered = true;
    }
    dim3 grid{unsigned((N + EMU_BN - 1) / EMU_BN), unsigned((M + EMU_BM - 1) / EMU_BM), unsigned(batch)};
    return launch([=] {
        gemm_tiled<T, EMU_BM, EMU_BN, EMU_BK, EMU_TM, EMU_TN, TA, TB>(a, b, c, M, N, K, lda, ldb, ldc, sa, sb, sc);
    }, grid, dim3{unsigned(threads), 1, 1}, mode, seed);
}

extern "C" {

// Returns 0 on success, 2 if a block's threads did not all meet at the same barriers, 3 on a
// misaligned 16-byte load or store.
int emulate_gemm(int trans_a, int trans_b, int naive, const void* A, const void* B, void* C, int M, int N,
                 int K, int lda, int ldb, int ldc, long long sa, long long sb, long long sc, int batch,
                 int mode, unsigned seed) {
    using T = EMU_T;
    const Mode m = Mode(mode);
    if (trans_a && trans_b) return run<T, true, true>(naive, A, B, C, M, N, K, lda, ldb, ldc, sa, sb, sc, batch, m, seed);
    if (trans_a) return run<T, true, false>(naive, A, B, C, M, N, K, lda, ldb, ldc, sa, sb, sc, batch, m, seed);
    if (trans_b) return run<T, false, true>(naive, A, B, C, M, N, K, lda, ldb, ldc, sa, sb, sc, batch, m, seed);
    return run<T, false, false>(naive, A, B, C, M, N, K, lda, ldb, ldc, sa, sb, sc, batch, m, seed);
}

// Record the loads of thread `linear_id` (block-major) from now on; -1 stops recording.
void emulate_watch(int linear_id) {
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    g_watch_thread = linear_id;
    g_trace.clear();
    g_loads = 0;
    g_elements = 0;
}

// The recorded loads as rows of 5 ints (operand, i, k, along_k, count); returns how many there are.
int emulate_trace(int* out, int capacity) {
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    const int n = int(g_trace.size());
    for (int r = 0; r < n && r < capacity; ++r) {
        const Load& l = g_trace[r];
        const int row[5] = {l.operand, l.i, l.k, l.along_k, l.count};
        std::memcpy(out + 5 * r, row, sizeof row);
    }
    return n;
}

// Global-memory load instructions and elements loaded since the last emulate_watch.
void emulate_counts(long long* out) {
    out[0] = g_loads;
    out[1] = g_elements;
}
}
