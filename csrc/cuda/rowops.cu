// Fused row kernels of the CUDA backend: embedding gather + sum + LayerNorm, bias + activation,
// bias + residual + LayerNorm, bias broadcast, pooling over row ranges, row scatter. One block per row for the LayerNorm
// kernels: the row is read once into its final place, then statistics (two passes, mean then
// centred variance, as PyTorch) and the normalisation re-read it from L1/L2. Each thread touches
// the same columns in every pass, so an output aliasing an input needs no barrier.
// Statistics are float whatever the storage type (one kernel source per op, templated on it).
#include "cuda_common.cuh"

using namespace ftcuda;

namespace {

template <typename T>
__device__ void layernorm_row(T *o, const T *gamma, const T *beta, int64_t C, float sum, float eps,
                              float *sh) {
    const float mean = block_sum(sum, sh) / (float)C;
    float var = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) { float d = to_f(o[c]) - mean; var += d * d; }
    var = block_sum(var, sh) / (float)C;
    const float rstd = rsqrtf(var + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        o[c] = from_f<T>(beta ? (to_f(o[c]) - mean) * rstd * to_f(gamma[c]) + to_f(beta[c])
                              : (to_f(o[c]) - mean) * rstd * to_f(gamma[c]));   // beta NULL: no bias
}

// out (N, C) row r = LN(word[ids[r]] + type[types[r]] + pos[positions[r]]); one block per row
template <typename T>
__global__ void embed_ln_kernel(T *out, const int32_t *ids, const int32_t *types, const int32_t *positions,
                                const T *word, const T *pos, const T *type, const T *gamma, const T *beta, int64_t C,
                                float eps) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    const T *w = word + (int64_t)ids[r] * C, *p = pos ? pos + (int64_t)positions[r] * C : NULL;   // NULL: rotary
    const T *ty = type ? type + (types ? (int64_t)types[r] * C : 0) : NULL;   // NULL: no token types
    T *o = out + r * C;
    float sum = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float v = !p ? to_f(w[c]) : ty ? (to_f(w[c]) + to_f(ty[c])) + to_f(p[c]) : to_f(w[c]) + to_f(p[c]);   // HF's order
        o[c] = from_f<T>(v);
        sum += to_f(o[c]);
    }
    layernorm_row(o, gamma, beta, C, sum, eps, sh);
}

// out (N, C) = LN((y + bias) + residual); out may alias residual or y; bias and residual may be NULL
template <typename T>
__global__ void bias_residual_ln_kernel(T *out, const T *residual, const T *y, const T *bias, const T *gamma,
                                        const T *beta, int64_t C, float eps) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    const T *a = residual ? residual + r * C : nullptr, *b = y + r * C;
    T *o = out + r * C;
    float sum = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float v = bias ? to_f(b[c]) + to_f(bias[c]) : to_f(b[c]);
        if (a) v += to_f(a[c]);
        o[c] = from_f<T>(v);
        sum += to_f(o[c]);
    }
    layernorm_row(o, gamma, beta, C, sum, eps, sh);
}

__device__ inline float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
__device__ inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}

template <typename T>
__global__ void bias_act_kernel(T *h, const T *bias, int64_t total, int64_t I, int act) {
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total; k += (int64_t)gridDim.x * blockDim.x) {
        float v = bias ? to_f(h[k]) + to_f(bias[k % I]) : to_f(h[k]);
        v = act == FT_ACT_GELU_ERF ? gelu_erf(v) : act == FT_ACT_GELU_TANH ? gelu_tanh(v) : act == FT_ACT_TANH ? tanhf(v) : fmaxf(v, 0.0f);
        h[k] = from_f<T>(v);
    }
}

template <typename T>
__global__ void broadcast_rows_kernel(T *dst, const T *bias, int64_t total, int64_t C) {
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total; k += (int64_t)gridDim.x * blockDim.x)
        dst[k] = bias[k % C];
}

