// Fused multi-tensor LAMB and AdamW on CUDA (equations: ft_optimizer_step in fasttran.h).
//
// Multi-tensor apply: every tensor is cut into chunks of OPT_CHUNK elements and one table of
// (tensor, start) chunks drives every kernel, so a step is a number of launches that does not
// depend on the number of tensors:
//   [grad_sumsq -> global_norm]   only with clipping or the finiteness check     2 launches
//   LAMB:  G + 1 launches over G groups of tensors (below)
//   AdamW: update                                                                1 launch
// (reported in ft_optim_info.kernel_launches). Memory-bound: AdamW reads g, m, v, w and writes m,
// v, w once (28 bytes a parameter). LAMB needs the norm of a tensor's whole update u before any
// of its weights can move, so each tensor takes two passes: moments (new m, v; partial sums of
// ||u||^2 and ||w||^2 per chunk) and apply (u recomputed from the new m, v rather than stored --
// one write and one read less per element -- then w -= lr * trust ratio * u). Run over the whole
// model one after the other, the second pass would read m, v, w from device memory again (40
// bytes a parameter; BERT-base's 110M parameters are 1.7 GB a pass, far past any L2). Instead the
// tensors are cut into groups of whole tensors whose (w, m, v, g) bytes (and a half-precision
// copy's) fit a third of the L2 (cudaDevAttrL2CacheSize, read once per context;
// FASTTRAN_CUDA_OPT_GROUP_BYTES overrides the size, for tests), and launch i runs the apply chunks
// of group i-1 (blocks [0, a)) AND the moments chunks of group i (blocks [a, a + b)): group i-1's
// m, v, w are re-read from the L2 right after launch i-1 wrote them, so a step streams device
// memory about once. The apply blocks take their chunks last to first, so the ones written last
// (the likeliest still in the L2) go first. A tensor larger than a group is a group by itself: its
// apply pass reads from the L2 only what is left of it there and the rest from device memory
// again (up to 40 bytes a parameter instead of 28: on an H100, L2 / 3 = 16.7 MB, BERT-base's word
// embeddings (23M parameters) and its 24 feed-forward matrices (2.4M each, 38 MB of w, m, v, g)).
// A group is then only some 64 chunks, so a launch has about 128 blocks: each thread loads a batch
// of its elements before computing them (more bytes in flight; the same operations in the same
// order). FASTTRAN_CUDA_OPT_GROUP_BYTES also lets a device run compare group sizes.
// The trust ratios of group i-1 are final before launch i starts: within launch i-1, the last
// block to finish a chunk of a tensor (a per-tensor atomic counter after a __threadfence, reset by
// that block) sums the tensor's chunk partials in chunk order, in double, with a fixed 256-lane
// tree -- the same order whatever the schedule, so the result is deterministic and bit-identical
// for any group size (and to the earlier separate moments / trust-ratio / apply kernels, whose
// arithmetic this keeps element for element).
//
// The tables stay on the device between steps: the tensor table (addresses, sizes,
// chunk ranges) and the chunk table are uploaded only when an address or a size changes (a
// tensor sits a step out, a gradient moved); the group table (each group's chunk range) is
// rebuilt on the host at the same time and travels as the launches' arguments. A step uploads just
// the coefficients -- one entry per distinct (group, update count), usually one or two -- and each
// tensor's index into them. The host image lives in the backend context (opt_plan), so a steady
// step allocates nothing.
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

__device__ inline void store_copy(const opt_tensor_dev &t, int64_t i, float w) {
    if (!t.copy) return;
    if (t.copy_bf16) static_cast<__nv_bfloat16 *>(t.copy)[i] = __float2bfloat16(w);
    else static_cast<__half *>(t.copy)[i] = __float2half(w);
}

constexpr int TR_LANES = 256;   // the trust ratio's reduction: lane k sums chunks k, k + 256, ..., then a tree
// A LAMB launch holds one group's chunks (about 72 to 128 blocks on an H100), so each thread loads
// LAMB_BATCH elements (its next ones, stride blockDim.x) before using them: more bytes in flight
// per thread, the same operations in the same order as one element at a time. (8: 120 registers,
// one block a multiprocessor; 4: 63, two.)
constexpr int LAMB_BATCH = 4;

