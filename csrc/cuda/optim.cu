// Fused multi-tensor LAMB and AdamW on CUDA (equations: ft_optimizer_step in fasttran.h).
//
// Multi-tensor apply: every tensor is cut into chunks of OPT_CHUNK elements and one table of
// (tensor, start) chunks drives every kernel, so a step is a fixed number of launches whatever
// the number of tensors:
//   [grad_sumsq -> global_norm]   only with clipping or the finiteness check     2 launches
//   LAMB:  moments (m, v, partial ||u||^2, ||w||^2) -> trust_ratio -> apply      3 launches
//   AdamW: update                                                                1 launch
// so LAMB is 3 or 5 launches and AdamW 1 or 3 (reported in ft_optim_info.kernel_launches). The
// trust-ratio pass recomputes u from the new m, v rather than storing it (one write and one read
// less per element). Partial sums go to a per-chunk array and are reduced in chunk order, in
// double: results do not depend on scheduling (deterministic).
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_common.cuh"

namespace ftcuda {

constexpr int OPT_CHUNK = 16384;
constexpr int OPT_THREADS = 512;

// a tensor and its coefficients (from its group and step), computed on the host
struct opt_tensor_dev {
    float *p;
    const float *g;
    float *m, *v;
    void *copy;
    int copy_bf16;
    float b1, omb1, b2, omb2, ibc1, ibc2, eps, lr, wd, decay;
    int64_t n;
    int64_t first_chunk, end_chunk;
};

struct opt_chunk_dev {
    int32_t t;
    int64_t start;
};

// scalars: [0] sum g^2 (double), [1] clip scale, [2] non-finite flag
struct opt_scalars {
    double gsq;
    float clip;
    int nonfinite;
};

__device__ inline float block_reduce_sum(float v, float *sh) { return block_sum(v, sh); }

__global__ void grad_sumsq_kernel(const opt_tensor_dev *T, const opt_chunk_dev *C, float *partial) {
    __shared__ float sh[32];
    const opt_chunk_dev c = C[blockIdx.x];
    const opt_tensor_dev t = T[c.t];
    const int64_t end = c.start + OPT_CHUNK < t.n ? c.start + OPT_CHUNK : t.n;
    float s = 0.0f;
    for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) s += t.g[i] * t.g[i];
    s = block_reduce_sum(s, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// one block: sum of the chunk partials in a fixed order (thread k takes chunks k, k+1024, ...,
// then a fixed tree), clip scale and the finiteness flag
__global__ void global_norm_kernel(const float *partial, int64_t nchunks, float max_norm, opt_scalars *out) {
    __shared__ double sh[1024];
    double s = 0.0;
    for (int64_t j = threadIdx.x; j < nchunks; j += blockDim.x) s += (double)partial[j];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        double g = sh[0];
        out->gsq = g;
        out->nonfinite = !isfinite(g);
        double norm = sqrt(g);
        out->clip = (max_norm > 0.0f && norm > max_norm) ? (float)(max_norm / norm) : 1.0f;
    }
}

__device__ inline bool skip_step(const opt_scalars *sc, int have) { return have && sc->nonfinite; }

__global__ void lamb_moments_kernel(const opt_tensor_dev *T, const opt_chunk_dev *C, const opt_scalars *sc, int have_scalars, float2 *partial) {
    __shared__ float sh[32];
    if (skip_step(sc, have_scalars)) return;
    const float clip = have_scalars ? sc->clip : 1.0f;
    const opt_chunk_dev c = C[blockIdx.x];
    const opt_tensor_dev t = T[c.t];
    const int64_t end = c.start + OPT_CHUNK < t.n ? c.start + OPT_CHUNK : t.n;
    float su = 0.0f, sw = 0.0f;
    for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {
        float g = t.g[i] * clip, w = t.p[i];
        float m = t.b1 * t.m[i] + t.omb1 * g;
        float v = t.b2 * t.v[i] + t.omb2 * g * g;
        t.m[i] = m;
        t.v[i] = v;
        float u = (m * t.ibc1) / (sqrtf(v * t.ibc2) + t.eps) + t.wd * w;
        su += u * u;
        sw += w * w;
    }
    su = block_reduce_sum(su, sh);
    sw = block_reduce_sum(sw, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = make_float2(su, sw);
}

// one block per tensor: its chunks' partials in order -> lr * trust ratio
__global__ void trust_ratio_kernel(const opt_tensor_dev *T, const float2 *partial, const double *lr, const opt_scalars *sc,
                                   int have_scalars, float *step) {
    __shared__ double su_sh[256], sw_sh[256];
    if (skip_step(sc, have_scalars)) return;
    const opt_tensor_dev t = T[blockIdx.x];
    double su = 0.0, sw = 0.0;
    for (int64_t j = t.first_chunk + threadIdx.x; j < t.end_chunk; j += blockDim.x) {
        su += partial[j].x;
        sw += partial[j].y;
    }
    su_sh[threadIdx.x] = su;
    sw_sh[threadIdx.x] = sw;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) { su_sh[threadIdx.x] += su_sh[threadIdx.x + w]; sw_sh[threadIdx.x] += sw_sh[threadIdx.x + w]; }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        double phi = (su_sh[0] > 0.0 && sw_sh[0] > 0.0) ? sqrt(sw_sh[0]) / sqrt(su_sh[0]) : 1.0;
        step[blockIdx.x] = (float)(lr[blockIdx.x] * phi);
    }
}

