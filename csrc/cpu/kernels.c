/* Micro-kernels (see kernels.h for the contract) and the run-time choice between them. Each
 * SIMD kernel is compiled for its instruction set with a target attribute, so one build holds
 * all three whatever -march says; the CPU decides which may run. */
#include "kernels.h"

#include "fasttran.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- AVX-512: 12 x 32 (24 zmm accumulators, A broadcast from its 12 rows) ---------------- */
#define MR512 12
__attribute__((target("avx512f"))) static void tile_avx512(int64_t K, const float *a, int64_t lda, const float *b,
                                                            int64_t ldb, float *c, int64_t ldc, int m, int n,
                                                            int accumulate) {
    const __mmask16 m0 = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? (__mmask16)0xFFFF : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : (__mmask16)0;
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
__attribute__((target("avx2,fma"))) static void tile_avx2(int64_t K, const float *a, int64_t lda, const float *b,
                                                          int64_t ldb, float *c, int64_t ldc, int m, int n,
                                                          int accumulate) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane);
    __m256 c0[MR256], c1[MR256];
#pragma GCC unroll 6
    for (int i = 0; i < MR256; i++) {
        if (accumulate && i < m) {
            c0[i] = _mm256_maskload_ps(c + i * ldc, m0);
            c1[i] = _mm256_maskload_ps(c + i * ldc + 8, m1);
        } else {
            c0[i] = _mm256_setzero_ps();
            c1[i] = _mm256_setzero_ps();
        }
    }
    const int64_t l3 = 3 * lda, l5 = 5 * lda;
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(b + (k + 8) * ldb), _MM_HINT_T0);
        const __m256 b0 = _mm256_maskload_ps(b + k * ldb, m0), b1 = _mm256_maskload_ps(b + k * ldb + 8, m1);
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
            _mm256_maskstore_ps(c + i * ldc, m0, c0[i]);
            _mm256_maskstore_ps(c + i * ldc + 8, m1, c1[i]);
        }
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

/* ---- choice --------------------------------------------------------------------------------- */
static const ft_cpu_kernel kernels[] = {
    {"avx512", MR512, 32, tile_avx512},
    {"avx2", MR256, 16, tile_avx2},
    {"generic", MRG, NRG, tile_generic},
};

static const ft_cpu_kernel *chosen;
static pthread_once_t choose_once = PTHREAD_ONCE_INIT;

static int supported(int k) {
    __builtin_cpu_init();
    switch (k) {
    case 0: return __builtin_cpu_supports("avx512f");
    case 1: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default: return 1;
    }
}

static void choose(void) {
    const char *want = getenv("FASTTRAN_CPU_ISA");
    int best = 0;
    while (!supported(best)) best++;
    chosen = &kernels[best];
    if (want && *want && strcmp(want, "auto") != 0) {
        for (int k = 0; k < 3; k++)
            if (strcmp(want, kernels[k].name) == 0) {
                if (supported(k)) chosen = &kernels[k];
                else fprintf(stderr, "fasttran: FASTTRAN_CPU_ISA=%s is not supported by this CPU; using %s\n", want, chosen->name);
                return;
            }
        fprintf(stderr, "fasttran: unknown FASTTRAN_CPU_ISA=%s (expected avx512, avx2, generic or auto); using %s\n",
                want, chosen->name);
    }
}

const ft_cpu_kernel *ft_cpu_kernel_get(void) {
    pthread_once(&choose_once, choose);
    return chosen;
}

const char *ft_cpu_isa(void) { return ft_cpu_kernel_get()->name; }
