/* Training ops of an encoder layer on the CPU (backend.h, "training of encoder layers"): the
 * LayerNorm forward that keeps its statistics and its backward, the activation forward that keeps
 * what its backward needs and its backward, attention over packed sequences with its backward.
 * The activations and their derivatives run on the kernel set's registers (the linear layers'
 * epilogue, ft_cpu_act_grad_row: vecmath.h); Tempo's recovery of GELU's input from its output uses
 * core/activation.h (double precision, the same source as the CUDA ops); dropout masks come from
 * core/rng.h. Row loops are independent and column sums (dgamma, dbeta) run over fixed row chunks
 * reduced in order, so results do not depend on the thread count. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "blas.h"
#include "core/activation.h"
#include "core/rng.h"
#include "core/status.h"
#include "cpu_ops.h"
#include "kernels.h"
#include "mathfun.h"
#include "rowfun.h"

#define LN_CHUNK 64   /* rows per partial column sum */

/* Per row: o = dropout(y + bias) + residual, kept as the LayerNorm input when asked, then the
 * LayerNorm of inference (rowfun.h: statistics in 16 fixed lanes; with p = 0 the same bits as
 * linear_residual_ln_forward's rows) and its statistics */
ft_status cpu_residual_ln_train_forward(ft_backend *be, float *out, float *ln_in, float *stats, const float *residual,
                                        const float *y, const float *bias, const float *gamma, const float *beta,
                                        int64_t N, int64_t C, float eps, float p, uint64_t key) {
    (void)be;
    const uint32_t thr = p > 0.0f ? ft_dropout_threshold(p) : 0;
    const float scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * C > 32768)
    for (int64_t r = 0; r < N; r++) {
        const float *a = residual + r * C, *b = y + r * C;
        float *o = out + r * C;
        if (thr) {   /* one elementwise pass: out may alias residual or y */
#pragma omp simd
            for (int64_t c = 0; c < C; c++) {
                const float v = b[c] + bias[c];
                o[c] = (ft_dropout_keep(key, (uint64_t)(r * C + c), thr) ? v * scale : 0.0f) + a[c];
            }
        } else {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] = (b[c] + bias[c]) + a[c];
        }
        if (ln_in) memcpy(ln_in + r * C, o, (size_t)C * sizeof(float));
        const float mean = ft_row_sum(o, C) / (float)C;
        const float rstd = 1.0f / sqrtf(ft_row_sqdev(o, C, mean) / (float)C + eps);
#pragma omp simd
        for (int64_t c = 0; c < C; c++) o[c] = (o[c] - mean) * rstd * gamma[c] + beta[c];
        stats[2 * r] = mean;
        stats[2 * r + 1] = rstd;
    }
    return FT_OK;
}

/* Per row: the embeddings' sum in embed_ln_forward's order, kept, then its LayerNorm and statistics
 * (the same arithmetic as ft_layernorm_row: embed_ln_forward's bits) */
ft_status cpu_embed_train_forward(ft_backend *be, float *out, float *sum, float *stats, const int32_t *ids,
                                  const int32_t *types, const int32_t *positions, const float *word, const float *pos,
                                  const float *type, const float *gamma, const float *beta, int64_t N, int64_t C,
                                  float eps) {
    (void)be;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * C > 32768)
    for (int64_t r = 0; r < N; r++) {
        const float *w = word + (int64_t)ids[r] * C;
        float *o = sum + r * C, *y = out + r * C;
        if (!pos) {
            memcpy(o, w, (size_t)C * sizeof(float));
        } else if (type) {
            const float *p = pos + (int64_t)positions[r] * C, *ty = type + (types ? (int64_t)types[r] * C : 0);
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] = w[c] + ty[c] + p[c];
        } else {
            const float *p = pos + (int64_t)positions[r] * C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] = w[c] + p[c];
        }
        const float mean = ft_row_sum(o, C) / (float)C;
        const float rstd = 1.0f / sqrtf(ft_row_sqdev(o, C, mean) / (float)C + eps);
        if (beta) {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) y[c] = (o[c] - mean) * rstd * gamma[c] + beta[c];
        } else {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) y[c] = (o[c] - mean) * rstd * gamma[c];
        }
        stats[2 * r] = mean;
        stats[2 * r + 1] = rstd;
    }
    return FT_OK;
}

