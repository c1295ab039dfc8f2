/* Task heads: the part every head shares -- configuration checks, the parameter table, the
 * workspace, target checks at the boundary, dropout keys -- and the dispatch to the kind of head
 * (its descriptor, listed in FT_HEAD_KINDS). Everything runs over the backend table, so one
 * head runs on the CPU and CUDA backends alike. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "core/status.h"
#include "head.h"

#define FT_HEAD_ENTRY_(NAME, code, name, desc) [code] = &desc,
static const head_kind *const KINDS[] = {FT_HEAD_KINDS(FT_HEAD_ENTRY_)};
#undef FT_HEAD_ENTRY_
enum { N_KINDS = (int)(sizeof KINDS / sizeof KINDS[0]) };

static const head_kind *kind_of(const ft_head_config *cfg) {
    const int k = (int)cfg->kind;
    return k >= 0 && k < N_KINDS ? KINDS[k] : NULL;
}

const char *ft_head_kind_name(int kind) { return kind >= 0 && kind < N_KINDS && KINDS[kind] ? KINDS[kind]->name : NULL; }

ft_status ft_head_check(const ft_head_config *cfg) {
    if (!cfg) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: no configuration");
    const head_kind *kd = kind_of(cfg);
    if (!kd) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: unknown kind %d", (int)cfg->kind);
    if (cfg->hidden < 1) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: hidden size must be >= 1, got %lld",
                                         (long long)cfg->hidden);
    if (cfg->loss != FT_LOSS_XENT && cfg->loss != FT_LOSS_MSE && cfg->loss != FT_LOSS_BCE)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: unknown loss %d", (int)cfg->loss);
    if (!(cfg->dropout >= 0.0f && cfg->dropout < 1.0f))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: dropout must lie in [0, 1), got %g", (double)cfg->dropout);
    FT_TRY(ft_head_check_dense(cfg));
    return kd->check(cfg);
}

#define FT_HEAD_ACT_NAME_(NAME, code, name, act) [code] = name,
static const char *const ACT_NAMES[] = {FT_HEAD_ACTS(FT_HEAD_ACT_NAME_)};
#undef FT_HEAD_ACT_NAME_
const char *ft_head_act_name(int act) { return act >= 0 && act < FT_HEAD_ACT_END_ ? ACT_NAMES[act] : NULL; }

unsigned ft_head_needs(const ft_head_config *cfg) { return cfg && kind_of(cfg) ? kind_of(cfg)->needs : 0; }

static size_t tensors(const ft_head_config *cfg, head_tensor t[HEAD_MAX_TENSORS]) { return kind_of(cfg)->tensors(cfg, t); }
static size_t numel(const head_tensor *t) { return (size_t)t->shape[0] * (size_t)(t->ndim == 2 ? t->shape[1] : 1); }

size_t ft_head_num_tensors(const ft_head_config *cfg) {
    head_tensor t[HEAD_MAX_TENSORS];
    return ft_head_check(cfg) == FT_OK ? tensors(cfg, t) : 0;
}

ft_status ft_head_tensor_info(const ft_head_config *cfg, size_t i, const char **name, int *ndim, int64_t shape[2],
                              size_t *offset) {
    FT_TRY(ft_head_check(cfg));
    head_tensor t[HEAD_MAX_TENSORS];
    size_t n = tensors(cfg, t), off = 0;
    if (i >= n) return ft_error(FT_ERR_OUT_OF_RANGE, "head tensor %zu out of range (%zu tensors)", i, n);
    for (size_t k = 0; k < i; k++) off += numel(&t[k]);
    *name = t[i].name;
    *ndim = t[i].ndim;
    shape[0] = t[i].shape[0];
    shape[1] = t[i].shape[1];
    *offset = off;
    return FT_OK;
}

size_t ft_head_param_count(const ft_head_config *cfg) {
    head_tensor t[HEAD_MAX_TENSORS];
    if (ft_head_check(cfg) != FT_OK) return 0;
    size_t n = tensors(cfg, t), total = 0;
    for (size_t k = 0; k < n; k++) total += numel(&t[k]);
    return total;
}

int64_t ft_head_logits_count(const ft_head_config *cfg, int64_t B, int64_t N) {
    return ft_head_check(cfg) == FT_OK ? kind_of(cfg)->logits_count(cfg, B, N) : 0;
}
int64_t ft_head_loss_count(const ft_head_config *cfg, int64_t B, int64_t N) {
    return ft_head_check(cfg) == FT_OK ? kind_of(cfg)->loss_count(cfg, B, N) : 0;
}
int64_t ft_head_target_count(const ft_head_config *cfg, int64_t B, int64_t N) {
    return ft_head_check(cfg) == FT_OK ? kind_of(cfg)->target_count(cfg, B, N) : 0;
}
int ft_head_float_targets(const ft_head_config *cfg) { return cfg->loss == FT_LOSS_MSE || cfg->loss == FT_LOSS_BCE; }

size_t ft_head_workspace_floats(const ft_head_config *cfg, int64_t B, int64_t N, int has_grads, int has_dx,
                                int training) {
    if (ft_head_check(cfg) != FT_OK || B < 1 || N < 1) return 0;
    const size_t n = kind_of(cfg)->workspace(cfg, B, N, has_grads, has_dx, training && cfg->dropout > 0.0f);
    return n ? n : 1;
}

/* ---- shared pieces ----------------------------------------------------------------------------- */
ft_status ft_head_linear_forward(ft_backend *be, float *logits, const float *in, const float *W, const float *b,
                                 int64_t R, int64_t C, int64_t K) {
    FT_TRY(be->broadcast_rows(be, logits, b, R, K));
    return be->gemm(be, 0, 1, R, K, C, 1.0f, in, C, W, C, 1.0f, logits, K);
}

