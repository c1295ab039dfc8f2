/* Reduced-precision micro-kernels (int8, bf16), their packed layouts, the activations' quantizer
 * and the run-time choice (see lowp.h for the arithmetic and the layouts). Each SIMD kernel is
 * compiled for its instruction set with a target attribute, so one build holds all of them; the
 * CPU's features (ft_cpu_features, FASTTRAN_CPU_ISA) decide which may run. */
#include "lowp.h"

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "core/dtype.h"
#include "core/status.h"
#include "kernels.h"
#include "vecmath.h"

static int32_t load32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---- AVX-512: 12 x 32 tiles (24 zmm accumulators, A broadcast a group at a time) ------------- */
#define MR512 12

/* The int8 epilogue of a finished tile, in place: c (m x n int32 sums, row stride ldc) = the exact
 * acc - z colsum (raw), or the dequantized floats ((float)(acc - z colsum) * s_m) * s_n, + bias,
 * activation (constant after inlining). A pass over the tile while it is in L1: keeping the
 * epilogue out of the accumulation loop keeps the 24 accumulators in registers. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), always_inline)) static inline void epi_i8_512_body(
    int32_t *c, int64_t ldc, int m, int n, const ft_lp_epi *epi, const int act) {
    float *cf = (float *)c;
    const int has_bias = epi->bias != NULL && act != FT_ACT_TANH;
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = ft_mask16(n - j);
        const __m512i cs = _mm512_maskz_loadu_epi32(k, epi->col_sum + j);
        const __m512 sw = epi->raw ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(k, epi->col_scale + j);
        const __m512 bb = has_bias ? _mm512_maskz_loadu_ps(k, epi->bias + j) : _mm512_setzero_ps();
        for (int i = 0; i < m; i++) {
            const __m512i v = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(k, c + i * ldc + j),
                                               _mm512_mullo_epi32(_mm512_set1_epi32(epi->row_zp[i]), cs));
            if (epi->raw) {
                _mm512_mask_storeu_epi32(c + i * ldc + j, k, v);
                continue;
            }
            __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(epi->row_scale[i])), sw);
            if (has_bias) f = _mm512_add_ps(f, bb);
            if (act >= 0 && act != FT_ACT_TANH) f = ft_act512(f, act);
            _mm512_mask_storeu_ps(cf + i * ldc + j, k, f);
        }
    }
    if (act == FT_ACT_TANH && !epi->raw) ft_cpu_epilogue(cf, ldc, m, n, epi->bias, act);   /* libm's tanhf */
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void epi_i8_512(int32_t *c, int64_t ldc, int m,
                                                                                     int n, const ft_lp_epi *epi) {
    switch (epi->raw ? -1 : epi->act) {
    case FT_ACT_GELU_ERF: epi_i8_512_body(c, ldc, m, n, epi, FT_ACT_GELU_ERF); break;
    case FT_ACT_GELU_TANH: epi_i8_512_body(c, ldc, m, n, epi, FT_ACT_GELU_TANH); break;
    case FT_ACT_RELU: epi_i8_512_body(c, ldc, m, n, epi, FT_ACT_RELU); break;
    case FT_ACT_TANH: epi_i8_512_body(c, ldc, m, n, epi, FT_ACT_TANH); break;
    default: epi_i8_512_body(c, ldc, m, n, epi, -1); break;
    }
}

/* GCC's partial redundancy elimination (-O3's tree-pre) spills half of the 24 int32 accumulators
 * of these loops to the stack on every group (measured: 20 stack accesses per 96 vpdpbusd);
 * without it the accumulators stay in registers */
#define FT_LP_NOPRE __attribute__((optimize("no-tree-pre")))

/* The int8 kernels on zmm: OP(acc, a, b) accumulates one group of a (broadcast) times b; the sums
 * are stored as int32, then finished by epi_i8_512 on the last K block */