/* Each table zeroed, then its rows summed: the threads split the columns, each running over the rows
 * in order, so every sum has one order whatever the thread count */
ft_status cpu_embed_backward(ft_backend *be, float *dword, float *dpos, float *dtype, const float *dsum,
                             const int32_t *ids, const int32_t *types, const int32_t *positions, int64_t N, int64_t C,
                             int64_t n_word, int64_t n_pos, int64_t n_type) {
    (void)be;
    float *tables[3] = {dword, dpos, dtype};
    const int32_t *index[3] = {ids, positions, types};
    const int64_t rows[3] = {n_word, n_pos, n_type};
    for (int t = 0; t < 3; t++) {
        if (!tables[t]) continue;
        memset(tables[t], 0, (size_t)rows[t] * (size_t)C * sizeof(float));
        const int32_t *ix = index[t];
        float *d = tables[t];
        const int64_t blocks = (C + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * C > 32768)
        for (int64_t k = 0; k < blocks; k++) {
            const int64_t c0 = k * 64, c1 = c0 + 64 < C ? c0 + 64 : C;
            for (int64_t r = 0; r < N; r++) {
                float *o = d + (ix ? (int64_t)ix[r] : 0) * C;
                const float *g = dsum + r * C;
#pragma omp simd
                for (int64_t c = c0; c < c1; c++) o[c] += g[c];
            }
        }
    }
    return FT_OK;
}

/* One pass over row chunks: per row the normalised input (from the saved input and the row's
 * statistics, or from the output: Tempo), its share of dgamma / dbeta (double, per chunk, reduced
 * in chunk order: the thread count never changes a bit), then dx. A row's dx is written after
 * its dy was read, so dx may alias dy. */
ft_status cpu_layernorm_backward(ft_backend *be, float *dx, float *dgamma, float *dbeta, const float *dy,
                                 const float *saved, const float *stats, const float *gamma, const float *beta,
                                 int64_t N, int64_t C, int saved_is_output) {
    (void)be;
    const int64_t chunks = (N + LN_CHUNK - 1) / LN_CHUNK;
    double *partial = calloc((size_t)(chunks ? chunks : 1) * 2 * (size_t)C, sizeof(double));
    if (!partial) return ft_error(FT_ERR_NOMEM, "layernorm_backward: out of memory for %lld partial sums", (long long)chunks);
    int failed = 0;
#pragma omp parallel num_threads(ft_num_threads()) if (N * C > 32768)
    {
        float *xh = malloc((size_t)(C ? C : 1) * 2 * sizeof(float)), *g = xh + C;
        if (!xh) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t k = 0; k < chunks; k++) {
            if (!xh) continue;
            double *sg = partial + k * 2 * C, *sb = sg + C;
            const int64_t r1 = (k + 1) * LN_CHUNK < N ? (k + 1) * LN_CHUNK : N;
            for (int64_t r = k * LN_CHUNK; r < r1; r++) {
                const float *sv = saved + r * C, *d = dy + r * C;
                const float mean = stats[2 * r], rstd = stats[2 * r + 1];
                if (saved_is_output) {
#pragma omp simd
                    for (int64_t c = 0; c < C; c++) xh[c] = (sv[c] - beta[c]) / gamma[c];
                } else {
#pragma omp simd
                    for (int64_t c = 0; c < C; c++) xh[c] = (sv[c] - mean) * rstd;
                }
                double s1 = 0.0, s2 = 0.0;
#pragma omp simd reduction(+ : s1, s2)
                for (int64_t c = 0; c < C; c++) {
                    sg[c] += (double)d[c] * xh[c];
                    sb[c] += d[c];
                    g[c] = d[c] * gamma[c];
                    s1 += g[c];
                    s2 += (double)g[c] * xh[c];
                }
                const float m1 = (float)(s1 / (double)C), m2 = (float)(s2 / (double)C);
                float *o = dx + r * C;
#pragma omp simd
                for (int64_t c = 0; c < C; c++) o[c] = rstd * (g[c] - m1 - xh[c] * m2);
            }
        }
        free(xh);
    }
    if (failed) {
        free(partial);
        return ft_error(FT_ERR_NOMEM, "layernorm_backward: out of memory for a row buffer");
    }
    for (int64_t c = 0; c < C; c++) {
        double gs = 0.0, bs = 0.0;
        for (int64_t k = 0; k < chunks; k++) { gs += partial[k * 2 * C + c]; bs += partial[k * 2 * C + C + c]; }
        dgamma[c] = (float)gs;
        dbeta[c] = (float)bs;
    }
    free(partial);
    return FT_OK;
}

