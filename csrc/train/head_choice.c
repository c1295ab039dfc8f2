/* Multiple choice, as transformers' BertForMultipleChoice: each question's G choices are G
 * consecutive sequences of the batch (B = questions x G), each scored from its pooled row through
 * BERT's pooler, the scores of a question compared by a softmax (B sequences, N rows, C hidden;
 * num_labels = G, the choices per question):
 *   h = tanh(pooled W1^T + b1); score (B) = dropout(h) w^T + b                W1 (C, C), w (1, C), b (1)
 *   (dropout(pooled) too where cfg->dense_input_dropout; BERT's class has none)
 *   (h: the dense layer in the configured shape, head_dense.c: DistilBERT's ReLU, ELECTRA's and
 *   ModernBERT's GELU ...)
 *   loss: per question, softmax cross-entropy over its G scores against labels (B / G) in [0, G),
 *   each term times `scale` (1 / the questions of the global batch).
 * The pooled step is head_sequence.c's (ft_head_pooled_step) with one output per sequence. */
#include "core/status.h"
#include "head.h"

static ft_status check(const ft_head_config *cfg) {
    if (cfg->loss != FT_LOSS_XENT)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: a multiple-choice head takes the cross-entropy loss only");
    if (cfg->num_labels < 2)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: a multiple-choice head needs num_labels (choices per question) "
                        ">= 2, got %lld", (long long)cfg->num_labels);
    return ft_head_check_pooling(cfg);
}

static size_t tensors(const ft_head_config *cfg, head_tensor *out) { return ft_head_pooled_tensors(cfg, 1, 1, out); }
static int64_t scores(const ft_head_config *cfg, int64_t B, int64_t N) { (void)cfg; (void)N; return B; }
static int64_t questions(const ft_head_config *cfg, int64_t B, int64_t N) { (void)N; return B / cfg->num_labels; }
static size_t workspace(const ft_head_config *cfg, int64_t B, int64_t N, int grads, int dx, int drop) {
    return ft_head_pooled_workspace(cfg, 1, 1, B, N, grads, dx, drop);
}

static ft_status whole_questions(const ft_head_config *cfg, int64_t B) {
    if (B % cfg->num_labels == 0) return FT_OK;
    return ft_error(FT_ERR_INVALID_ARGUMENT, "multiple choice: the batch holds %lld sequences, not whole questions of "
                    "%lld choices each", (long long)B, (long long)cfg->num_labels);
}

static ft_status check_targets(const ft_head_config *cfg, const ft_head_batch *bt, const void *targets,
                               const float *valid) {
    (void)valid;
    FT_TRY(whole_questions(cfg, bt->B));
    const int32_t *y = targets;
    for (int64_t q = 0; q < bt->B / cfg->num_labels; q++)
        if (y[q] < 0 || y[q] >= cfg->num_labels)
            return ft_error(FT_ERR_OUT_OF_RANGE, "answer %lld of the batch is choice %d, outside [0, %lld)", (long long)q,
                            y[q], (long long)cfg->num_labels);
    return FT_OK;
}

static ft_status loss(ft_backend *be, const head_call *c, float *dlogits) {
    const int64_t G = c->cfg->num_labels;
    FT_TRY(whole_questions(c->cfg, c->bt->B));
    return be->softmax_xent(be, c->loss, dlogits, c->logits, NULL, 1, c->targets, c->bt->B / G, G, c->scale);
}

static ft_status step(ft_backend *be, const head_call *c) { return ft_head_pooled_step(be, c, 1, 1, loss); }

const head_kind ft_head_choice = {"choice", 0, check, tensors, scores, questions, questions, workspace, check_targets,
                                  step};
