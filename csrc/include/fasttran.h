/* fasttran public C API.
 *
 * Everything the Python binding does goes through these functions, so a C program can drive
 * the library without Python. Every function returns an ft_status; on failure the first error
 * writes a message (what, which argument/tensor/file, expected vs got) into a thread-local
 * buffer that ft_last_error() returns. Nothing here prints, exits or aborts.
 */
#ifndef FASTTRAN_H
#define FASTTRAN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FT_VERSION "0.1.0"

typedef enum {
    FT_OK = 0,
    FT_ERR_INVALID_ARGUMENT = 1, /* bad shape, bad option, empty batch            */
    FT_ERR_DTYPE = 2,            /* an array or tensor has a dtype we cannot take  */
    FT_ERR_OUT_OF_RANGE = 3,     /* token id / type id / position out of range     */
    FT_ERR_NOMEM = 4,            /* allocation failed                              */
    FT_ERR_IO = 5,               /* open/read/write/rename failed (errno in text)  */
    FT_ERR_NOT_FOUND = 6,        /* a file or a named tensor is missing            */
    FT_ERR_FORMAT = 7,           /* a file is corrupt, truncated or lies           */
    FT_ERR_UNSUPPORTED = 8,      /* model feature / backend op we do not implement */
    FT_ERR_DEVICE = 9,           /* CUDA runtime or cuBLAS failure                 */
    FT_ERR_INTERRUPTED = 10,     /* the cancel callback asked us to stop           */
    FT_ERR_INTERNAL = 11
} ft_status;

const char *ft_status_name(ft_status s);
/* Message of the last failure on this thread ("" when none). */
const char *ft_last_error(void);
/* errno of the OS call behind the last failure on this thread (FT_ERR_IO, FT_ERR_NOT_FOUND), or 0. */
int ft_last_errno(void);
void ft_clear_error(void);

typedef enum {
    FT_F32 = 0, FT_F16 = 1, FT_BF16 = 2,
    FT_I64 = 3, FT_I32 = 4, FT_I16 = 5, FT_I8 = 6, FT_U8 = 7, FT_BOOL = 8, FT_F64 = 9,
    FT_DTYPE_COUNT
} ft_dtype;

const char *ft_dtype_name(ft_dtype dt);
size_t ft_dtype_size(ft_dtype dt);

typedef enum { FT_DEVICE_CPU = 0, FT_DEVICE_CUDA = 1 } ft_device_kind;
typedef struct { ft_device_kind kind; int index; } ft_device;

/* A read-only 2-D integer-like array (ids, masks) viewed in place: strides in elements, so
 * non-contiguous NumPy/DLPack inputs are read without a copy. */
typedef struct {
    const void *data;
    ft_dtype dtype;       /* I64, I32, I16, I8, U8, BOOL, F32 (masks only), F64 (masks only) */
    int64_t stride[2];    /* elements */
} ft_index2d;

/* ---- model description --------------------------------------------------------------- */
typedef enum { FT_ACT_GELU_ERF = 0, FT_ACT_GELU_TANH = 1, FT_ACT_RELU = 2, FT_ACT_TANH = 3 } ft_activation;

/* How a token's position id is found (fasttran/architectures.py names the one each architecture uses):
 *   FT_POS_INDEX: its index t in the row (BERT, DistilBERT, ELECTRA);
 *   FT_POS_AFTER_PADDING: transformers' create_position_ids_from_input_ids (RoBERTa, XLM-R, CamemBERT):
 *     pad_token_id + 1 + the number of real tokens before it whose id is not pad_token_id; a token whose
 *     id is pad_token_id takes pad_token_id. Left or right padding leaves every position unchanged. */
typedef enum { FT_POS_INDEX = 0, FT_POS_AFTER_PADDING = 1 } ft_position_ids;

/* Where a layer's LayerNorms sit (fasttran/architectures.py's `norm`):
 *   FT_NORM_POST: BERT's x = LN(x + f(x)) after attention and after the FFN;
 *   FT_NORM_PRE: ModernBERT's x = x + f(LN(x)): layer l's attention reads LN_attn(x) (layer 0 reads
 *     the embeddings' LayerNorm output as it is: its attention norm is the identity, and it has no
 *     tensor), its FFN LN_mlp(x); one more LayerNorm (final_norm) after the last layer. */
typedef enum { FT_NORM_POST = 0, FT_NORM_PRE = 1 } ft_norm_placement;

typedef struct {
    int64_t vocab_size;
    int64_t hidden_size;          /* C */
    int64_t num_layers;           /* L */
    int64_t num_heads;            /* NH, C % NH == 0 */
    int64_t intermediate_size;    /* I */
    int64_t max_position_embeddings;
    int64_t type_vocab_size;      /* 0: no token types (no type table; token_type_ids must be 0) */
    float layer_norm_eps;
    ft_activation activation;
    int64_t pad_token_id;
    ft_position_ids position_ids;
    int64_t embedding_size;       /* E, the embeddings' width (word, position, type tables, their LayerNorm); 0:
                                   * hidden_size. E != C: a linear layer embeddings_project (C, E) + bias maps
                                   * the LayerNorm's output to the layers' width (ELECTRA) */
    /* Structure of a compressed model (fasttran.compress); all NULL / 0 for a model as pretrained.
     * The head size is hidden_size / num_heads in every layer; a pruned layer keeps fewer heads
     * (its Q, K, V projections have layer_heads[l] * head size rows, its output projection as many
     * columns) and a narrower FFN. The encoder copies the arrays it is given at creation;
     * ft_encoder_config returns its copies. */
    const int64_t *layer_heads;          /* (num_layers) heads per layer, 1..num_heads, or NULL: num_heads */
    const int64_t *layer_intermediate;   /* (num_layers) FFN width per layer >= 1, or NULL: intermediate_size */
    const uint8_t *head_attention;       /* (sum of the layers' heads) ft_attention_mode per head (EXACT or
                                          * SIGN_MATCH), layer after layer, or NULL: every head exact */
    int64_t sign_match_keys;             /* keys a sign-matching head attends to (>= 1 when one does) */
    /* A pruned vocabulary: the word embeddings keep vocab_rows rows and token id t reads row
     * vocab_map[t] (vocab_size entries: the ids a tokenizer gives stay valid; ids whose rows were
     * removed map to the unknown token's). NULL / 0: every id its own row. */
    const int32_t *vocab_map;
    int64_t vocab_rows;
    /* The layer's shape beyond BERT's (ModernBERT); all 0 for BERT's layers.
     *   norm: ft_norm_placement (FT_NORM_PRE needs num_layers >= 1);
     *   rope_theta > 0: rotary position embeddings (RoPE, rotate_half layout) on Q and K at each row's
     *     index in its sequence, no position table; global layers use rope_theta, windowed ones
     *     rope_theta_local (> 0 when attention_window is);
     *   gated_ffn: the FFN's first projection has 2I rows, h = act(first I) * (last I) (GeGLU);
     *   no_bias: no linear-layer or LayerNorm biases (no bias tensors);
     *   qkv_fused: Q, K and V are one (3A, C) tensor (attention.self.qkv.weight), not three;
     *   attention_window > 0: layer l is global when l % global_every == 0, else its query i sees the
     *     keys j with |i - j| <= attention_window / 2 (indices in the sequence). */
    ft_norm_placement norm;
    double rope_theta, rope_theta_local;
    int gated_ffn, no_bias, qkv_fused;
    int64_t attention_window, global_every;
} ft_bert_config;

/* layer l's attention window (0: global) and rotary theta (0: none) */
int64_t ft_config_layer_window(const ft_bert_config *c, int64_t layer);
double ft_config_layer_rope_theta(const ft_bert_config *c, int64_t layer);

/* How an attention head computes. FT_ATTN_SIGN_MATCH is the sign-matching attention of Nagarajan et
 * al., "Optimizing Transformers with Approximate Computing" (2020): per query, the keys whose signs
 * agree with the query's in the most dimensions (XOR + popcount of sign bits) are found, and
 * softmax(q.k / sqrt(d)) V is taken over the sign_match_keys best of them only (the others get no
 * weight; ties go to the earlier key; a sequence with no more keys than that gets exact attention).
 * FT_ATTN_OFF (forward masks only): the head's output is zero. */
typedef enum { FT_ATTN_EXACT = 0, FT_ATTN_SIGN_MATCH = 1, FT_ATTN_OFF = 2 } ft_attention_mode;

/* per-layer shape of a config (NULL arrays: the uniform values), its consistency check, and equality
 * (arrays compared by value) */
int64_t ft_config_layer_heads(const ft_bert_config *c, int64_t layer);
int64_t ft_config_layer_intermediate(const ft_bert_config *c, int64_t layer);
int64_t ft_config_total_heads(const ft_bert_config *c);
int64_t ft_config_vocab_rows(const ft_bert_config *c);   /* rows of the word embeddings */
int64_t ft_config_max_tokens(const ft_bert_config *c);   /* real tokens a sequence may hold (positions) */
int64_t ft_config_embedding_size(const ft_bert_config *c);   /* E (hidden_size when the config says 0) */
int ft_bert_config_equal(const ft_bert_config *a, const ft_bert_config *b);

