/* The task heads' shared part (csrc/train/head.c) and the interface each kind of head implements
 * in its own file: head_sequence.c (classification, regression, multi-label over pooled
 * sequences), head_token.c (a label per token), head_span.c (extractive QA spans). */
#ifndef FT_TRAIN_HEAD_H
#define FT_TRAIN_HEAD_H
#include "backend.h"

enum { HEAD_SITE_INPUT = 0, HEAD_SITE_HIDDEN = 1 };   /* dropout sites 0..15 belong to the heads */

typedef struct { const char *name; int ndim; int64_t shape[2]; } head_tensor;

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

typedef struct {
    /* tensors in buffer order; returns the count (at most 4) */
    size_t (*tensors)(const ft_head_config *cfg, head_tensor out[4]);
    int64_t (*logits_count)(const ft_head_config *cfg, int64_t B, int64_t N);
    int64_t (*loss_count)(const ft_head_config *cfg, int64_t B, int64_t N);
    int64_t (*target_count)(const ft_head_config *cfg, int64_t B, int64_t N);
    size_t (*workspace)(const ft_head_config *cfg, int64_t B, int64_t N, int grads, int dx, int drop);
    /* the targets of a host copy against the head's rules (valid: host copy for QA) */
    ft_status (*check_targets)(const ft_head_config *cfg, const ft_head_batch *bt, const void *targets,
                               const float *valid);
    ft_status (*step)(ft_backend *be, const head_call *c);
} head_kind;

extern const head_kind ft_head_sequence, ft_head_token, ft_head_span;

/* logits (R, K) = in (R, C) W^T + b */
ft_status ft_head_linear_forward(ft_backend *be, float *logits, const float *in, const float *W, const float *b,
                                 int64_t R, int64_t C, int64_t K);
/* gW (K, C) = dlogits^T in, gb (K) = column sums; din (R, C) = dlogits W when din != NULL */
ft_status ft_head_linear_backward(ft_backend *be, float *gW, float *gb, float *din, const float *dlogits,
                                  const float *in, const float *W, int64_t R, int64_t C, int64_t K);
#endif
