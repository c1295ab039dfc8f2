/* Branch-free exp and GELU that GCC auto-vectorises (AVX2/AVX-512) inside `omp simd` loops.
 * libm's expf/erff are scalar calls; on BERT's FFN (B*T*I elements per layer) they would cost
 * as much as a GEMM. Accuracy: ft_expf within 2 ulp (Cephes minimax polynomial); the erf used
 * by GELU has relative error < 1.2e-7 on erfc (Numerical Recipes' Chebyshev fit). */
#ifndef FT_CPU_MATHFUN_H
#define FT_CPU_MATHFUN_H
#include <stdint.h>
#include <string.h>

#include "fasttran.h"

static inline float ft_expf(float x) {
    x = x < -87.33f ? -87.33f : x;
    x = x > 88.37f ? 88.37f : x;
    /* round to nearest with the 1.5 * 2^23 trick: floorf/rintf become libm calls under GCC's
     * default -ftrapping-math and stop the loop from vectorising */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;   /* Cody-Waite split of ln 2 */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* erfc(z) for z >= 0 */
static inline float ft_erfcf_pos(float z) {
    float t = 1.0f / (1.0f + 0.5f * z);
    float q = 0.17087277f;
    q = q * t - 0.82215223f;
    q = q * t + 1.48851587f;
    q = q * t - 1.13520398f;
    q = q * t + 0.27886807f;
    q = q * t - 0.18628806f;
    q = q * t + 0.09678418f;
    q = q * t + 0.37409196f;
    q = q * t + 1.00002368f;
    q = q * t - 1.26551223f;
    return t * ft_expf(-z * z + q);
}

/* GELU, erf form: 0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2) */
static inline float ft_gelu_erf(float x) {
    float z = (x < 0 ? -x : x) * 0.70710678118654752f;
    float c = ft_erfcf_pos(z);
    return 0.5f * x * (x < 0 ? c : 2.0f - c);
}

/* GELU, tanh form (gelu_new / gelu_pytorch_tanh): 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)),
 * which keeps its relative accuracy where 1 + tanh(y) would cancel (x < -3) */
static inline float ft_gelu_tanh(float x) {
    float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.0f + ft_expf(-2.0f * y));
}

/* act'(x) (the training backward's reference form; vecmath.h's ft_act_grad512/256 on registers) */
static inline float ft_act_gradf(float x, ft_activation act) {
    switch (act) {
    case FT_ACT_GELU_ERF: {   /* Phi(x) + x phi(x), Phi(x) = erfc(-x / sqrt 2) / 2 */
        const float z = (x < 0 ? -x : x) * 0.70710678118654752f, c = ft_erfcf_pos(z);
        return 0.5f * (x < 0 ? c : 2.0f - c) + x * ft_expf(-0.5f * x * x) * 0.39894228040143268f;
    }
    case FT_ACT_GELU_TANH: {
        const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        const float t = 1.0f - 2.0f / (ft_expf(2.0f * u) + 1.0f);
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 0.134145f * x * x);
    }
    case FT_ACT_RELU: return x > 0.0f ? 1.0f : 0.0f;
    default: {
        const float t = 1.0f - 2.0f / (ft_expf(2.0f * x) + 1.0f);
        return 1.0f - t * t;
    }
    }
}

#endif
