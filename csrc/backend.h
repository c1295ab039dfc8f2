/* The backend interface: one table of function pointers per device kind (ggml's shape).
 * The encoder's layer loop (model/encoder.c) only talks to this table, so the CPU and CUDA
 * implementations are interchangeable. All buffers are flat, row-major, in the backend's
 * memory; shapes are given as (B, T, C) with B batch, T tokens, C channels, NH heads.
 *
 * The CUDA backend lives in a separate shared library loaded at run time (backend.c), so a
 * missing CUDA driver or cuBLAS never stops the CPU backend from importing. It cannot call
 * the core's ft_error(), so it reports errors through host->error. */
#ifndef FT_BACKEND_H
#define FT_BACKEND_H
#include "fasttran.h"

#define FT_BACKEND_ABI 16

typedef struct ft_backend ft_backend;

/* One output row of a cache read gathered on the device (cache_decode_rows): dst row `row` = the
 * decoded cache row at `src` (backend memory, in the cache codec; int8 rows times `scale`), or
 * zeros when src is NULL (padding). */
typedef struct {
    const void *src;
    int64_t row;
    float scale;
    int32_t unused;
} ft_gather_row;

/* services the core lends to a backend loaded as a separate library */
typedef struct {
    ft_status (*error)(ft_status s, const char *fmt, ...);
} ft_host_api;

/* ---- the op list ---------------------------------------------------------------------------
 * Every entry of the backend table is declared once, here. From these two lists come the
 * struct ft_backend slots, the CPU prototypes (cpu_<name>, cpu/cpu_ops.h), the CUDA prototypes
 * (cuda_<name>, cuda/cuda_common.cuh), both tables, and the registry (ft_backend_registry) that
 * tests iterate. Adding an op = its CPU and CUDA implementations + one line in FT_BACKEND_OPS.
 *
 * Services (memory, copies, queries): S(return type, name, (parameters)).
 * Ops (the math): X(name, (parameters), (argument names)); every op returns ft_status; the names
 * let generated wrappers (the profiler, core/profile.c) forward a call. The op-by-op test
 * (tests/test_backend_ops.py) calls each op on both backends by its parameter names, so the
 * names here are part of the contract. */
#define FT_BACKEND_SERVICES(S)                                                                      \
    S(ft_status, alloc, (ft_backend *be, size_t bytes, void **out))                               \
    S(void, free, (ft_backend *be, void *p))                                                       \
    S(ft_status, upload, (ft_backend *be, void *dst, const void *host_src, size_t bytes))         \
    S(ft_status, download, (ft_backend *be, void *host_dst, const void *src, size_t bytes))       \
    /* copy within the backend's memory (device to device) */                                     \
    S(ft_status, copy, (ft_backend *be, void *dst, const void *src, size_t bytes))                \
    S(ft_status, synchronize, (ft_backend *be))                                                    \
    /* the device's free and total memory, and what this backend holds for itself (cuBLASLt and  \
     * optimizer workspaces; not the buffers it handed out) */                                    \
    S(ft_status, memory_info, (ft_backend *be, size_t *free_bytes, size_t *total_bytes, size_t *own_bytes)) \
    /* float32 products on TF32 tensor cores (on != 0) or in true fp32 (0, the default); the CPU    \
     * has no TF32 and ignores it */                                                              \
    S(ft_status, set_tf32, (ft_backend *be, int on))                                               \
    S(void, destroy, (ft_backend *be))                                                             \
    /* bytes of `scratch` attention_forward (storage type dt) needs for B sequences of at most T    \
     * rows, NH heads */                                                                           \
    S(size_t, attention_scratch_bytes, (ft_backend *be, ft_dtype dt, int64_t B, int64_t T, int64_t NH)) \
    /* bytes of `scratch` attention_train_forward / attention_backward need for B sequences of at  \
     * most T rows, NH heads; the ops get the size they were given (scratch_bytes) and never use  \
     * more, whatever set_num_threads did in between */                                           \
    S(size_t, attention_train_scratch_bytes, (ft_backend *be, int64_t B, int64_t T, int64_t NH))   \
    /* bytes of a packed copy of an (N, K) weight for linear_*_forward; 0 = the backend reads the \
     * weight as it is (w_packed is then ignored) */                                               \
    S(size_t, packed_weight_bytes, (ft_backend *be, int64_t N, int64_t K))                        \
    /* ---- device tier of the cache, CUDA training ---- */                                       \
    /* host memory the device copies from at full speed (pinned on CUDA; plain on the CPU): the  \
     * staging buffers of cache reads into device memory. Free with host_free. */                 \
    S(ft_status, host_alloc, (ft_backend *be, size_t bytes, void **out))                           \
    S(void, host_free, (ft_backend *be, void *p))                                                  \
    /* side streams and events (the cache reader's prefetch): a stream or event is an opaque     \
     * handle (0 on the CPU, where everything is synchronous); stream 0 = the backend's own */     \
    S(ft_status, stream_create, (ft_backend *be, uintptr_t *out))                                  \
    S(void, stream_destroy, (ft_backend *be, uintptr_t stream))                                    \
    S(ft_status, event_create, (ft_backend *be, uintptr_t *out))                                   \
    S(void, event_destroy, (ft_backend *be, uintptr_t event))                                      \
    S(ft_status, event_record, (ft_backend *be, uintptr_t event, uintptr_t stream))                \
    /* work queued on `stream` after this waits for `event` (no host wait) */                      \
    S(ft_status, stream_wait_event, (ft_backend *be, uintptr_t stream, uintptr_t event))           \
    S(ft_status, event_synchronize, (ft_backend *be, uintptr_t event))                             \
    /* upload queued on `stream` (from pinned memory: asynchronous; the source must stay as it is \
     * until an event recorded after it completes) */                                            \
    S(ft_status, upload_async, (ft_backend *be, void *dst, const void *host_src, size_t bytes, uintptr_t stream)) \
    /* ---- reduced-precision linear layers (cpu/lowp.h) ---- */                                    \
    /* bytes of the packed copy of an (N, K) weight for linear_lp_*_forward in wt (FT_I8: int8    \
     * weights with per-output-channel scales; FT_BF16); 0 where the backend has no such kernels    \
     * (CUDA; bf16 on a CPU without AVX512_BF16) */                                                \
    S(size_t, packed_weight_lp_bytes, (ft_backend *be, ft_dtype wt, int64_t N, int64_t K))       \
    /* 1 when the linear layers run faster in wt than in float32 on this backend (measured per     \
     * instruction set: int8 with VNNI / AVX-VNNI / AMX-INT8, bf16 with AVX512_BF16), so an encoder \
     * uses linear_lp_*; 0: an int8 encoder runs its weights dequantized in float32 */              \
    S(int, linear_lp_pays, (ft_backend *be, ft_dtype wt))

