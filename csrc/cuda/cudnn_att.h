/* Attention through cuDNN's fused scaled-dot-product attention (cudnn_att.cpp), behind a C
 * interface. cudnn_att.cpp is host C++17 over cudnn-frontend (header-only); it is built into its
 * own library, fasttran/libfasttran_cudnn.so, linked to libcudnn.so.9 from the nvidia-cudnn-cu13
 * wheel, which the CUDA backend opens at run time (attention_cudnn.cu): a missing wheel, no GPU or
 * a configuration cuDNN refuses leaves the backend on its own kernels.
 *
 * Layout: the packed rows of a batch, padding-free (THD). qkv holds T rows of [3, H, D] values
 * (Q, K, V at columns 0, H D, 2 H D of a row), o T rows of [H, D], stats T rows of H floats (the
 * natural-log log-sum-exp of each query row's scaled scores, per head). Sequence b's queries are
 * rows [first[b], first[b] + q_len[b]) and its keys the first kv_len[b] of those rows (kv_len <=
 * q_len): cuDNN's seq_len_q / seq_len_kv padding masks, never a bias mask. Every length must be at
 * least 1 (refused before any cuDNN call). Products in bf16 or fp16 with float32 sums and softmax.
 *
 * Every function returns 0 or a nonzero status with a message in err (err_len bytes). */
#ifndef FT_CUDNN_ATT_H
#define FT_CUDNN_ATT_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* the interface is exported from a library built with -fvisibility=hidden */
#define FT_CUDNN_ATT_API __attribute__((visibility("default")))

enum {
    FT_CUDNN_ATT_OK = 0,
    FT_CUDNN_ATT_REFUSED = 1,   /* cuDNN does not take this configuration: use another kernel */
    FT_CUDNN_ATT_INVALID = 2,   /* bad arguments (a zero-length sequence, a null pointer, ...) */
    FT_CUDNN_ATT_FAILED = 3     /* cuDNN or CUDA failed while running */
};

/* the graph kinds: forward for inference, forward keeping each row's statistics (training), and
 * the deterministic backward */
typedef enum { FT_CUDNN_ATT_FWD = 0, FT_CUDNN_ATT_FWD_STATS = 1, FT_CUDNN_ATT_BWD = 2 } ft_cudnn_att_kind;
/* the operands' type */
typedef enum { FT_CUDNN_ATT_BF16 = 0, FT_CUDNN_ATT_F16 = 1 } ft_cudnn_att_type;

/* One graph's shape: B sequences, the longest at most S rows (queries or keys), H heads of D, and
 * the attention window: 0 global, else query i sees the keys j with |i - j| <= window / 2 (local
 * attention, ModernBERT: the ops' window) -- cuDNN's diagonal band, top-left aligned, left bound
 * window / 2 + 1 (it keeps j > i - left) and right bound window / 2 (it keeps j <= i + right). */
typedef struct {
    int kind;   /* ft_cudnn_att_kind */
    int type;   /* ft_cudnn_att_type */
    int64_t B, S, H, D;
    int64_t window;
} ft_cudnn_att_shape;

/* the cuDNN version the library was built against and the one loaded (cudnnGetVersion) */
FT_CUDNN_ATT_API void ft_cudnn_att_versions(size_t *built, size_t *loaded);

/* The frontend's host-side check of a graph for compute capability sm_version (e.g. 90), with no
 * device and no handle: graph.set_sm_version + validate(). 0: accepted; FT_CUDNN_ATT_REFUSED with
 * the frontend's reason. */
FT_CUDNN_ATT_API int ft_cudnn_att_validate(int sm_version, const ft_cudnn_att_shape *shape, char *err, size_t err_len);

/* A cuDNN handle on `device` and the graphs built for it (one per shape bucket, type and kind,
 * kept until destroy). Creating it fails (FT_CUDNN_ATT_FAILED, cuDNN's reason) without a GPU. Calls
 * on one context are serialised by the caller. */
typedef struct ft_cudnn_att ft_cudnn_att;
FT_CUDNN_ATT_API int ft_cudnn_att_create(int device, ft_cudnn_att **out, char *err, size_t err_len);
FT_CUDNN_ATT_API void ft_cudnn_att_destroy(ft_cudnn_att *a);

/* The graph for `shape` (built on first use and cached; a refusal is cached too) and its
 * workspace bytes. FT_CUDNN_ATT_REFUSED: cuDNN does not support it on this device. */
FT_CUDNN_ATT_API int ft_cudnn_att_prepare(ft_cudnn_att *a, const ft_cudnn_att_shape *shape, size_t *workspace_bytes, char *err,
                         size_t err_len);

/* Device buffers of one call. The per-sequence tables live in device memory: q_len, kv_len (B
 * int32), and the ragged offsets (B + 1 int64 elements each): qkv_off = first * 3 H D,
 * o_off = first * H D, stats_off = first * H (the last entry: the total). host_q_len and
 * host_kv_len: the same lengths in host memory, checked before anything runs. */
typedef struct {
    const int32_t *q_len, *kv_len;
    const int64_t *qkv_off, *o_off, *stats_off;
    const int32_t *host_q_len, *host_kv_len;
} ft_cudnn_att_seqs;

/* o = attention(qkv); stats (kind FT_CUDNN_ATT_FWD_STATS) the log-sum-exp rows, else NULL.
 * Queued on `stream` (a cudaStream_t); workspace: ft_cudnn_att_prepare's bytes. */
FT_CUDNN_ATT_API int ft_cudnn_att_forward(ft_cudnn_att *a, const ft_cudnn_att_shape *shape, void *stream, const ft_cudnn_att_seqs *seqs,
                         const void *qkv, void *o, float *stats, void *workspace, char *err, size_t err_len);

/* dqkv (T rows of [3, H, D], the layout of qkv) = the gradients of Q, K, V from do_ (like o), the
 * forward's o and stats; deterministic (the same bits every run). */
FT_CUDNN_ATT_API int ft_cudnn_att_backward(ft_cudnn_att *a, const ft_cudnn_att_shape *shape, void *stream,
                          const ft_cudnn_att_seqs *seqs, const void *qkv, const void *o, const void *do_,
                          const float *stats, void *dqkv, void *workspace, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif
#endif
