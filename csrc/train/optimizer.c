/* ft_optimizer_step: checks the arguments once, at the API boundary, then hands the whole tensor
 * list to the device's backend, which runs it as one fused step (cpu/optim.c, cuda/optim.cu). */
#include <math.h>

#include "backend.h"
#include "core/status.h"

static int unit_interval(double x) { return x >= 0.0 && x < 1.0; }

ft_status ft_optimizer_step(ft_device dev, const ft_optim_config *cfg, const ft_optim_tensor *tensors,
                            size_t count, ft_optim_info *info) {
    if (!cfg) return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer step: no configuration");
    if (cfg->kind != FT_OPT_ADAMW && cfg->kind != FT_OPT_LAMB)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer step: unknown optimizer %d", (int)cfg->kind);
    if (!(cfg->lr > 0.0) || !isfinite(cfg->lr))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "learning rate must be a finite number > 0, got %g", cfg->lr);
    if (!unit_interval(cfg->beta1) || !unit_interval(cfg->beta2))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "betas must lie in [0, 1), got (%g, %g)", cfg->beta1,
                        cfg->beta2);
    if (!(cfg->eps > 0.0) || !isfinite(cfg->eps))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "eps must be a finite number > 0, got %g", cfg->eps);
    if (!isfinite(cfg->max_grad_norm))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "max_grad_norm must be finite, got %g", cfg->max_grad_norm);
    if (cfg->step < 1) return ft_error(FT_ERR_INVALID_ARGUMENT, "step must be >= 1, got %lld", (long long)cfg->step);
    if (count && !tensors) return ft_error(FT_ERR_INVALID_ARGUMENT, "optimizer step: no tensor table");
    for (size_t k = 0; k < count; k++) {
        const ft_optim_tensor *t = &tensors[k];
        if (t->n < 0) return ft_error(FT_ERR_INVALID_ARGUMENT, "tensor %zu: negative size %lld", k, (long long)t->n);
        if (t->n > 0 && (!t->param || !t->grad || !t->m || !t->v))
            return ft_error(FT_ERR_INVALID_ARGUMENT, "tensor %zu: missing parameter, gradient or state memory", k);
        if (!(t->weight_decay >= 0.0f) || !isfinite(t->weight_decay))
            return ft_error(FT_ERR_INVALID_ARGUMENT, "tensor %zu: weight decay must be finite and >= 0, got %g", k,
                            (double)t->weight_decay);
        if (t->copy && t->copy_dtype != FT_F16 && t->copy_dtype != FT_BF16)
            return ft_error(FT_ERR_DTYPE, "tensor %zu: a model copy must be float16 or bfloat16, got %s", k,
                            ft_dtype_name(t->copy_dtype));
    }
    ft_backend *be = NULL;
    FT_TRY(ft_backend_for(dev, &be));
    if (!be->optim_step) return ft_error(FT_ERR_UNSUPPORTED, "the %s backend has no optimizer step", be->name);
    return be->optim_step(be, cfg, tensors, count, info);
}