ft_status cpu_bias_act_train_forward(ft_backend *be, float *f, float *pre, uint8_t *bits, const float *h,
                                     const float *bias, int64_t N, int64_t K, ft_activation act) {
    (void)be;
    const int64_t total = N * K, nbytes = (total + 7) / 8;
    if (bits) {   /* before f, which may overwrite h */
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (total > 65536)
        for (int64_t t = 0; t < nbytes; t++) {
            uint8_t byte = 0;
            for (int j = 0; j < 8 && t * 8 + j < total; j++) {
                const int64_t i = t * 8 + j;
                byte |= (uint8_t)(ft_gelu_left((double)(h[i] + bias[i % K]), (int)act) << j);
            }
            bits[t] = byte;
        }
    }
    /* f = act(h + bias) row by row on the kernel set's registers: the linear layers' epilogue */
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (total > 65536)
    for (int64_t r = 0; r < N; r++) {
        float *fr = f + r * K;
        const float *hr = h + r * K;
        if (pre) {
#pragma omp simd
            for (int64_t c = 0; c < K; c++) pre[r * K + c] = hr[c] + bias[c];
        }
        if (fr != hr) memcpy(fr, hr, (size_t)K * sizeof(float));
        ft_cpu_epilogue(fr, K, 1, (int)K, bias, (int)act);
    }
    return FT_OK;
}

ft_status cpu_bias_act_backward(ft_backend *be, float *dh, const float *df, const float *saved, const uint8_t *bits,
                                const float *in, const float *w, const float *bias, int64_t N, int64_t K, int64_t C,
                                ft_activation act) {
    (void)be;
    const int64_t total = N * K;
    if (bits) {   /* saved is the output: recover the input on its side of the minimum */
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (total > 16384)
        for (int64_t i = 0; i < total; i++) {
            double x;
            if (act == FT_ACT_RELU) {
                x = saved[i] > 0.0f ? 1.0 : -1.0;
            } else if (act == FT_ACT_TANH) {
                x = atanh(fmin(fmax((double)saved[i], -1.0 + 1e-16), 1.0 - 1e-16));
            } else if (ft_gelu_flat(saved[i], (int)act)) {   /* recompute the GEMM's element */
                const float *a = in + (i / K) * C, *b = w + (i % K) * C;
                float s = 0.0f;
                for (int64_t c = 0; c < C; c++) s += a[c] * b[c];
                x = s + bias[i % K];
            } else {
                x = ft_gelu_invertf(saved[i], (bits[i >> 3] >> (i & 7)) & 1, (int)act);
            }
            dh[i] = df[i] * ft_act_gradf((float)x, act);
        }
        return FT_OK;
    }
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (total > 16384)
    for (int64_t r = 0; r < N; r++) ft_cpu_act_grad_row(dh + r * K, df + r * K, saved + r * K, K, (int)act);
    return FT_OK;
}

/* per row: a = h[:K], g = h[K:]; dh[:K] = dout g act'(a) (the kernel set's derivative), dh[K:] =
 * dout act(a) (act(a) as gated_act_forward computes it) */
ft_status cpu_gated_act_backward(ft_backend *be, float *dh, const float *dout, const float *h, int64_t N, int64_t K,
                                 ft_activation act) {
    (void)be;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * K > 16384)
    for (int64_t r = 0; r < N; r++) {
        const float *a = h + r * 2 * K, *g = a + K, *d = dout + r * K;
        float *da = dh + r * 2 * K, *dg = da + K;
        for (int64_t i = 0; i < K; i++) da[i] = d[i] * g[i];
        ft_cpu_act_grad_row(da, da, a, K, (int)act);
        memcpy(dg, a, (size_t)K * sizeof(float));
        ft_activation_row(dg, K, act);
        for (int64_t i = 0; i < K; i++) dg[i] *= d[i];
    }
    return FT_OK;
}

