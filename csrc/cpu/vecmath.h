/* The activations of the linear layers' epilogues on whole SIMD registers (AVX-512, AVX2+FMA):
 * mathfun.h's formulas (Cephes exp with a Cody-Waite reduction, the erfc of Numerical Recipes'
 * Chebyshev fit) evaluated with FMA, and 1 / (1 + z / 2) as a reciprocal estimate refined by
 * one Newton step. Elementwise, so a value never depends on its neighbours; the bits differ
 * from mathfun.h's (FMA), accuracy does not: GELU within 3e-6 relative of float64 wherever
 * |GELU(x)| > 1e-6 (tests/test_cpu_kernels.py). Include only from files that use the target attributes. */
#ifndef FT_CPU_VECMATH_H
#define FT_CPU_VECMATH_H
#include <immintrin.h>
#include <stdint.h>

#include "fasttran.h"

#define FT_EXP_LO -87.33f
#define FT_EXP_HI 88.37f
#define FT_LOG2E 1.44269504088896341f
#define FT_LN2_HI 0.693359375f
#define FT_LN2_LO -2.12194440e-4f
#define FT_EXP_POLY(FMA, SET1, p, r)                                                                   \
    p = FMA(p, r, SET1(1.3981999507e-3f)); p = FMA(p, r, SET1(8.3334519073e-3f));                     \
    p = FMA(p, r, SET1(4.1665795894e-2f)); p = FMA(p, r, SET1(1.6666665459e-1f));                     \
    p = FMA(p, r, SET1(5.0000001201e-1f))
#define FT_ERFC_POLY(FMA, SET1, q, t)                                                                  \
    q = FMA(q, t, SET1(-0.82215223f)); q = FMA(q, t, SET1(1.48851587f));                              \
    q = FMA(q, t, SET1(-1.13520398f)); q = FMA(q, t, SET1(0.27886807f));                              \
    q = FMA(q, t, SET1(-0.18628806f)); q = FMA(q, t, SET1(0.09678418f));                              \
    q = FMA(q, t, SET1(0.37409196f)); q = FMA(q, t, SET1(1.00002368f));                               \
    q = FMA(q, t, SET1(-1.26551223f))

/* lanes [0, left) of a 16-lane AVX-512 register (left clamped to 0..16) */
static inline __mmask16 ft_mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* ---- AVX-512 -------------------------------------------------------------------------------- */
#define FT_V512 __attribute__((target("avx512f"), always_inline)) static inline
FT_V512 __m512 ft_exp512(__m512 x) {   /* NaN stays NaN (max/min return their second operand) */
    x = _mm512_min_ps(_mm512_set1_ps(FT_EXP_HI), _mm512_max_ps(_mm512_set1_ps(FT_EXP_LO), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(FT_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(FT_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(FT_LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    FT_EXP_POLY(_mm512_fmadd_ps, _mm512_set1_ps, p, r);
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
FT_V512 __m512 ft_rcp512(__m512 d) {   /* 1 / d for d >= 1: 14-bit estimate, one Newton step */
    const __m512 r = _mm512_rcp14_ps(d);
    return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
}
/* act(x) for GELU (both forms) and ReLU; -1: none. Tanh is not here: 1 - 2 / (exp(2x) + 1) loses
 * its relative accuracy near 0, so callers keep libm's tanhf for it (ft_vec_act). */
FT_V512 __m512 ft_act512(__m512 x, int act) {
    switch (act) {
    case FT_ACT_GELU_ERF: {   /* 0.5 x erfc(-x / sqrt 2) */
        const __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.70710678118654752f));
        const __m512 t = ft_rcp512(_mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.0f)));
        __m512 q = _mm512_set1_ps(0.17087277f);
        FT_ERFC_POLY(_mm512_fmadd_ps, _mm512_set1_ps, q, t);
        /* -z^2 + q as -(x / 2) x + q, one rounding: z itself is rounded, and erfc's relative
         * error grows with 2 z^2 times the error of its argument */
        const __m512 hx = _mm512_mul_ps(x, _mm512_set1_ps(0.5f));
        const __m512 c = _mm512_mul_ps(t, ft_exp512(_mm512_fnmadd_ps(hx, x, q)));
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x),
                             _mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_set1_ps(2.0f), c), c));
    }
    case FT_ACT_GELU_TANH: {  /* 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)) (mathfun.h) */
        const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
        const __m512 d = _mm512_add_ps(ft_exp512(_mm512_mul_ps(y, _mm512_set1_ps(-2.0f))), _mm512_set1_ps(1.0f));
        return _mm512_div_ps(x, d);
    }
    case FT_ACT_RELU: return _mm512_max_ps(x, _mm512_setzero_ps());   /* NaN -> 0, as x > 0 ? x : 0 */
    default: return x;
    }
}

/* act'(x) for the training backward, every activation (tanh from 1 - 2 / (exp(2x) + 1): its
 * derivative 1 - t^2 keeps its accuracy): the formulas of train_layer.c's act_grad */
