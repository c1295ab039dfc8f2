/* The BERT encoder: parameters in one allocation with a table of named views (Hugging Face
 * names), activations in one workspace sized from (B, T), and the layer loop over backend ops. */
#ifndef FT_MODEL_ENCODER_H
#define FT_MODEL_ENCODER_H
#include <pthread.h>
#include <stdlib.h>

#include "backend.h"

typedef struct {
    char name[96];
    size_t offset;        /* floats from the start of the parameter buffer */
    int ndim;
    int64_t shape[2];
    int optional;         /* pooler: may be absent from a checkpoint */
    /* int8 encoders (ft_encoder_quantize): the view is stored in int8, its rows at qoffset bytes
     * of q.data with one scale per row at soffset floats of q.scale; offset is FT_NO_OFFSET */
    int int8;
    size_t qoffset, soffset;
} ft_param_view;

#define FT_NO_OFFSET ((size_t)-1)   /* a float view that an int8 encoder no longer has */

/* An int8 encoder's quantized weights: each layer's four projection matrices, and optionally the
 * word embeddings, int8 with one float32 scale per output channel (row); one allocation each. */
typedef struct {
    int8_t *data;
    float *scale;
    size_t data_bytes, scales;
    struct { size_t q, s; } (*layer)[4];   /* per layer: wqkv, wo, w1, w2 (bytes into data, floats into scale) */
    int word;                               /* the word embeddings are int8 */
    size_t word_q, word_s;
} ft_encoder_int8;

/* Offsets (in floats) of one layer's tensors. Q, K, V weights are adjacent rows of one
 * (3C, C) block and their biases one (3C) vector, so the QKV projection is a single GEMM while
 * each Hugging Face tensor is still a contiguous named view. */
typedef struct {
    size_t wqkv, bqkv, wo, bo, ln1_g, ln1_b, w1, b1, w2, b2, ln2_g, ln2_b;   /* FT_NO_OFFSET: absent (no biases;
                                              * pre-LN: ln1 = before attention (none in layer 0), ln2 = before the FFN) */
    size_t pqkv, po, p1, p2;   /* the backend's packed copies of wqkv, wo, w1, w2 (in `packed`) */
} ft_layer_offsets;

/* A layer's attention in the forward, picked once per layer when the structure is set: attention_forward
 * (every head exact), or attention_heads_forward with the layer's head modes (it holds sign-matching
 * heads); modes: the layer's NH modes, read by the second only. */
typedef ft_status (*ft_attend_fn)(ft_backend *be, ft_dtype dt, void *ctx, const void *qkv, const int32_t *seqs,
                                  const int32_t *seqs_dev, int64_t B, int64_t C, int64_t NH, const uint8_t *modes,
                                  int64_t sign_keys, void *scratch);

struct ft_encoder {
    ft_bert_config cfg;
    ft_backend *be;
    ft_dtype dtype;           /* storage type of params and activations: F32, or F16/BF16 on CUDA */
    size_t esz;               /* its size in bytes */
    /* the linear layers' weights on the CPU: FT_F32, FT_BF16 (packed bf16 copies of the
     * float32 masters) or FT_I8 (int8 + scales in `int8`, no float32 masters) */
    ft_dtype wtype;
    int lowp;                 /* the linear layers run on the backend's linear_lp_* (it pays for wtype) */
    ft_encoder_int8 *int8;    /* FT_I8: the quantized weights */
    void *params;             /* backend memory, n_params values of dtype */
    float *host_params;       /* float32 master copy (== params on the CPU) for save and inspection */
    size_t n_params;
    ft_param_view *views;
    size_t n_views;
    size_t word, pos, type, emb_ln_g, emb_ln_b, pooler_w, pooler_b;   /* pos, emb_ln_b: FT_NO_OFFSET in a rotary /
                                                                       * bias-free model */
    size_t final_g, final_b;  /* pre-LN: the LayerNorm after the last layer, else FT_NO_OFFSET */
    size_t proj_w, proj_b, pproj;   /* embeddings_project (embedding_size != hidden_size), else FT_NO_OFFSET */
    ft_layer_offsets *layers;
    /* the structure of a compressed model: per layer its heads and FFN width, per head its
     * attention mode (the config's arrays point here); head_first[l] = the layer's first head */
    int64_t *layer_heads, *layer_intermediate, *head_first;
    uint8_t *head_attention;
    ft_attend_fn *attend;     /* per layer: its attention (above) */
    int32_t *vocab_map;       /* a pruned vocabulary's id -> row map (vocab_size), or NULL */
    int has_pooler;
    /* the backend's packed copies of the layer weights (pack_weight), made on the first
     * forward after the weights change; NULL when the backend packs nothing */
    float *packed;
    size_t packed_floats;
    int packed_ok;
    /* workspace, grown on demand, never shrunk */
    void *ws;
    size_t ws_bytes;
    void *host_ws;            /* int32 ids/types, float keymask, int32 key_len staging */
    size_t host_ws_bytes;
    pthread_mutex_t lock;
};

/* Free an int8 encoder's quantized weights (NULL: nothing). Beside the type it frees, so that
 * encoder.c (an encoder's end) and encoder_int8.c (which makes them) share it without calling
 * each other: encoder_int8.c builds on encoder.c, never the other way. */
static inline void ft_encoder_int8_free(ft_encoder_int8 *q) {
    if (!q) return;
    free(q->data);
    free(q->scale);
    free(q->layer);
    free(q);
}

/* the (rows, columns) of layer l's four projection weights -- Wqkv (3A, C), Wo (C, A), W1 (I, C),
 * W2 (C, I) with A its heads x head size and I its FFN width -- at the layer's own (pruned) shape */
void ft_encoder_layer_shapes(const ft_encoder *e, int64_t l, int64_t shapes[4][2]);

/* host_params changed: refresh the backend's copy (in dtype) and drop the packed copies */
ft_status ft_encoder_sync_params(ft_encoder *e);

/* the position id of token t of a sequence, raw id `id`, a real token or padding: t, or FT_POS_AFTER_PADDING's
 * rule. *before counts the sequence's real tokens so far whose id is not the padding id: start it at 0 per
 * sequence and call once per token, in order. The encoder's input staging and the layers that train the
 * embeddings both number positions with it. */
int64_t ft_config_position(const ft_bert_config *c, int64_t t, int64_t id, int real, int64_t *before);

#endif
