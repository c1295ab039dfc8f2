/* Encoder layers for fine-tuning: the layer as a training forward / backward pair over the backend
 * table, and the stack of the top layers (ft_layer_stack): parameters and gradients one allocation
 * each with a table of named views, the saved activations one arena, per-step buffers one more.
 *
 * Training forward of one layer (N packed rows, C hidden, I intermediate):
 *   qkv   (N, 3C) = x Wqkv^T + bqkv                                    broadcast_rows + gemm
 *   ctx   (N, C)  = attention(qkv), probs kept, dropout on probs       attention_train_forward
 *   h1    (N, C)  = LN(x + dropout(ctx Wo^T + bo))                     gemm + residual_ln_train_forward
 *   act   (N, I)  = GELU(h1 W1^T + b1)                                 gemm + bias_act_train_forward
 *   out   (N, C)  = LN(h1 + dropout(act W2^T + b2))                    gemm + residual_ln_train_forward
 * and its backward, in reverse (see ft_layer_backward). Dropout keys: (seed, step, layer, site).
 *
 * A pre-LN layer (ModernBERT: no biases, no dropout) keeps its input x, the residual stream:
 *   a     (N, C)  = LN_attn(x) (x itself in encoder layer 0)          residual_ln_train_forward
 *   qkv   (N, 3A) = a Wqkv^T, RoPE on Q and K                          gemm + rotary_forward
 *   ctx   (N, A)  = attention(qkv) over the layer's window             attention_train_forward
 *   x1    (N, C)  = x + ctx Wo^T;  m = LN_mlp(x1)                      gemm + residual_ln_train_forward
 *   big   (N, 2I) = m Wi^T;  act (N, I) = GELU(big[:, :I]) big[:, I:]  gemm + gated_act_forward
 *   out   (N, C)  = x1 + act W2^T, then final_norm(out) in the encoder's last layer
 * (ft_layer_forward_train_pre; its backward: ft_layer_backward_pre). */
#include "model/layer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "core/status.h"
#include "dist/shared.h"
#include "model/encoder.h"
#include "model/significance.h"

enum { SITE_ATTN_PROBS = 0, SITE_ATTN_OUT = 1, SITE_FFN_OUT = 2, SITES = 3 };
enum {
    ACT_INPUT, ACT_QKV, ACT_PROBS, ACT_ATTN_MASK, ACT_CTX, ACT_LN_IN, ACT_LN_STATS, ACT_LN_OUT, ACT_GELU_IN,
    ACT_GELU_BITS, ACT_GELU_OUT
};
const char *const ft_layer_act_kind_names[FT_LAYER_ACT_KINDS] = {
    "input", "qkv", "attention_probs", "attention_dropout_mask", "attention_context", "layernorm_inputs",
    "layernorm_stats", "layernorm_outputs", "gelu_inputs", "gelu_branch_bits", "gelu_outputs"};

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* activations whose input the backward can recover from the output (Tempo's in-place GELU) */
static int inplace_act_ok(ft_activation act) {
    return act == FT_ACT_GELU_ERF || act == FT_ACT_GELU_TANH || act == FT_ACT_RELU;
}

/* sites 0..14 belong to the heads (train/head.c), 15 to the stack's input (input_key); layer l's
 * sites follow. A mask element is keep(key, index), so counting the indices from the batch's place in its global batch is adding
 * that place to the key: probabilities from NH sq_base (sq_base = the sum of n^2 over the global
 * batch's sequences before this one), hidden states from row_base C. */
static uint64_t site_key(const ft_layer_batch *bt, int64_t layer, int site) {
    const uint64_t base = site == SITE_ATTN_PROBS ? bt->sq_base * (uint64_t)bt->cfg->num_heads
                                                  : bt->row_base * (uint64_t)bt->cfg->hidden_size;
    return ft_dropout_key(bt->seed, bt->step, 16 + (uint64_t)layer * SITES + (uint64_t)site) + base;
}

/* the stack input's dropout (input_dropout): its rows counted from row_base, as the hidden states' */
enum { SITE_STACK_INPUT = 15 };
static uint64_t input_key(const ft_layer_batch *bt) {
    return ft_dropout_key(bt->seed, bt->step, SITE_STACK_INPUT) + bt->row_base * (uint64_t)bt->cfg->hidden_size;
}

void ft_layer_acts_sizes(const ft_bert_config *cfg, const ft_layer_options *opt, const ft_layer_shape *sh, int64_t N,
                         int64_t P, size_t sizes[FT_LAYER_ACT_KINDS]) {
    const size_t C = (size_t)cfg->hidden_size, A = (size_t)sh->attn, I = (size_t)sh->inter, n = (size_t)N,
                 f = sizeof(float), probs = (size_t)P * (size_t)sh->heads;
    memset(sizes, 0, FT_LAYER_ACT_KINDS * sizeof(size_t));
    if (cfg->norm == FT_NORM_PRE) {   /* ft_layer_forward_train_pre's (no dropout, no Tempo) */
        const size_t nc = n * C * f, first = sh->index > 0, fin = sh->final_norm != 0;
        sizes[ACT_QKV] = n * 3 * A * f;
        sizes[ACT_PROBS] = opt->recompute_attention_probs ? n * (size_t)sh->heads * 2 * f : probs * f;
        sizes[ACT_CTX] = n * A * f;
        sizes[ACT_LN_IN] = (1 + fin) * nc;                       /* x1, and the final norm's input */
        sizes[ACT_LN_STATS] = (first + 1 + fin) * n * 2 * f;
        sizes[ACT_LN_OUT] = (first + 2) * nc;                    /* the attention norm's output, the MLP norm's, out */
        sizes[ACT_GELU_IN] = n * 2 * I * f;
        sizes[ACT_GELU_OUT] = n * I * f;
        return;
    }
    sizes[ACT_QKV] = n * 3 * A * f;
    /* the probabilities, or (recomputed in the backward) each row's softmax statistics: 2 floats per row and head */
    sizes[ACT_PROBS] = opt->recompute_attention_probs ? n * (size_t)sh->heads * 2 * f : probs * f;
    sizes[ACT_ATTN_MASK] = !opt->recompute_attention_dropout && opt->attention_dropout > 0.0f ? probs : 0;
    sizes[ACT_CTX] = n * A * f;
    sizes[ACT_LN_IN] = opt->inplace_layernorm ? 0 : 2 * n * C * f;
    sizes[ACT_LN_STATS] = 2 * n * 2 * f;
    sizes[ACT_LN_OUT] = 2 * n * C * f;   /* h1 and out (the next layer's input) */
    sizes[ACT_GELU_IN] = opt->inplace_gelu ? 0 : n * I * f;
    sizes[ACT_GELU_BITS] = opt->inplace_gelu ? (n * I + 7) / 8 : 0;
    sizes[ACT_GELU_OUT] = n * I * f;
}

ft_status ft_layer_forward_train(ft_backend *be, const ft_layer_batch *bt, int64_t layer, const ft_layer_shape *sh,
                                 const ft_layer_weights *w, ft_layer_acts *a, const ft_layer_work *wk) {
    const ft_bert_config *c = bt->cfg;
    const ft_layer_options *o = bt->opt;
    const int64_t N = bt->N, C = c->hidden_size, A = sh->attn, I = sh->inter, NH = sh->heads;
    const float eps = c->layer_norm_eps;
    /* qkv (N, 3A) = x Wqkv^T + bqkv */
    FT_TRY(be->broadcast_rows(be, a->qkv, w->bqkv, N, 3 * A));
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 0, 1, N, 3 * A, C, 1.0f, a->x, C, w->wqkv, C, 1.0f, a->qkv, 3 * A));
    FT_TRY(be->attention_train_forward(be, o->matmul_precision, a->ctx, a->probs, a->attn_stats, a->attn_mask, a->qkv,
                                       bt->seqs, bt->B, A, NH, 0, o->attention_dropout,
                                       site_key(bt, layer, SITE_ATTN_PROBS), wk->attn_scratch, wk->attn_scratch_bytes));
    /* h1 = LN(x + dropout(ctx Wo^T + bo)) */
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 0, 1, N, C, A, 1.0f, a->ctx, A, w->wo, A, 0.0f, wk->tmp, C));
    FT_TRY(be->residual_ln_train_forward(be, a->h1, a->ln1_in, a->ln1_stats, a->x, wk->tmp, w->bo, w->ln1_g, w->ln1_b,
                                         N, C, eps, o->hidden_dropout, site_key(bt, layer, SITE_ATTN_OUT)));
    /* act = GELU(h1 W1^T + b1), in place over the GEMM output */
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 0, 1, N, I, C, 1.0f, a->h1, C, w->w1, C, 0.0f, a->ffn_act, I));
    FT_TRY(be->bias_act_train_forward(be, a->ffn_act, a->ffn_pre, a->gelu_bits, a->ffn_act, w->b1, N, I, c->activation));
    /* out = LN(h1 + dropout(act W2^T + b2)) */
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 0, 1, N, C, I, 1.0f, a->ffn_act, I, w->w2, I, 0.0f, wk->tmp, C));
    return be->residual_ln_train_forward(be, a->out, a->ln2_in, a->ln2_stats, a->h1, wk->tmp, w->b2, w->ln2_g, w->ln2_b,
                                         N, C, eps, o->hidden_dropout, site_key(bt, layer, SITE_FFN_OUT));
}

