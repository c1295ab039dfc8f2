/* Token classification (named entities, part of speech): a label per row (N rows, C hidden, K
 * labels), as transformers' BertForTokenClassification.
 *   logits (N, K) = dropout(x) W^T + b                                       W (K, C), b (K)
 *   loss: softmax cross-entropy per row against labels (N); a negative label (special tokens,
 *   sub-tokens after a word's first, padding) takes no part; each term times `scale`
 *   (1 / the labelled rows of the global batch).
 * With `dense` (ModernBERT's prediction head), the dense layer (head_dense.c) on every row first:
 *   logits = dropout(dense(x)) W^T + b (dense(dropout(x)) where cfg->dense_input_dropout). */
#include "core/status.h"
#include "head.h"

static size_t tensors(const ft_head_config *cfg, head_tensor *out) {
    size_t n = cfg->dense ? ft_head_dense_tensors(cfg, out) : 0;
    out[n++] = (head_tensor){"classifier.weight", 2, {cfg->num_labels, cfg->hidden}};
    out[n++] = (head_tensor){"classifier.bias", 1, {cfg->num_labels, 0}};
    return n;
}

static int64_t logits_count(const ft_head_config *cfg, int64_t B, int64_t N) { (void)B; return N * cfg->num_labels; }
static int64_t rows(const ft_head_config *cfg, int64_t B, int64_t N) { (void)cfg; (void)B; return N; }

/* workspace: the dropped input (N, C) where head_drops_input, d logits (N, K),
 * then with `dense` its workspace, its output's dropout (N, C) and d of the classifier's input (N, C) */
static size_t workspace(const ft_head_config *cfg, int64_t B, int64_t N, int grads, int dx, int drop) {
    (void)B;
    (void)dx;
    const size_t NC = (size_t)(N * cfg->hidden);
    return (head_drops_input(cfg, cfg->dense, drop) ? NC : 0) + (grads ? (size_t)(N * cfg->num_labels) : 0) +
           (cfg->dense ? ft_head_dense_workspace(cfg, N) + (drop ? NC : 0) + (grads ? NC : 0) : 0);
}

static ft_status check_targets(const ft_head_config *cfg, const ft_head_batch *bt, const void *targets,
                               const float *valid) {
    (void)valid;
    const int32_t *y = targets;
    for (int64_t r = 0; r < bt->N; r++)
        if (y[r] >= cfg->num_labels)
            return ft_error(FT_ERR_OUT_OF_RANGE, "token label %lld of the batch is %d, outside [0, %lld) (negative: "
                            "no label)", (long long)r, y[r], (long long)cfg->num_labels);
    return FT_OK;
}

static ft_status step(ft_backend *be, const head_call *c) {
    const ft_head_config *cfg = c->cfg;
    const int64_t N = c->bt->N, C = cfg->hidden, K = cfg->num_labels;
    const int64_t dense = cfg->dense ? (int64_t)ft_head_dense_floats(cfg) : 0;
    const float p = cfg->dropout, *W = c->params + dense, *b = W + K * C;
    const uint64_t key_in = c->key_in + c->bt->row_base * (uint64_t)C;
    const uint64_t key_hid = c->key_hidden + c->bt->row_base * (uint64_t)C;
    const int drop_in = head_drops_input(cfg, cfg->dense, c->drop);   /* the first layer's input */
    float *dropped = drop_in ? c->ws : NULL, *dlogits = c->grads ? c->ws + (drop_in ? N * C : 0) : NULL;
    float *dws = c->ws + (drop_in ? N * C : 0) + (c->grads ? N * K : 0);        /* the dense layer's */
    float *hdrop = dws + (cfg->dense ? ft_head_dense_workspace(cfg, N) : 0);
    float *dfeat = hdrop + (c->drop ? N * C : 0);
    const float *in = c->x, *feat;
    if (drop_in) {
        FT_TRY(be->dropout(be, dropped, in, N * C, p, key_in));
        in = dropped;
    }
    feat = in;
    if (cfg->dense) {
        FT_TRY(ft_head_dense_forward(be, cfg, c->params, in, N, dws, &feat));
        if (c->drop) {
            FT_TRY(be->dropout(be, hdrop, feat, N * C, p, key_hid));
            feat = hdrop;
        }
    }
    FT_TRY(ft_head_linear_forward(be, c->logits, feat, W, b, N, C, K));
    if (!c->targets) return FT_OK;
    FT_TRY(be->softmax_xent(be, c->loss, dlogits, c->logits, NULL, 1, c->targets, N, K, c->scale));
    if (!c->grads) return FT_OK;
    float *gW = c->grads + dense;
    if (!cfg->dense) {
        FT_TRY(ft_head_linear_backward(be, gW, gW + K * C, c->dx, dlogits, in, W, N, C, K));
    } else {
        FT_TRY(ft_head_linear_backward(be, gW, gW + K * C, dfeat, dlogits, feat, W, N, C, K));
        if (c->drop) FT_TRY(be->dropout(be, dfeat, dfeat, N * C, p, key_hid));
        FT_TRY(ft_head_dense_backward(be, cfg, c->params, in, N, dws, dfeat, c->grads, c->dx));
    }
    if (c->dx && drop_in) FT_TRY(be->dropout(be, c->dx, c->dx, N * C, p, key_in));
    return FT_OK;
}

static ft_status check(const ft_head_config *cfg) {
    if (cfg->loss != FT_LOSS_XENT)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: a token head takes the cross-entropy loss only");
    return cfg->num_labels >= 2 ? FT_OK : ft_error(FT_ERR_INVALID_ARGUMENT, "head: num_labels must be >= 2 for "
                                                   "classification, got %lld", (long long)cfg->num_labels);
}

const head_kind ft_head_token = {"token", FT_HEAD_NEEDS_ROWS, check, tensors, logits_count, rows, rows, workspace,
                                 check_targets, step};
