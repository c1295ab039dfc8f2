/* The CPU backend's reduced-precision ops (backend.h, "reduced precision"): weights quantized or rounded and
 * packed once, activations quantized (int8) or rounded (bf16) per row as a layer runs, the product
 * on linear.c's tasks with lowp.c's micro-kernels; and gemm_prec's bf16 products on AVX512_BF16. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "cpu_ops.h"
#include "kernels.h"
#include "lowp.h"
#include "rowfun.h"

/* ---- the calling thread's buffers, grown on demand, freed at thread exit -------------------------
 * SCRATCH_ROWS: prepared rows; SCRATCH_PACKED: gemm_prec's packed op(B); SCRATCH_PRODUCT: its product
 * before alpha and beta. Up to SCRATCH_KEEP bytes stay between calls (a training step's products
 * reuse them instead of faulting in fresh pages); a larger request is allocated and freed per call. */
enum { SCRATCH_ROWS, SCRATCH_PACKED, SCRATCH_PRODUCT, SCRATCH_SLOTS };
#define SCRATCH_KEEP ((size_t)64 << 20)
typedef struct {
    void *p[SCRATCH_SLOTS];
    size_t bytes[SCRATCH_SLOTS];
} scratch_buf;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void scratch_free(void *v) {
    scratch_buf *b = v;
    for (int i = 0; i < SCRATCH_SLOTS; i++) free(b->p[i]);
    free(b);
}
static void scratch_make_key(void) { pthread_key_create(&scratch_key, scratch_free); }

/* slot's buffer of at least `bytes` (64-byte aligned), or NULL; *to_free: what the caller frees
 * after use (the buffer when larger than SCRATCH_KEEP, else NULL) */
static void *thread_scratch(int slot, size_t bytes, void **to_free) {
    bytes = (bytes + 63) & ~(size_t)63;
    *to_free = NULL;
    if (bytes > SCRATCH_KEEP) return *to_free = aligned_alloc(64, bytes);
    pthread_once(&scratch_once, scratch_make_key);
    scratch_buf *b = pthread_getspecific(scratch_key);
    if (!b) {
        b = calloc(1, sizeof *b);
        if (!b || pthread_setspecific(scratch_key, b) != 0) {
            free(b);
            return NULL;
        }
    }
    if (b->bytes[slot] < bytes) {
        free(b->p[slot]);
        b->bytes[slot] = 0;
        b->p[slot] = aligned_alloc(64, bytes);
        if (!b->p[slot]) return NULL;
        b->bytes[slot] = bytes;
    }
    return b->p[slot];
}

/* ---- checks at the op boundary ------------------------------------------------------------------ */
static ft_status kernel_for(ft_dtype wt, const char *op, const ft_lp_kernel **out) {
    if (wt != FT_I8 && wt != FT_BF16)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "%s: the weights' type must be int8 or bfloat16, got %s", op,
                        ft_dtype_name(wt));
    *out = ft_lp_kernel_for(wt);
    if (!*out)
        return ft_error(FT_ERR_UNSUPPORTED, "%s: bfloat16 products need a CPU with AVX512_BF16 (Intel Cooper Lake, "
                        "Sapphire Rapids or later; AMD Zen 4 or later), and this one runs the '%s' kernels without "
                        "avx512_bf16; use float32 here", op, ft_cpu_isa());
    return FT_OK;
}

static ft_status check_k(const ft_lp_kernel *kl, int64_t K, const char *op) {
    if (kl->wt == FT_I8 && K > FT_LP_MAX_K)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "%s: K = %lld; int8 products take K <= %d (their int32 sums must "
                        "not overflow)", op, (long long)K, FT_LP_MAX_K);
    return FT_OK;
}

size_t cpu_packed_weight_lp_bytes(ft_backend *be, ft_dtype wt, int64_t N, int64_t K) {
    (void)be;
    const ft_lp_kernel *kl = wt == FT_I8 || wt == FT_BF16 ? ft_lp_kernel_for(wt) : NULL;
    return kl ? ft_lp_layout_of(kl, N, K).bytes : 0;
}

int cpu_linear_lp_pays(ft_backend *be, ft_dtype wt) {
    (void)be;
    const ft_lp_kernel *kl = wt == FT_I8 || wt == FT_BF16 ? ft_lp_kernel_for(wt) : NULL;
    return kl && kl->pays;
}

/* ---- quantization ---------------------------------------------------------------------------- */
ft_status cpu_quantize_weight(ft_backend *be, int8_t *q, float *scale, const float *w, int64_t N, int64_t K) {
    (void)be;
    return ft_lp_quantize_weight(q, scale, w, N, K, "quantize_weight");
}

ft_status cpu_quantize_rows(ft_backend *be, uint8_t *q, float *scale, int32_t *zero_point, const float *x, int64_t M,
                            int64_t K) {
    (void)be;
#pragma omp parallel for schedule(dynamic, 16) num_threads(ft_num_threads()) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) ft_lp_quantize_row(x + m * K, K, q + m * K, scale + m, zero_point + m);
    return FT_OK;
}

