/* Micro-kernels (see kernels.h for the contract) and the run-time choice between them. Each
 * SIMD kernel is compiled for its instruction set with a target attribute, so one build holds
 * all three whatever -march says; the CPU decides which may run. */
#include "kernels.h"

#include "amx.h"
#include "rowfun.h"
#include "vecmath.h"

#include "fasttran.h"

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- AVX-512: 12 x 32 (24 zmm accumulators, A broadcast from its 12 rows) ---------------- */
#define MR512 12
__attribute__((target("avx512f"))) static void tile_avx512(int64_t K, const float *a, int64_t lda, const float *b,
                                                            int64_t ldb, float *c, int64_t ldc, int m, int n,
                                                            int accumulate) {
    const __mmask16 m0 = ft_mask16(n), m1 = ft_mask16(n - 16);
    __m512 c0[MR512], c1[MR512];
#pragma GCC unroll 12
    for (int i = 0; i < MR512; i++) {
        if (accumulate && i < m) {
            c0[i] = _mm512_maskz_loadu_ps(m0, c + i * ldc);
            c1[i] = _mm512_maskz_loadu_ps(m1, c + i * ldc + 16);
        } else {
            c0[i] = _mm512_setzero_ps();
            c1[i] = _mm512_setzero_ps();
        }
    }
    /* rows as two bases and a few multiples of lda, so every broadcast is one addressing mode */
    const int64_t l3 = 3 * lda, l5 = 5 * lda, l7 = 7 * lda;
    const float *a8 = a + 8 * lda;
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(b + (k + 8) * ldb), _MM_HINT_T0);
        _mm_prefetch((const char *)(b + (k + 8) * ldb + 16), _MM_HINT_T0);
        const __m512 b0 = _mm512_maskz_loadu_ps(m0, b + k * ldb), b1 = _mm512_maskz_loadu_ps(m1, b + k * ldb + 16);
        const float *p = a + k, *q = a8 + k;
        const float av[MR512] = {p[0], p[lda], p[2 * lda], p[l3], p[4 * lda], p[l5],
                                 p[2 * l3], p[l7], q[0], q[lda], q[2 * lda], q[l3]};
#pragma GCC unroll 12
        for (int i = 0; i < MR512; i++) {
            const __m512 ai = _mm512_set1_ps(av[i]);
            c0[i] = _mm512_fmadd_ps(ai, b0, c0[i]);
            c1[i] = _mm512_fmadd_ps(ai, b1, c1[i]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR512; i++) {
        if (i < m) {
            _mm512_mask_storeu_ps(c + i * ldc, m0, c0[i]);
            _mm512_mask_storeu_ps(c + i * ldc + 16, m1, c1[i]);
        }
    }
}

/* ---- AVX2 + FMA: 6 x 16 (12 ymm accumulators) ------------------------------------------- */
#define MR256 6
/* full: n == 16, plain loads of B (masked loads give the same values, at a third of the rate) */
__attribute__((target("avx2,fma"), always_inline)) static inline void body_avx2(int64_t K, const float *a, int64_t lda,
                                                                              const float *b, int64_t ldb, float *c,
                                                                              int64_t ldc, int m, int n, int accumulate,
                                                                              const int full) {
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
    const int64_t l3 = 3 * lda, l5 = 5 * lda;
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(b + (k + 8) * ldb), _MM_HINT_T0);
        const __m256 b0 = full ? _mm256_loadu_ps(b + k * ldb) : _mm256_maskload_ps(b + k * ldb, m0);
        const __m256 b1 = full ? _mm256_loadu_ps(b + k * ldb + 8) : _mm256_maskload_ps(b + k * ldb + 8, m1);
        const float *p = a + k;
        const float *av[MR256] = {p, p + lda, p + 2 * lda, p + l3, p + 4 * lda, p + l5};
#pragma GCC unroll 6
        for (int i = 0; i < MR256; i++) {
            const __m256 ai = _mm256_broadcast_ss(av[i]);
            c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);
            c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);
        }
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
    if (n == 16) body_avx2(K, a, lda, b, ldb, c, ldc, m, n, accumulate, 1);
    else body_avx2(K, a, lda, b, ldb, c, ldc, m, n, accumulate, 0);
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

/* ---- softmax of a score row: s = softmax(scale s) in place --------------------------------- */
/* The max is exact in any order; the sum adds element j into lane j % 16 in order of j, then
 * folds the lanes in rowfun.h's tree: the same order as ft_row_sum, on registers. */