typedef enum { FT_POOL_NONE = 0, FT_POOL_CLS = 1, FT_POOL_MEAN = 2 } ft_pooling;

typedef struct ft_encoder ft_encoder;

/* Cancel callback: called between layers; return non-zero to stop with FT_ERR_INTERRUPTED. */
typedef int (*ft_cancel_fn)(void *arg);

/* dtype: the storage type of the weights and activations on the device: FT_F32 everywhere,
 * FT_F16 / FT_BF16 on CUDA (float32 accumulation and statistics); FT_BF16 on a CPU with
 * AVX512_BF16: the linear layers' weights packed in bf16 and their products in bf16 (float32
 * activations, sums and statistics; refused, naming avx512_bf16, where the CPU lacks it). The host
 * copy of the weights (ft_encoder_tensor_info, save) is float32 whatever dtype is. */
ft_status ft_encoder_create(const ft_bert_config *cfg, ft_device device, ft_dtype dtype, ft_encoder **out);
/* FT_F32, FT_F16, FT_BF16, or FT_I8 after ft_encoder_quantize */
ft_dtype ft_encoder_dtype(const ft_encoder *enc);
/* float32 encoders on CUDA: products on TF32 tensor cores (inputs rounded to 10-bit mantissas,
 * float32 accumulation) when on != 0; true fp32 by default. No effect on the CPU or in half
 * precision. */
ft_status ft_encoder_set_tf32(ft_encoder *enc, int on);
void ft_encoder_free(ft_encoder *enc);
const ft_bert_config *ft_encoder_config(const ft_encoder *enc);
int ft_encoder_has_pooler(const ft_encoder *enc);
size_t ft_encoder_param_count(const ft_encoder *enc);   /* float elements */
size_t ft_encoder_workspace_bytes(const ft_encoder *enc);

/* What an encoder holds, in bytes, and what its device has left. */
typedef struct {
    size_t parameters;       /* the weights where they compute (in the encoder's dtype) */
    size_t packed_weights;   /* the backend's packed copies of the layer weights (CPU) */
    size_t workspace;        /* activations: grown to the largest batch so far, never shrunk */
    size_t backend;          /* the backend's own workspaces (cuBLASLt, optimizer, training) */
    size_t host;             /* on the host besides: the float32 master weights (CUDA), staging */
    size_t device_free, device_total;
} ft_encoder_memory;
ft_status ft_encoder_memory_report(ft_encoder *enc, ft_encoder_memory *out);

/* Load weights from a safetensors file. `prefix` is stripped from tensor names ("" or
 * "bert."); pass NULL to detect it. Every tensor of the model must be present with the right
 * shape; F32/F16/BF16 are converted to the parameter dtype. */
ft_status ft_encoder_load_safetensors(ft_encoder *enc, const char *path, const char *prefix);
/* Copy all weights of `src` into `dst` (same config, any devices): Encoder.to(device). */
ft_status ft_encoder_copy_weights(ft_encoder *dst, const ft_encoder *src);
/* Write the weights as a Hugging Face BertModel safetensors file (atomic: temp + rename). */
ft_status ft_encoder_save_safetensors(const ft_encoder *enc, const char *path, ft_dtype dtype);
/* The same two with the file's record: the load first checks the file's size and CRC-32C (-1: not
 * checked) before its header is read; the save returns them (bytes / crc may be NULL). */
ft_status ft_encoder_load_safetensors_expect(ft_encoder *enc, const char *path, const char *prefix,
                                             int64_t expect_bytes, int64_t expect_crc32c);
/* The same for a checkpoint that names its tensors otherwise: names[k] is view k's name in the file
 * (without the prefix; ft_encoder_num_tensors entries, NULL: the views' own names), layer_prefix what
 * precedes a layer's index in them ("encoder.layer.", DistilBERT's "transformer.layer."); a NULL
 * prefix is detected from names[0] (the word embeddings). */
ft_status ft_encoder_load_safetensors_named(ft_encoder *enc, const char *path, const char *prefix,
                                            const char *const *names, const char *layer_prefix,
                                            int64_t expect_bytes, int64_t expect_crc32c);
/* names (one per view, as for ft_encoder_load_safetensors_named; NULL: the views' own) names the tensors */
ft_status ft_encoder_save_safetensors_named(const ft_encoder *enc, const char *path, ft_dtype dtype,
                                            const char *const *names, uint64_t *bytes, uint32_t *crc32c);
ft_status ft_encoder_save_safetensors_record(const ft_encoder *enc, const char *path, ft_dtype dtype,
                                             uint64_t *bytes, uint32_t *crc32c);

/* Named parameter views, in a fixed order (Hugging Face names, no prefix). A view an int8 encoder
 * stores in int8 has no float32 data: tensor_info gives its name and shape, *host_data NULL and
 * FT_ERR_UNSUPPORTED; read it with ft_encoder_tensor_int8. */
size_t ft_encoder_num_tensors(const ft_encoder *enc);
ft_status ft_encoder_tensor_info(const ft_encoder *enc, size_t i, const char **name,
                                 int *ndim, int64_t shape[2], float **host_data);
/* Write view i (float32, shape as tensor_info says); the packed copies are remade on the next forward. */
ft_status ft_encoder_set_tensor(ft_encoder *enc, size_t i, const float *data);

/* ---- int8 encoders --------------------------------------------------------------------------
 * ft_encoder_quantize turns a float32 CPU encoder into an int8 one, in place: each layer's four
 * projection matrices (Q, K, V, attention output, FFN in and out) and, with embeddings != 0, the
 * word embeddings become int8 q (rows x cols) with one float32 scale per row (output channel):
 * scale = max|w| / 127, q = rint(w / scale) in [-127, 127]. Their float32 copies are freed (the
 * biases, LayerNorms, position and type embeddings and the pooler stay float32). The linear layers
 * then run int8 products where the CPU gains from them (ft_cpu_int8_kernel: VNNI, AVX-VNNI,
 * AMX-INT8), else float32 kernels over the dequantized weights (int8_products 0). Irreversible: an
 * int8 encoder cannot be trained (ft_layer_stack_create refuses it), moved to CUDA, loaded from or
 * saved to a float checkpoint. A non-finite weight is refused (the encoder stays as it was). */
ft_status ft_encoder_quantize(ft_encoder *enc, int embeddings);
int ft_encoder_int8_products(const ft_encoder *enc);     /* 1: its linear layers run int8 products */
int ft_encoder_int8_embeddings(const ft_encoder *enc);   /* 1: its word embeddings are int8 */
int ft_encoder_tensor_is_int8(const ft_encoder *enc, size_t i);
/* view i's int8 values (shape[0] x shape[1], row-major) and its per-row scales (shape[0]), in place */
ft_status ft_encoder_tensor_int8(const ft_encoder *enc, size_t i, int8_t **data, float **scale);
/* write an int8 view: values (any int8) and per-row scales (finite, >= 0) */
ft_status ft_encoder_set_tensor_int8(ft_encoder *enc, size_t i, const int8_t *data, const float *scale);

/* Forward pass over a (B, T) batch.
 *   ids   (B, T) token ids, mask (B, T) 1 = attend / 0 = padding (NULL: all ones),
 *   types (B, T) token type ids (NULL: all zeros).
 *   hidden_out[l] (B, T, C) float32, l = 0..L (0 = embeddings output); NULL = not wanted.
 *   pooled_out[l] (B, C) float32 pooled with `pooling`; NULL = not wanted.
 * With outputs_on_device = 0 the output pointers are host memory; with 1 they are memory
 * of the encoder's device from ft_encoder_device_alloc (the same thing on the CPU backend).
 * Returns when the outputs are complete. Thread-safe (one forward at a time per encoder). */
ft_status ft_encoder_forward(ft_encoder *enc, int64_t B, int64_t T,
                             const ft_index2d *ids, const ft_index2d *mask,
                             const ft_index2d *types,
                             float *const *hidden_out, float *const *pooled_out,
                             ft_pooling pooling, int outputs_on_device,
                             ft_cancel_fn cancel, void *cancel_arg);

/* Masks of a forward pass (significance analysis, fasttran.compress): components switched off for
 * one call, on the model as it is -- no copy of the weights. Every field may be NULL.
 *   skip_layers (num_layers): 1 = the layer is skipped (its output is its input);
 *   head_keep (sum of the layers' heads, layer after layer): 0 = the head's attention output is zero,
 *     as if its value projection and bias were zero (or its columns of the output projection);
 *   ffn_keep (per layer its intermediate width / ffn_group entries, layer after layer): 0 = the
 *     group's activations are zero, as if its rows of the first FFN projection and its biases were
 *     zero (GELU(0) = 0) or its columns of the second. ffn_group must divide every layer's width. */
