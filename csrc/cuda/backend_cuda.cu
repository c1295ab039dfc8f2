// The CUDA backend, built into libfasttran_cuda.so and opened at run time by core/backend.c.
//
// This file holds the context (device, own non-blocking stream, cuBLAS handle), memory, copies
// and the GEMM; the fused encoder ops live in rowops.cu and attention.cu. All work is queued on
// the backend's stream; `synchronize` is the only host wait on the forward path.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_common.cuh"

#include <pthread.h>

namespace ftcuda {
const ft_host_api *g_host;

// one cuBLAS handle per device (a handle holds workspace and library state: one per encoder was
// 143 MB on an H100), shared by every backend of the device, counted, destroyed with the last
struct device_blas {
    pthread_mutex_t use;   // held while a backend's calls are queued on the handle
    cublasHandle_t h;
    int refs;
};
static device_blas g_blas[64];
static pthread_mutex_t g_blas_lock = PTHREAD_MUTEX_INITIALIZER;

static ft_status blas_acquire(int device, device_blas **out) {
    if (device < 0 || device >= 64) return g_host->error(FT_ERR_DEVICE, "CUDA device %d out of range", device);
    pthread_mutex_lock(&g_blas_lock);
    device_blas *d = &g_blas[device];
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (d->refs == 0) {
        st = cublasCreate(&d->h);
        if (st == CUBLAS_STATUS_SUCCESS) pthread_mutex_init(&d->use, nullptr);
    }
    if (st == CUBLAS_STATUS_SUCCESS) d->refs++;
    pthread_mutex_unlock(&g_blas_lock);
    if (st != CUBLAS_STATUS_SUCCESS) return blas_fail(st, "cublasCreate");
    *out = d;
    return FT_OK;
}

static void blas_release(device_blas *d) {
    pthread_mutex_lock(&g_blas_lock);
    if (--d->refs == 0) {
        cublasDestroy(d->h);
        pthread_mutex_destroy(&d->use);
    }
    pthread_mutex_unlock(&g_blas_lock);
}

blas_use::blas_use(cuda_ctx *c) : h(c->blas->h), status(FT_OK), d(c->blas) {
    pthread_mutex_lock(&d->use);
    cublasStatus_t st = cublasSetStream(h, c->stream);
    if (st == CUBLAS_STATUS_SUCCESS)   // true fp32 unless the backend asked for TF32
        st = cublasSetMathMode(h, c->tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH);
    if (st != CUBLAS_STATUS_SUCCESS) status = blas_fail(st, "binding the cuBLAS handle to the stream");
}

blas_use::~blas_use() { pthread_mutex_unlock(&d->use); }
}  // namespace ftcuda
using namespace ftcuda;

#define CU FT_CU

ft_status cuda_alloc(ft_backend *be, size_t bytes, void **out) {
    CU(cudaSetDevice(ctx_of(be)->device), "cudaSetDevice");
    cudaError_t e = cudaMalloc(out, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        // cudaGetLastError would report this failure at the next launch check (stale): clear it
        cudaGetLastError();
        *out = nullptr;
        return g_host->error(e == cudaErrorMemoryAllocation ? FT_ERR_NOMEM : FT_ERR_DEVICE,
                             "cannot allocate %zu bytes on %s: %s", bytes, ctx_of(be)->name,
                             cudaGetErrorString(e));
    }
    return FT_OK;
}

void cuda_free(ft_backend *be, void *p) {
    cudaSetDevice(ctx_of(be)->device);
    cudaFree(p);
}

ft_status cuda_upload(ft_backend *be, void *dst, const void *src, size_t bytes) {
    CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx_of(be)->stream), "upload");
    return FT_OK;
}

ft_status cuda_download(ft_backend *be, void *dst, const void *src, size_t bytes) {
    CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx_of(be)->stream), "download");
    CU(cudaStreamSynchronize(ctx_of(be)->stream), "download");
    return FT_OK;
}

ft_status cuda_set_tf32(ft_backend *be, int on) {
    ctx_of(be)->tf32 = on != 0;
    return FT_OK;
}

