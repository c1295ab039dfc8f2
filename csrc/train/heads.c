/* Task heads on frozen features: forward, loss and backward over the backend interface, so the
 * same code runs on the CPU and CUDA backends. Shapes: B examples, T tokens (QA), C hidden,
 * K labels. Parameters in one flat buffer, in the order of head_tensors(); gradients the same.
 * Dropout masks are recomputed from (seed, step, site) in the backward pass (core/rng.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "core/rng.h"
#include "core/status.h"

enum { SITE_INPUT = 0, SITE_HIDDEN = 1 };

typedef struct { const char *name; int ndim; int64_t shape[2]; } head_tensor;

/* the tensors of a head, in buffer order; returns the count */
static size_t head_tensors(const ft_head_config *cfg, head_tensor out[4]) {
    const int64_t C = cfg->hidden, K = cfg->num_labels;
    size_t n = 0;
    if (cfg->kind == FT_HEAD_POOLER) {
        out[n++] = (head_tensor){"pooler.dense.weight", 2, {C, C}};
        out[n++] = (head_tensor){"pooler.dense.bias", 1, {C, 0}};
    }
    if (cfg->kind == FT_HEAD_QA) {
        out[n++] = (head_tensor){"qa_outputs.weight", 2, {2, C}};
        out[n++] = (head_tensor){"qa_outputs.bias", 1, {2, 0}};
    } else {
        out[n++] = (head_tensor){"classifier.weight", 2, {K, C}};
        out[n++] = (head_tensor){"classifier.bias", 1, {K, 0}};
    }
    return n;
}

ft_status ft_head_check(const ft_head_config *cfg) {
    if (!cfg) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: no configuration");
    if (cfg->kind != FT_HEAD_LINEAR && cfg->kind != FT_HEAD_POOLER && cfg->kind != FT_HEAD_QA)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: unknown kind %d", (int)cfg->kind);
    if (cfg->hidden < 1) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: hidden size must be >= 1, got %lld",
                                         (long long)cfg->hidden);
    if (cfg->kind == FT_HEAD_QA ? cfg->num_labels != 2 : cfg->num_labels < 2)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: num_labels must be %s, got %lld",
                        cfg->kind == FT_HEAD_QA ? "2 for QA" : ">= 2", (long long)cfg->num_labels);
    if (!(cfg->dropout >= 0.0f && cfg->dropout < 1.0f))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: dropout must lie in [0, 1), got %g", (double)cfg->dropout);
    return FT_OK;
}

size_t ft_head_num_tensors(const ft_head_config *cfg) {
    head_tensor t[4];
    return ft_head_check(cfg) == FT_OK ? head_tensors(cfg, t) : 0;
}

static size_t numel(const head_tensor *t) { return (size_t)t->shape[0] * (size_t)(t->ndim == 2 ? t->shape[1] : 1); }

ft_status ft_head_tensor_info(const ft_head_config *cfg, size_t i, const char **name, int *ndim, int64_t shape[2],
                              size_t *offset) {
    FT_TRY(ft_head_check(cfg));
    head_tensor t[4];
    size_t n = head_tensors(cfg, t), off = 0;
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
    head_tensor t[4];
    if (ft_head_check(cfg) != FT_OK) return 0;
    size_t n = head_tensors(cfg, t), total = 0;
    for (size_t k = 0; k < n; k++) total += numel(&t[k]);
    return total;
}

/* Labels must name a class, or a valid position of their own example (QA). They live in device
 * memory; they are few, so they are checked on a host copy. */
static ft_status check_labels(ft_backend *be, const ft_head_config *cfg, const int32_t *labels, const float *valid,
                              int64_t B, int64_t T) {
    const int qa = cfg->kind == FT_HEAD_QA;
    const int64_t n = qa ? 2 * B : B;
    int32_t *lab = malloc((size_t)n * sizeof *lab);
    float *ok = qa ? malloc((size_t)(B * T) * sizeof *ok) : NULL;
    ft_status st = (!lab || (qa && !ok)) ? ft_error(FT_ERR_NOMEM, "head: out of memory checking labels") : FT_OK;
    if (st == FT_OK) st = be->download(be, lab, labels, (size_t)n * sizeof *lab);
    if (st == FT_OK && qa) st = be->download(be, ok, valid, (size_t)(B * T) * sizeof *ok);
    for (int64_t r = 0; st == FT_OK && r < n; r++) {
        const int64_t lim = qa ? T : cfg->num_labels;
        if (lab[r] < 0 || lab[r] >= lim)
            st = ft_error(FT_ERR_OUT_OF_RANGE, "%s %lld of the batch is %d, outside [0, %lld)",
                          qa ? (r < B ? "start position" : "end position") : "label", (long long)(qa ? r % B : r),
                          lab[r], (long long)lim);
        else if (qa && ok[(r % B) * T + lab[r]] == 0.0f)
            st = ft_error(FT_ERR_OUT_OF_RANGE, "%s %lld of the batch is %d, which is not a context position",
                          r < B ? "start position" : "end position", (long long)(r % B), lab[r]);
    }
    free(lab);
    free(ok);
    return st;
}