typedef struct {
    const uint8_t *skip_layers;
    const uint8_t *head_keep;
    const uint8_t *ffn_keep;
    int64_t ffn_group;
    /* start_layer > 0: the forward starts from start_hidden (B, T, C), host float32, the output of
     * layer start_layer as ft_encoder_forward gives it (its real positions are read): the layers above
     * run from it (masks of the layers below are the caller's to have applied), and no output below
     * start_layer may be asked for. The CPU encoder's results are then the bits of a full forward. */
    int64_t start_layer;
    const float *start_hidden;
} ft_forward_masks;

/* ft_encoder_forward with masks (NULL: none) */
ft_status ft_encoder_forward_masked(ft_encoder *enc, int64_t B, int64_t T, const ft_index2d *ids,
                                    const ft_index2d *mask, const ft_index2d *types, float *const *hidden_out,
                                    float *const *pooled_out, ft_pooling pooling, int outputs_on_device,
                                    const ft_forward_masks *masks, ft_cancel_fn cancel, void *cancel_arg);

/* A compressed copy of an encoder (fasttran.compress): the layers, attention heads and FFN neurons
 * kept are copied into an encoder of that smaller structure (same device and dtype); every field may
 * be NULL (keep everything / keep src's modes).
 *   keep_layers (src layers), keep_heads (src's heads, layer after layer), keep_neurons (src's FFN
 *   neurons, layer after layer): 1 = kept;
 *   head_attention (src's heads): the ft_attention_mode of each kept head in the copy (EXACT or
 *   SIGN_MATCH), sign_match_keys its keys (0: src's);
 *   keep_tokens: the word-embedding rows kept (a pruned vocabulary, see ft_bert_config.vocab_map).
 * A kept layer must keep at least one head and one neuron, and at least one layer must be kept; a
 * spec that breaks this is refused (FT_ERR_INVALID_ARGUMENT) and nothing is created. */
typedef struct {
    const uint8_t *keep_layers, *keep_heads, *keep_neurons, *head_attention;
    int64_t sign_match_keys;
    /* keep_tokens (vocab_size) or NULL: the token ids whose word-embedding rows are kept (each one src
     * has a row of its own for); every other id reads unknown_token's row, which must be kept */
    const uint8_t *keep_tokens;
    int64_t unknown_token;
} ft_compress_spec;
ft_status ft_encoder_compress(const ft_encoder *src, const ft_compress_spec *spec, ft_encoder **out);

/* Memory on the encoder's device (host memory for the CPU backend), for device outputs.
 * Free it with ft_encoder_device_free on the same encoder, before ft_encoder_free. */
ft_device ft_encoder_device(const ft_encoder *enc);
ft_status ft_encoder_device_alloc(ft_encoder *enc, size_t bytes, void **out);
void ft_encoder_device_free(ft_encoder *enc, void *p);
/* Copy `bytes` from encoder device memory to the host (blocking). */
ft_status ft_encoder_device_read(ft_encoder *enc, void *host_dst, const void *src, size_t bytes);

/* Device memory services without an encoder: copy `bytes` at device address `src` to the host
 * (blocking), and the stream that copy is ordered on (so a DLPack producer can be asked to
 * make its data ready for it). For the CPU the copy is a memcpy and the stream 0. */
ft_status ft_device_read(ft_device dev, void *host_dst, const void *src, size_t bytes);
ft_status ft_device_stream(ft_device dev, uintptr_t *stream);

/* ---- files ---------------------------------------------------------------------------- */
typedef struct { const void *data; size_t bytes; } ft_chunk;

/* Write the chunks, in order, to `path` atomically: a temporary file in the same directory,
 * fsync, rename over `path`, fsync of the directory. Readers see the old file or the whole new
 * one, also after a crash; on failure `path` is untouched and no temporary file is left.
 * bytes_out / crc_out (may be NULL): size and CRC-32C of what was written. */
ft_status ft_atomic_write(const char *path, const ft_chunk *chunks, size_t n, uint64_t *bytes_out,
                          uint32_t *crc_out);

/* ---- safetensors ---------------------------------------------------------------------- */
typedef struct {
    const char *name;
    ft_dtype dtype;
    int ndim;
    int64_t shape[8];
    const void *data;   /* host memory, ft_dtype_size(dtype) * prod(shape) bytes */
} ft_st_tensor;

typedef struct { const char *key, *value; } ft_st_meta;   /* a __metadata__ entry (strings) */

/* Write tensors (in the given order, names distinct) and n_meta metadata strings into `path`
 * with ft_atomic_write; bytes_out / crc_out as there. */
ft_status ft_safetensors_write(const char *path, const ft_st_tensor *tensors, size_t n, const ft_st_meta *meta,
                               size_t n_meta, uint64_t *bytes_out, uint32_t *crc_out);

/* ---- activation cache ---------------------------------------------------------------------
 * Rows of C floats (one pooled vector per example, or one row per real token) stored in a
 * codec: F32 (exact), F16 / BF16 (round to nearest even), I8 with one float32 scale per row
 * (s = max|x| / 127, q = round(x / s)). */

/* Error of an encoding against its float32 input, accumulated over calls. */
typedef struct { double max_abs_err, sum_sq_err, sum_sq_ref; } ft_codec_error;

/* Encode n rows of C floats into `dst` with codec F32/F16/BF16/I8; I8 writes one scale per
 * row into `scales` (n). `err` (may be NULL) accumulates the error made. */
ft_status ft_cache_encode(void *dst, float *scales, ft_dtype codec, const float *src, int64_t n, int64_t C,
                          ft_codec_error *err);
/* dst (n, C) = decoded rows of src (n adjacent encoded rows; scales (n) for I8). */
void ft_cache_decode(float *dst, const void *src, const float *scales, ft_dtype codec, int64_t n, int64_t C);
/* CRC-32C of n bytes, continuing from `crc` (0 to start). */
uint32_t ft_crc32c(uint32_t crc, const void *data, size_t n);
/* out[i] (n) = fingerprint of example i's inputs (token ids tokens[offsets[i]..offsets[i+1]) and
 * their type ids): CRC-32C of the ids in the high half, of the types in the low half. */
void ft_input_fingerprints(const int32_t *tokens, const int32_t *types, const int64_t *offsets, int64_t n,
                           uint64_t *out);

/* The read side of a cache: which rows each example has and where they are (shards in host
 * memory or memory-mapped files), and the inputs to recompute the examples that are not
 * cached. Shards are registered by the owner of their memory, which keeps it alive. */
typedef struct ft_cache ft_cache;

typedef struct {
    int64_t examples;              /* N >= 1 */
    int64_t hidden;                /* C */
    ft_dtype codec;                /* F32, F16, BF16, I8 */
    int all_tokens;                /* 0: one pooled row per example; 1: one row per real token */
    const int64_t *example_ids;    /* (N) distinct */
    const int32_t *tokens, *types; /* (offsets[N]) every example's real tokens, for recomputing */
    const int64_t *offsets;        /* (N + 1) nondecreasing, offsets[0] = 0 */
    int64_t layer;                 /* encoder output the cache holds (0 = embeddings) */
    ft_pooling pooling;            /* CLS / MEAN when pooled, NONE for all tokens */
    int64_t recompute_batch;       /* uncached examples are recomputed in batches of at most this */
} ft_cache_config;

typedef struct {
    const char *name;              /* file name for messages (NULL: "host shard") */
    const int64_t *examples;       /* (n) example indices 0..N-1, none already in a shard */
    int64_t n;
    const void *values;            /* (rows, C) in the cache codec, the examples' rows one after another */
    const float *scales;           /* (rows) for I8, else NULL */
    int64_t rows;                  /* must equal the examples' row count */
    const void *file;              /* NULL, or the whole shard file: checked against crc32c */
    size_t file_bytes;             /*   before the first read of this shard                  */
    uint32_t crc32c;
    ft_device device;              /* where values are: the CPU (host memory, a file) or a CUDA
                                    * device (the device tier; scales stay in host memory, file
                                    * NULL). Every device shard of a cache is on one device. */
} ft_cache_shard;

/* Padded: (n, T, C) with T the batch's longest example, zero rows after each example's tokens.
 * Ragged: the examples' rows one after another, (sum of lengths, C). Pooled caches: (n, C). */
typedef enum { FT_CACHE_PADDED = 0, FT_CACHE_RAGGED = 1 } ft_cache_layout;

typedef struct {
    int64_t rows;                  /* rows of C floats the batch fills */
    int64_t T;                     /* longest example (padded all-token batches), else 1 */
    int64_t misses;                /* examples in the batch that are not cached */
} ft_cache_batch_info;

