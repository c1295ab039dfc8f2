// Training ops of an encoder layer on the GPU (backend.h, "training of encoder layers"): the
// LayerNorm forward that keeps its statistics and its backward, the activation forward that keeps
// what its backward needs (the pre-activation, or Tempo's GELU branch bits) and its backward, and
// pooling's backward (attention and its backward: train_attention.cu). Dropout masks come from
// core/rng.h, keyed by the element index, so the CPU and the GPU drop the same elements and the
// backward recomputes the masks. Column sums (dgamma, dbeta) are deterministic: fixed row chunks, then the chunks in
// order.
#include <cmath>
#include <cstdlib>

#include "core/activation.h"
#include "core/rng.h"
#include "cuda_common.cuh"

using namespace ftcuda;

namespace {

constexpr int LN_CHUNK = 64;   // rows per partial column sum

// the block's row x (C; `sum` its threads' partial sums) normalised into y (may alias x): the mean,
// then the centred variance (two passes, as the CPU's rows), y = (x - mean) rstd gamma + beta (beta
// NULL: no bias), st = (mean, rstd)
__device__ inline void ln_train_row(float *y, const float *x, float *st, const float *gamma, const float *beta,
                                    int64_t C, float sum, float eps, float *sh) {
    const float mean = block_sum(sum, sh) / (float)C;
    float var = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) { float d = x[c] - mean; var += d * d; }
    var = block_sum(var, sh) / (float)C;
    const float rstd = rsqrtf(var + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        y[c] = beta ? (x[c] - mean) * rstd * gamma[c] + beta[c] : (x[c] - mean) * rstd * gamma[c];
    if (threadIdx.x == 0) { st[0] = mean; st[1] = rstd; }
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
    ln_train_row(o, o, stats + 2 * r, gamma, beta, C, sum, eps, sh);
}

// one block per row: sum = word[id] + type[t] + pos[p] (embed_ln_kernel's order), kept; out = LN(sum);
// stats = (mean, rstd)
__global__ void embed_train_kernel(float *out, float *sum, float *stats, const int32_t *ids, const int32_t *types,
                                   const int32_t *positions, const float *word, const float *pos, const float *type,
                                   const float *gamma, const float *beta, int64_t C, float eps) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    const float *w = word + (int64_t)ids[r] * C, *p = pos ? pos + (int64_t)positions[r] * C : nullptr;
    const float *ty = type ? type + (types ? (int64_t)types[r] * C : 0) : nullptr;
    float *o = sum + r * C, *y = out + r * C;
    float acc = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        const float v = !p ? w[c] : ty ? (w[c] + ty[c]) + p[c] : w[c] + p[c];
        o[c] = v;
        acc += v;
    }
    ln_train_row(y, o, stats + 2 * r, gamma, beta, C, acc, eps, sh);
}

// one thread per column: the rows of dsum added into their table rows in order of r (no atomics:
// the same bits every run). N dependent steps per column: cheap beside the layers at the batches
// top-k training runs; a sort by row and segmented sums would be the way past that.
__global__ void embed_backward_kernel(float *d, const float *dsum, const int32_t *index, int64_t N, int64_t C) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int64_t r = 0; r < N; r++) d[(index ? (int64_t)index[r] : 0) * C + c] += dsum[r * C + c];
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
    // g is rounded once (__fmul_rn: no fused multiply-add) and used the same way in both loops, so
    // g - mean(g) is exactly 0 where every g is equal (C = 1): rstd (up to 1/sqrt(eps)) would
    // magnify a contracted product's rounding error
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        const float g = __fmul_rn(dy[r * C + c], gamma[c]), xh = ln_xhat(saved, stats, gamma, beta, r, c, C, from_output);
        s1 += g;
        s2 += g * xh;
    }
    s1 = block_sum(s1, sh) / (float)C;
    s2 = block_sum(s2, sh) / (float)C;
    const float rstd = stats[2 * r + 1];
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        const float g = __fmul_rn(dy[r * C + c], gamma[c]), xh = ln_xhat(saved, stats, gamma, beta, r, c, C, from_output);
        dx[r * C + c] = rstd * (__fsub_rn(g, s1) - xh * s2);
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

// one thread per (row, k): a = h[r, k], g = h[r, K + k]; dh[r, k] = dout g act'(a), dh[r, K + k] = dout act(a)
__global__ void gated_act_backward_kernel(float *dh, const float *dout, const float *h, int64_t total, int64_t K,
                                          int act) {
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total; k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = k / K, i = k % K;
        const float a = h[r * 2 * K + i], g = h[r * 2 * K + K + i], d = dout[k];
        dh[r * 2 * K + i] = (float)((double)(d * g) * ft_act_grad((double)a, act));
        dh[r * 2 * K + K + i] = d * (float)ft_act_value((double)a, act);
    }
}