#define FT_LP_I8_512(NAME, TARGET, OP)                                                                               \
    __attribute__((target(TARGET))) FT_LP_NOPRE static void NAME(int64_t kg, const uint8_t *a, int64_t lda, const uint8_t *b,    \
                                                     int64_t pstride, void *c_, int64_t ldc, int m, int n,            \
                                                     int accumulate, const ft_lp_epi *epi) {                          \
        int32_t *c = c_;                                                                                            \
        const __mmask16 m0 = ft_mask16(n), m1 = ft_mask16(n - 16);                                                  \
        __m512i c0[MR512], c1[MR512];                                                                               \
        _Pragma("GCC unroll 12") for (int i = 0; i < MR512; i++) {                                                  \
            c0[i] = _mm512_setzero_si512();                                                                         \
            c1[i] = _mm512_setzero_si512();                                                                         \
        }                                                                                                           \
        const uint8_t *b1 = b + pstride;                                                                            \
        const uint8_t *p0 = a, *p3 = a + 3 * lda, *p6 = a + 6 * lda, *p9 = a + 9 * lda;                             \
        _Pragma("GCC unroll 4") for (int64_t g = 0; g < kg; g++, p0 += 4, p3 += 4, p6 += 4, p9 += 4) {           \
            _mm_prefetch((const char *)(b + (g + 8) * 64), _MM_HINT_T0);                                            \
            const __m512i w0 = _mm512_loadu_si512(b + g * 64);                                                      \
            const __m512i w1 = _mm512_maskz_loadu_epi32(m1, b1 + g * 64); /* no second panel: nothing read */     \
            const int32_t av[MR512] = {load32(p0), load32(p0 + lda), load32(p0 + 2 * lda), load32(p3),            \
                                       load32(p3 + lda), load32(p3 + 2 * lda), load32(p6), load32(p6 + lda),       \
                                       load32(p6 + 2 * lda), load32(p9), load32(p9 + lda), load32(p9 + 2 * lda)};  \
            _Pragma("GCC unroll 12") for (int i = 0; i < MR512; i++) {                                              \
                const __m512i ai = _mm512_set1_epi32(av[i]);                                                        \
                c0[i] = OP(c0[i], ai, w0);                                                                          \
                c1[i] = OP(c1[i], ai, w1);                                                                          \
            }                                                                                                       \
        }                                                                                                           \
        /* the previous K blocks' sums added last (integers: the same sum in any order) */                        \
        _Pragma("GCC unroll 12") for (int i = 0; i < MR512; i++) if (i < m) {                                       \
            if (accumulate) {                                                                                       \
                c0[i] = _mm512_add_epi32(c0[i], _mm512_maskz_loadu_epi32(m0, c + i * ldc));                         \
                c1[i] = _mm512_add_epi32(c1[i], _mm512_maskz_loadu_epi32(m1, c + i * ldc + 16));                    \
            }                                                                                                       \
            _mm512_mask_storeu_epi32(c + i * ldc, m0, c0[i]);                                                       \
            _mm512_mask_storeu_epi32(c + i * ldc + 16, m1, c1[i]);                                                  \
        }                                                                                                           \
        if (epi) epi_i8_512(c, ldc, m, n, epi);                                                                     \
    }

/* u8 x s8, four products per lane summed exactly (AVX512_VNNI) */
#define OP_VNNI512(acc, a, b) _mm512_dpbusd_epi32(acc, a, b)
/* int16 pairs (AVX-512BW): vpmaddwd's two products and their sum are exact for u8 x s8 values */
#define OP_MADD512(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
FT_LP_I8_512(tile_i8_vnni512, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni", OP_VNNI512)
FT_LP_I8_512(tile_i8_bw512, "avx512f,avx512bw,avx512vl,avx512dq", OP_MADD512)

/* ---- AVX2-width int8: 6 x 16 tiles (12 ymm accumulators) --------------------------------------- */
#define MR256 6
__attribute__((target("avx2,fma"), always_inline)) static inline void epi_i8_256_body(int32_t *c, int64_t ldc, int m,
                                                                                     int n, const ft_lp_epi *epi,
                                                                                     const int act) {
    float *cf = (float *)c;
    const int has_bias = epi->bias != NULL && act != FT_ACT_TANH;
    for (int j = 0; j < n; j += 8) {
        const __m256i k = ft_mask8(n - j);
        const __m256i cs = _mm256_maskload_epi32(epi->col_sum + j, k);
        const __m256 sw = epi->raw ? _mm256_setzero_ps() : _mm256_maskload_ps(epi->col_scale + j, k);
        const __m256 bb = has_bias ? _mm256_maskload_ps(epi->bias + j, k) : _mm256_setzero_ps();
        for (int i = 0; i < m; i++) {
            const __m256i v = _mm256_sub_epi32(_mm256_maskload_epi32(c + i * ldc + j, k),
                                               _mm256_mullo_epi32(_mm256_set1_epi32(epi->row_zp[i]), cs));
            if (epi->raw) {
                _mm256_maskstore_epi32(c + i * ldc + j, k, v);
                continue;
            }
            __m256 f = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(epi->row_scale[i])), sw);
            if (has_bias) f = _mm256_add_ps(f, bb);
            if (act >= 0 && act != FT_ACT_TANH) f = ft_act256(f, act);
            _mm256_maskstore_ps(cf + i * ldc + j, k, f);
        }
    }
    if (act == FT_ACT_TANH && !epi->raw) ft_cpu_epilogue(cf, ldc, m, n, epi->bias, act);
}

