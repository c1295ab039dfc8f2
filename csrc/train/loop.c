/* Training steps in one call: the Trainer's common loop (one process, float32, no loss scaling)
 * without a return to Python per step. Per step: the batch's place in the caller's buffers (rows,
 * lengths, targets laid out one step after another), ft_model_step, the finiteness check of the
 * loss, then ft_optim_table_step at the step's learning rate (times each group's lr_scale) --
 * exactly the calls, arguments and order of fasttran/trainer.py's per-step loop, so both give the
 * same bits. The caller's callback
 * (progress, Ctrl-C) runs every `every` steps. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "fasttran.h"

ft_status ft_model_train_steps(ft_model *m, ft_optim_table *opt, const ft_optim_config *cfg,
                               const ft_train_plan *plan, int64_t every, int64_t phase, ft_train_callback cb, void *arg,
                               ft_train_result *out) {
    if (!m || !opt || !cfg || !plan || !out || !out->loss)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: a missing argument");
    out->done = 0;
    out->stop = FT_TRAIN_DONE;
    if (plan->steps < 0 || (plan->steps && (!plan->x || !plan->lengths || !plan->examples || !plan->targets ||
                                            !plan->denominator || !plan->lr)))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: an incomplete plan");
    if (!cfg->groups || cfg->num_groups < 1)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: the optimizer has no parameter groups");
    const ft_head_config *head = ft_model_head(m);
    if (ft_head_needs(head) & FT_HEAD_NEEDS_MASK)
        return ft_error(FT_ERR_UNSUPPORTED, "train steps: the %s head needs a row mask per batch; train it step by step",
                        ft_head_kind_name((int)head->kind));
    for (size_t g = 0; g < cfg->num_groups; g++)
        if (!(cfg->groups[g].lr_scale > 0.0) || !isfinite(cfg->groups[g].lr_scale))
            return ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: parameter group %zu: lr_scale must be a finite "
                            "number > 0 (the factor of the plan's lr; 1 for none), got %g", g, cfg->groups[g].lr_scale);
    ft_optim_group *groups = malloc(cfg->num_groups * sizeof *groups);
    if (!groups) return ft_error(FT_ERR_NOMEM, "out of memory");
    memcpy(groups, cfg->groups, cfg->num_groups * sizeof *groups);
    ft_optim_config oc = *cfg;
    oc.groups = groups;
    const size_t tsize = 4;   /* int32 or float32 targets */
    int64_t row = 0, tgt = 0, lg = 0;
    ft_status st = FT_OK;
    for (int64_t k = 0; k < plan->steps; k++) {
        const int64_t e0 = plan->examples[k], B = plan->examples[k + 1] - e0;
        if (B < 1) { st = ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: step %lld has no examples", (long long)k); break; }
        int64_t N = 0;
        for (int64_t i = 0; i < B; i++) N += plan->lengths[e0 + i];
        ft_model_batch b = {0};
        b.x = plan->x + (size_t)row * (size_t)head->hidden;
        b.lengths = plan->lengths + e0;
        b.B = B;
        b.targets = (const char *)plan->targets + (size_t)tgt * tsize;
        b.denominator = plan->denominator[k];
        b.seed = plan->seed;
        b.step = plan->first_step + (uint64_t)k;
        b.loss_scale = 1.0f;
        double loss = 0.0;
        st = ft_model_step(m, &b, &loss, out->logits ? out->logits + lg : NULL, NULL, NULL);
        if (st != FT_OK) break;
        out->loss[k] = loss;
        if (!isfinite(loss)) { out->stop = FT_TRAIN_NONFINITE_LOSS; break; }
        for (size_t g = 0; g < oc.num_groups; g++) groups[g].lr = plan->lr[k] * groups[g].lr_scale;
        for (size_t t = 0; t < opt->count; t++) opt->active[t] = 1;
        st = ft_optim_table_step(opt, &oc, &out->info);
        if (st != FT_OK) {
            /* refused (a non-finite gradient, nothing written): the caller reports it as its own loop
             * does, from the message left in ft_last_error */
            if (st == FT_ERR_INVALID_ARGUMENT) {
                out->stop = FT_TRAIN_REFUSED;
                st = FT_OK;
            }
            break;
        }
        out->done = k + 1;
        row += N;
        tgt += ft_head_target_count(head, B, N);
        lg += ft_head_logits_count(head, B, N);
        if (cb && ((every > 0 && (phase + out->done) % every == 0) || out->done == plan->steps) && cb(arg, out->done)) {
            out->stop = out->done == plan->steps ? FT_TRAIN_DONE : FT_TRAIN_STOPPED;
            break;
        }
    }
    free(groups);
    return st;
}