// out (B, C) row b = mean of rows [first[b], first[b] + count[b]) of h: sentence-transformers'
// sum / max(count, 1e-9) (count 0 gives 0; CLS pooling is count 1). Grid (B, column blocks): the
// batch on x, which has room for any batch size
template <typename T>
__global__ void pool_kernel(float *out, const T *h, const int32_t *first, const int32_t *count, int64_t C) {
    const int64_t b = blockIdx.x, c = blockIdx.y * (int64_t)blockDim.x + threadIdx.x;
    if (c >= C) return;
    const T *hb = h + (int64_t)first[b] * C;
    float acc = 0.0f;
    for (int64_t t = 0; t < count[b]; t++) acc += to_f(hb[t * C + c]);
    out[b * C + c] = acc / fmaxf((float)count[b], 1e-9f);
}

// dst (float) row index[r] = src row r
template <typename T>
__global__ void scatter_rows_kernel(float *dst, const T *src, const int32_t *index, int64_t total, int64_t C) {
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total; k += (int64_t)gridDim.x * blockDim.x)
        dst[(int64_t)index[k / C] * C + k % C] = to_f(src[k]);
}

// rotary embeddings in place on Q and K of qkv (N, 3C): one thread per (row, Q/K head, pair), the
// CPU's float32 arithmetic (cpu/rowfun.h ft_rotary_*): inv f_i from a double power rounded to float,
// the angle a float product, cos / sin in double rounded to float, products rounded before the sums
__global__ void rotary_kernel_f(float *inv, int64_t h2, int64_t hs, double theta) {
    for (int64_t i = threadIdx.x; i < h2; i += blockDim.x) {
        const float e = (float)(2 * i) / (float)hs;
        inv[i] = 1.0f / (float)pow(theta, (double)e);
    }
}

template <typename T>
__global__ void rotary_kernel(T *qkv, const int32_t *positions, const float *inv, int64_t N, int64_t C, int64_t NH,
                              int64_t h2, int backward) {
    const int64_t total = N * 2 * NH * h2, hs = 2 * h2;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total; k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = k % h2, head = (k / h2) % (2 * NH), r = k / (h2 * 2 * NH);
        const float a = __fmul_rn((float)positions[r], inv[i]);
        const float cs = (float)cos((double)a), sf = (float)sin((double)a), sn = backward ? -sf : sf;
        T *x = qkv + r * 3 * C + head * hs;
        const float u = to_f(x[i]), v = to_f(x[h2 + i]);
        x[i] = from_f<T>(__fsub_rn(__fmul_rn(u, cs), __fmul_rn(v, sn)));
        x[h2 + i] = from_f<T>(__fadd_rn(__fmul_rn(v, cs), __fmul_rn(u, sn)));
    }
}

// out (N, I) = act(h[:, :I]) * h[:, I:]
template <typename T>
__global__ void gated_act_kernel(T *out, const T *h, int64_t total, int64_t I, int act) {
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < total; k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = k / I, i = k % I;
        float v = to_f(h[r * 2 * I + i]);
        v = act == FT_ACT_GELU_ERF ? gelu_erf(v) : act == FT_ACT_GELU_TANH ? gelu_tanh(v) : act == FT_ACT_TANH ? tanhf(v) : fmaxf(v, 0.0f);
        out[k] = from_f<T>(__fmul_rn(v, to_f(h[r * 2 * I + I + i])));
    }
}

// x (N, C) += y (or not: y NULL), then h = LN(x); one block per row
template <typename T>
__global__ void residual_ln_kernel(T *x, T *hout, const T *y, const T *gamma, const T *beta, int64_t C, float eps) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    T *xr = x + r * C, *o = hout + r * C;
    float sum = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        if (y) xr[c] = from_f<T>(to_f(xr[c]) + to_f(y[r * C + c]));
        o[c] = xr[c];
        sum += to_f(o[c]);
    }
    layernorm_row(o, gamma, beta, C, sum, eps, sh);
}

}  // namespace

