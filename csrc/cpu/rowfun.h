/* Per-row building blocks shared by the CPU ops (rowops.c, linear.c, attention.c).
 *
 * Reductions (LayerNorm statistics, softmax sums) add into 16 fixed lanes, element c into lane
 * c % 16, then fold the lanes in a fixed tree: the order depends on the row length only, never
 * on the row's address or on how a compiler chose to vectorise, so a row gives the same bits
 * wherever it sits in a batch. Elementwise loops are exact whatever their vectorisation. */
#ifndef FT_CPU_ROWFUN_H
#define FT_CPU_ROWFUN_H
#include <math.h>
#include <stdint.h>

#include "fasttran.h"
#include "mathfun.h"

#define FT_LANES 16

static inline float ft_fold_lanes(float *lane) {
    for (int w = FT_LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

/* sum of x[0..n) */
static inline float ft_row_sum(const float *x, int64_t n) {
    float lane[FT_LANES] = {0};
    int64_t c = 0;
    for (; c + FT_LANES <= n; c += FT_LANES)
        for (int l = 0; l < FT_LANES; l++) lane[l] += x[c + l];
    for (int l = 0; c + l < n; l++) lane[l] += x[c + l];
    return ft_fold_lanes(lane);
}

/* sum of (x - mean)^2 */
static inline float ft_row_sqdev(const float *x, int64_t n, float mean) {
    float lane[FT_LANES] = {0};
    int64_t c = 0;
    for (; c + FT_LANES <= n; c += FT_LANES)
        for (int l = 0; l < FT_LANES; l++) { float d = x[c + l] - mean; lane[l] += d * d; }
    for (int l = 0; c + l < n; l++) { float d = x[c + l] - mean; lane[l] += d * d; }
    return ft_fold_lanes(lane);
}

/* y = (x - mean) / sqrt(var + eps) * gamma + beta (beta NULL: no bias) in place; two passes (mean, then the centred
 * variance) like PyTorch */
static inline void ft_layernorm_row(float *x, const float *gamma, const float *beta, int64_t C, float eps) {
    const float mean = ft_row_sum(x, C) / (float)C;
    const float var = ft_row_sqdev(x, C, mean) / (float)C;
    const float rstd = 1.0f / sqrtf(var + eps);
    if (!beta) {   /* a LayerNorm without bias (ModernBERT) */
#pragma omp simd
        for (int64_t c = 0; c < C; c++) x[c] = (x[c] - mean) * rstd * gamma[c];
        return;
    }
#pragma omp simd
    for (int64_t c = 0; c < C; c++) x[c] = (x[c] - mean) * rstd * gamma[c] + beta[c];
}

/* out = LN((y + bias) + residual) (transformers' order: dense(x) + input); out may alias y or
 * residual; bias may be NULL */
static inline void ft_bias_residual_ln_row(float *out, const float *residual, const float *y, const float *bias,
                                           const float *gamma, const float *beta, int64_t C, float eps) {
    if (bias) {
#pragma omp simd
        for (int64_t c = 0; c < C; c++) out[c] = (y[c] + bias[c]) + residual[c];
    } else {
#pragma omp simd
        for (int64_t c = 0; c < C; c++) out[c] = y[c] + residual[c];
    }
    ft_layernorm_row(out, gamma, beta, C, eps);
}

/* x = act(x) in place */
static inline void ft_activation_row(float *x, int64_t n, ft_activation act) {
    switch (act) {
    case FT_ACT_GELU_ERF:
#pragma omp simd
        for (int64_t i = 0; i < n; i++) x[i] = ft_gelu_erf(x[i]);
        break;
    case FT_ACT_GELU_TANH:
#pragma omp simd
        for (int64_t i = 0; i < n; i++) x[i] = ft_gelu_tanh(x[i]);
        break;
    case FT_ACT_RELU:
#pragma omp simd
        for (int64_t i = 0; i < n; i++) x[i] = x[i] > 0.0f ? x[i] : 0.0f;
        break;
    case FT_ACT_TANH:
        for (int64_t i = 0; i < n; i++) x[i] = tanhf(x[i]);
        break;
    }
}
/* Rotary position embeddings as transformers computes them in float32: f_i = 1 / theta^(2i / hs)
 * (the exponent a float32 quotient, the power rounded to float32), the angle p f_i as a float32
 * product, its cosine and sine rounded to float32; a pair (x_i, x_{i + hs/2}) becomes
 * (x_i c - x_{i+hs/2} s, x_{i+hs/2} c + x_i s), each product rounded (q cos + rotate_half(q) sin). */
static inline void ft_rotary_inv_freq(float *inv, int64_t hs, double theta) {
    for (int64_t i = 0; i < hs / 2; i++) {
        const float e = (float)(2 * i) / (float)hs;
        inv[i] = 1.0f / (float)pow(theta, (double)e);
    }
}
static inline void ft_rotary_cos_sin(float *cs, const float *inv, int64_t h2, int64_t pos) {
    for (int64_t i = 0; i < h2; i++) {
        const float a = (float)pos * inv[i];
        cs[i] = (float)cos((double)a);
        cs[h2 + i] = (float)sin((double)a);
    }
}
static inline void ft_rotary_row(float *x, const float *cs, int64_t h2) {
    for (int64_t i = 0; i < h2; i++) {
        const float a = x[i], b = x[h2 + i], c = cs[i], s = cs[h2 + i];
        x[i] = a * c - b * s;   /* -std=c11: no contraction into fused multiply-adds */
        x[h2 + i] = b * c + a * s;
    }
}
#endif
