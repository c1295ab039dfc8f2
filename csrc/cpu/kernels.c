/* Micro-kernels (see kernels.h for the contract) and the run-time choice between them. Each
 * SIMD kernel is compiled for its instruction set with a target attribute, so one build holds
 * all three whatever -march says; the CPU decides which may run. */
#include "kernels.h"

#include "amx.h"
#include "lowp.h"
#include "rowfun.h"
#include "vecmath.h"

#include "fasttran.h"

#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- AVX-512: 12 x 32 (24 zmm accumulators, A broadcast from its 12 rows) ---------------- */
#define MR512 12
__attribute__((target("avx512f"), always_inline)) static inline void body_avx512(
    int64_t K, const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int m, int n,
    int accumulate, const float *bias, const int act) {
    const __mmask16 m0 = ft_mask16(n), m1 = ft_mask16(n - 16);
    __m512 c0[MR512], c1[MR512];
    FT_TILE512_INIT(c0, c1, MR512, c, ldc, m, m0, m1, accumulate);
    /* rows from four bases walking along k (rows 0-2, 3-5, 6-8, 9-11), each row one base +
     * index * scale addressing mode: no address arithmetic in the loop; k unrolled by 4 */
    const float *p0 = a, *p3 = a + 3 * lda, *p6 = a + 6 * lda, *p9 = a + 9 * lda;
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; k++, p0++, p3++, p6++, p9++) {
        _mm_prefetch((const char *)(b + (k + 8) * ldb), _MM_HINT_T0);
        _mm_prefetch((const char *)(b + (k + 8) * ldb + 16), _MM_HINT_T0);
        const __m512 b0 = _mm512_maskz_loadu_ps(m0, b + k * ldb), b1 = _mm512_maskz_loadu_ps(m1, b + k * ldb + 16);
        const float av[MR512] = {p0[0], p0[lda], p0[2 * lda], p3[0], p3[lda], p3[2 * lda],
                                 p6[0], p6[lda], p6[2 * lda], p9[0], p9[lda], p9[2 * lda]};
#pragma GCC unroll 12
        for (int i = 0; i < MR512; i++) {
            const __m512 ai = _mm512_set1_ps(av[i]);
            c0[i] = _mm512_fmadd_ps(ai, b0, c0[i]);
            c1[i] = _mm512_fmadd_ps(ai, b1, c1[i]);
        }
    }
    FT_TILE512_FINISH(c0, c1, MR512, c, ldc, m, m0, m1, bias, act);
}
__attribute__((target("avx512f"))) static void tile_avx512(int64_t K, const float *a, int64_t lda, const float *b,
                                                            int64_t ldb, float *c, int64_t ldc, int m, int n,
                                                            int accumulate) {
    body_avx512(K, a, lda, b, ldb, c, ldc, m, n, accumulate, NULL, -1);
}
/* one copy of the tile per vector activation, so that each inlines its formula */
__attribute__((target("avx512f"))) static void tile_epi_avx512(int64_t K, const float *a, int64_t lda,
                                                                const float *b, int64_t ldb, float *c, int64_t ldc,
                                                                int m, int n, int accumulate, const float *bias,
                                                                int act) {
    switch (act) {
    case FT_ACT_GELU_ERF: body_avx512(K, a, lda, b, ldb, c, ldc, m, n, accumulate, bias, FT_ACT_GELU_ERF); break;
    case FT_ACT_GELU_TANH: body_avx512(K, a, lda, b, ldb, c, ldc, m, n, accumulate, bias, FT_ACT_GELU_TANH); break;
    case FT_ACT_RELU: body_avx512(K, a, lda, b, ldb, c, ldc, m, n, accumulate, bias, FT_ACT_RELU); break;
    case FT_ACT_TANH:   /* libm's tanhf on the stored values (ft_vec_act) */
        body_avx512(K, a, lda, b, ldb, c, ldc, m, n, accumulate, NULL, -1);
        ft_cpu_epilogue(c, ldc, m, n, bias, act);
        break;
    default: body_avx512(K, a, lda, b, ldb, c, ldc, m, n, accumulate, bias, -1); break;
    }
}