ft_status ft_cache_create(const ft_cache_config *cfg, ft_cache **out);   /* copies the arrays */
void ft_cache_free(ft_cache *c);
ft_status ft_cache_add_shard(ft_cache *c, const ft_cache_shard *shard);
/* index_out (n) = position of each example id; an unknown id fails with FT_ERR_OUT_OF_RANGE. */
ft_status ft_cache_lookup(const ft_cache *c, const int64_t *ids, int64_t n, int64_t *index_out);
/* Shape of the batch of examples index (n); fails when some are not cached and enc is NULL. */
ft_status ft_cache_batch_info_get(const ft_cache *c, const int64_t *index, int64_t n, ft_cache_layout layout,
                                  const ft_encoder *enc, ft_cache_batch_info *info);
/* One batch into dst (capacity floats) in memory of dst_device: cached rows decoded from
 * whatever tier holds them with `threads` threads (0: ft_num_threads()); uncached examples run
 * through `enc` padded to their longest, then through the codec, so they equal what the cache
 * would hold. A shard that fails its checksum fails with FT_ERR_FORMAT. A CUDA destination:
 * rows of device shards are decoded on the device (the backend's cache_decode_rows), the others
 * decoded on the host into pinned staging memory and copied up first; a host destination
 * with rows in device shards: the same into device memory, then one copy down. Returns when the
 * batch is complete. `cancel` as in ft_encoder_forward. Thread-safe; ft_cache_add_shard waits
 * for reads in flight. */
ft_status ft_cache_read(ft_cache *c, const int64_t *index, int64_t n, ft_cache_layout layout, float *dst,
                        ft_device dst_device, size_t capacity, ft_encoder *enc, int threads, ft_cancel_fn cancel,
                        void *cancel_arg);
/* The cache's examples (N), and their ids (N). */
int64_t ft_cache_examples(const ft_cache *c);
/* the rows example index i has: 1 (pooled), its tokens (all tokens); -1 outside 0..N-1 */
int64_t ft_cache_rows_of(const ft_cache *c, int64_t i);
const int64_t *ft_cache_ids(const ft_cache *c);
/* Rank `part` of `parts`'s slice of a global batch (the cache indices idx[0..gn)): positions
 * [*lo, *hi), contiguous, possibly empty; the slices of parts 0..parts-1 are the batch in order.
 * Balanced by cost, not count -- an example of n rows costs n (6 hidden + n), its dense layers'
 * products per row and its attention's per pair of rows -- because every rank waits for the
 * slowest at the gradient sums: equal example counts of ragged sentences leave one rank idle for
 * the length difference. Slice p starts at the position whose cost prefix is nearest p/parts of the
 * batch's (ties to the earlier); with rows all equal (one per example) the sizes are within one.
 * The reader's slices (ft_cache_reader parts) and the Trainer's C loop's are these. */
ft_status ft_cache_slice(const ft_cache *c, const int64_t *idx, int64_t gn, int64_t part, int64_t parts, int64_t *lo,
                         int64_t *hi);
/* FT_OK if every example can be read: cached, or enc given to recompute it; else the error a
 * read of the first one that cannot would give. */
ft_status ft_cache_check_readable(const ft_cache *c, const ft_encoder *enc);
/* Examples read from a tier (hits) and recomputed (misses) so far. */
void ft_cache_counters(const ft_cache *c, int64_t *hits, int64_t *misses);

/* A reader prepares the batches of one epoch on its own thread, at most `depth` ahead of the
 * consumer: order (n) example indices, cut into batches of batch_size (the last may be short).
 * Data parallelism: with parts > 1 each of those (global) batches delivers only its slice `part`
 * (0 <= part < parts): its positions [g part / parts, g (part + 1) / parts) for a global batch of
 * g examples -- contiguous, sizes within one of each other, empty when g < parts; every step is
 * delivered, empty or not, so readers of every part see the same number of batches. parts = 1:
 * whole batches. The cache (and enc) must outlive the reader. */
typedef struct ft_cache_reader ft_cache_reader;

typedef struct {
    float *values;                 /* (rows, C) in the reader's device memory, the batch's layout */
    const int64_t *index;          /* (n) the examples, in batch order */
    const int64_t *ids;            /* (n) their example ids (read by the thread with the batch) */
    int64_t n, rows, T;
    int64_t step;                  /* batch number within the reader's order */
    int64_t global_n;              /* examples in the global batch this slice is part of (parts = 1: n) */
    int64_t offset;                /* its first example's position in the global batch */
    int64_t global_rows;           /* the global batch's real rows (tokens with every token kept, else examples) */
    int64_t row_offset;            /* real rows of the global batch before this slice */
    int64_t global_T;              /* the global batch's longest example, in rows */
} ft_cache_batch;

/* device: where the batches are delivered (the CPU, or a CUDA device: then each buffer is device
 * memory, read as ft_cache_read does, with its own pinned staging, reused batch after batch). */
ft_status ft_cache_reader_start(ft_cache *c, const int64_t *order, int64_t n, int64_t batch_size, int64_t part,
                                int64_t parts, ft_cache_layout layout, int depth, ft_encoder *enc, int threads,
                                ft_device device, ft_cache_reader **out);
/* A shuffled epoch: the order is the first `keep` positions of ft_epoch_order(seed, N) (N the
 * cache's examples), batches starting at position `skip`. The shuffle runs on the reader's thread,
 * a batch ahead of the reads, so the consumer never waits for the whole permutation. */
ft_status ft_cache_reader_start_shuffled(ft_cache *c, uint64_t seed, int64_t keep, int64_t skip, int64_t batch_size,
                                         int64_t part, int64_t parts, ft_cache_layout layout, int depth,
                                         ft_encoder *enc, int threads, ft_device device, ft_cache_reader **out);
/* The epoch order of a shuffled epoch: a uniformly random permutation of 0..n-1 (Fisher-Yates,
 * position i drawn from counter-based random numbers keyed by (seed, i)), a pure function of
 * (seed, n) on every machine. */
ft_status ft_epoch_order(uint64_t seed, int64_t n, int64_t *out);
/* Wait up to timeout_ms (< 0: no limit) for the next batch: FT_OK with *out set, or *out NULL
 * at the end of the order (or when the wait timed out: then *timed_out = 1). A batch the thread
 * failed to read returns its error (and the reader stops). */
ft_status ft_cache_reader_next(ft_cache_reader *r, int timeout_ms, ft_cache_batch **out, int *timed_out);
/* Give a batch's memory back to its reader (it is reused for a later batch). Any thread. */
void ft_cache_batch_release(ft_cache_batch *b);
/* Ask the thread to stop (a recompute in flight is cancelled); the consumer then gets the end.
 * Any thread; the reader stays valid. */
void ft_cache_reader_stop(ft_cache_reader *r);
/* Stop the thread (a recompute in flight is cancelled), wait for it, and drop the reader;
 * batches not yet released stay valid until they are. */
void ft_cache_reader_close(ft_cache_reader *r);

/* ---- optimizers -------------------------------------------------------------------------- */
/* One fused step over a list of tensors, in place, on the device that holds them (all tensors of
 * one call on one device). LAMB (You et al. 2019) and AdamW (Loshchilov & Hutter), both with
 * optional bias correction and optional global gradient-norm clipping:
 *   g <- g * min(1, max_grad_norm / ||g||_global)            (max_grad_norm > 0)
 *   m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  m^ = m / (1 - b1^t);  v^ = v / (1 - b2^t)
 *   LAMB:  u = m^ / (sqrt(v^) + eps) + wd w;  phi = ||w|| / ||u|| (1 if either is 0);  w <- w - lr phi u
 *   AdamW: w <- w - lr wd w - lr m^ / (sqrt(v^) + eps)
 * lr, b1, b2, eps, wd and bias correction come from the tensor's parameter group; t is the
 * tensor's own update count (a tensor that sat steps out, as torch's optimizers do with a
 * parameter without a gradient, keeps its count). ||g||_global is taken over all tensors of
 * the call. Gradients are read only (a caller's .grad stays intact). With check_finite, a
 * non-finite gradient fails the call with FT_ERR_INVALID_ARGUMENT before anything is written. */
typedef enum { FT_OPT_ADAMW = 0, FT_OPT_LAMB = 1 } ft_optimizer;

/* The hyper-parameters of one parameter group. double, so that 1 - beta is exact before the
 * kernels round it to float (0.999f leaves 1 - beta2 off by 1e-5 relative, which v accumulates). */
typedef struct {
    double lr;             /* >= 0 (a schedule may reach 0) */
    double beta1, beta2;   /* [0, 1) */
    double eps;            /* > 0 */
    double weight_decay;   /* >= 0, for the group's tensors with decay != 0 */
    int bias_correction;
    double lr_scale;       /* > 0: ft_model_train_steps gives the group lr = the plan's lr x lr_scale (a
                            * layer's or the head's factor of the schedule; 1 for none). The step
                            * itself reads lr only. */
} ft_optim_group;