// rotary_forward (backward = 0) or its backward on float32 gradients (1: minus the angle)
static ft_status rotary(ft_backend *be, ft_dtype dt, void *qkv, const int32_t *positions, int64_t N, int64_t C,
                        int64_t NH, double theta, int backward) {
    const char *what = backward ? "rotary_backward" : "rotary_forward";
    const int64_t hs = C / NH, h2 = hs / 2;
    if (hs % 2 || !(theta > 0.0))
        return g_host->error(FT_ERR_INVALID_ARGUMENT, "%s: needs an even head size and theta > 0, got %lld, %g", what,
                             (long long)hs, theta);
    if (N == 0 || h2 == 0) return FT_OK;
    cuda_ctx *c = ctx_of(be);
    float *inv = nullptr;   // the frequencies, made on the device for this call (a few hundred bytes)
    FT_CU(cudaMallocAsync((void **)&inv, (size_t)h2 * sizeof(float), c->stream), "rotary frequencies");
    FT_LAUNCH(rotary_kernel_f, 1, 128, 0, c->stream)(inv, h2, hs, theta);
    ft_status st = launched(what);
    if (st == FT_OK)
        st = with_dtype(dt, what, [&](auto tag) {
            typedef decltype(tag) T;
            FT_LAUNCH(rotary_kernel<T>, grid_of(N * 2 * NH * h2, 256), 256, 0, c->stream)(
                (T *)qkv, positions, inv, N, C, NH, h2, backward);
            return launched(what);
        });
    cudaFreeAsync(inv, c->stream);
    return st;
}

ft_status cuda_rotary_forward(ft_backend *be, ft_dtype dt, void *qkv, const int32_t *positions, int64_t N, int64_t C,
                              int64_t NH, double theta) {
    return rotary(be, dt, qkv, positions, N, C, NH, theta, 0);
}

ft_status cuda_rotary_backward(ft_backend *be, float *dqkv, const int32_t *positions, int64_t N, int64_t C, int64_t NH,
                               double theta) {
    return rotary(be, FT_F32, dqkv, positions, N, C, NH, theta, 1);
}

ft_status cuda_gated_act_forward(ft_backend *be, ft_dtype dt, void *out, const void *h, int64_t N, int64_t I,
                                 ft_activation act) {
    if (N * I == 0) return FT_OK;
    return with_dtype(dt, "gated_act_forward", [&](auto tag) {
        typedef decltype(tag) T;
        FT_LAUNCH(gated_act_kernel<T>, grid_of(N * I, 256), 256, 0, ctx_of(be)->stream)((T *)out, (const T *)h, N * I,
                                                                                         I, (int)act);
        return launched("gated_act_forward");
    });
}

ft_status cuda_residual_ln_forward(ft_backend *be, ft_dtype dt, void *x, void *h, const void *y, const void *gamma,
                                   const void *beta, int64_t N, int64_t C, float eps) {
    if (N == 0) return FT_OK;
    return with_dtype(dt, "residual_ln_forward", [&](auto tag) {
        typedef decltype(tag) T;
        FT_LAUNCH(residual_ln_kernel<T>, (unsigned)N, row_threads(C), 0, ctx_of(be)->stream)(
            (T *)x, (T *)h, (const T *)y, (const T *)gamma, (const T *)beta, C, eps);
        return launched("residual_ln_forward");
    });
}