__attribute__((target("avx2,fma"))) static void epi_i8_256(int32_t *c, int64_t ldc, int m, int n,
                                                           const ft_lp_epi *epi) {
    switch (epi->raw ? -1 : epi->act) {
    case FT_ACT_GELU_ERF: epi_i8_256_body(c, ldc, m, n, epi, FT_ACT_GELU_ERF); break;
    case FT_ACT_GELU_TANH: epi_i8_256_body(c, ldc, m, n, epi, FT_ACT_GELU_TANH); break;
    case FT_ACT_RELU: epi_i8_256_body(c, ldc, m, n, epi, FT_ACT_RELU); break;
    case FT_ACT_TANH: epi_i8_256_body(c, ldc, m, n, epi, FT_ACT_TANH); break;
    default: epi_i8_256_body(c, ldc, m, n, epi, -1); break;
    }
}

#define FT_LP_I8_256(NAME, TARGET, OP)                                                                               \
    __attribute__((target(TARGET))) FT_LP_NOPRE static void NAME(int64_t kg, const uint8_t *a, int64_t lda, const uint8_t *b,    \
                                                     int64_t pstride, void *c_, int64_t ldc, int m, int n,            \
                                                     int accumulate, const ft_lp_epi *epi) {                          \
        (void)pstride;                                                                                              \
        int32_t *c = c_;                                                                                            \
        const __m256i m0 = ft_mask8(n), m1 = ft_mask8(n - 8);                                                       \
        __m256i c0[MR256], c1[MR256];                                                                               \
        _Pragma("GCC unroll 6") for (int i = 0; i < MR256; i++) {                                                   \
            if (accumulate && i < m) {                                                                              \
                c0[i] = _mm256_maskload_epi32(c + i * ldc, m0);                                                     \
                c1[i] = _mm256_maskload_epi32(c + i * ldc + 8, m1);                                                 \
            } else {                                                                                                \
                c0[i] = _mm256_setzero_si256();                                                                     \
                c1[i] = _mm256_setzero_si256();                                                                     \
            }                                                                                                       \
        }                                                                                                           \
        const uint8_t *p0 = a, *p3 = a + 3 * lda;                                                                   \
        _Pragma("GCC unroll 4") for (int64_t g = 0; g < kg; g++, p0 += 4, p3 += 4) {                               \
            _mm_prefetch((const char *)(b + (g + 8) * 64), _MM_HINT_T0);                                            \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(b + g * 64));                                   \
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(b + g * 64 + 32));                              \
            const int32_t av[MR256] = {load32(p0), load32(p0 + lda), load32(p0 + 2 * lda),                        \
                                       load32(p3), load32(p3 + lda), load32(p3 + 2 * lda)};                        \
            _Pragma("GCC unroll 6") for (int i = 0; i < MR256; i++) {                                               \
                const __m256i ai = _mm256_set1_epi32(av[i]);                                                        \
                c0[i] = OP(c0[i], ai, w0);                                                                          \
                c1[i] = OP(c1[i], ai, w1);                                                                          \
            }                                                                                                       \
        }                                                                                                           \
        _Pragma("GCC unroll 6") for (int i = 0; i < MR256; i++) if (i < m) {                                        \
            _mm256_maskstore_epi32(c + i * ldc, m0, c0[i]);                                                         \
            _mm256_maskstore_epi32(c + i * ldc + 8, m1, c1[i]);                                                     \
        }                                                                                                           \
        if (epi) epi_i8_256(c, ldc, m, n, epi);                                                                     \
    }

/* u8 x s8 on ymm, VEX-encoded (AVX-VNNI: Alder Lake and later; not on AMD Zen 4) */
#define OP_VNNI256(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#define OP_MADD256(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
FT_LP_I8_256(tile_i8_avxvnni, "avx2,fma,avxvnni", OP_VNNI256)
FT_LP_I8_256(tile_i8_avx2, "avx2,fma", OP_MADD256)