/* ---- AVX2 + FMA: 6 x 16 (12 ymm accumulators) ------------------------------------------- */
#define MR256 6
/* full: n == 16, plain loads of B (masked loads give the same values, at a third of the rate) */
__attribute__((target("avx2,fma"), always_inline)) static inline void body_avx2(int64_t K, const float *a, int64_t lda,
                                                                              const float *b, int64_t ldb, float *c,
                                                                              int64_t ldc, int m, int n, int accumulate,
                                                                              const int full, const float *bias,
                                                                              const int act) {
    const __m256i m0 = ft_mask8(n), m1 = ft_mask8(n - 8);
    __m256 c0[MR256], c1[MR256];
#pragma GCC unroll 6
    for (int i = 0; i < MR256; i++) {
        if (accumulate && i < m) {
            c0[i] = full ? _mm256_loadu_ps(c + i * ldc) : _mm256_maskload_ps(c + i * ldc, m0);
            c1[i] = full ? _mm256_loadu_ps(c + i * ldc + 8) : _mm256_maskload_ps(c + i * ldc + 8, m1);
        } else {
            c0[i] = _mm256_setzero_ps();
            c1[i] = _mm256_setzero_ps();
        }
    }
    /* rows i and i + 3 from two bases walking along k, each row one base + index * scale
     * addressing mode (no address arithmetic in the loop); k unrolled by 4 */
    const float *p0 = a, *p3 = a + 3 * lda;
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; k++, p0++, p3++) {
        _mm_prefetch((const char *)(b + (k + 8) * ldb), _MM_HINT_T0);
        const __m256 b0 = full ? _mm256_loadu_ps(b + k * ldb) : _mm256_maskload_ps(b + k * ldb, m0);
        const __m256 b1 = full ? _mm256_loadu_ps(b + k * ldb + 8) : _mm256_maskload_ps(b + k * ldb + 8, m1);
        const float *av[MR256] = {p0, p0 + lda, p0 + 2 * lda, p3, p3 + lda, p3 + 2 * lda};
#pragma GCC unroll 6
        for (int i = 0; i < MR256; i++) {
            const __m256 ai = _mm256_broadcast_ss(av[i]);
            c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);
            c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);
        }
    }
    if (bias || act >= 0) {
        const __m256 bb0 = !bias ? _mm256_setzero_ps() : full ? _mm256_loadu_ps(bias) : _mm256_maskload_ps(bias, m0);
        const __m256 bb1 = !bias ? _mm256_setzero_ps() : full ? _mm256_loadu_ps(bias + 8) : _mm256_maskload_ps(bias + 8, m1);
        FT_EPI_REGS(_mm256_add_ps, ft_act256, MR256, c0, c1, bb0, bb1, bias != NULL, act);
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR256; i++) {
        if (i < m) {
            if (full) {
                _mm256_storeu_ps(c + i * ldc, c0[i]);
                _mm256_storeu_ps(c + i * ldc + 8, c1[i]);
            } else {
                _mm256_maskstore_ps(c + i * ldc, m0, c0[i]);
                _mm256_maskstore_ps(c + i * ldc + 8, m1, c1[i]);
            }
        }
    }
}
__attribute__((target("avx2,fma"))) static void tile_avx2(int64_t K, const float *a, int64_t lda, const float *b,
                                                          int64_t ldb, float *c, int64_t ldc, int m, int n,
                                                          int accumulate) {
    if (n == 16) body_avx2(K, a, lda, b, ldb, c, ldc, m, n, accumulate, 1, NULL, -1);
    else body_avx2(K, a, lda, b, ldb, c, ldc, m, n, accumulate, 0, NULL, -1);
}
#define FT_AVX2_EPI(ACT)                                                                   \
    do {                                                                                   \
        if (n == 16) body_avx2(K, a, lda, b, ldb, c, ldc, m, n, accumulate, 1, bias, ACT); \
        else body_avx2(K, a, lda, b, ldb, c, ldc, m, n, accumulate, 0, bias, ACT);         \
    } while (0)
