/* The dense layer a head runs before its classifier, in each architecture's shape (R rows, C
 * hidden; ft_head_config's act, no_dense_bias, norm):
 *   BERT / RoBERTa pooler        h = tanh(in W1^T + b1)
 *   DistilBERT pre_classifier    h = relu(in W1^T + b1)
 *   ELECTRA classification head  h = gelu(in W1^T + b1)          (gelu: exact, erf)
 *   ModernBERT prediction head   h = LayerNorm(gelu(in W1^T [+ b1])) gamma [beta]
 * Backward in reverse: the LayerNorm's from its input and statistics, the activation's from its
 * output (tanh) or its input (relu, gelu), then the GEMMs. A missing bias reads a zero vector, so
 * every backend runs the same ops as for the shapes with biases. */
#include "core/status.h"
#include "head.h"

#define FT_HEAD_ACT_OP_(NAME, code, name, act) [code] = act,
static const ft_activation ACT_OPS[] = {FT_HEAD_ACTS(FT_HEAD_ACT_OP_)};
#undef FT_HEAD_ACT_OP_

static int has_bias(const ft_head_config *cfg) { return !cfg->no_dense_bias; }
static int has_norm(const ft_head_config *cfg) { return cfg->norm != FT_HEAD_NORM_NONE; }

ft_status ft_head_check_dense(const ft_head_config *cfg) {
    if ((int)cfg->act < 0 || (int)cfg->act >= FT_HEAD_ACT_END_)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: unknown dense activation %d", (int)cfg->act);
    if (cfg->no_dense_bias != 0 && cfg->no_dense_bias != 1)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: no_dense_bias must be 0 or 1, got %d", cfg->no_dense_bias);
    if (cfg->dense != 0 && cfg->dense != 1)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: dense must be 0 or 1, got %d", cfg->dense);
    if (cfg->dense_input_dropout != 0 && cfg->dense_input_dropout != 1)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: dense_input_dropout must be 0 or 1, got %d",
                        cfg->dense_input_dropout);
    if (cfg->norm != FT_HEAD_NORM_NONE && cfg->norm != FT_HEAD_NORM_LN && cfg->norm != FT_HEAD_NORM_LN_BIAS)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: unknown dense norm %d", (int)cfg->norm);
    if (has_norm(cfg) && !(cfg->norm_eps > 0.0f && cfg->norm_eps < 1.0f))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "head: the dense layer's LayerNorm eps must lie in (0, 1), got %g",
                        (double)cfg->norm_eps);
    return FT_OK;
}

size_t ft_head_dense_tensors(const ft_head_config *cfg, head_tensor *out) {
    const int64_t C = cfg->hidden;
    size_t n = 0;
    out[n++] = (head_tensor){"pooler.dense.weight", 2, {C, C}};
    if (has_bias(cfg)) out[n++] = (head_tensor){"pooler.dense.bias", 1, {C, 0}};
    if (has_norm(cfg)) out[n++] = (head_tensor){"pooler.norm.weight", 1, {C, 0}};
    if (cfg->norm == FT_HEAD_NORM_LN_BIAS) out[n++] = (head_tensor){"pooler.norm.bias", 1, {C, 0}};
    return n;
}

size_t ft_head_dense_floats(const ft_head_config *cfg) {
    const size_t C = (size_t)cfg->hidden;
    return C * C + (has_bias(cfg) ? C : 0) + (has_norm(cfg) ? C : 0) + (cfg->norm == FT_HEAD_NORM_LN_BIAS ? C : 0);
}

/* workspace parts in floats, in order: h (the activation's output), the activation's input (relu,
 * gelu), the LayerNorm's output and statistics, zeros (R C for the LayerNorm's residual, then C for
 * a missing bias), d beta of a LayerNorm without one */
enum { D_H, D_PRE, D_LN, D_STATS, D_ZERO, D_DBETA, D_COUNT };
static size_t parts(const ft_head_config *cfg, int64_t R, size_t part[D_COUNT]) {
    const size_t RC = (size_t)(R * cfg->hidden), C = (size_t)cfg->hidden;
    part[D_H] = RC;
    part[D_PRE] = cfg->act != FT_HEAD_ACT_TANH ? RC : 0;
    part[D_LN] = has_norm(cfg) ? RC : 0;
    part[D_STATS] = has_norm(cfg) ? (size_t)(2 * R) : 0;
    part[D_ZERO] = (has_norm(cfg) ? RC : 0) + (!has_bias(cfg) || cfg->norm == FT_HEAD_NORM_LN ? C : 0);
    part[D_DBETA] = cfg->norm == FT_HEAD_NORM_LN ? C : 0;
    size_t total = 0;
    for (int k = 0; k < D_COUNT; k++) total += part[k];
    return total;
}
size_t ft_head_dense_workspace(const ft_head_config *cfg, int64_t R) {
    size_t part[D_COUNT];
    return parts(cfg, R, part);
}