ft_status ft_head_linear_backward(ft_backend *be, float *gW, float *gb, float *din, const float *dlogits,
                                  const float *in, const float *W, int64_t R, int64_t C, int64_t K) {
    FT_TRY(be->gemm(be, 1, 0, K, C, R, 1.0f, dlogits, K, in, C, 0.0f, gW, C));   /* dW (K, C) */
    FT_TRY(be->sum_axis(be, gb, dlogits, R, K, 0));                              /* db (K) */
    if (!din) return FT_OK;
    return be->gemm(be, 0, 0, R, C, K, 1.0f, dlogits, K, W, C, 0.0f, din, C);     /* d in (R, C) */
}

/* ---- one step -------------------------------------------------------------------------------------- */
/* Targets live in backend memory; they are few, so they are checked on a host copy. */
static ft_status check_targets(ft_backend *be, const head_kind *kd, const ft_head_config *cfg, const ft_head_batch *bt,
                               const void *targets, const float *valid) {
    const int64_t n = kd->target_count(cfg, bt->B, bt->N);
    void *host = malloc((size_t)(n ? n : 1) * 4);
    float *ok = valid ? malloc((size_t)bt->N * sizeof *ok) : NULL;
    ft_status st = (!host || (valid && !ok)) ? ft_error(FT_ERR_NOMEM, "head: out of memory checking targets") : FT_OK;
    if (st == FT_OK) st = be->download(be, host, targets, (size_t)n * 4);
    if (st == FT_OK && valid) st = be->download(be, ok, valid, (size_t)bt->N * sizeof *ok);
    if (st == FT_OK) st = kd->check_targets(cfg, bt, host, ok);
    free(host);
    free(ok);
    return st;
}

static ft_status check_batch(const ft_head_batch *bt) {
    if (!bt || bt->B < 1 || bt->N < 1 || !bt->seqs)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: empty batch");
    int64_t rows = 0;
    for (int64_t b = 0; b < bt->B; b++) {
        const int64_t f = bt->seqs[b], n = bt->seqs[bt->B + b];
        if (n < 1 || f != rows)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "head: sequence %lld is rows [%lld, %lld); sequences must follow "
                            "each other and hold at least one row", (long long)b, (long long)f, (long long)(f + n));
        rows += n;
    }
    if (rows != bt->N)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: the sequences hold %lld rows, the batch has %lld",
                        (long long)rows, (long long)bt->N);
    return FT_OK;
}

ft_status ft_head_step(ft_device dev, const ft_head_config *cfg, const float *params, const float *x,
                       const ft_head_batch *bt, const void *targets, const float *valid, float *logits, float *loss,
                       float *grads, float *dx, float scale, int training, uint64_t seed, uint64_t step,
                       float *workspace, size_t workspace_floats, int check) {
    FT_TRY(ft_head_check(cfg));
    FT_TRY(check_batch(bt));
    if (!params || !x || !logits) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: missing params, x or logits");
    const head_kind *kd = kind_of(cfg);
    if ((kd->needs & FT_HEAD_NEEDS_MASK) && !valid)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "%s head: the row mask (valid) is required", kd->name);
    if ((grads || loss) && !targets) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: a loss and gradients need targets");
    if (dx && !grads) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: dx comes with the gradients");
    if (!(scale > 0.0f) || !isfinite(scale))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: the loss scale must be finite and > 0, got %g", (double)scale);
    if (!bt->seqs_dev && (bt->N != bt->B || (kd->needs & FT_HEAD_NEEDS_ROWS)))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: %s the sequence table in backend memory",
                        bt->N != bt->B ? "several rows per sequence need" : "this kind of head needs");
    ft_backend *be = NULL;
    FT_TRY(ft_backend_for(dev, &be));
    if (!be->softmax_xent || !be->dropout || !be->span_xent)
        return ft_error(FT_ERR_UNSUPPORTED, "the %s backend has no training ops", be->name);
    if (targets && check) FT_TRY(check_targets(be, kd, cfg, bt, targets, valid));

    const int drop = training && cfg->dropout > 0.0f;
    const size_t need = kd->workspace(cfg, bt->B, bt->N, grads != NULL, dx != NULL, drop);
    float *ws = workspace;
    if (ws && workspace_floats < need)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: the workspace holds %zu floats, this batch needs %zu",
                        workspace_floats, need);
    if (!ws && need) FT_TRY(be->alloc(be, need * sizeof(float), (void **)&ws));
    const head_call c = {cfg, bt, params, x, valid, targets, logits, loss, grads, dx, scale, drop,
                         ft_dropout_key(seed, step, HEAD_SITE_INPUT), ft_dropout_key(seed, step, HEAD_SITE_HIDDEN), ws};
    ft_status st = kd->step(be, &c);
    if (st == FT_OK && !loss) st = be->synchronize(be);
    if (ws != workspace) {
        if (st == FT_OK) st = be->synchronize(be);   /* the step may still read it */
        be->free(be, ws);
    }
    return st;
}