typedef struct {
    ft_optimizer kind;
    const ft_optim_group *groups;  /* num_groups entries, indexed by ft_optim_tensor.group */
    size_t num_groups;
    double max_grad_norm;  /* > 0: clip by the global gradient norm; <= 0: no clipping */
    int check_finite;      /* refuse non-finite gradients (costs one read of the gradients) */
} ft_optim_config;

typedef struct {
    float *param;          /* (n) float32 master weights, updated in place */
    const float *grad;     /* (n) */
    float *m, *v;          /* (n) moment estimates, updated in place */
    void *copy;            /* NULL, or (n) F16/BF16 model copy written from the new weights */
    ft_dtype copy_dtype;
    int64_t n;
    int64_t step;          /* t >= 1: the number of this tensor's update (bias correction) */
    int32_t group;         /* index into ft_optim_config.groups */
    int32_t decay;         /* 0: no weight decay (biases and LayerNorm by the caller's rule) */
} ft_optim_tensor;

typedef struct {
    double grad_norm;      /* global ||g|| before clipping (NaN when not computed) */
    double clip_scale;     /* the factor applied to the gradients (1 without clipping) */
    int kernel_launches;   /* CUDA kernels this step launched (0 on the CPU): fixed per configuration */
    int64_t bad_tensor;    /* a refused step: index of a tensor with a non-finite gradient (-1: not known) */
} ft_optim_info;

/* info may be NULL (on CUDA it then costs no host synchronisation). */
ft_status ft_optimizer_step(ft_device dev, const ft_optim_config *cfg, const ft_optim_tensor *tensors,
                            size_t count, ft_optim_info *info);

/* An optimizer's tensor table, built once for a parameter set: one contiguous ft_optim_tensor
 * array (what a backend uploads), and the moment estimates of all tensors in one allocation each
 * in the device's memory (zeroed; each tensor's slice starts on a 64-byte boundary). The caller
 * points param / grad of each entry, marks which tensors take part in the next step (those with
 * a gradient) and calls ft_optim_table_step; update counts are kept per tensor. */
typedef struct {
    ft_device device;
    size_t count;
    ft_optim_tensor *tensors;  /* (count) param, grad: set by the caller; m, v, n, group, decay: fixed */
    uint8_t *active;           /* (count) 1: the tensor takes part in the next step */
    int64_t *steps;            /* (count) updates done per tensor */
    float *steps_f32;          /* (count) the same counts as float32 (host memory; torch's state["step"]) */
    float *m, *v;              /* (total) moment estimates, device memory */
    int64_t total;             /* elements in m and in v (alignment padding included) */
    ft_optim_tensor *scratch;  /* (count) the active subset when some tensor sits a step out */
} ft_optim_table;

ft_status ft_optim_table_create(ft_device dev, size_t count, const int64_t *numel, const int32_t *group,
                                const int32_t *decay, ft_optim_table **out);
void ft_optim_table_free(ft_optim_table *table);
/* One step over the active tensors: each gets step = steps + 1; the counts advance only when the
 * step succeeds (a refused step writes nothing and counts nothing). info->bad_tensor is a table
 * index. No active tensor: nothing to do, FT_OK. */
ft_status ft_optim_table_step(ft_optim_table *table, const ft_optim_config *cfg, ft_optim_info *info);

/* ---- task heads ---------------------------------------------------------------------------- */
/* A task head turns the token states of a batch into its predictions, its loss and the gradient
 * back to the token states; what differs between tasks lives in the head (csrc/train/head_*.c),
 * so the training step itself (ft_model) knows no task. Parameters of a head live in one flat
 * float buffer; ft_head_tensor_info gives each tensor's name (Hugging Face's), shape and offset.
 *
 * Input rows are packed (as everywhere in fasttran): sequence b owns rows [first[b], first[b] +
 * count[b]) of x (N, C). Features pooled by the cache are one row per sequence (N == B).
 *   linear:  pooled (B, C) = mean (or CLS: first) row of each sequence, x itself when
 *                    every sequence has one row; logits (B, K) = dropout(pooled) W^T + b
 *   pooler:  h = tanh(dropout(pooled) W1^T + b1); logits = dropout(h) W^T + b (BERT's
 *                    pooler + classifier, W1 (C, C))
 *       loss FT_LOSS_XENT: softmax cross-entropy, int32 labels (B) in [0, K)
 *            FT_LOSS_MSE:  squared error, float targets (B, K) (regression)
 *            FT_LOSS_BCE:  binary cross-entropy per label on logits, float targets (B, K) in
 *                          [0, 1] (multi-label)
 *   token:   logits (N, K) = dropout(x) W^T + b for every row; softmax cross-entropy
 *                    against int32 labels (N), a negative label = the row takes no part
 *   qa:      logits (2, N) = W dropout(x)^T + b, each row's start and end score
 *                    (W (2, C)); per sequence a softmax over its rows with valid (N) != 0 (the
 *                    context); int32 labels (2, B): the answer's start and end row within the
 *                    sequence
 *   choice:  one score per sequence through the pooler (as "pooler" with K = 1); each run of
 *                    num_labels sequences is a question's choices: softmax cross-entropy over
 *                    them against int32 labels (B / num_labels)
 * The loss of a batch is the sum of its terms (ft_head_loss_count of them) times `scale`: the
 * caller passes 1 / the number of terms of the global batch (data-parallel training divides by
 * the global count). Dropout masks come from a counter-based hash of (seed, step, element),
 * recomputed in the backward pass, never stored; row_base / seq_base place the batch in its
 * global batch so a slice of it draws the global batch's masks. */
/* The kinds of head, declared once: X(NAME, code, "name", descriptor). The enum, the descriptor
 * table (csrc/train/head.c), the binding's HEAD_KINDS and the Python heads (fasttran/heads, by
 * name) all follow from this list; a new head is its own csrc/train/head_<name>.c defining the
 * descriptor (csrc/train/head.h) plus one line here. */
#define FT_HEAD_KINDS(X)                                  \
    X(LINEAR, 0, "linear", ft_head_linear)                \
    X(POOLER, 1, "pooler", ft_head_pooler)                \
    X(QA, 2, "qa", ft_head_span)                          \
    X(TOKEN, 3, "token", ft_head_token)                   \
    X(CHOICE, 4, "choice", ft_head_choice)
#define FT_HEAD_ENUM_(NAME, code, name, desc) FT_HEAD_##NAME = code,
typedef enum { FT_HEAD_KINDS(FT_HEAD_ENUM_) FT_HEAD_KIND_END_ } ft_head_kind;
#undef FT_HEAD_ENUM_
/* what a kind of head needs from a batch (ft_head_needs): */
enum {
    FT_HEAD_NEEDS_ROWS = 1,   /* every row of each sequence on the device (the sequence table), even
                                 when each sequence has one row */
    FT_HEAD_NEEDS_MASK = 2    /* the per-row mask `valid` (QA: the context rows) */
};
typedef enum { FT_LOSS_XENT = 0, FT_LOSS_MSE = 1, FT_LOSS_BCE = 2 } ft_head_loss;

/* The activations of a head's dense layer, declared once: X(NAME, code, "name", ft_activation).
 * BERT's pooler is tanh; DistilBERT's pre_classifier ReLU; ELECTRA's classification head and
 * ModernBERT's prediction head GELU (exact, erf). */
#define FT_HEAD_ACTS(X)                            \
    X(TANH, 0, "tanh", FT_ACT_TANH)                \
    X(RELU, 1, "relu", FT_ACT_RELU)                \
    X(GELU, 2, "gelu", FT_ACT_GELU_ERF)
#define FT_HEAD_ACT_ENUM_(NAME, code, name, act) FT_HEAD_ACT_##NAME = code,
typedef enum { FT_HEAD_ACTS(FT_HEAD_ACT_ENUM_) FT_HEAD_ACT_END_ } ft_head_act;
#undef FT_HEAD_ACT_ENUM_
/* the LayerNorm after a head's dense layer (ModernBERT's prediction head) */
typedef enum { FT_HEAD_NORM_NONE = 0, FT_HEAD_NORM_LN = 1, FT_HEAD_NORM_LN_BIAS = 2 } ft_head_norm;

