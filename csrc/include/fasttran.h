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
typedef enum { FT_ACT_GELU_ERF = 0, FT_ACT_GELU_TANH = 1, FT_ACT_RELU = 2 } ft_activation;

typedef struct {
    int64_t vocab_size;
    int64_t hidden_size;          /* C */
    int64_t num_layers;           /* L */
    int64_t num_heads;            /* NH, C % NH == 0 */
    int64_t intermediate_size;    /* I */
    int64_t max_position_embeddings;
    int64_t type_vocab_size;
    float layer_norm_eps;
    ft_activation activation;
    int64_t pad_token_id;
} ft_bert_config;

typedef enum { FT_POOL_NONE = 0, FT_POOL_CLS = 1, FT_POOL_MEAN = 2 } ft_pooling;

typedef struct ft_encoder ft_encoder;

/* Cancel callback: called between layers; return non-zero to stop with FT_ERR_INTERRUPTED. */
typedef int (*ft_cancel_fn)(void *arg);

ft_status ft_encoder_create(const ft_bert_config *cfg, ft_device device, ft_encoder **out);
void ft_encoder_free(ft_encoder *enc);
const ft_bert_config *ft_encoder_config(const ft_encoder *enc);
int ft_encoder_has_pooler(const ft_encoder *enc);
size_t ft_encoder_param_count(const ft_encoder *enc);   /* float elements */
size_t ft_encoder_workspace_bytes(const ft_encoder *enc);

/* Load weights from a safetensors file. `prefix` is stripped from tensor names ("" or
 * "bert."); pass NULL to detect it. Every tensor of the model must be present with the right
 * shape; F32/F16/BF16 are converted to the parameter dtype. */
ft_status ft_encoder_load_safetensors(ft_encoder *enc, const char *path, const char *prefix);
/* Copy all weights of `src` into `dst` (same config, any devices): Encoder.to(device). */
ft_status ft_encoder_copy_weights(ft_encoder *dst, const ft_encoder *src);
/* Write the weights as a Hugging Face BertModel safetensors file (atomic: temp + rename). */
ft_status ft_encoder_save_safetensors(const ft_encoder *enc, const char *path, ft_dtype dtype);

/* Named parameter views, in a fixed order (Hugging Face names, no prefix). */
size_t ft_encoder_num_tensors(const ft_encoder *enc);
ft_status ft_encoder_tensor_info(const ft_encoder *enc, size_t i, const char **name,
                                 int *ndim, int64_t shape[2], float **host_data);

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

/* ---- safetensors ---------------------------------------------------------------------- */
typedef struct {
    const char *name;
    ft_dtype dtype;
    int ndim;
    int64_t shape[8];
    const void *data;   /* host memory, ft_dtype_size(dtype) * prod(shape) bytes */
} ft_st_tensor;

/* Write tensors into `path` atomically (temp file in the same directory, fsync, rename). */
ft_status ft_safetensors_write(const char *path, const ft_st_tensor *tensors, size_t n,
                               const char *metadata_json /* NULL or a JSON object of strings */);

/* ---- activation cache codecs ------------------------------------------------------------- */
/* Error of an encoding against its float32 input, accumulated over calls. */
typedef struct { double max_abs_err, sum_sq_err, sum_sq_ref; } ft_codec_error;

/* Encode n rows of C floats into `dst` with codec F32/F16/BF16/I8; I8 writes one scale per
 * row into `scales` (n). `err` (may be NULL) accumulates the error made. */
ft_status ft_cache_encode(void *dst, float *scales, ft_dtype codec, const float *src, int64_t n, int64_t C,
                          ft_codec_error *err);
/* dst row k (n, C) = decoded row at src[k] (scale scales[k] for I8); NULL src[k] = zeros. */
ft_status ft_cache_gather(float *dst, int64_t n, int64_t C, ft_dtype codec, const void *const *src,
                          const float *scales);
/* CRC-32C of n bytes, continuing from `crc` (0 to start). */
uint32_t ft_crc32c(uint32_t crc, const void *data, size_t n);

/* ---- build and runtime information ------------------------------------------------------ */
const char *ft_blas_name(void);          /* "OpenBLAS 0.3.x ... (core)"  */
int ft_num_threads(void);
void ft_set_num_threads(int n);
int ft_cuda_compiled(void);              /* CUDA backend library was built */
/* Try to load the CUDA backend; returns FT_OK and the device count, or an error saying why. */
ft_status ft_cuda_probe(int *device_count, char *desc, size_t desc_len);

#ifdef __cplusplus
}
#endif
#endif