__attribute__((target("avx2,fma"))) static void tile_epi_avx2(int64_t K, const float *a, int64_t lda, const float *b,
                                                              int64_t ldb, float *c, int64_t ldc, int m, int n,
                                                              int accumulate, const float *bias, int act) {
    switch (act) {
    case FT_ACT_GELU_ERF: FT_AVX2_EPI(FT_ACT_GELU_ERF); break;
    case FT_ACT_GELU_TANH: FT_AVX2_EPI(FT_ACT_GELU_TANH); break;
    case FT_ACT_RELU: FT_AVX2_EPI(FT_ACT_RELU); break;
    case FT_ACT_TANH:   /* libm's tanhf on the stored values (ft_vec_act) */
        tile_avx2(K, a, lda, b, ldb, c, ldc, m, n, accumulate);
        ft_cpu_epilogue(c, ldc, m, n, bias, act);
        break;
    default: FT_AVX2_EPI(-1); break;
    }
}

/* ---- portable C: 4 x 16, multiply then add (this file is ISO C: no contraction into FMA) -- */
#define MRG 4
#define NRG 16
static void tile_generic(int64_t K, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                         int64_t ldc, int m, int n, int accumulate) {
    float acc[MRG][NRG], bk[NRG];
    for (int i = 0; i < MRG; i++)
        for (int j = 0; j < NRG; j++) acc[i][j] = accumulate && i < m && j < n ? c[i * ldc + j] : 0.0f;
    for (int64_t k = 0; k < K; k++) {
        for (int j = 0; j < NRG; j++) bk[j] = j < n ? b[k * ldb + j] : 0.0f;
        for (int i = 0; i < MRG; i++) {
            const float ai = a[i * lda + k];
            for (int j = 0; j < NRG; j++) acc[i][j] += ai * bk[j];
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) c[i * ldc + j] = acc[i][j];
}

/* ---- epilogues: c = act(c + bias) over a tile, on the kernel set's registers ----------------- */
__attribute__((target("avx512f"))) static void epilogue_avx512(float *c, int64_t ldc, int m, int n, const float *bias,
                                                               int act) {
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = ft_mask16(n - j);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(k, bias + j) : _mm512_setzero_ps();
        for (int i = 0; i < m; i++) {
            __m512 v = _mm512_maskz_loadu_ps(k, c + i * ldc + j);
            if (bias) v = _mm512_add_ps(v, b);
            _mm512_mask_storeu_ps(c + i * ldc + j, k, ft_act512(v, act));
        }
    }
}

__attribute__((target("avx2,fma"))) static void epilogue_avx2(float *c, int64_t ldc, int m, int n, const float *bias,
                                                              int act) {
    for (int j = 0; j < n; j += 8) {
        const __m256i k = ft_mask8(n - j);
        const __m256 b = bias ? _mm256_maskload_ps(bias + j, k) : _mm256_setzero_ps();
        for (int i = 0; i < m; i++) {
            __m256 v = _mm256_maskload_ps(c + i * ldc + j, k);
            if (bias) v = _mm256_add_ps(v, b);
            _mm256_maskstore_ps(c + i * ldc + j, k, ft_act256(v, act));
        }
    }
}

void ft_cpu_epilogue(float *c, int64_t ldc, int m, int n, const float *bias, int act) {
    const ft_cpu_kernel *kr = ft_cpu_kernel_get();
    if (ft_vec_act(act) && kr->tile == tile_avx512) {
        epilogue_avx512(c, ldc, m, n, bias, act);
    } else if (ft_vec_act(act) && kr->tile == tile_avx2) {
        epilogue_avx2(c, ldc, m, n, bias, act);
    } else {   /* portable C, and tanh everywhere (libm's tanhf) */
        for (int i = 0; i < m; i++) {
            float *r = c + i * ldc;
            if (bias)
                for (int j = 0; j < n; j++) r[j] += bias[j];
            if (act >= 0) ft_activation_row(r, n, (ft_activation)act);
        }
    }
}

