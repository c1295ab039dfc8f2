/* One BERT encoder layer as a forward / backward pair over the backend table (llm.c's shape), and
 * the stack of the top layers that fine-tuning trains (ft_layer_stack in fasttran.h).
 *
 * Rows are packed: the N rows of a batch are its sequences' real tokens one after another
 * (sequence b: rows [first_b, first_b + n_b)); C hidden, I intermediate, NH heads, P = sum over b
 * of NH n_b^2 attention probabilities. */
#ifndef FT_MODEL_LAYER_H
#define FT_MODEL_LAYER_H
#include "backend.h"

/* a layer's shape: its attention heads, their width (heads x head size: C unless heads were pruned)
 * and its FFN width (compressed models have them per layer); index: the encoder's layer; final_norm:
 * (pre-LN) the layer is the encoder's last and owns the final LayerNorm */
typedef struct {
    int64_t heads, attn, inter;
    int64_t index;
    int final_norm;
} ft_layer_shape;

/* a layer's parameters, or their gradients: views into one flat buffer, in the encoder's order */
typedef struct {
    float *wqkv, *bqkv, *wo, *bo, *ln1_g, *ln1_b, *w1, *b1, *w2, *b2, *ln2_g, *ln2_b;
    float *fin_g, *fin_b;   /* pre-LN: the final LayerNorm, in the encoder's last layer only (else NULL) */
} ft_layer_weights;

/* What a layer's backward needs, kept by its training forward: views into one arena. NULL views
 * are not kept under the options in force (see ft_layer_acts_layout). */
typedef struct {
    const float *x;      /* (N, C)   the layer input: the previous layer's `out`, or the batch */
    float *qkv;          /* (N, 3C)  Q, K, V */
    float *probs;        /* (P)      attention probabilities before dropout, unless recomputed */
    float *attn_stats;   /* (N, NH, 2) their rows' softmax max and 1/sum, when recomputed */
    uint8_t *attn_mask;  /* (P)      attention dropout mask, unless it is recomputed (Tempo) */
    float *ctx;          /* (N, C)   attention output */
    float *ln1_in;       /* (N, C)   LayerNorm 1 input, unless the backward uses its output (Tempo) */
    float *ln1_stats;    /* (N, 2)   its mean and 1/std */
    float *h1;           /* (N, C)   LayerNorm 1 output */
    float *ffn_pre;      /* (N, I)   GELU input, unless the backward uses its output (Tempo) */
    uint8_t *gelu_bits;  /* (N I/8)  GELU branch bits (Tempo's in-place GELU) */
    float *ffn_act;      /* (N, I)   GELU output */
    float *ln2_in;       /* (N, C)   LayerNorm 2 input, unless the backward uses its output (Tempo) */
    float *ln2_stats;    /* (N, 2) */
    float *out;          /* (N, C)   the layer output */
    /* a pre-LN layer's (ft_layer_forward_train_pre) in these views: h1 = its attention input (the
     * attention norm's output; x itself in encoder layer 0), ln1_stats its statistics, ln1_in = x +
     * attention (the residual stream), ln2_stats the MLP norm's, ffn_pre = the (N, 2I) GeGLU input,
     * ffn_act its (N, I) output; and these: */
    float *mlp_in;       /* (N, C)   the MLP norm's output */
    float *res_out;      /* (N, C)   with a final norm: the residual stream it normalises (else NULL) */
    float *fin_stats;    /* (N, 2)   the final norm's statistics */
    float *x_dropped;    /* (N, C)   the bottom layer's only: the stack's input after input_dropout, in
                          *          training (else NULL); its x points here then */
    /* the bottom layer's only, when the stack trains the embeddings (else NULL): */
    float *emb_sum;      /* (N, C)   word + type + position rows, the embeddings' LayerNorm input */
    float *emb_stats;    /* (N, 2)   its mean and 1/std */
    float *emb_out;      /* (N, C)   its output: the stack's input before input_dropout */
} ft_layer_acts;

