// Shared pieces of the CUDA backend: the context, error helpers and block reductions.
#ifndef FT_CUDA_COMMON_CUH
#define FT_CUDA_COMMON_CUH
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "backend.h"

#ifndef FT_CUDA_EMU
// FT_LAUNCH(kernel, grid, block, shared bytes, stream)(arguments...): every launch site uses it, so
// the CUDA emulator (csrc/cuda_emu, FASTTRAN_CUDA=emu) can run the same source on the CPU
#define FT_LAUNCH(kernel, grid, block, shmem, stream) kernel<<<(grid), (block), (shmem), (stream)>>>
#endif

namespace ftcuda {

extern const ft_host_api *g_host;

struct cuda_ctx {
    int device;
    cudaStream_t stream;   // all work of this backend runs here (non-blocking)
    cublasHandle_t blas;
    char name[32];
    void *opt_plan;        // optimizer tables kept between steps, host images, workspace (optim.cu)
    void *train_ws;        // partial sums of the training ops (train_layer.cu), grown as needed
    size_t train_ws_bytes;
};

inline cuda_ctx *ctx_of(ft_backend *be) { return static_cast<cuda_ctx *>(be->ctx); }

// frees what cuda_optim_step keeps in the context (optim.cu)
void cuda_optim_release(cuda_ctx *c);

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
