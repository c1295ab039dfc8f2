// Shared pieces of the CUDA backend: the context, error helpers and block reductions.
#ifndef FT_CUDA_COMMON_CUH
#define FT_CUDA_COMMON_CUH
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "backend.h"

#ifndef FT_CUDA_EMU
// FT_LAUNCH(kernel, grid, block, shared bytes, stream)(arguments...): every launch site uses it, so
// the CUDA emulator (csrc/cuda_emu, FASTTRAN_CUDA=emu) can run the same source on the CPU
#define FT_LAUNCH(kernel, grid, block, shmem, stream) kernel<<<(grid), (block), (shmem), (stream)>>>
// dynamic shared memory as bytes (one declaration shared by every kernel instantiation)
#define FT_DYNAMIC_SHARED(T, name) extern __shared__ __align__(128) T name[]
#endif

namespace ftcuda {

extern const ft_host_api *g_host;

// A cuBLASLt matmul planned once per (dtype, shape, epilogue) and kept: the layouts, the operation
// descriptor (its bias pointer set per call) and the algorithm the heuristic chose
struct lt_plan {
    ft_dtype dt;
    int64_t M, N, K;
    int epilogue, accumulate;   // accumulate: D = A B + C (beta = 1)
    uint32_t align;             // the operands' common alignment in bytes (<= 256) the algorithm may assume
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
};
enum { LT_PLANS = 64 };
constexpr size_t LT_WORKSPACE = 32u << 20;   // cuBLASLt's workspace per backend: NVIDIA's advice for Hopper

struct device_blas;   // one cuBLAS handle per device, shared by its backends (backend_cuda.cu)

struct cuda_ctx {
    int device;
    cudaStream_t stream;   // all work of this backend runs here (non-blocking)
    device_blas *blas;     // the device's cuBLAS handle: use it through blas_use
    int tf32;              // float32 products on TF32 tensor cores (set_tf32)
    int cc_major;          // the device's compute capability (major), read once at open
    cublasLtHandle_t lt;   // half-precision projections (linear.cu), made on first use
    void *lt_ws;           // its workspace, allocated once (LT_WORKSPACE bytes)
    lt_plan plans[LT_PLANS];
    int n_plans, next_plan;
    char name[32];
    void *opt_plan;        // optimizer tables kept between steps, host images, workspace (optim.cu)
    void *train_ws;        // partial sums of the training ops (train_layer.cu), grown as needed
    size_t train_ws_bytes;
    void *round_ws;        // gemm_prec's operands rounded to bf16 / fp16 (backend_cuda.cu), grown as needed
    size_t round_ws_bytes;
    void *cudnn_ws;        // cuDNN attention's tables, workspace and operands (attention_cudnn.cu), grown as needed
    size_t cudnn_ws_bytes;
};

inline cuda_ctx *ctx_of(ft_backend *be) { return static_cast<cuda_ctx *>(be->ctx); }

// The device's cuBLAS handle, held for one or more calls: locked against the other backends of the
// device and bound to this backend's stream and math mode (cuBLAS keeps its workspace per stream).
//   blas_use blas(c); FT_TRY(blas.status); FT_CUBLAS(cublasSgemm(blas.h, ...), "...");
struct blas_use {
    cublasHandle_t h;
    ft_status status;
    explicit blas_use(cuda_ctx *c);
    ~blas_use();
    blas_use(const blas_use &) = delete;
    blas_use &operator=(const blas_use &) = delete;
  private:
    device_blas *d;
};
// Mixed-precision products: float32 operands rounded to bf16 / fp16 (nearest even, as the CPU's
// gemm_prec and PyTorch's .to() round) into the context's rounding workspace, then multiplied on
// tensor cores with float32 sums. cuBLAS's own FAST_16BF / FAST_16F modes are not used for this:
// on an H100 (cuBLAS 13.0) they neither round to nearest (bf16 off by up to 0.08 at K = 17) nor
// always round at all (fp16 gradients of 1e-9 kept, not flushed), so the arithmetic would depend on
// the kernel cuBLAS picks. round_operands: the spans of two operands (n_a, n_b floats from a and
// b, each a rows x cols block with leading dimension ld, row-major, or flat when rows = 1) into one
// workspace; *ha, *hb: the rounded copies, packed (leading dimension = cols).
ft_status round_operands(ft_backend *be, ft_dtype prec, const float *a, int64_t a_rows, int64_t a_cols, int64_t lda,
                         const float *b, int64_t b_rows, int64_t b_cols, int64_t ldb, void **ha, void **hb);
inline cudaDataType_t half_type(ft_dtype prec) { return prec == FT_BF16 ? CUDA_R_16BF : CUDA_R_16F; }
// frees what cuda_optim_step keeps in the context (optim.cu)
void cuda_optim_release(cuda_ctx *c);
// device bytes it keeps there (memory_info)
size_t cuda_optim_device_bytes(cuda_ctx *c);

inline ft_status cuda_fail(cudaError_t err, const char *what) {
    return g_host->error(FT_ERR_DEVICE, "CUDA error in %s: %s (%s)", what, cudaGetErrorName(err),
                         cudaGetErrorString(err));
}
inline ft_status blas_fail(cublasStatus_t st, const char *what) {
    return g_host->error(FT_ERR_DEVICE, "cuBLAS error in %s: %d", what, (int)st);
}

// after a kernel launch: report launch errors (bad configuration), not asynchronous faults
inline ft_status launched(const char *what) {
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? FT_OK : cuda_fail(e, what);
}

#ifndef FT_TRY
#define FT_TRY(expr) do { ft_status _t = (expr); if (_t != FT_OK) return _t; } while (0)
#endif
#define FT_CU(call, what) do { cudaError_t _e = (call); if (_e != cudaSuccess) return ftcuda::cuda_fail(_e, what); } while (0)
#define FT_CUBLAS(call, what) do { cublasStatus_t _s = (call); if (_s != CUBLAS_STATUS_SUCCESS) return ftcuda::blas_fail(_s, what); } while (0)

// a loop nvcc must unroll (a register tile's fixed trip count: indexing a register array with a
// loop variable that is not unrolled puts the array in local memory); the emulator's host compiler
// decides for itself
#ifdef FT_CUDA_EMU
#define FT_UNROLL
#else
#define FT_UNROLL _Pragma("unroll")
#endif

// blocks for a grid-stride loop over `total` items, `threads` per block (at least 1, at most
// 65535 x 8: the loop covers the rest)
inline unsigned grid_of(int64_t total, int threads) {
    int64_t g = (total + threads - 1) / threads;
    return (unsigned)(g < 1 ? 1 : g > 65535 * 8 ? 65535 * 8 : g);
}

// threads of a one-block-per-row kernel over rows of C elements: C rounded up to whole warps, 32..256
inline int row_threads(int64_t C) {
    int64_t t = (C + 31) / 32 * 32;
    return (int)(t < 32 ? 32 : t > 256 ? 256 : t);
}

// Sum of v over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ inline float block_sum(float v, float *shared32) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    __syncthreads();   // shared32 may still be read by a previous call
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    v = lane < nwarps ? shared32[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// element type <-> float, so one kernel source serves fp32 / fp16 / bf16
template <typename T> __device__ inline float to_f(T x) { return static_cast<float>(x); }
template <typename T> __device__ inline T from_f(float x) { return static_cast<T>(x); }

// bf16 WMMA exists from sm_80 (Ampere): an older target compiles a trap for it (the ops refuse
// bf16 on such a device before launching)
template <typename T> struct wmma_type_ok { static constexpr bool value = true; };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
template <> struct wmma_type_ok<__nv_bfloat16> { static constexpr bool value = false; };
#endif

inline ft_status dtype_error(ft_dtype dt, const char *op) {
    return g_host->error(FT_ERR_DTYPE, "%s: storage type %d is not float32, float16 or bfloat16", op, (int)dt);
}

// f(T()) with T the storage type of dt: the one place an op's dtype becomes a template argument
template <typename F> inline ft_status with_dtype(ft_dtype dt, const char *op, F &&f) {
    switch (dt) {
    case FT_F32: return f(float());
    case FT_F16: return f(__half());
    case FT_BF16: return f(__nv_bfloat16());
    default: return dtype_error(dt, op);
    }
}

inline cudaDataType_t cuda_type(ft_dtype dt) {
    return dt == FT_F16 ? CUDA_R_16F : dt == FT_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

// Attention through cuDNN (attention_cudnn.cu): *ran = true when cuDNN ran the op, false when the
// caller's own kernels must (cuDNN absent, refused the configuration, or the emulator); an error
// only when cuDNN was asked and failed. window: the ops' (0 global; else |i - j| <= window / 2),
// cuDNN's diagonal band. cudnn_release frees the backend's cuDNN workspace.
ft_status cudnn_attention_forward(ft_backend *be, ft_dtype dt, void *ctx, const void *qkv, const int32_t *seqs,
                                  int64_t B, int64_t C, int64_t NH, int64_t window, bool *ran);
ft_status cudnn_attention_train_forward(ft_backend *be, ft_dtype prec, float *ctx, float *stats, const float *qkv,
                                        const int32_t *seqs, int64_t B, int64_t C, int64_t NH, int64_t window,
                                        bool *ran);
ft_status cudnn_attention_backward(ft_backend *be, ft_dtype prec, float *dqkv, const float *dctx, const float *qkv,
                                   const int32_t *seqs, int64_t B, int64_t C, int64_t NH, int64_t window, bool *ran);
void cudnn_release(cuda_ctx *c);

// release the cuBLASLt state of a backend (backend_cuda.cu's destroy)
void lt_release(cuda_ctx *c);
// rowops.cu in any storage type: h = act(h + bias) in place (bias may be NULL; act an
// ft_activation); out = LayerNorm(residual + y + bias) (residual and bias may be NULL)
ft_status act_rows(cuda_ctx *c, ft_dtype dt, void *h, const void *bias, int64_t N, int64_t I, int act);
ft_status layernorm_rows(cuda_ctx *c, ft_dtype dt, void *out, const void *residual, const void *y, const void *bias,
                         const void *gamma, const void *beta, int64_t N, int64_t C, float eps);

}  // namespace ftcuda

// cuda_<name> for every entry of the op list (backend.h): services in backend_cuda.cu, encoder
// ops in rowops.cu and attention.cu, training ops in train_ops.cu and optim.cu
#define FT_CUDA_SERVICE(ret, name, params) ret cuda_##name params;
#define FT_CUDA_OP(name, params, args) ft_status cuda_##name params;
FT_BACKEND_SERVICES(FT_CUDA_SERVICE)
FT_BACKEND_OPS(FT_CUDA_OP)
#undef FT_CUDA_SERVICE
#undef FT_CUDA_OP

#endif