/* ---- K^T panels for attention: panel p, element (d, j) = k[(p nr + j) ld + d] ---------------- */
/* 8 x 8 blocks: eight keys' rows in, eight panel rows out (data movement only) */
__attribute__((target("avx2,fma"))) static void transpose8_avx2(float *dst, int64_t ldd, const float *src,
                                                                int64_t lds) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

void ft_cpu_pack_keys_t(float *kp, const float *k, int64_t ld, int64_t nk, int64_t hs) {
    const ft_cpu_kernel *kr = ft_cpu_kernel_get();
    const int nr = kr->nr, simd = kr->tile != tile_generic;
    const int64_t panels = (nk + nr - 1) / nr, hs8 = simd ? hs & ~(int64_t)7 : 0;
    for (int64_t p = 0; p < panels; p++) {
        float *panel = kp + p * hs * nr;
        for (int j0 = 0; j0 < nr; j0 += 8) {
            const int64_t key0 = p * nr + j0;
            int64_t d0 = 0;
            if (simd && key0 + 8 <= nk)
                for (; d0 < hs8; d0 += 8) transpose8_avx2(panel + d0 * nr + j0, nr, k + key0 * ld + d0, ld);
            for (int j = j0; j < j0 + 8 && j < nr; j++) {
                const int64_t key = p * nr + j;
                for (int64_t d = d0; d < hs; d++) panel[d * nr + j] = key < nk ? k[key * ld + d] : 0.0f;
            }
        }
    }
}

/* ---- softmax of a score row: s = softmax(scale s) in place --------------------------------- */
/* The max is exact in any order (several accumulators; max(new, acc) ignores a NaN as one chain
 * would); the sum adds element j into lane j % 16 in order of j, then folds the lanes in
 * rowfun.h's tree: the same order as ft_row_sum, on registers. Whole vectors go through plain
 * loads and stores (masked ones give the same values, slower). */
__attribute__((target("avx512f"))) static void softmax_avx512(float *s, int64_t n, float scale, float *stats) {
    const int64_t n16 = n & ~(int64_t)15, n64 = n & ~(int64_t)63;
    __m512 m4[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                    _mm512_set1_ps(-INFINITY)};
    int64_t j = 0;
    for (; j < n64; j += 64)
        for (int u = 0; u < 4; u++) m4[u] = _mm512_max_ps(_mm512_loadu_ps(s + j + 16 * u), m4[u]);
    for (; j < n; j += 16) {
        const __mmask16 k = ft_mask16(n - j);
        m4[0] = _mm512_mask_max_ps(m4[0], k, _mm512_maskz_loadu_ps(k, s + j), m4[0]);
    }
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
    /* exp(scale s - scale max) with the scale in the FMA (scale > 0: the max of s is that of scale s) */
    const float top = scale * _mm512_reduce_max_ps(mx);
    const __m512 sc = _mm512_set1_ps(scale), shift = _mm512_set1_ps(-top);
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < n16; j += 16) {
        const __m512 e = ft_exp512(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), sc, shift));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (j < n) {
        const __mmask16 k = ft_mask16(n - j);
        const __m512 e = ft_exp512(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, s + j), sc, shift));
        _mm512_mask_storeu_ps(s + j, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    float lane[FT_LANES];
    _mm512_storeu_ps(lane, sum);
    const float inv1 = 1.0f / ft_fold_lanes(lane);
    if (stats) { stats[0] = top; stats[1] = inv1; }
    const __m512 inv = _mm512_set1_ps(inv1);
    for (j = 0; j < n16; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
    if (j < n) {
        const __mmask16 k = ft_mask16(n - j);
        _mm512_mask_storeu_ps(s + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), inv));
    }
}

