/* Training steps in one call: the Trainer's common loop (one process) without a return to Python
 * per step. Per step: the batch's place in the caller's buffers (rows, lengths, targets and QA's
 * row mask laid out one step after another; or the rows read from the cache into the model's
 * memory: on a GPU the device tier's rows gathered there), ft_model_step, the finiteness check of
 * the loss, then ft_optim_table_step at the step's learning rate (times each group's lr_scale) and float16's loss scaling
 * decision (skip and halve, or count and grow) -- exactly the calls, arguments and order of
 * fasttran/trainer.py's per-step loop, so both give the same bits. Data-parallel (plan->reduction):
 * each step is this rank's slice of a global batch (its place in it for the dropout keys, possibly
 * empty), and the reduction runs as the per-step loop's hook does -- begin before the model step,
 * ready per bucket during the backward, finish after it -- so the finiteness check and the optimizer
 * see the ranks' sums. The caller's callback (progress, Ctrl-C) runs every `every` steps. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cache/codec.h"
#include "core/status.h"
#include "fasttran.h"

/* Where each step's rows come from: the caller's x, or (plan->cache) a read of the step's
 * examples into one buffer of the model's memory, sized for the largest step. */
typedef struct {
    const ft_train_plan *plan;
    ft_backend *be;
    float *buf;
    size_t cap;                  /* floats */
    ft_cache_staging stg;        /* the reads' staging and gather table, reused */
} step_rows;

static ft_status rows_open(step_rows *r, ft_model *m, const ft_train_plan *plan, int64_t C) {
    *r = (step_rows){.plan = plan};
    if (!plan->cache) return FT_OK;
    int64_t most = 0;
    for (int64_t k = 0; k < plan->steps; k++) {
        int64_t n = 0;
        for (int64_t i = plan->examples[k]; i < plan->examples[k + 1]; i++) n += plan->lengths[i];
        most = n > most ? n : most;
    }
    FT_TRY(ft_backend_for(ft_model_device(m), &r->be));
    r->cap = (size_t)(most ? most : 1) * (size_t)C;
    return r->be->alloc(r->be, r->cap * sizeof(float), (void **)&r->buf);
}

/* step k's rows (N of them, starting at row `row` of the plan) */
static ft_status rows_of_step(step_rows *r, const ft_model *m, int64_t k, int64_t row, int64_t C, const float **x) {
    const ft_train_plan *p = r->plan;
    if (!p->cache) {
        *x = p->x + (size_t)row * (size_t)C;
        return FT_OK;
    }
    const int64_t e0 = p->examples[k];
    FT_TRY(ft_cache_read_staged(p->cache, p->index + e0, p->examples[k + 1] - e0, FT_CACHE_RAGGED, r->buf,
                                ft_model_device(m), r->cap, NULL, 0, NULL, NULL, &r->stg));
    *x = r->buf;
    return FT_OK;
}

static ft_status rows_close(step_rows *r) {
    if (!r->buf) return FT_OK;
    const ft_status st = r->be->synchronize(r->be);   /* the last step's kernels may still read buf */
    r->be->free(r->be, r->buf);
    ft_cache_staging_free(&r->stg);
    return st;
}

/* float16 loss scaling after the optimizer step's status st (the per-step loop's rule, trainer.py
 * _optimizer_step): applied -> one more clean step, the scale doubled (up to max) after `growth` of
 * them; refused for a non-finite gradient while the scale is above 1 -> the step is skipped (FT_OK,
 * nothing applied), the scale halved. Any other status is returned as it is. */
static ft_status scaler_after_step(ft_loss_scaler *s, ft_status st) {
    if (!(s->scale > 0.0)) return st;
    if (st == FT_OK) {
        if (++s->good >= s->growth) {
            s->scale = s->scale * 2.0 < s->max ? s->scale * 2.0 : s->max;
            s->good = 0;
        }
        return FT_OK;
    }
    if (st == FT_ERR_INVALID_ARGUMENT && s->scale > 1.0 && strstr(ft_last_error(), "not finite")) {
        s->scale /= 2.0;
        s->good = 0;
        s->skipped++;
        ft_clear_error();
        return FT_OK;
    }
    return st;
}