/* ---- portable C int8: 4 x 16, the u8 / s8 layout ----------------------------------------------- */
#define MRG 4
static void tile_i8_generic(int64_t kg, const uint8_t *a, int64_t lda, const uint8_t *b, int64_t pstride, void *c_,
                            int64_t ldc, int m, int n, int accumulate, const ft_lp_epi *epi) {
    (void)pstride;
    int32_t *c = c_;
    int32_t acc[MRG][FT_LP_PANEL];
    for (int i = 0; i < MRG; i++)
        for (int j = 0; j < FT_LP_PANEL; j++) acc[i][j] = accumulate && i < m && j < n ? c[i * ldc + j] : 0;
    for (int64_t g = 0; g < kg; g++) {
        const int8_t *w = (const int8_t *)(b + g * 64);
        for (int i = 0; i < MRG; i++) {
            const uint8_t *x = a + i * lda + 4 * g;
            for (int j = 0; j < FT_LP_PANEL; j++)
                acc[i][j] += (int32_t)x[0] * w[4 * j] + (int32_t)x[1] * w[4 * j + 1] + (int32_t)x[2] * w[4 * j + 2] +
                             (int32_t)x[3] * w[4 * j + 3];
        }
    }
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            int32_t v = acc[i][j];
            if (epi) v = (int32_t)((int64_t)v - (int64_t)epi->row_zp[i] * epi->col_sum[j]);   /* exact: it fits */
            if (!epi || epi->raw) c[i * ldc + j] = v;
            else ((float *)c)[i * ldc + j] = ((float)v * epi->row_scale[i]) * epi->col_scale[j];
        }
    }
    if (epi && !epi->raw && (epi->bias || epi->act >= 0)) ft_cpu_epilogue((float *)c, ldc, m, n, epi->bias, epi->act);
}

/* ---- bf16 (AVX512_BF16): 12 x 32, float32 accumulators --------------------------------------- */
#define BF16_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"
/* the float32 kernel's tile (kernels.c) with vdpbf16ps for its FMAs: bias and activation on the
 * registers (tanh: libm on the stored values, as ft_cpu_epilogue) */
__attribute__((target(BF16_TARGET), always_inline)) static inline void bf16_body(
    int64_t kg, const uint8_t *a, int64_t lda, const uint8_t *b, int64_t pstride, float *c, int64_t ldc, int m, int n,
    int accumulate, const float *bias, const int act) {
    const __mmask16 m0 = ft_mask16(n), m1 = ft_mask16(n - 16);
    __m512 c0[MR512], c1[MR512];
    FT_TILE512_INIT(c0, c1, MR512, c, ldc, m, m0, m1, accumulate);
    const uint8_t *b1 = b + pstride;
    const uint8_t *p0 = a, *p3 = a + 3 * lda, *p6 = a + 6 * lda, *p9 = a + 9 * lda;
#pragma GCC unroll 4
    for (int64_t g = 0; g < kg; g++, p0 += 4, p3 += 4, p6 += 4, p9 += 4) {
        _mm_prefetch((const char *)(b + (g + 8) * 64), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + g * 64);
        const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, b1 + g * 64);
        const int32_t av[MR512] = {load32(p0), load32(p0 + lda), load32(p0 + 2 * lda), load32(p3),
                                   load32(p3 + lda), load32(p3 + 2 * lda), load32(p6), load32(p6 + lda),
                                   load32(p6 + 2 * lda), load32(p9), load32(p9 + lda), load32(p9 + 2 * lda)};
#pragma GCC unroll 12
        for (int i = 0; i < MR512; i++) {
            const __m512bh ai = (__m512bh)_mm512_set1_epi32(av[i]);
            c0[i] = _mm512_dpbf16_ps(c0[i], ai, w0);
            c1[i] = _mm512_dpbf16_ps(c1[i], ai, w1);
        }
    }
    FT_TILE512_FINISH(c0, c1, MR512, c, ldc, m, m0, m1, bias, act);
}

__attribute__((target(BF16_TARGET))) FT_LP_NOPRE static void tile_bf16_512(int64_t kg, const uint8_t *a, int64_t lda,
                                                               const uint8_t *b, int64_t pstride, void *c, int64_t ldc,
                                                               int m, int n, int accumulate, const ft_lp_epi *epi) {
    const float *bias = epi ? epi->bias : NULL;
    switch (epi ? epi->act : -1) {
    case FT_ACT_GELU_ERF: bf16_body(kg, a, lda, b, pstride, c, ldc, m, n, accumulate, bias, FT_ACT_GELU_ERF); break;
    case FT_ACT_GELU_TANH: bf16_body(kg, a, lda, b, pstride, c, ldc, m, n, accumulate, bias, FT_ACT_GELU_TANH); break;
    case FT_ACT_RELU: bf16_body(kg, a, lda, b, pstride, c, ldc, m, n, accumulate, bias, FT_ACT_RELU); break;
    case FT_ACT_TANH:
        bf16_body(kg, a, lda, b, pstride, c, ldc, m, n, accumulate, NULL, -1);
        ft_cpu_epilogue(c, ldc, m, n, bias, FT_ACT_TANH);
        break;
    default: bf16_body(kg, a, lda, b, pstride, c, ldc, m, n, accumulate, bias, -1); break;
    }
}