// LAMB apply of one chunk: w -= step * u, u recomputed from m, v exactly as the moments pass made it
__device__ inline void lamb_apply_chunk(const opt_tensor_dev *T, const opt_coef_dev *K, const int32_t *coef_of,
                                        const opt_chunk_dev c, const float *step) {
    const opt_tensor_dev t = T[c.t];
    const opt_coef_dev k = K[coef_of[c.t]];
    const float s = step[c.t];
    const int64_t end = c.start + OPT_CHUNK < t.n ? c.start + OPT_CHUNK : t.n, stride = blockDim.x;
    for (int64_t i0 = c.start + threadIdx.x; i0 < end; i0 += LAMB_BATCH * stride) {
        float w[LAMB_BATCH], m[LAMB_BATCH], v[LAMB_BATCH];
        for (int r = 0; r < LAMB_BATCH; r++) {
            const int64_t i = i0 + r * stride;
            if (i < end) { w[r] = t.p[i]; m[r] = t.m[i]; v[r] = t.v[i]; }
        }
        for (int r = 0; r < LAMB_BATCH; r++) {
            const int64_t i = i0 + r * stride;
            if (i < end) {
                float u = (m[r] * k.ibc1) / (sqrtf(v[r] * k.ibc2) + k.eps) + k.wd * w[r];
                const float wn = w[r] - s * u;
                t.p[i] = wn;
                store_copy(t, i, wn);
            }
        }
    }
}

// LAMB moments of chunk j: new m, v and the chunk's (sum u^2, sum w^2); the last block of the
// tensor to get here turns the tensor's partials into its step (lr * trust ratio)
__device__ inline void lamb_moments_chunk(const opt_tensor_dev *T, const opt_coef_dev *K, const int32_t *coef_of,
                                          const opt_chunk_dev *C, int64_t j, float clip, float2 *partial,
                                          float *step, unsigned *done) {
    __shared__ float sh[32];
    __shared__ double su_sh[TR_LANES], sw_sh[TR_LANES];
    __shared__ int last;
    const opt_chunk_dev c = C[j];
    const opt_tensor_dev t = T[c.t];
    const opt_coef_dev k = K[coef_of[c.t]];
    const int64_t end = c.start + OPT_CHUNK < t.n ? c.start + OPT_CHUNK : t.n;
    const int64_t stride = blockDim.x;
    float su = 0.0f, sw = 0.0f;
    for (int64_t i0 = c.start + threadIdx.x; i0 < end; i0 += LAMB_BATCH * stride) {
        float gb[LAMB_BATCH], wb[LAMB_BATCH], mb[LAMB_BATCH], vb[LAMB_BATCH];
        for (int r = 0; r < LAMB_BATCH; r++) {
            const int64_t i = i0 + r * stride;
            if (i < end) { gb[r] = t.g[i]; wb[r] = t.p[i]; mb[r] = t.m[i]; vb[r] = t.v[i]; }
        }
        for (int r = 0; r < LAMB_BATCH; r++) {   // in element order: the sums as one element at a time
            const int64_t i = i0 + r * stride;
            if (i < end) {
                float g = gb[r] * clip, w = wb[r];
                float m = k.b1 * mb[r] + k.omb1 * g;
                float v = k.b2 * vb[r] + k.omb2 * g * g;
                t.m[i] = m;
                t.v[i] = v;
                float u = (m * k.ibc1) / (sqrtf(v * k.ibc2) + k.eps) + k.wd * w;
                su += u * u;
                sw += w * w;
            }
        }
    }
    su = block_sum(su, sh);
    sw = block_sum(sw, sh);
    const unsigned nct = (unsigned)(t.end_chunk - t.first_chunk);
    if (threadIdx.x == 0) {
        partial[j] = make_float2(su, sw);
        __threadfence();   // the partial is visible device-wide before the count says so
        last = atomicAdd(&done[c.t], 1u) == nct - 1;
        if (last) {
            done[c.t] = 0;   // every chunk of the tensor has counted: ready for the next step
            __threadfence();
        }
    }
    __syncthreads();
    if (!last) return;   // uniform over the block
    // the tensor's partials in chunk order (volatile: written by other blocks of this launch)
    const volatile float *pv = reinterpret_cast<const volatile float *>(partial);
    double du = 0.0, dw = 0.0;
    if (threadIdx.x < TR_LANES)
        for (int64_t q = t.first_chunk + threadIdx.x; q < t.end_chunk; q += TR_LANES) {
            du += pv[2 * q];
            dw += pv[2 * q + 1];
        }
    if (threadIdx.x < TR_LANES) { su_sh[threadIdx.x] = du; sw_sh[threadIdx.x] = dw; }
    __syncthreads();
    for (int w = TR_LANES / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) { su_sh[threadIdx.x] += su_sh[threadIdx.x + w]; sw_sh[threadIdx.x] += sw_sh[threadIdx.x + w]; }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        double phi = (su_sh[0] > 0.0 && sw_sh[0] > 0.0) ? sqrt(sw_sh[0]) / sqrt(su_sh[0]) : 1.0;
        step[c.t] = (float)(k.lr_d * phi);
    }
}