ft_status cuda_memory_info(ft_backend *be, size_t *free_bytes, size_t *total_bytes, size_t *own_bytes) {
    cuda_ctx *c = ctx_of(be);
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    CU(cudaMemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo");
    *own_bytes = cuda_optim_device_bytes(c) + c->train_ws_bytes + c->round_ws_bytes + c->cudnn_ws_bytes +
                 (c->lt_ws ? ftcuda::LT_WORKSPACE : 0);
    return FT_OK;
}

ft_status cuda_synchronize(ft_backend *be) {
    CU(cudaStreamSynchronize(ctx_of(be)->stream), "cudaStreamSynchronize");
    return FT_OK;
}

void cuda_destroy(ft_backend *be) {
    cuda_ctx *c = ctx_of(be);
    cudaSetDevice(c->device);
    cuda_optim_release(c);
    if (c->train_ws) cudaFree(c->train_ws);
    if (c->round_ws) cudaFree(c->round_ws);
    cudnn_release(c);
    lt_release(c);
    blas_release(c->blas);
    cudaStreamDestroy(c->stream);
    free(c);
    free(be);
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
ft_status cuda_gemm(ft_backend *be, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha,
                    const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                    int64_t ldc) {
    blas_use blas(ctx_of(be));
    FT_TRY(blas.status);
    cublasStatus_t st = cublasSgemm(blas.h, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha, B,
                                    (int)ldb, A, (int)lda, &beta, C, (int)ldc);
    if (st != CUBLAS_STATUS_SUCCESS) return blas_fail(st, "cublasSgemm");
    return FT_OK;
}

// float32 operands rounded to bf16 / fp16 (nearest even: round_operands), products on tensor cores,
// float32 sums: mixed-precision training's GEMMs
ft_status cuda_gemm_prec(ft_backend *be, ft_dtype prec, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha,
                         const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (prec == FT_F32) return cuda_gemm(be, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    if (prec != FT_BF16 && prec != FT_F16) return dtype_error(prec, "gemm_prec");
    blas_use blas(ctx_of(be));
    FT_TRY(blas.status);
    // stored shapes: A is (M, K), or (K, M) when transposed; B (K, N), or (N, K)
    const int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    void *ha, *hb;
    FT_TRY(round_operands(be, prec, A, ar, ac, lda, B, br, bc, ldb, &ha, &hb));
    cublasStatus_t st = cublasGemmEx(blas.h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N,
                                     (int)M, (int)K, &alpha, hb, half_type(prec), (int)(bc > 1 ? bc : 1), ha,
                                     half_type(prec), (int)(ac > 1 ? ac : 1), &beta, C, CUDA_R_32F, (int)ldc,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) return blas_fail(st, "cublasGemmEx");
    return FT_OK;
}

namespace {
template <typename H> __device__ inline H round_half(float x);
template <> __device__ inline __nv_bfloat16 round_half<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ inline __half round_half<__half>(float x) { return __float2half_rn(x); }

// dst (rows, cols) packed = src (rows, cols) with leading dimension ld, rounded to nearest even
template <typename H>
__global__ void round_block_kernel(H *dst, const float *src, int64_t rows, int64_t cols, int64_t ld) {
    const int64_t n = rows * cols;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / cols, col = i - r * cols;
        dst[i] = round_half<H>(src[r * ld + col]);
    }
}

ft_status round_block(cuda_ctx *c, ft_dtype prec, void *dst, const float *src, int64_t rows, int64_t cols,
                      int64_t ld) {
    const int64_t n = rows * cols;
    if (n <= 0) return FT_OK;
    if (prec == FT_BF16)
        FT_LAUNCH(round_block_kernel<__nv_bfloat16>, grid_of(n, 256), 256, 0, c->stream)(
            static_cast<__nv_bfloat16 *>(dst), src, rows, cols, ld);
    else
        FT_LAUNCH(round_block_kernel<__half>, grid_of(n, 256), 256, 0, c->stream)(static_cast<__half *>(dst), src, rows,
                                                                                   cols, ld);
    return launched("rounding to half precision");
}
}  // namespace

ft_status ftcuda::round_operands(ft_backend *be, ft_dtype prec, const float *a, int64_t a_rows, int64_t a_cols,
                                 int64_t lda, const float *b, int64_t b_rows, int64_t b_cols, int64_t ldb, void **ha,
                                 void **hb) {
    cuda_ctx *c = ctx_of(be);
    const size_t na = (size_t)(a_rows * a_cols), nb = (size_t)(b_rows * b_cols);
    const size_t a_bytes = (na * 2 + 255) & ~(size_t)255, bytes = a_bytes + nb * 2 + 2;
    if (c->round_ws_bytes < bytes) {
        // the stream may still be reading the old copies
        FT_CU(cudaStreamSynchronize(c->stream), "rounding workspace");
        if (c->round_ws) cuda_free(be, c->round_ws);
        c->round_ws = nullptr;
        c->round_ws_bytes = 0;
        const size_t want = bytes + bytes / 4;   // some room: the next batch is often a little longer
        FT_TRY(cuda_alloc(be, want, &c->round_ws));
        c->round_ws_bytes = want;
    }
    *ha = c->round_ws;
    *hb = static_cast<char *>(c->round_ws) + a_bytes;
    FT_TRY(round_block(c, prec, *ha, a, a_rows, a_cols, lda));
    return round_block(c, prec, *hb, b, b_rows, b_cols, ldb);
}

// device-to-device copy on the backend's stream (outputs kept on the device)
ft_status cuda_copy(ft_backend *be, void *dst, const void *src, size_t bytes) {
    CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx_of(be)->stream), "device copy");
    return FT_OK;
}