/* ---- the kernels and the choice ------------------------------------------------------------------
 * `pays`: measured against the float32 kernels of the same CPU on MiniLM's and BERT-base's layer
 * shapes at 1 x 128 and 32 x 128 tokens (benchmarks/int8_gemm.py, benchmarks/RESULTS.md). VNNI and
 * AMX do four times a float32 FMA's work per instruction; the exact fallbacks without VNNI
 * (vpmaddwd on int16 pairs: two products per lane, plus an add) do no more per instruction than
 * float32 FMAs and lose the time quantizing the activations: they stay for exactness, the encoder
 * runs such CPUs' int8 weights dequantized in float32. */
enum { K_AMX, K_AMX_MODEL, K_VNNI512, K_AVXVNNI, K_BW512, K_AVX2, K_GENERIC, K_BF16, K_COUNT };
static const ft_lp_kernel lp_kernels[K_COUNT] = {
    [K_AMX] = {"amx_int8", FT_I8, 32, 32, 1, NULL, 1, 1},
    [K_AMX_MODEL] = {"amx_int8_emulated", FT_I8, 32, 32, 1, NULL, 2, 1},   /* test infrastructure */
    [K_VNNI512] = {"avx512_vnni", FT_I8, MR512, 32, 1, tile_i8_vnni512, 0, 1},
    [K_AVXVNNI] = {"avx_vnni", FT_I8, MR256, 16, 1, tile_i8_avxvnni, 0, 1},
    [K_BW512] = {"avx512bw", FT_I8, MR512, 32, 2, tile_i8_bw512, 0, 0},
    [K_AVX2] = {"avx2", FT_I8, MR256, 16, 2, tile_i8_avx2, 0, 0},
    [K_GENERIC] = {"generic", FT_I8, MRG, 16, 1, tile_i8_generic, 0, 0},
    [K_BF16] = {"avx512_bf16", FT_BF16, MR512, 32, 2, tile_bf16_512, 0, 1},
};

const ft_lp_kernel *ft_lp_kernel_for(ft_dtype wt) {
    const unsigned f = ft_cpu_features();
    if (wt == FT_BF16) return f & FT_CPU_AVX512_BF16 ? &lp_kernels[K_BF16] : NULL;
    if (wt != FT_I8) return NULL;
    if (f & FT_CPU_AMX_INT8) return &lp_kernels[K_AMX];
    if (f & FT_CPU_AMX_INT8_MODEL) return &lp_kernels[K_AMX_MODEL];
    if (f & FT_CPU_AVX512_VNNI) return &lp_kernels[K_VNNI512];
    if (f & FT_CPU_AVX_VNNI) return &lp_kernels[K_AVXVNNI];
    if (f & FT_CPU_AVX512) return &lp_kernels[K_BW512];
    if (f & FT_CPU_AVX2) return &lp_kernels[K_AVX2];
    return &lp_kernels[K_GENERIC];
}

const ft_lp_kernel *ft_lp_vnni512(void) { return &lp_kernels[K_VNNI512]; }

const char *ft_cpu_int8_kernel(int *int8_used) {
    const ft_lp_kernel *kl = ft_lp_kernel_for(FT_I8);
    if (int8_used) *int8_used = kl->pays;
    return kl->name;
}

const char *ft_cpu_bf16_kernel(void) {
    const ft_lp_kernel *kl = ft_lp_kernel_for(FT_BF16);
    return kl ? kl->name : NULL;
}

/* the bits of bf16(v), nearest even (ft_cpu_round_bf16's rule; a NaN stays a quiet NaN) */
static inline uint16_t bf16_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x0040u : r);
}

/* ---- layouts and packing ---------------------------------------------------------------------- */
static size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