/* the workspace a call takes, in floats (sizes of its parts, in order: dropped-out input, pooler
 * hidden, its dropout, d features, per-row losses, d logits) */
static size_t workspace_parts(const ft_head_config *cfg, int64_t B, int64_t T, int has_labels, int has_grads,
                              int has_dx, int drop, size_t part[6]) {
    const int qa = cfg->kind == FT_HEAD_QA, pooler = cfg->kind == FT_HEAD_POOLER;
    const int64_t C = cfg->hidden, K = cfg->num_labels, N = B * T;
    part[0] = drop ? (size_t)(N * C) : 0;
    part[1] = pooler ? (size_t)(B * C) : 0;
    part[2] = pooler && drop ? part[1] : 0;
    part[3] = (!qa && (pooler || has_dx)) ? (size_t)(B * C) : 0;
    part[4] = has_labels ? (size_t)(qa ? 2 * B : B) : 0;
    part[5] = has_grads ? (size_t)(qa ? 2 * N : B * K) : 0;
    size_t total = 0;
    for (int k = 0; k < 6; k++) total += part[k];
    return total ? total : 1;
}

size_t ft_head_workspace_floats(const ft_head_config *cfg, int64_t B, int64_t T, int has_labels, int has_grads,
                                int has_dx, int training) {
    if (ft_head_check(cfg) != FT_OK) return 0;
    if (cfg->kind != FT_HEAD_QA) T = 1;
    size_t part[6];
    return workspace_parts(cfg, B, T, has_labels, has_grads, has_dx, training && cfg->dropout > 0.0f, part);
}

ft_status ft_head_forward_backward(ft_device dev, const ft_head_config *cfg, const float *params, const float *x,
                                   int64_t B, int64_t T, const float *valid, const int32_t *labels, float *logits,
                                   double *loss, float *grads, float *dx, int training, uint64_t seed,
                                   uint64_t step) {
    return ft_head_forward_backward_ws(dev, cfg, params, x, B, T, valid, labels, logits, loss, grads, dx, training,
                                       seed, step, NULL, 0, 1);
}

ft_status ft_head_forward_backward_ws(ft_device dev, const ft_head_config *cfg, const float *params, const float *x,
                                      int64_t B, int64_t T, const float *valid, const int32_t *labels, float *logits,
                                      double *loss, float *grads, float *dx, int training, uint64_t seed,
                                      uint64_t step, float *workspace, size_t workspace_floats, int check) {
    FT_TRY(ft_head_check(cfg));
    const int qa = cfg->kind == FT_HEAD_QA, pooler = cfg->kind == FT_HEAD_POOLER;
    if (!qa) T = 1;
    if (B < 1 || T < 1) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: empty batch (B=%lld, T=%lld)", (long long)B,
                                        (long long)T);
    if (!params || !x || !logits) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: missing params, x or logits");
    if (qa && !valid) return ft_error(FT_ERR_INVALID_ARGUMENT, "QA head: the context mask is required");
    if ((grads || loss) && !labels) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: loss and gradients need labels");
    ft_backend *be = NULL;
    FT_TRY(ft_backend_for(dev, &be));
    if (!be->softmax_xent || !be->dropout)
        return ft_error(FT_ERR_UNSUPPORTED, "the %s backend has no training ops", be->name);
    if (labels && check) FT_TRY(check_labels(be, cfg, labels, valid, B, T));

    const int64_t C = cfg->hidden, K = cfg->num_labels, N = B * T;
    const float p = cfg->dropout;
    const int drop = training && p > 0.0f;
    const uint64_t key_in = ft_dropout_key(seed, step, SITE_INPUT), key_hid = ft_dropout_key(seed, step, SITE_HIDDEN);
    const int64_t rows = qa ? 2 * B : B;

    /* workspace: the caller's (kept across steps), else one allocation */
    size_t part[6];
    const size_t total = workspace_parts(cfg, B, T, labels != NULL, grads != NULL, dx != NULL, drop, part);
    const size_t sz_d = part[0], sz_h = part[1], sz_h2 = part[2], sz_df = part[3], sz_loss = part[4];
    float *ws = workspace;
    if (ws && workspace_floats < total)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: the workspace holds %zu floats, this batch needs %zu",
                        workspace_floats, total);
    if (!ws) FT_TRY(be->alloc(be, total * sizeof(float), (void **)&ws));
    float *d = ws, *h = d + sz_d, *h2 = h + sz_h, *dfeat = h2 + sz_h2, *loss_rows = dfeat + sz_df,
          *dlogits = loss_rows + sz_loss;
    ft_status st = FT_OK;