__device__ inline void store_copy(const opt_tensor_dev &t, int64_t i, float w) {
    if (!t.copy) return;
    if (t.copy_bf16) static_cast<__nv_bfloat16 *>(t.copy)[i] = __float2bfloat16(w);
    else static_cast<__half *>(t.copy)[i] = __float2half(w);
}

__global__ void lamb_apply_kernel(const opt_tensor_dev *T, const opt_chunk_dev *C, const float *step,
                                  const opt_scalars *sc, int have_scalars) {
    if (skip_step(sc, have_scalars)) return;
    const opt_chunk_dev c = C[blockIdx.x];
    const opt_tensor_dev t = T[c.t];
    const float s = step[c.t];
    const int64_t end = c.start + OPT_CHUNK < t.n ? c.start + OPT_CHUNK : t.n;
    for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {
        float w = t.p[i];
        float u = (t.m[i] * t.ibc1) / (sqrtf(t.v[i] * t.ibc2) + t.eps) + t.wd * w;
        w -= s * u;
        t.p[i] = w;
        store_copy(t, i, w);
    }
}

__global__ void adamw_kernel(const opt_tensor_dev *T, const opt_chunk_dev *C, const opt_scalars *sc,
                             int have_scalars) {
    if (skip_step(sc, have_scalars)) return;
    const float clip = have_scalars ? sc->clip : 1.0f;
    const opt_chunk_dev c = C[blockIdx.x];
    const opt_tensor_dev t = T[c.t];
    const int64_t end = c.start + OPT_CHUNK < t.n ? c.start + OPT_CHUNK : t.n;
    for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {
        float g = t.g[i] * clip;
        float m = t.b1 * t.m[i] + t.omb1 * g;
        float v = t.b2 * t.v[i] + t.omb2 * g * g;
        t.m[i] = m;
        t.v[i] = v;
        float w = t.p[i] * t.decay - t.lr * (m * t.ibc1) / (sqrtf(v * t.ibc2) + t.eps);
        t.p[i] = w;
        store_copy(t, i, w);
    }
}

}  // namespace ftcuda

using namespace ftcuda;

// Device workspace: tables, partials, scalars, per-tensor steps. Grown as needed, kept in the
// context (freed with the backend).
static ft_status workspace(ft_backend *be, size_t bytes, void **out) {
    cuda_ctx *c = ctx_of(be);
    if (c->opt_ws_bytes < bytes) {
        if (c->opt_ws) cudaFree(c->opt_ws);
        c->opt_ws = nullptr;
        c->opt_ws_bytes = 0;
        FT_CU(cudaMalloc(&c->opt_ws, bytes), "optimizer workspace");
        c->opt_ws_bytes = bytes;
    }
    *out = c->opt_ws;
    return FT_OK;
}

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

