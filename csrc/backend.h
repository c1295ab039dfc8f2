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

#define FT_BACKEND_ABI 4

typedef struct ft_backend ft_backend;

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
 * Ops (the math): X(name, (parameters)); every op returns ft_status. The op-by-op test
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
    S(void, destroy, (ft_backend *be))                                                             \
    /* bytes of `scratch` attention_forward needs for (B, T, NH) */                                \
    S(size_t, attention_scratch_bytes, (ft_backend *be, int64_t B, int64_t T, int64_t NH))

#define FT_BACKEND_OPS(X)                                                                           \
    /* C (M, N) = alpha * op(A) op(B) + beta * C, row-major, op = transpose when trans_* */        \
    X(gemm, (ft_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, \
             const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,      \
             int64_t ldc))                                                                         \
    /* ---- encoder ops (fp32) ---- */                                                             \
    /* out (B*T, C) = LayerNorm(word[ids] + pos[t] + type[types]) */                              \
    X(embed_ln_forward, (ft_backend *be, float *out, const int32_t *ids, const int32_t *types,     \
                         const float *word, const float *pos, const float *type, const float *gamma, \
                         const float *beta, int64_t B, int64_t T, int64_t C, float eps))           \
    /* dst (N, C) = row broadcast of bias (C): prefill before a beta=1 GEMM */                    \
    X(broadcast_rows, (ft_backend *be, float *dst, const float *bias, int64_t N, int64_t C))        \
    /* ctx (B, T, C) = softmax(Q K^T / sqrt(C/NH) + mask) V per (b, h); qkv (B, T, 3C) with Q, K, \
     * V at column offsets 0, C, 2C. keymask (B, T) 1/0; key_len (B): keys at and after          \
     * key_len[b] are all masked (lets the CPU skip right padding). scratch: see                 \
     * attention_scratch_bytes. A row with no real key gets a zero output. */                     \
    X(attention_forward, (ft_backend *be, float *ctx, const float *qkv, const float *keymask,     \
                          const int32_t *key_len, int64_t B, int64_t T, int64_t C, int64_t NH,    \
                          float *scratch))                                                         \
    /* h (N, K) = act(h + bias) in place */                                                        \
    X(bias_act_forward, (ft_backend *be, float *h, const float *bias, int64_t N, int64_t K,       \
                         ft_activation act))                                                       \
    /* out (N, C) = LayerNorm(residual + y + bias); out may alias residual or y */                \
    X(bias_residual_ln_forward, (ft_backend *be, float *out, const float *residual, const float *y, \
                                 const float *bias, const float *gamma, const float *beta,        \
                                 int64_t N, int64_t C, float eps))                                 \
    /* out (B, C) = CLS row or mask-aware mean over T of h (B, T, C) */                           \
    X(pool_forward, (ft_backend *be, float *out, const float *h, const float *keymask, int64_t B,  \
                     int64_t T, int64_t C, ft_pooling mode))                                       \
    /* ---- training (heads, optimizers) ---- */                                                  \
    /* y (n) = x * keep(key, i) / (1 - p); y may alias x. keep() is ft_dropout_keep (core/rng.h), \
     * so the same call on a gradient applies the same mask (the backward pass). */               \
    X(dropout, (ft_backend *be, float *y, const float *x, int64_t n, float p, uint64_t key))      \
    /* dx (n) = dy * (1 - y^2): tanh backward from its output y; dx may alias dy */               \
    X(tanh_backward, (ft_backend *be, float *dx, const float *dy, const float *y, int64_t n))      \
    /* Row-wise softmax cross-entropy over (N, K) logits. valid (valid_rows, K) or NULL: row r    \
     * uses valid row r % valid_rows, and positions with 0 take no part. labels (N) in [0, K) at \
     * a valid position (checked by the caller). loss (N) per-row loss; dlogits (N, K) or NULL = \
     * scale * (softmax - onehot), 0 at invalid positions. A row with no valid position: loss 0, \
     * dlogits 0. */                                                                               \
    X(softmax_xent, (ft_backend *be, float *loss, float *dlogits, const float *logits,            \
                     const float *valid, int64_t valid_rows, const int32_t *labels, int64_t N,     \
                     int64_t K, float scale))                                                      \
    /* axis 0: out (K) = sum over rows of x (N, K);  axis 1: out (N) = sum over columns */        \
    X(sum_axis, (ft_backend *be, float *out, const float *x, int64_t N, int64_t K, int axis))     \
    /* One fused LAMB / AdamW step over `count` tensors (see ft_optimizer_step). */                \
    X(optim_step, (ft_backend *be, const ft_optim_config *cfg, const ft_optim_tensor *t,          \
                   size_t count, ft_optim_info *info))

/* The argument names of each op, in the order of its parameters above: the profiler
 * (core/profile.c) generates a wrapper per op that forwards its call through them. A new op
 * needs its line here too (a missing one is a compile error in profile.c); tests/test_profile.py
 * checks every line against the parameter list. */
#define FT_OP_ARGS_gemm (be, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)
#define FT_OP_ARGS_embed_ln_forward (be, out, ids, types, word, pos, type, gamma, beta, B, T, C, eps)
#define FT_OP_ARGS_broadcast_rows (be, dst, bias, N, C)
#define FT_OP_ARGS_attention_forward (be, ctx, qkv, keymask, key_len, B, T, C, NH, scratch)
#define FT_OP_ARGS_bias_act_forward (be, h, bias, N, K, act)
#define FT_OP_ARGS_bias_residual_ln_forward (be, out, residual, y, bias, gamma, beta, N, C, eps)
#define FT_OP_ARGS_pool_forward (be, out, h, keymask, B, T, C, mode)
#define FT_OP_ARGS_dropout (be, y, x, n, p, key)
#define FT_OP_ARGS_tanh_backward (be, dx, dy, y, n)
#define FT_OP_ARGS_softmax_xent (be, loss, dlogits, logits, valid, valid_rows, labels, N, K, scale)
#define FT_OP_ARGS_sum_axis (be, out, x, N, K, axis)
#define FT_OP_ARGS_optim_step (be, cfg, t, count, info)

struct ft_backend {
    int abi;
    const char *name;          /* "cpu", "cuda:0" */
    ft_device device;
    void *ctx;                 /* backend private state */
    uintptr_t stream;          /* cudaStream_t the backend queues work on (0 on the CPU) */
#define FT_SERVICE_SLOT(ret, name, params) ret(*name) params;
#define FT_OP_SLOT(name, params) ft_status(*name) params;
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

/* The process-wide backend of a device (the CPU table, or one shared CUDA backend per device,
 * opened on first use): memory services, optimizer steps and heads that have no encoder. */
ft_status ft_backend_for(ft_device dev, ft_backend **out);

/* Entry points the CUDA library exports (resolved with dlsym). */
typedef ft_status (*ft_cuda_open_fn)(const ft_host_api *host, int index, ft_backend **out);
typedef ft_status (*ft_cuda_probe_fn)(const ft_host_api *host, int *count, char *desc, size_t len);
typedef const char *(*ft_cuda_build_fn)(void);

#endif