/* score blocks per worker: the recomputed probabilities (when they are not kept), and one that
 * holds the dropped probabilities until dV is done, then dP and dS */
#define ATTN_BLOCKS 2

size_t cpu_attention_train_scratch_bytes(ft_backend *be, int64_t B, int64_t T, int64_t NH) {
    (void)be; (void)B; (void)NH;   /* ATTN_BLOCKS (T, T) score blocks per worker (ft_num_threads) */
    return (size_t)ft_num_threads() * ATTN_BLOCKS * (size_t)T * (size_t)T * sizeof(float);
}

/* (sequence, head) tasks: the sequence of task j, its first row, length and probs offset */
typedef struct { int64_t first, n, base; } seq_task;

/* what attention's forward and backward both derive from their arguments */
typedef struct {
    seq_task *tasks;
    int64_t ntasks, tmax, hs, ld;   /* tasks; the longest sequence; head size; qkv row stride */
    float scale, keep_scale;        /* 1/sqrt(hs); 1/(1-p) */
    uint32_t thr;                   /* dropout threshold, 0 when p == 0 */
} attn_plan;

static ft_status attn_plan_make(attn_plan *pl, const int32_t *seqs, int64_t B, int64_t C, int64_t NH, float p,
                                const char *op) {
    pl->hs = C / NH;
    pl->ld = 3 * C;
    pl->scale = 1.0f / sqrtf((float)pl->hs);
    pl->thr = p > 0.0f ? ft_dropout_threshold(p) : 0;
    pl->keep_scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
    pl->tasks = malloc((size_t)(B > 0 ? B : 1) * (size_t)NH * sizeof *pl->tasks);
    if (!pl->tasks) return ft_error(FT_ERR_NOMEM, "%s: out of memory", op);
    int64_t base = 0, k = 0;
    pl->tmax = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = seqs[3 * b + 1];
        for (int64_t h = 0; h < NH; h++) pl->tasks[k++] = (seq_task){seqs[3 * b], n, base + h * n * n};
        base += NH * n * n;
        pl->tmax = n > pl->tmax ? n : pl->tmax;
    }
    pl->ntasks = k;
    return FT_OK;
}

/* the team for a scratch of scratch_bytes: ATTN_BLOCKS (T, T) score blocks per worker, at most
 * ft_num_threads() workers -- never more than the scratch holds, even when another thread
 * raised the thread count after the caller sized it */
static ft_status scratch_workers(const attn_plan *pl, size_t scratch_bytes, const char *op, int *workers) {
    const size_t slot = ATTN_BLOCKS * (size_t)pl->tmax * (size_t)pl->tmax * sizeof(float);
    const size_t fit = slot ? scratch_bytes / slot : (size_t)ft_num_threads();
    if (fit < 1) {
        free(pl->tasks);
        return ft_error(FT_ERR_INVALID_ARGUMENT, "%s: a scratch of %zu bytes holds no worker's score blocks (%zu bytes)",
                        op, scratch_bytes, slot);
    }
    const int nt = ft_num_threads();
    *workers = fit < (size_t)nt ? (int)fit : nt;
    return FT_OK;
}

/* local attention's training ops: a window >= 0, and no dropout with one */
static ft_status check_window(int64_t window, float p, const char *op) {
    if (window < 0) return ft_error(FT_ERR_INVALID_ARGUMENT, "%s: window %lld < 0", op, (long long)window);
    if (window > 0 && p > 0.0f)
        return ft_error(FT_ERR_UNSUPPORTED, "%s: dropout on local attention's probabilities (window %lld, p %g) is not "
                        "supported; use attention dropout 0", op, (long long)window, (double)p);
    return FT_OK;
}