#define FT_BACKEND_OPS(X)                                                                           \
    /* C (M, N) = alpha * op(A) op(B) + beta * C, row-major, op = transpose when trans_* */        \
    X(gemm, (ft_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, \
             const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,      \
             int64_t ldc), (be, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc))                                                                         \
    /* gemm with the products' inputs at precision `prec`: FT_F32 = gemm; FT_BF16 / FT_F16: A and \
     * B rounded to that type (nearest even; fp16 overflows to inf), products exact, sums in       \
     * float32 (CUDA: rounded copies, then cuBLAS on 16-bit inputs; cuBLAS's FAST_16BF / _16F      \
     * modes do not round to nearest on an H100). Mixed-precision training: float32 storage and  \
     * master weights, half-precision products. */                                                 \
    X(gemm_prec, (ft_backend *be, ft_dtype prec, int trans_a, int trans_b, int64_t M, int64_t N,   \
                  int64_t K, float alpha, const float *A, int64_t lda, const float *B, int64_t ldb, \
                  float beta, float *C, int64_t ldc), (be, prec, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) \
    /* ---- encoder ops. Activations are "packed rows": the encoder keeps only the rows it       \
     * computes (real tokens, then any padded ones asked for), sequence by sequence. dt is the    \
     * storage type of the weights and activations (FT_F32, FT_F16 or FT_BF16; the CPU computes  \
     * in FT_F32 only): products accumulate in float32, LayerNorm and softmax statistics are      \
     * float32, every stored value is rounded once to dt. pool_forward and scatter_rows write     \
     * float32 whatever dt is (the encoder's outputs). ---- */                                    \
    /* packed (packed_weight_bytes) = w (N, K) in the backend's layout for linear_*_forward */     \
    X(pack_weight, (ft_backend *be, float *packed, const float *w, int64_t N, int64_t K), (be, packed, w, N, K))          \
    /* out (M, N) = act(x (M, K) w^T + bias); w (N, K) and its packed copy; bias (N) or NULL;     \
     * act an ft_activation or -1 for none. out must not alias x. */                              \
    X(linear_forward, (ft_backend *be, ft_dtype dt, void *out, const void *x, const void *w,       \
                       const float *w_packed, const void *bias, int64_t M, int64_t K, int64_t N,   \
                       int act), (be, dt, out, x, w, w_packed, bias, M, K, N, act))                \
    /* out (M, N) = LayerNorm(residual + (x w^T + bias)) per row; out aliases neither x nor       \
     * residual */                                                                                 \
    X(linear_residual_ln_forward, (ft_backend *be, ft_dtype dt, void *out, const void *x,          \
                                   const void *w, const float *w_packed, const void *bias,          \
                                   const void *residual, const void *gamma, const void *beta,       \
                                   int64_t M, int64_t K, int64_t N, float eps), (be, dt, out, x, w, w_packed, bias, residual, gamma, beta, M, K, N, eps)) \
    /* out (N, C) row r = LayerNorm(word[ids[r]] + type[types[r]] + pos[positions[r]]); types NULL: 0; type NULL: no type term; \
     * pos NULL: no position term (rotary models); beta NULL: a LayerNorm without bias */         \
    X(embed_ln_forward, (ft_backend *be, ft_dtype dt, void *out, const int32_t *ids,               \
                         const int32_t *types, const int32_t *positions, const void *word,         \
                         const void *pos, const void *type, const void *gamma, const void *beta,   \
                         int64_t N, int64_t C, float eps), (be, dt, out, ids, types, positions, word, pos, type, gamma, beta, N, C, eps)) \
    /* dst (N, C) = row broadcast of bias (C): prefill before a beta=1 GEMM */                    \
    X(broadcast_rows, (ft_backend *be, float *dst, const float *bias, int64_t N, int64_t C), (be, dst, bias, N, C))        \
    /* ctx (rows, C) = per (sequence b, head h): softmax(Q K^T / sqrt(C/NH)) V; qkv (rows, 3C)    \
     * with Q, K, V at column offsets 0, C, 2C. seqs: HOST memory, (B, 3) int32 = first row,     \
     * key rows, query rows of sequence b: its queries are rows [first, first + query rows) and   \
     * its keys the first `key rows` of them (no mask: every key is real). A sequence with no key \
     * gets a zero output. seqs_dev: the same table in the backend's memory, or NULL (a backend   \
     * that reads it on the device then copies it into scratch, a host-ordered copy that may wait  \
     * for the stream: the encoder uploads it once per forward). scratch:                          \
     * attention_scratch_bytes(dt, B, max query rows, NH). window > 0: query row i of a sequence  \
     * (its index among the sequence's rows) sees only the keys j with |i - j| <= window / 2       \
     * (local attention; a query with no key in reach gets zeros); 0: every key. */               \
    X(attention_forward, (ft_backend *be, ft_dtype dt, void *ctx, const void *qkv,                 \
                          const int32_t *seqs, const int32_t *seqs_dev, int64_t B, int64_t C,      \
                          int64_t NH, int64_t window, void *scratch),                              \
      (be, dt, ctx, qkv, seqs, seqs_dev, B, C, NH, window, scratch))                               \
    /* rotary position embeddings in place on the Q and K columns of qkv (N, 3C), NH heads of     \
     * hs = C / NH: row r at position positions[r] (backend memory), for i < hs / 2 the pair       \
     * (x_i, x_{i + hs/2}) rotated by the angle p f_i, f_i = 1 / theta^(2i / hs) (transformers'    \
     * rotate_half layout; f_i, the angle and cos / sin as float32 values, as transformers has    \
     * them). V untouched. */                                                                      \
    X(rotary_forward, (ft_backend *be, ft_dtype dt, void *qkv, const int32_t *positions, int64_t N, \
                       int64_t C, int64_t NH, double theta), (be, dt, qkv, positions, N, C, NH, theta)) \
    /* out (N, K) = act(h[:, :K]) * h[:, K:] for h (N, 2K): a gated FFN's activation (GeGLU with   \
     * GELU); out must not alias h */                                                              \
    X(gated_act_forward, (ft_backend *be, ft_dtype dt, void *out, const void *h, int64_t N,        \
                          int64_t K, ft_activation act), (be, dt, out, h, N, K, act))              \
    /* a pre-LN residual: x (N, C) += y (y NULL: x unchanged), then h (N, C) = LayerNorm(x) with   \
     * gamma and beta (NULL: no bias); h must not alias x or y */                                  \
    X(residual_ln_forward, (ft_backend *be, ft_dtype dt, void *x, void *h, const void *y,          \
                            const void *gamma, const void *beta, int64_t N, int64_t C, float eps), \
      (be, dt, x, h, y, gamma, beta, N, C, eps))                                                   \
    /* h (N, K) = act(h + bias) in place */                                                        \
    X(bias_act_forward, (ft_backend *be, float *h, const float *bias, int64_t N, int64_t K,       \
                         ft_activation act), (be, h, bias, N, K, act))                                                       \
    /* out (N, C) = LayerNorm(residual + y + bias); out may alias residual or y */                \
    X(bias_residual_ln_forward, (ft_backend *be, float *out, const float *residual, const float *y, \
                                 const float *bias, const float *gamma, const float *beta,        \
                                 int64_t N, int64_t C, float eps), (be, out, residual, y, bias, gamma, beta, N, C, eps))                                 \
    /* out (B, C) float32, row b = mean of rows [first[b], first[b] + count[b]) of h (rows, C) in  \
     * dt; count 0 gives zeros (CLS pooling: count 1) */                                          \
    X(pool_forward, (ft_backend *be, ft_dtype dt, float *out, const void *h, const int32_t *first, \
                     const int32_t *count, int64_t B, int64_t C), (be, dt, out, h, first, count, B, C)) \
    /* dst (float32) row index[r] = src (dt) row r, for r < N; rows are C values */               \
    X(scatter_rows, (ft_backend *be, ft_dtype dt, float *dst, const void *src, const int32_t *index, \
                     int64_t N, int64_t C), (be, dt, dst, src, index, N, C))                       \
    /* ---- training (heads, optimizers) ---- */                                                  \
    /* y (n) = x * keep(key, i) / (1 - p); y may alias x. keep() is ft_dropout_keep (core/rng.h), \
     * so the same call on a gradient applies the same mask (the backward pass). */               \
    X(dropout, (ft_backend *be, float *y, const float *x, int64_t n, float p, uint64_t key), (be, y, x, n, p, key))      \
    /* x (n) *= s, in place (loss scaling: a gradient scaled up before a half-precision backward,  \
     * and the gradients scaled back after it) */                                                  \
    X(scale, (ft_backend *be, float *x, int64_t n, float s), (be, x, n, s))                        \
    /* y (n) += x, elementwise (a gradient reaching a tensor by two paths: a pre-LN residual) */  \
    X(add, (ft_backend *be, float *y, const float *x, int64_t n), (be, y, x, n))                  \
    /* dx (n) = dy * (1 - y^2): tanh backward from its output y; dx may alias dy */               \
    X(tanh_backward, (ft_backend *be, float *dx, const float *dy, const float *y, int64_t n), (be, dx, dy, y, n))      \
    /* Row-wise softmax cross-entropy over (N, K) logits. valid (valid_rows, K) or NULL: row r    \
     * uses valid row r % valid_rows, and positions with 0 take no part. labels (N) in [0, K) at \
     * a valid position (checked by the caller), or < 0: the row is ignored (token labels of      \
     * positions that carry none). loss (N) per-row loss; dlogits (N, K) or NULL = scale *        \
     * (softmax - onehot), 0 at invalid positions. An ignored row, or one with no valid position: \
     * loss 0, dlogits 0. */                                                                       \
    X(softmax_xent, (ft_backend *be, float *loss, float *dlogits, const float *logits,            \
                     const float *valid, int64_t valid_rows, const int32_t *labels, int64_t N,     \
                     int64_t K, float scale), (be, loss, dlogits, logits, valid, valid_rows, labels, N, K, scale))                                                      \
    /* Per-element squared error (regression): loss (n) = (pred - target)^2; dpred (n) or NULL = \
     * scale * 2 (pred - target). */                                                              \
    X(mse_loss, (ft_backend *be, float *loss, float *dpred, const float *pred, const float *target, \
                 int64_t n, float scale), (be, loss, dpred, pred, target, n, scale))                \
    /* Per-element binary cross-entropy on logits (multi-label): loss (n) = max(z, 0) - z y +     \
     * log(1 + exp(-|z|)) for target y in [0, 1]; dlogits (n) or NULL = scale (sigmoid(z) - y). */ \
    X(bce_logits_loss, (ft_backend *be, float *loss, float *dlogits, const float *logits,         \
                        const float *target, int64_t n, float scale), (be, loss, dlogits, logits, target, n, scale)) \
    /* Span cross-entropy over packed rows (extractive QA). logits (2, N): each row's start and   \
     * end score; sequence b owns rows [first[b], first[b] + count[b]) (backend memory, int32). For \
     * k = start, end and each b: softmax over its rows with valid (N) != 0 (the context), label  \
     * labels[k B + b] = the answer's row within the sequence (checked by the caller). loss (2, B);\
     * dlogits (2, N) or NULL = scale (softmax - onehot), 0 at invalid rows; rows of no sequence  \
     * are not written. A sequence with no valid row: loss 0, gradient 0. */                       \
    X(span_xent, (ft_backend *be, float *loss, float *dlogits, const float *logits, const float *valid, \
                  const int32_t *first, const int32_t *count, const int32_t *labels, int64_t B,      \
                  int64_t N, float scale), (be, loss, dlogits, logits, valid, first, count, labels, B, N, scale)) \
    /* axis 0: out (K) = sum over rows of x (N, K);  axis 1: out (N) = sum over columns */        \
    X(sum_axis, (ft_backend *be, float *out, const float *x, int64_t N, int64_t K, int axis), (be, out, x, N, K, axis))     \
    /* One fused LAMB / AdamW step over `count` tensors (see ft_optimizer_step). */                \
    X(optim_step, (ft_backend *be, const ft_optim_config *cfg, const ft_optim_tensor *t,          \
                   size_t count, ft_optim_info *info), (be, cfg, t, count, info))                                             \
    /* ---- training of encoder layers (model/layer.c). Rows are packed: sequence b is rows       \
     * [first, first + n) of seqs (HOST memory, (B, 3) int32: first row, n, n), every row real.  \
     * Dropout masks come from core/rng.h, keyed by the element's index (p = 0: none). ---- */    \
    /* out (N, C) = LayerNorm(residual + dropout(y + bias)); stats (N, 2) = (mean, rstd); ln_in   \
     * (N, C) or NULL: the LayerNorm input, kept for a backward that reads it. out may alias      \
     * residual or y. Dropout index: r C + c. */                                                   \
    X(residual_ln_train_forward, (ft_backend *be, float *out, float *ln_in, float *stats,          \
                                  const float *residual, const float *y, const float *bias,         \
                                  const float *gamma, const float *beta, int64_t N, int64_t C,      \
                                  float eps, float p, uint64_t key), (be, out, ln_in, stats, residual, y, bias, gamma, beta, N, C, eps, p, key))                                \
    /* the embeddings trained (ft_layer_options.train_embeddings): sum (N, C) row r = word[ids[r]] \
     * + type[types[r]] + pos[positions[r]] (embed_ln_forward's terms, order and NULLs: type NULL, \
     * no type term; types NULL, type row 0; pos NULL, no position term), kept for the backward;   \
     * out (N, C) = its LayerNorm (embed_ln_forward's bits), stats (N, 2) = (mean, rstd); beta    \
     * NULL: no bias */                                                                            \
    X(embed_train_forward, (ft_backend *be, float *out, float *sum, float *stats, const int32_t *ids, \
                            const int32_t *types, const int32_t *positions, const float *word,      \
                            const float *pos, const float *type, const float *gamma,                \
                            const float *beta, int64_t N, int64_t C, float eps), (be, out, sum, stats, ids, types, positions, word, pos, type, gamma, beta, N, C, eps)) \
    /* embed_train_forward's tables' gradients from dsum (N, C), overwritten: dword (n_word, C)   \
     * row i = the sum of the rows r of dsum with ids[r] = i, in order of r (0 where none), and   \
     * likewise dpos (n_pos, C) by positions and dtype (n_type, C) by types (types NULL: row 0);  \
     * dpos / dtype NULL: skipped. The order of the sums never depends on the threads. */         \
    X(embed_backward, (ft_backend *be, float *dword, float *dpos, float *dtype, const float *dsum,   \
                       const int32_t *ids, const int32_t *types, const int32_t *positions,          \
                       int64_t N, int64_t C, int64_t n_word, int64_t n_pos, int64_t n_type),        \
      (be, dword, dpos, dtype, dsum, ids, types, positions, N, C, n_word, n_pos, n_type))          \
    /* dx (N, C) = the LayerNorm backward of dy; dgamma, dbeta (C) overwritten. saved: the        \
     * LayerNorm input (saved_is_output = 0), or its output (1: Tempo's in-place LayerNorm, the   \
     * normalised input recovered as (out - beta) / gamma). dx may alias dy. */                   \
    X(layernorm_backward, (ft_backend *be, float *dx, float *dgamma, float *dbeta, const float *dy, \
                           const float *saved, const float *stats, const float *gamma,              \
                           const float *beta, int64_t N, int64_t C, int saved_is_output), (be, dx, dgamma, dbeta, dy, saved, stats, gamma, beta, N, C, saved_is_output))           \
    /* f (N, K) = act(h + bias); pre (N, K) or NULL: h + bias, kept for the backward; bits        \
     * ((N K + 7) / 8 bytes) or NULL: bit i set when element i lies left of GELU's minimum        \
     * (Tempo's in-place GELU keeps f and these bits). f may alias h. */                           \
    X(bias_act_train_forward, (ft_backend *be, float *f, float *pre, uint8_t *bits, const float *h, \
                               const float *bias, int64_t N, int64_t K, ft_activation act), (be, f, pre, bits, h, bias, N, K, act))        \
    /* dh (N, K) = df act'(x): x = saved (the pre-activation) when bits is NULL, else recovered   \
     * from the output saved = f and its branch bits; where GELU is too flat for that (outputs     \
     * within FT_GELU_BAND of its minimum) x is recomputed as in (N, C) w (K, C)^T + bias, the     \
     * forward's GEMM, which the caller keeps anyway. dh may alias df. */                          \
    X(bias_act_backward, (ft_backend *be, float *dh, const float *df, const float *saved,          \
                          const uint8_t *bits, const float *in, const float *w, const float *bias,  \
                          int64_t N, int64_t K, int64_t C, ft_activation act), (be, dh, df, saved, bits, in, w, bias, N, K, C, act))                     \
    /* the backward of rotary_forward (float32), in place on the Q and K columns of dqkv (N, 3C): \
     * each pair rotated by minus rotary_forward's angle (the same float32 cos / sin, the sine    \
     * negated); V's columns untouched */                                                          \
    X(rotary_backward, (ft_backend *be, float *dqkv, const int32_t *positions, int64_t N, int64_t C, \
                        int64_t NH, double theta), (be, dqkv, positions, N, C, NH, theta))         \
    /* the backward of gated_act_forward (float32): dh (N, 2K) from dout (N, K) and the forward's \
     * input h (N, 2K): dh[:, :K] = dout h[:, K:] act'(h[:, :K]), dh[:, K:] = dout act(h[:, :K]); \
     * dh aliases neither dout nor h */                                                            \
    X(gated_act_backward, (ft_backend *be, float *dh, const float *dout, const float *h, int64_t N, \
                           int64_t K, ft_activation act), (be, dh, dout, h, N, K, act))            \
    /* probs (sum over b of NH n_b^2, sequence after sequence, (NH, n, n) each) = softmax(Q K^T / \
     * sqrt(C/NH)) per (b, h), or NULL (not kept); stats (N, NH, 2) or NULL: per query row and    \
     * head, the scaled scores' maximum m and 1 / sum(exp(s - m)), so that P = exp(s - m) / sum    \
     * can be recomputed (FlashAttention); ctx (N, C) = dropout(P) V, dropout index = index in    \
     * probs (whether kept or not); dmask (like probs, bytes) or NULL: the dropout mask kept (else \
     * the backward recomputes it). qkv (N, 3C): Q, K, V at column offsets 0, C, 2C. prec: the    \
     * products' precision, as gemm_prec's: FT_F32, or FT_BF16 / FT_F16 (mixed precision: the     \
     * inputs of Q K^T and of dropout(P) V rounded to it, float32 sums; softmax, its statistics    \
     * and the kept probabilities in float32). window > 0: local attention as attention_forward's \
     * (row i sees the keys j with |i - j| <= window / 2; the kept probabilities are 0 elsewhere, \
     * the statistics over the row's reach), dropout refused (p must be 0); 0: every key. */        \
    X(attention_train_forward, (ft_backend *be, ft_dtype prec, float *ctx, float *probs,           \
                                float *stats, uint8_t *dmask, const float *qkv, const int32_t *seqs,\
                                int64_t B, int64_t C, int64_t NH, int64_t window, float p, uint64_t key, \
                                float *scratch, size_t scratch_bytes), (be, prec, ctx, probs, stats, dmask, qkv, seqs, B, C, NH, window, p, key, scratch, scratch_bytes))                 \
    /* dqkv (N, 3C) = the gradients of Q, K and V from dctx (N, C), with the forward's probs, or  \
     * (probs NULL) the probabilities recomputed from qkv and the forward's stats, and its dmask  \
     * (or the same p and key). prec as the forward's: the inputs of dO V^T, dropout(P)^T dO,     \
     * dS K and dS^T Q rounded to it (dS = P (dP - D) in float32, then rounded), float32 sums.     \
     * window: the forward's (recomputed probabilities are 0 outside a row's reach). */            \
    X(attention_backward, (ft_backend *be, ft_dtype prec, float *dqkv, const float *dctx,          \
                           const float *qkv, const float *probs, const float *stats,               \
                           const uint8_t *dmask, const int32_t *seqs, int64_t B, int64_t C,         \
                           int64_t NH, int64_t window, float p, uint64_t key, float *scratch, size_t scratch_bytes), (be, prec, dqkv, dctx, qkv, probs, stats, dmask, seqs, B, C, NH, window, p, key, scratch, scratch_bytes))                \
    /* dh (N, C) = the backward of mean pooling: row r of sequence b (rows [first[b], first[b] +  \
     * count[b]), device int32) gets dout[b] / count[b] (CLS pooling: count 1); rows of no        \
     * sequence get 0 */                                                                           \
    X(pool_backward, (ft_backend *be, float *dh, const float *dout, const int32_t *first,          \
                      const int32_t *count, int64_t B, int64_t N, int64_t C), (be, dh, dout, first, count, B, N, C)) \
    /* ---- the cache's device tier ---- */                                                        \
    /* dst (rows, C) float32: for each of the n entries of rows (HOST memory), dst row rows[k].row \
     * = the decoded cache row rows[k].src (codec F32 / F16 / BF16 / I8 x scale: the CPU decoder's \
     * bits), or zeros for src NULL; other rows of dst untouched. rows_dev: backend memory for n   \
     * entries, where the op keeps its copy of the table (unused on the CPU). Queued on `stream`   \
     * (0: the backend's; rows must then stay as they are until the stream has run the copy). */  \
    X(cache_decode_rows, (ft_backend *be, float *dst, const ft_gather_row *rows, ft_gather_row *rows_dev, int64_t n,  \
                     int64_t C, ft_dtype codec, uintptr_t stream), (be, dst, rows, rows_dev, n, C, codec, stream)) \
    /* ---- reduced precision (CPU; the CUDA backend refuses these with the reason). int8:           \
     * weights q (N, K) in [-127, 127] with scale (N): w = scale q per output channel; activations  \
     * quantized per row as the layer runs (u8 with a zero point: quantize_rows); sums exact in    \
     * int32. bf16: weights and activations rounded to bf16 (nearest even), float32 sums. ---- */  \
    /* q (N, K) int8, scale (N) = a float32 weight's symmetric per-row quantization: scale = max|w| \
     * / 127, q = rint(w / scale); a non-finite value is refused */                                 \
    X(quantize_weight, (ft_backend *be, int8_t *q, float *scale, const float *w, int64_t N, int64_t K), \
      (be, q, scale, w, N, K))                                                                     \
    /* q (M, K) u8, scale (M), zero_point (M) int32 = x (M, K)'s dynamic per-row quantization, as  \
     * linear_lp_* quantizes its input: x ~ scale (q - zero_point) (cpu/lowp.h) */                  \
    X(quantize_rows, (ft_backend *be, uint8_t *q, float *scale, int32_t *zero_point, const float *x,  \
                      int64_t M, int64_t K), (be, q, scale, zero_point, x, M, K))                  \
    /* packed (packed_weight_lp_bytes(FT_I8)) = int8 weights q (N, K) and their scales (N) */       \
    X(pack_weight_i8, (ft_backend *be, void *packed, const int8_t *q, const float *scale, int64_t N, \
                       int64_t K), (be, packed, q, scale, N, K))                                    \
    /* packed (packed_weight_lp_bytes(FT_BF16)) = w (N, K) rounded to bf16 */                      \
    X(pack_weight_bf16, (ft_backend *be, void *packed, const float *w, int64_t N, int64_t K),       \
      (be, packed, w, N, K))                                                                       \
    /* C (M, N) int32, row stride ldc = sum_k (A[m, k] - zero_point[m]) q[n, k] exactly: A (M, K)   \
     * u8 with row stride lda, zero_point (M) or NULL (0), q the int8 weights packed in w_packed;  \
     * the int8 GEMM of linear_lp_* on its own */                                                  \
    X(gemm_i8, (ft_backend *be, int32_t *C, const uint8_t *A, const int32_t *zero_point,           \
                const void *w_packed, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldc),   \
      (be, C, A, zero_point, w_packed, M, N, K, lda, ldc))                                          \
    /* out (M, N) float32 = act(x (M, K) w^T + bias) with w packed in wt (FT_I8: x quantized per  \
     * row, out = dequantized int32 sums; FT_BF16: bf16 products, float32 sums); bias (N) or NULL, \
     * act an ft_activation or -1. out must not alias x. */                                         \
    X(linear_lp_forward, (ft_backend *be, ft_dtype wt, float *out, const float *x, const void *w_packed, \
                          const float *bias, int64_t M, int64_t K, int64_t N, int act),              \
      (be, wt, out, x, w_packed, bias, M, K, N, act))                                               \
    /* out (M, N) = LayerNorm(residual + (x w^T + bias)) per row, w packed in wt */                \
    X(linear_lp_residual_ln_forward, (ft_backend *be, ft_dtype wt, float *out, const float *x,     \
                                      const void *w_packed, const float *bias, const float *residual, \
                                      const float *gamma, const float *beta, int64_t M, int64_t K,  \
                                      int64_t N, float eps),                                        \
      (be, wt, out, x, w_packed, bias, residual, gamma, beta, M, K, N, eps))                        \
    /* embed_ln_forward with int8 word embeddings: row r = LayerNorm(word_scale[id] word[id] +    \
     * type[types[r]] + pos[positions[r]]), word (V, C) int8, word_scale (V); float32 otherwise;    \
     * pos NULL: no position or type term (rotary models), beta NULL: no LayerNorm bias */          \
    X(embed_i8_ln_forward, (ft_backend *be, float *out, const int32_t *ids, const int32_t *types,  \
                            const int32_t *positions, const int8_t *word, const float *word_scale, \
                            const float *pos, const float *type, const float *gamma, const float *beta, \
                            int64_t N, int64_t C, float eps),                                       \
      (be, out, ids, types, positions, word, word_scale, pos, type, gamma, beta, N, C, eps)) \
    /* ---- compressed models (fasttran.compress) ---- */                                         \
    /* attention_forward with a mode per head: modes (HOST, NH entries, ft_attention_mode):       \
     * FT_ATTN_EXACT = attention_forward's result, FT_ATTN_SIGN_MATCH = softmax over the           \
     * sign_keys keys whose signs agree most with the query's (fasttran.h), FT_ATTN_OFF = zeros,  \
     * nothing computed. CUDA: EXACT and OFF only. */                                             \
    X(attention_heads_forward, (ft_backend *be, ft_dtype dt, void *ctx, const void *qkv,           \
                                const int32_t *seqs, const int32_t *seqs_dev, int64_t B, int64_t C, \
                                int64_t NH, const uint8_t *modes, int64_t sign_keys, void *scratch), \
      (be, dt, ctx, qkv, seqs, seqs_dev, B, C, NH, modes, sign_keys, scratch))                    \
    /* x (N rows of ld values, dt): columns [col, col + ncols) of every row set to zero (a masked  \
     * FFN group) */                                                                               \
    X(zero_columns, (ft_backend *be, ft_dtype dt, void *x, int64_t N, int64_t ld, int64_t col,     \
                     int64_t ncols), (be, dt, x, N, ld, col, ncols))                               \
    /* out (N rows, row stride ldo), column g < W / group = sum over c < group of                  \
     * a[r lda + g group + c] b[r ldb + g group + c], in order of c (float32; first-order          \
     * significance: a gradient times an activation, per row and component) */                    \
    X(group_dot, (ft_backend *be, float *out, int64_t ldo, const float *a, int64_t lda,            \
                  const float *b, int64_t ldb, int64_t N, int64_t W, int64_t group),               \
      (be, out, ldo, a, lda, b, ldb, N, W, group))

struct ft_backend {
    int abi;
    const char *name;          /* "cpu", "cuda:0" */
    ft_device device;
    void *ctx;                 /* backend private state */
    uintptr_t stream;          /* cudaStream_t the backend queues work on (0 on the CPU) */
#define FT_SERVICE_SLOT(ret, name, params) ret(*name) params;
#define FT_OP_SLOT(name, params, args) ft_status(*name) params;
    FT_BACKEND_SERVICES(FT_SERVICE_SLOT)
    FT_BACKEND_OPS(FT_OP_SLOT)
#undef FT_SERVICE_SLOT
#undef FT_OP_SLOT
};

/* The registry: every slot of the table by name, with its kind, C signature and offset. */
typedef struct {
    const char *name;
    const char *kind;        /* "service" or "op" */
    const char *ret;         /* C return type */
    const char *params;      /* the parenthesised parameter list, as written in the op list */
    size_t offset;           /* offsetof(struct ft_backend, name): where the function pointer is */
} ft_backend_entry;

extern const ft_backend_entry ft_backend_registry[];
extern const size_t ft_backend_registry_count;

/* The CPU backend (always built). */
ft_backend *ft_backend_cpu(void);
/* Open the CUDA backend on device `index` (loads the CUDA library on first use). */
ft_status ft_backend_cuda_open(int index, ft_backend **out);
/* A function ft_backend_cuda_open passes every CUDA table it opens, before returning it (the
 * profiler installs its wrappers: core/profile.c registers ft_profile_attach). One per process;
 * NULL: none. The loader knows only this pointer, so it needs nothing of whoever registers. */
typedef void (*ft_backend_open_hook)(ft_backend *be);
void ft_backend_set_open_hook(ft_backend_open_hook hook);
/* dlsym in the CUDA backend library (NULL when it is absent or lacks `name`). */
void *ft_cuda_symbol(const char *name);

/* The process-wide backend of a device (the CPU table, or one shared CUDA backend per device,
 * opened on first use): memory services, optimizer steps and heads that have no encoder. */
ft_status ft_backend_for(ft_device dev, ft_backend **out);
/* Destroy those shared backends (at interpreter exit; a later ft_backend_for opens a new one). */
void ft_backend_release_shared(void);

/* Entry points the CUDA library exports (resolved with dlsym). */
typedef ft_status (*ft_cuda_open_fn)(const ft_host_api *host, int index, ft_backend **out);
typedef ft_status (*ft_cuda_probe_fn)(const ft_host_api *host, int *count, char *desc, size_t len);
typedef const char *(*ft_cuda_build_fn)(void);

#endif
