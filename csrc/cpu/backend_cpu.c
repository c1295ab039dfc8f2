/* The CPU backend table: host memory, OpenBLAS GEMMs, the fused ops of rowops.c and
 * attention.c. */
#include <stdlib.h>
#include <string.h>

#include "blas.h"
#include "core/status.h"
#include "cpu_ops.h"

static ft_status cpu_alloc(ft_backend *be, size_t bytes, void **out) {
    (void)be;
    /* 64-byte alignment: full AVX-512 vectors and no false sharing between row blocks */
    size_t rounded = (bytes + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p) return ft_error(FT_ERR_NOMEM, "cannot allocate %zu bytes of host memory", bytes);
    *out = p;
    return FT_OK;
}

static void cpu_free(ft_backend *be, void *p) { (void)be; free(p); }

static ft_status cpu_copy(ft_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    if (bytes) memcpy(dst, src, bytes);
    return FT_OK;
}

static ft_status cpu_sync(ft_backend *be) { (void)be; return FT_OK; }
static void cpu_destroy(ft_backend *be) { (void)be; /* static table */ }

static ft_status cpu_gemm(ft_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                          float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                          float beta, float *C, int64_t ldc) {
    (void)be;
    if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "GEMM of %lld x %lld x %lld exceeds 32-bit BLAS indices",
                        (long long)M, (long long)N, (long long)K);
    ft_blas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                  (blasint)M, (blasint)N, (blasint)K, alpha, A, (blasint)lda, B, (blasint)ldb, beta, C,
                  (blasint)ldc);
    return FT_OK;
}

static ft_backend cpu_backend = {
    .abi = FT_BACKEND_ABI,
    .name = "cpu",
    .device = {FT_DEVICE_CPU, 0},
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy = cpu_copy,
    .synchronize = cpu_sync,
    .destroy = cpu_destroy,
    .gemm = cpu_gemm,
    .embed_ln_forward = cpu_embed_ln_forward,
    .broadcast_rows = cpu_broadcast_rows,
    .attention_forward = cpu_attention_forward,
    .attention_scratch_bytes = cpu_attention_scratch_bytes,
    .bias_act_forward = cpu_bias_act_forward,
    .dropout = cpu_dropout,
    .tanh_backward = cpu_tanh_backward,
    .softmax_xent = cpu_softmax_xent,
    .sum_axis = cpu_sum_axis,
    .optim_step = cpu_optim_step,
    .bias_residual_ln_forward = cpu_bias_residual_ln_forward,
    .pool_forward = cpu_pool_forward,
};

ft_backend *ft_backend_cpu(void) {
    ft_blas_use_openmp();
    return &cpu_backend;
}
