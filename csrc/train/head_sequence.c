/* Sequence-level heads: one prediction per sequence from its pooled state (B examples, N rows,
 * C hidden, K outputs).
 *   pooled (B, C) = mean (or CLS: first) row of each sequence of x (N, C), or x itself when every
 *                   sequence has one row (features pooled by the cache)
 *   linear: logits (B, K) = dropout(pooled) W^T + b                            W (K, C), b (K)
 *   pooler: h = tanh([dropout](pooled) W1^T + b1); logits = dropout(h) W^T + b   W1 (C, C)
 *           (the input dropout where cfg->dense_input_dropout: RoBERTa's and ELECTRA's heads; BERT's pooler has none)
 *           (BERT's; the dense layer in the configured shape: head_dense.c)
 *   loss: softmax cross-entropy (labels (B)), squared error (regression: targets (B, K)) or binary
 *   cross-entropy per label (multi-label: targets (B, K) in [0, 1]), each term times `scale`.
 * Backward in reverse, the dropout masks recomputed; d x = the pooling's backward.
 * The pooled step itself (ft_head_pooled_*) is shared with other heads that score pooled
 * sequences (head.h); this file's two descriptors are the linear and the pooler heads. */
#include <math.h>
#include <stdlib.h>

#include "core/status.h"
#include "head.h"

size_t ft_head_pooled_tensors(const ft_head_config *cfg, int pooler, int64_t K, head_tensor *out) {
    const int64_t C = cfg->hidden;
    size_t n = pooler ? ft_head_dense_tensors(cfg, out) : 0;
    out[n++] = (head_tensor){"classifier.weight", 2, {K, C}};
    out[n++] = (head_tensor){"classifier.bias", 1, {K, 0}};
    return n;
}

static int64_t logits_count(const ft_head_config *cfg, int64_t B, int64_t N) { (void)N; return B * cfg->num_labels; }
static int64_t loss_count(const ft_head_config *cfg, int64_t B, int64_t N) {
    (void)N;
    return cfg->loss == FT_LOSS_XENT ? B : B * cfg->num_labels;
}
static int64_t target_count(const ft_head_config *cfg, int64_t B, int64_t N) { return loss_count(cfg, B, N); }

/* workspace parts in floats, in order: pooled, dropped input, the dense layer's (its output first),
 * its output's dropout, d of the classifier's input, d pooled, d logits, CLS row counts (int32) */
enum { P_POOLED, P_DROP, P_H, P_H2, P_DFEAT, P_DPOOLED, P_DLOGITS, P_ONES, P_COUNT };
static size_t parts(const ft_head_config *cfg, int pooler, int64_t K, int64_t B, int64_t N, int grads, int dx, int drop,
                    size_t part[P_COUNT]) {
    const size_t BC = (size_t)(B * cfg->hidden);
    const int pool = N != B;
    part[P_POOLED] = pool ? BC : 0;
    part[P_DROP] = head_drops_input(cfg, pooler, drop) ? BC : 0;
    part[P_H] = pooler ? ft_head_dense_workspace(cfg, B) : 0;
    part[P_H2] = pooler && drop ? BC : 0;
    part[P_DFEAT] = grads && pooler ? BC : 0;
    part[P_DPOOLED] = dx && pool ? BC : 0;
    part[P_DLOGITS] = grads ? (size_t)(B * K) : 0;
    part[P_ONES] = pool && cfg->pooling == FT_POOL_CLS ? (size_t)B : 0;
    size_t total = 0;
    for (int k = 0; k < P_COUNT; k++) total += part[k];
    return total;
}
size_t ft_head_pooled_workspace(const ft_head_config *cfg, int pooler, int64_t K, int64_t B, int64_t N, int grads,
                                int dx, int drop) {
    size_t part[P_COUNT];
    return parts(cfg, pooler, K, B, N, grads, dx, drop, part);
}

