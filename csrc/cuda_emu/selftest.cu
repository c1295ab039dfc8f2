// fasttran's CUDA emulator: kernels that exercise the emulator itself (barriers, warp intrinsics,
// exits, deadlock and barrier checks, guard pages, half types, wmma, the cuBLAS shims), exported
// as ftemu_selftest_* for tests/test_cuda_emulator.py. Written as ordinary CUDA, so the same
// file would build with nvcc (the emulator-only checks aside).
#include <cstdio>
#include <cstring>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#ifndef FT_LAUNCH
#define FT_LAUNCH(kernel, grid, block, shmem, stream) kernel<<<(grid), (block), (shmem), (stream)>>>
#endif

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {

char g_message[4096];

// the result of a self-test: 0, or the error with its message; the pending error is cleared so
// that a deliberate failure does not surface in a later, unrelated call
int report(cudaError_t e) {
    snprintf(g_message, sizeof g_message, "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
    cudaGetLastError();
    return (int)e;
}

// ---- a block reduction (two barriers per level) and a warp-shuffle reduction --------------------
__global__ void block_sum_kernel(const float *x, float *out, int n) {
    __shared__ float sh[1024];
    const int t = threadIdx.x;
    sh[t] = t < n ? x[blockIdx.x * n + t] : 0.0f;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (t < w) sh[t] += sh[t + w];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = sh[0];
}

// every shuffle flavour, per lane: out[lane * 8 + k]
__global__ void shuffle_kernel(const int *x, int *out, int width) {
    const int lane = threadIdx.x & 31;
    int v = x[threadIdx.x];
    int *o = out + threadIdx.x * 8;
    o[0] = __shfl_sync(0xffffffffu, v, 5, width);
    o[1] = __shfl_up_sync(0xffffffffu, v, 3, width);
    o[2] = __shfl_down_sync(0xffffffffu, v, 3, width);
    o[3] = __shfl_xor_sync(0xffffffffu, v, 6, width);
    o[4] = (int)__ballot_sync(0xffffffffu, v & 1);
    o[5] = __any_sync(0xffffffffu, v == 7);
    o[6] = __all_sync(0xffffffffu, v >= 0);
    o[7] = __reduce_add_sync(0xffffffffu, v);
    (void)lane;
}

// half-warp groups shuffle independently (masks 0x0000ffff and 0xffff0000)
__global__ void half_warp_kernel(const float *x, float *out) {
    const int lane = threadIdx.x & 31;
    const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    float v = x[threadIdx.x];
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
    out[threadIdx.x] = v;
}

// threads past n return early; the rest meet at barriers (exited threads leave them)
__global__ void early_exit_kernel(float *x, int n) {
    __shared__ float sh[256];
    const int t = threadIdx.x;
    if (t >= n) return;
    sh[t] = x[t];
    __syncthreads();
    x[t] = sh[n - 1 - t];
}

// a shuffle inside a branch taken by half the warp, with a full mask, while the other half
// waits at a __syncthreads: no thread can make progress
__global__ void deadlock_kernel(float *x) {
    float v = x[threadIdx.x];
    if (threadIdx.x < 16) v += __shfl_xor_sync(0xffffffffu, v, 1);
    else __syncthreads();
    x[threadIdx.x] = v;
}

// __syncthreads in a branch: half the block waits at one barrier, half at another
__global__ void divergent_barrier_kernel(float *x) {
    __shared__ float sh[64];
    const int t = threadIdx.x;
    sh[t] = x[t];
    if (t < 32) __syncthreads();
    else __syncthreads();
    x[t] = sh[63 - t];
}

// a missing barrier: each thread reads what a higher-numbered thread writes, without waiting
__global__ void missing_barrier_kernel(float *x) {
    __shared__ float sh[128];
    const int t = threadIdx.x;
    sh[t] = x[t] * 2.0f;
    x[t] = sh[(t + 32) % 128];   // needs a __syncthreads() between the two lines
}

// reads one element past the end of x
__global__ void past_end_kernel(const float *x, float *out, int n) {
    float s = 0.0f;
    for (int i = 0; i <= n; i++) s += x[i];
    out[0] = s;
}

// writes one element past the end of out, into the bytes before its page
__global__ void write_past_end_kernel(float *out, int n) { out[n] = 1.0f; }

__global__ void convert_kernel(const float *x, unsigned short *h, unsigned short *b, float *hf, float *bf, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        h[i] = __half_as_ushort(__float2half(x[i]));
        b[i] = __bfloat16_as_ushort(__float2bfloat16(x[i]));
    }
    for (int i = threadIdx.x; i < 65536; i += blockDim.x) {   // every 16-bit pattern back to float
        hf[i] = __half2float(__ushort_as_half((unsigned short)i));
        bf[i] = __bfloat162float(__ushort_as_bfloat16((unsigned short)i));
    }
}

using namespace nvcuda;

// C (16 x 16, fp32) = A (16 x 16, fp16, row-major) B (16 x 16, fp16, col-major) + C
__global__ void wmma_half_kernel(const __half *A, const __half *B, float *C) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::load_matrix_sync(a, A, 16);
    wmma::load_matrix_sync(b, B, 16);
    wmma::load_matrix_sync(c, C, 16, wmma::mem_row_major);
    wmma::mma_sync(c, a, b, c);
    wmma::store_matrix_sync(C, c, 16, wmma::mem_row_major);
}