typedef struct {
    ft_head_kind kind;
    int64_t hidden;        /* C */
    int64_t num_labels;    /* K (QA: 2; regression: the number of scores, usually 1) */
    float dropout;         /* probability, [0, 1) */
    ft_head_loss loss;     /* LINEAR / POOLER: XENT, MSE or BCE; TOKEN and QA: XENT */
    ft_pooling pooling;    /* LINEAR / POOLER over several rows per sequence: FT_POOL_MEAN or _CLS */
    /* The dense layer before the classifier (POOLER and CHOICE always; TOKEN and QA when `dense`,
     * on every row): h = act(in W1^T [+ b1]) [then LayerNorm(h) with gamma [and beta], norm_eps].
     * All zero is BERT's pooler: tanh, with a bias, no LayerNorm. */
    ft_head_act act;
    int no_dense_bias;     /* 1: the dense layer has no bias (ModernBERT's classifier_bias false) */
    ft_head_norm norm;
    float norm_eps;        /* > 0 with a norm */
    int dense;             /* TOKEN / QA: 1 runs the dense layer on every row (ModernBERT's head) */
    int dense_input_dropout; /* with a dense layer: 1 drops its input too (RoBERTa's and ELECTRA's
                              * classification heads), 0 only its output (BERT's pooler, DistilBERT's
                              * pre_classifier, ModernBERT's head); without one the classifier's input drops */
} ft_head_config;
/* the activation's name ("tanh", ...), NULL for none */
const char *ft_head_act_name(int act);

/* A batch as a head sees it. */
typedef struct {
    int64_t B, N;               /* sequences; rows of x */
    const int32_t *seqs;        /* HOST (2, B): the first row of each sequence, then its row count */
    const int32_t *seqs_dev;    /* the same table in the backend's memory (pooling, spans) */
    uint64_t row_base, seq_base;/* the batch's first row and sequence within its global batch */
} ft_head_batch;

ft_status ft_head_check(const ft_head_config *cfg);
size_t ft_head_num_tensors(const ft_head_config *cfg);
ft_status ft_head_tensor_info(const ft_head_config *cfg, size_t i, const char **name, int *ndim,
                              int64_t shape[2], size_t *offset);
size_t ft_head_param_count(const ft_head_config *cfg);
/* element counts of a batch's buffers: logits; loss terms; targets (int32, or float32 when
 * ft_head_float_targets) */
int64_t ft_head_logits_count(const ft_head_config *cfg, int64_t B, int64_t N);
int64_t ft_head_loss_count(const ft_head_config *cfg, int64_t B, int64_t N);
int64_t ft_head_target_count(const ft_head_config *cfg, int64_t B, int64_t N);
int ft_head_float_targets(const ft_head_config *cfg);
/* FT_HEAD_NEEDS_* flags of the head's kind (0 for an unknown kind) */
unsigned ft_head_needs(const ft_head_config *cfg);
/* the kind's name ("linear", "qa", ...), NULL for no such kind */
const char *ft_head_kind_name(int kind);
/* floats of the workspace a step takes */
size_t ft_head_workspace_floats(const ft_head_config *cfg, int64_t B, int64_t N, int has_grads, int has_dx,
                                int training);

/* Forward (and, with targets, the loss terms; with grads also the backward) over a batch, every
 * buffer in the memory of `dev`:
 *   x (N, C); valid (N) for QA; targets (ft_head_target_count, int32 or float32) or NULL;
 *   logits out (ft_head_logits_count); loss out (ft_head_loss_count) per-term losses, or NULL;
 *   grads out: like params (overwritten), or NULL; dx out: like x (overwritten), or NULL.
 * training != 0 applies dropout. check != 0 first checks the targets on a host copy (labels in
 * range, QA spans inside their sequence's context, float targets finite, multi-label targets in
 * [0, 1]: FT_ERR_OUT_OF_RANGE / FT_ERR_INVALID_ARGUMENT); check = 0 is for callers that checked
 * every target already (the Trainer does, once per fit): out-of-range labels are then undefined
 * behaviour. workspace: memory of `dev` with ft_head_workspace_floats, or NULL (one allocation). */
ft_status ft_head_step(ft_device dev, const ft_head_config *cfg, const float *params, const float *x,
                       const ft_head_batch *bt, const void *targets, const float *valid, float *logits,
                       float *loss, float *grads, float *dx, float scale, int training, uint64_t seed,
                       uint64_t step, float *workspace, size_t workspace_floats, int check);

/* Memory on a device without an encoder (host memory for the CPU): optimizer state, head
 * buffers. Free with ft_device_free on the same device. */
ft_status ft_device_alloc(ft_device dev, size_t bytes, void **out);
void ft_device_free(ft_device dev, void *p);
ft_status ft_device_write(ft_device dev, void *dst, const void *host_src, size_t bytes);

/* ---- fine-tuning the top layers of an encoder ------------------------------------------------ */
/* Training options of encoder layers: dropout, and Tempo's three memory savings (Andoorveedu et al.
 * 2022), each switchable and each leaving the gradients unchanged up to fp32 rounding:
 *   inplace_gelu: keep the GELU output and one branch bit per element, not its input;
 *   inplace_layernorm: the LayerNorm backward works from its output and statistics, not its input;
 *   recompute_attention_dropout: the attention-dropout mask is regenerated in the backward pass from
 *   the counter-based generator, never stored.
 * And FlashAttention's (Dao et al. 2022), which Tempo's paper leaves out:
 *   recompute_attention_probs: the attention probabilities (NH n^2 floats per sequence) are not
 *   kept; each row's softmax maximum and 1/sum are (2 floats per row and head), and the backward
 *   recomputes the probabilities from Q and K. */
typedef struct {
    float hidden_dropout, attention_dropout;
    int inplace_gelu, inplace_layernorm, recompute_attention_dropout, recompute_attention_probs;
    /* the products (forward and backward) of the projections (backend op gemm_prec) and of
     * attention (attention_train_forward / attention_backward's prec): FT_F32, or FT_BF16 / FT_F16
     * (mixed precision: float32 storage, master weights and sums; half-precision products on
     * tensor cores; softmax, its statistics and dropout in float32). */
    ft_dtype matmul_precision;
    /* dropout on the stack's input x in training (0: none): where the stack starts at layer 0 and x
     * is the embeddings' output, the dropout BERT applies after the embeddings' LayerNorm */
    float input_dropout;
    /* the embeddings trained too (the stack must start at layer 0): their tables and LayerNorm come
     * first in the parameters, inside layer 0's range, and the stack's input is token ids
     * (ft_layer_stack_set_tokens), not x -- what transformers trains when it fine-tunes every layer.
     * Not for an embeddings' projection (ELECTRA-small: embedding_size != hidden_size). */
    int train_embeddings;
} ft_layer_options;

/* kinds of saved activations (ft_layer_memory.activations), names in ft_layer_act_kind_names */
#define FT_LAYER_ACT_KINDS 11
extern const char *const ft_layer_act_kind_names[FT_LAYER_ACT_KINDS];

typedef struct {
    size_t weights, gradients;                   /* the trained layers' parameters and gradients */
    size_t activations[FT_LAYER_ACT_KINDS];      /* kept from forward to backward, all layers */
    size_t workspace;                            /* per-step buffers */
} ft_layer_memory;

typedef struct ft_layer_stack ft_layer_stack;

/* A trainable copy of encoder layers [first, first + count) (fp32 master weights) on `dev`, with
 * their gradients and the activation arena, each one allocation. extra_floats: room after the
 * layers in the parameter and gradient allocations for the caller's own tensors (ft_model puts
 * its task head there, so that layers and head are one flat table); 0 for none. shared_grads
 * (CPU): the gradient allocation in host memory the other processes of this machine can map
 * (data-parallel ranks sum their tables in place, csrc/dist/host_sum.c; plain memory where the
 * OS refuses); 0: the backend's memory. */
ft_status ft_layer_stack_create(const ft_encoder *enc, int64_t first, int64_t count, ft_device dev,
                                const ft_layer_options *opt, size_t extra_floats, int shared_grads,
                                ft_layer_stack **out);
void ft_layer_stack_free(ft_layer_stack *s);
size_t ft_layer_stack_param_count(const ft_layer_stack *s);            /* floats */
int64_t ft_layer_stack_count(const ft_layer_stack *s);                 /* layers */
size_t ft_layer_stack_extra_floats(const ft_layer_stack *s);           /* room after the layers */
/* where layer l (0 = the bottom one of the stack) lies in the parameter / gradient buffers */
void ft_layer_stack_layer_range(const ft_layer_stack *s, int64_t l, size_t *offset, size_t *floats);
size_t ft_layer_stack_num_tensors(const ft_layer_stack *s);
ft_status ft_layer_stack_tensor_info(const ft_layer_stack *s, size_t i, const char **name, int *ndim,
                                     int64_t shape[2], size_t *offset); /* offset in floats */
float *ft_layer_stack_params(ft_layer_stack *s);                       /* device memory */
float *ft_layer_stack_grads(ft_layer_stack *s);                        /* device memory */
/* out (N, C) = the layers applied to x (N, C): B sequences of lengths[b] rows packed one after
 * another (lengths: host memory), x and out in the stack's device memory. training != 0 keeps what
 * the backward needs (x must stay valid until then) and applies dropout (input_dropout on x, then
 * each layer's) with masks from (seed, step, layer, site), element indices counted from where the
 * batch starts in its global batch: row_base rows and sq_base = the sum of n^2 over the sequences before it (hidden states from
 * row_base C, attention probabilities from NH sq_base), so that a
 * slice of a global batch draws the masks the whole batch would (data-parallel training); 0, 0
 * for a whole batch. */