/* Backward of one layer. On entry wk->g = d out; on exit wk->g = d x.
 *   g     = d ln2_in                 LN2 backward (from ln2_in, or from out: Tempo)  -> dln2_g, dln2_b
 *   tmp   = dropout(g)               d(act W2^T + b2)                                -> db2, dW2 = tmp^T act
 *   dbig  = GELU'(.) * (tmp W2)      from ffn_pre, or from act + branch bits (Tempo; near GELU's
 *                                    minimum the input is recomputed from h1 W1^T + b1) -> db1, dW1 = dbig^T h1
 *   g    += dbig W1                  d h1 (its residual path and the FFN)
 *   g     = d ln1_in                 LN1 backward                                    -> dln1_g, dln1_b
 *   tmp   = dropout(g)               d(ctx Wo^T + bo)                                -> dbo, dWo = tmp^T ctx
 *   dctx  = tmp Wo
 *   dbig  = d qkv                    attention backward (probs kept, dropout mask kept or recomputed)
 *                                                                                    -> dbqkv, dWqkv = dbig^T x
 *   g    += dbig Wqkv                d x (its residual path and the attention; skipped when nothing
 *                                    below needs it) */
ft_status ft_layer_backward(ft_backend *be, const ft_layer_batch *bt, int64_t layer, const ft_layer_shape *sh,
                            const ft_layer_weights *w, const ft_layer_acts *a, const ft_layer_work *wk,
                            const ft_layer_weights *gw, int want_dx, const ft_layer_recorder *rec) {
    const ft_bert_config *c = bt->cfg;
    const ft_layer_options *o = bt->opt;
    const int64_t N = bt->N, C = c->hidden_size, A = sh->attn, I = sh->inter, NH = sh->heads;
    const int ln_out = o->inplace_layernorm;
    FT_TRY(rec->output(rec, be, layer, wk->g, a->out, a->x, N, C));
    FT_TRY(be->layernorm_backward(be, wk->g, gw->ln2_g, gw->ln2_b, wk->g, ln_out ? a->out : a->ln2_in, a->ln2_stats,
                                  w->ln2_g, w->ln2_b, N, C, ln_out));
    const float *dy = wk->g;
    if (o->hidden_dropout > 0.0f) {
        FT_TRY(be->dropout(be, wk->tmp, wk->g, N * C, o->hidden_dropout, site_key(bt, layer, SITE_FFN_OUT)));
        dy = wk->tmp;
    }
    FT_TRY(be->sum_axis(be, gw->b2, dy, N, C, 0));
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 1, 0, C, I, N, 1.0f, dy, C, a->ffn_act, I, 0.0f, gw->w2, I));
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 0, 0, N, I, C, 1.0f, dy, C, w->w2, I, 0.0f, wk->dbig, I));
    FT_TRY(rec->ffn(rec, be, layer, wk->dbig, a->ffn_act, N, I));
    FT_TRY(be->bias_act_backward(be, wk->dbig, wk->dbig, o->inplace_gelu ? a->ffn_act : a->ffn_pre,
                                 o->inplace_gelu ? a->gelu_bits : NULL, a->h1, w->w1, w->b1, N, I, C, c->activation));
    FT_TRY(be->sum_axis(be, gw->b1, wk->dbig, N, I, 0));
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 1, 0, I, C, N, 1.0f, wk->dbig, I, a->h1, C, 0.0f, gw->w1, C));
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 0, 0, N, C, I, 1.0f, wk->dbig, I, w->w1, C, 1.0f, wk->g, C));
    FT_TRY(be->layernorm_backward(be, wk->g, gw->ln1_g, gw->ln1_b, wk->g, ln_out ? a->h1 : a->ln1_in, a->ln1_stats,
                                  w->ln1_g, w->ln1_b, N, C, ln_out));
    const float *da = wk->g;
    if (o->hidden_dropout > 0.0f) {
        FT_TRY(be->dropout(be, wk->tmp, wk->g, N * C, o->hidden_dropout, site_key(bt, layer, SITE_ATTN_OUT)));
        da = wk->tmp;
    }
    FT_TRY(be->sum_axis(be, gw->bo, da, N, C, 0));
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 1, 0, C, A, N, 1.0f, da, C, a->ctx, A, 0.0f, gw->wo, A));
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 0, 0, N, A, C, 1.0f, da, C, w->wo, A, 0.0f, wk->dctx, A));
    FT_TRY(rec->heads(rec, be, layer, wk->dctx, a->ctx, N, A, NH));
    FT_TRY(be->attention_backward(be, o->matmul_precision, wk->dbig, wk->dctx, a->qkv, a->probs, a->attn_stats,
                                  a->attn_mask, bt->seqs, bt->B, A, NH, 0, o->attention_dropout,
                                  site_key(bt, layer, SITE_ATTN_PROBS), wk->attn_scratch, wk->attn_scratch_bytes));
    FT_TRY(be->sum_axis(be, gw->bqkv, wk->dbig, N, 3 * A, 0));
    FT_TRY(be->gemm_prec(be, o->matmul_precision, 1, 0, 3 * A, C, N, 1.0f, wk->dbig, 3 * A, a->x, C, 0.0f, gw->wqkv, C));
    if (!want_dx) return FT_OK;   /* the bottom trained layer: nothing below needs d x */
    return be->gemm_prec(be, o->matmul_precision, 0, 0, N, C, 3 * A, 1.0f, wk->dbig, 3 * A, w->wqkv, C, 1.0f, wk->g, C);
}

ft_status ft_layer_forward_train_pre(ft_backend *be, const ft_layer_batch *bt, int64_t layer, const ft_layer_shape *sh,
                                     const ft_layer_weights *w, ft_layer_acts *a, const ft_layer_work *wk) {
    const ft_bert_config *c = bt->cfg;
    const ft_dtype mp = bt->opt->matmul_precision;
    const int64_t N = bt->N, C = c->hidden_size, A = sh->attn, I = sh->inter, NH = sh->heads;
    const float eps = c->layer_norm_eps, *z = wk->zeros;
    /* a = LN_attn(x): the LayerNorm of 0 + (x + 0), its statistics kept */
    if (w->ln1_g)
        FT_TRY(be->residual_ln_train_forward(be, a->h1, NULL, a->ln1_stats, z, a->x, z, w->ln1_g, w->ln1_b ? w->ln1_b : z,
                                             N, C, eps, 0.0f, 0));
    const float *in = w->ln1_g ? a->h1 : a->x;
    FT_TRY(be->gemm_prec(be, mp, 0, 1, N, 3 * A, C, 1.0f, in, C, w->wqkv, C, 0.0f, a->qkv, 3 * A));
    const double theta = ft_config_layer_rope_theta(c, layer);
    if (theta > 0) FT_TRY(be->rotary_forward(be, FT_F32, a->qkv, wk->positions, N, A, NH, theta));
    FT_TRY(be->attention_train_forward(be, mp, a->ctx, a->probs, a->attn_stats, NULL, a->qkv, bt->seqs, bt->B, A, NH,
                                       ft_config_layer_window(c, layer), 0.0f, 0, wk->attn_scratch,
                                       wk->attn_scratch_bytes));
    /* x1 = x + ctx Wo^T (kept), m = LN_mlp(x1) */
    FT_TRY(be->gemm_prec(be, mp, 0, 1, N, C, A, 1.0f, a->ctx, A, w->wo, A, 0.0f, wk->tmp, C));
    FT_TRY(be->residual_ln_train_forward(be, a->mlp_in, a->ln1_in, a->ln2_stats, a->x, wk->tmp, z, w->ln2_g,
                                         w->ln2_b ? w->ln2_b : z, N, C, eps, 0.0f, 0));
    /* big = m Wi^T, act = GELU(big[:, :I]) big[:, I:] */
    FT_TRY(be->gemm_prec(be, mp, 0, 1, N, 2 * I, C, 1.0f, a->mlp_in, C, w->w1, C, 0.0f, a->ffn_pre, 2 * I));
    FT_TRY(be->gated_act_forward(be, FT_F32, a->ffn_act, a->ffn_pre, N, I, c->activation));
    /* out = x1 + act W2^T; the encoder's last layer: final_norm of it */
    FT_TRY(be->gemm_prec(be, mp, 0, 1, N, C, I, 1.0f, a->ffn_act, I, w->w2, I, 0.0f, wk->tmp, C));
    if (w->fin_g)
        return be->residual_ln_train_forward(be, a->out, a->res_out, a->fin_stats, a->ln1_in, wk->tmp, z, w->fin_g,
                                             w->fin_b ? w->fin_b : z, N, C, eps, 0.0f, 0);
    FT_TRY(be->copy(be, a->out, a->ln1_in, (size_t)N * (size_t)C * sizeof(float)));
    return be->add(be, a->out, wk->tmp, N * C);
}