// C (16 x 16) = A (16 x 8, tf32) B (8 x 16, tf32), both row-major
__global__ void wmma_tf32_kernel(const float *A, const float *B, float *C) {
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 8, float> c;
    wmma::fill_fragment(c, 0.0f);
    wmma::load_matrix_sync(a, A, 8);
    wmma::load_matrix_sync(b, B, 16);
    for (int i = 0; i < a.num_elements; i++) a.x[i] = wmma::__float_to_tf32(a.x[i]);
    for (int i = 0; i < b.num_elements; i++) b.x[i] = wmma::__float_to_tf32(b.x[i]);
    wmma::mma_sync(c, a, b, c);
    wmma::store_matrix_sync(C, c, 16, wmma::mem_row_major);
}

// a 16 x 16 fp16 load from A + offset with leading dimension ldm (alignment rules)
__global__ void wmma_operand_kernel(const __half *A, int offset, int ldm, float *C) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::load_matrix_sync(a, A + offset, (unsigned)ldm);
    wmma::fill_fragment(c, (float)a.x[0]);
    wmma::store_matrix_sync(C, c, 16, wmma::mem_row_major);
}

template <typename T> T *to_device(const T *host, size_t n) {
    T *d = nullptr;
    if (cudaMalloc(&d, n * sizeof(T) + 1) != cudaSuccess) return nullptr;
    if (host) cudaMemcpy(d, host, n * sizeof(T), cudaMemcpyHostToDevice);
    return d;
}

}  // namespace

EXPORT const char *ftemu_selftest_message(void) { return g_message; }

// 1 when built with AddressSanitizer, which reports faults itself (no guard-page recovery then)
EXPORT int ftemu_selftest_sanitized(void) {
#if defined(__SANITIZE_ADDRESS__)
    return 1;
#else
    return 0;
#endif
}