ft_status ft_layer_stack_forward(ft_layer_stack *s, const float *x, const int32_t *lengths, int64_t B, float *out,
                                 int training, uint64_t seed, uint64_t step, uint64_t row_base, uint64_t sq_base);
/* With train_embeddings: the next forward's rows as tokens (host memory, N each, in x's packed
 * order): ids in [0, vocab_size) and types (NULL: 0) in [0, type_vocab_size) (0 without a type
 * table); checked here, positions taken from the rows' places in their sequences as the encoder
 * takes them. The forward then takes x NULL and uses them once: set them before every forward. */
ft_status ft_layer_stack_set_tokens(ft_layer_stack *s, const int32_t *ids, const int32_t *types, int64_t N);
/* After a training forward: the gradients (overwritten) from dout (N, C); dx (N, C) or NULL.
 * loss_scale != 1 (float16 mixed precision's loss scaling, a power of two): the backward runs on
 * dout * loss_scale, so that small gradients survive fp16 products, and each layer's gradients
 * (and dx) are scaled back by 1 / loss_scale; an overflow shows as non-finite gradients.
 * done (or NULL): called with the layer's index in the stack (count - 1 first) as soon as that
 * layer's gradients are final and complete in memory (the backend synchronised), while the
 * layers below still run: data-parallel training starts reducing them there. */
typedef void (*ft_layer_done_fn)(void *arg, int64_t layer);
ft_status ft_layer_stack_backward(ft_layer_stack *s, const float *dout, float *dx, float loss_scale,
                                  ft_layer_done_fn done, void *arg);
int64_t ft_layer_stack_hidden_size(const ft_layer_stack *s);
/* the sequences (B) and rows (N) of the last forward */
void ft_layer_stack_last_batch(const ft_layer_stack *s, int64_t *B, int64_t *N);
/* pooled (B, C) = per sequence of the last forward, the mean of its rows of h (N, C), or its
 * first row (cls != 0); and the backward: dh (N, C) from dpooled (B, C). Device memory. */
ft_status ft_layer_stack_pool(ft_layer_stack *s, const float *h, int cls, float *pooled);
ft_status ft_layer_stack_pool_backward(ft_layer_stack *s, const float *dpooled, int cls, float *dh);
/* what a training step over B sequences of T tokens holds (bytes) under the stack's options, or
 * (opt not NULL) under others (its memory options: another configuration's report, nothing
 * allocated); and the bytes the stack has allocated now and at most so far */
ft_status ft_layer_stack_memory(const ft_layer_stack *s, const ft_layer_options *opt, int64_t B, int64_t T,
                                ft_layer_memory *m);
/* the options the stack was made with */
void ft_layer_stack_options(const ft_layer_stack *s, ft_layer_options *out);
void ft_layer_stack_allocated(const ft_layer_stack *s, size_t *now, size_t *peak);
/* the stack's weights written back into the encoder's layers [first, first + count) (same config) */
ft_status ft_layer_stack_export(ft_layer_stack *s, ft_encoder *enc);
/* First-order significance (fasttran.compress; Michel et al. 2019, Molchanov et al. 2019): with
 * ffn_group > 0 (dividing every layer's FFN width) each later backward also records, per sequence of
 * its batch, the derivative of the loss with respect to a gate on each component at 1 -- the sum
 * over the sequence's rows of
 *   head h of layer l:  dL/dctx_h . ctx_h        (its attention output, before the output projection)
 *   FFN group g:        dL/dact_g . act_g        (its activations, after GELU)
 *   layer l:            dL/dout_l . (out_l - x_l) (its residual branch: 0 = the layer skipped)
 * ffn_group 0 turns it off. The stack's layers must not be sign-matching ones (refused at creation). */
ft_status ft_layer_stack_set_significance(ft_layer_stack *s, int64_t ffn_group);
/* After such a backward over B sequences: heads (B, sum of the stack's heads), ffn (B, its groups),
 * layers (B, count), host memory, layers in stack order (NULL: not wanted). */
ft_status ft_layer_stack_significance(ft_layer_stack *s, float *heads, float *ffn, float *layers);
/* the heads and FFN width of the stack's layer i (0 <= i < ft_layer_stack_count) */
void ft_layer_stack_layer_shape(const ft_layer_stack *s, int64_t i, int64_t *heads, int64_t *intermediate);

/* ---- the training model ------------------------------------------------------------------ */
/* [frozen features] -> [top layers, optional] -> task head: one forward / backward over a batch,
 * one flat parameter and gradient table (the layers' tensors, bottom layer first, then the
 * head's), on any backend. It knows no task (the head does) and no device (the backend does).
 * The gradient table is handed out in buckets as the backward completes them, head first, then
 * the top layer, down to the bottom one: data-parallel training reduces a bucket while the
 * layers below it still run. */
typedef struct ft_model ft_model;

/* layers: NULL (a head on frozen features), or a stack made with extra_floats =
 * ft_head_param_count(head) whose allocations then hold the head too; borrowed: it must outlive
 * the model. The head's parameters start at zero (write them with ft_model_write_params).
 * shared_grads: the model's own gradient table (no layers) in shared host memory, as
 * ft_layer_stack_create's; with layers the stack's table is the model's and was placed by it. */
ft_status ft_model_create(ft_device dev, const ft_head_config *head, ft_layer_stack *layers, int shared_grads,
                          ft_model **out);
void ft_model_free(ft_model *m);
size_t ft_model_param_count(const ft_model *m);
float *ft_model_params(ft_model *m);   /* backend memory, ft_model_param_count floats */
float *ft_model_grads(ft_model *m);
/* the head's parameters start here in the flat table */
size_t ft_model_head_offset(const ft_model *m);
/* the model's head, and the device of its memory */
const ft_head_config *ft_model_head(const ft_model *m);
ft_device ft_model_device(const ft_model *m);
/* buckets: 0 = the head, 1 = the top layer, ..., count = the bottom layer */
size_t ft_model_num_buckets(const ft_model *m);
void ft_model_bucket(const ft_model *m, size_t i, size_t *offset, size_t *floats);
/* host <-> the flat parameter table, floats [offset, offset + n) */
ft_status ft_model_write_params(ft_model *m, size_t offset, const float *host, size_t n);
ft_status ft_model_read_params(ft_model *m, size_t offset, float *host, size_t n);
/* every gradient 0 (a process's empty slice of a global batch still takes part in the reduction) */
ft_status ft_model_zero_grads(ft_model *m);

typedef struct {
    const float *x;              /* (N, C) backend memory: packed sequences, or pooled features (N = B) */
    const int32_t *lengths;      /* HOST (B): rows per sequence (1 for pooled features) */
    int64_t B;
    const void *targets;         /* HOST, ft_head_target_count elements (int32 / float32), or NULL */
    const float *valid;          /* HOST (N): QA's context rows, else NULL */
    double denominator;          /* the loss is the sum of its terms / denominator (the global batch's
                                    count of terms: its mean over every rank's slice) */
    uint64_t seed, step;         /* dropout keys */
    uint64_t row_base, seq_base, sq_base;   /* the batch's place in its global batch: rows, sequences
                                    and sum of n^2 before it (0 for a whole batch) */
    float loss_scale;            /* float16 products' loss scaling (1: none) */
    /* layers that train the embeddings (ft_layer_options.train_embeddings) take the rows as tokens:
     * x NULL, ids and types (NULL: 0) HOST (N) in x's packed order (ft_layer_stack_set_tokens) */
    const int32_t *ids, *types;
} ft_model_batch;

/* called with a bucket's index once its gradients are final and complete in memory */
typedef void (*ft_bucket_fn)(void *arg, size_t bucket);

/* per-batch buffers for batches of up to B sequences and N rows, made now (grown, never shrunk;
 * a step makes what it lacks) */
ft_status ft_model_reserve(ft_model *m, int64_t B, int64_t N);
/* One training step: forward with dropout, the loss (host: the batch's terms / denominator),
 * the gradients of every parameter (overwritten), `ready` per bucket; logits_host (or NULL):
 * ft_head_logits_count floats. Targets are not checked here (the caller checked them all). */
ft_status ft_model_step(ft_model *m, const ft_model_batch *b, double *loss, float *logits_host, ft_bucket_fn ready,
                        void *arg);
/* A step without examples (a process's empty slice of an uneven last global batch): every gradient
 * 0, and each bucket still handed to `ready` (or NULL), so the ranks' reductions pair up. The one
 * definition of it: the C loop and Model.idle both call it. */
ft_status ft_model_idle(ft_model *m, ft_bucket_fn ready, void *arg);
/* Inference: logits_host = the model's logits (no dropout, nothing kept for a backward) */
ft_status ft_model_forward(ft_model *m, const ft_model_batch *b, float *logits_host);
/* bytes the model holds: parameters + gradients (the layers' too) and its per-batch buffers */
size_t ft_model_allocated(const ft_model *m);