/* ---- packing ---------------------------------------------------------------------------------- */
ft_status cpu_pack_weight_i8(ft_backend *be, void *packed, const int8_t *q, const float *scale, int64_t N, int64_t K) {
    (void)be;
    const ft_lp_kernel *kl = ft_lp_kernel_for(FT_I8);
    FT_TRY(check_k(kl, K, "pack_weight_i8"));
    const int64_t panels = (N + FT_LP_PANEL - 1) / FT_LP_PANEL;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * K > 65536)
    for (int64_t p = 0; p < panels; p++) ft_lp_pack_panel_i8(kl, packed, q, scale, N, K, p);
    return FT_OK;
}

static void pack_bf16(const ft_lp_kernel *kl, void *packed, const float *w, int64_t ld, int kmajor, int64_t N,
                      int64_t K) {
    const int64_t panels = (N + FT_LP_PANEL - 1) / FT_LP_PANEL;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * K > 65536)
    for (int64_t p = 0; p < panels; p++) ft_lp_pack_panel_bf16(kl, packed, w, ld, kmajor, N, K, p);
}

ft_status cpu_pack_weight_bf16(ft_backend *be, void *packed, const float *w, int64_t N, int64_t K) {
    (void)be;
    const ft_lp_kernel *kl;
    FT_TRY(kernel_for(FT_BF16, "pack_weight_bf16", &kl));
    pack_bf16(kl, packed, w, K, 0, N, K);
    return FT_OK;
}

/* ---- products ---------------------------------------------------------------------------------- */
/* the prepared rows of x (M, K) (line-major, row stride ld, or k-major) in the calling thread's
 * scratch, rows in parallel */
static ft_status prepare(const ft_lp_kernel *kl, ft_lp_rows *r, const float *x, int64_t ld, int kmajor, int64_t M,
                         int64_t K, void **to_free) {
    void *mem = thread_scratch(SCRATCH_ROWS, ft_lp_rows_bytes(kl, M, K), to_free);
    if (!mem) return ft_error(FT_ERR_NOMEM, "out of memory for the prepared rows of a %lld x %lld product", (long long)M,
                              (long long)K);
    ft_lp_rows_init(r, kl, mem, M, K);
    const int64_t chunks = r->Mp / FT_LP_GATHER;
    int failed = 0;
#pragma omp parallel num_threads(ft_num_threads()) if (M * K > 32768)
    {
        float *tmp = kmajor ? malloc((size_t)FT_LP_GATHER * (size_t)K * sizeof(float)) : NULL;
        if (kmajor && !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++)
            if (!kmajor || tmp)
                ft_lp_prepare_rows(kl, r, x, ld, kmajor, M, K, c * FT_LP_GATHER, (c + 1) * FT_LP_GATHER, tmp);
        free(tmp);
    }
    if (failed) return ft_error(FT_ERR_NOMEM, "out of memory gathering a transposed operand");
    return FT_OK;
}

ft_status cpu_gemm_i8(ft_backend *be, int32_t *C, const uint8_t *A, const int32_t *zero_point, const void *w_packed,
                      int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldc) {
    (void)be;
    const ft_lp_kernel *kl = ft_lp_kernel_for(FT_I8);
    FT_TRY(check_k(kl, K, "gemm_i8"));
    if (M <= 0 || N <= 0) return FT_OK;
    if (lda < K || ldc < N) return ft_error(FT_ERR_INVALID_ARGUMENT, "gemm_i8: lda %lld < K %lld or ldc %lld < N %lld",
                                            (long long)lda, (long long)K, (long long)ldc, (long long)N);
    ft_lp_rows r;
    void *to_free;
    void *mem = thread_scratch(SCRATCH_ROWS, ft_lp_rows_bytes(kl, M, K), &to_free);
    if (!mem) return ft_error(FT_ERR_NOMEM, "out of memory for gemm_i8's rows");
    ft_lp_rows_init(&r, kl, mem, M, K);
    /* the given u8 rows into the kernel's layout (u8, or widened to int16), scale 1 */
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (M * K > 65536)
    for (int64_t m = 0; m < r.Mp; m++) {
        uint8_t *dst = r.data + m * r.lda;
        memset(dst, 0, (size_t)r.lda);
        r.scale[m] = 1.0f;
        r.zp[m] = m < M && zero_point ? zero_point[m] : 0;
        if (m >= M) continue;
        for (int64_t k = 0; k < K; k++) {
            if (kl->elem == 1) dst[k] = A[m * lda + k];
            else {
                const int16_t v = A[m * lda + k];
                memcpy(dst + 2 * k, &v, 2);
            }
        }
    }
    const ft_status st = ft_cpu_lp_product(kl, &r, w_packed, M, K, N, C, ldc, NULL, -1, NULL, NULL, NULL, 0.0f, 1);
    free(to_free);
    return st;
}

