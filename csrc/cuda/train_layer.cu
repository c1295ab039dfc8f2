// Training ops of an encoder layer on the GPU (backend.h, "training of encoder layers"): the
// LayerNorm forward that keeps its statistics and its backward, the activation forward that keeps
// what its backward needs (the pre-activation, or Tempo's GELU branch bits) and its backward, and
// attention over packed sequences with its backward. Dropout masks come from core/rng.h, keyed
// by the element index, so the CPU and the GPU drop the same elements and the backward recomputes
// the masks. Column sums (dgamma, dbeta) are deterministic: fixed row chunks, then the chunks in
// order.
#include <cmath>
#include <cstdlib>

#include "core/activation.h"
#include "core/rng.h"
#include "cuda_common.cuh"

using namespace ftcuda;

namespace {

constexpr int LN_CHUNK = 64;   // rows per partial column sum

unsigned grid_of(int64_t total, int threads) {
    int64_t g = (total + threads - 1) / threads;
    return (unsigned)(g < 1 ? 1 : g > 65535 * 8 ? 65535 * 8 : g);
}

int row_threads(int64_t C) {
    int64_t t = (C + 31) / 32 * 32;
    return (int)(t < 32 ? 32 : t > 256 ? 256 : t);
}

// one block per row: t = residual + dropout(y + bias); out = LN(t); stats = (mean, rstd)
__global__ void residual_ln_train_kernel(float *out, float *ln_in, float *stats, const float *residual, const float *y,
                                         const float *bias, const float *gamma, const float *beta, int64_t C, float eps,
                                         uint32_t thr, float scale, uint64_t key) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    const float *a = residual + r * C, *b = y + r * C;
    float *o = out + r * C;
    float sum = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float v = b[c] + bias[c];
        if (thr) v = ft_dropout_keep(key, (uint64_t)(r * C + c), thr) ? v * scale : 0.0f;
        v += a[c];
        o[c] = v;
        if (ln_in) ln_in[r * C + c] = v;
        sum += v;
    }
    const float mean = block_sum(sum, sh) / (float)C;
    float var = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) { float d = o[c] - mean; var += d * d; }
    var = block_sum(var, sh) / (float)C;
    const float rstd = rsqrtf(var + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = (o[c] - mean) * rstd * gamma[c] + beta[c];
    if (threadIdx.x == 0) { stats[2 * r] = mean; stats[2 * r + 1] = rstd; }
}

__device__ inline float ln_xhat(const float *saved, const float *stats, const float *gamma, const float *beta, int64_t r,
                                int64_t c, int64_t C, int from_output) {
    const float s = saved[r * C + c];
    return from_output ? (s - beta[c]) / gamma[c] : (s - stats[2 * r]) * stats[2 * r + 1];
}

// one block per row: dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = dy gamma
__global__ void layernorm_backward_rows_kernel(float *dx, const float *dy, const float *saved, const float *stats,
                                               const float *gamma, const float *beta, int64_t C, int from_output) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    float s1 = 0.0f, s2 = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        const float g = dy[r * C + c] * gamma[c], xh = ln_xhat(saved, stats, gamma, beta, r, c, C, from_output);
        s1 += g;
        s2 += g * xh;
    }
    s1 = block_sum(s1, sh) / (float)C;
    s2 = block_sum(s2, sh) / (float)C;
    const float rstd = stats[2 * r + 1];
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        const float g = dy[r * C + c] * gamma[c], xh = ln_xhat(saved, stats, gamma, beta, r, c, C, from_output);
        dx[r * C + c] = rstd * (g - s1 - xh * s2);
    }
}

// grid (column blocks, row chunks): partial[chunk] (2, C) = sums over the chunk's rows of dy xhat, dy
__global__ void layernorm_backward_cols_kernel(float *partial, const float *dy, const float *saved, const float *stats,
                                               const float *gamma, const float *beta, int64_t N, int64_t C,
                                               int from_output) {
    const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, r0 = (int64_t)blockIdx.y * LN_CHUNK;
    if (c >= C) return;
    const int64_t r1 = r0 + LN_CHUNK < N ? r0 + LN_CHUNK : N;
    float sg = 0.0f, sb = 0.0f;
    for (int64_t r = r0; r < r1; r++) {
        const float d = dy[r * C + c];
        sg += d * ln_xhat(saved, stats, gamma, beta, r, c, C, from_output);
        sb += d;
    }
    partial[(int64_t)blockIdx.y * 2 * C + c] = sg;
    partial[(int64_t)blockIdx.y * 2 * C + C + c] = sb;
}