FT_V512 __m512 ft_act_grad512(__m512 x, int act) {
    switch (act) {
    case FT_ACT_GELU_ERF: {   /* Phi(x) + x phi(x) */
        const __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.70710678118654752f));
        const __m512 t = ft_rcp512(_mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.0f)));
        __m512 q = _mm512_set1_ps(0.17087277f);
        FT_ERFC_POLY(_mm512_fmadd_ps, _mm512_set1_ps, q, t);
        const __m512 hx = _mm512_mul_ps(x, _mm512_set1_ps(0.5f));
        const __m512 c = _mm512_mul_ps(t, ft_exp512(_mm512_fnmadd_ps(hx, x, q)));   /* erfc(|x| / sqrt 2) */
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 half_c = _mm512_mul_ps(_mm512_set1_ps(0.5f), c);
        const __m512 Phi = _mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_set1_ps(1.0f), half_c), half_c);
        const __m512 phi = _mm512_mul_ps(ft_exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hx), x)),
                                         _mm512_set1_ps(0.39894228040143268f));
        return _mm512_fmadd_ps(x, phi, Phi);
    }
    case FT_ACT_GELU_TANH: {
        const __m512 xx = _mm512_mul_ps(x, x);
        const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                       _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), xx), x, x));
        const __m512 th = _mm512_sub_ps(_mm512_set1_ps(1.0f),
            _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(ft_exp512(_mm512_add_ps(u, u)), _mm512_set1_ps(1.0f))));
        const __m512 sech2 = _mm512_fnmadd_ps(th, th, _mm512_set1_ps(1.0f));
        const __m512 du = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                        _mm512_fmadd_ps(_mm512_set1_ps(0.134145f), xx, _mm512_set1_ps(1.0f)));
        return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), sech2), du,
                               _mm512_mul_ps(_mm512_set1_ps(0.5f), _mm512_add_ps(_mm512_set1_ps(1.0f), th)));
    }
    case FT_ACT_RELU:
        return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    default: {   /* tanh */
        const __m512 th = _mm512_sub_ps(_mm512_set1_ps(1.0f),
            _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(ft_exp512(_mm512_add_ps(x, x)), _mm512_set1_ps(1.0f))));
        return _mm512_fnmadd_ps(th, th, _mm512_set1_ps(1.0f));
    }
    }
}

/* ---- AVX2 + FMA ----------------------------------------------------------------------------- */
#define FT_V256 __attribute__((target("avx2,fma"), always_inline)) static inline
/* lanes [0, left) of an 8-lane AVX2 register (left clamped to 0..8), for maskload / maskstore */
FT_V256 __m256i ft_mask8(int64_t left) {
    const int n = left >= 8 ? 8 : left <= 0 ? 0 : (int)left;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
FT_V256 __m256 ft_exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(FT_EXP_HI), _mm256_max_ps(_mm256_set1_ps(FT_EXP_LO), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(FT_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(FT_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(FT_LN2_LO), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    FT_EXP_POLY(_mm256_fmadd_ps, _mm256_set1_ps, p, r);
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
FT_V256 __m256 ft_rcp256(__m256 d) {   /* 1 / d for d >= 1: 12-bit estimate, one Newton step */
    const __m256 r = _mm256_rcp_ps(d);
    return _mm256_fmadd_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(1.0f)), r);
}
FT_V256 __m256 ft_act256(__m256 x, int act) {
    switch (act) {
    case FT_ACT_GELU_ERF: {
        const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(0.70710678118654752f));
        const __m256 t = ft_rcp256(_mm256_fmadd_ps(z, _mm256_set1_ps(0.5f), _mm256_set1_ps(1.0f)));
        __m256 q = _mm256_set1_ps(0.17087277f);
        FT_ERFC_POLY(_mm256_fmadd_ps, _mm256_set1_ps, q, t);
        const __m256 hx = _mm256_mul_ps(x, _mm256_set1_ps(0.5f));
        const __m256 c = _mm256_mul_ps(t, ft_exp256(_mm256_fnmadd_ps(hx, x, q)));
        const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
        return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x),
                             _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(2.0f), c), c, neg));
    }
    case FT_ACT_GELU_TANH: {
        const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
        const __m256 d = _mm256_add_ps(ft_exp256(_mm256_mul_ps(y, _mm256_set1_ps(-2.0f))), _mm256_set1_ps(1.0f));
        return _mm256_div_ps(x, d);
    }
    case FT_ACT_RELU: return _mm256_max_ps(x, _mm256_setzero_ps());
    default: return x;
    }
}