/* Backward of a pre-LN layer. On entry wk->g = d out; on exit wk->g = d x.
 *   g     = d res_out                final norm backward (the encoder's last layer)   -> dfin_g
 *   dW2   = g^T act;  dact = g W2    (dbig's last I columns)
 *   dbig  = GeGLU backward of dact                                                    -> dWi = dbig^T m
 *   tmp   = dbig Wi = d m;  tmp = LN_mlp backward;  g += tmp   (g = d x1)             -> dln2_g
 *   dWo   = g^T ctx;  dctx = g Wo;  dbig = d qkv (attention backward), RoPE backward  -> dWqkv = dbig^T a
 *   tmp   = dbig Wqkv = d a;  LN_attn backward (not in layer 0);  g += tmp  (g = d x; skipped
 *           when nothing below needs it)                                               -> dln1_g */
ft_status ft_layer_backward_pre(ft_backend *be, const ft_layer_batch *bt, int64_t layer, const ft_layer_shape *sh,
                                const ft_layer_weights *w, const ft_layer_acts *a, const ft_layer_work *wk,
                                const ft_layer_weights *gw, int want_dx, const ft_layer_recorder *rec) {
    const ft_bert_config *c = bt->cfg;
    const ft_dtype mp = bt->opt->matmul_precision;
    const int64_t N = bt->N, C = c->hidden_size, A = sh->attn, I = sh->inter, NH = sh->heads;
    const float *z = wk->zeros;
    FT_TRY(rec->output(rec, be, layer, wk->g, a->out, a->x, N, C));
    if (w->fin_g)
        FT_TRY(be->layernorm_backward(be, wk->g, gw->fin_g, gw->fin_b ? gw->fin_b : wk->dump, wk->g, a->res_out,
                                      a->fin_stats, w->fin_g, w->fin_b ? w->fin_b : z, N, C, 0));
    float *dact = wk->dbig + (size_t)N * 2 * (size_t)I;
    FT_TRY(be->gemm_prec(be, mp, 1, 0, C, I, N, 1.0f, wk->g, C, a->ffn_act, I, 0.0f, gw->w2, I));
    FT_TRY(be->gemm_prec(be, mp, 0, 0, N, I, C, 1.0f, wk->g, C, w->w2, I, 0.0f, dact, I));
    FT_TRY(rec->ffn(rec, be, layer, dact, a->ffn_act, N, I));
    FT_TRY(be->gated_act_backward(be, wk->dbig, dact, a->ffn_pre, N, I, c->activation));
    FT_TRY(be->gemm_prec(be, mp, 1, 0, 2 * I, C, N, 1.0f, wk->dbig, 2 * I, a->mlp_in, C, 0.0f, gw->w1, C));
    FT_TRY(be->gemm_prec(be, mp, 0, 0, N, C, 2 * I, 1.0f, wk->dbig, 2 * I, w->w1, C, 0.0f, wk->tmp, C));
    FT_TRY(be->layernorm_backward(be, wk->tmp, gw->ln2_g, gw->ln2_b ? gw->ln2_b : wk->dump, wk->tmp, a->ln1_in,
                                  a->ln2_stats, w->ln2_g, w->ln2_b ? w->ln2_b : z, N, C, 0));
    FT_TRY(be->add(be, wk->g, wk->tmp, N * C));
    FT_TRY(be->gemm_prec(be, mp, 1, 0, C, A, N, 1.0f, wk->g, C, a->ctx, A, 0.0f, gw->wo, A));
    FT_TRY(be->gemm_prec(be, mp, 0, 0, N, A, C, 1.0f, wk->g, C, w->wo, A, 0.0f, wk->dctx, A));
    FT_TRY(rec->heads(rec, be, layer, wk->dctx, a->ctx, N, A, NH));
    FT_TRY(be->attention_backward(be, mp, wk->dbig, wk->dctx, a->qkv, a->probs, a->attn_stats, NULL, bt->seqs, bt->B, A,
                                  NH, ft_config_layer_window(c, layer), 0.0f, 0, wk->attn_scratch,
                                  wk->attn_scratch_bytes));
    const double theta = ft_config_layer_rope_theta(c, layer);
    if (theta > 0) FT_TRY(be->rotary_backward(be, wk->dbig, wk->positions, N, A, NH, theta));
    const float *in = w->ln1_g ? a->h1 : a->x;
    FT_TRY(be->gemm_prec(be, mp, 1, 0, 3 * A, C, N, 1.0f, wk->dbig, 3 * A, in, C, 0.0f, gw->wqkv, C));
    if (!want_dx && !w->ln1_g) return FT_OK;   /* the bottom trained layer: nothing below needs d x */
    FT_TRY(be->gemm_prec(be, mp, 0, 0, N, C, 3 * A, 1.0f, wk->dbig, 3 * A, w->wqkv, C, 0.0f, wk->tmp, C));
    if (w->ln1_g)   /* d LN_attn's weight, whether or not d x is wanted */
        FT_TRY(be->layernorm_backward(be, wk->tmp, gw->ln1_g, gw->ln1_b ? gw->ln1_b : wk->dump, wk->tmp, a->x,
                                      a->ln1_stats, w->ln1_g, w->ln1_b ? w->ln1_b : z, N, C, 0));
    return want_dx ? be->add(be, wk->g, wk->tmp, N * C) : FT_OK;
}

/* the recorder that records nothing: a layer's backward calls its recorder unconditionally */
static ft_status no_output(const ft_layer_recorder *r, ft_backend *be, int64_t layer, const float *dout,
                           const float *out, const float *x, int64_t N, int64_t C) {
    (void)r; (void)be; (void)layer; (void)dout; (void)out; (void)x; (void)N; (void)C;
    return FT_OK;
}
static ft_status no_ffn(const ft_layer_recorder *r, ft_backend *be, int64_t layer, const float *dact,
                        const float *act, int64_t N, int64_t I) {
    (void)r; (void)be; (void)layer; (void)dact; (void)act; (void)N; (void)I;
    return FT_OK;
}
static ft_status no_heads(const ft_layer_recorder *r, ft_backend *be, int64_t layer, const float *dctx,
                          const float *ctx, int64_t N, int64_t A, int64_t NH) {
    (void)r; (void)be; (void)layer; (void)dctx; (void)ctx; (void)N; (void)A; (void)NH;
    return FT_OK;
}
static void no_release(ft_layer_recorder *r) { (void)r; }

void ft_layer_recorder_none(ft_layer_recorder *r) {
    *r = (ft_layer_recorder){NULL, 0, NULL, no_output, no_ffn, no_heads, no_release};
}

/* ---- the stack ------------------------------------------------------------------------------ */

typedef struct {
    char name[96];
    int ndim;
    int64_t shape[2];
    size_t offset;   /* floats from the start of the stack's buffer */
} stack_view;

struct ft_layer_stack {
    ft_backend *be;
    ft_bert_config cfg;
    ft_layer_options opt;
    int64_t first, count;
    ft_layer_shape *shape;              /* per layer of the stack */
    size_t *layer_start, n_params;      /* per layer: its first float in params / grads; count + 1 entries */
    int64_t *layer_heads, *layer_inter; /* the config's per-layer arrays (all L layers), owned here */
    uint8_t *head_attention;
    int32_t *vocab_map;
    size_t extra;                       /* floats after the layers in params and grads: the caller's */
    float *params, *grads;              /* n_params + extra each, backend memory */
    /* what the backward hands its activations' gradients to, chosen once: nothing, or first-order
     * significance (ft_layer_stack_set_significance: FFN groups of sig_group neurons); its rows are
     * backend memory, grown with the batch */
    ft_layer_recorder rec;
    size_t rec_bytes;
    int64_t sig_group;
    int sig_valid;                      /* rec.rows holds the last backward's */
    stack_view *views;
    size_t n_views;
    ft_layer_weights *w, *gw;           /* per layer */
    ft_layer_acts *acts;                /* per layer, views into the arena */
    ft_layer_work work;
    void *arena, *ws;                   /* saved activations; per-step buffers */
    size_t arena_bytes, ws_bytes, peak;
    int32_t *seqs;                      /* host (B, 3) of the last forward */
    int32_t *pool_host;                 /* host (2, B): pooling's first rows and row counts */
    int64_t seqs_cap;
    ft_layer_batch batch;
    int ready;                          /* a training forward is waiting for its backward */
    /* the layer pair, chosen once from the config: post-LN (BERT) or pre-LN (ModernBERT) */
    ft_status (*forward_train)(ft_backend *, const ft_layer_batch *, int64_t, const ft_layer_shape *,
                               const ft_layer_weights *, ft_layer_acts *, const ft_layer_work *);
    ft_status (*backward)(ft_backend *, const ft_layer_batch *, int64_t, const ft_layer_shape *,
                          const ft_layer_weights *, const ft_layer_acts *, const ft_layer_work *,
                          const ft_layer_weights *, int, const ft_layer_recorder *);
    int32_t *pos_host;                  /* host (N): each row's position in its sequence (pre-LN) */
    /* the embeddings, when trained (opt.train_embeddings): their block first in params / grads and
     * inside layer 0's range ([0, layer_start[1])); the floats of the block, the offsets in it of
     * the word, position and type tables and the LayerNorm's weight and bias (NO_TENSOR: absent),
     * and the tables' rows; the next forward's tokens (host (3, tok_cap): ids, types, positions) */
    size_t emb_floats, emb_off[5];
    int64_t emb_rows[3];
    int32_t *tok_host;
    int64_t tok_n, tok_cap;             /* rows set by ft_layer_stack_set_tokens (0: none) */
    float *zeros_host;                  /* host (N, C) zeros, uploaded into the workspace (pre-LN) */
    int64_t pos_cap;
};

