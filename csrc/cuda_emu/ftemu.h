// fasttran's CUDA emulator: the device-side language (qualifiers, built-in variables, barriers,
// warp intrinsics, atomics, math intrinsics) and the kernel launch, so that the CUDA backend's
// unmodified .cu files compile with the host C++ compiler and their kernels run on the CPU.
//
// Test infrastructure only (FASTTRAN_CUDA=emu builds libfasttran_cuda_emu.so, loaded only when
// FASTTRAN_CUDA_EMU=1): it checks what the kernels compute, not how fast or how nvcc compiles
// them. Model (scheduler.cpp):
//   - the blocks of a grid run one after another (in a seeded random order with
//     FASTTRAN_EMU_SEED); the threads of a block are coroutines on the calling OS thread;
//   - a thread runs until it reaches a barrier (__syncthreads*, a warp-synchronous intrinsic, a
//     wmma operation) or returns; the scheduler then resumes another runnable thread: the
//     lowest-numbered one, or a random one with FASTTRAN_EMU_SEED set;
//   - __syncthreads() releases when every live thread of the block waits at one; a thread that
//     returned leaves all later barriers, as on the GPU. __shfl_*_sync and friends release when
//     every live lane named in the mask has arrived; all lanes' results are computed at once;
//   - a block in which no thread can make progress is a deadlock: the launch fails with a message
//     naming the kernel, the block and where each thread waits (never a hang);
//   - FASTTRAN_EMU_CHECK=barriers additionally fails a launch when a __syncthreads() is not
//     reached by every thread of the block (the programming guide's rule: a barrier inside a
//     branch taken by part of the block, or after some threads returned) or the threads released
//     by one wait at different call sites, when the lanes of one warp operation disagree on the operation, the call site
//     or the mask, when a mask names a lane that has exited, or when a shuffle reads a lane that
//     takes no part in it; FASTTRAN_EMU_CHECK=memory puts device allocations right before an
//     inaccessible page (out-of-bounds accesses fault and are reported as cudaErrorIllegalAddress
//     with the kernel, block, thread and the allocation) and checks the bytes between the end of
//     an allocation and its page for writes after every launch.
// __shared__ variables are function-local `static thread_local` storage: shared by the block's
// threads (which run on one OS thread) and safe because blocks run one at a time.
#ifndef FTEMU_H
#define FTEMU_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include <cmath>
#include <cstdio>
#include <tuple>
#include <type_traits>
#include <utility>

#define FT_CUDA_EMU 1

// ---- qualifiers -------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) alignas(n)
#define __shared__ static thread_local
#define __constant__ static
#define __managed__

// ---- vector types ------------------------------------------------------------------------------
struct uint3 { unsigned int x, y, z; };
struct int2 { int x, y; };
struct int4 { int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct float3 { float x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float3 make_float3(float x, float y, float z) { return float3{x, y, z}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }
inline double2 make_double2(double x, double y) { return double2{x, y}; }

struct CUstream_st;
typedef CUstream_st *cudaStream_t;

namespace ftemu {

// ---- the running thread ------------------------------------------------------------------------
struct thread_builtins {   // base of the scheduler's thread state
    uint3 thread_idx;
    unsigned lane, warp, linear;
};
struct block_builtins {    // base of the scheduler's block state
    uint3 block_idx;
    dim3 block_dim, grid_dim;
    void *dynamic_shared;
    size_t dynamic_shared_bytes;
};
// the emulated thread and block the calling OS thread runs now (valid only inside a kernel)
extern thread_local thread_builtins *g_thread;
extern thread_local block_builtins *g_block;
inline const thread_builtins &cur_thread() { return *g_thread; }
inline const block_builtins &cur_block() { return *g_block; }

// ---- barriers and warp operations (scheduler.cpp) ------------------------------------------------
enum sync_kind { SYNC_PLAIN = 0, SYNC_COUNT, SYNC_AND, SYNC_OR };
int syncthreads(int kind, int predicate, const char *file, int line);

enum warp_op {
    WOP_SYNC = 0, WOP_SHFL, WOP_SHFL_UP, WOP_SHFL_DOWN, WOP_SHFL_XOR, WOP_BALLOT, WOP_ANY, WOP_ALL,
    WOP_REDUCE_ADD, WOP_REDUCE_MIN, WOP_REDUCE_MAX, WOP_REDUCE_AND, WOP_REDUCE_OR, WOP_REDUCE_XOR,
    WOP_REDUCE_MIN_S, WOP_REDUCE_MAX_S, WOP_WMMA
};
// One warp-synchronous operation of the calling lane: waits for every live lane of `mask`, then
// returns this lane's result. `value` is the lane's operand bits, `arg` the source lane / delta /
// lane mask, `width` the shuffle segment width.
uint64_t warp_collective(warp_op op, unsigned mask, uint64_t value, int arg, int width, const char *file,
                         int line);
unsigned active_mask();

// a launch: runs fn(ctx) as every thread of every block; returns a cudaError_t value
typedef void (*thread_body)(void *ctx);
int run_grid(const char *kernel, const void *kernel_id, dim3 grid, dim3 block, size_t dynamic_shared,
             cudaStream_t stream, thread_body body, void *ctx);

inline void compiler_barrier() { __asm__ __volatile__("" ::: "memory"); }

template <typename T> inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp intrinsics take <= 8-byte values");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof v);
    return b;
}
template <typename T> inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof v);
    return v;
}