ft_status cpu_attention_train_forward(ft_backend *be, ft_dtype prec, float *ctx, float *probs, float *stats,
                                      uint8_t *dmask, const float *qkv, const int32_t *seqs, int64_t B, int64_t C,
                                      int64_t NH, int64_t window, float p, uint64_t key, float *scratch,
                                      size_t scratch_bytes) {
    (void)be;
    FT_TRY(ft_cpu_check_prec(prec, "attention_train_forward"));
    FT_TRY(check_window(window, p, "attention_train_forward"));
    if (!probs && !stats)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "attention_train_forward: probs and stats are both NULL (the "
                        "backward needs one of them)");
    attn_plan pl;
    ft_status st = attn_plan_make(&pl, seqs, B, C, NH, p, "attention_train_forward");
    if (st != FT_OK) return st;
    int workers = 1;
    if ((st = scratch_workers(&pl, scratch_bytes, "attention_train_forward", &workers)) != FT_OK) return st;
    free(pl.tasks);
    /* the packed-panel kernels of inference attention (attention.c): the scratch only bounds the
     * team here, each worker packs its panels in its own buffer */
    (void)scratch;
    return ft_cpu_attention_train_heads(prec, ctx, probs, stats, dmask, qkv, seqs, B, C, NH, p, key, workers,
                                        window > 0 ? window / 2 : -1);
}

ft_status cpu_attention_backward(ft_backend *be, ft_dtype prec, float *dqkv, const float *dctx, const float *qkv,
                                 const float *probs, const float *stats, const uint8_t *dmask, const int32_t *seqs,
                                 int64_t B, int64_t C, int64_t NH, int64_t window, float p, uint64_t key,
                                 float *scratch, size_t scratch_bytes) {
    (void)be;
    FT_TRY(ft_cpu_check_prec(prec, "attention_backward"));
    FT_TRY(check_window(window, p, "attention_backward"));
    const int64_t half = window > 0 ? window / 2 : -1;
    if (!probs && !stats)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "attention_backward: probs and stats are both NULL");
    attn_plan pl;
    ft_status st = attn_plan_make(&pl, seqs, B, C, NH, p, "attention_backward");
    if (st != FT_OK) return st;
    int workers = 1;
    if ((st = scratch_workers(&pl, scratch_bytes, "attention_backward", &workers)) != FT_OK) return st;
    const int64_t hs = pl.hs, ld = pl.ld, ntasks = pl.ntasks, tmax = pl.tmax;
    const float scale = pl.scale, keep_scale = pl.keep_scale;
    const uint32_t thr = pl.thr;
    const seq_task *tasks = pl.tasks;
    const int rounded = prec != FT_F32;
    const int blas_threads = ft_blas_get_threads();
    ft_blas_set_threads(1);
    int failed = 0;
