/* Fused per-row ops of the CPU backend: each reads and writes a row once, rows in parallel
 * (OpenMP), the inner loops vectorised. LayerNorm uses two passes (mean, then the centred
 * variance) like PyTorch, so results agree to float rounding. */
#include <math.h>

#include "cpu_ops.h"
#include "mathfun.h"

/* y = (x - mean) / sqrt(var + eps) * gamma + beta over one row, in place */
static inline void layernorm_row(float *x, const float *gamma, const float *beta, int64_t C, float eps) {
    float mean = 0.0f;
#pragma omp simd reduction(+ : mean)
    for (int64_t c = 0; c < C; c++) mean += x[c];
    mean /= (float)C;
    float var = 0.0f;
#pragma omp simd reduction(+ : var)
    for (int64_t c = 0; c < C; c++) { float d = x[c] - mean; var += d * d; }
    var /= (float)C;
    float rstd = 1.0f / sqrtf(var + eps);
#pragma omp simd
    for (int64_t c = 0; c < C; c++) x[c] = (x[c] - mean) * rstd * gamma[c] + beta[c];
}

ft_status cpu_embed_ln_forward(ft_backend *be, float *out, const int32_t *ids, const int32_t *types,
                               const float *word, const float *pos, const float *type,
                               const float *gamma, const float *beta, int64_t B, int64_t T,
                               int64_t C, float eps) {
    (void)be;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < B * T; r++) {
        const float *w = word + (int64_t)ids[r] * C;
        const float *p = pos + (r % T) * C;
        const float *ty = type + (int64_t)(types ? types[r] : 0) * C;
        float *o = out + r * C;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) o[c] = w[c] + ty[c] + p[c];   /* HF's order of sums */
        layernorm_row(o, gamma, beta, C, eps);
    }
    return FT_OK;
}

ft_status cpu_broadcast_rows(ft_backend *be, float *dst, const float *bias, int64_t N, int64_t C) {
    (void)be;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; r++) memcpy(dst + r * C, bias, (size_t)C * sizeof(float));
    return FT_OK;
}

ft_status cpu_bias_act_forward(ft_backend *be, float *h, const float *bias, int64_t N, int64_t I,
                               ft_activation act) {
    (void)be;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; r++) {
        float *x = h + r * I;
        switch (act) {
        case FT_ACT_GELU_ERF:
#pragma omp simd
            for (int64_t i = 0; i < I; i++) x[i] = ft_gelu_erf(x[i] + bias[i]);
            break;
        case FT_ACT_GELU_TANH:
#pragma omp simd
            for (int64_t i = 0; i < I; i++) x[i] = ft_gelu_tanh(x[i] + bias[i]);
            break;
        case FT_ACT_RELU:
#pragma omp simd
            for (int64_t i = 0; i < I; i++) { float v = x[i] + bias[i]; x[i] = v > 0.0f ? v : 0.0f; }
            break;
        case FT_ACT_TANH:
            for (int64_t i = 0; i < I; i++) x[i] = tanhf(x[i] + bias[i]);
            break;
        }
    }
    return FT_OK;
}

ft_status cpu_bias_residual_ln_forward(ft_backend *be, float *out, const float *residual,
                                       const float *y, const float *bias, const float *gamma,
                                       const float *beta, int64_t N, int64_t C, float eps) {
    (void)be;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; r++) {
        float *o = out + r * C;
        const float *a = residual + r * C, *b = y + r * C;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) o[c] = (b[c] + bias[c]) + a[c];   /* dense(x) + input */
        layernorm_row(o, gamma, beta, C, eps);
    }
    return FT_OK;
}

ft_status cpu_pool_forward(ft_backend *be, float *out, const float *h, const float *keymask,
                           int64_t B, int64_t T, int64_t C, ft_pooling mode) {
    (void)be;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        float *o = out + b * C;
        const float *hb = h + b * T * C;
        if (mode == FT_POOL_CLS) { memcpy(o, hb, (size_t)C * sizeof(float)); continue; }
        /* sentence-transformers: sum(mask * h) / clamp(sum(mask), min=1e-9) */
        float count = 0.0f;
        for (int64_t c = 0; c < C; c++) o[c] = 0.0f;
        for (int64_t t = 0; t < T; t++) {
            float m = keymask[b * T + t];
            if (m == 0.0f) continue;
            count += m;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] += hb[t * C + c];
        }
        float inv = 1.0f / (count > 1e-9f ? count : 1e-9f);
#pragma omp simd
        for (int64_t c = 0; c < C; c++) o[c] *= inv;
    }
    return FT_OK;
}