extern "C" {

__attribute__((visibility("default"))) const char *ft_cuda_build_info(void) {
    static char buf[128];
    snprintf(buf, sizeof buf, "CUDA %d.%d, cuBLAS %d.%d.%d", CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10,
             CUBLAS_VER_MAJOR, CUBLAS_VER_MINOR, CUBLAS_VER_PATCH);
    return buf;
}

__attribute__((visibility("default"))) ft_status ft_cuda_probe_devices(const ft_host_api *host, int *count,
                                                                       char *desc, size_t len) {
    g_host = host;
    *count = 0;
    cudaError_t e = cudaGetDeviceCount(count);
    if (e != cudaSuccess) {
        *count = 0;
        return host->error(FT_ERR_DEVICE, "no usable CUDA device: %s", cudaGetErrorString(e));
    }
    if (len) desc[0] = '\0';
    size_t used = 0;
    for (int d = 0; d < *count && used + 1 < len; d++) {
        cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
        int n = snprintf(desc + used, len - used, "%s%d: %s (sm_%d%d, %.1f GiB)", d ? "; " : "", d, p.name,
                         p.major, p.minor, (double)p.totalGlobalMem / (1u << 30));
        if (n < 0) break;
        used += (size_t)n;
    }
    return FT_OK;
}

__attribute__((visibility("default"))) ft_status ft_cuda_backend_open(const ft_host_api *host, int index,
                                                                      ft_backend **out) {
    g_host = host;
    *out = nullptr;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) return host->error(FT_ERR_DEVICE, "no usable CUDA device: %s", cudaGetErrorString(e));
    if (index < 0 || index >= count)
        return host->error(FT_ERR_DEVICE, "CUDA device %d requested but %d device(s) present", index, count);
    cuda_ctx *c = static_cast<cuda_ctx *>(calloc(1, sizeof(cuda_ctx)));
    ft_backend *be = static_cast<ft_backend *>(calloc(1, sizeof(ft_backend)));
    if (!c || !be) { free(c); free(be); return host->error(FT_ERR_NOMEM, "out of memory"); }
    c->device = index;
    snprintf(c->name, sizeof c->name, "cuda:%d", index);
    if ((e = cudaSetDevice(index)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        free(c); free(be);
        return cuda_fail(e, "opening the device");
    }
    if ((e = cudaDeviceGetAttribute(&c->cc_major, cudaDevAttrComputeCapabilityMajor, index)) != cudaSuccess) {
        cudaStreamDestroy(c->stream);
        free(c); free(be);
        return cuda_fail(e, "reading the compute capability");
    }
    ft_status fs = blas_acquire(index, &c->blas);   // true fp32 (tf32 = 0) unless set_tf32
    if (fs != FT_OK) {
        cudaStreamDestroy(c->stream);
        free(c); free(be);
        return fs;
    }
    be->abi = FT_BACKEND_ABI;
    be->name = c->name;
    be->device.kind = FT_DEVICE_CUDA;
    be->device.index = index;
    be->ctx = c;
    be->stream = reinterpret_cast<uintptr_t>(c->stream);
#define FT_CUDA_SERVICE_INIT(ret, name, params) be->name = cuda_##name;
#define FT_CUDA_OP_INIT(name, params, args) be->name = cuda_##name;
    FT_BACKEND_SERVICES(FT_CUDA_SERVICE_INIT)
    FT_BACKEND_OPS(FT_CUDA_OP_INIT)
#undef FT_CUDA_SERVICE_INIT
#undef FT_CUDA_OP_INIT
    *out = be;
    return FT_OK;
}

}  // extern "C"