typedef struct { const float *W1, *b1, *gamma, *beta; } dense_params;
static dense_params params_of(const ft_head_config *cfg, const float *p, const float *zero_c) {
    const int64_t C = cfg->hidden;
    dense_params d = {p, zero_c, NULL, zero_c};
    p += C * C;
    if (has_bias(cfg)) { d.b1 = p; p += C; }
    if (has_norm(cfg)) { d.gamma = p; p += C; }
    if (cfg->norm == FT_HEAD_NORM_LN_BIAS) d.beta = p;
    return d;
}

static void split(const ft_head_config *cfg, int64_t R, float *ws, float *w[D_COUNT]) {
    size_t part[D_COUNT];
    parts(cfg, R, part);
    for (int k = 0; k < D_COUNT; k++) { w[k] = part[k] ? ws : NULL; ws += part[k]; }
}

/* the zero vector of a missing bias (the last C floats of the zeros), NULL when none is needed */
static float *zero_c(const ft_head_config *cfg, int64_t R, float *w[D_COUNT]) {
    if (!w[D_ZERO]) return NULL;
    return (!has_bias(cfg) || cfg->norm == FT_HEAD_NORM_LN) ? w[D_ZERO] + (has_norm(cfg) ? R * cfg->hidden : 0) : NULL;
}

ft_status ft_head_dense_forward(ft_backend *be, const ft_head_config *cfg, const float *params, const float *in,
                                int64_t R, float *ws, const float **out) {
    const int64_t C = cfg->hidden;
    float *w[D_COUNT];
    split(cfg, R, ws, w);
    if (w[D_ZERO]) {   /* the zeros: rows of C, cleared on the device */
        const int64_t rows = (has_norm(cfg) ? R : 0) + (zero_c(cfg, R, w) ? 1 : 0);
        FT_TRY(be->zero_columns(be, FT_F32, w[D_ZERO], rows, C, 0, C));
    }
    const dense_params d = params_of(cfg, params, zero_c(cfg, R, w));
    FT_TRY(be->gemm(be, 0, 1, R, C, C, 1.0f, in, C, d.W1, C, 0.0f, w[D_H], C));
    if (cfg->act == FT_HEAD_ACT_TANH) {   /* (BERT's pooler, as it always ran: the output serves the backward) */
        FT_TRY(be->bias_act_forward(be, w[D_H], d.b1, R, C, FT_ACT_TANH));
    } else {
        FT_TRY(be->bias_act_train_forward(be, w[D_H], w[D_PRE], NULL, w[D_H], d.b1, R, C, ACT_OPS[cfg->act]));
    }
    *out = w[D_H];
    if (!has_norm(cfg)) return FT_OK;
    /* LayerNorm(0 + (h + 0)): the training LayerNorm, which keeps the statistics its backward reads */
    FT_TRY(be->residual_ln_train_forward(be, w[D_LN], NULL, w[D_STATS], w[D_ZERO], w[D_H], zero_c(cfg, R, w) ?
                                         zero_c(cfg, R, w) : w[D_ZERO], d.gamma, d.beta, R, C, cfg->norm_eps, 0.0f, 0));
    *out = w[D_LN];
    return FT_OK;
}

ft_status ft_head_dense_backward(ft_backend *be, const ft_head_config *cfg, const float *params, const float *in,
                                 int64_t R, float *ws, float *dh, float *grads, float *din) {
    const int64_t C = cfg->hidden;
    float *w[D_COUNT];
    split(cfg, R, ws, w);
    const dense_params d = params_of(cfg, params, zero_c(cfg, R, w));
    float *gW1 = grads, *gb1 = NULL, *ggamma = NULL, *gbeta = w[D_DBETA], *g = grads + C * C;
    if (has_bias(cfg)) { gb1 = g; g += C; }
    if (has_norm(cfg)) { ggamma = g; g += C; }
    if (cfg->norm == FT_HEAD_NORM_LN_BIAS) gbeta = g;
    if (has_norm(cfg))
        FT_TRY(be->layernorm_backward(be, dh, ggamma, gbeta, dh, w[D_H], w[D_STATS], d.gamma, d.beta, R, C, 0));
    if (cfg->act == FT_HEAD_ACT_TANH) {
        FT_TRY(be->tanh_backward(be, dh, dh, w[D_H], R * C));                                  /* d pre-tanh */
    } else {
        FT_TRY(be->bias_act_backward(be, dh, dh, w[D_PRE], NULL, in, d.W1, d.b1, R, C, C, ACT_OPS[cfg->act]));
    }
    FT_TRY(be->gemm(be, 1, 0, C, C, R, 1.0f, dh, C, in, C, 0.0f, gW1, C));                    /* dW1 (C, C) */
    if (gb1) FT_TRY(be->sum_axis(be, gb1, dh, R, C, 0));
    if (din) FT_TRY(be->gemm(be, 0, 0, R, C, C, 1.0f, dh, C, d.W1, C, 0.0f, din, C));
    return FT_OK;
}
