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
#define OPT_PARALLEL_ELEMS (1 << 16) /* below this a step runs on one thread: a parallel region
                                        costs more than it saves, and much more when other
                                        OpenMP runtimes (torch's) still hold the cores */

typedef struct { size_t t; int64_t a, b; } opt_block;

typedef struct {
    float clip, b1, omb1, b2, omb2, ibc1, ibc2, eps;   /* omb = 1 - b, from the double */
    float lr, wd, decay;                              /* decay = 1 - lr wd (AdamW), from the doubles */
} opt_coef;

/* the coefficients of each tensor, from its group and its step; neighbours with the same group
 * and step (the usual case) share the powers */
static void tensor_coefs(const ft_optim_config *cfg, const ft_optim_tensor *t, size_t count, float clip,
                         opt_coef *k) {
    for (size_t c = 0; c < count; c++) {
        if (c > 0 && t[c].group == t[c - 1].group && t[c].step == t[c - 1].step) {
            k[c] = k[c - 1];
        } else {
            const ft_optim_group *g = &cfg->groups[t[c].group];
            k[c] = (opt_coef){clip, (float)g->beta1, (float)(1.0 - g->beta1), (float)g->beta2, (float)(1.0 - g->beta2),
                              1.0f, 1.0f, (float)g->eps, (float)g->lr, 0.0f, 1.0f};
            if (g->bias_correction) {
                k[c].ibc1 = (float)(1.0 / (1.0 - pow(g->beta1, (double)t[c].step)));
                k[c].ibc2 = (float)(1.0 / (1.0 - pow(g->beta2, (double)t[c].step)));
            }
        }
        const ft_optim_group *g = &cfg->groups[t[c].group];
        const double wd = t[c].decay ? g->weight_decay : 0.0;
        k[c].wd = (float)wd;
        k[c].decay = (float)(1.0 - g->lr * wd);
    }
}

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
    const float wd = k->wd;
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
    const float wd = k->wd;
#pragma omp simd
    for (int64_t i = a; i < b; i++) {
        float u = (m[i] * k->ibc1) / (sqrtf(v[i] * k->ibc2) + k->eps) + wd * w[i];
        w[i] -= step * u;
    }
    write_copy(t, a, b);
}

static void adamw_update(const ft_optim_tensor *t, int64_t a, int64_t b, const opt_coef *k) {
    float *m = t->m, *v = t->v, *w = t->param;
    const float *g = t->grad;
    const float decay = k->decay, lr = k->lr;
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
    /* the block table: blocks of tensor k are first[k] .. first[k+1]-1; one allocation for the
     * block table, partial sums, per-tensor coefficients and LAMB step sizes */
    size_t nblk = 0;
    for (size_t k = 0; k < count; k++) nblk += (size_t)((t[k].n + OPT_BLOCK - 1) / OPT_BLOCK);
    const size_t nb = nblk ? nblk : 1, nc = count ? count : 1;
    int64_t elems = 0;
    for (size_t k = 0; k < count; k++) elems += t[k].n;
    const int par = elems >= OPT_PARALLEL_ELEMS;
    char *mem = malloc(nb * sizeof(opt_block) + (nc + 1) * sizeof(size_t) + nb * 2 * sizeof(double) +
                       nc * sizeof(opt_coef) + nc * sizeof(float));
    if (!mem) return ft_error(FT_ERR_NOMEM, "optimizer step: cannot allocate the block table for %zu tensors", count);
    double *part = (double *)mem;
    opt_block *blk = (opt_block *)(part + 2 * nb);
    size_t *first = (size_t *)(blk + nb);
    opt_coef *coef = (opt_coef *)(first + nc + 1);
    float *step = (float *)(coef + nc);
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
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (par)
        for (size_t q = 0; q < nblk; q++) part[q] = sumsq(t[blk[q].t].grad + blk[q].a, blk[q].b - blk[q].a);
        double s = 0.0;
        for (size_t q = 0; q < nblk; q++) s += part[q];
        if (!isfinite(s)) {
            size_t bad = 0;
            for (size_t q = 0; q < nblk; q++)
                if (!isfinite(part[q])) { bad = blk[q].t; break; }
            free(mem);
            if (info) info->bad_tensor = (int64_t)bad;
            return ft_error(FT_ERR_INVALID_ARGUMENT,
                            "the gradient of tensor %zu is not finite (NaN or Inf) at step %lld; nothing was updated",
                            bad, (long long)t[bad].step);
        }
        gnorm = sqrt(s);
        if (cfg->max_grad_norm > 0.0 && gnorm > cfg->max_grad_norm) clip = (float)(cfg->max_grad_norm / gnorm);
    }
    if (info) { info->grad_norm = gnorm; info->clip_scale = clip; info->kernel_launches = 0; }
    tensor_coefs(cfg, t, count, clip, coef);

    if (cfg->kind == FT_OPT_ADAMW) {
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (par)
        for (size_t q = 0; q < nblk; q++) adamw_update(&t[blk[q].t], blk[q].a, blk[q].b, &coef[blk[q].t]);
    } else {
        for (size_t g0 = 0; g0 < count;) {
            size_t g1 = g0 + 1;
            int64_t gelems = t[g0].n;
            while (g1 < count && gelems + t[g1].n <= OPT_GROUP_ELEMS) gelems += t[g1++].n;
            const size_t q0 = first[g0], q1 = first[g1];
            const int gpar = gelems >= OPT_PARALLEL_ELEMS;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (gpar)
            for (size_t q = q0; q < q1; q++)
                lamb_moments(&t[blk[q].t], blk[q].a, blk[q].b, &coef[blk[q].t], part + 2 * q);
            /* trust ratio per tensor, then the update with it */
            for (size_t c = g0; c < g1; c++) {
                double su = 0.0, sw = 0.0;
                for (size_t q = first[c]; q < first[c + 1]; q++) { su += part[2 * q]; sw += part[2 * q + 1]; }
                double phi = (su > 0.0 && sw > 0.0) ? sqrt(sw) / sqrt(su) : 1.0;
                step[c] = (float)(cfg->groups[t[c].group].lr * phi);
            }
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (gpar)
            for (size_t q = q0; q < q1; q++)
                lamb_apply(&t[blk[q].t], blk[q].a, blk[q].b, &coef[blk[q].t], step[blk[q].t]);
            g0 = g1;
        }
    }
    free(mem);
    return FT_OK;
}