__attribute__((target("avx2,fma"))) static void softmax_avx2(float *s, int64_t n, float scale, float *stats) {
    const int64_t n8 = n & ~(int64_t)7, n16 = n & ~(int64_t)15, n32 = n & ~(int64_t)31;
    __m256 m4[4] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY),
                    _mm256_set1_ps(-INFINITY)};
    int64_t j = 0;
    for (; j < n32; j += 32)
        for (int u = 0; u < 4; u++) m4[u] = _mm256_max_ps(_mm256_loadu_ps(s + j + 8 * u), m4[u]);
    for (; j < n; j += 8) {
        const __m256i k = ft_mask8(n - j);
        m4[0] = _mm256_blendv_ps(m4[0], _mm256_max_ps(_mm256_maskload_ps(s + j, k), m4[0]), _mm256_castsi256_ps(k));
    }
    const __m256 mx = _mm256_max_ps(_mm256_max_ps(m4[0], m4[1]), _mm256_max_ps(m4[2], m4[3]));
    float l8[8];
    _mm256_storeu_ps(l8, mx);
    float top = l8[0];
    for (int l = 1; l < 8; l++) top = l8[l] > top ? l8[l] : top;
    top *= scale;
    const __m256 sc = _mm256_set1_ps(scale), shift = _mm256_set1_ps(-top);
    /* lanes j % 16: two accumulators, elements [16c, 16c + 8) and [16c + 8, 16c + 16) */
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (j = 0; j < n16; j += 16)
        for (int h = 0; h < 2; h++) {
            const __m256 e = ft_exp256(_mm256_fmadd_ps(_mm256_loadu_ps(s + j + 8 * h), sc, shift));
            _mm256_storeu_ps(s + j + 8 * h, e);
            sum[h] = _mm256_add_ps(sum[h], e);
        }
    for (; j < n; j += 8) {
        const __m256i k = ft_mask8(n - j);
        const __m256 e = ft_exp256(_mm256_fmadd_ps(_mm256_maskload_ps(s + j, k), sc, shift));
        _mm256_maskstore_ps(s + j, k, e);
        const int half = (int)((j / 8) & 1);
        sum[half] = _mm256_add_ps(sum[half], _mm256_and_ps(e, _mm256_castsi256_ps(k)));
    }
    float lane[FT_LANES];
    _mm256_storeu_ps(lane, sum[0]);
    _mm256_storeu_ps(lane + 8, sum[1]);
    const float inv1 = 1.0f / ft_fold_lanes(lane);
    if (stats) { stats[0] = top; stats[1] = inv1; }
    const __m256 inv = _mm256_set1_ps(inv1);
    for (j = 0; j < n8; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
    if (j < n) {
        const __m256i k = ft_mask8(n - j);
        _mm256_maskstore_ps(s + j, k, _mm256_mul_ps(_mm256_maskload_ps(s + j, k), inv));
    }
}

static void softmax_generic(float *s, int64_t n, float scale, float *stats) {
    float lane[FT_LANES];
    for (int l = 0; l < FT_LANES; l++) lane[l] = -INFINITY;
    int64_t j = 0;
    for (; j + FT_LANES <= n; j += FT_LANES)
        for (int l = 0; l < FT_LANES; l++) {
            float v = scale * s[j + l];
            s[j + l] = v;
            lane[l] = v > lane[l] ? v : lane[l];
        }
    for (int l = 0; j + l < n; l++) {
        float v = scale * s[j + l];
        s[j + l] = v;
        lane[l] = v > lane[l] ? v : lane[l];
    }
    float mx = lane[0];
    for (int l = 1; l < FT_LANES; l++) mx = lane[l] > mx ? lane[l] : mx;   /* max: exact in any order */
#pragma omp simd
    for (j = 0; j < n; j++) s[j] = ft_expf(s[j] - mx);
    const float inv = 1.0f / ft_row_sum(s, n);
    if (stats) { stats[0] = mx; stats[1] = inv; }
#pragma omp simd
    for (j = 0; j < n; j++) s[j] *= inv;
}