/* float16 products' dynamic loss scaling (torch.amp.GradScaler's rule, as the Trainer applies it):
 * the backward runs at `scale`; a step whose gradients are not finite while scale > 1 is skipped
 * and halves it; `growth` clean steps in a row double it, up to `max`. scale 0: no scaling. */
typedef struct {
    double scale, max;
    int64_t good;                /* clean steps since the scale last changed */
    int64_t growth;
    int64_t skipped;             /* steps skipped so far */
} ft_loss_scaler;

/* A gradient reduction between a step's backward and its optimizer step (data-parallel training),
 * as the per-step loop's reduction hook calls it: begin(ctx, step) before the model step (step: the
 * global step number), ready(ctx, bucket) as the backward finishes each gradient bucket (the head,
 * then the top layer down), finish(ctx, loss, &total) after it: every bucket holds the ranks' sum,
 * *total the ranks' losses summed -- the global batch's loss. ready cannot fail: it keeps its
 * error for finish. Implementations: the shared-memory host sum (dist/host_sum.h:
 * ft_host_sum_reduction, in C) and the Python binding's callbacks (a transport that only exists in
 * Python, called with the GIL). */
typedef struct {
    ft_status (*begin)(void *ctx, uint64_t step);
    ft_bucket_fn ready;
    ft_status (*finish)(void *ctx, double loss, double *total);
    void *ctx;
} ft_train_reduction;

/* Many training steps in one call (csrc/train/loop.c): per step k of the plan, the batch of
 * examples [examples[k], examples[k + 1]) -- their rows packed one after another in x, `lengths`
 * rows each, or read per step from `cache` --, its targets (the steps' targets one after another,
 * ft_head_target_count each), the loss denominator denominator[k], then ft_model_step (dropout keys
 * seed, first_step + k; a whole batch: no place in a global one; the scaler's loss scale) and
 * ft_optim_table_step over every tensor of `opt` at lr[k] (each group's lr; the rest of cfg as
 * given), a refusal for non-finite gradients under loss scaling being a skipped step. The steps
 * stop early, with FT_OK, at a non-finite loss (the step is not applied), at a refused optimizer
 * step, or when the callback
 * (called after step k when (phase + k + 1) % every == 0, and after the last) returns non-zero. */
typedef struct {
    int64_t steps;
    const float *x;              /* every step's rows, the model's device memory */
    const int32_t *lengths;      /* HOST: rows per example, every step's examples */
    const int64_t *examples;     /* HOST (steps + 1): the first example of each step; [0] = 0 */
    const void *targets;         /* HOST: every step's targets (int32 / float32 as the head takes) */
    const double *denominator;   /* HOST (steps): the loss terms of each step's batch */
    const double *lr;            /* HOST (steps): each step's learning rate */
    uint64_t seed, first_step;   /* dropout keys: seed, and the global step number of step 0 */
    /* or, x NULL: each step's rows read from `cache` straight into a buffer of the model's memory
     * (ft_cache_read: rows of the device tier gathered and decoded on the device by the backend's
     * cache_decode_rows, no host round trip; host rows decoded on the host); every example cached,
     * lengths[i] = ft_cache_rows_of(cache, index[i]); rows packed (FT_CACHE_RAGGED) */
    ft_cache *cache;
    const int64_t *index;        /* HOST: the cache index of every step's examples, in order */
    const float *valid;          /* HOST: every step's row mask one after another (a row per row: QA's
                                    context rows), for a head that needs one; else NULL */
    ft_loss_scaler scaler;       /* at step 0 (scale 0: none) */
    /* data-parallel: each step is this rank's slice of a global batch -- place[3k..3k+2] its rows,
     * sequences and sum of n^2 before it in the global batch (dropout keys; NULL: whole batches),
     * denominator[k] the global batch's loss terms -- and `reduction` (NULL: none) runs between each
     * step's backward and its optimizer step; a slice may be empty (no examples: zero gradients, every
     * bucket still handed over, loss 0), and the loss checked and reported is the reduction's total */
    const int64_t *place;
    const ft_train_reduction *reduction;
    /* or, x and cache NULL: layers that train the embeddings, every step's rows as token ids and
     * types (NULL: 0), HOST, one step after another (ft_model_batch's ids / types) */
    const int32_t *ids, *types;
} ft_train_plan;

typedef enum {
    FT_TRAIN_DONE = 0,           /* every step of the plan ran */
    FT_TRAIN_NONFINITE_LOSS = 1, /* step `done`'s loss is not finite: nothing of it applied */
    FT_TRAIN_REFUSED = 2,        /* the optimizer refused step `done` (the message: ft_last_error) */
    FT_TRAIN_STOPPED = 3         /* the callback asked to stop after `done` steps */
} ft_train_stop;

typedef struct {
    double *loss;                /* HOST (steps): each step's loss (out) */
    float *logits;               /* HOST: each step's logits one after another (ft_head_logits_count), or NULL */
    int64_t done;                /* steps applied */
    ft_train_stop stop;
    ft_optim_info info;          /* of the last optimizer step (the refused one's after a refusal) */
    ft_loss_scaler scaler;       /* after the steps applied or skipped */
} ft_train_result;

/* non-zero: stop after the `done` steps applied */
typedef int (*ft_train_callback)(void *arg, int64_t done);
ft_status ft_model_train_steps(ft_model *m, ft_optim_table *opt, const ft_optim_config *cfg,
                               const ft_train_plan *plan, int64_t every, int64_t phase, ft_train_callback cb, void *arg,
                               ft_train_result *out);

/* ---- build and runtime information ------------------------------------------------------ */
const char *ft_blas_name(void);          /* "OpenBLAS 0.3.x ... (core)"  */
int ft_num_threads(void);               /* threads of the CPU backend (see core/threads.c) */
void ft_set_num_threads(int n);
int ft_default_threads(void);           /* FASTTRAN_NUM_THREADS, OMP_NUM_THREADS, else ft_cpu_count() */
int ft_cpu_count(void);                 /* CPUs this process may use: its affinity mask capped by a cgroup CPU quota */
const char *ft_cpu_isa(void);           /* CPU kernels in use: "amx", "avx512", "avx2" or "generic" */
/* The CPU features fasttran's kernels may use in this process: the CPU's (CPUID, and the OS's
 * permission for AVX-512 and AMX state), restricted by FASTTRAN_CPU_ISA to a level's set. Bits: */
enum {
    FT_CPU_AVX2 = 1 << 0,         /* AVX2 + FMA */
    FT_CPU_AVX512 = 1 << 1,       /* AVX-512 F, BW, DQ, VL (Skylake-X's set) */
    FT_CPU_AVX512_VNNI = 1 << 2,  /* vpdpbusd on zmm (Cascade Lake, Ice Lake, Zen 4) */
    FT_CPU_AVX_VNNI = 1 << 3,     /* vpdpbusd on ymm, VEX-encoded (Alder Lake, Sapphire Rapids) */
    FT_CPU_AVX512_BF16 = 1 << 4,  /* vdpbf16ps (Cooper Lake, Sapphire Rapids, Zen 4) */
    FT_CPU_AMX_BF16 = 1 << 5,     /* AMX tiles with bf16 products, tile state granted by the OS */
    FT_CPU_AMX_INT8 = 1 << 6      /* AMX tiles with int8 products (tdpbusd), tile state granted */
};
#define FT_CPU_FEATURE_COUNT 7
unsigned ft_cpu_features(void);
/* the name of feature bit k (0 <= k < FT_CPU_FEATURE_COUNT): "avx2", "avx512", "avx512_vnni", ... */
const char *ft_cpu_feature_name(int k);
/* the features this CPU has, whatever FASTTRAN_CPU_ISA says */
unsigned ft_cpu_features_present(void);
/* the kernels of the reduced-precision linear layers (cpu/lowp.h): int8 ("amx_int8", "avx512_vnni",
 * "avx_vnni", "avx512bw", "avx2" or "generic": exact int32 sums on every one) and whether the
 * encoder uses them (int8_used = 0: slower than float32 on this CPU, int8 weights are dequantized
 * into float32 panels instead); bf16 ("avx512_bf16", or NULL: no bf16 products on this CPU) */
const char *ft_cpu_int8_kernel(int *int8_used);
const char *ft_cpu_bf16_kernel(void);
int ft_cuda_compiled(void);              /* the CUDA backend library (nvcc) is installed */
int ft_cuda_emulated(void);              /* FASTTRAN_CUDA_EMU is set and the emulated backend is installed */
/* Try to load the CUDA backend; returns FT_OK and the device count, or an error saying why. */
ft_status ft_cuda_probe(int *device_count, char *desc, size_t desc_len);

#ifdef __cplusplus
}
#endif
#endif