/* the offsets (floats, from the layer's start) of its tensors (slots in ft_layer_weights' order:
 * wqkv bqkv wo bo ln1_g ln1_b w1 b1 w2 b2 ln2_g ln2_b fin_g fin_b), laid out in the encoder's order
 * (model/encoder.c); an absent tensor has NO_TENSOR. A pre-LN layer (bias-free: the stack refuses
 * others) is wqkv, the attention norm (not in layer 0), wo, the MLP norm, Wi (2I rows), W2, then in
 * the encoder's last layer the final norm, which follows it in the encoder's buffer. */
enum { TENSORS = 14 };
#define NO_TENSOR ((size_t)-1)
static void layer_offsets(const ft_bert_config *c, const ft_layer_shape *sh, size_t off[TENSORS], size_t *total) {
    const size_t C = (size_t)c->hidden_size, A = (size_t)sh->attn, I = (size_t)sh->inter;
    size_t sizes[TENSORS] = {3 * A * C, 3 * A, C * A, C, C, C, I * C, I, C * I, C, C, C, 0, 0};
    int order[TENSORS] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
    if (c->norm == FT_NORM_PRE) {
        const size_t pre[TENSORS] = {3 * A * C, 0, C * A, 0, sh->index > 0 ? C : 0, 0, 2 * I * C, 0, C * I, 0, C, 0,
                                     sh->final_norm ? C : 0, 0};
        const int pre_order[TENSORS] = {0, 4, 2, 10, 6, 8, 12, 1, 3, 5, 7, 9, 11, 13};
        memcpy(sizes, pre, sizeof sizes);
        memcpy(order, pre_order, sizeof order);
    }
    size_t o = 0;
    for (int k = 0; k < TENSORS; k++) {
        const int t = order[k];
        off[t] = sizes[t] ? o : NO_TENSOR;
        o += sizes[t];
    }
    *total = o;
}

static void bind_weights(ft_layer_weights *w, float *base, const size_t off[TENSORS]) {
    float **slots[TENSORS] = {&w->wqkv, &w->bqkv, &w->wo, &w->bo, &w->ln1_g, &w->ln1_b, &w->w1,
                              &w->b1,   &w->w2,   &w->b2, &w->ln2_g, &w->ln2_b, &w->fin_g, &w->fin_b};
    for (int k = 0; k < TENSORS; k++) *slots[k] = off[k] == NO_TENSOR ? NULL : base + off[k];
}

/* where layer l's own weights start in params / grads (layer 0's range holds the embeddings before them) */
static size_t layer_base(const ft_layer_stack *s, int64_t l) { return s->layer_start[l] + (l ? 0 : s->emb_floats); }

static size_t stack_bytes_now(const ft_layer_stack *s) {
    return 2 * (s->n_params + s->extra) * sizeof(float) + s->arena_bytes + s->ws_bytes + s->rec_bytes;
}

void ft_layer_stack_free(ft_layer_stack *s) {
    if (!s) return;
    if (s->be) {
        if (s->params) s->be->free(s->be, s->params);
        if (s->grads) s->be->free(s->be, s->grads);
        if (s->arena) s->be->free(s->be, s->arena);
        if (s->ws) s->be->free(s->be, s->ws);
        if (s->rec.rows) s->be->free(s->be, s->rec.rows);
    }
    s->rec.release(&s->rec);
    free(s->views);
    free(s->w);
    free(s->gw);
    free(s->acts);
    free(s->seqs);
    free(s->pool_host);
    free(s->pos_host);
    free(s->zeros_host);
    free(s->tok_host);
    free(s->shape);
    free(s->layer_start);
    free(s->layer_heads);
    free(s->layer_inter);
    free(s->head_attention);
    free(s->vocab_map);
    free(s);
}

/* the stack's own copy of the encoder's per-layer structure (the config points at it), and the
 * shapes and parameter offsets of its layers */
static ft_status copy_structure(ft_layer_stack *s, const ft_encoder *e) {
    const int64_t L = e->cfg.num_layers, heads = ft_config_total_heads(&e->cfg), hs = e->cfg.hidden_size / e->cfg.num_heads;
    s->layer_heads = malloc((size_t)(L + 1) * sizeof(int64_t));
    s->layer_inter = malloc((size_t)(L + 1) * sizeof(int64_t));
    s->head_attention = malloc((size_t)heads + 1);
    s->shape = calloc((size_t)s->count, sizeof *s->shape);
    s->layer_start = calloc((size_t)s->count + 1, sizeof *s->layer_start);
    if (!s->layer_heads || !s->layer_inter || !s->head_attention || !s->shape || !s->layer_start)
        return ft_error(FT_ERR_NOMEM, "out of memory");
    memcpy(s->layer_heads, e->layer_heads, (size_t)L * sizeof(int64_t));
    memcpy(s->layer_inter, e->layer_intermediate, (size_t)L * sizeof(int64_t));
    memcpy(s->head_attention, e->head_attention, (size_t)heads);
    s->cfg.layer_heads = s->layer_heads;
    s->cfg.layer_intermediate = s->layer_inter;
    s->cfg.head_attention = s->head_attention;
    if (e->vocab_map) {   /* (only compared: the stack holds no embeddings) */
        if (!(s->vocab_map = malloc((size_t)e->cfg.vocab_size * sizeof(int32_t)))) return ft_error(FT_ERR_NOMEM, "out of memory");
        memcpy(s->vocab_map, e->vocab_map, (size_t)e->cfg.vocab_size * sizeof(int32_t));
        s->cfg.vocab_map = s->vocab_map;
    }
    for (int64_t i = 0; i < s->count; i++) {
        const int64_t l = s->first + i;
        for (int64_t h = e->head_first[l]; h < e->head_first[l + 1]; h++)
            if (e->head_attention[h] == FT_ATTN_SIGN_MATCH)
                return ft_error(FT_ERR_UNSUPPORTED, "layer %lld has sign-matching attention heads, which cannot be "
                                "trained (their backward would be exact attention's); train these layers before "
                                "applying sign matching, or train fewer top layers", (long long)l);
        s->shape[i] = (ft_layer_shape){e->layer_heads[l], e->layer_heads[l] * hs, e->layer_intermediate[l], l,
                                       e->cfg.norm == FT_NORM_PRE && l + 1 == L};
        size_t off[TENSORS], floats;
        layer_offsets(&s->cfg, &s->shape[i], off, &floats);
        s->layer_start[i + 1] = (i ? s->layer_start[i] : s->emb_floats) + floats;   /* layer 0's range: the embeddings too */
    }
    s->n_params = s->layer_start[s->count];
    return FT_OK;
}

