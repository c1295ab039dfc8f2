/* The task heads' shared part (csrc/train/head.c) and the interface each kind of head implements
 * in its own file: head_sequence.c (classification, regression, multi-label over pooled
 * sequences), head_token.c (a label per token), head_span.c (extractive QA spans). */
#ifndef FT_TRAIN_HEAD_H
#define FT_TRAIN_HEAD_H
#include "backend.h"

enum { HEAD_SITE_INPUT = 0, HEAD_SITE_HIDDEN = 1 };   /* dropout sites 0..14: the heads'; 15: a layer
                                                         * stack's input (model/layer.c) */

/* whether a head training with dropout (`drop`) drops its input: always without a dense layer; with
 * one (`dense`), only where the architecture's class does (cfg->dense_input_dropout: RoBERTa's and
 * ELECTRA's heads drop it, BERT's pooler does not) */
static inline int head_drops_input(const ft_head_config *cfg, int dense, int drop) {
    return drop && (!dense || cfg->dense_input_dropout);
}

typedef struct { const char *name; int ndim; int64_t shape[2]; } head_tensor;
enum { HEAD_MAX_TENSORS = 8 };

/* everything one step of a head works on (backend memory unless said) */
typedef struct {
    const ft_head_config *cfg;
    const ft_head_batch *bt;
    const float *params, *x, *valid;
    const void *targets;       /* NULL: forward only */
    float *logits, *loss, *grads, *dx;
    float scale;               /* the loss terms' weight: 1 / their count in the global batch */
    int drop;                  /* training with dropout > 0 */
    uint64_t key_in, key_hidden;   /* dropout keys of the input and the pooler's hidden layer */
    float *ws;                 /* the step's workspace (kind->workspace floats) */
} head_call;

/* A kind of head: a descriptor, one per csrc/train/head_<name>.c, listed once in FT_HEAD_KINDS
 * (fasttran.h). Nothing outside a head's own file asks which kind it is: the shared code reads
 * these fields. */
typedef struct {
    const char *name;
    unsigned needs;            /* FT_HEAD_NEEDS_* */
    /* the kind's own rules for a configuration (num_labels, loss, pooling); the shared ones (hidden,
     * dropout, loss and pooling codes) are checked before */
    ft_status (*check)(const ft_head_config *cfg);
    /* tensors in buffer order; returns the count (at most HEAD_MAX_TENSORS) */
    size_t (*tensors)(const ft_head_config *cfg, head_tensor out[HEAD_MAX_TENSORS]);
    int64_t (*logits_count)(const ft_head_config *cfg, int64_t B, int64_t N);
    int64_t (*loss_count)(const ft_head_config *cfg, int64_t B, int64_t N);
    int64_t (*target_count)(const ft_head_config *cfg, int64_t B, int64_t N);
    size_t (*workspace)(const ft_head_config *cfg, int64_t B, int64_t N, int grads, int dx, int drop);
    /* the targets of a host copy against the head's rules (valid: host copy when the kind needs it) */
    ft_status (*check_targets)(const ft_head_config *cfg, const ft_head_batch *bt, const void *targets,
                               const float *valid);
    ft_status (*step)(ft_backend *be, const head_call *c);
} head_kind;

#define FT_HEAD_DECLARE_(NAME, code, name, desc) extern const head_kind desc;
FT_HEAD_KINDS(FT_HEAD_DECLARE_)
#undef FT_HEAD_DECLARE_

/* The dense layer a head runs before its classifier (head_dense.c), in the shape the configuration
 * gives (ft_head_config: act, no_dense_bias, norm), on R rows of C:
 *   h (R, C) = act(in W1^T [+ b1]) [then LayerNorm(h) gamma [beta]]
 * Tensors: pooler.dense.weight (C, C), [pooler.dense.bias (C),] [pooler.norm.weight (C),
 * [pooler.norm.bias (C)]] (fasttran.export renames them per architecture). */
size_t ft_head_dense_tensors(const ft_head_config *cfg, head_tensor *out);
size_t ft_head_dense_floats(const ft_head_config *cfg);       /* its parameters */
size_t ft_head_dense_workspace(const ft_head_config *cfg, int64_t R);
ft_status ft_head_check_dense(const ft_head_config *cfg);
/* *out = h (in ws) from in (R, C); params: the block's parameters; ws: ft_head_dense_workspace floats */
ft_status ft_head_dense_forward(ft_backend *be, const ft_head_config *cfg, const float *params, const float *in,
                                int64_t R, float *ws, const float **out);
/* from d h (R, C; overwritten): grads of the block's parameters (like params), din (R, C) = d in
 * when not NULL; ws and in as the forward left them */
ft_status ft_head_dense_backward(ft_backend *be, const ft_head_config *cfg, const float *params, const float *in,
                                 int64_t R, float *ws, float *dh, float *grads, float *din);

/* The pooled sequence head (head_sequence.c), shared by the heads that score pooled sequences:
 *   pooled (B, C) = mean / CLS row of each sequence (x itself when N == B); with `pooler`, the
 *   dense layer (BERT's: h = tanh(dropout(pooled) W1^T + b1)); logits (B, K) = dropout(h or pooled) W^T + b.
 * Tensors: [the dense layer's,] classifier.weight (K, C), classifier.bias (K). `loss` computes the
 * loss terms from c->logits (B, K) and, when dlogits is not NULL, d logits; the step then runs the
 * backward from them. */
typedef ft_status (*head_loss_fn)(ft_backend *be, const head_call *c, float *dlogits);
size_t ft_head_pooled_tensors(const ft_head_config *cfg, int pooler, int64_t K, head_tensor *out);
size_t ft_head_pooled_workspace(const ft_head_config *cfg, int pooler, int64_t K, int64_t B, int64_t N, int grads,
                                int dx, int drop);
ft_status ft_head_pooled_step(ft_backend *be, const head_call *c, int pooler, int64_t K, head_loss_fn loss);
/* the checks every head that pools shares (pooling mean or CLS) */
ft_status ft_head_check_pooling(const ft_head_config *cfg);

/* logits (R, K) = in (R, C) W^T + b */
ft_status ft_head_linear_forward(ft_backend *be, float *logits, const float *in, const float *W, const float *b,
                                 int64_t R, int64_t C, int64_t K);
/* gW (K, C) = dlogits^T in, gb (K) = column sums; din (R, C) = dlogits W when din != NULL */
ft_status ft_head_linear_backward(ft_backend *be, float *gW, float *gb, float *din, const float *dlogits,
                                  const float *in, const float *W, int64_t R, int64_t C, int64_t K);
#endif
