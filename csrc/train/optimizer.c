/* ft_optimizer_step: checks the arguments once, at the API boundary, then hands the whole tensor
 * list to the device's backend, which runs it as one fused step (cpu/optim.c, cuda/optim.cu).
 * ft_optim_table: the tensor table and moment estimates of an optimizer, built once. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "backend.h"
#include "core/status.h"

static int unit_interval(double x) { return x >= 0.0 && x < 1.0; }

static ft_status check_group(const ft_optim_group *g, size_t i) {
    if (!(g->lr >= 0.0) || !isfinite(g->lr))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "parameter group %zu: lr must be a finite number >= 0, got %g", i,
                        g->lr);
    if (!unit_interval(g->beta1) || !unit_interval(g->beta2))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "parameter group %zu: betas must lie in [0, 1), got (%g, %g)", i,
                        g->beta1, g->beta2);
    if (!(g->eps > 0.0) || !isfinite(g->eps))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "parameter group %zu: eps must be a finite number > 0, got %g", i,
                        g->eps);
    if (!(g->weight_decay >= 0.0) || !isfinite(g->weight_decay))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "parameter group %zu: weight_decay must be finite and >= 0, got %g",
                        i, g->weight_decay);
    return FT_OK;
}

ft_status ft_optimizer_step(ft_device dev, const ft_optim_config *cfg, const ft_optim_tensor *tensors,
                            size_t count, ft_optim_info *info) {
    if (info) *info = (ft_optim_info){NAN, 1.0, 0, -1};
    if (!cfg) return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer step: no configuration");
    if (cfg->kind != FT_OPT_ADAMW && cfg->kind != FT_OPT_LAMB)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer step: unknown optimizer %d", (int)cfg->kind);
    if (!isfinite(cfg->max_grad_norm))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "max_grad_norm must be finite, got %g", cfg->max_grad_norm);
    if (cfg->num_groups && !cfg->groups) return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer step: no group table");
    for (size_t i = 0; i < cfg->num_groups; i++) FT_TRY(check_group(&cfg->groups[i], i));
    if (count && !tensors) return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer step: no tensor table");
    for (size_t k = 0; k < count; k++) {
        const ft_optim_tensor *t = &tensors[k];
        if (t->n < 0) return ft_error(FT_ERR_INVALID_ARGUMENT, "tensor %zu: negative size %lld", k, (long long)t->n);
        if (t->n > 0 && (!t->param || !t->grad || !t->m || !t->v))
            return ft_error(FT_ERR_INVALID_ARGUMENT, "tensor %zu: missing parameter, gradient or state memory", k);
        if (t->group < 0 || (size_t)t->group >= cfg->num_groups)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "tensor %zu: parameter group %d of %zu", k, (int)t->group,
                            cfg->num_groups);
        if (t->step < 1)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "tensor %zu: step must be >= 1, got %lld", k, (long long)t->step);
        if (t->copy && t->copy_dtype != FT_F16 && t->copy_dtype != FT_BF16)
            return ft_error(FT_ERR_DTYPE, "tensor %zu: a model copy must be float16 or bfloat16, got %s", k,
                            ft_dtype_name(t->copy_dtype));
    }
    ft_backend *be = NULL;
    FT_TRY(ft_backend_for(dev, &be));
    if (!be->optim_step) return ft_error(FT_ERR_UNSUPPORTED, "the %s backend has no optimizer step", be->name);
    return be->optim_step(be, cfg, tensors, count, info);
}

/* ---- the table ------------------------------------------------------------------------------ */

#define TABLE_ALIGN 16   /* elements: each tensor's moments start on a 64-byte boundary */
#define ZERO_CHUNK ((size_t)1 << 20)

static ft_status zero_device(ft_device dev, float *p, int64_t n) {
    if (dev.kind == FT_DEVICE_CPU) {
        memset(p, 0, (size_t)n * sizeof(float));
        return FT_OK;
    }
    void *zeros = calloc(1, ZERO_CHUNK);
    if (!zeros) return ft_error(FT_ERR_NOMEM, "optimizer table: out of host memory");
    ft_status st = FT_OK;
    const size_t bytes = (size_t)n * sizeof(float);
    for (size_t off = 0; off < bytes && st == FT_OK; off += ZERO_CHUNK)
        st = ft_device_write(dev, (char *)p + off, zeros, bytes - off < ZERO_CHUNK ? bytes - off : ZERO_CHUNK);
    free(zeros);
    return st;
}

/* Moment memory. Host: 2 MiB-aligned and advised for transparent huge pages when large (as
 * NumPy does for large arrays): every step streams through all of it, and with 4 KiB pages the
 * TLB misses cost ~10% of a BERT-base step. Freed with ft_device_free (free() on the CPU). */