// one launch of a LAMB step: blocks [0, napply) apply chunks apply0.., the rest take the moments of
// chunks moments0.. (the previous group's apply and the next group's moments; either may be empty)
__global__ void __launch_bounds__(OPT_THREADS)
lamb_kernel(const opt_tensor_dev *T, const opt_coef_dev *K, const int32_t *coef_of, const opt_chunk_dev *C,
            const opt_scalars *sc, int have_scalars, int64_t apply0, int64_t napply, int64_t moments0,
            float2 *partial, float *step, unsigned *done) {
    if (skip_step(sc, have_scalars)) return;
    if ((int64_t)blockIdx.x < napply) {
        // backwards: the chunks the previous launch wrote last are the likeliest still in the L2
        lamb_apply_chunk(T, K, coef_of, C[apply0 + napply - 1 - blockIdx.x], step);
        return;
    }
    const float clip = have_scalars ? sc->clip : 1.0f;
    lamb_moments_chunk(T, K, coef_of, C, moments0 + ((int64_t)blockIdx.x - napply), clip, partial, step, done);
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
//   [tensor table tb][chunk table cb][partials pb][scalars sb][per-tensor step stb][per-tensor done
//   counters db][coef_of ib][coefs kb]
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
    int64_t l2_bytes;        // the device's L2 (read on the first step)
    int64_t group_bytes;     // LAMB's group size the group table was cut for
    int64_t *groups;         // LAMB's groups: group q = chunks [groups[q], groups[q + 1]), none empty
    size_t ngroups, groups_cap;
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
    free(p->groups);
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

// LAMB's group size in bytes: FASTTRAN_CUDA_OPT_GROUP_BYTES when set (tests: several groups on
// small tensors), else a third of the L2, so that a group's m, v, w are still there when the next
// launch applies it while the following group's moments stream through
static ft_status lamb_group_bytes(cuda_ctx *c, opt_plan *P, int64_t *out) {
    const char *e = getenv("FASTTRAN_CUDA_OPT_GROUP_BYTES");
    if (e && *e) {
        char *end = nullptr;
        const long long v = strtoll(e, &end, 10);
        if (*end || v <= 0)
            return g_host->error(FT_ERR_INVALID_ARGUMENT,
                                 "FASTTRAN_CUDA_OPT_GROUP_BYTES=%s is not a positive number of bytes", e);
        *out = v;
        return FT_OK;
    }
    if (!P->l2_bytes) {
        int l2 = 0;
        FT_CU(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, c->device), "reading the L2 cache size");
        P->l2_bytes = l2 > 0 ? l2 : 1;
    }
    *out = P->l2_bytes / 3 > 0 ? P->l2_bytes / 3 : 1;
    return FT_OK;
}