// out[b] = sum of x[b * n .. b * n + n), nblocks blocks of `threads` threads
EXPORT int ftemu_selftest_block_sum(const float *x, float *out, int nblocks, int threads, int n) {
    cudaGetLastError();
    float *dx = to_device(x, (size_t)nblocks * n), *dout = to_device<float>(nullptr, nblocks);
    FT_LAUNCH(block_sum_kernel, nblocks, threads, 0, 0)(dx, dout, n);
    cudaError_t e = cudaGetLastError();
    cudaMemcpy(out, dout, nblocks * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(dx);
    cudaFree(dout);
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

EXPORT int ftemu_selftest_shuffles(const int *x, int *out, int threads, int width) {
    cudaGetLastError();
    int *dx = to_device(x, threads), *dout = to_device<int>(nullptr, (size_t)threads * 8);
    FT_LAUNCH(shuffle_kernel, 1, threads, 0, 0)(dx, dout, width);
    cudaError_t e = cudaGetLastError();
    cudaMemcpy(out, dout, (size_t)threads * 8 * sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(dx);
    cudaFree(dout);
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

EXPORT int ftemu_selftest_half_warp(const float *x, float *out) {
    cudaGetLastError();
    float *dx = to_device(x, 32), *dout = to_device<float>(nullptr, 32);
    FT_LAUNCH(half_warp_kernel, 1, 32, 0, 0)(dx, dout);
    cudaError_t e = cudaGetLastError();
    cudaMemcpy(out, dout, 32 * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(dx);
    cudaFree(dout);
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

EXPORT int ftemu_selftest_early_exit(float *x, int threads, int n) {
    cudaGetLastError();
    float *dx = to_device(x, threads);
    FT_LAUNCH(early_exit_kernel, 1, threads, 0, 0)(dx, n);
    cudaError_t e = cudaGetLastError();
    cudaMemcpy(x, dx, threads * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(dx);
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

// kind: 0 deadlock, 1 divergent barrier, 2 missing barrier; returns the launch's error
EXPORT int ftemu_selftest_broken(int kind, float *x) {
    cudaGetLastError();
    const int n = kind == 0 ? 32 : kind == 1 ? 64 : 128;
    float *dx = to_device(x, n);
    if (kind == 0) FT_LAUNCH(deadlock_kernel, 1, 32, 0, 0)(dx);
    else if (kind == 1) FT_LAUNCH(divergent_barrier_kernel, 1, 64, 0, 0)(dx);
    else FT_LAUNCH(missing_barrier_kernel, 1, 128, 0, 0)(dx);
    cudaError_t e = cudaGetLastError();
    cudaMemcpy(x, dx, n * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(dx);
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

// kind: 0 read past the end, 1 write past the end; the error of the launch or the next sync
EXPORT int ftemu_selftest_out_of_bounds(int kind, int n) {
    cudaGetLastError();
    float *dx = nullptr, *out = nullptr;
    cudaMalloc(&dx, n * sizeof(float));
    cudaMalloc(&out, n * sizeof(float));
    cudaMemset(dx, 0, n * sizeof(float));
    if (kind == 0) FT_LAUNCH(past_end_kernel, 1, 1, 0, 0)(dx, out, n);
    else FT_LAUNCH(write_past_end_kernel, 1, 1, 0, 0)(out, n);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    cudaFree(dx);
    cudaFree(out);
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

EXPORT int ftemu_selftest_bad_launch(void) {
    cudaGetLastError();
    float *dx = to_device<float>(nullptr, 64);
    FT_LAUNCH(block_sum_kernel, 1, 2048, 0, 0)(dx, dx, 1);   // more than 1024 threads
    cudaError_t e = cudaGetLastError();
    cudaFree(dx);
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

EXPORT int ftemu_selftest_convert(const float *x, unsigned short *h, unsigned short *b, float *hf, float *bf, int n) {
    cudaGetLastError();
    float *dx = to_device(x, n), *dhf = to_device<float>(nullptr, 65536), *dbf = to_device<float>(nullptr, 65536);
    unsigned short *dh = to_device<unsigned short>(nullptr, n), *db = to_device<unsigned short>(nullptr, n);
    FT_LAUNCH(convert_kernel, 1, 256, 0, 0)(dx, dh, db, dhf, dbf, n);
    cudaError_t e = cudaGetLastError();
    cudaMemcpy(h, dh, n * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(b, db, n * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(hf, dhf, 65536 * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(bf, dbf, 65536 * 4, cudaMemcpyDeviceToHost);
    cudaFree(dx); cudaFree(dh); cudaFree(db); cudaFree(dhf); cudaFree(dbf);
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

EXPORT int ftemu_selftest_wmma_half(const unsigned short *A, const unsigned short *B, float *C) {
    cudaGetLastError();
    __half *dA = to_device(reinterpret_cast<const __half *>(A), 256), *dB = to_device(reinterpret_cast<const __half *>(B), 256);
    float *dC = to_device(C, 256);
    FT_LAUNCH(wmma_half_kernel, 1, 32, 0, 0)(dA, dB, dC);
    cudaError_t e = cudaGetLastError();
    cudaMemcpy(C, dC, 256 * 4, cudaMemcpyDeviceToHost);
    cudaFree(dA); cudaFree(dB); cudaFree(dC);
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

EXPORT int ftemu_selftest_wmma_operand(int offset, int ldm) {
    cudaGetLastError();
    __half *dA = to_device<__half>(nullptr, 4096);
    float *dC = to_device<float>(nullptr, 256);
    FT_LAUNCH(wmma_operand_kernel, 1, 32, 0, 0)(dA, offset, ldm, dC);
    cudaError_t e = cudaGetLastError();
    cudaFree(dA); cudaFree(dC);
    return e == cudaSuccess ? 0 : report(e);
}

EXPORT int ftemu_selftest_wmma_tf32(const float *A, const float *B, float *C) {
    cudaGetLastError();
    float *dA = to_device(A, 128), *dB = to_device(B, 128), *dC = to_device<float>(nullptr, 256);
    FT_LAUNCH(wmma_tf32_kernel, 1, 32, 0, 0)(dA, dB, dC);
    cudaError_t e = cudaGetLastError();
    cudaMemcpy(C, dC, 256 * 4, cudaMemcpyDeviceToHost);
    cudaFree(dA); cudaFree(dB); cudaFree(dC);
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

// row-major D (M x N, bf16) = gelu(A (M x K, bf16) B^T (B: N x K, bf16) + bias (N, bf16)) through
// cublasLtMatmul with the GELU_AUX_BIAS epilogue (aux: the pre-activation, bf16), as a row-major
// caller writes it: column-major D^T = B A^T
EXPORT int ftemu_selftest_lt_gelu_bias(const unsigned short *A, const unsigned short *B, const unsigned short *bias,
                                       unsigned short *D, unsigned short *aux, int M, int N, int K) {
    cudaGetLastError();
    auto *dA = to_device(A, (size_t)M * K), *dB = to_device(B, (size_t)N * K), *dbias = to_device(bias, N);
    auto *dD = to_device<unsigned short>(nullptr, (size_t)M * N), *daux = to_device<unsigned short>(nullptr, (size_t)M * N);
    cublasLtHandle_t h;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtCreate(&h);
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    const void *bp = dbias;
    void *ap = daux;
    int64_t ald = N;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ap, sizeof ap);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ald, sizeof ald);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K);   // B as stored: column-major K x N
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K);   // A as stored: column-major K x M
    cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, N, M, N);   // D^T: column-major N x M
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulHeuristicResult_t res;
    int got = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &res, &got);
    const float alpha = 1.0f, beta = 0.0f;
    if (st == CUBLAS_STATUS_SUCCESS && got == 1)
        st = cublasLtMatmul(h, desc, &alpha, dB, la, dA, lb, &beta, dD, ld, dD, ld, &res.algo, nullptr, 0, 0);
    cudaError_t e = cudaDeviceSynchronize();
    cudaMemcpy(D, dD, (size_t)M * N * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(aux, daux, (size_t)M * N * 2, cudaMemcpyDeviceToHost);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(h);
    cudaFree(dA); cudaFree(dB); cudaFree(dbias); cudaFree(dD); cudaFree(daux);
    if (st != CUBLAS_STATUS_SUCCESS) { snprintf(g_message, sizeof g_message, "cuBLASLt status %d", (int)st); cudaGetLastError(); return 1000 + st; }
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}

// column-major C (m x n, fp16) = A (m x k, fp16) B (k x n, fp16) with fp32 compute (GemmEx), and a
// GEMM whose B operand reaches past its allocation (must fail at the next synchronisation)
EXPORT int ftemu_selftest_gemm_ex(const unsigned short *A, const unsigned short *B, unsigned short *C, int m, int n,
                                  int k, int overrun) {
    cudaGetLastError();
    auto *dA = to_device(A, (size_t)m * k), *dC = to_device<unsigned short>(nullptr, (size_t)m * n);
    unsigned short *dB = nullptr;
    cudaMalloc(&dB, (size_t)k * n * 2 - (overrun ? 2 : 0));
    cudaMemcpy(dB, B, (size_t)k * n * 2 - (overrun ? 2 : 0), cudaMemcpyHostToDevice);
    cublasHandle_t h;
    cublasCreate(&h);
    const float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t st = cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, dA, CUDA_R_16F, m, dB, CUDA_R_16F, k,
                                     &beta, dC, CUDA_R_16F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaError_t e = cudaDeviceSynchronize();
    cudaMemcpy(C, dC, (size_t)m * n * 2, cudaMemcpyDeviceToHost);
    cublasDestroy(h);
    cudaFree(dA); cudaFree(dB); cudaFree(dC);
    if (st != CUBLAS_STATUS_SUCCESS) { snprintf(g_message, sizeof g_message, "cuBLAS status %d", (int)st); cudaGetLastError(); return 1000 + st; }
    return e == cudaSuccess ? (cudaGetLastError(), 0) : report(e);
}