/* the per-step buffers that nothing keeps between forward and backward */
typedef struct {
    float *tmp;          /* (N, C)   projection outputs before their LayerNorm; dropout gradients */
    float *g;            /* (N, C)   the running gradient of the layer output / input */
    float *dctx;         /* (N, C) */
    float *dbig;         /* (N, max(I, 3A))  GELU / QKV gradients */
    float *attn_scratch; /* attention_train_scratch_bytes */
    size_t attn_scratch_bytes;
    int32_t *pool_index; /* (2, B)   pooling's first rows and row counts (ft_layer_stack_pool) */
    /* pre-LN layers: */
    int32_t *positions;  /* (N)      each row's position in its sequence (RoPE) */
    float *zeros;        /* (N, C)   zeros: the norms' absent biases, a LayerNorm without a residual */
    float *dump;         /* (C)      the gradients of absent LayerNorm biases, thrown away */
    int32_t *tokens;     /* (3, N)   trained embeddings: the rows' ids, types and positions */
} ft_layer_work;

typedef struct {
    const ft_bert_config *cfg;
    const ft_layer_options *opt;
    int64_t N, B, P;     /* rows, sequences, attention probabilities per head (sum over b of n_b^2) */
    const int32_t *seqs; /* HOST (B, 3): first row, n, n */
    uint64_t seed, step; /* dropout keys: (seed, step, layer, site) */
    uint64_t row_base, sq_base;   /* rows, and sum of n^2, of the global batch's sequences before it */
} ft_layer_batch;

/* bytes of each saved activation kind for one layer of shape sh (index: ft_layer_memory's order);
 * P = sum over sequences of n_b^2 */
void ft_layer_acts_sizes(const ft_bert_config *cfg, const ft_layer_options *opt, const ft_layer_shape *sh, int64_t N,
                         int64_t P, size_t sizes[FT_LAYER_ACT_KINDS]);

/* What a layer's backward hands over at three points -- the gradient of its output with its output
 * and input, of its FFN activations with them, of its attention output with it -- to a recorder the
 * stack picks once (ft_layer_stack_set_significance), never tested per call: the calls of
 * ft_layer_recorder_none's do nothing; model/significance.c's record first-order significance.
 * `layer` is the encoder's layer index; a recorder writes into rows, N rows of ld floats (backend
 * memory the stack grows with each training forward; ld 0: nothing kept). */
typedef struct ft_layer_recorder ft_layer_recorder;
struct ft_layer_recorder {
    void *self;          /* the recorder's own state */
    int64_t ld;
    float *rows;
    ft_status (*output)(const ft_layer_recorder *r, ft_backend *be, int64_t layer, const float *dout,
                        const float *out, const float *x, int64_t N, int64_t C);
    ft_status (*ffn)(const ft_layer_recorder *r, ft_backend *be, int64_t layer, const float *dact,
                     const float *act, int64_t N, int64_t I);
    ft_status (*heads)(const ft_layer_recorder *r, ft_backend *be, int64_t layer, const float *dctx,
                       const float *ctx, int64_t N, int64_t A, int64_t NH);
    void (*release)(ft_layer_recorder *r);   /* frees self (not rows: the stack's) */
};

/* r = the recorder that records nothing (ld 0) */
void ft_layer_recorder_none(ft_layer_recorder *r);

/* out = layer(x): keeps what the backward needs in `acts` (x is acts->x) */
ft_status ft_layer_forward_train(ft_backend *be, const ft_layer_batch *bt, int64_t layer, const ft_layer_shape *sh,
                                 const ft_layer_weights *w, ft_layer_acts *acts, const ft_layer_work *work);
/* work->g holds d out on entry and d x on exit (want_dx; else partial); grads overwritten; rec: the
 * stack's recorder (never NULL) */
ft_status ft_layer_backward(ft_backend *be, const ft_layer_batch *bt, int64_t layer, const ft_layer_shape *sh,
                            const ft_layer_weights *w, const ft_layer_acts *acts, const ft_layer_work *work,
                            const ft_layer_weights *grads, int want_dx, const ft_layer_recorder *rec);

/* The same pair for a pre-LN layer (ModernBERT: no biases, RoPE, GeGLU, the layer's attention
 * window; see layer.c). The stack picks one pair from the config when it is made. */
ft_status ft_layer_forward_train_pre(ft_backend *be, const ft_layer_batch *bt, int64_t layer, const ft_layer_shape *sh,
                                     const ft_layer_weights *w, ft_layer_acts *acts, const ft_layer_work *work);
ft_status ft_layer_backward_pre(ft_backend *be, const ft_layer_batch *bt, int64_t layer, const ft_layer_shape *sh,
                                const ft_layer_weights *w, const ft_layer_acts *acts, const ft_layer_work *work,
                                const ft_layer_weights *grads, int want_dx, const ft_layer_recorder *rec);
#endif