void ft_cpu_softmax_row(float *s, int64_t n, float scale, float *stats) {
    const ft_tile_fn tile = ft_cpu_kernel_get()->tile;
    if (tile == tile_avx512) softmax_avx512(s, n, scale, stats);
    else if (tile == tile_avx2) softmax_avx2(s, n, scale, stats);
    else softmax_generic(s, n, scale, stats);
}

/* ---- activation backward of a row: dh = df act'(x) ------------------------------------------ */
__attribute__((target("avx512f"))) static void act_grad_avx512(float *dh, const float *df, const float *x, int64_t n,
                                                               int act) {
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = ft_mask16(n - j);
        const __m512 g = ft_act_grad512(_mm512_maskz_loadu_ps(k, x + j), act);
        _mm512_mask_storeu_ps(dh + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, df + j), g));
    }
}

__attribute__((target("avx2,fma"))) static void act_grad_avx2(float *dh, const float *df, const float *x, int64_t n,
                                                              int act) {
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i k = ft_mask8(n - j);
        const __m256 g = ft_act_grad256(_mm256_maskload_ps(x + j, k), act);
        _mm256_maskstore_ps(dh + j, k, _mm256_mul_ps(_mm256_maskload_ps(df + j, k), g));
    }
}

void ft_cpu_act_grad_row(float *dh, const float *df, const float *x, int64_t n, int act) {
    const ft_tile_fn tile = ft_cpu_kernel_get()->tile;
    if (tile == tile_avx512) {
        act_grad_avx512(dh, df, x, n, act);
    } else if (tile == tile_avx2) {
        act_grad_avx2(dh, df, x, n, act);
    } else {
        for (int64_t j = 0; j < n; j++) dh[j] = df[j] * ft_act_gradf(x[j], (ft_activation)act);
    }
}

/* ---- choice --------------------------------------------------------------------------------- */
static const ft_cpu_kernel kernels[] = {
    {"amx", MR512, 32, tile_avx512, tile_epi_avx512, 1},
    {"avx512", MR512, 32, tile_avx512, tile_epi_avx512, 0},
    {"avx2", MR256, 16, tile_avx2, tile_epi_avx2, 0},
    {"generic", MRG, NRG, tile_generic, NULL, 0},
};
#define N_KERNELS 4

static const ft_cpu_kernel *chosen;
static unsigned features, present;
static pthread_once_t choose_once = PTHREAD_ONCE_INIT;

static int supported(int k) {
    __builtin_cpu_init();
    switch (k) {
    case 0: return __builtin_cpu_supports("avx512f") && ft_amx_usable();
    case 1: return __builtin_cpu_supports("avx512f");
    case 2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default: return 1;
    }
}

static const char *const feature_names[FT_CPU_FEATURE_COUNT] = {"avx2", "avx512", "avx512_vnni", "avx_vnni",
                                                                 "avx512_bf16", "amx_bf16", "amx_int8"};
const char *ft_cpu_feature_name(int k) { return k >= 0 && k < FT_CPU_FEATURE_COUNT ? feature_names[k] : NULL; }

/* The CPU's features: CPUID, each vector feature only where the OS saves its registers
 * (__builtin_cpu_supports checks XCR0 for the AVX and AVX-512 state), AMX only where the OS
 * granted this process the tile state (amx.c, amx_int8.c). */
static unsigned detect(void) {
    __builtin_cpu_init();
    unsigned f = 0;
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    unsigned a = 0, b = 0, c = 0, d = 0, a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        if (a >= 1) __cpuid_count(7, 1, a1, b1, c1, d1);
    }
    if (avx2) f |= FT_CPU_AVX2;
    if (avx2 && (a1 >> 4) & 1) f |= FT_CPU_AVX_VNNI;
    if (avx2 && avx512) {
        f |= FT_CPU_AVX512;
        if ((c >> 11) & 1) f |= FT_CPU_AVX512_VNNI;
        if ((a1 >> 5) & 1) f |= FT_CPU_AVX512_BF16;
    }
    if ((f & FT_CPU_AVX512) && ft_amx_usable()) f |= FT_CPU_AMX_BF16;
    if ((f & FT_CPU_AVX512) && ft_amx_int8_usable()) f |= FT_CPU_AMX_INT8;
    return f;
}