ft_status ft_layer_stack_create(const ft_encoder *e, int64_t first, int64_t count, ft_device dev,
                                const ft_layer_options *opt, size_t extra_floats, int shared_grads,
                                ft_layer_stack **out) {
    *out = NULL;
    const int64_t L = e->cfg.num_layers;
    const int pre = e->cfg.norm == FT_NORM_PRE;
    if (pre && (!e->cfg.no_bias || !e->cfg.gated_ffn))   /* ModernBERT's layers: bias-free, GeGLU */
        return ft_error(FT_ERR_UNSUPPORTED, "training pre-LN encoder layers needs ModernBERT's layer: no biases and a "
                        "gated FFN (this config has %s)", !e->cfg.no_bias ? "biases" : "an ungated FFN");
    if (pre && opt && (opt->hidden_dropout > 0.0f || opt->attention_dropout > 0.0f || opt->input_dropout > 0.0f))
        return ft_error(FT_ERR_UNSUPPORTED, "training pre-LN encoder layers (ModernBERT) supports no dropout: hidden, "
                        "attention and input dropout must be 0, got %g, %g and %g", (double)opt->hidden_dropout,
                        (double)opt->attention_dropout, (double)opt->input_dropout);
    if (pre && opt && (opt->inplace_gelu || opt->inplace_layernorm))
        return ft_error(FT_ERR_UNSUPPORTED, "training pre-LN encoder layers (ModernBERT): Tempo's in-place %s is not "
                        "supported; turn it off", opt->inplace_gelu ? "GELU (inplace_gelu)" : "LayerNorm (inplace_layernorm)");
    if (e->int8)
        return ft_error(FT_ERR_UNSUPPORTED, "an int8 model asked to train: quantization kept int8 weights and their "
                        "scales, not the float32 weights training updates. Fine-tune the float32 model, then quantize "
                        "it (a head alone trains on an int8 encoder's features)");
    if (count < 1 || first < 0 || first + count > L)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "layers [%lld, %lld) are not layers of this %lld-layer encoder",
                        (long long)first, (long long)(first + count), (long long)L);
    if (!opt) return ft_error(FT_ERR_INVALID_ARGUMENT, "layer stack: no options");
    if (!(opt->hidden_dropout >= 0.0f && opt->hidden_dropout < 1.0f) ||
        !(opt->attention_dropout >= 0.0f && opt->attention_dropout < 1.0f) ||
        !(opt->input_dropout >= 0.0f && opt->input_dropout < 1.0f))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "dropout probabilities must be in [0, 1), got %g (hidden), %g "
                        "(attention) and %g (input)", (double)opt->hidden_dropout, (double)opt->attention_dropout,
                        (double)opt->input_dropout);
    if (opt->matmul_precision != FT_F32 && opt->matmul_precision != FT_BF16 && opt->matmul_precision != FT_F16)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "the layers' matmul precision must be float32, bfloat16 or float16, "
                        "got %s", ft_dtype_name(opt->matmul_precision));
    if (opt->inplace_gelu && !inplace_act_ok(e->cfg.activation))
        return ft_error(FT_ERR_UNSUPPORTED, "in-place activation needs GELU or ReLU");
    if (opt->train_embeddings && first != 0)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "training the embeddings needs every layer trained (the stack from "
                        "layer 0), got layers [%lld, %lld) of %lld", (long long)first, (long long)(first + count),
                        (long long)L);
    if (opt->train_embeddings && ft_config_embedding_size(&e->cfg) != e->cfg.hidden_size)
        return ft_error(FT_ERR_UNSUPPORTED, "training the embeddings of a model with an embeddings' projection "
                        "(embedding_size %lld, hidden_size %lld: ELECTRA-small) is not supported; train the layers "
                        "alone (train_embeddings off)", (long long)ft_config_embedding_size(&e->cfg),
                        (long long)e->cfg.hidden_size);
    ft_layer_stack *s = calloc(1, sizeof *s);
    if (!s) return ft_error(FT_ERR_NOMEM, "out of memory");
    ft_layer_recorder_none(&s->rec);
    s->forward_train = pre ? ft_layer_forward_train_pre : ft_layer_forward_train;
    s->backward = pre ? ft_layer_backward_pre : ft_layer_backward;
    s->cfg = e->cfg;
    s->opt = *opt;
    s->first = first;
    s->count = count;
    ft_status st = ft_backend_for(dev, &s->be);
    for (int t = 0; t < 5; t++) s->emb_off[t] = NO_TENSOR;
    if (opt->train_embeddings) {   /* the encoder's embeddings block: word, positions, types, LayerNorm (encoder.c) */
        const size_t C = (size_t)e->cfg.hidden_size, at[5] = {e->word, e->pos, e->type, e->emb_ln_g, e->emb_ln_b};
        for (int t = 0; t < 5; t++) s->emb_off[t] = at[t] == FT_NO_OFFSET ? NO_TENSOR : at[t] - e->word;
        s->emb_floats = (e->emb_ln_b != FT_NO_OFFSET ? e->emb_ln_b : e->emb_ln_g) + C - e->word;
        s->emb_rows[0] = ft_config_vocab_rows(&e->cfg);
        s->emb_rows[1] = e->pos != FT_NO_OFFSET ? e->cfg.max_position_embeddings : 0;
        s->emb_rows[2] = e->type != FT_NO_OFFSET ? e->cfg.type_vocab_size : 0;
    }
    if (st == FT_OK) st = copy_structure(s, e);
    if (st == FT_OK && opt->inplace_layernorm) {
        /* the backward divides by gamma: a zero would lose the normalised input */
        for (int64_t l = first; l < first + count && st == FT_OK; l++)
            for (int k = 0; k < 2; k++) {
                const float *g = e->host_params + (k ? e->layers[l].ln2_g : e->layers[l].ln1_g);
                for (int64_t c = 0; c < s->cfg.hidden_size; c++)
                    if (g[c] == 0.0f) {
                        st = ft_error(FT_ERR_UNSUPPORTED, "layer %lld: LayerNorm %d has a zero weight at column %lld, "
                                      "which in-place LayerNorm cannot invert; train with inplace_layernorm off",
                                      (long long)l, k + 1, (long long)c);
                        break;
                    }
            }
    }
    /* the named views: the encoder's, for these layers, offsets relative to the stack */
    if (st == FT_OK) {
        s->views = calloc((size_t)count * 16 + 5, sizeof *s->views);
        s->w = calloc((size_t)count, sizeof *s->w);
        s->gw = calloc((size_t)count, sizeof *s->gw);
        s->acts = calloc((size_t)count, sizeof *s->acts);
        if (!s->views || !s->w || !s->gw || !s->acts) st = ft_error(FT_ERR_NOMEM, "out of memory");
    }
    for (size_t k = 0; st == FT_OK && k < e->n_views; k++) {
        long long l;
        size_t offset;
        if (opt->train_embeddings && !strncmp(e->views[k].name, "embeddings.", 11))
            offset = e->views[k].offset - e->word;   /* the block, from 0 */
        else {
            if (pre && first + count == L && !strncmp(e->views[k].name, "final_norm.", 11))
                l = L - 1;   /* the final norm belongs to the encoder's last layer */
            else if (sscanf(e->views[k].name, "encoder.layer.%lld.", &l) != 1 || l < first || l >= first + count)
                continue;
            offset = layer_base(s, l - first) + (e->views[k].offset - e->layers[l].wqkv);
        }
        stack_view *v = &s->views[s->n_views++];
        snprintf(v->name, sizeof v->name, "%s", e->views[k].name);
        v->ndim = e->views[k].ndim;
        v->shape[0] = e->views[k].shape[0];
        v->shape[1] = e->views[k].shape[1];
        v->offset = offset;
    }
    s->extra = extra_floats;
    if (st == FT_OK) st = s->be->alloc(s->be, (s->n_params + s->extra) * sizeof(float), (void **)&s->params);
    if (st == FT_OK) st = ft_backend_alloc_grads(s->be, (s->n_params + s->extra) * sizeof(float), shared_grads,
                                                 (void **)&s->grads);
    if (st == FT_OK && s->emb_floats)
        st = s->be->upload(s->be, s->params, e->host_params + e->word, s->emb_floats * sizeof(float));
    for (int64_t l = 0; st == FT_OK && l < count; l++) {
        /* the encoder's layer block is contiguous in the same order (model/encoder.c's layout) */
        size_t off[TENSORS], floats;
        layer_offsets(&s->cfg, &s->shape[l], off, &floats);
        st = s->be->upload(s->be, s->params + layer_base(s, l), e->host_params + e->layers[first + l].wqkv,
                           floats * sizeof(float));
        bind_weights(&s->w[l], s->params + layer_base(s, l), off);
        bind_weights(&s->gw[l], s->grads + layer_base(s, l), off);
    }
    if (st == FT_OK) st = s->be->synchronize(s->be);
    if (st != FT_OK) { ft_layer_stack_free(s); return st; }
    s->peak = stack_bytes_now(s);
    *out = s;
    return FT_OK;
}

size_t ft_layer_stack_param_count(const ft_layer_stack *s) { return s->n_params; }
int64_t ft_layer_stack_count(const ft_layer_stack *s) { return s->count; }
size_t ft_layer_stack_extra_floats(const ft_layer_stack *s) { return s->extra; }
void ft_layer_stack_layer_range(const ft_layer_stack *s, int64_t l, size_t *offset, size_t *floats) {
    *offset = s->layer_start[l];
    *floats = s->layer_start[l + 1] - s->layer_start[l];
}
size_t ft_layer_stack_num_tensors(const ft_layer_stack *s) { return s->n_views; }
float *ft_layer_stack_params(ft_layer_stack *s) { return s->params; }
float *ft_layer_stack_grads(ft_layer_stack *s) { return s->grads; }

ft_status ft_layer_stack_tensor_info(const ft_layer_stack *s, size_t i, const char **name, int *ndim, int64_t shape[2],
                                     size_t *offset) {
    if (i >= s->n_views) return ft_error(FT_ERR_OUT_OF_RANGE, "tensor index %zu out of range", i);
    *name = s->views[i].name;
    *ndim = s->views[i].ndim;
    shape[0] = s->views[i].shape[0];
    shape[1] = s->views[i].shape[1];
    *offset = s->views[i].offset;
    return FT_OK;
}