ft_lp_layout ft_lp_layout_of(const ft_lp_kernel *kl, int64_t N, int64_t K) {
    ft_lp_layout L;
    L.Kp = (K + FT_LP_KALIGN - 1) / FT_LP_KALIGN * FT_LP_KALIGN;
    L.groups = L.Kp * kl->elem / 4;
    L.panels = (N + FT_LP_PANEL - 1) / FT_LP_PANEL;
    L.panel_bytes = (size_t)L.groups * 64;
    const size_t w = (size_t)L.panels * L.panel_bytes, cols = (size_t)L.panels * FT_LP_PANEL;
    L.scale_off = kl->wt == FT_I8 ? w : 0;
    L.sum_off = kl->wt == FT_I8 ? w + cols * sizeof(float) : 0;
    L.bytes = up64(kl->wt == FT_I8 ? w + cols * (sizeof(float) + sizeof(int32_t)) : w);
    return L;
}

void ft_lp_pack_panel_i8(const ft_lp_kernel *kl, uint8_t *packed, const int8_t *q, const float *scale, int64_t N,
                         int64_t K, int64_t p) {
    const ft_lp_layout L = ft_lp_layout_of(kl, N, K);
    uint8_t *dst = packed + (size_t)p * L.panel_bytes;
    float *cscale = (float *)(packed + L.scale_off);
    int32_t *csum = (int32_t *)(packed + L.sum_off);
    const int per = 4 / kl->elem;   /* k per group */
    for (int j = 0; j < FT_LP_PANEL; j++) {
        const int64_t col = p * FT_LP_PANEL + j;
        const int8_t *row = col < N ? q + col * K : NULL;
        int32_t sum = 0;
        for (int64_t g = 0; g < L.groups; g++) {
            for (int t = 0; t < per; t++) {
                const int64_t k = g * per + t;
                const int8_t v = row && k < K ? row[k] : 0;
                sum += v;
                if (kl->elem == 1) dst[g * 64 + 4 * j + t] = (uint8_t)v;
                else {
                    const int16_t w = v;
                    memcpy(dst + g * 64 + 4 * j + 2 * t, &w, 2);
                }
            }
        }
        cscale[col] = row ? scale[col] : 0.0f;
        csum[col] = sum;
    }
}

/* bf16 panel p: 32-bit word g * 16 + j holds column j's elements k = 2g (low half) and 2g + 1 (high
 * half), zero past N and K. Whole groups of a whole panel take the branch-free loops (vectorised:
 * sixteen words per k pair k-major; a column's pairs, then a 16 x 16 transpose of words,
 * line-major); the edges go element by element. bf16_bits everywhere, so the bits are the same. */
static inline uint32_t bf16_pair(const float *w, int64_t i0, int64_t i1, int ok0, int ok1) {
    return (uint32_t)(ok0 ? bf16_bits(w[i0]) : 0) | (uint32_t)(ok1 ? bf16_bits(w[i1]) : 0) << 16;
}
/* sixteen words: d[j] = bf16(lo[j]) | bf16(hi[j]) << 16 (a k pair of sixteen contiguous columns or rows) */
static inline void bf16_words16(uint32_t *d, const float *lo, const float *hi) {
#pragma omp simd
    for (int j = 0; j < 16; j++) d[j] = (uint32_t)bf16_bits(lo[j]) | (uint32_t)bf16_bits(hi[j]) << 16;
}
/* dst[a * ld + b] = t[b][a]: a 16 x 16 block of words put in place transposed */
static inline void put_transposed16(uint32_t *dst, int64_t ld, const uint32_t t[16][16]) {
    for (int a = 0; a < 16; a++)
        for (int b = 0; b < 16; b++) dst[a * ld + b] = t[b][a];
}

void ft_lp_pack_panel_bf16(const ft_lp_kernel *kl, uint8_t *packed, const float *w, int64_t ld, int kmajor, int64_t N,
                           int64_t K, int64_t p) {
    const ft_lp_layout L = ft_lp_layout_of(kl, N, K);
    uint32_t *dst = (uint32_t *)(packed + (size_t)p * L.panel_bytes);
    const int64_t c0 = p * FT_LP_PANEL, nc = N - c0 < FT_LP_PANEL ? N - c0 : FT_LP_PANEL;
    const int64_t full = nc == FT_LP_PANEL ? K / 2 : 0;   /* groups with both k and every column real */
    int64_t g0 = 0;                                         /* the groups from here go element by element */
    if (kmajor) {
        for (; g0 < full; g0++) bf16_words16(dst + g0 * FT_LP_PANEL, w + 2 * g0 * ld + c0, w + (2 * g0 + 1) * ld + c0);
    } else {
        uint32_t t[FT_LP_PANEL][FT_LP_PANEL];   /* [column][group] */
        for (; g0 + FT_LP_PANEL <= full; g0 += FT_LP_PANEL) {
            for (int j = 0; j < FT_LP_PANEL; j++) {
                const float *row = w + (c0 + j) * ld + 2 * g0;
#pragma omp simd
                for (int q = 0; q < FT_LP_PANEL; q++)
                    t[j][q] = (uint32_t)bf16_bits(row[2 * q]) | (uint32_t)bf16_bits(row[2 * q + 1]) << 16;
            }
            put_transposed16(dst + g0 * FT_LP_PANEL, FT_LP_PANEL, t);
        }
    }
    for (int64_t g = g0; g < L.groups; g++)   /* the rest: under 16 groups, a last odd k, K's padding, columns past N */
        for (int j = 0; j < FT_LP_PANEL; j++) {
            const int64_t col = c0 + j, k0 = 2 * g, k1 = k0 + 1;
            const int ok = col < N;
            dst[g * FT_LP_PANEL + j] = kmajor ? bf16_pair(w, k0 * ld + col, k1 * ld + col, ok && k0 < K, ok && k1 < K)
                                              : bf16_pair(w, col * ld + k0, col * ld + k1, ok && k0 < K, ok && k1 < K);
        }
}