static ft_status check_targets(const ft_head_config *cfg, const ft_head_batch *bt, const void *targets,
                               const float *valid) {
    (void)valid;
    const int64_t n = target_count(cfg, bt->B, bt->N), K = cfg->num_labels;
    for (int64_t i = 0; i < n; i++) {
        if (cfg->loss == FT_LOSS_XENT) {
            const int32_t y = ((const int32_t *)targets)[i];
            if (y < 0 || y >= K)
                return ft_error(FT_ERR_OUT_OF_RANGE, "label %lld of the batch is %d, outside [0, %lld)", (long long)i, y,
                                (long long)K);
            continue;
        }
        const float y = ((const float *)targets)[i];
        if (!isfinite(y))
            return ft_error(FT_ERR_INVALID_ARGUMENT, "target %lld of the batch is %g, not a finite number", (long long)i,
                            (double)y);
        if (cfg->loss == FT_LOSS_BCE && !(y >= 0.0f && y <= 1.0f))
            return ft_error(FT_ERR_OUT_OF_RANGE, "multi-label target %lld of the batch is %g, outside [0, 1]",
                            (long long)i, (double)y);
    }
    return FT_OK;
}

ft_status ft_head_pooled_step(ft_backend *be, const head_call *c, int pooler, int64_t K, head_loss_fn loss) {
    const ft_head_config *cfg = c->cfg;
    const ft_head_batch *bt = c->bt;
    const int64_t B = bt->B, N = bt->N, C = cfg->hidden;
    const int pool = N != B, cls = cfg->pooling == FT_POOL_CLS;
    const float p = cfg->dropout;
    size_t part[P_COUNT];
    parts(cfg, pooler, K, B, N, c->grads != NULL, c->dx != NULL, c->drop, part);
    float *w[P_COUNT], *at = c->ws;
    for (int k = 0; k < P_COUNT; k++) { w[k] = part[k] ? at : NULL; at += part[k]; }
    /* the masks of a slice of a global batch are the global batch's: element index + base */
    const uint64_t key_in = c->key_in + bt->seq_base * (uint64_t)C, key_hid = c->key_hidden + bt->seq_base * (uint64_t)C;
    const int32_t *first = bt->seqs_dev, *count = bt->seqs_dev ? bt->seqs_dev + B : NULL;
    if (pool && cls) {   /* CLS: a range of one row per sequence */
        int32_t *ones = malloc((size_t)B * sizeof *ones);
        if (!ones) return ft_error(FT_ERR_NOMEM, "head: out of memory");
        for (int64_t b = 0; b < B; b++) ones[b] = 1;
        ft_status st = be->upload(be, w[P_ONES], ones, (size_t)B * sizeof *ones);
        if (st == FT_OK) st = be->synchronize(be);   /* (the upload reads `ones`) */
        free(ones);
        FT_TRY(st);
        count = (const int32_t *)w[P_ONES];
    }
    /* forward */
    const float *in = c->x;
    if (pool) {
        FT_TRY(be->pool_forward(be, FT_F32, w[P_POOLED], c->x, first, count, B, C));
        in = w[P_POOLED];
    }
    const int drop_in = head_drops_input(cfg, pooler, c->drop);   /* the classifier's or dense layer's input */
    if (drop_in) {
        FT_TRY(be->dropout(be, w[P_DROP], in, B * C, p, key_in));
        in = w[P_DROP];
    }
    const int64_t dense = pooler ? (int64_t)ft_head_dense_floats(cfg) : 0;
    const float *W = c->params + dense, *b = W + K * C;
    const float *feat = in;
    if (pooler) {
        FT_TRY(ft_head_dense_forward(be, cfg, c->params, in, B, w[P_H], &feat));
        if (c->drop) {
            FT_TRY(be->dropout(be, w[P_H2], feat, B * C, p, key_hid));
            feat = w[P_H2];
        }
    }
    FT_TRY(ft_head_linear_forward(be, c->logits, feat, W, b, B, C, K));
    if (!c->targets) return FT_OK;
    float *dlogits = c->grads ? w[P_DLOGITS] : NULL;
    FT_TRY(loss(be, c, dlogits));
    if (!c->grads) return FT_OK;
    /* backward */
    float *gW = c->grads + dense, *gb = gW + K * C;
    float *dpooled = pool ? w[P_DPOOLED] : c->dx;    /* d of the pooled input (NULL: not wanted) */
    float *df = pooler ? w[P_DFEAT] : dpooled;       /* d of what the classifier read */
    FT_TRY(ft_head_linear_backward(be, gW, gb, df, dlogits, feat, W, B, C, K));
    if (pooler) {
        if (c->drop) FT_TRY(be->dropout(be, df, df, B * C, p, key_hid));
        FT_TRY(ft_head_dense_backward(be, cfg, c->params, in, B, w[P_H], df, c->grads, dpooled));
    }
    if (!dpooled) return FT_OK;
    if (drop_in) FT_TRY(be->dropout(be, dpooled, dpooled, B * C, p, key_in));
    if (pool) FT_TRY(be->pool_backward(be, c->dx, dpooled, first, count, B, N, C));
    return FT_OK;
}

