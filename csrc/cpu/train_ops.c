/* Training ops of the CPU backend for the task heads: dropout with recomputed masks, tanh
 * backward, the losses with their gradients (softmax cross-entropy, span cross-entropy over packed
 * rows, squared error, binary cross-entropy on logits), and axis sums (bias gradients). Every loop
 * is over independent rows or elements in a fixed order, so results do not depend on the
 * thread count. */
#include <math.h>
#include <string.h>

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

ft_status cpu_add(ft_backend *be, float *y, const float *x, int64_t n) {
    (void)be;
#pragma omp parallel for simd schedule(static) num_threads(ft_num_threads()) if (n > 65536)
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
    return FT_OK;
}

ft_status cpu_tanh_backward(ft_backend *be, float *dx, const float *dy, const float *y, int64_t n) {
    (void)be;
#pragma omp parallel for simd schedule(static) num_threads(ft_num_threads()) if (n > 65536)
    for (int64_t i = 0; i < n; i++) dx[i] = dy[i] * (1.0f - y[i] * y[i]);
    return FT_OK;
}

/* the larger of a and b, NaN when either is: a NaN logit makes its row's loss NaN (never a silent
 * zero loss with NaN gradients) */
static inline float nan_max(float a, float b) { return (a != a || b != b) ? a + b : (b > a ? b : a); }

/* Softmax cross-entropy of one row of n logits z (stride 1) against label y over the positions with
 * ok != 0 (ok NULL: all): *loss; dz (or NULL) = scale (softmax - onehot), 0 at the others. A label
 * < 0 (an ignored row), or no valid position: loss 0, gradient 0. */
static void xent_row(const float *z, const float *ok, int64_t n, int32_t y, float scale, float *loss, float *dz) {
    float mx = -INFINITY;
    if (y >= 0)
        for (int64_t k = 0; k < n; k++)
            if (!ok || ok[k] != 0.0f) mx = nan_max(mx, z[k]);
    if (mx == -INFINITY) {
        *loss = 0.0f;
        if (dz) memset(dz, 0, (size_t)n * sizeof(float));
        return;
    }
    double sum = 0.0;
    for (int64_t k = 0; k < n; k++)
        if (!ok || ok[k] != 0.0f) sum += exp((double)z[k] - mx);
    const double lse = mx + log(sum);
    *loss = (float)(lse - z[y]);
    if (dz)
        for (int64_t k = 0; k < n; k++) {
            double p = (!ok || ok[k] != 0.0f) ? exp((double)z[k] - lse) : 0.0;
            dz[k] = (float)(scale * (p - (k == y ? 1.0 : 0.0)));
        }
}

ft_status cpu_softmax_xent(ft_backend *be, float *loss, float *dlogits, const float *logits, const float *valid,
                           int64_t valid_rows, const int32_t *labels, int64_t N, int64_t K, float scale) {
    (void)be;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * K > 65536)
    for (int64_t r = 0; r < N; r++)
        xent_row(logits + r * K, valid ? valid + (r % valid_rows) * K : NULL, K, labels[r], scale, &loss[r],
                 dlogits ? dlogits + r * K : NULL);
    return FT_OK;
}

ft_status cpu_span_xent(ft_backend *be, float *loss, float *dlogits, const float *logits, const float *valid,
                        const int32_t *first, const int32_t *count, const int32_t *labels, int64_t B, int64_t N,
                        float scale) {
    (void)be;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N > 65536)
    for (int64_t s = 0; s < 2 * B; s++) {   /* s = k B + b: start (k = 0) or end (k = 1) of sequence b */
        const int64_t f = first[s % B], off = (s / B) * N + f;
        xent_row(logits + off, valid + f, count[s % B], labels[s], scale, &loss[s], dlogits ? dlogits + off : NULL);
    }
    return FT_OK;
}

ft_status cpu_mse_loss(ft_backend *be, float *loss, float *dpred, const float *pred, const float *target, int64_t n,
                       float scale) {
    (void)be;
#pragma omp parallel for simd schedule(static) num_threads(ft_num_threads()) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        const float d = pred[i] - target[i];
        loss[i] = d * d;
        if (dpred) dpred[i] = scale * 2.0f * d;
    }
    return FT_OK;
}

ft_status cpu_bce_logits_loss(ft_backend *be, float *loss, float *dlogits, const float *logits, const float *target,
                              int64_t n, float scale) {
    (void)be;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        const double z = logits[i], y = target[i];
        /* log(1 + exp(-|z|)) without overflow; sigmoid from the same exp */
        const double e = exp(-fabs(z));
        loss[i] = (float)((z > 0.0 ? z : 0.0) - z * y + log1p(e));
        if (dlogits) dlogits[i] = (float)(scale * ((z >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e)) - y));
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