// one thread per element: dh = df act'(x), x recovered from the saved output where that is
// accurate; elements in Tempo's flat GELU band are left (dh may be df itself) to bias_act_flat_kernel
__global__ void bias_act_backward_kernel(float *dh, const float *df, const float *saved, const uint8_t *bits,
                                         int64_t total, int act) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        double x = saved[i];
        if (bits) {   // saved is the output: recover the input on its side of the minimum
            if (act == FT_ACT_RELU) {
                x = saved[i] > 0.0f ? 1.0 : -1.0;
            } else if (act == FT_ACT_TANH) {
                x = atanh(fmin(fmax((double)saved[i], -1.0 + 1e-16), 1.0 - 1e-16));
            } else if (ft_gelu_flat(saved[i], act)) {   // too flat to invert: the GEMM's element, next pass
                continue;
            } else {
                x = ft_gelu_invertf(saved[i], (bits[i >> 3] >> (i & 7)) & 1, act);
            }
        }
        dh[i] = (float)((double)df[i] * ft_act_grad(x, act));
    }
}

// a warp per row of dh (N, K): the flat band's elements' inputs recomputed from the GEMM, x = in[r] .
// w[k] + bias[k] (the warp's lanes split the C products, then a fixed shuffle tree: the row of
// `in` stays in L1 across the row's marked elements), dh = df act'(x)
__global__ void bias_act_flat_kernel(float *dh, const float *df, const float *saved, const float *in, const float *w,
                                     const float *bias, int64_t N, int64_t K, int64_t C, int act) {
    const int64_t r = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (r >= N) return;
    const float *a = in + r * C;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const int64_t k = k0 + lane;
        const bool mine = k < K && ft_gelu_flat(saved[r * K + k], act);
        unsigned todo = __ballot_sync(0xffffffffu, mine);
        while (todo) {
            const int j = __ffs(todo) - 1;
            todo &= todo - 1;
            const float *b = w + (k0 + j) * C;
            float s = 0.0f;
            for (int64_t c = lane; c < C; c += 32) s += a[c] * b[c];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == j) dh[r * K + k] = (float)((double)df[r * K + k] * ft_act_grad((double)(s + bias[k]), act));
        }
    }
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

ft_status cuda_embed_train_forward(ft_backend *be, float *out, float *sum, float *stats, const int32_t *ids,
                                   const int32_t *types, const int32_t *positions, const float *word, const float *pos,
                                   const float *type, const float *gamma, const float *beta, int64_t N, int64_t C,
                                   float eps) {
    if (N == 0 || C == 0) return FT_OK;
    FT_LAUNCH(embed_train_kernel, (unsigned)N, row_threads(C), 0, ctx_of(be)->stream)(
        out, sum, stats, ids, types, positions, word, pos, type, gamma, beta, C, eps);
    return launched("embed_train_forward");
}

ft_status cuda_embed_backward(ft_backend *be, float *dword, float *dpos, float *dtype, const float *dsum,
                              const int32_t *ids, const int32_t *types, const int32_t *positions, int64_t N, int64_t C,
                              int64_t n_word, int64_t n_pos, int64_t n_type) {
    cudaStream_t s = ctx_of(be)->stream;
    float *tables[3] = {dword, dpos, dtype};
    const int32_t *index[3] = {ids, positions, types};
    const int64_t rows[3] = {n_word, n_pos, n_type};
    for (int t = 0; t < 3; t++) {
        if (!tables[t] || rows[t] * C == 0) continue;
        FT_CU(cudaMemsetAsync(tables[t], 0, (size_t)rows[t] * (size_t)C * sizeof(float), s), "embed_backward");
        if (N == 0) continue;
        FT_LAUNCH(embed_backward_kernel, grid_of(C, 128), 128, 0, s)(tables[t], dsum, index[t], N, C);
        FT_TRY(launched("embed_backward"));
    }
    return FT_OK;
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
    cudaStream_t st = ctx_of(be)->stream;
    FT_LAUNCH(bias_act_backward_kernel, grid_of(total, 256), 256, 0, st)(dh, df, saved, bits, total, (int)act);
    if (bits && (act == FT_ACT_GELU_ERF || act == FT_ACT_GELU_TANH))   // Tempo's GELU: the flat band's elements
        FT_LAUNCH(bias_act_flat_kernel, (unsigned)((N + 7) / 8), 256, 0, st)(dh, df, saved, in, w, bias, N, K, C,
                                                                             (int)act);
    return launched("bias_act_backward");
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

ft_status cuda_gated_act_backward(ft_backend *be, float *dh, const float *dout, const float *h, int64_t N, int64_t K,
                                  ft_activation act) {
    if (N * K == 0) return FT_OK;
    FT_LAUNCH(gated_act_backward_kernel, grid_of(N * K, 256), 256, 0, ctx_of(be)->stream)(dh, dout, h, N * K, K,
                                                                                         (int)act);
    return launched("gated_act_backward");
}