// cut the tensors into groups of whole tensors of at most `limit` bytes of (w, m, v, g) and copy
// (a larger tensor alone); groups are kept as chunk ranges, empty ones (tensors of no element) dropped
static bool cut_groups(opt_plan *P, const opt_tensor_dev *ht, size_t count, int64_t limit) {
    char *buf = reinterpret_cast<char *>(P->groups);
    if (!grow_host(&buf, &P->groups_cap, (count + 1) * sizeof(int64_t))) return false;
    P->groups = reinterpret_cast<int64_t *>(buf);
    size_t ng = 0;
    P->groups[0] = 0;
    int64_t bytes = 0;
    for (size_t k = 0; k < count; k++) {
        const int64_t b = ht[k].n * (int64_t)(4 * sizeof(float) + (ht[k].copy ? 2 : 0));
        if (bytes > 0 && bytes + b > limit) {   // close the current group before tensor k
            P->groups[++ng] = ht[k].first_chunk;
            bytes = 0;
        }
        bytes += b;
    }
    if (bytes > 0) P->groups[++ng] = ht[count - 1].end_chunk;
    P->ngroups = ng;
    return true;
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
                 stb = align256(count * sizeof(float)), db = align256(count * sizeof(unsigned)),
                 ib = align256(count * sizeof(int32_t)),
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
    const size_t need = tb + cb + pb + sb + stb + db + ib + kb;
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
                 o_done = o_step + stb, o_coef_of = o_done + db, o_coefs = o_coef_of + ib;
    // the static tables sit at fixed offsets for a given (count, nchunks): a different layout re-sends them
    const bool same = P->valid && P->uploaded_count == count && P->nchunks == nchunks &&
                      memcmp(P->uploaded, ht, count * sizeof(opt_tensor_dev)) == 0;
    int64_t group_bytes = 0;
    if (cfg->kind == FT_OPT_LAMB) FT_TRY(lamb_group_bytes(c, P, &group_bytes));
    if (!same || group_bytes != P->group_bytes) {
        if (!cut_groups(P, ht, count, group_bytes > 0 ? group_bytes : INT64_MAX))
            return g_host->error(FT_ERR_NOMEM, "optimizer step: out of host memory for %zu tensors", count);
        P->group_bytes = group_bytes;
    }
    if (!same) {
        opt_chunk_dev *hc = reinterpret_cast<opt_chunk_dev *>(P->host + tb);
        j = 0;
        for (size_t k = 0; k < count; k++)
            for (int64_t a = 0; a < t[k].n; a += OPT_CHUNK) hc[j++] = {(int32_t)k, a};
        P->valid = 0;
        FT_CU(cudaMemcpyAsync(ws, P->host, tb + cb, cudaMemcpyHostToDevice, c->stream), "optimizer table upload");
        // LAMB's per-tensor counters start at zero (the last block of a tensor resets its own)
        FT_CU(cudaMemsetAsync(ws + o_done, 0, db, c->stream), "optimizer counters");
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
    unsigned *done = reinterpret_cast<unsigned *>(ws + o_done);
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
        // launch q: the apply of group q - 1 and the moments of group q (groups + 1 launches)
        const int64_t *G = P->groups;
        const int64_t ng = (int64_t)P->ngroups;
        for (int64_t q = 0; q <= ng; q++) {
            const int64_t apply0 = q > 0 ? G[q - 1] : 0, napply = q > 0 ? G[q] - G[q - 1] : 0;
            const int64_t moments0 = q < ng ? G[q] : 0, nmoments = q < ng ? G[q + 1] - G[q] : 0;
            FT_LAUNCH(lamb_kernel, (unsigned)(napply + nmoments), OPT_THREADS, 0, c->stream)(
                T, K, CI, C, sc, have, apply0, napply, moments0, partial, step, done);
        }
        launches += (int)ng + 1;
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
