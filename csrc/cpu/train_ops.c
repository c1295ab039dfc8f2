/* Training ops of the CPU backend for the task heads: dropout with recomputed masks, tanh
 * backward, softmax cross-entropy with its gradient, and axis sums (bias gradients). Every loop
 * is over independent rows or elements in a fixed order, so results do not depend on the
 * thread count. */
#include <math.h>

#include "core/rng.h"
#include "cpu_ops.h"

ft_status cpu_dropout(ft_backend *be, float *y, const float *x, int64_t n, float p, uint64_t key) {
    (void)be;
    const uint32_t thr = ft_dropout_threshold(p);
    const float scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (n > 65536)
    for (int64_t i = 0; i < n; i++) y[i] = ft_dropout_keep(key, (uint64_t)i, thr) ? x[i] * scale : 0.0f;
    return FT_OK;
}

void ft_cpu_dropout_row(float *row, uint8_t *mask, int64_t n, uint64_t key, uint64_t e0, uint32_t thr,
                        float keep_scale) {
    if (mask) {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) {
            const int keep = ft_dropout_keep(key, e0 + (uint64_t)j, thr);
            mask[j] = (uint8_t)keep;
            row[j] = keep ? row[j] * keep_scale : 0.0f;
        }
    } else {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) row[j] = ft_dropout_keep(key, e0 + (uint64_t)j, thr) ? row[j] * keep_scale : 0.0f;
    }
}

ft_status cpu_scale(ft_backend *be, float *x, int64_t n, float s) {
    (void)be;
#pragma omp parallel for simd schedule(static) num_threads(ft_num_threads()) if (n > 65536)
    for (int64_t i = 0; i < n; i++) x[i] *= s;
    return FT_OK;
}

ft_status cpu_tanh_backward(ft_backend *be, float *dx, const float *dy, const float *y, int64_t n) {
    (void)be;
#pragma omp parallel for simd schedule(static) num_threads(ft_num_threads()) if (n > 65536)
    for (int64_t i = 0; i < n; i++) dx[i] = dy[i] * (1.0f - y[i] * y[i]);
    return FT_OK;
}

ft_status cpu_softmax_xent(ft_backend *be, float *loss, float *dlogits, const float *logits, const float *valid,
                           int64_t valid_rows, const int32_t *labels, int64_t N, int64_t K, float scale) {
    (void)be;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * K > 65536)
    for (int64_t r = 0; r < N; r++) {
        const float *z = logits + r * K;
        const float *ok = valid ? valid + (r % valid_rows) * K : NULL;
        float *dz = dlogits ? dlogits + r * K : NULL;
        float mx = -INFINITY;
        for (int64_t k = 0; k < K; k++)
            if (!ok || ok[k] != 0.0f) mx = z[k] > mx ? z[k] : mx;
        if (mx == -INFINITY) {   /* no valid position: no loss, no gradient */
            loss[r] = 0.0f;
            if (dz) memset(dz, 0, (size_t)K * sizeof(float));
            continue;
        }
        double sum = 0.0;
        for (int64_t k = 0; k < K; k++)
            if (!ok || ok[k] != 0.0f) sum += exp((double)z[k] - mx);
        const double lse = mx + log(sum);
        const int32_t y = labels[r];
        loss[r] = (float)(lse - z[y]);
        if (dz)
            for (int64_t k = 0; k < K; k++) {
                double pk = (!ok || ok[k] != 0.0f) ? exp((double)z[k] - lse) : 0.0;
                dz[k] = (float)(scale * (pk - (k == y ? 1.0 : 0.0)));
            }
    }
    return FT_OK;
}

ft_status cpu_sum_axis(ft_backend *be, float *out, const float *x, int64_t N, int64_t K, int axis) {
    (void)be;
    if (axis == 0) {
        for (int64_t k = 0; k < K; k++) out[k] = 0.0f;
        for (int64_t r = 0; r < N; r++) {
            const float *row = x + r * K;
#pragma omp simd
            for (int64_t k = 0; k < K; k++) out[k] += row[k];
        }
    } else {
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * K > 65536)
        for (int64_t r = 0; r < N; r++) {
            const float *row = x + r * K;
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += row[k];
            out[r] = s;
        }
    }
    return FT_OK;
}