ft_status cuda_optim_step(ft_backend *be, const ft_optim_config *cfg, const ft_optim_tensor *t, size_t count,
                          ft_optim_info *info) {
    cuda_ctx *c = ctx_of(be);
    FT_CU(cudaSetDevice(c->device), "cudaSetDevice");
    int64_t nchunks = 0;
    for (size_t k = 0; k < count; k++) nchunks += (t[k].n + OPT_CHUNK - 1) / OPT_CHUNK;
    if (info) { info->grad_norm = NAN; info->clip_scale = 1.0; info->kernel_launches = 0; info->bad_tensor = -1; }
    if (nchunks == 0) return FT_OK;
    // host image of the tables (tensors with their coefficients, chunks, per-tensor lr for the
    // trust ratio), uploaded in one copy
    const size_t tb = align256(count * sizeof(opt_tensor_dev)), cb = align256((size_t)nchunks * sizeof(opt_chunk_dev)),
                 lb = align256(count * sizeof(double));
    const size_t pb = align256((size_t)nchunks * sizeof(float2)), sb = align256(sizeof(opt_scalars)),
                 stb = align256(count * sizeof(float));
    char *host = static_cast<char *>(malloc(tb + cb + lb));
    if (!host) return g_host->error(FT_ERR_NOMEM, "optimizer step: out of host memory for %zu tensors", count);
    opt_tensor_dev *ht = reinterpret_cast<opt_tensor_dev *>(host);
    opt_chunk_dev *hc = reinterpret_cast<opt_chunk_dev *>(host + tb);
    double *hl = reinterpret_cast<double *>(host + tb + cb);
    int64_t j = 0;
    for (size_t k = 0; k < count; k++) {
        const ft_optim_group *g = &cfg->groups[t[k].group];
        const double wd = t[k].decay ? g->weight_decay : 0.0;
        opt_tensor_dev &d = ht[k];
        d = {};
        d.p = t[k].param; d.g = t[k].grad; d.m = t[k].m; d.v = t[k].v;
        d.copy = t[k].copy; d.copy_bf16 = t[k].copy_dtype == FT_BF16;
        d.b1 = (float)g->beta1; d.omb1 = (float)(1.0 - g->beta1);
        d.b2 = (float)g->beta2; d.omb2 = (float)(1.0 - g->beta2);
        d.ibc1 = g->bias_correction ? (float)(1.0 / (1.0 - pow(g->beta1, (double)t[k].step))) : 1.0f;
        d.ibc2 = g->bias_correction ? (float)(1.0 / (1.0 - pow(g->beta2, (double)t[k].step))) : 1.0f;
        d.eps = (float)g->eps; d.lr = (float)g->lr; d.wd = (float)wd; d.decay = (float)(1.0 - g->lr * wd);
        d.n = t[k].n;
        d.first_chunk = j;
        for (int64_t a = 0; a < t[k].n; a += OPT_CHUNK) hc[j++] = {(int32_t)k, a};
        d.end_chunk = j;
        hl[k] = g->lr;
    }
    char *ws = nullptr;
    ft_status st = workspace(be, tb + cb + lb + pb + sb + stb, reinterpret_cast<void **>(&ws));
    if (st == FT_OK) st = cudaMemcpyAsync(ws, host, tb + cb + lb, cudaMemcpyHostToDevice, c->stream) == cudaSuccess
                              ? FT_OK : cuda_fail(cudaGetLastError(), "optimizer table upload");
    free(host);   // pageable memory: cudaMemcpyAsync has staged it when it returns
    if (st != FT_OK) return st;
    opt_tensor_dev *T = reinterpret_cast<opt_tensor_dev *>(ws);
    opt_chunk_dev *C = reinterpret_cast<opt_chunk_dev *>(ws + tb);
    const double *lr = reinterpret_cast<const double *>(ws + tb + cb);
    float2 *partial = reinterpret_cast<float2 *>(ws + tb + cb + lb);
    opt_scalars *sc = reinterpret_cast<opt_scalars *>(ws + tb + cb + lb + pb);
    float *step = reinterpret_cast<float *>(ws + tb + cb + lb + pb + sb);

    const int have = cfg->max_grad_norm > 0.0 || cfg->check_finite;
    int launches = 0;
    const dim3 grid((unsigned)nchunks);
    if (have) {
        FT_LAUNCH(grad_sumsq_kernel, grid, OPT_THREADS, 0, c->stream)(T, C, reinterpret_cast<float *>(partial));
        FT_LAUNCH(global_norm_kernel, 1, 1024, 0, c->stream)(reinterpret_cast<float *>(partial), nchunks,
                                                     (float)cfg->max_grad_norm, sc);
        launches += 2;
    }
    if (cfg->kind == FT_OPT_LAMB) {
        FT_LAUNCH(lamb_moments_kernel, grid, OPT_THREADS, 0, c->stream)(T, C, sc, have, partial);
        FT_LAUNCH(trust_ratio_kernel, (unsigned)count, 256, 0, c->stream)(T, partial, lr, sc, have, step);
        FT_LAUNCH(lamb_apply_kernel, grid, OPT_THREADS, 0, c->stream)(T, C, step, sc, have);
        launches += 3;
    } else {
        FT_LAUNCH(adamw_kernel, grid, OPT_THREADS, 0, c->stream)(T, C, sc, have);
        launches += 1;
    }
    if ((st = launched("optimizer step")) != FT_OK) return st;
    if (info) info->kernel_launches = launches;
    // the finiteness verdict and the norm need the scalars on the host: one small copy + wait
    if (have && (cfg->check_finite || info)) {
        opt_scalars h;
        FT_CU(cudaMemcpyAsync(&h, sc, sizeof h, cudaMemcpyDeviceToHost, c->stream), "optimizer scalars");
        FT_CU(cudaStreamSynchronize(c->stream), "optimizer step");
        if (h.nonfinite)
            return g_host->error(FT_ERR_INVALID_ARGUMENT,
                                 "a gradient is not finite (NaN or Inf) at step %lld; nothing was updated",
                                 (long long)t[0].step);
        if (info) { info->grad_norm = sqrt(h.gsq); info->clip_scale = h.clip; }
    }
    return FT_OK;
}