/* x (M, K) prepared (quantized or rounded), then the product: act(. + bias), or LN(residual + . + bias) */
static ft_status linear_lp(ft_dtype wt, const char *op, float *out, const float *x, const void *w_packed,
                           const float *bias, int act, const float *residual, const float *gamma, const float *beta,
                           int64_t M, int64_t K, int64_t N, float eps) {
    const ft_lp_kernel *kl;
    FT_TRY(kernel_for(wt, op, &kl));
    FT_TRY(check_k(kl, K, op));
    if (M <= 0 || N <= 0) return FT_OK;
    ft_lp_rows r;
    void *to_free;
    ft_status st = prepare(kl, &r, x, K, 0, M, K, &to_free);
    if (st == FT_OK) st = ft_cpu_lp_product(kl, &r, w_packed, M, K, N, out, N, bias, act, residual, gamma, beta, eps, 0);
    free(to_free);
    return st;
}

ft_status cpu_linear_lp_forward(ft_backend *be, ft_dtype wt, float *out, const float *x, const void *w_packed,
                                const float *bias, int64_t M, int64_t K, int64_t N, int act) {
    (void)be;
    return linear_lp(wt, "linear_lp_forward", out, x, w_packed, bias, act, NULL, NULL, NULL, M, K, N, 0.0f);
}

ft_status cpu_linear_lp_residual_ln_forward(ft_backend *be, ft_dtype wt, float *out, const float *x,
                                            const void *w_packed, const float *bias, const float *residual,
                                            const float *gamma, const float *beta, int64_t M, int64_t K, int64_t N,
                                            float eps) {
    (void)be;
    return linear_lp(wt, "linear_lp_residual_ln_forward", out, x, w_packed, bias, -1, residual, gamma, beta, M, K, N,
                     eps);
}

/* ---- embeddings with int8 word vectors -------------------------------------------------------- */
ft_status cpu_embed_i8_ln_forward(ft_backend *be, float *out, const int32_t *ids, const int32_t *types,
                                  const int32_t *positions, const int8_t *word, const float *word_scale,
                                  const float *pos, const float *type, const float *gamma, const float *beta,
                                  int64_t N, int64_t C, float eps) {
    (void)be;
#pragma omp parallel for schedule(dynamic, 32) num_threads(ft_num_threads())
    for (int64_t r = 0; r < N; r++) {
        const int8_t *w = word + (int64_t)ids[r] * C;
        const float s = word_scale[ids[r]];
        float *o = out + r * C;
        if (!pos) {   /* no position table (rotary models) and no type table: embed_ln_forward's */
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] = (float)w[c] * s;
            ft_layernorm_row(o, gamma, beta, C, eps);
            continue;
        }
        const float *p = pos + (int64_t)positions[r] * C;
        if (type) {
            const float *ty = type + (types ? (int64_t)types[r] * C : 0);
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] = ((float)w[c] * s + ty[c]) + p[c];   /* embed_ln_forward's order */
        } else {   /* no token types */
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] = (float)w[c] * s + p[c];
        }
        ft_layernorm_row(o, gamma, beta, C, eps);
    }
    return FT_OK;
}

/* ---- gemm_prec in bf16 on AVX512_BF16 ------------------------------------------------------------ */
int ft_cpu_bf16_gemm_fast(int64_t M, int64_t N, int64_t K) {
    return M >= 16 && N >= 16 && K >= 32 && M * N * K >= (int64_t)1 << 18 && ft_lp_kernel_for(FT_BF16) != NULL;
}

ft_status ft_cpu_bf16_gemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                           int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    const ft_lp_kernel *kl = ft_lp_kernel_for(FT_BF16);
    const ft_lp_layout lay = ft_lp_layout_of(kl, N, K);
    const int direct = alpha == 1.0f && beta == 0.0f;
    void *wp_free, *t_free = NULL, *rows_free = NULL;
    void *wp = thread_scratch(SCRATCH_PACKED, lay.bytes, &wp_free);
    float *t = direct ? C : thread_scratch(SCRATCH_PRODUCT, (size_t)M * (size_t)N * sizeof(float), &t_free);
    ft_status st = wp && t ? FT_OK : ft_error(FT_ERR_NOMEM, "out of memory for a %lld x %lld x %lld bf16 product",
                                              (long long)M, (long long)N, (long long)K);
    /* op(B)^T (N, K): B's rows when transposed (line-major), else its columns (k-major) */
    if (st == FT_OK) pack_bf16(kl, wp, B, ldb, !trans_b, N, K);
    ft_lp_rows r;
    if (st == FT_OK) st = prepare(kl, &r, A, lda, trans_a, M, K, &rows_free);
    if (st == FT_OK) st = ft_cpu_lp_product(kl, &r, wp, M, K, N, t, direct ? ldc : N, NULL, -1, NULL, NULL, NULL, 0.0f, 0);
    if (st == FT_OK && !direct) {
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (M * N > 65536)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++)
                C[m * ldc + n] = beta == 0.0f ? alpha * t[m * N + n] : alpha * t[m * N + n] + beta * C[m * ldc + n];
    }
    free(rows_free);
    free(wp_free);
    free(t_free);
    return st;
}