__global__ void layernorm_backward_reduce_kernel(float *dgamma, float *dbeta, const float *partial, int64_t chunks,
                                                 int64_t C) {
    const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sg = 0.0f, sb = 0.0f;
    for (int64_t k = 0; k < chunks; k++) { sg += partial[k * 2 * C + c]; sb += partial[k * 2 * C + C + c]; }
    dgamma[c] = sg;
    dbeta[c] = sb;
}

// f = act(h + bias); pre = h + bias; bits: one thread per 8 elements (one byte)
__global__ void bias_act_train_kernel(float *f, float *pre, uint8_t *bits, const float *h, const float *bias,
                                      int64_t total, int64_t K, int act) {
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t * 8 < total; t += (int64_t)gridDim.x * blockDim.x) {
        uint8_t byte = 0;
        for (int j = 0; j < 8; j++) {
            const int64_t i = t * 8 + j;
            if (i >= total) break;
            const float x = h[i] + bias[i % K];
            if (pre) pre[i] = x;
            f[i] = (float)ft_act_value((double)x, act);
            byte |= (uint8_t)(ft_gelu_left((double)x, act) << j);
        }
        if (bits) bits[t] = byte;
    }
}

__global__ void bias_act_backward_kernel(float *dh, const float *df, const float *saved, const uint8_t *bits,
                                         const float *in, const float *w, const float *bias, int64_t total, int64_t K,
                                         int64_t C, int act) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        double x = saved[i];
        if (bits) {   // saved is the output: recover the input on its side of the minimum
            if (act == FT_ACT_RELU) {
                x = saved[i] > 0.0f ? 1.0 : -1.0;
            } else if (act == FT_ACT_TANH) {
                x = atanh(fmin(fmax((double)saved[i], -1.0 + 1e-16), 1.0 - 1e-16));
            } else if (ft_gelu_flat(saved[i], act)) {   // too flat to invert: recompute the GEMM's element
                const float *a = in + (i / K) * C, *b = w + (i % K) * C;
                float s = 0.0f;
                for (int64_t c = 0; c < C; c++) s += a[c] * b[c];
                x = s + bias[i % K];
            } else {
                x = ft_gelu_invert((double)saved[i], (bits[i >> 3] >> (i & 7)) & 1, act);
            }
        }
        dh[i] = (float)((double)df[i] * ft_act_grad(x, act));
    }
}

// one warp per row of n scores: softmax in place
__global__ void softmax_rows_kernel(float *S, int64_t rows, int64_t n) {
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float *s = S + row * n;
    float mx = -INFINITY;
    for (int64_t j = lane; j < n; j += 32) mx = fmaxf(mx, s[j]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int64_t j = lane; j < n; j += 32) { float e = expf(s[j] - mx); s[j] = e; sum += e; }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = 1.0f / sum;
    for (int64_t j = lane; j < n; j += 32) s[j] *= inv;
}

// pd = dropout(p) with element index base + i; the mask kept in dmask when given, read from it
// when `from_mask`
__global__ void dropout_probs_kernel(float *pd, uint8_t *dmask, const float *p, int64_t n, int64_t base, uint32_t thr,
                                     float scale, uint64_t key, int from_mask) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int keep = from_mask ? dmask[i] : ft_dropout_keep(key, (uint64_t)(base + i), thr);
        if (dmask && !from_mask) dmask[i] = (uint8_t)keep;
        pd[i] = keep ? p[i] * scale : 0.0f;
    }
}