/* per-step buffers for N rows of sequences of at most T rows */
static size_t work_layout(const ft_layer_stack *s, int64_t B, int64_t N, int64_t T, ft_layer_work *wk, char *base) {
    const size_t C = (size_t)s->cfg.hidden_size, n = (size_t)N;
    const int pre = s->cfg.norm == FT_NORM_PRE;
    size_t wide = 0;   /* the widest layer's FFN or QKV (pre-LN: its GeGLU input and output, 3I) */
    int64_t NH = 1;
    for (int64_t l = 0; l < s->count; l++) {
        const size_t I = (size_t)s->shape[l].inter * (pre ? 3 : 1), A3 = 3 * (size_t)s->shape[l].attn;
        wide = I > wide ? I : wide;
        wide = A3 > wide ? A3 : wide;
        NH = s->shape[l].heads > NH ? s->shape[l].heads : NH;
    }
    const int emb = s->opt.train_embeddings != 0;
    const size_t sizes[10] = {align64(n * C * 4), align64(n * C * 4), align64(n * C * 4), align64(n * wide * 4),
                              align64(s->be->attention_train_scratch_bytes(s->be, B, T, NH)),
                              align64((size_t)B * 2 * 4), pre ? align64(n * 4) : 0, pre ? align64(n * C * 4) : 0,
                              pre || emb ? align64(C * 4) : 0, emb ? align64(3 * n * 4) : 0};
    float **slots[5] = {&wk->tmp, &wk->g, &wk->dctx, &wk->dbig, &wk->attn_scratch};
    if (wk) wk->attn_scratch_bytes = sizes[4];
    size_t o = 0;
    for (int k = 0; k < 10; k++) {
        if (base && k < 5) *slots[k] = (float *)(base + o);
        if (base && k == 5) wk->pool_index = (int32_t *)(base + o);
        if (base && k == 6) wk->positions = pre ? (int32_t *)(base + o) : NULL;
        if (base && k == 7) wk->zeros = pre ? (float *)(base + o) : NULL;
        if (base && k == 8) wk->dump = pre || emb ? (float *)(base + o) : NULL;
        if (base && k == 9) wk->tokens = emb ? (int32_t *)(base + o) : NULL;
        o += sizes[k];
    }
    return o;
}

/* Inference (`shared`): nothing is kept for a backward, so every layer lays its activations over the
 * same slot (the end is the largest layer's), and the outputs alternate between two buffers before
 * it -- layer l reads layer l-1's output while it writes its own. Training: each layer its own. */
#define ARENA_BEGIN(nc)                                                      \
    size_t o = 0, end = 0, slot = 0;                                         \
    if (shared) o = slot = 2 * align64(nc)
#define TAKE(ptr, type, bytes)                                              \
    do {                                                                     \
        size_t b_ = (bytes);                                                 \
        if (base) (ptr) = b_ ? (type)(base + o) : NULL;                      \
        o += align64(b_);                                                    \
    } while (0)
/* the embeddings' rows (trained embeddings), before every layer's: kept in inference too (the
 * layers' shared slot starts after them) */
#define TAKE_EMB(nc, N)                                                       \
    do {                                                                      \
        const int e_ = s->opt.train_embeddings != 0;                          \
        TAKE(s->acts[0].emb_out, float *, e_ ? (nc) : 0);                     \
        TAKE(s->acts[0].emb_sum, float *, e_ ? (nc) : 0);                     \
        TAKE(s->acts[0].emb_stats, float *, e_ ? (size_t)(N) * 2 * 4 : 0);    \
        if (shared) slot = o;                                                 \
    } while (0)
#define TAKE_OUT(a, l, nc)                                                   \
    do {                                                                     \
        if (!shared) TAKE((a)->out, float *, nc);                            \
        else if (base) (a)->out = (float *)(base + ((l) & 1) * align64(nc)); \
    } while (0)

/* saved activations of every layer for N rows and P probabilities (shared: one layer's, for inference) */
static size_t arena_layout(const ft_layer_stack *s, int64_t N, int64_t P, int shared, char *base) {
    size_t sizes[FT_LAYER_ACT_KINDS];
    const size_t nc = (size_t)N * (size_t)s->cfg.hidden_size * 4;
    ARENA_BEGIN(nc);
    TAKE_EMB(nc, N);
    TAKE(s->acts[0].x_dropped, float *, !shared && s->opt.input_dropout > 0.0f ? nc : 0);
    for (int64_t l = 0; l < s->count; l++) {
        ft_layer_acts *a = &s->acts[l];
        if (shared) o = slot;
        ft_layer_acts_sizes(&s->cfg, &s->opt, &s->shape[l], N, P, sizes);
        TAKE(a->qkv, float *, sizes[ACT_QKV]);
        if (s->opt.recompute_attention_probs) {
            if (base) a->probs = NULL;
            TAKE(a->attn_stats, float *, sizes[ACT_PROBS]);
        } else {
            if (base) a->attn_stats = NULL;
            TAKE(a->probs, float *, sizes[ACT_PROBS]);
        }
        TAKE(a->attn_mask, uint8_t *, sizes[ACT_ATTN_MASK]);
        TAKE(a->ctx, float *, sizes[ACT_CTX]);
        TAKE(a->ln1_in, float *, sizes[ACT_LN_IN] / 2);
        TAKE(a->ln2_in, float *, sizes[ACT_LN_IN] / 2);
        TAKE(a->ln1_stats, float *, sizes[ACT_LN_STATS] / 2);
        TAKE(a->ln2_stats, float *, sizes[ACT_LN_STATS] / 2);
        TAKE(a->h1, float *, nc);
        TAKE_OUT(a, l, nc);
        TAKE(a->ffn_pre, float *, sizes[ACT_GELU_IN]);
        TAKE(a->gelu_bits, uint8_t *, sizes[ACT_GELU_BITS]);
        TAKE(a->ffn_act, float *, sizes[ACT_GELU_OUT]);
        end = o > end ? o : end;
    }
    return end;
}

/* a pre-LN stack's saved activations (ft_layer_forward_train_pre; ft_layer_acts_sizes' kinds) */
static size_t arena_layout_pre(const ft_layer_stack *s, int64_t N, int64_t P, int shared, char *base) {
    const size_t nc = (size_t)N * (size_t)s->cfg.hidden_size * 4, st = (size_t)N * 2 * 4;
    ARENA_BEGIN(nc);
    TAKE_EMB(nc, N);
    for (int64_t l = 0; l < s->count; l++) {
        ft_layer_acts *a = &s->acts[l];
        if (shared) o = slot;
        const ft_layer_shape *sh = &s->shape[l];
        const size_t n = (size_t)N, A = (size_t)sh->attn, I = (size_t)sh->inter, first = sh->index > 0,
                     fin = sh->final_norm != 0;
        TAKE(a->qkv, float *, n * 3 * A * 4);
        if (s->opt.recompute_attention_probs) {
            if (base) a->probs = NULL;
            TAKE(a->attn_stats, float *, n * (size_t)sh->heads * 2 * 4);
        } else {
            if (base) a->attn_stats = NULL;
            TAKE(a->probs, float *, (size_t)P * (size_t)sh->heads * 4);
        }
        if (base) a->attn_mask = NULL, a->ln2_in = NULL, a->gelu_bits = NULL;
        TAKE(a->ctx, float *, n * A * 4);
        TAKE(a->h1, float *, first * nc);
        TAKE(a->ln1_stats, float *, first * st);
        TAKE(a->ln1_in, float *, nc);
        TAKE(a->ln2_stats, float *, st);
        TAKE(a->mlp_in, float *, nc);
        TAKE(a->ffn_pre, float *, n * 2 * I * 4);
        TAKE(a->ffn_act, float *, n * I * 4);
        TAKE(a->res_out, float *, fin * nc);
        TAKE(a->fin_stats, float *, fin * st);
        TAKE_OUT(a, l, nc);
        end = o > end ? o : end;
    }
    return end;
}
#undef ARENA_BEGIN
#undef TAKE
#undef TAKE_OUT
#undef TAKE_EMB

static ft_status grow(ft_layer_stack *s, void **buf, size_t *have, size_t need) {
    if (need <= *have) return FT_OK;
    if (*buf) s->be->free(s->be, *buf);
    *buf = NULL;
    *have = 0;
    FT_TRY(s->be->alloc(s->be, need, buf));
    *have = need;
    const size_t now = stack_bytes_now(s);
    if (now > s->peak) s->peak = now;
    return FT_OK;
}

ft_status ft_layer_stack_set_tokens(ft_layer_stack *s, const int32_t *ids, const int32_t *types, int64_t N) {
    const ft_bert_config *c = &s->cfg;
    s->tok_n = 0;
    if (!s->opt.train_embeddings)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "these layers do not train the embeddings: their input is the "
                        "embeddings' output x, not tokens");
    if (N < 1 || !ids) return ft_error(FT_ERR_INVALID_ARGUMENT, "layer stack tokens: no rows");
    for (int64_t r = 0; r < N; r++) {
        if (ids[r] < 0 || ids[r] >= c->vocab_size)
            return ft_error(FT_ERR_OUT_OF_RANGE, "token id %lld (row %lld) is out of range for vocab_size %lld",
                            (long long)ids[r], (long long)r, (long long)c->vocab_size);
        const int32_t ty = types ? types[r] : 0;
        if (ty < 0 || ty >= (s->emb_rows[2] ? s->emb_rows[2] : 1))
            return ft_error(FT_ERR_OUT_OF_RANGE, s->emb_rows[2] ? "token type %lld (row %lld) is out of range for "
                            "type_vocab_size %lld" : "token type %lld (row %lld): this model has no token types (pass "
                            "zeros or none)", (long long)ty, (long long)r, (long long)s->emb_rows[2]);
    }
    if (N > s->tok_cap) {
        int32_t *t = realloc(s->tok_host, (size_t)N * 3 * sizeof *t);
        if (!t) return ft_error(FT_ERR_NOMEM, "out of memory");
        s->tok_host = t;
        s->tok_cap = N;
    }
    memcpy(s->tok_host, ids, (size_t)N * sizeof(int32_t));
    for (int64_t r = 0; r < N; r++) s->tok_host[s->tok_cap + r] = types ? types[r] : 0;
    s->tok_n = N;
    return FT_OK;
}