ft_status ft_head_check_pooling(const ft_head_config *cfg) {
    if (cfg->pooling != FT_POOL_MEAN && cfg->pooling != FT_POOL_CLS)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: a sequence head pools with mean or CLS, got pooling %d",
                        (int)cfg->pooling);
    return FT_OK;
}

/* ---- the linear and pooler heads: K = num_labels outputs, the configured loss ------------------ */
static ft_status check(const ft_head_config *cfg) {
    const int64_t least = cfg->loss == FT_LOSS_XENT ? 2 : 1;
    if (cfg->num_labels < least)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: num_labels must be >= %lld%s, got %lld", (long long)least,
                        least == 2 ? " for classification" : "", (long long)cfg->num_labels);
    return ft_head_check_pooling(cfg);
}

static ft_status configured_loss(ft_backend *be, const head_call *c, float *dlogits) {
    const int64_t B = c->bt->B, K = c->cfg->num_labels;
    if (c->cfg->loss == FT_LOSS_XENT)
        return be->softmax_xent(be, c->loss, dlogits, c->logits, NULL, 1, c->targets, B, K, c->scale);
    if (c->cfg->loss == FT_LOSS_MSE) return be->mse_loss(be, c->loss, dlogits, c->logits, c->targets, B * K, c->scale);
    return be->bce_logits_loss(be, c->loss, dlogits, c->logits, c->targets, B * K, c->scale);
}

static size_t tensors_linear(const ft_head_config *cfg, head_tensor *out) {
    return ft_head_pooled_tensors(cfg, 0, cfg->num_labels, out);
}
static size_t tensors_pooler(const ft_head_config *cfg, head_tensor *out) {
    return ft_head_pooled_tensors(cfg, 1, cfg->num_labels, out);
}
static size_t workspace_linear(const ft_head_config *cfg, int64_t B, int64_t N, int grads, int dx, int drop) {
    return ft_head_pooled_workspace(cfg, 0, cfg->num_labels, B, N, grads, dx, drop);
}
static size_t workspace_pooler(const ft_head_config *cfg, int64_t B, int64_t N, int grads, int dx, int drop) {
    return ft_head_pooled_workspace(cfg, 1, cfg->num_labels, B, N, grads, dx, drop);
}
static ft_status step_linear(ft_backend *be, const head_call *c) {
    return ft_head_pooled_step(be, c, 0, c->cfg->num_labels, configured_loss);
}
static ft_status step_pooler(ft_backend *be, const head_call *c) {
    return ft_head_pooled_step(be, c, 1, c->cfg->num_labels, configured_loss);
}

const head_kind ft_head_linear = {"linear", 0, check, tensors_linear, logits_count, loss_count, target_count,
                                  workspace_linear, check_targets, step_linear};
const head_kind ft_head_pooler = {"pooler", 0, check, tensors_pooler, logits_count, loss_count, target_count,
                                  workspace_pooler, check_targets, step_pooler};