/* ---- prepared rows ----------------------------------------------------------------------------- */
size_t ft_lp_rows_bytes(const ft_lp_kernel *kl, int64_t M, int64_t K) {
    const int64_t Mp = (M + FT_LP_MALIGN - 1) / FT_LP_MALIGN * FT_LP_MALIGN;
    const int64_t Kp = (K + FT_LP_KALIGN - 1) / FT_LP_KALIGN * FT_LP_KALIGN;
    return up64((size_t)Mp * (size_t)Kp * (size_t)kl->elem) + (kl->wt == FT_I8 ? 2 * up64((size_t)Mp * 4) : 0);
}

void ft_lp_rows_init(ft_lp_rows *r, const ft_lp_kernel *kl, void *mem, int64_t M, int64_t K) {
    r->Mp = (M + FT_LP_MALIGN - 1) / FT_LP_MALIGN * FT_LP_MALIGN;
    r->Kp = (K + FT_LP_KALIGN - 1) / FT_LP_KALIGN * FT_LP_KALIGN;
    r->lda = r->Kp * kl->elem;
    r->data = mem;
    const size_t d = up64((size_t)r->Mp * (size_t)r->lda);
    r->scale = kl->wt == FT_I8 ? (float *)((char *)mem + d) : NULL;
    r->zp = kl->wt == FT_I8 ? (int32_t *)((char *)mem + d + up64((size_t)r->Mp * 4)) : NULL;
}

void ft_lp_quantize_row(const float *x, int64_t K, uint8_t *u, float *scale, int32_t *zp) {
    float lo = 0.0f, hi = 0.0f;
    int bad = 0;
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(| : bad)
    for (int64_t k = 0; k < K; k++) {
        lo = x[k] < lo ? x[k] : lo;
        hi = x[k] > hi ? x[k] : hi;
        bad |= !(x[k] - x[k] == 0.0f);   /* NaN or infinite */
    }
    const float s = (hi - lo) / 255.0f, inv = 1.0f / s;
    if (bad || !isfinite(s)) {
        *scale = NAN;
        *zp = 0;
        memset(u, 0, (size_t)K);
        return;
    }
    if (!isfinite(inv)) {   /* a zero row, or a range below 255 x 2^-126: zeros */
        *scale = 0.0f;
        *zp = 0;
        memset(u, 0, (size_t)K);
        return;
    }
    float z = rintf(-lo * inv);
    z = z < 0.0f ? 0.0f : z > 255.0f ? 255.0f : z;
    *scale = s;
    *zp = (int32_t)z;
#pragma omp simd
    for (int64_t k = 0; k < K; k++) {
        float v = rintf(x[k] * inv) + z;
        v = v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v;
        u[k] = (uint8_t)(int32_t)v;
    }
}

/* one row of x (K values at src) into prepared row m */
static void prepare_row(const ft_lp_kernel *kl, ft_lp_rows *r, const float *src, int64_t K, int64_t m) {
    uint8_t *dst = r->data + m * r->lda;
    if (kl->wt == FT_BF16) {
        uint16_t *d = (uint16_t *)dst;
#pragma omp simd
        for (int64_t k = 0; k < K; k++) d[k] = bf16_bits(src[k]);
        for (int64_t k = K; k < r->Kp; k++) d[k] = 0;
    } else if (kl->elem == 1) {
        ft_lp_quantize_row(src, K, dst, &r->scale[m], &r->zp[m]);
        memset(dst + K, 0, (size_t)(r->Kp - K));
    } else {   /* int16 pairs: the same u8 values widened; the u8 staged in the row's second half */
        uint8_t *u = dst + r->Kp;
        ft_lp_quantize_row(src, K, u, &r->scale[m], &r->zp[m]);
        int16_t *d = (int16_t *)dst;
        /* ascending: d[k] (bytes 2k, 2k + 1 <= Kp + k) never overwrites a u[j] (byte Kp + j) not yet read */
        for (int64_t k = 0; k < K; k++) d[k] = u[k];
        for (int64_t k = K; k < r->Kp; k++) d[k] = 0;
    }
}