ft_status ft_model_train_steps(ft_model *m, ft_optim_table *opt, const ft_optim_config *cfg,
                               const ft_train_plan *plan, int64_t every, int64_t phase, ft_train_callback cb, void *arg,
                               ft_train_result *out) {
    if (!m || !opt || !cfg || !plan || !out || !out->loss)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: a missing argument");
    out->done = 0;
    out->stop = FT_TRAIN_DONE;
    out->scaler = plan->scaler;
    if (plan->steps < 0 || (plan->steps && ((!plan->x + !plan->cache + !plan->ids) != 2 || (plan->cache && !plan->index) ||
                                            !plan->lengths || !plan->examples || !plan->targets ||
                                            !plan->denominator || !plan->lr)))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: an incomplete plan");
    if (plan->reduction && !plan->reduction->finish)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: a reduction without its finish");
    if (!cfg->groups || cfg->num_groups < 1)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: the optimizer has no parameter groups");
    const ft_head_config *head = ft_model_head(m);
    if (plan->steps && !(ft_head_needs(head) & FT_HEAD_NEEDS_MASK) != !plan->valid)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: the %s head %s a row mask per row",
                        ft_head_kind_name((int)head->kind), plan->valid ? "takes no" : "needs");
    for (size_t g = 0; g < cfg->num_groups; g++)
        if (!(cfg->groups[g].lr_scale > 0.0) || !isfinite(cfg->groups[g].lr_scale))
            return ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: parameter group %zu: lr_scale must be a finite "
                            "number > 0 (the factor of the plan's lr; 1 for none), got %g", g, cfg->groups[g].lr_scale);
    step_rows rows;
    ft_status st = rows_open(&rows, m, plan, head->hidden);
    ft_optim_group *groups = st == FT_OK ? malloc(cfg->num_groups * sizeof *groups) : NULL;
    if (!groups) {
        (void)rows_close(&rows);
        return st != FT_OK ? st : ft_error(FT_ERR_NOMEM, "out of memory");
    }
    memcpy(groups, cfg->groups, cfg->num_groups * sizeof *groups);
    ft_optim_config oc = *cfg;
    oc.groups = groups;
    ft_loss_scaler scaler = plan->scaler;
    const ft_train_reduction *red = plan->reduction;
    const size_t tsize = 4;   /* int32 or float32 targets */
    int64_t row = 0, tgt = 0, lg = 0;
    for (int64_t k = 0; k < plan->steps; k++) {
        const int64_t e0 = plan->examples[k], B = plan->examples[k + 1] - e0;
        if (B < 0 || (B == 0 && !red)) {
            st = ft_error(FT_ERR_INVALID_ARGUMENT, "train steps: step %lld has no examples", (long long)k);
            break;
        }
        int64_t N = 0;
        for (int64_t i = 0; i < B; i++) N += plan->lengths[e0 + i];
        const uint64_t step = plan->first_step + (uint64_t)k;
        if (red && red->begin && (st = red->begin(red->ctx, step)) != FT_OK) break;
        double loss = 0.0;
        if (B > 0) {
            ft_model_batch b = {0};
            if (plan->ids) {   /* tokens: the layers compute the embeddings */
                b.ids = plan->ids + row;
                b.types = plan->types ? plan->types + row : NULL;
            } else if ((st = rows_of_step(&rows, m, k, row, head->hidden, &b.x)) != FT_OK) {
                break;
            }
            b.lengths = plan->lengths + e0;
            b.valid = plan->valid ? plan->valid + row : NULL;
            b.B = B;
            b.targets = (const char *)plan->targets + (size_t)tgt * tsize;
            b.denominator = plan->denominator[k];
            b.seed = plan->seed;
            b.step = step;
            if (plan->place) {
                b.row_base = (uint64_t)plan->place[3 * k];
                b.seq_base = (uint64_t)plan->place[3 * k + 1];
                b.sq_base = (uint64_t)plan->place[3 * k + 2];
            }
            b.loss_scale = scaler.scale > 0.0 ? (float)scaler.scale : 1.0f;
            st = ft_model_step(m, &b, &loss, out->logits ? out->logits + lg : NULL, red ? red->ready : NULL,
                               red ? red->ctx : NULL);
        } else {   /* an empty slice of its global batch: no gradient, every bucket still handed over */
            st = ft_model_idle(m, red->ready, red->ctx);
        }
        if (st != FT_OK) break;
        if (red) {   /* the ranks' sums: every gradient and the loss the global batch's */
            double total = 0.0;
            if ((st = red->finish(red->ctx, loss, &total)) != FT_OK) break;
            loss = total;
        }
        out->loss[k] = loss;
        if (!isfinite(loss)) { out->stop = FT_TRAIN_NONFINITE_LOSS; break; }
        for (size_t g = 0; g < oc.num_groups; g++) groups[g].lr = plan->lr[k] * groups[g].lr_scale;
        for (size_t t = 0; t < opt->count; t++) opt->active[t] = 1;
        st = ft_optim_table_step(opt, &oc, &out->info);
        st = scaler_after_step(&scaler, st);
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
    out->scaler = scaler;
    const ft_status closed = rows_close(&rows);
    return st != FT_OK ? st : closed;
}
