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
//
// The tables stay on the device between steps: the tensor table (addresses, sizes,
// chunk ranges) and the chunk table are uploaded only when an address or a size changes (a
// tensor sits a step out, a gradient moved); a step uploads just the coefficients -- one entry per
// distinct (group, update count), usually one or two -- and each tensor's index into them. The
// host image lives in the backend context (opt_plan), so a steady step allocates nothing.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_common.cuh"

namespace ftcuda {

constexpr int OPT_CHUNK = 16384;
constexpr int OPT_THREADS = 512;

// a tensor: addresses, size, chunk range (kept on the device while they do not change)
struct opt_tensor_dev {
    float *p;
    const float *g;
    float *m, *v;
    void *copy;
    int copy_bf16;
    int64_t n;
    int64_t first_chunk, end_chunk;
};

// the coefficients of a (group, update count): uploaded every step
struct opt_coef_dev {
    float b1, omb1, b2, omb2, ibc1, ibc2, eps, lr, wd, decay;
    double lr_d;   // the trust-ratio step's lr, in double as before
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

__global__ void lamb_moments_kernel(const opt_tensor_dev *T, const opt_coef_dev *K, const int32_t *coef_of,
                                    const opt_chunk_dev *C, const opt_scalars *sc, int have_scalars, float2 *partial) {
    __shared__ float sh[32];
    if (skip_step(sc, have_scalars)) return;
    const float clip = have_scalars ? sc->clip : 1.0f;
    const opt_chunk_dev c = C[blockIdx.x];
    const opt_tensor_dev t = T[c.t];
    const opt_coef_dev k = K[coef_of[c.t]];
    const int64_t end = c.start + OPT_CHUNK < t.n ? c.start + OPT_CHUNK : t.n;
    float su = 0.0f, sw = 0.0f;
    for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {
        float g = t.g[i] * clip, w = t.p[i];
        float m = k.b1 * t.m[i] + k.omb1 * g;
        float v = k.b2 * t.v[i] + k.omb2 * g * g;
        t.m[i] = m;
        t.v[i] = v;
        float u = (m * k.ibc1) / (sqrtf(v * k.ibc2) + k.eps) + k.wd * w;
        su += u * u;
        sw += w * w;
    }
    su = block_reduce_sum(su, sh);
    sw = block_reduce_sum(sw, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = make_float2(su, sw);
}

// one block per tensor: its chunks' partials in order -> lr * trust ratio
__global__ void trust_ratio_kernel(const opt_tensor_dev *T, const opt_coef_dev *K, const int32_t *coef_of,
                                   const float2 *partial, const opt_scalars *sc, int have_scalars, float *step) {
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
        step[blockIdx.x] = (float)(K[coef_of[blockIdx.x]].lr_d * phi);
    }
}

__device__ inline void store_copy(const opt_tensor_dev &t, int64_t i, float w) {
    if (!t.copy) return;
    if (t.copy_bf16) static_cast<__nv_bfloat16 *>(t.copy)[i] = __float2bfloat16(w);
    else static_cast<__half *>(t.copy)[i] = __float2half(w);
}

__global__ void lamb_apply_kernel(const opt_tensor_dev *T, const opt_coef_dev *K, const int32_t *coef_of,
                                  const opt_chunk_dev *C, const float *step, const opt_scalars *sc, int have_scalars) {
    if (skip_step(sc, have_scalars)) return;
    const opt_chunk_dev c = C[blockIdx.x];
    const opt_tensor_dev t = T[c.t];
    const opt_coef_dev k = K[coef_of[c.t]];
    const float s = step[c.t];
    const int64_t end = c.start + OPT_CHUNK < t.n ? c.start + OPT_CHUNK : t.n;
    for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {
        float w = t.p[i];
        float u = (t.m[i] * k.ibc1) / (sqrtf(t.v[i] * k.ibc2) + k.eps) + k.wd * w;
        w -= s * u;
        t.p[i] = w;
        store_copy(t, i, w);
    }
}

__global__ void adamw_kernel(const opt_tensor_dev *T, const opt_coef_dev *K, const int32_t *coef_of,
                             const opt_chunk_dev *C, const opt_scalars *sc, int have_scalars) {
    if (skip_step(sc, have_scalars)) return;
    const float clip = have_scalars ? sc->clip : 1.0f;
    const opt_chunk_dev c = C[blockIdx.x];
    const opt_tensor_dev t = T[c.t];
    const opt_coef_dev k = K[coef_of[c.t]];
    const int64_t end = c.start + OPT_CHUNK < t.n ? c.start + OPT_CHUNK : t.n;
    for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {
        float g = t.g[i] * clip;
        float m = k.b1 * t.m[i] + k.omb1 * g;
        float v = k.b2 * t.v[i] + k.omb2 * g * g;
        t.m[i] = m;
        t.v[i] = v;
        float w = t.p[i] * k.decay - k.lr * (m * k.ibc1) / (sqrtf(v * k.ibc2) + k.eps);
        t.p[i] = w;
        store_copy(t, i, w);
    }
}

}  // namespace ftcuda

using namespace ftcuda;

// The plan kept in the backend context between steps: the host images of the tables, what the
// device holds (static tables valid?), and the device workspace:
//   [tensor table tb][chunk table cb][partials pb][scalars sb][per-tensor step stb][coef_of ib][coefs kb]
struct opt_plan {
    char *host;              // host image: static part (tb + cb), then coef_of + coefs (ib + kb)
    size_t host_bytes;
    char *uploaded;          // (uploaded_count) opt_tensor_dev: the tensor table the device holds
    size_t uploaded_count, uploaded_bytes;
    int64_t nchunks;
    int valid;               // the device's static tables match `uploaded`
    char *ws;                // device workspace
    size_t ws_bytes;
    size_t static_uploads;   // times the static tables were uploaded (tests)
};

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

// device bytes the optimizer keeps in the context (memory_info)
size_t ftcuda::cuda_optim_device_bytes(cuda_ctx *c) {
    return c->opt_plan ? static_cast<opt_plan *>(c->opt_plan)->ws_bytes : 0;
}

static opt_plan *plan_of(cuda_ctx *c) {
    if (!c->opt_plan) c->opt_plan = calloc(1, sizeof(opt_plan));
    return static_cast<opt_plan *>(c->opt_plan);
}

void ftcuda::cuda_optim_release(cuda_ctx *c) {
    opt_plan *p = static_cast<opt_plan *>(c->opt_plan);
    if (!p) return;
    if (p->ws) cudaFree(p->ws);
    free(p->host);
    free(p->uploaded);
    free(p);
    c->opt_plan = nullptr;
}

static bool grow_host(char **buf, size_t *have, size_t need) {
    if (*have >= need) return true;
    char *n = static_cast<char *>(realloc(*buf, need + need / 2));
    if (!n) return false;
    *buf = n;
    *have = need + need / 2;
    return true;
}

// the coefficients of tensor k's (group, update count), as the kernels take them
static opt_coef_dev coefficients(const ft_optim_group *g, int64_t step, double wd) {
    opt_coef_dev d;
    d.b1 = (float)g->beta1; d.omb1 = (float)(1.0 - g->beta1);
    d.b2 = (float)g->beta2; d.omb2 = (float)(1.0 - g->beta2);
    d.ibc1 = g->bias_correction ? (float)(1.0 / (1.0 - pow(g->beta1, (double)step))) : 1.0f;
    d.ibc2 = g->bias_correction ? (float)(1.0 / (1.0 - pow(g->beta2, (double)step))) : 1.0f;
    d.eps = (float)g->eps; d.lr = (float)g->lr; d.wd = (float)wd; d.decay = (float)(1.0 - g->lr * wd);
    d.lr_d = g->lr;
    return d;
}

ft_status cuda_optim_step(ft_backend *be, const ft_optim_config *cfg, const ft_optim_tensor *t, size_t count,
                          ft_optim_info *info) {
    cuda_ctx *c = ctx_of(be);
    FT_CU(cudaSetDevice(c->device), "cudaSetDevice");
    if (info) { info->grad_norm = NAN; info->clip_scale = 1.0; info->kernel_launches = 0; info->bad_tensor = -1; }
    opt_plan *P = plan_of(c);
    if (!P) return g_host->error(FT_ERR_NOMEM, "optimizer step: out of host memory");
    int64_t nchunks = 0;
    for (size_t k = 0; k < count; k++) nchunks += (t[k].n + OPT_CHUNK - 1) / OPT_CHUNK;
    if (nchunks == 0) return FT_OK;
    const size_t tb = align256(count * sizeof(opt_tensor_dev)), cb = align256((size_t)nchunks * sizeof(opt_chunk_dev));
    const size_t pb = align256((size_t)nchunks * sizeof(float2)), sb = align256(sizeof(opt_scalars)),
                 stb = align256(count * sizeof(float)), ib = align256(count * sizeof(int32_t)),
                 kb = align256(count * sizeof(opt_coef_dev));
    if (!grow_host(&P->host, &P->host_bytes, tb + cb + ib + kb) ||
        !grow_host(&P->uploaded, &P->uploaded_bytes, count * sizeof(opt_tensor_dev)))
        return g_host->error(FT_ERR_NOMEM, "optimizer step: out of host memory for %zu tensors", count);
    // the static tables: the tensor table built (cheap: addresses and sizes), compared with what the
    // device holds; the chunk table rebuilt and both uploaded only when something changed
    opt_tensor_dev *ht = reinterpret_cast<opt_tensor_dev *>(P->host);
    int64_t j = 0;
    for (size_t k = 0; k < count; k++) {
        opt_tensor_dev &d = ht[k];
        memset(&d, 0, sizeof d);   // padding included: the table is compared bytewise
        d.p = t[k].param; d.g = t[k].grad; d.m = t[k].m; d.v = t[k].v;
        d.copy = t[k].copy; d.copy_bf16 = t[k].copy_dtype == FT_BF16;
        d.n = t[k].n;
        d.first_chunk = j;
        j += (t[k].n + OPT_CHUNK - 1) / OPT_CHUNK;
        d.end_chunk = j;
    }
    const size_t need = tb + cb + pb + sb + stb + ib + kb;
    if (P->ws_bytes < need) {   // grown (and the static tables re-sent) only for a larger set
        if (P->ws) cudaFree(P->ws);
        P->ws = nullptr;
        P->ws_bytes = 0;
        P->valid = 0;
        FT_CU(cudaMalloc(&P->ws, need), "optimizer workspace");
        P->ws_bytes = need;
    }
    char *ws = P->ws;
    const size_t o_chunks = tb, o_partial = o_chunks + cb, o_scalars = o_partial + pb, o_step = o_scalars + sb,
                 o_coef_of = o_step + stb, o_coefs = o_coef_of + ib;
    // the static tables sit at fixed offsets for a given (count, nchunks): a different layout re-sends them
    const bool same = P->valid && P->uploaded_count == count && P->nchunks == nchunks &&
                      memcmp(P->uploaded, ht, count * sizeof(opt_tensor_dev)) == 0;
    if (!same) {
        opt_chunk_dev *hc = reinterpret_cast<opt_chunk_dev *>(P->host + tb);
        j = 0;
        for (size_t k = 0; k < count; k++)
            for (int64_t a = 0; a < t[k].n; a += OPT_CHUNK) hc[j++] = {(int32_t)k, a};
        P->valid = 0;
        FT_CU(cudaMemcpyAsync(ws, P->host, tb + cb, cudaMemcpyHostToDevice, c->stream), "optimizer table upload");
        memcpy(P->uploaded, ht, count * sizeof(opt_tensor_dev));
        P->uploaded_count = count;
        P->nchunks = nchunks;
        P->valid = 1;
        P->static_uploads++;
    }
    // the per-step part: one coefficient entry per distinct (group, update count), and each tensor's
    int32_t *coef_of = reinterpret_cast<int32_t *>(P->host + tb + cb);
    opt_coef_dev *coefs = reinterpret_cast<opt_coef_dev *>(P->host + tb + cb + ib);
    int32_t ncoef = 0;
    int32_t last_group = -1, last = -1;
    int64_t last_step = -1;
    int32_t last_decay = -1;
    // keys of the entries: (group, step, decay), searched among the most recent few
    struct key { int32_t group; int32_t decay; int64_t step; };
    key keys[16];
    for (size_t k = 0; k < count; k++) {
        if (t[k].group == last_group && t[k].step == last_step && t[k].decay == last_decay) {
            coef_of[k] = last;
            continue;
        }
        int32_t found = -1;
        for (int32_t q = ncoef - 1; q >= 0 && q >= ncoef - 16; q--) {
            const key &e = keys[q % 16];
            if (e.group == t[k].group && e.step == t[k].step && e.decay == t[k].decay) { found = q; break; }
        }
        if (found < 0) {
            const ft_optim_group *g = &cfg->groups[t[k].group];
            coefs[ncoef] = coefficients(g, t[k].step, t[k].decay ? g->weight_decay : 0.0);
            keys[ncoef % 16] = {t[k].group, t[k].decay, t[k].step};
            found = ncoef++;
        }
        coef_of[k] = found;
        last_group = t[k].group; last_step = t[k].step; last_decay = t[k].decay; last = found;
    }
    // coef_of and the used coefficients in one copy (the coefficients start at ib)
    FT_CU(cudaMemcpyAsync(ws + o_coef_of, coef_of, ib + (size_t)ncoef * sizeof(opt_coef_dev), cudaMemcpyHostToDevice,
                          c->stream), "optimizer coefficients upload");
    const opt_tensor_dev *T = reinterpret_cast<const opt_tensor_dev *>(ws);
    const opt_chunk_dev *C = reinterpret_cast<const opt_chunk_dev *>(ws + o_chunks);
    float2 *partial = reinterpret_cast<float2 *>(ws + o_partial);
    opt_scalars *sc = reinterpret_cast<opt_scalars *>(ws + o_scalars);
    float *step = reinterpret_cast<float *>(ws + o_step);
    const int32_t *CI = reinterpret_cast<const int32_t *>(ws + o_coef_of);
    const opt_coef_dev *K = reinterpret_cast<const opt_coef_dev *>(ws + o_coefs);
    ft_status st = FT_OK;

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
        FT_LAUNCH(lamb_moments_kernel, grid, OPT_THREADS, 0, c->stream)(T, K, CI, C, sc, have, partial);
        FT_LAUNCH(trust_ratio_kernel, (unsigned)count, 256, 0, c->stream)(T, K, CI, partial, sc, have, step);
        FT_LAUNCH(lamb_apply_kernel, grid, OPT_THREADS, 0, c->stream)(T, K, CI, C, step, sc, have);
        launches += 3;
    } else {
        FT_LAUNCH(adamw_kernel, grid, OPT_THREADS, 0, c->stream)(T, K, CI, C, sc, have);
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
