/* Extractive question answering: the answer is a span of the context (B sequences, N rows, C
 * hidden), as transformers' BertForQuestionAnswering, with the softmax over the context only.
 *   logits (2, N) = W dropout(x)^T + b: each row's start and end score       W (2, C), b (2)
 *   loss: per sequence and end, softmax cross-entropy over its rows with valid != 0 (the
 *   context: token type 1 but the final [SEP]) against labels (2, B) = the answer's start and
 *   end row within the sequence; each term times `scale` (1 / 2 B of the global batch).
 * With `dense` (ModernBERT's prediction head), the dense layer (head_dense.c) on every row first:
 *   logits = W dropout(dense(x))^T + b (dense(dropout(x)) where cfg->dense_input_dropout). */
#include "core/status.h"
#include "head.h"

static size_t tensors(const ft_head_config *cfg, head_tensor *out) {
    size_t n = cfg->dense ? ft_head_dense_tensors(cfg, out) : 0;
    out[n++] = (head_tensor){"qa_outputs.weight", 2, {2, cfg->hidden}};
    out[n++] = (head_tensor){"qa_outputs.bias", 1, {2, 0}};
    return n;
}

static int64_t logits_count(const ft_head_config *cfg, int64_t B, int64_t N) { (void)cfg; (void)B; return 2 * N; }
static int64_t two_per_sequence(const ft_head_config *cfg, int64_t B, int64_t N) { (void)cfg; (void)N; return 2 * B; }

/* workspace: the dropped input (N, C) where head_drops_input, d logits (2, N),
 * then with `dense` its workspace, its output's dropout (N, C) and d of the scores' input (N, C) */
static size_t workspace(const ft_head_config *cfg, int64_t B, int64_t N, int grads, int dx, int drop) {
    (void)B;
    (void)dx;
    const size_t NC = (size_t)(N * cfg->hidden);
    return (head_drops_input(cfg, cfg->dense, drop) ? NC : 0) + (grads ? (size_t)(2 * N) : 0) +
           (cfg->dense ? ft_head_dense_workspace(cfg, N) + (drop ? NC : 0) + (grads ? NC : 0) : 0);
}

static ft_status check_targets(const ft_head_config *cfg, const ft_head_batch *bt, const void *targets,
                               const float *valid) {
    (void)cfg;
    const int32_t *y = targets;
    const int64_t B = bt->B;
    for (int64_t s = 0; s < 2 * B; s++) {
        const int64_t b = s % B, n = bt->seqs[B + b];
        const char *what = s < B ? "start position" : "end position";
        if (y[s] < 0 || y[s] >= n)
            return ft_error(FT_ERR_OUT_OF_RANGE, "%s %lld of the batch is %d, outside its %lld rows", what, (long long)b,
                            y[s], (long long)n);
        if (valid[bt->seqs[b] + y[s]] == 0.0f)
            return ft_error(FT_ERR_OUT_OF_RANGE, "%s %lld of the batch is %d, which is not a context position", what,
                            (long long)b, y[s]);
    }
    return FT_OK;
}

static ft_status step(ft_backend *be, const head_call *c) {
    const ft_head_batch *bt = c->bt;
    const int64_t B = bt->B, N = bt->N, C = c->cfg->hidden;
    const ft_head_config *cfg = c->cfg;
    const int64_t dense = cfg->dense ? (int64_t)ft_head_dense_floats(cfg) : 0;
    const float p = cfg->dropout, *W = c->params + dense, *b = W + 2 * C;
    const uint64_t key_in = c->key_in + bt->row_base * (uint64_t)C;
    const uint64_t key_hid = c->key_hidden + bt->row_base * (uint64_t)C;
    const int drop_in = head_drops_input(cfg, cfg->dense, c->drop);   /* the first layer's input */
    float *dropped = drop_in ? c->ws : NULL, *dlogits = c->grads ? c->ws + (drop_in ? N * C : 0) : NULL;
    float *dws = c->ws + (drop_in ? N * C : 0) + (c->grads ? 2 * N : 0);        /* the dense layer's */
    float *hdrop = dws + (cfg->dense ? ft_head_dense_workspace(cfg, N) : 0);
    float *dfeat = hdrop + (c->drop ? N * C : 0);
    const float *x = c->x, *in;
    if (drop_in) {
        FT_TRY(be->dropout(be, dropped, x, N * C, p, key_in));
        x = dropped;
    }
    in = x;   /* what the scores read */
    if (cfg->dense) {
        FT_TRY(ft_head_dense_forward(be, cfg, c->params, x, N, dws, &in));
        if (c->drop) {
            FT_TRY(be->dropout(be, hdrop, in, N * C, p, key_hid));
            in = hdrop;
        }
    }
    /* (2, N): the start scores of every row, then the end scores */
    for (int k = 0; k < 2; k++) FT_TRY(be->broadcast_rows(be, c->logits + k * N, b + k, N, 1));
    FT_TRY(be->gemm(be, 0, 1, 2, N, C, 1.0f, W, C, in, C, 1.0f, c->logits, N));
    if (!c->targets) return FT_OK;
    FT_TRY(be->span_xent(be, c->loss, dlogits, c->logits, c->valid, bt->seqs_dev, bt->seqs_dev + B, c->targets, B, N,
                         c->scale));
    if (!c->grads) return FT_OK;
    float *gW = c->grads + dense;
    FT_TRY(be->gemm(be, 0, 0, 2, C, N, 1.0f, dlogits, N, in, C, 0.0f, gW, C));         /* dW (2, C) */
    FT_TRY(be->sum_axis(be, gW + 2 * C, dlogits, 2, N, 1));                             /* db (2) */
    if (cfg->dense) {
        FT_TRY(be->gemm(be, 1, 0, N, C, 2, 1.0f, dlogits, N, W, C, 0.0f, dfeat, C));     /* d in (N, C) */
        if (c->drop) FT_TRY(be->dropout(be, dfeat, dfeat, N * C, p, key_hid));
        FT_TRY(ft_head_dense_backward(be, cfg, c->params, x, N, dws, dfeat, c->grads, c->dx));
    } else if (c->dx) {
        FT_TRY(be->gemm(be, 1, 0, N, C, 2, 1.0f, dlogits, N, W, C, 0.0f, c->dx, C));    /* dx (N, C) */
    }
    if (!c->dx) return FT_OK;
    if (drop_in) FT_TRY(be->dropout(be, c->dx, c->dx, N * C, p, key_in));
    return FT_OK;
}

static ft_status check(const ft_head_config *cfg) {
    if (cfg->num_labels != 2)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: num_labels must be 2 for QA, got %lld", (long long)cfg->num_labels);
    if (cfg->loss != FT_LOSS_XENT) return ft_error(FT_ERR_INVALID_ARGUMENT, "head: a QA head takes the cross-entropy loss only");
    return FT_OK;
}

const head_kind ft_head_span = {"qa", FT_HEAD_NEEDS_ROWS | FT_HEAD_NEEDS_MASK, check, tensors, logits_count,
                                two_per_sequence, two_per_sequence, workspace, check_targets, step};