ft_status cuda_embed_ln_forward(ft_backend *be, ft_dtype dt, void *out, const int32_t *ids, const int32_t *types,
                                const int32_t *positions, const void *word, const void *pos, const void *type,
                                const void *gamma, const void *beta, int64_t N, int64_t C, float eps) {
    if (N == 0) return FT_OK;   // a grid of no blocks is not a launch CUDA accepts
    return with_dtype(dt, "embed_ln_forward", [&](auto tag) {
        typedef decltype(tag) T;
        FT_LAUNCH(embed_ln_kernel<T>, (unsigned)N, row_threads(C), 0, ctx_of(be)->stream)(
            (T *)out, ids, types, positions, (const T *)word, (const T *)pos, (const T *)type, (const T *)gamma,
            (const T *)beta, C, eps);
        return launched("embed_ln_forward");
    });
}

ft_status cuda_broadcast_rows(ft_backend *be, float *dst, const float *bias, int64_t N, int64_t C) {
    FT_LAUNCH(broadcast_rows_kernel<float>, grid_of(N * C, 256), 256, 0, ctx_of(be)->stream)(dst, bias, N * C, C);
    return launched("broadcast_rows");
}

namespace ftcuda {

ft_status act_rows(cuda_ctx *c, ft_dtype dt, void *h, const void *bias, int64_t N, int64_t I, int act) {
    if (N * I == 0) return FT_OK;
    return with_dtype(dt, "bias_act_forward", [&](auto tag) {
        typedef decltype(tag) T;
        FT_LAUNCH(bias_act_kernel<T>, grid_of(N * I, 256), 256, 0, c->stream)((T *)h, (const T *)bias, N * I, I, act);
        return launched("bias_act_forward");
    });
}

ft_status layernorm_rows(cuda_ctx *c, ft_dtype dt, void *out, const void *residual, const void *y, const void *bias,
                         const void *gamma, const void *beta, int64_t N, int64_t C, float eps) {
    if (N == 0) return FT_OK;
    return with_dtype(dt, "bias_residual_ln_forward", [&](auto tag) {
        typedef decltype(tag) T;
        FT_LAUNCH(bias_residual_ln_kernel<T>, (unsigned)N, row_threads(C), 0, c->stream)(
            (T *)out, (const T *)residual, (const T *)y, (const T *)bias, (const T *)gamma, (const T *)beta, C, eps);
        return launched("bias_residual_ln_forward");
    });
}

}  // namespace ftcuda

ft_status cuda_bias_act_forward(ft_backend *be, float *h, const float *bias, int64_t N, int64_t I, ft_activation act) {
    return act_rows(ctx_of(be), FT_F32, h, bias, N, I, (int)act);
}

ft_status cuda_bias_residual_ln_forward(ft_backend *be, float *out, const float *residual, const float *y,
                                        const float *bias, const float *gamma, const float *beta, int64_t N, int64_t C,
                                        float eps) {
    return layernorm_rows(ctx_of(be), FT_F32, out, residual, y, bias, gamma, beta, N, C, eps);
}

ft_status cuda_pool_forward(ft_backend *be, ft_dtype dt, float *out, const void *h, const int32_t *first,
                            const int32_t *count, int64_t B, int64_t C) {
    if (B == 0 || C == 0) return FT_OK;
    return with_dtype(dt, "pool_forward", [&](auto tag) {
        typedef decltype(tag) T;
        dim3 grid((unsigned)B, (unsigned)((C + 127) / 128));
        FT_LAUNCH(pool_kernel<T>, grid, 128, 0, ctx_of(be)->stream)(out, (const T *)h, first, count, C);
        return launched("pool_forward");
    });
}

ft_status cuda_scatter_rows(ft_backend *be, ft_dtype dt, float *dst, const void *src, const int32_t *index, int64_t N,
                            int64_t C) {
    if (N * C == 0) return FT_OK;
    return with_dtype(dt, "scatter_rows", [&](auto tag) {
        typedef decltype(tag) T;
        FT_LAUNCH(scatter_rows_kernel<T>, grid_of(N * C, 256), 256, 0, ctx_of(be)->stream)(dst, (const T *)src, index,
                                                                                            N * C, C);
        return launched("scatter_rows");
    });
}