static ft_status alloc_moments(ft_device dev, size_t bytes, float **out) {
    if (dev.kind != FT_DEVICE_CPU) return ft_device_alloc(dev, bytes, (void **)out);
    const size_t huge = (size_t)1 << 21, align = bytes >= huge ? huge : 64;
    const size_t rounded = (bytes + align - 1) / align * align;
    void *p = aligned_alloc(align, rounded);
    if (!p) return ft_error(FT_ERR_NOMEM, "optimizer table: cannot allocate %zu bytes of moment estimates", bytes);
#ifdef MADV_HUGEPAGE
    if (align == huge) (void)madvise(p, rounded, MADV_HUGEPAGE);   /* advice only: failure is harmless */
#endif
    *out = p;
    return FT_OK;
}

void ft_optim_table_free(ft_optim_table *t) {
    if (!t) return;
    ft_device_free(t->device, t->m);
    ft_device_free(t->device, t->v);
    free(t->tensors);
    free(t->scratch);
    free(t->active);
    free(t->steps);
    free(t->steps_f32);
    free(t);
}

ft_status ft_optim_table_create(ft_device dev, size_t count, const int64_t *numel, const int32_t *group,
                                const int32_t *decay, ft_optim_table **out) {
    *out = NULL;
    if (count && (!numel || !group || !decay))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer table: missing sizes, groups or decay flags");
    int64_t total = 0;
    for (size_t k = 0; k < count; k++) {
        if (numel[k] < 0)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer table: tensor %zu has negative size %lld", k,
                            (long long)numel[k]);
        if (group[k] < 0) return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer table: tensor %zu has group %d", k, group[k]);
        total += (numel[k] + TABLE_ALIGN - 1) / TABLE_ALIGN * TABLE_ALIGN;
    }
    ft_optim_table *t = calloc(1, sizeof *t);
    const size_t c = count ? count : 1;
    if (t) {
        t->device = dev;
        t->count = count;
        t->total = total;
        t->tensors = calloc(c, sizeof *t->tensors);
        t->scratch = calloc(c, sizeof *t->scratch);
        t->active = calloc(c, 1);
        t->steps = calloc(c, sizeof *t->steps);
        t->steps_f32 = calloc(c, sizeof *t->steps_f32);
    }
    if (!t || !t->tensors || !t->scratch || !t->active || !t->steps || !t->steps_f32) {
        ft_optim_table_free(t);
        return ft_error(FT_ERR_NOMEM, "optimizer table: out of host memory for %zu tensors", count);
    }
    const size_t bytes = (size_t)(total ? total : 1) * sizeof(float);
    ft_status st = alloc_moments(dev, bytes, &t->m);
    if (st == FT_OK) st = alloc_moments(dev, bytes, &t->v);
    if (st == FT_OK) st = zero_device(dev, t->m, total);
    if (st == FT_OK) st = zero_device(dev, t->v, total);
    if (st != FT_OK) {
        ft_optim_table_free(t);
        return st;
    }
    int64_t off = 0;
    for (size_t k = 0; k < count; k++) {
        t->tensors[k] = (ft_optim_tensor){NULL, NULL, t->m + off, t->v + off, NULL, FT_F16, numel[k], 1, group[k],
                                          decay[k] != 0};
        off += (numel[k] + TABLE_ALIGN - 1) / TABLE_ALIGN * TABLE_ALIGN;
    }
    *out = t;
    return FT_OK;
}

ft_status ft_optim_table_step(ft_optim_table *t, const ft_optim_config *cfg, ft_optim_info *info) {
    if (info) *info = (ft_optim_info){NAN, 1.0, 0, -1};
    if (!t) return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer step: no table");
    /* the active tensors: the table itself when every tensor takes part (the common case) */
    size_t n = 0;
    for (size_t k = 0; k < t->count; k++) {
        t->tensors[k].step = t->steps[k] + 1;
        n += t->active[k] != 0;
    }
    if (n == 0) return FT_OK;
    const ft_optim_tensor *list = t->tensors;
    if (n < t->count) {
        size_t j = 0;
        for (size_t k = 0; k < t->count; k++)
            if (t->active[k]) t->scratch[j++] = t->tensors[k];
        list = t->scratch;
    }
    ft_status st = ft_optimizer_step(t->device, cfg, list, n, info);
    if (st != FT_OK) {
        if (info && info->bad_tensor >= 0 && n < t->count) {   /* back to a table index */
            int64_t j = -1;
            for (size_t k = 0; k < t->count; k++)
                if (t->active[k] && ++j == info->bad_tensor) {
                    info->bad_tensor = (int64_t)k;
                    st = ft_error(st, "the gradient of tensor %zu is not finite (NaN or Inf) at step %lld; nothing "
                                  "was updated", k, (long long)t->tensors[k].step);
                    break;
                }
        }
        return st;
    }
    for (size_t k = 0; k < t->count; k++)
        if (t->active[k]) {
            t->steps[k]++;
            t->steps_f32[k] = (float)t->steps[k];
        }
    return FT_OK;
}
