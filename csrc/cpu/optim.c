/* Fused LAMB and AdamW on the CPU (see ft_optimizer_step for the equations).
 *
 * Memory-bound: a step must touch each array as few times as the algorithm allows. AdamW is one
 * pass (read g, m, v, w; write m, v, w). LAMB needs ||u|| of a tensor before any of its weights
 * can move, so it is two passes per tensor: (2) update m, v and reduce ||u||^2 and ||w||^2; (3)
 * recompute u from the new m, v and apply it, rather than storing u (one more write and read of
 * every element). Tensors are processed in groups small enough for the last-level cache, pass 2
 * then pass 3 per group, so pass 3 mostly reads m, v, w from the cache. Pass 1 (the global
 * gradient norm, for clipping and the finiteness check) reads the gradients once more.
 *
 * Reductions are per block of OPT_BLOCK elements into a partial array, then summed in block order
 * in double: the result does not depend on the number of threads (deterministic training). */
#include <math.h>
#include <stdlib.h>

#include "core/dtype.h"
#include "core/status.h"
#include "cpu_ops.h"

#define OPT_BLOCK 16384
#define OPT_GROUP_ELEMS (1 << 20)   /* ~12 MiB of w, m, v per group: fits a 32 MiB L3 */

typedef struct { size_t t; int64_t a, b; } opt_block;

typedef struct {
    float clip, b1, omb1, b2, omb2, ibc1, ibc2, eps;   /* omb = 1 - b, from the double */
} opt_coef;

/* the Adam moment update both optimizers share: m, v updated in place, new values returned */
static inline void adam_moments(const opt_coef *k, float g, float *m, float *v, float *mi, float *vi) {
    g *= k->clip;
    *mi = k->b1 * *m + k->omb1 * g;
    *vi = k->b2 * *v + k->omb2 * g * g;
    *m = *mi;
    *v = *vi;
}

static double sumsq(const float *x, int64_t n) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
    return s;
}

static void write_copy(const ft_optim_tensor *t, int64_t a, int64_t b) {
    if (!t->copy) return;
    uint16_t *c = (uint16_t *)t->copy;
    if (t->copy_dtype == FT_BF16)
        for (int64_t i = a; i < b; i++) c[i] = ft_f32_to_bf16(t->param[i]);
    else
        for (int64_t i = a; i < b; i++) c[i] = ft_f32_to_f16(t->param[i]);
}

/* LAMB pass 2 over [a, b): new m, v; returns sum u^2 and sum w^2 */
static void lamb_moments(const ft_optim_tensor *t, int64_t a, int64_t b, const opt_coef *k, double out[2]) {
    float *m = t->m, *v = t->v;
    const float *g = t->grad, *w = t->param;
    const float wd = t->weight_decay;
    double su = 0.0, sw = 0.0;
#pragma omp simd reduction(+ : su, sw)
    for (int64_t i = a; i < b; i++) {
        float mi, vi;
        adam_moments(k, g[i], &m[i], &v[i], &mi, &vi);
        float u = (mi * k->ibc1) / (sqrtf(vi * k->ibc2) + k->eps) + wd * w[i];
        su += (double)u * u;
        sw += (double)w[i] * w[i];
    }
    out[0] = su;
    out[1] = sw;
}

/* LAMB pass 3 over [a, b): w -= step * u, u recomputed exactly as in pass 2 */
static void lamb_apply(const ft_optim_tensor *t, int64_t a, int64_t b, const opt_coef *k, float step) {
    const float *m = t->m, *v = t->v;
    float *w = t->param;
    const float wd = t->weight_decay;
#pragma omp simd
    for (int64_t i = a; i < b; i++) {
        float u = (m[i] * k->ibc1) / (sqrtf(v[i] * k->ibc2) + k->eps) + wd * w[i];
        w[i] -= step * u;
    }
    write_copy(t, a, b);
}

static void adamw_update(const ft_optim_tensor *t, int64_t a, int64_t b, const opt_coef *k, float lr) {
    float *m = t->m, *v = t->v, *w = t->param;
    const float *g = t->grad;
    const float decay = (float)(1.0 - (double)lr * t->weight_decay);
#pragma omp simd
    for (int64_t i = a; i < b; i++) {
        float mi, vi;
        adam_moments(k, g[i], &m[i], &v[i], &mi, &vi);
        w[i] = w[i] * decay - lr * (mi * k->ibc1) / (sqrtf(vi * k->ibc2) + k->eps);
    }
    write_copy(t, a, b);
}