#pragma omp parallel num_threads(workers)
    {
        float *Pr = scratch + (size_t)omp_get_thread_num() * ATTN_BLOCKS * (size_t)tmax * (size_t)tmax;
        float *dS = Pr + (size_t)tmax * (size_t)tmax, *Pd = dS;   /* Pd is read by dV before dPd is written */
        /* mixed precision: the head's Q, K, V and dO rounded to prec, (n, hs) each */
        float *rq = rounded ? malloc((size_t)(tmax * hs > 0 ? tmax * hs : 1) * 4 * sizeof(float)) : NULL;
        if (rounded && !rq) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < ntasks; j++) {
            const int64_t n = tasks[j].n, h = j % NH, base = tasks[j].base;
            if (n == 0 || (rounded && !rq)) continue;
            const float *q = qkv + tasks[j].first * ld + h * hs, *k = q + C, *v = q + 2 * C;
            const float *dout = dctx + tasks[j].first * C + h * hs;
            float *dq = dqkv + tasks[j].first * ld + h * hs, *dk = dq + C, *dv = dq + 2 * C;
            int64_t lq = ld, lo = C;   /* row strides of q, k, v and of dout */
            if (rounded) {
                float *r = rq;
                for (int64_t i = 0; i < n; i++) {
                    ft_cpu_round_row(r + i * hs, q + i * ld, hs, prec);
                    ft_cpu_round_row(r + (n + i) * hs, k + i * ld, hs, prec);
                    ft_cpu_round_row(r + (2 * n + i) * hs, v + i * ld, hs, prec);
                    ft_cpu_round_row(r + (3 * n + i) * hs, dout + i * C, hs, prec);
                }
                q = r;
                k = r + n * hs;
                v = r + 2 * n * hs;
                dout = r + 3 * n * hs;
                lq = lo = hs;
            }
            const float *P = probs ? probs + base : Pr, *pd = P;
            if (!probs) {   /* recomputed: P = exp(scale Q K^T - m) / sum, (m, 1 / sum) per row */
                ft_blas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)n, (blasint)n, (blasint)hs, scale, q,
                              (blasint)lq, k, (blasint)lq, 0.0f, Pr, (blasint)n);
                for (int64_t i = 0; i < n; i++) {
                    const float *st = stats + ((tasks[j].first + i) * NH + h) * 2;
                    const float m = st[0], inv = st[1];
                    float *row = Pr + i * n;
#pragma omp simd
                    for (int64_t c = 0; c < n; c++) row[c] = ft_expf(row[c] - m) * inv;
                    if (half >= 0) {   /* a window: 0 outside the row's reach */
                        const int64_t lo = i - half > 0 ? i - half : 0, hi = i + half + 1 < n ? i + half + 1 : n;
                        memset(row, 0, (size_t)lo * sizeof(float));
                        if (hi < n) memset(row + hi, 0, (size_t)(n - hi) * sizeof(float));
                    }
                }
            }
            if (thr) {
                if (dmask) {
                    const uint8_t *mk = dmask + base;
#pragma omp simd
                    for (int64_t i = 0; i < n * n; i++) Pd[i] = mk[i] ? P[i] * keep_scale : 0.0f;
                } else {
                    memcpy(Pd, P, (size_t)(n * n) * sizeof(float));
                    ft_cpu_dropout_row(Pd, NULL, n * n, key, (uint64_t)base, thr, keep_scale);
                }
                pd = Pd;
            }
            if (rounded) {   /* the dropped probabilities as the product reads them */
                ft_cpu_round_row(Pd, pd, n * n, prec);
                pd = Pd;
            }
            /* dV (n, hs) = Pd^T dctx;  dPd (n, n) = dctx V^T */
            ft_blas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (blasint)n, (blasint)hs, (blasint)n, 1.0f, pd,
                          (blasint)n, dout, (blasint)lo, 0.0f, dv, (blasint)ld);
            ft_blas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)n, (blasint)n, (blasint)hs, 1.0f, dout,
                          (blasint)lo, v, (blasint)lq, 0.0f, dS, (blasint)n);
            /* dP = dropout backward of dPd; dS = P (dP - sum_j dP P) per row */
            for (int64_t i = 0; i < n; i++) {
                float *d = dS + i * n;
                const float *pr = P + i * n;
                if (thr) {
                    const int64_t e = base + i * n;
                    if (dmask) {
                        const uint8_t *mk = dmask + e;
#pragma omp simd
                        for (int64_t c = 0; c < n; c++) d[c] = mk[c] ? d[c] * keep_scale : 0.0f;
                    } else {
                        ft_cpu_dropout_row(d, NULL, n, key, (uint64_t)e, thr, keep_scale);
                    }
                }
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t c = 0; c < n; c++) dot += d[c] * pr[c];
#pragma omp simd
                for (int64_t c = 0; c < n; c++) d[c] = pr[c] * (d[c] - dot);
            }
            if (rounded) ft_cpu_round_row(dS, dS, n * n, prec);
            /* dQ (n, hs) = dS K scale;  dK (n, hs) = dS^T Q scale */
            ft_blas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)n, (blasint)hs, (blasint)n, scale, dS,
                          (blasint)n, k, (blasint)lq, 0.0f, dq, (blasint)ld);
            ft_blas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (blasint)n, (blasint)hs, (blasint)n, scale, dS,
                          (blasint)n, q, (blasint)lq, 0.0f, dk, (blasint)ld);
        }
        free(rq);
    }
    ft_blas_set_threads(blas_threads);
    free(pl.tasks);
    if (failed) return ft_error(FT_ERR_NOMEM, "attention_backward: out of memory for the rounded operands");
    return FT_OK;
}

ft_status cpu_pool_backward(ft_backend *be, float *dh, const float *dout, const int32_t *first, const int32_t *count,
                            int64_t B, int64_t N, int64_t C) {
    (void)be;
    memset(dh, 0, (size_t)N * (size_t)C * sizeof(float));
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * C > 65536)
    for (int64_t b = 0; b < B; b++) {
        const float n = (float)count[b], inv = 1.0f / (n > 1e-9f ? n : 1e-9f);
        for (int64_t t = 0; t < count[b]; t++) {
            float *row = dh + ((int64_t)first[b] + t) * C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) row[c] = dout[b * C + c] * inv;
        }
    }
    return FT_OK;
}
