/* The CPU backend table: host memory, GEMMs (OpenBLAS, or AMX where linear.c takes them), the fused ops of rowops.c and
 * attention.c. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "blas.h"
#include "core/dtype.h"
#include "core/status.h"
#include "cpu_ops.h"
#include "dist/shared.h"

ft_status cpu_alloc(ft_backend *be, size_t bytes, void **out) {
    (void)be;
    /* 64-byte alignment: full AVX-512 vectors and no false sharing between row blocks */
    size_t rounded = (bytes + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p) return ft_error(FT_ERR_NOMEM, "cannot allocate %zu bytes of host memory", bytes);
    *out = p;
    return FT_OK;
}

/* host memory: aligned_alloc's, or a gradient table in shared memory (dist/shared.h) */
void cpu_free(ft_backend *be, void *p) {
    (void)be;
    if (!ft_shared_free(p)) free(p);
}

ft_status cpu_copy(ft_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    if (bytes) memcpy(dst, src, bytes);
    return FT_OK;
}

/* host memory is the backend's memory: uploads and downloads are copies */
ft_status cpu_upload(ft_backend *be, void *dst, const void *host_src, size_t bytes) {
    return cpu_copy(be, dst, host_src, bytes);
}
ft_status cpu_download(ft_backend *be, void *host_dst, const void *src, size_t bytes) {
    return cpu_copy(be, host_dst, src, bytes);
}

ft_status cpu_synchronize(ft_backend *be) { (void)be; return FT_OK; }

ft_status cpu_set_tf32(ft_backend *be, int on) { (void)be; (void)on; return FT_OK; }

ft_status cpu_memory_info(ft_backend *be, size_t *free_bytes, size_t *total_bytes, size_t *own_bytes) {
    (void)be;
    const long page = sysconf(_SC_PAGESIZE), avail = sysconf(_SC_AVPHYS_PAGES), total = sysconf(_SC_PHYS_PAGES);
    *free_bytes = page > 0 && avail > 0 ? (size_t)page * (size_t)avail : 0;
    *total_bytes = page > 0 && total > 0 ? (size_t)page * (size_t)total : 0;
    *own_bytes = 0;
    return FT_OK;
}
void cpu_destroy(ft_backend *be) { (void)be; /* static table */ }

ft_status cpu_gemm(ft_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                          float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                          float beta, float *C, int64_t ldc) {
    (void)be;
    if (ft_cpu_gemm_on_amx(M, N, K))
        return ft_cpu_amx_gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, 0);
    if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "GEMM of %lld x %lld x %lld exceeds 32-bit BLAS indices",
                        (long long)M, (long long)N, (long long)K);
    ft_blas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                  (blasint)M, (blasint)N, (blasint)K, alpha, A, (blasint)lda, B, (blasint)ldb, beta, C,
                  (blasint)ldc);
    return FT_OK;
}

ft_status ft_cpu_check_prec(ft_dtype prec, const char *op) {
    if (prec == FT_F32 || prec == FT_BF16 || prec == FT_F16) return FT_OK;
    return ft_error(FT_ERR_INVALID_ARGUMENT, "%s: the products' precision must be float32, bfloat16 or float16, got %s",
                    op, ft_dtype_name(prec));
}

/* The region of a row-major operand a GEMM reads, rounded to prec into a packed copy (ld = cols),
 * rows in parallel. */
static float *rounded_copy(const float *X, int64_t rows, int64_t cols, int64_t ld, ft_dtype prec) {
    float *r = malloc((size_t)(rows * cols > 0 ? rows * cols : 1) * sizeof *r);
    if (!r) return NULL;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (rows * cols > 65536)
    for (int64_t i = 0; i < rows; i++) ft_cpu_round_row(r + i * cols, X + i * ld, cols, prec);
    return r;
}

/* Half-precision products as the GPU's tensor cores compute them (inputs rounded, products exact,
 * float32 sums). bf16 on AMX: the tiles' own bf16 products (one term of the bf16x6 split); bf16 on
 * AVX512_BF16 without AMX: vdpbf16ps over bf16 panels (lowp_ops.c); these are the fast paths of
 * mixed-precision training on such CPUs. Otherwise the inputs are rounded into copies and
 * multiplied in float32: a reference for tests (the CUDA op is checked against it), no faster
 * than float32. Every path equals that reference up to the order of the float32 sums. */
ft_status cpu_gemm_prec(ft_backend *be, ft_dtype prec, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                        float alpha, const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                        int64_t ldc) {
    FT_TRY(ft_cpu_check_prec(prec, "gemm_prec"));
    if (prec == FT_F32) return cpu_gemm(be, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    if (M <= 0 || N <= 0) return FT_OK;
    if (prec == FT_BF16 && ft_cpu_gemm_on_amx(M, N, K))
        return ft_cpu_amx_gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, 1);
    if (prec == FT_BF16 && ft_cpu_bf16_gemm_fast(M, N, K))
        return ft_cpu_bf16_gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    const int64_t ar = trans_a ? K : M, ac = trans_a ? M : K, br = trans_b ? N : K, bc = trans_b ? K : N;
    float *a = rounded_copy(A, ar, ac, lda, prec), *b = a ? rounded_copy(B, br, bc, ldb, prec) : NULL;
    ft_status st = a && b ? cpu_gemm(be, trans_a, trans_b, M, N, K, alpha, a, ac, b, bc, beta, C, ldc)
                          : ft_error(FT_ERR_NOMEM, "out of memory");
    free(a);
    free(b);
    return st;
}

#define FT_CPU_SERVICE_INIT(ret, name, params) .name = cpu_##name,
#define FT_CPU_OP_INIT(name, params, args) .name = cpu_##name,
static ft_backend cpu_backend = {
    .abi = FT_BACKEND_ABI,
    .name = "cpu",
    .device = {FT_DEVICE_CPU, 0},
    FT_BACKEND_SERVICES(FT_CPU_SERVICE_INIT)
    FT_BACKEND_OPS(FT_CPU_OP_INIT)
};
#undef FT_CPU_SERVICE_INIT
#undef FT_CPU_OP_INIT

ft_backend *ft_backend_cpu(void) {
    ft_blas_use_openmp();
    return &cpu_backend;
}