/* The tokens set for this batch as the embeddings take them, into the workspace: rows of a pruned
 * vocabulary, and each row's position in its sequence as the encoder counts it (model/encoder.c:
 * RoBERTa's after the padding id, skipping tokens equal to it) */
static ft_status upload_tokens(ft_layer_stack *s, int64_t N, int64_t B) {
    const ft_bert_config *c = &s->cfg;
    if (s->tok_n != N)
        return ft_error(FT_ERR_INVALID_ARGUMENT, s->tok_n ? "the tokens set are %lld rows, the batch has %lld" :
                        "these layers train the embeddings: set the batch's tokens (ft_layer_stack_set_tokens) "
                        "before each forward (%lld rows set, the batch has %lld)", (long long)s->tok_n, (long long)N);
    s->tok_n = 0;   /* used once */
    int32_t *ids = s->tok_host, *types = ids + s->tok_cap, *pos = ids + 2 * s->tok_cap;
    for (int64_t b = 0; b < B; b++) {
        const int32_t first = s->seqs[3 * b], n = s->seqs[3 * b + 1];
        int64_t before = 0;
        for (int32_t t = 0; t < n; t++) {
            const int64_t r = first + t, id = ids[r];
            const int64_t p = ft_config_position(c, t, id, 1, &before);
            if (s->emb_rows[1] && p >= s->emb_rows[1])
                return ft_error(FT_ERR_INVALID_ARGUMENT, "sequence %lld: position %lld exceeds max_position_embeddings "
                                "%lld (at most %lld tokens)", (long long)b, (long long)p, (long long)s->emb_rows[1],
                                (long long)ft_config_max_tokens(c));
            pos[r] = (int32_t)p;
        }
    }
    /* rows of a pruned vocabulary, in place: the raw ids were used above */
    if (c->vocab_map)
        for (int64_t r = 0; r < N; r++) ids[r] = c->vocab_map[ids[r]];
    FT_TRY(s->be->upload(s->be, s->work.tokens, ids, (size_t)N * sizeof(int32_t)));
    FT_TRY(s->be->upload(s->be, s->work.tokens + N, types, (size_t)N * sizeof(int32_t)));
    return s->be->upload(s->be, s->work.tokens + 2 * N, pos, (size_t)N * sizeof(int32_t));
}

/* the embeddings' tables in params (or grads): word, position, type, LayerNorm weight and bias (NULL: absent) */
static float *emb_table(const ft_layer_stack *s, float *base, int t) {
    return s->emb_off[t] == NO_TENSOR ? NULL : base + s->emb_off[t];
}

ft_status ft_layer_stack_forward(ft_layer_stack *s, const float *x, const int32_t *lengths, int64_t B, float *out,
                                 int training, uint64_t seed, uint64_t step, uint64_t row_base, uint64_t sq_base) {
    const int emb = s->opt.train_embeddings != 0;
    if (B < 1 || (!x && !emb) || !out || !lengths)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "layer stack forward: empty batch");
    if (x && emb)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "these layers train the embeddings: their input is the tokens "
                        "(ft_layer_stack_set_tokens), and x must be NULL");
    const int64_t C = s->cfg.hidden_size;
    if (B > s->seqs_cap) {
        int32_t *ns = realloc(s->seqs, (size_t)B * 3 * sizeof *ns);
        if (ns) s->seqs = ns;
        int32_t *np = ns ? realloc(s->pool_host, (size_t)B * 2 * sizeof *np) : NULL;
        if (np) s->pool_host = np;
        if (!ns || !np) return ft_error(FT_ERR_NOMEM, "out of memory");
        s->seqs_cap = B;
    }
    int64_t N = 0, P = 0, T = 0;
    s->batch.B = s->batch.N = 0;   /* nothing to pool or go back through until this forward is done */
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lengths[b];
        if (n < 1 || n > s->cfg.max_position_embeddings)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "sequence %lld has %lld tokens; expected 1 to %lld", (long long)b,
                            (long long)n, (long long)s->cfg.max_position_embeddings);
        s->seqs[3 * b] = (int32_t)N;
        s->seqs[3 * b + 1] = s->seqs[3 * b + 2] = (int32_t)n;
        N += n;
        P += n * n;
        T = n > T ? n : T;
    }
    s->ready = 0;
    s->sig_valid = 0;
    const int pre = s->cfg.norm == FT_NORM_PRE;
    size_t (*layout)(const ft_layer_stack *, int64_t, int64_t, int, char *) = pre ? arena_layout_pre : arena_layout;
    const int shared = !training;   /* evaluation keeps nothing for a backward: one layer's activations */
    FT_TRY(grow(s, &s->arena, &s->arena_bytes, layout(s, N, P, shared, NULL)));
    FT_TRY(grow(s, &s->ws, &s->ws_bytes, work_layout(s, B, N, T, NULL, NULL)));
    layout(s, N, P, shared, s->arena);
    work_layout(s, B, N, T, &s->work, s->ws);
    if (pre) {   /* RoPE's positions (each row's index in its sequence) and the zeros, for this batch */
        if (N > s->pos_cap) {
            int32_t *np = realloc(s->pos_host, (size_t)N * sizeof *np);
            if (np) s->pos_host = np;
            float *nz = np ? calloc((size_t)N * (size_t)C, sizeof *nz) : NULL;
            if (!np || !nz) return ft_error(FT_ERR_NOMEM, "out of memory");
            free(s->zeros_host);
            s->zeros_host = nz;
            s->pos_cap = N;
        }
        for (int64_t b = 0; b < B; b++)
            for (int32_t t = 0; t < s->seqs[3 * b + 1]; t++) s->pos_host[s->seqs[3 * b] + t] = t;
        FT_TRY(s->be->upload(s->be, s->work.positions, s->pos_host, (size_t)N * sizeof(int32_t)));
        FT_TRY(s->be->upload(s->be, s->work.zeros, s->zeros_host, (size_t)N * (size_t)C * sizeof(float)));
    }
    ft_layer_options inference = s->opt;
    if (!training) {   /* evaluation and predictions: no dropout, and float32 products whatever the training's
                        * matmul_precision -- the weights as the exported float32 model computes with them */
        inference.hidden_dropout = inference.attention_dropout = inference.input_dropout = 0.0f;
        inference.matmul_precision = FT_F32;
    }
    s->batch = (ft_layer_batch){&s->cfg, training ? &s->opt : NULL, N, B, P, s->seqs, seed, step, row_base, sq_base};
    ft_layer_batch bt = s->batch;
    bt.opt = training ? &s->opt : &inference;
    if (training)   /* the recorder's rows of this batch, filled by the backward (none: 0 bytes) */
        FT_TRY(grow(s, (void **)&s->rec.rows, &s->rec_bytes, (size_t)N * (size_t)s->rec.ld * sizeof(float)));
    if (emb) {   /* the embeddings' output from this batch's tokens: the stack's input */
        FT_TRY(upload_tokens(s, N, B));
        const int32_t *tok = s->work.tokens;
        float *p = s->params;
        ft_layer_acts *a = &s->acts[0];
        FT_TRY(s->be->embed_train_forward(s->be, a->emb_out, a->emb_sum, a->emb_stats, tok, s->emb_rows[2] ? tok + N : NULL,
                                          tok + 2 * N, p, emb_table(s, p, 1), emb_table(s, p, 2), emb_table(s, p, 3),
                                          emb_table(s, p, 4), N, C, s->cfg.layer_norm_eps));
        x = a->emb_out;
    }
    if (training && s->opt.input_dropout > 0.0f) {   /* the stack's input dropped (BERT's embeddings' dropout) */
        FT_TRY(s->be->dropout(s->be, s->acts[0].x_dropped, x, N * C, s->opt.input_dropout, input_key(&bt)));
        x = s->acts[0].x_dropped;
    }
    for (int64_t l = 0; l < s->count; l++) {
        s->acts[l].x = l ? s->acts[l - 1].out : x;
        FT_TRY(s->forward_train(s->be, &bt, s->first + l, &s->shape[l], &s->w[l], &s->acts[l], &s->work));
    }
    FT_TRY(s->be->copy(s->be, out, s->acts[s->count - 1].out, (size_t)N * (size_t)C * sizeof(float)));
    FT_TRY(s->be->synchronize(s->be));
    s->ready = training != 0;
    return FT_OK;
}