#define RUN(expr) do { if (st == FT_OK) st = (expr); } while (0)

    const float *in = x;
    if (drop) { RUN(be->dropout(be, d, x, N * C, p, key_in)); in = d; }

    if (qa) {
        const float *W = params, *b = params + 2 * C;
        for (int k = 0; k < 2; k++) RUN(be->broadcast_rows(be, logits + k * N, b + k, N, 1));
        RUN(be->gemm(be, 0, 1, 2, N, C, 1.0f, W, C, in, C, 1.0f, logits, N));   /* (2, N) */
        if (labels)
            RUN(be->softmax_xent(be, loss_rows, grads ? dlogits : NULL, logits, valid, B, labels, 2 * B, T,
                                 1.0f / (float)(2 * B)));
        if (grads) {
            RUN(be->gemm(be, 0, 0, 2, C, N, 1.0f, dlogits, N, in, C, 0.0f, grads, C));   /* dW (2, C) */
            RUN(be->sum_axis(be, grads + 2 * C, dlogits, 2, N, 1));                       /* db (2) */
        }
        if (grads && dx) {
            RUN(be->gemm(be, 1, 0, N, C, 2, 1.0f, dlogits, N, W, C, 0.0f, dx, C));     /* dx (N, C) */
            if (drop) RUN(be->dropout(be, dx, dx, N * C, p, key_in));
        }
    } else {
        const float *W1 = params, *b1 = params + C * C;
        const float *W = pooler ? params + C * C + C : params, *b = W + K * C;
        float *gW1 = grads, *gb1 = grads ? grads + C * C : NULL;
        float *gW = grads ? grads + (pooler ? C * C + C : 0) : NULL, *gb = gW ? gW + K * C : NULL;
        const float *feat = in;
        if (pooler) {
            RUN(be->gemm(be, 0, 1, B, C, C, 1.0f, in, C, W1, C, 0.0f, h, C));
            RUN(be->bias_act_forward(be, h, b1, B, C, FT_ACT_TANH));
            feat = h;
            if (drop) { RUN(be->dropout(be, h2, h, B * C, p, key_hid)); feat = h2; }
        }
        RUN(be->broadcast_rows(be, logits, b, B, K));
        RUN(be->gemm(be, 0, 1, B, K, C, 1.0f, feat, C, W, C, 1.0f, logits, K));        /* (B, K) */
        if (labels)
            RUN(be->softmax_xent(be, loss_rows, grads ? dlogits : NULL, logits, NULL, 1, labels, B, K, 1.0f / (float)B));
        if (grads) {
            RUN(be->gemm(be, 1, 0, K, C, B, 1.0f, dlogits, K, feat, C, 0.0f, gW, C));   /* dW (K, C) */
            RUN(be->sum_axis(be, gb, dlogits, B, K, 0));                               /* db (K) */
            if (pooler || dx) {
                float *df = pooler ? dfeat : dx;
                RUN(be->gemm(be, 0, 0, B, C, K, 1.0f, dlogits, K, W, C, 0.0f, df, C));  /* d feat (B, C) */
                if (pooler) {
                    if (drop) RUN(be->dropout(be, df, df, B * C, p, key_hid));
                    RUN(be->tanh_backward(be, df, df, h, B * C));                        /* d pre-tanh */
                    RUN(be->gemm(be, 1, 0, C, C, B, 1.0f, df, C, in, C, 0.0f, gW1, C)); /* dW1 (C, C) */
                    RUN(be->sum_axis(be, gb1, df, B, C, 0));
                    if (dx) RUN(be->gemm(be, 0, 0, B, C, C, 1.0f, df, C, W1, C, 0.0f, dx, C));
                }
                if (dx && drop) RUN(be->dropout(be, dx, dx, B * C, p, key_in));
            }
        }
    }
    if (st == FT_OK && loss) {
        float *host = malloc((size_t)rows * sizeof *host);
        if (!host) st = ft_error(FT_ERR_NOMEM, "head: out of memory");
        RUN(be->download(be, host, loss_rows, (size_t)rows * sizeof *host));
        if (st == FT_OK) {
            double s = 0.0;
            for (int64_t r = 0; r < rows; r++) s += host[r];
            *loss = s / (double)rows;
        }
        free(host);
    }
    if (st == FT_OK && !loss) st = be->synchronize(be);   /* (the loss's copy down waited already) */
#undef RUN
    if (ws != workspace) be->free(be, ws);
    return st;
}