ft_status cpu_optim_step(ft_backend *be, const ft_optim_config *cfg, const ft_optim_tensor *t, size_t count,
                         ft_optim_info *info) {
    (void)be;
    /* the block table: blocks of tensor k are first[k] .. first[k+1]-1 */
    size_t nblk = 0;
    for (size_t k = 0; k < count; k++) nblk += (size_t)((t[k].n + OPT_BLOCK - 1) / OPT_BLOCK);
    opt_block *blk = malloc((nblk ? nblk : 1) * sizeof *blk);
    size_t *first = malloc((count + 1) * sizeof *first);
    double *part = malloc((nblk ? nblk : 1) * 2 * sizeof *part);
    if (!blk || !first || !part) {
        free(blk); free(first); free(part);
        return ft_error(FT_ERR_NOMEM, "optimizer step: cannot allocate the block table for %zu tensors", count);
    }
    size_t j = 0;
    for (size_t k = 0; k < count; k++) {
        first[k] = j;
        for (int64_t a = 0; a < t[k].n; a += OPT_BLOCK)
            blk[j++] = (opt_block){k, a, a + OPT_BLOCK < t[k].n ? a + OPT_BLOCK : t[k].n};
    }
    first[count] = j;

    /* pass 1: global gradient norm */
    double gnorm = NAN;
    float clip = 1.0f;
    if (cfg->max_grad_norm > 0.0 || cfg->check_finite) {
#pragma omp parallel for schedule(static)
        for (size_t q = 0; q < nblk; q++) part[q] = sumsq(t[blk[q].t].grad + blk[q].a, blk[q].b - blk[q].a);
        double s = 0.0;
        for (size_t q = 0; q < nblk; q++) s += part[q];
        if (!isfinite(s)) {
            size_t bad = 0;
            for (size_t q = 0; q < nblk; q++)
                if (!isfinite(part[q])) { bad = blk[q].t; break; }
            free(blk); free(first); free(part);
            return ft_error(FT_ERR_INVALID_ARGUMENT,
                            "the gradient of tensor %zu is not finite (NaN or Inf) at step %lld; nothing was updated",
                            bad, (long long)cfg->step);
        }
        gnorm = sqrt(s);
        if (cfg->max_grad_norm > 0.0 && gnorm > cfg->max_grad_norm) clip = (float)(cfg->max_grad_norm / gnorm);
    }
    if (info) { info->grad_norm = gnorm; info->clip_scale = clip; info->kernel_launches = 0; }

    opt_coef k = {clip, (float)cfg->beta1, (float)(1.0 - cfg->beta1), (float)cfg->beta2, (float)(1.0 - cfg->beta2),
                  1.0f, 1.0f, (float)cfg->eps};
    if (cfg->bias_correction) {
        k.ibc1 = (float)(1.0 / (1.0 - pow(cfg->beta1, (double)cfg->step)));
        k.ibc2 = (float)(1.0 / (1.0 - pow(cfg->beta2, (double)cfg->step)));
    }

    if (cfg->kind == FT_OPT_ADAMW) {
#pragma omp parallel for schedule(static)
        for (size_t q = 0; q < nblk; q++) adamw_update(&t[blk[q].t], blk[q].a, blk[q].b, &k, (float)cfg->lr);
    } else {
        for (size_t g0 = 0; g0 < count;) {
            size_t g1 = g0 + 1;
            int64_t elems = t[g0].n;
            while (g1 < count && elems + t[g1].n <= OPT_GROUP_ELEMS) elems += t[g1++].n;
            const size_t q0 = first[g0], q1 = first[g1];
#pragma omp parallel for schedule(static)
            for (size_t q = q0; q < q1; q++) lamb_moments(&t[blk[q].t], blk[q].a, blk[q].b, &k, part + 2 * q);
            /* trust ratio per tensor, then the update with it */
            float *step = malloc((g1 - g0) * sizeof *step);
            if (!step) {
                free(blk); free(first); free(part);
                return ft_error(FT_ERR_NOMEM, "optimizer step: out of memory");
            }
            for (size_t c = g0; c < g1; c++) {
                double su = 0.0, sw = 0.0;
                for (size_t q = first[c]; q < first[c + 1]; q++) { su += part[2 * q]; sw += part[2 * q + 1]; }
                double phi = (su > 0.0 && sw > 0.0) ? sqrt(sw) / sqrt(su) : 1.0;
                step[c - g0] = (float)(cfg->lr * phi);
            }
#pragma omp parallel for schedule(static)
            for (size_t q = q0; q < q1; q++) lamb_apply(&t[blk[q].t], blk[q].a, blk[q].b, &k, step[blk[q].t - g0]);
            free(step);
            g0 = g1;
        }
    }
    free(blk); free(first); free(part);
    return FT_OK;
}