// ---- kernel launch ---------------------------------------------------------------------------------
template <typename... P> struct kernel_call {
    void (*kernel)(P...);
    std::tuple<typename std::decay<P>::type...> args;
    static void run(void *self) {
        kernel_call *k = static_cast<kernel_call *>(self);
        std::apply(k->kernel, k->args);   // each thread gets the arguments by value, as on the GPU
    }
};

template <typename... P> struct launcher {
    void (*kernel)(P...);
    const char *name;
    dim3 grid, block;
    size_t shared;
    cudaStream_t stream;
    template <typename... A> void operator()(A &&...a) const {
        static_assert(sizeof...(A) == sizeof...(P), "kernel launched with the wrong number of arguments");
        kernel_call<P...> call{kernel, std::tuple<typename std::decay<P>::type...>(static_cast<P>(a)...)};
        run_grid(name, reinterpret_cast<const void *>(kernel), grid, block, shared, stream, &kernel_call<P...>::run,
                 &call);
    }
};

template <typename... P>
launcher<P...> make_launcher(void (*kernel)(P...), const char *name, dim3 grid, dim3 block, size_t shared,
                             cudaStream_t stream) {
    return launcher<P...>{kernel, name, grid, block, shared, stream};
}

}  // namespace ftemu

// FT_LAUNCH(kernel, grid, block, shared bytes, stream)(arguments...): `<<<>>>` under nvcc
#define FT_LAUNCH(kernel, grid, block, shmem, stream) \
    ::ftemu::make_launcher(kernel, #kernel, dim3(grid), dim3(block), (size_t)(shmem), (stream))
// dynamic shared memory: `extern __shared__ T name[]` under nvcc
#define FT_DYNAMIC_SHARED(T, name) T *name = static_cast<T *>(::ftemu::cur_block().dynamic_shared)

// ---- built-in variables -------------------------------------------------------------------------
#define threadIdx (::ftemu::cur_thread().thread_idx)
#define blockIdx (::ftemu::cur_block().block_idx)
#define blockDim (::ftemu::cur_block().block_dim)
#define gridDim (::ftemu::cur_block().grid_dim)
static constexpr int warpSize = 32;

// ---- barriers -----------------------------------------------------------------------------------
inline void __syncthreads(const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    ftemu::syncthreads(ftemu::SYNC_PLAIN, 1, file, line);
}
inline int __syncthreads_count(int p, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ftemu::syncthreads(ftemu::SYNC_COUNT, p, file, line);
}
inline int __syncthreads_and(int p, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ftemu::syncthreads(ftemu::SYNC_AND, p, file, line);
}
inline int __syncthreads_or(int p, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ftemu::syncthreads(ftemu::SYNC_OR, p, file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    ftemu::warp_collective(ftemu::WOP_SYNC, mask, 0, 0, 32, file, line);
}
namespace ftemu { [[noreturn]] void trap(const char *file, int line); }
// ends the launch with cudaErrorLaunchFailure, naming where (a GPU aborts the kernel the same way)
[[noreturn]] inline void __trap(const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    ftemu::trap(file, line);
}
inline void __threadfence() { ftemu::compiler_barrier(); }
inline void __threadfence_block() { ftemu::compiler_barrier(); }
inline void __threadfence_system() { ftemu::compiler_barrier(); }
inline unsigned __activemask() { return ftemu::active_mask(); }

// ---- warp intrinsics ----------------------------------------------------------------------------
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32, const char *file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
    return ftemu::from_bits<T>(ftemu::warp_collective(ftemu::WOP_SHFL, mask, ftemu::to_bits(v), src, width, file, line));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32, const char *file = __builtin_FILE(),
                        int line = __builtin_LINE()) {
    return ftemu::from_bits<T>(
        ftemu::warp_collective(ftemu::WOP_SHFL_UP, mask, ftemu::to_bits(v), (int)delta, width, file, line));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, const char *file = __builtin_FILE(),
                          int line = __builtin_LINE()) {
    return ftemu::from_bits<T>(
        ftemu::warp_collective(ftemu::WOP_SHFL_DOWN, mask, ftemu::to_bits(v), (int)delta, width, file, line));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, const char *file = __builtin_FILE(),
                         int line = __builtin_LINE()) {
    return ftemu::from_bits<T>(
        ftemu::warp_collective(ftemu::WOP_SHFL_XOR, mask, ftemu::to_bits(v), lane_mask, width, file, line));
}
inline unsigned __ballot_sync(unsigned mask, int p, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (unsigned)ftemu::warp_collective(ftemu::WOP_BALLOT, mask, p != 0, 0, 32, file, line);
}
inline int __any_sync(unsigned mask, int p, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (int)ftemu::warp_collective(ftemu::WOP_ANY, mask, p != 0, 0, 32, file, line);
}
inline int __all_sync(unsigned mask, int p, const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (int)ftemu::warp_collective(ftemu::WOP_ALL, mask, p != 0, 0, 32, file, line);
}
#define FTEMU_REDUCE(name, op, T)                                                                          \
    inline T name(unsigned mask, T v, const char *file = __builtin_FILE(), int line = __builtin_LINE()) { \
        return (T)ftemu::warp_collective(op, mask, (uint64_t)(uint32_t)v, 0, 32, file, line);            \
    }
FTEMU_REDUCE(__reduce_add_sync, ftemu::WOP_REDUCE_ADD, unsigned)
FTEMU_REDUCE(__reduce_add_sync, ftemu::WOP_REDUCE_ADD, int)
FTEMU_REDUCE(__reduce_min_sync, ftemu::WOP_REDUCE_MIN, unsigned)
FTEMU_REDUCE(__reduce_min_sync, ftemu::WOP_REDUCE_MIN_S, int)
FTEMU_REDUCE(__reduce_max_sync, ftemu::WOP_REDUCE_MAX, unsigned)
FTEMU_REDUCE(__reduce_max_sync, ftemu::WOP_REDUCE_MAX_S, int)
FTEMU_REDUCE(__reduce_and_sync, ftemu::WOP_REDUCE_AND, unsigned)
FTEMU_REDUCE(__reduce_or_sync, ftemu::WOP_REDUCE_OR, unsigned)
FTEMU_REDUCE(__reduce_xor_sync, ftemu::WOP_REDUCE_XOR, unsigned)
#undef FTEMU_REDUCE

// ---- atomics: the threads of a launch never run at the same time, so plain read-modify-writes
// are atomic with respect to each other; the returned value is the old one, as on the GPU ----------
template <typename T, typename U> inline T atomicAdd(T *a, U v) { T o = *a; *a = (T)(o + v); return o; }
template <typename T, typename U> inline T atomicSub(T *a, U v) { T o = *a; *a = (T)(o - v); return o; }
template <typename T, typename U> inline T atomicExch(T *a, U v) { T o = *a; *a = (T)v; return o; }
template <typename T, typename U> inline T atomicMax(T *a, U v) { T o = *a; if ((T)v > o) *a = (T)v; return o; }
template <typename T, typename U> inline T atomicMin(T *a, U v) { T o = *a; if ((T)v < o) *a = (T)v; return o; }
template <typename T, typename U> inline T atomicAnd(T *a, U v) { T o = *a; *a = o & (T)v; return o; }
template <typename T, typename U> inline T atomicOr(T *a, U v) { T o = *a; *a = o | (T)v; return o; }
template <typename T, typename U> inline T atomicXor(T *a, U v) { T o = *a; *a = o ^ (T)v; return o; }
template <typename T, typename U, typename V> inline T atomicCAS(T *a, U cmp, V v) {
    T o = *a;
    if (o == (T)cmp) *a = (T)v;
    return o;
}
inline unsigned atomicInc(unsigned *a, unsigned v) { unsigned o = *a; *a = o >= v ? 0 : o + 1; return o; }

// ---- math intrinsics (host libm; fast-math accuracy is not emulated) --------------------------------
using std::isfinite;
using std::isinf;
using std::isnan;
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanhf(float x) { return tanhf(x); }
inline float exp2f_(float x) { return exp2f(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : (x != x ? 0.0f : x); }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
inline float __int2float_rn(int x) { return (float)x; }
inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
inline float __uint_as_float(unsigned i) { float x; memcpy(&x, &i, 4); return x; }
inline long long __double_as_longlong(double x) { long long i; memcpy(&i, &x, 8); return i; }
inline double __longlong_as_double(long long i) { double x; memcpy(&x, &i, 8); return x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
    return (x >> 16) | (x << 16);
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
template <typename T> inline T __ldg(const T *p) { return *p; }
template <typename T> inline T __ldcs(const T *p) { return *p; }
template <typename T> inline void __stcs(T *p, T v) { *p = v; }
long long clock64();   // nanoseconds of a monotonic clock (runtime.cpp)
inline void __nanosleep(unsigned) {}

#endif