FT_V256 __m256 ft_act_grad256(__m256 x, int act) {   /* ft_act_grad512 on 8 lanes */
    switch (act) {
    case FT_ACT_GELU_ERF: {
        const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(0.70710678118654752f));
        const __m256 t = ft_rcp256(_mm256_fmadd_ps(z, _mm256_set1_ps(0.5f), _mm256_set1_ps(1.0f)));
        __m256 q = _mm256_set1_ps(0.17087277f);
        FT_ERFC_POLY(_mm256_fmadd_ps, _mm256_set1_ps, q, t);
        const __m256 hx = _mm256_mul_ps(x, _mm256_set1_ps(0.5f));
        const __m256 c = _mm256_mul_ps(t, ft_exp256(_mm256_fnmadd_ps(hx, x, q)));
        const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 half_c = _mm256_mul_ps(_mm256_set1_ps(0.5f), c);
        const __m256 Phi = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), half_c), half_c, neg);
        const __m256 phi = _mm256_mul_ps(ft_exp256(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), hx), x)),
                                         _mm256_set1_ps(0.39894228040143268f));
        return _mm256_fmadd_ps(x, phi, Phi);
    }
    case FT_ACT_GELU_TANH: {
        const __m256 xx = _mm256_mul_ps(x, x);
        const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                       _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), xx), x, x));
        const __m256 th = _mm256_sub_ps(_mm256_set1_ps(1.0f),
            _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(ft_exp256(_mm256_add_ps(u, u)), _mm256_set1_ps(1.0f))));
        const __m256 sech2 = _mm256_fnmadd_ps(th, th, _mm256_set1_ps(1.0f));
        const __m256 du = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                        _mm256_fmadd_ps(_mm256_set1_ps(0.134145f), xx, _mm256_set1_ps(1.0f)));
        return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), sech2), du,
                               _mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_add_ps(_mm256_set1_ps(1.0f), th)));
    }
    case FT_ACT_RELU:
        return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    default: {
        const __m256 th = _mm256_sub_ps(_mm256_set1_ps(1.0f),
            _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(ft_exp256(_mm256_add_ps(x, x)), _mm256_set1_ps(1.0f))));
        return _mm256_fnmadd_ps(th, th, _mm256_set1_ps(1.0f));
    }
    }
}

/* c = act(c + bias) on a tile's accumulators before they are stored: the same operations as
 * ft_cpu_epilogue on the stored values, so the same bits; act a constant after inlining */
#define FT_EPI_REGS(ADD, ACT, rows, c0, c1, b0, b1, has_bias, act)                     \
    do {                                                                               \
        _Pragma("GCC unroll 12") for (int i = 0; i < (rows); i++) {                    \
            if (has_bias) { c0[i] = ADD(c0[i], b0); c1[i] = ADD(c1[i], b1); }          \
            if ((act) >= 0) { c0[i] = ACT(c0[i], act); c1[i] = ACT(c1[i], act); }      \
        }                                                                              \
    } while (0)

/* A rows x 32 AVX-512 register tile of float32 accumulators, c0[i] (columns 0-15) and c1[i]
 * (16-31), lanes masked by m0 / m1: loaded from c (row stride ldc) when accumulating (rows < m),
 * else zero; and finished: bias + activation on the registers (FT_EPI_REGS), rows [0, m) stored.
 * The float32 kernel (kernels.c) and the bf16 one (lowp.c) share them. */
#define FT_TILE512_INIT(c0, c1, rows, c, ldc, m, m0, m1, accumulate)                   \
    _Pragma("GCC unroll 12") for (int i = 0; i < (rows); i++) {                        \
        if ((accumulate) && i < (m)) {                                                 \
            c0[i] = _mm512_maskz_loadu_ps(m0, (c) + i * (ldc));                        \
            c1[i] = _mm512_maskz_loadu_ps(m1, (c) + i * (ldc) + 16);                   \
        } else {                                                                       \
            c0[i] = _mm512_setzero_ps();                                               \
            c1[i] = _mm512_setzero_ps();                                               \
        }                                                                              \
    }
#define FT_TILE512_FINISH(c0, c1, rows, c, ldc, m, m0, m1, bias, act)                  \
    do {                                                                               \
        if ((bias) || (act) >= 0) {                                                    \
            const __m512 bb0 = (bias) ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();      \
            const __m512 bb1 = (bias) ? _mm512_maskz_loadu_ps(m1, (bias) + 16) : _mm512_setzero_ps(); \
            FT_EPI_REGS(_mm512_add_ps, ft_act512, rows, c0, c1, bb0, bb1, (bias) != NULL, act); \
        }                                                                              \
        _Pragma("GCC unroll 12") for (int i = 0; i < (rows); i++) {                    \
            if (i < (m)) {                                                             \
                _mm512_mask_storeu_ps((c) + i * (ldc), m0, c0[i]);                     \
                _mm512_mask_storeu_ps((c) + i * (ldc) + 16, m1, c1[i]);                \
            }                                                                          \
        }                                                                              \
    } while (0)

/* whether ft_act512 / ft_act256 compute `act` (-1 counts: nothing to compute) */
static inline int ft_vec_act(int act) { return act != FT_ACT_TANH; }
#endif
