/* Fused per-row ops of the CPU backend: each reads and writes a row once, rows in parallel
 * (OpenMP, dynamic chunks so that a thread slowed by another process takes fewer), the inner
 * loops vectorised. Row arithmetic lives in rowfun.h (fixed-order reductions). */
#include <math.h>
#include <string.h>

#include "cpu_ops.h"
#include "rowfun.h"

#define ROWS_PER_CHUNK 32

ft_status cpu_embed_ln_forward(ft_backend *be, ft_dtype dt, void *out_, const int32_t *ids, const int32_t *types,
                               const int32_t *positions, const void *word_, const void *pos_, const void *type_,
                               const void *gamma, const void *beta, int64_t N, int64_t C, float eps) {
    (void)be;
    FT_CPU_F32_ONLY(dt, "embed_ln_forward");
    float *out = out_;
    const float *word = word_, *pos = pos_, *type = type_;
#pragma omp parallel for schedule(dynamic, ROWS_PER_CHUNK) num_threads(ft_num_threads())
    for (int64_t r = 0; r < N; r++) {
        const float *w = word + (int64_t)ids[r] * C;
        float *o = out + r * C;
        if (!pos) {   /* no position table (rotary models) and no type table */
            memcpy(o, w, (size_t)C * sizeof(float));
            ft_layernorm_row(o, gamma, beta, C, eps);
            continue;
        }
        const float *p = pos + (int64_t)positions[r] * C;
        if (type) {
            const float *ty = type + (types ? (int64_t)types[r] * C : 0);
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] = w[c] + ty[c] + p[c];   /* HF's order of sums */
        } else {   /* no token types (DistilBERT) */
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] = w[c] + p[c];
        }
        ft_layernorm_row(o, gamma, beta, C, eps);
    }
    return FT_OK;
}

ft_status cpu_broadcast_rows(ft_backend *be, float *dst, const float *bias, int64_t N, int64_t C) {
    (void)be;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * C > 65536)
    for (int64_t r = 0; r < N; r++) memcpy(dst + r * C, bias, (size_t)C * sizeof(float));
    return FT_OK;
}

ft_status cpu_bias_act_forward(ft_backend *be, float *h, const float *bias, int64_t N, int64_t I,
                               ft_activation act) {
    (void)be;
#pragma omp parallel for schedule(dynamic, ROWS_PER_CHUNK) num_threads(ft_num_threads()) if (N * I > 65536)
    for (int64_t r = 0; r < N; r++) {
        float *x = h + r * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) x[i] += bias[i];
        ft_activation_row(x, I, act);
    }
    return FT_OK;
}

ft_status cpu_bias_residual_ln_forward(ft_backend *be, float *out, const float *residual,
                                       const float *y, const float *bias, const float *gamma,
                                       const float *beta, int64_t N, int64_t C, float eps) {
    (void)be;
#pragma omp parallel for schedule(dynamic, ROWS_PER_CHUNK) num_threads(ft_num_threads())
    for (int64_t r = 0; r < N; r++)
        ft_bias_residual_ln_row(out + r * C, residual + r * C, y + r * C, bias, gamma, beta, C, eps);
    return FT_OK;
}

ft_status cpu_pool_forward(ft_backend *be, ft_dtype dt, float *out, const void *h_, const int32_t *first,
                           const int32_t *count, int64_t B, int64_t C) {
    (void)be;
    FT_CPU_F32_ONLY(dt, "pool_forward");
    const float *h = h_;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (B * C > 65536)
    for (int64_t b = 0; b < B; b++) {
        float *o = out + b * C;
        for (int64_t c = 0; c < C; c++) o[c] = 0.0f;
        const float *hb = h + (int64_t)first[b] * C;
        for (int64_t t = 0; t < count[b]; t++) {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] += hb[t * C + c];
        }
        /* sentence-transformers: sum / clamp(count, min=1e-9); no row gives 0 */
        const float n = (float)count[b], inv = 1.0f / (n > 1e-9f ? n : 1e-9f);
#pragma omp simd
        for (int64_t c = 0; c < C; c++) o[c] *= inv;
    }
    return FT_OK;
}

ft_status cpu_scatter_rows(ft_backend *be, ft_dtype dt, float *dst, const void *src_, const int32_t *index,
                           int64_t N, int64_t C) {
    (void)be;
    FT_CPU_F32_ONLY(dt, "scatter_rows");
    const float *src = src_;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * C > 65536)
    for (int64_t r = 0; r < N; r++) memcpy(dst + (int64_t)index[r] * C, src + r * C, (size_t)C * sizeof(float));
    return FT_OK;
}

