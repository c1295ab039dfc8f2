// Training ops of the CUDA backend for the task heads (see backend.h): dropout with masks from
// the same counter-based hash as the CPU (core/rng.h, so both backends draw identical masks),
// tanh backward, softmax cross-entropy with its gradient (one block per row, rows up to a full
// sequence of positions for QA), and axis sums for bias gradients. Grid-stride loops.
#include <cmath>

#include "core/rng.h"
#include "cuda_common.cuh"

using namespace ftcuda;

namespace {

__global__ void dropout_kernel(float *y, const float *x, int64_t n, uint32_t thr, float scale, uint64_t key) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = ft_dropout_keep(key, (uint64_t)i, thr) ? x[i] * scale : 0.0f;
}

__global__ void scale_kernel(float *x, int64_t n, float s) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

__global__ void tanh_backward_kernel(float *dx, const float *dy, const float *y, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dx[i] = dy[i] * (1.0f - y[i] * y[i]);
}

__device__ inline float block_max(float v, float *sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// one block per row
__global__ void softmax_xent_kernel(float *loss, float *dlogits, const float *logits, const float *valid,
                                    int64_t valid_rows, const int32_t *labels, int64_t K, float scale) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    const float *z = logits + r * K;
    const float *ok = valid ? valid + (r % valid_rows) * K : nullptr;
    float mx = -INFINITY;
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x)
        if (!ok || ok[k] != 0.0f) mx = fmaxf(mx, z[k]);
    mx = block_max(mx, sh);
    if (mx == -INFINITY) {
        if (threadIdx.x == 0) loss[r] = 0.0f;
        if (dlogits)
            for (int64_t k = threadIdx.x; k < K; k += blockDim.x) dlogits[r * K + k] = 0.0f;
        return;
    }
    float s = 0.0f;
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x)
        if (!ok || ok[k] != 0.0f) s += expf(z[k] - mx);
    s = block_sum(s, sh);
    const float lse = mx + logf(s);
    const int32_t y = labels[r];
    if (threadIdx.x == 0) loss[r] = lse - z[y];
    if (dlogits)
        for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
            float p = (!ok || ok[k] != 0.0f) ? expf(z[k] - lse) : 0.0f;
            dlogits[r * K + k] = scale * (p - (k == y ? 1.0f : 0.0f));
        }
}

// axis 0: one thread per column, rows in order (deterministic); axis 1: one block per row
__global__ void sum_rows_kernel(float *out, const float *x, int64_t N, int64_t K) {
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < K; k += (int64_t)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int64_t r = 0; r < N; r++) s += x[r * K + k];
        out[k] = s;
    }
}

__global__ void sum_cols_kernel(float *out, const float *x, int64_t K) {
    __shared__ float sh[32];
    const float *row = x + blockIdx.x * K;
    float s = 0.0f;
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) s += row[k];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

}  // namespace

ft_status cuda_dropout(ft_backend *be, float *y, const float *x, int64_t n, float p, uint64_t key) {
    FT_LAUNCH(dropout_kernel, grid_of(n, 256), 256, 0, ctx_of(be)->stream)(y, x, n, ft_dropout_threshold(p),
                                                                     1.0f / (1.0f - p), key);
    return launched("dropout");
}

ft_status cuda_scale(ft_backend *be, float *x, int64_t n, float s) {
    if (n <= 0) return FT_OK;
    FT_LAUNCH(scale_kernel, grid_of(n, 256), 256, 0, ctx_of(be)->stream)(x, n, s);
    return launched("scale");
}

ft_status cuda_tanh_backward(ft_backend *be, float *dx, const float *dy, const float *y, int64_t n) {
    FT_LAUNCH(tanh_backward_kernel, grid_of(n, 256), 256, 0, ctx_of(be)->stream)(dx, dy, y, n);
    return launched("tanh_backward");
}

ft_status cuda_softmax_xent(ft_backend *be, float *loss, float *dlogits, const float *logits, const float *valid,
                            int64_t valid_rows, const int32_t *labels, int64_t N, int64_t K, float scale) {
    if (N > 0x7fffffff) return g_host->error(FT_ERR_INVALID_ARGUMENT, "softmax_xent: too many rows (%lld)", (long long)N);
    if (N == 0) return FT_OK;
    FT_LAUNCH(softmax_xent_kernel, (unsigned)N, 128, 0, ctx_of(be)->stream)(loss, dlogits, logits, valid, valid_rows, labels, K,
                                                                       scale);
    return launched("softmax_xent");
}

ft_status cuda_sum_axis(ft_backend *be, float *out, const float *x, int64_t N, int64_t K, int axis) {
    if (axis == 1 && N == 0) return FT_OK;
    if (axis == 0) FT_LAUNCH(sum_rows_kernel, grid_of(K, 128), 128, 0, ctx_of(be)->stream)(out, x, N, K);
    else FT_LAUNCH(sum_cols_kernel, (unsigned)N, 256, 0, ctx_of(be)->stream)(out, x, K);
    return launched("sum_axis");
}