// one warp per row: dS = P (dP - sum(dP P)), dP = dropout backward of dPd (mask from dmask or the
// hash); in place over dpd
__global__ void softmax_dropout_backward_kernel(float *dpd, const float *P, const uint8_t *dmask, int64_t rows, int64_t n,
                                                int64_t base, uint32_t thr, float scale, uint64_t key) {
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float *d = dpd + row * n;
    const float *p = P + row * n;
    float dot = 0.0f;
    for (int64_t j = lane; j < n; j += 32) {
        const int64_t i = row * n + j;
        const int keep = !thr ? 1 : dmask ? dmask[i] : ft_dropout_keep(key, (uint64_t)(base + i), thr);
        const float dp = keep ? d[j] * scale : 0.0f;
        d[j] = dp;
        dot += dp * p[j];
    }
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    for (int64_t j = lane; j < n; j += 32) d[j] = p[j] * (d[j] - dot);
}

// grid (B, column blocks): sequence b's rows get dout[b] / count[b]
__global__ void pool_backward_kernel(float *dh, const float *dout, const int32_t *first, const int32_t *count,
                                     int64_t C) {
    const int64_t b = blockIdx.x, c = blockIdx.y * (int64_t)blockDim.x + threadIdx.x;
    if (c >= C) return;
    const float g = dout[b * C + c] / fmaxf((float)count[b], 1e-9f);
    float *rows = dh + (int64_t)first[b] * C;
    for (int64_t t = 0; t < count[b]; t++) rows[t * C + c] = g;
}

// the device workspace of the training ops (grown as needed, kept in the context)
ft_status train_workspace(ft_backend *be, size_t bytes, float **out) {
    cuda_ctx *c = ctx_of(be);
    if (c->train_ws_bytes < bytes) {
        if (c->train_ws) cudaFree(c->train_ws);
        c->train_ws = nullptr;
        c->train_ws_bytes = 0;
        FT_CU(cudaMalloc(&c->train_ws, bytes), "training workspace");
        c->train_ws_bytes = bytes;
    }
    *out = static_cast<float *>(c->train_ws);
    return FT_OK;
}

}  // namespace

ft_status cuda_residual_ln_train_forward(ft_backend *be, float *out, float *ln_in, float *stats, const float *residual,
                                         const float *y, const float *bias, const float *gamma, const float *beta,
                                         int64_t N, int64_t C, float eps, float p, uint64_t key) {
    if (N == 0) return FT_OK;
    const uint32_t thr = p > 0.0f ? ft_dropout_threshold(p) : 0;
    FT_LAUNCH(residual_ln_train_kernel, (unsigned)N, row_threads(C), 0, ctx_of(be)->stream)(
        out, ln_in, stats, residual, y, bias, gamma, beta, C, eps, thr, p > 0.0f ? 1.0f / (1.0f - p) : 1.0f, key);
    return launched("residual_ln_train_forward");
}

ft_status cuda_layernorm_backward(ft_backend *be, float *dx, float *dgamma, float *dbeta, const float *dy,
                                  const float *saved, const float *stats, const float *gamma, const float *beta,
                                  int64_t N, int64_t C, int saved_is_output) {
    cudaStream_t s = ctx_of(be)->stream;
    if (C == 0) return FT_OK;
    if (N == 0) {
        FT_CU(cudaMemsetAsync(dgamma, 0, (size_t)C * sizeof(float), s), "layernorm_backward");
        FT_CU(cudaMemsetAsync(dbeta, 0, (size_t)C * sizeof(float), s), "layernorm_backward");
        return FT_OK;
    }
    const int64_t chunks = (N + LN_CHUNK - 1) / LN_CHUNK;
    float *partial = nullptr;
    FT_TRY(train_workspace(be, (size_t)chunks * 2 * (size_t)C * sizeof(float), &partial));
    // the column sums read dy and the saved input before dx (which may alias dy) is written
    FT_LAUNCH(layernorm_backward_cols_kernel, dim3(grid_of(C, 128), (unsigned)chunks), 128, 0, s)(
        partial, dy, saved, stats, gamma, beta, N, C, saved_is_output);
    FT_LAUNCH(layernorm_backward_reduce_kernel, grid_of(C, 128), 128, 0, s)(dgamma, dbeta, partial, chunks, C);
    FT_LAUNCH(layernorm_backward_rows_kernel, (unsigned)N, row_threads(C), 0, s)(dx, dy, saved, stats, gamma, beta, C,
                                                                                 saved_is_output);
    return launched("layernorm_backward");
}