/* bf16 rows [m0, m0 + 16) of a k-major x, all real: word g of row m holds x[2g][m] (low half) and
 * x[2g + 1][m], zero past K up to Kp. A k pair's sixteen words at once (the rows of x are
 * contiguous in m), then a 16 x 16 word transpose into the rows: bf16_bits, so the bits of
 * prepare_row's. */
static void bf16_rows_kmajor(ft_lp_rows *r, const float *x, int64_t ld, int64_t K, int64_t m0) {
    const int64_t ldw = r->lda / 4, full = K / 2;
    uint32_t *d = (uint32_t *)(r->data + m0 * r->lda);
    uint32_t t[FT_LP_GATHER][FT_LP_GATHER];   /* [group][row] */
    int64_t g0 = 0;
    for (; g0 + FT_LP_GATHER <= full; g0 += FT_LP_GATHER) {
        for (int q = 0; q < FT_LP_GATHER; q++)
            bf16_words16(t[q], x + 2 * (g0 + q) * ld + m0, x + (2 * (g0 + q) + 1) * ld + m0);
        put_transposed16(d + g0, ldw, t);
    }
    for (int64_t g = g0; g < ldw; g++)   /* the last groups: fewer than 16, a last odd k, K's padding */
        for (int j = 0; j < FT_LP_GATHER; j++) {
            const int64_t k0 = 2 * g, k1 = k0 + 1;
            d[j * ldw + g] = bf16_pair(x, k0 * ld + m0 + j, k1 * ld + m0 + j, k0 < K, k1 < K);
        }
}

void ft_lp_prepare_rows(const ft_lp_kernel *kl, ft_lp_rows *r, const float *x, int64_t ld, int kmajor, int64_t M,
                        int64_t K, int64_t r0, int64_t r1, float *tmp) {
    for (int64_t m0 = r0; m0 < r1; m0 += FT_LP_GATHER) {
        const int64_t m1 = m0 + FT_LP_GATHER < r1 ? m0 + FT_LP_GATHER : r1, real = m1 < M ? m1 : M;
        if (kl->wt == FT_BF16 && kmajor && real - m0 == FT_LP_GATHER) {
            bf16_rows_kmajor(r, x, ld, K, m0);
            continue;
        }
        if (kmajor && m0 < real)   /* a transposed operand: FT_LP_GATHER rows at a time, a cache line per k */
            for (int64_t k = 0; k < K; k++)
                for (int64_t m = m0; m < real; m++) tmp[(m - m0) * K + k] = x[k * ld + m];
        for (int64_t m = m0; m < m1; m++) {
            if (m >= M) {
                memset(r->data + m * r->lda, 0, (size_t)r->lda);
                if (r->scale) { r->scale[m] = 0.0f; r->zp[m] = 0; }
                continue;
            }
            prepare_row(kl, r, kmajor ? tmp + (m - m0) * K : x + m * ld, K, m);
        }
    }
}

ft_status ft_lp_quantize_weight(int8_t *q, float *scale, const float *w, int64_t N, int64_t K, const char *what) {
    int64_t bad = -1;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * K > 65536)
    for (int64_t n = 0; n < N; n++) {
        const float *row = w + n * K;
        float amax = 0.0f;
        int nonfinite = 0;
        for (int64_t k = 0; k < K; k++) {
            const float a = fabsf(row[k]);
            amax = a > amax ? a : amax;
            nonfinite |= !(row[k] - row[k] == 0.0f);
        }
        if (nonfinite) {
#pragma omp critical(ft_lp_bad_row)
            if (bad < 0 || n < bad) bad = n;
            continue;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        scale[n] = amax / 127.0f;
        for (int64_t k = 0; k < K; k++) {
            float v = rintf(row[k] * inv);
            v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
            q[n * K + k] = (int8_t)(int32_t)v;
        }
    }
    if (bad >= 0)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "%s: row %lld has a non-finite value (NaN or infinity); int8 weights "
                        "need finite ones", what, (long long)bad);
    return FT_OK;
}