/* FASTTRAN_CPU_ISA: a CPU generation's feature set, to run (and test) what such a CPU would run:
 * the float32 kernel set (kernels[]) and the features the reduced-precision kernels may use */
#define F_AVX512_ALL (FT_CPU_AVX2 | FT_CPU_AVX512)
static const struct {
    const char *name;
    int kernel;
    unsigned features;
} levels[] = {
    {"amx", 0, ~0u},                                                                  /* Sapphire Rapids */
    {"avx512_bf16", 1, F_AVX512_ALL | FT_CPU_AVX512_VNNI | FT_CPU_AVX512_BF16},        /* Cooper Lake, Zen 4 */
    {"avx512_vnni", 1, F_AVX512_ALL | FT_CPU_AVX512_VNNI},                             /* Cascade Lake, Ice Lake */
    {"avx512", 1, F_AVX512_ALL},                                                      /* Skylake-X */
    {"avx_vnni", 2, FT_CPU_AVX2 | FT_CPU_AVX_VNNI},                                   /* Alder Lake */
    {"avx2", 2, FT_CPU_AVX2},                                                         /* Haswell .. Zen 3 */
    {"generic", 3, 0},
    /* test infrastructure: avx512_bf16's set with AMX-INT8's block loop on a C model of the tiles */
    {"amx_int8_emulated", 1, F_AVX512_ALL | FT_CPU_AVX512_VNNI | FT_CPU_AVX512_BF16 | FT_CPU_AMX_INT8_MODEL},
};
#define N_LEVELS (sizeof levels / sizeof *levels)

static void choose(void) {
    const char *want = getenv("FASTTRAN_CPU_ISA");
    int best = 0;
    while (!supported(best)) best++;
    chosen = &kernels[best];
    present = features = detect();
    if (!want || !*want || strcmp(want, "auto") == 0) return;
    for (size_t k = 0; k < N_LEVELS; k++) {
        if (strcmp(want, levels[k].name) != 0) continue;
        if (supported(levels[k].kernel)) chosen = &kernels[levels[k].kernel];
        else fprintf(stderr, "fasttran: FASTTRAN_CPU_ISA=%s is not supported by this CPU; using %s\n", want, chosen->name);
        features &= levels[k].features;
        if ((levels[k].features & FT_CPU_AMX_INT8_MODEL) && (present & FT_CPU_AVX512_VNNI)) features |= FT_CPU_AMX_INT8_MODEL;
        const unsigned lacking = levels[k].features & ~present & ((1u << FT_CPU_FEATURE_COUNT) - 1);
        if (supported(levels[k].kernel) && lacking && levels[k].features != ~0u)
            for (int b = 0; b < FT_CPU_FEATURE_COUNT; b++)
                if (lacking >> b & 1)
                    fprintf(stderr, "fasttran: FASTTRAN_CPU_ISA=%s: this CPU has no %s; running without it\n", want,
                            feature_names[b]);
        return;
    }
    fprintf(stderr, "fasttran: unknown FASTTRAN_CPU_ISA=%s (expected amx, avx512_bf16, avx512_vnni, avx512, avx_vnni, "
                    "avx2, generic, amx_int8_emulated or auto); using %s\n", want, chosen->name);
}

unsigned ft_cpu_features(void) {
    pthread_once(&choose_once, choose);
    return features;
}

unsigned ft_cpu_features_present(void) {
    pthread_once(&choose_once, choose);
    return present;
}

const ft_cpu_kernel *ft_cpu_kernel_get(void) {
    pthread_once(&choose_once, choose);
    return chosen;
}

const char *ft_cpu_isa(void) { return ft_cpu_kernel_get()->name; }