ft_status cuda_bias_act_train_forward(ft_backend *be, float *f, float *pre, uint8_t *bits, const float *h,
                                      const float *bias, int64_t N, int64_t K, ft_activation act) {
    const int64_t total = N * K;
    if (total == 0) return FT_OK;
    FT_LAUNCH(bias_act_train_kernel, grid_of((total + 7) / 8, 256), 256, 0, ctx_of(be)->stream)(f, pre, bits, h, bias,
                                                                                                total, K, (int)act);
    return launched("bias_act_train_forward");
}

ft_status cuda_bias_act_backward(ft_backend *be, float *dh, const float *df, const float *saved, const uint8_t *bits,
                                 const float *in, const float *w, const float *bias, int64_t N, int64_t K, int64_t C,
                                 ft_activation act) {
    const int64_t total = N * K;
    if (total == 0) return FT_OK;
    FT_LAUNCH(bias_act_backward_kernel, grid_of(total, 256), 256, 0, ctx_of(be)->stream)(dh, df, saved, bits, in, w, bias,
                                                                                          total, K, C, (int)act);
    return launched("bias_act_backward");
}

size_t cuda_attention_train_scratch_bytes(ft_backend *, int64_t B, int64_t T, int64_t NH) {
    (void)B;   // sequences run one after another: two (NH, T, T) score blocks
    return 2 * (size_t)NH * (size_t)T * (size_t)T * sizeof(float);
}

ft_status cuda_attention_train_forward(ft_backend *be, float *ctx, float *probs, uint8_t *dmask, const float *qkv,
                                       const int32_t *seqs, int64_t B, int64_t C, int64_t NH, float p, uint64_t key,
                                       float *scratch, size_t scratch_bytes) {
    (void)scratch_bytes;   // sized by B, T, NH only (cuda_attention_train_scratch_bytes)
    cuda_ctx *c = ctx_of(be);
    blas_use blas(c);
    FT_TRY(blas.status);
    const int64_t hs = C / NH, ld = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs), one = 1.0f, zero = 0.0f;
    const uint32_t thr = p > 0.0f ? ft_dropout_threshold(p) : 0;
    const float keep_scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
    int64_t base = 0;   // index of the sequence's first probability
    for (int64_t b = 0; b < B; b++) {
        const int64_t first = seqs[3 * b], n = seqs[3 * b + 1];
        if (n == 0) continue;
        const float *q = qkv + first * ld, *k = q + C, *v = q + 2 * C;
        float *P = probs + base;
        // row-major P_h (n, n) = Q_h K_h^T scale: column-major P_h^T = K_h Q_h^T
        FT_CUBLAS(cublasSgemmStridedBatched(blas.h, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)n, (int)hs, &scale, k, (int)ld,
                                            hs, q, (int)ld, hs, &zero, P, (int)n, n * n, (int)NH),
                  "attention scores");
        const int64_t rows = NH * n;
        FT_LAUNCH(softmax_rows_kernel, (unsigned)((rows + 7) / 8), 256, 0, c->stream)(P, rows, n);
        const float *Pd = P;
        if (thr) {
            FT_LAUNCH(dropout_probs_kernel, grid_of(rows * n, 256), 256, 0, c->stream)(
                scratch, dmask ? dmask + base : nullptr, P, rows * n, base, thr, keep_scale, key, 0);
            Pd = scratch;
        }
        FT_TRY(launched("attention_train_forward"));
        // row-major ctx_h (n, hs) = Pd_h (n, n) V_h (n, hs): column-major ctx_h^T = V_h^T Pd_h^T
        FT_CUBLAS(cublasSgemmStridedBatched(blas.h, CUBLAS_OP_N, CUBLAS_OP_N, (int)hs, (int)n, (int)n, &one, v, (int)ld,
                                            hs, Pd, (int)n, n * n, &zero, ctx + first * C, (int)C, hs, (int)NH),
                  "attention output");
        base += NH * n * n;
    }
    return FT_OK;
}