ft_status ft_layer_stack_backward(ft_layer_stack *s, const float *dout, float *dx, float loss_scale,
                                  ft_layer_done_fn done, void *arg) {
    if (!s->ready) return ft_error(FT_ERR_INVALID_ARGUMENT, "layer stack backward: no training forward to go back through");
    if (!(loss_scale > 0.0f) || !isfinite(loss_scale))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "layer stack backward: the loss scale must be finite and > 0, got %g",
                        (double)loss_scale);
    const int64_t N = s->batch.N, C = s->cfg.hidden_size;
    const int emb = s->opt.train_embeddings != 0;
    if (emb && dx)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "these layers train the embeddings: their input is tokens, which "
                        "have no gradient (dx must be NULL)");
    FT_TRY(s->be->copy(s->be, s->work.g, dout, (size_t)N * (size_t)C * sizeof(float)));
    if (loss_scale != 1.0f) FT_TRY(s->be->scale(s->be, s->work.g, N * C, loss_scale));
    for (int64_t l = s->count - 1; l >= 0; l--) {
        FT_TRY(s->backward(s->be, &s->batch, s->first + l, &s->shape[l], &s->w[l], &s->acts[l], &s->work, &s->gw[l],
                           l > 0 || dx != NULL || emb, &s->rec));
        if (l == 0 && emb) {   /* on into the embeddings: their dropout, LayerNorm, then the tables' rows */
            const ft_layer_acts *a = &s->acts[0];
            float *g = s->work.g, *gr = s->grads;
            const int32_t *tok = s->work.tokens;
            if (s->opt.input_dropout > 0.0f)
                FT_TRY(s->be->dropout(s->be, g, g, N * C, s->opt.input_dropout, input_key(&s->batch)));
            float *dbeta = emb_table(s, gr, 4);
            FT_TRY(s->be->layernorm_backward(s->be, g, emb_table(s, gr, 3), dbeta ? dbeta : s->work.dump, g, a->emb_sum,
                                             a->emb_stats, emb_table(s, s->params, 3), emb_table(s, s->params, 4), N, C, 0));
            FT_TRY(s->be->embed_backward(s->be, gr, emb_table(s, gr, 1), emb_table(s, gr, 2), g, tok,
                                         s->emb_rows[2] ? tok + N : NULL, tok + 2 * N, N, C, s->emb_rows[0],
                                         s->emb_rows[1], s->emb_rows[2]));
        }
        if (loss_scale != 1.0f)
            FT_TRY(s->be->scale(s->be, s->grads + s->layer_start[l], (int64_t)(s->layer_start[l + 1] - s->layer_start[l]),
                                1.0f / loss_scale));
        if (done) {   /* its gradients are final: complete them in memory and hand them over */
            FT_TRY(s->be->synchronize(s->be));
            done(arg, l);
        }
    }
    if (loss_scale != 1.0f && dx) FT_TRY(s->be->scale(s->be, s->work.g, N * C, 1.0f / loss_scale));
    if (dx && s->opt.input_dropout > 0.0f)   /* through the input's dropout: the same mask and scale */
        FT_TRY(s->be->dropout(s->be, dx, s->work.g, N * C, s->opt.input_dropout, input_key(&s->batch)));
    else if (dx)
        FT_TRY(s->be->copy(s->be, dx, s->work.g, (size_t)N * (size_t)C * sizeof(float)));
    s->ready = 0;
    s->sig_valid = 1;
    return s->be->synchronize(s->be);
}

int64_t ft_layer_stack_hidden_size(const ft_layer_stack *s) { return s->cfg.hidden_size; }

void ft_layer_stack_last_batch(const ft_layer_stack *s, int64_t *B, int64_t *N) {
    *B = s->batch.B;
    *N = s->batch.N;
}

/* the last forward's sequences as pooling's (first row, row count) table, in the workspace */
static ft_status pool_index(ft_layer_stack *s, int cls) {
    const int64_t B = s->batch.B;
    if (B < 1) return ft_error(FT_ERR_INVALID_ARGUMENT, "layer stack pooling: no forward to pool");
    for (int64_t b = 0; b < B; b++) {
        s->pool_host[b] = s->seqs[3 * b];
        s->pool_host[B + b] = cls ? 1 : s->seqs[3 * b + 1];
    }
    return s->be->upload(s->be, s->work.pool_index, s->pool_host, (size_t)B * 2 * sizeof(int32_t));
}

ft_status ft_layer_stack_pool(ft_layer_stack *s, const float *h, int cls, float *pooled) {
    FT_TRY(pool_index(s, cls));
    const int64_t B = s->batch.B;
    FT_TRY(s->be->pool_forward(s->be, FT_F32, pooled, h, s->work.pool_index, s->work.pool_index + B, B,
                               s->cfg.hidden_size));
    return s->be->synchronize(s->be);
}

ft_status ft_layer_stack_pool_backward(ft_layer_stack *s, const float *dpooled, int cls, float *dh) {
    FT_TRY(pool_index(s, cls));
    const int64_t B = s->batch.B;
    FT_TRY(s->be->pool_backward(s->be, dh, dpooled, s->work.pool_index, s->work.pool_index + B, B, s->batch.N,
                                s->cfg.hidden_size));
    return s->be->synchronize(s->be);
}

ft_status ft_layer_stack_memory(const ft_layer_stack *s, const ft_layer_options *opt, int64_t B, int64_t T,
                                ft_layer_memory *m) {
    if (B < 1 || T < 1) return ft_error(FT_ERR_INVALID_ARGUMENT, "memory report: batch %lld x %lld", (long long)B,
                                        (long long)T);
    if (!opt) opt = &s->opt;
    if (s->cfg.norm == FT_NORM_PRE && (opt->inplace_gelu || opt->inplace_layernorm))
        return ft_error(FT_ERR_UNSUPPORTED, "training pre-LN encoder layers (ModernBERT): Tempo's in-place GELU and "
                        "LayerNorm are not supported");
    if (opt->inplace_gelu && !inplace_act_ok(s->cfg.activation))
        return ft_error(FT_ERR_UNSUPPORTED, "in-place activation needs GELU or ReLU");
    memset(m, 0, sizeof *m);
    const int64_t N = B * T, P = B * T * T;
    size_t sizes[FT_LAYER_ACT_KINDS];
    for (int64_t l = 0; l < s->count; l++) {
        ft_layer_acts_sizes(&s->cfg, opt, &s->shape[l], N, P, sizes);
        for (int k = 0; k < FT_LAYER_ACT_KINDS; k++) m->activations[k] += sizes[k];
    }
    /* the caller's rows, and their copy after input_dropout */
    m->activations[ACT_INPUT] = (size_t)(1 + (opt->input_dropout > 0.0f)) * (size_t)N * (size_t)s->cfg.hidden_size *
                                sizeof(float);
    if (s->opt.train_embeddings)   /* the embeddings' sum and statistics too (their output is the input above) */
        m->activations[ACT_INPUT] += (size_t)N * ((size_t)s->cfg.hidden_size + 2) * sizeof(float);
    m->weights = m->gradients = (s->n_params + s->extra) * sizeof(float);   /* the head's floats after the layers too */
    ft_layer_work wk;
    m->workspace = work_layout(s, B, N, T, &wk, NULL);
    return FT_OK;
}

void ft_layer_stack_options(const ft_layer_stack *s, ft_layer_options *out) { *out = s->opt; }

void ft_layer_stack_allocated(const ft_layer_stack *s, size_t *now, size_t *peak) {
    *now = stack_bytes_now(s);
    *peak = s->peak;
}

ft_status ft_layer_stack_export(ft_layer_stack *s, ft_encoder *e) {
    if (!ft_bert_config_equal(&e->cfg, &s->cfg))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "export: the encoder has another configuration");
    if (e->int8)
        return ft_error(FT_ERR_UNSUPPORTED, "export: the encoder is int8; export into a float32 encoder, then quantize it");
    if (s->emb_floats)
        FT_TRY(s->be->download(s->be, e->host_params + e->word, s->params, s->emb_floats * sizeof(float)));
    for (int64_t l = 0; l < s->count; l++)
        FT_TRY(s->be->download(s->be, e->host_params + e->layers[s->first + l].wqkv, s->params + layer_base(s, l),
                               (s->layer_start[l + 1] - layer_base(s, l)) * sizeof(float)));
    return ft_encoder_sync_params(e);   /* device copy; packed copies remade on the next forward */
}

void ft_layer_stack_layer_shape(const ft_layer_stack *s, int64_t i, int64_t *heads, int64_t *intermediate) {
    *heads = s->shape[i].heads;
    *intermediate = s->shape[i].inter;
}

ft_status ft_layer_stack_set_significance(ft_layer_stack *s, int64_t ffn_group) {
    if (ffn_group < 0) return ft_error(FT_ERR_INVALID_ARGUMENT, "significance: FFN group size %lld", (long long)ffn_group);
    ft_layer_recorder rec;
    if (ffn_group) FT_TRY(ft_significance_recorder(&rec, s->shape, s->first, s->count, ffn_group));
    else ft_layer_recorder_none(&rec);
    if (s->rec.rows) s->be->free(s->be, s->rec.rows);
    s->rec.release(&s->rec);
    s->rec = rec;
    s->rec_bytes = 0;
    s->sig_group = ffn_group;
    s->ready = s->sig_valid = 0;   /* a forward made before this has no rows to record into: forward again */
    return FT_OK;
}

ft_status ft_layer_stack_significance(ft_layer_stack *s, float *heads, float *ffn, float *layers) {
    if (!s->sig_group) return ft_error(FT_ERR_INVALID_ARGUMENT, "significance: not recorded (set_significance first)");
    if (s->batch.B < 1 || !s->sig_valid)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "significance: no backward since the last training forward");
    return ft_significance_sums(&s->rec, s->be, s->seqs, s->batch.B, s->batch.N, heads, ffn, layers);
}