/* ---- pre-LN layers (ModernBERT) ---- */

ft_status cpu_rotary_forward(ft_backend *be, ft_dtype dt, void *qkv_, const int32_t *positions, int64_t N, int64_t C,
                             int64_t NH, double theta) {
    (void)be;
    FT_CPU_F32_ONLY(dt, "rotary_forward");
    const int64_t hs = C / NH, h2 = hs / 2;
    if (hs % 2 || !(theta > 0.0))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "rotary_forward: needs an even head size and theta > 0, got %lld, %g",
                        (long long)hs, theta);
    float *qkv = qkv_;
    float inv[h2 > 0 ? h2 : 1];
    ft_rotary_inv_freq(inv, hs, theta);
#pragma omp parallel for schedule(dynamic, ROWS_PER_CHUNK) num_threads(ft_num_threads()) if (N * C > 65536)
    for (int64_t r = 0; r < N; r++) {
        float cs[2 * (h2 > 0 ? h2 : 1)];
        ft_rotary_cos_sin(cs, inv, h2, positions[r]);
        float *row = qkv + r * 3 * C;
        for (int64_t k = 0; k < 2 * NH; k++)   /* Q's heads, then K's */
            ft_rotary_row(row + k * hs, cs, h2);
    }
    return FT_OK;
}

/* rotation by minus the forward's angle: the forward's cos / sin bits, the sine negated (exact) */
ft_status cpu_rotary_backward(ft_backend *be, float *dqkv, const int32_t *positions, int64_t N, int64_t C, int64_t NH,
                              double theta) {
    (void)be;
    const int64_t hs = C / NH, h2 = hs / 2;
    if (hs % 2 || !(theta > 0.0))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "rotary_backward: needs an even head size and theta > 0, got %lld, %g",
                        (long long)hs, theta);
    float inv[h2 > 0 ? h2 : 1];
    ft_rotary_inv_freq(inv, hs, theta);
#pragma omp parallel for schedule(dynamic, ROWS_PER_CHUNK) num_threads(ft_num_threads()) if (N * C > 65536)
    for (int64_t r = 0; r < N; r++) {
        float cs[2 * (h2 > 0 ? h2 : 1)];
        ft_rotary_cos_sin(cs, inv, h2, positions[r]);
        for (int64_t i = 0; i < h2; i++) cs[h2 + i] = -cs[h2 + i];
        float *row = dqkv + r * 3 * C;
        for (int64_t k = 0; k < 2 * NH; k++) ft_rotary_row(row + k * hs, cs, h2);
    }
    return FT_OK;
}

ft_status cpu_gated_act_forward(ft_backend *be, ft_dtype dt, void *out_, const void *h_, int64_t N, int64_t I,
                                ft_activation act) {
    (void)be;
    FT_CPU_F32_ONLY(dt, "gated_act_forward");
    float *out = out_;
    const float *h = h_;
#pragma omp parallel for schedule(dynamic, ROWS_PER_CHUNK) num_threads(ft_num_threads()) if (N * I > 65536)
    for (int64_t r = 0; r < N; r++) {
        float *o = out + r * I;
        const float *in = h + r * 2 * I, *gate = in + I;
        memcpy(o, in, (size_t)I * sizeof(float));
        ft_activation_row(o, I, act);
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] *= gate[i];
    }
    return FT_OK;
}

ft_status cpu_residual_ln_forward(ft_backend *be, ft_dtype dt, void *x_, void *h_, const void *y_, const void *gamma,
                                  const void *beta, int64_t N, int64_t C, float eps) {
    (void)be;
    FT_CPU_F32_ONLY(dt, "residual_ln_forward");
    float *x = x_, *h = h_;
    const float *y = y_;
#pragma omp parallel for schedule(dynamic, ROWS_PER_CHUNK) num_threads(ft_num_threads())
    for (int64_t r = 0; r < N; r++) {
        float *xr = x + r * C, *hr = h + r * C;
        if (y) {
            const float *yr = y + r * C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) xr[c] += yr[c];
        }
        memcpy(hr, xr, (size_t)C * sizeof(float));
        ft_layernorm_row(hr, gamma, beta, C, eps);
    }
    return FT_OK;
}