ft_status cuda_attention_backward(ft_backend *be, float *dqkv, const float *dctx, const float *qkv, const float *probs,
                                  const uint8_t *dmask, const int32_t *seqs, int64_t B, int64_t C, int64_t NH, float p,
                                  uint64_t key, float *scratch, size_t scratch_bytes) {
    (void)scratch_bytes;
    cuda_ctx *c = ctx_of(be);
    blas_use blas(c);
    FT_TRY(blas.status);
    const int64_t hs = C / NH, ld = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs), one = 1.0f, zero = 0.0f;
    const uint32_t thr = p > 0.0f ? ft_dropout_threshold(p) : 0;
    const float keep_scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
    int64_t base = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t first = seqs[3 * b], n = seqs[3 * b + 1];
        if (n == 0) continue;
        const float *q = qkv + first * ld, *k = q + C, *v = q + 2 * C;
        const float *dout = dctx + first * C;
        float *dq = dqkv + first * ld, *dk = dq + C, *dv = dq + 2 * C;
        const float *P = probs + base;
        float *Pd = scratch, *dS = scratch + NH * n * n;
        const int64_t rows = NH * n;
        const float *pd = P;
        if (thr) {   // the dropped probabilities again, from the kept mask or the hash
            FT_LAUNCH(dropout_probs_kernel, grid_of(rows * n, 256), 256, 0, c->stream)(
                Pd, const_cast<uint8_t *>(dmask ? dmask + base : nullptr), P, rows * n, base, thr, keep_scale, key,
                dmask != nullptr);
            pd = Pd;
            FT_TRY(launched("attention_backward"));
        }
        // dV_h (n, hs) = Pd_h^T dctx_h: column-major dV_h^T = dctx_h^T Pd_h
        FT_CUBLAS(cublasSgemmStridedBatched(blas.h, CUBLAS_OP_N, CUBLAS_OP_T, (int)hs, (int)n, (int)n, &one, dout, (int)C,
                                            hs, pd, (int)n, n * n, &zero, dv, (int)ld, hs, (int)NH),
                  "attention dV");
        // dPd_h (n, n) = dctx_h V_h^T: column-major dPd_h^T = V_h dctx_h^T
        FT_CUBLAS(cublasSgemmStridedBatched(blas.h, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)n, (int)hs, &one, v, (int)ld,
                                            hs, dout, (int)C, hs, &zero, dS, (int)n, n * n, (int)NH),
                  "attention dP");
        FT_LAUNCH(softmax_dropout_backward_kernel, (unsigned)((rows + 7) / 8), 256, 0, c->stream)(
            dS, P, dmask ? dmask + base : nullptr, rows, n, base, thr, keep_scale, key);
        FT_TRY(launched("attention_backward"));
        // dQ_h (n, hs) = dS_h K_h scale: column-major dQ_h^T = K_h^T dS_h^T
        FT_CUBLAS(cublasSgemmStridedBatched(blas.h, CUBLAS_OP_N, CUBLAS_OP_N, (int)hs, (int)n, (int)n, &scale, k, (int)ld,
                                            hs, dS, (int)n, n * n, &zero, dq, (int)ld, hs, (int)NH),
                  "attention dQ");
        // dK_h (n, hs) = dS_h^T Q_h scale: column-major dK_h^T = Q_h^T dS_h
        FT_CUBLAS(cublasSgemmStridedBatched(blas.h, CUBLAS_OP_N, CUBLAS_OP_T, (int)hs, (int)n, (int)n, &scale, q, (int)ld,
                                            hs, dS, (int)n, n * n, &zero, dk, (int)ld, hs, (int)NH),
                  "attention dK");
        base += NH * n * n;
    }
    return FT_OK;
}

ft_status cuda_pool_backward(ft_backend *be, float *dh, const float *dout, const int32_t *first, const int32_t *count,
                             int64_t B, int64_t N, int64_t C) {
    cudaStream_t s = ctx_of(be)->stream;
    if (N * C == 0) return FT_OK;
    FT_CU(cudaMemsetAsync(dh, 0, (size_t)(N * C) * sizeof(float), s), "pool_backward");
    if (B == 0) return FT_OK;
    FT_LAUNCH(pool_backward_kernel, dim3((unsigned)B, (unsigned)((C + 127) / 128)), 128, 0, s)(dh, dout, first, count, C);
    return launched("pool_backward");
}