__attribute__((target("avx512f"))) static void softmax_avx512(float *s, int64_t n, float scale) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = ft_mask16(n - j);
        mx = _mm512_mask_max_ps(mx, k, _mm512_maskz_loadu_ps(k, s + j), mx);
    }
    /* exp(scale s - scale max) with the scale in the FMA (scale > 0: the max of s is that of scale s) */
    const __m512 sc = _mm512_set1_ps(scale), shift = _mm512_set1_ps(-scale * _mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = ft_mask16(n - j);
        const __m512 e = ft_exp512(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, s + j), sc, shift));
        _mm512_mask_storeu_ps(s + j, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    float lane[FT_LANES];
    _mm512_storeu_ps(lane, sum);
    const __m512 inv = _mm512_set1_ps(1.0f / ft_fold_lanes(lane));
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = ft_mask16(n - j);
        _mm512_mask_storeu_ps(s + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), inv));
    }
}

__attribute__((target("avx2,fma"))) static void softmax_avx2(float *s, int64_t n, float scale) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i k = ft_mask8(n - j);
        mx = _mm256_blendv_ps(mx, _mm256_max_ps(_mm256_maskload_ps(s + j, k), mx), _mm256_castsi256_ps(k));
    }
    float l8[8];
    _mm256_storeu_ps(l8, mx);
    float top = l8[0];
    for (int l = 1; l < 8; l++) top = l8[l] > top ? l8[l] : top;
    const __m256 sc = _mm256_set1_ps(scale), shift = _mm256_set1_ps(-scale * top);
    /* lanes j % 16: two accumulators, elements [16c, 16c + 8) and [16c + 8, 16c + 16) */
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i k = ft_mask8(n - j);
        const __m256 e = ft_exp256(_mm256_fmadd_ps(_mm256_maskload_ps(s + j, k), sc, shift));
        _mm256_maskstore_ps(s + j, k, e);
        const int half = (int)((j / 8) & 1);
        sum[half] = _mm256_add_ps(sum[half], _mm256_and_ps(e, _mm256_castsi256_ps(k)));
    }
    float lane[FT_LANES];
    _mm256_storeu_ps(lane, sum[0]);
    _mm256_storeu_ps(lane + 8, sum[1]);
    const __m256 inv = _mm256_set1_ps(1.0f / ft_fold_lanes(lane));
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i k = ft_mask8(n - j);
        _mm256_maskstore_ps(s + j, k, _mm256_mul_ps(_mm256_maskload_ps(s + j, k), inv));
    }
}

static void softmax_generic(float *s, int64_t n, float scale) {
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
#pragma omp simd
    for (j = 0; j < n; j++) s[j] *= inv;
}

void ft_cpu_softmax_row(float *s, int64_t n, float scale) {
    const ft_tile_fn tile = ft_cpu_kernel_get()->tile;
    if (tile == tile_avx512) softmax_avx512(s, n, scale);
    else if (tile == tile_avx2) softmax_avx2(s, n, scale);
    else softmax_generic(s, n, scale);
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
    {"amx", MR512, 32, tile_avx512, 1},
    {"avx512", MR512, 32, tile_avx512, 0},
    {"avx2", MR256, 16, tile_avx2, 0},
    {"generic", MRG, NRG, tile_generic, 0},
};
#define N_KERNELS 4

static const ft_cpu_kernel *chosen;
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

static void choose(void) {
    const char *want = getenv("FASTTRAN_CPU_ISA");
    int best = 0;
    while (!supported(best)) best++;
    chosen = &kernels[best];
    if (want && *want && strcmp(want, "auto") != 0) {
        for (int k = 0; k < N_KERNELS; k++)
            if (strcmp(want, kernels[k].name) == 0) {
                if (supported(k)) chosen = &kernels[k];
                else fprintf(stderr, "fasttran: FASTTRAN_CPU_ISA=%s is not supported by this CPU; using %s\n", want, chosen->name);
                return;
            }
        fprintf(stderr, "fasttran: unknown FASTTRAN_CPU_ISA=%s (expected amx, avx512, avx2, generic or auto); using %s\n",
                want, chosen->name);
    }
}

const ft_cpu_kernel *ft_cpu_kernel_get(void) {
    pthread_once(&choose_once, choose);
    return chosen;
}

const char *ft_cpu_isa(void) { return ft_cpu_kernel_get()->name; }
