// Attention through cuDNN's fused SDPA where cuDNN is there and takes the configuration; the ops
// of attention.cu and train_attention.cu ask here first and run their own kernels otherwise.
//
// cuDNN lives in fasttran/libfasttran_cudnn.so (cudnn_att.cpp, built only where the cuDNN headers
// were installed at build time), opened here on first use beside this library; it is linked to
// libcudnn.so.9 of the nvidia-cudnn-cu13 wheel, so a machine without the wheel, without a GPU
// (cudnnCreate fails), or with FASTTRAN_CUDA_ATTENTION=wmma keeps our kernels, and
// ft_cuda_attention_info says which runs and why. The emulator never runs cuDNN.
//
// What goes to cuDNN:
//   attention_forward in float16 / bfloat16 storage: qkv and ctx are already [T, 3, H, D] and
//     [T, H, D] in the storage type, so cuDNN reads and writes them in place.
//   with FASTTRAN_CUDA_ATTENTION=cudnn also (not by default: ctx and dqkv come back rounded to
//   bf16 / fp16 and the statistics in another form, so the training ops would no longer give the
//   same bits from kept and from recomputed probabilities, which their tests hold them to)
//   attention_train_forward / attention_backward with bf16 / fp16 products, no dropout and the
//     probabilities not kept (statistics only: recompute_attention_probs): the ops' float32 qkv
//     (and dctx) are rounded to the products' type (nearest even, as the WMMA kernels round them)
//     by the conversion kernels below into the backend's cuDNN workspace, and the results widened
//     back to float32 (ctx and dqkv are therefore the bf16 / fp16 values cuDNN wrote). The forward
//     keeps each row's statistics as (m, 1/sum) = (log-sum-exp, 1), which the WMMA backward reads
//     as well; the backward recomputes O and the log-sum-exp with cuDNN's forward (the op is not
//     given the forward's output) before cuDNN's deterministic backward.
// Everything else -- float32, dropout, kept probabilities, head sizes cuDNN refuses, a batch with
// a zero-length sequence (refused by cudnn_att.cpp; our kernels give such a sequence zeros) --
// stays on the WMMA / SIMT kernels. Graphs are built per (kind, type, batch, longest sequence
// rounded up to a power of two >= 64, heads, head size) and kept by cudnn_att.cpp.
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "cuda_common.cuh"
#include "cudnn_att.h"

#ifndef FT_CUDA_EMU
#include <dlfcn.h>
#endif

using namespace ftcuda;

namespace ftcudnn {   // named: nvcc's stubs for kernels break on a reopened anonymous namespace

// ---- conversion kernels (float32 <-> the products' type) ---------------------------------------
template <typename H> __global__ void round_kernel(H *dst, const float *src, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = from_f<H>(src[i]);
}

// rows [first[b], first[b] + len[b]) of dst (width values each) = the same rows of src, widened
template <typename H>
__global__ void widen_rows_kernel(float *dst, const H *src, const int32_t *first, const int32_t *len, int64_t width) {
    const int64_t b = blockIdx.y, n = (int64_t)len[b] * width, base = (int64_t)first[b] * width;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[base + i] = to_f(src[base + i]);
}

// stats (N, NH, 2) rows of sequence b = (lse, 1): P = exp(s - lse) * 1, the WMMA kernels' form
__global__ void stats_kernel(float *stats, const float *lse, const int32_t *first, const int32_t *len, int64_t NH) {
    const int64_t b = blockIdx.y, n = (int64_t)len[b] * NH, base = (int64_t)first[b] * NH;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        stats[2 * (base + i)] = lse[base + i];
        stats[2 * (base + i) + 1] = 1.0f;
    }
}

// ---- the decision, said in words ---------------------------------------------------------------
pthread_mutex_t g_info_lock = PTHREAD_MUTEX_INITIALIZER;
char g_state[512] = "";      // why cuDNN is (not) used at all
char g_last_refusal[512];    // the last configuration that went to our kernels, and why
long long g_runs[3], g_fallbacks;

void note_refusal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void note_refusal(const char *fmt, ...) {
    pthread_mutex_lock(&g_info_lock);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_refusal, sizeof g_last_refusal, fmt, ap);
    va_end(ap);
    g_fallbacks++;
    pthread_mutex_unlock(&g_info_lock);
}

void note_run(int kind) {
    pthread_mutex_lock(&g_info_lock);
    g_runs[kind]++;
    pthread_mutex_unlock(&g_info_lock);
}

#ifdef FT_CUDA_EMU
bool cudnn_ready(cuda_ctx *) {
    pthread_mutex_lock(&g_info_lock);
    snprintf(g_state, sizeof g_state, "wmma: cuDNN: not on the emulator");
    pthread_mutex_unlock(&g_info_lock);
    return false;
}
#else
// ---- libfasttran_cudnn.so, opened once ---------------------------------------------------------
struct cudnn_api {
    decltype(&ft_cudnn_att_versions) versions;
    decltype(&ft_cudnn_att_create) create;
    decltype(&ft_cudnn_att_destroy) destroy;
    decltype(&ft_cudnn_att_prepare) prepare;
    decltype(&ft_cudnn_att_forward) forward;
    decltype(&ft_cudnn_att_backward) backward;
};
cudnn_api g_api;
int g_loaded;   // 0 not tried, 1 loaded, -1 unavailable (g_state says why)
pthread_mutex_t g_load_lock = PTHREAD_MUTEX_INITIALIZER;

// per device: the cuDNN context (handle + graphs), its lock, or why it could not be made
struct device_cudnn {
    pthread_mutex_t use;
    ft_cudnn_att *att;
    int tried;
};
device_cudnn g_dev[64];

void set_state(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void set_state(const char *fmt, ...) {
    pthread_mutex_lock(&g_info_lock);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_state, sizeof g_state, fmt, ap);
    va_end(ap);
    pthread_mutex_unlock(&g_info_lock);
}

int g_training;   // FASTTRAN_CUDA_ATTENTION=cudnn: the training ops through cuDNN too

void load_library() {
    const char *env = getenv("FASTTRAN_CUDA_ATTENTION");
    if (env && *env && strcmp(env, "auto") && strcmp(env, "cudnn")) {
        if (!strcmp(env, "wmma")) set_state("wmma: FASTTRAN_CUDA_ATTENTION=wmma");
        else set_state("wmma: FASTTRAN_CUDA_ATTENTION=%s is not auto, cudnn or wmma", env);
        g_loaded = -1;
        return;
    }
    g_training = env && !strcmp(env, "cudnn");
    Dl_info info;
    if (!dladdr((void *)&load_library, &info) || !info.dli_fname) {
        set_state("wmma: cuDNN: cannot locate the CUDA backend library");
        g_loaded = -1;
        return;
    }
    std::string path(info.dli_fname);
    path = path.substr(0, path.find_last_of('/') + 1) + "libfasttran_cudnn.so";
    FILE *f = fopen(path.c_str(), "rb");
    if (!f) {
        set_state("wmma: cuDNN attention not built (the cuDNN and cudnn-frontend headers were not installed when "
                  "fasttran was built: pip install nvidia-cudnn-frontend nvidia-cudnn-cu13 nvidia-cuda-nvrtc, then "
                  "reinstall fasttran with FASTTRAN_CUDA=1)");
        g_loaded = -1;
        return;
    }
    fclose(f);
    void *h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        set_state("wmma: cuDNN not loadable (%s): pip install nvidia-cudnn-cu13 nvidia-cuda-nvrtc", e ? e : "?");
        g_loaded = -1;
        return;
    }
    g_api.versions = (decltype(g_api.versions))dlsym(h, "ft_cudnn_att_versions");
    g_api.create = (decltype(g_api.create))dlsym(h, "ft_cudnn_att_create");
    g_api.destroy = (decltype(g_api.destroy))dlsym(h, "ft_cudnn_att_destroy");
    g_api.prepare = (decltype(g_api.prepare))dlsym(h, "ft_cudnn_att_prepare");
    g_api.forward = (decltype(g_api.forward))dlsym(h, "ft_cudnn_att_forward");
    g_api.backward = (decltype(g_api.backward))dlsym(h, "ft_cudnn_att_backward");
    if (!g_api.versions || !g_api.create || !g_api.destroy || !g_api.prepare || !g_api.forward || !g_api.backward) {
        set_state("wmma: %s lacks the ft_cudnn_att_* functions: rebuild fasttran", path.c_str());
        g_loaded = -1;
        return;
    }
    size_t built = 0, loaded = 0;
    g_api.versions(&built, &loaded);
    if (loaded / 100 == 910 || loaded < 90100) {   // 9.10.0/1: known forward bugs; < 9.1: no packed ragged
        set_state("wmma: cuDNN %zu.%zu.%zu loaded: ragged packed attention needs 9.1 or newer, not 9.10.0/9.10.1",
                  loaded / 10000, loaded / 100 % 100, loaded % 100);
        g_loaded = -1;
        return;
    }
    set_state("cudnn: cuDNN %zu.%zu.%zu (built against %zu.%zu.%zu) fused attention for the forward in float16 / "
              "bfloat16 storage%s; our kernels for the rest", loaded / 10000, loaded / 100 % 100, loaded % 100,
              built / 10000, built / 100 % 100, built % 100,
              g_training ? " and for training with bf16 / fp16 products, no dropout, no kept probabilities "
                           "(FASTTRAN_CUDA_ATTENTION=cudnn)"
                         : " (training ops through cuDNN too with FASTTRAN_CUDA_ATTENTION=cudnn)");
    g_loaded = 1;
}

// the device's cuDNN context (locked: the caller unlocks dev->use), or NULL: use our kernels
device_cudnn *cudnn_device(cuda_ctx *c) {
    pthread_mutex_lock(&g_load_lock);
    if (!g_loaded) load_library();
    device_cudnn *d = g_loaded == 1 && c->device >= 0 && c->device < 64 ? &g_dev[c->device] : nullptr;
    if (d && !d->tried) {
        d->tried = 1;
        pthread_mutex_init(&d->use, nullptr);
        char err[512] = "";
        if (g_api.create(c->device, &d->att, err, sizeof err) != FT_CUDNN_ATT_OK) {
            set_state("wmma: cuDNN found but not usable on device %d: %s", c->device, err);
            d->att = nullptr;
        }
        cudaGetLastError();   // cuDNN's own CUDA errors are not this backend's
    }
    pthread_mutex_unlock(&g_load_lock);
    if (!d || !d->att) return nullptr;
    pthread_mutex_lock(&d->use);
    return d;
}

bool cudnn_ready(cuda_ctx *c) {
    device_cudnn *d = cudnn_device(c);
    if (d) pthread_mutex_unlock(&d->use);
    return d != nullptr;
}
#endif

// the longest sequence's bucket: a power of two, at least 64 (few graphs, each built once)
int64_t bucket(int64_t n) {
    int64_t s = 64;
    while (s < n) s *= 2;
    return s;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// the backend's cuDNN workspace, grown (never shrunk) through the backend's allocator
ft_status grow_workspace(ft_backend *be, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    if (c->cudnn_ws_bytes >= bytes) return FT_OK;
    if (c->cudnn_ws) cuda_free(be, c->cudnn_ws);
    c->cudnn_ws = nullptr;
    c->cudnn_ws_bytes = 0;
    FT_TRY(cuda_alloc(be, bytes, &c->cudnn_ws));
    c->cudnn_ws_bytes = bytes;
    return FT_OK;
}

// One call's plan: the sequence tables (host copy, then device), the end of the packed rows.
struct call_tables {
    std::vector<unsigned char> host;   // q_len, kv_len, first (B int32 each), then 3 x (B + 1) int64, each 256-aligned
    size_t bytes = 0;
    int64_t end = 0, longest = 0;
    std::vector<int32_t> q_len, kv_len;
};

// every table starts on a 256-byte boundary (cuDNN's tensors want 16 at least): in 4-byte units
// for the int32 tables, 8-byte for the int64 ones
int64_t i32_stride(int64_t B) { return (int64_t)(align256((size_t)B * 4) / 4); }
int64_t i64_stride(int64_t B) { return (int64_t)(align256(((size_t)B + 1) * 8) / 8); }

// the tables from the ops' (B, 3) host table: first row, key rows, query rows (train: rows for
// both, key_col == query_col); false when a sequence is empty or has keys past its queries (our
// kernels take that batch)

bool make_tables(call_tables &t, const int32_t *seqs, int64_t B, int64_t C, int64_t NH, int key_col, int query_col) {
    t.q_len.resize(B);
    t.kv_len.resize(B);
    std::vector<int32_t> first(B);
    for (int64_t b = 0; b < B; b++) {
        first[b] = seqs[3 * b];
        t.kv_len[b] = seqs[3 * b + key_col];
        t.q_len[b] = seqs[3 * b + query_col];
        if (t.q_len[b] < 1 || t.kv_len[b] < 1 || t.kv_len[b] > t.q_len[b]) return false;
        t.end = first[b] + t.q_len[b] > t.end ? first[b] + t.q_len[b] : t.end;
        t.longest = t.q_len[b] > t.longest ? t.q_len[b] : t.longest;
    }
    const int64_t s32 = i32_stride(B), s64 = i64_stride(B);
    t.bytes = (size_t)(3 * s32 * 4 + 3 * s64 * 8);
    t.host.assign(t.bytes, 0);
    int32_t *i32 = reinterpret_cast<int32_t *>(t.host.data());
    memcpy(i32, t.q_len.data(), B * 4);
    memcpy(i32 + s32, t.kv_len.data(), B * 4);
    memcpy(i32 + 2 * s32, first.data(), B * 4);
    int64_t *o = reinterpret_cast<int64_t *>(t.host.data() + 3 * s32 * 4);
    for (int64_t b = 0; b <= B; b++) {
        const int64_t row = b < B ? first[b] : t.end;
        o[b] = row * 3 * C;          // qkv rows
        o[s64 + b] = row * C;        // o rows
        o[2 * s64 + b] = row * NH;   // statistics rows
    }
    return true;
}

struct device_tables {
    const int32_t *q_len, *kv_len, *first;
    ft_cudnn_att_seqs seqs;
};

device_tables place_tables(const call_tables &t, void *dev, int64_t B) {
    device_tables d;
    const int64_t s32 = i32_stride(B), s64 = i64_stride(B);
    const int32_t *i32 = static_cast<const int32_t *>(dev);
    d.q_len = i32;
    d.kv_len = i32 + s32;
    d.first = i32 + 2 * s32;
    const int64_t *o = reinterpret_cast<const int64_t *>(static_cast<const unsigned char *>(dev) + 3 * s32 * 4);
    d.seqs.q_len = d.q_len;
    d.seqs.kv_len = d.kv_len;
    d.seqs.qkv_off = o;
    d.seqs.o_off = o + s64;
    d.seqs.stats_off = o + 2 * s64;
    d.seqs.host_q_len = t.q_len.data();
    d.seqs.host_kv_len = t.kv_len.data();
    return d;
}

// the products' type of a half dtype, in cudnn_att.h's words
int att_type(ft_dtype dt) { return dt == FT_F16 ? FT_CUDNN_ATT_F16 : FT_CUDNN_ATT_BF16; }

// the configuration checks every path shares (false: our kernels, with the reason noted)
bool shape_ok(cuda_ctx *c, const char *op, int64_t C, int64_t NH, const void *p0, const void *p1) {
    const int64_t hs = C / NH;
    if (hs % 8 || C % NH) {
        note_refusal("%s: head size %lld is not a multiple of 8 (cuDNN's rule)", op, (long long)hs);
        return false;
    }
    if (((uintptr_t)p0 | (uintptr_t)p1) & 15) {
        note_refusal("%s: operands not 16-byte aligned", op);
        return false;
    }
    if (c->cc_major < 8) {
        note_refusal("%s: compute capability %d.x: cuDNN's fused attention needs 8.0+", op, c->cc_major);
        return false;
    }
    return true;
}

ft_status cudnn_error(int st, const char *op, const char *err) {
    return g_host->error(st == FT_CUDNN_ATT_INVALID ? FT_ERR_INVALID_ARGUMENT : FT_ERR_DEVICE, "%s: %s", op, err);
}

}  // namespace ftcudnn
using namespace ftcudnn;

namespace ftcuda {

void cudnn_release(cuda_ctx *c) {
    if (c->cudnn_ws) cudaFree(c->cudnn_ws);
    c->cudnn_ws = nullptr;
    c->cudnn_ws_bytes = 0;
}

#ifdef FT_CUDA_EMU
ft_status cudnn_attention_forward(ft_backend *, ft_dtype, void *, const void *, const int32_t *, int64_t, int64_t,
                                  int64_t, int64_t, bool *ran) {
    *ran = false;
    cudnn_ready(nullptr);
    return FT_OK;
}
ft_status cudnn_attention_train_forward(ft_backend *, ft_dtype, float *, float *, const float *, const int32_t *,
                                        int64_t, int64_t, int64_t, int64_t, bool *ran) {
    *ran = false;
    cudnn_ready(nullptr);
    return FT_OK;
}
ft_status cudnn_attention_backward(ft_backend *, ft_dtype, float *, const float *, const float *, const int32_t *,
                                   int64_t, int64_t, int64_t, int64_t, bool *ran) {
    *ran = false;
    cudnn_ready(nullptr);
    return FT_OK;
}
#else
ft_status cudnn_attention_forward(ft_backend *be, ft_dtype dt, void *ctx, const void *qkv, const int32_t *seqs,
                                  int64_t B, int64_t C, int64_t NH, int64_t window, bool *ran) {
    const char *op = "attention_forward";
    *ran = false;
    cuda_ctx *c = ctx_of(be);
    if (!cudnn_ready(c) || !shape_ok(c, op, C, NH, ctx, qkv)) return FT_OK;
    call_tables t;
    if (!make_tables(t, seqs, B, C, NH, 1, 2)) {
        note_refusal("%s: a sequence with no query or no key row (our kernel gives it zeros)", op);
        return FT_OK;
    }
    for (int64_t b = 0; window > 0 && b < B; b++)
        if (t.q_len[b] > t.kv_len[b] + window / 2) {
            note_refusal("%s: window %lld: sequence %lld has query rows beyond every key's reach (%d queries, %d "
                         "keys; our kernel gives them zeros)", op, (long long)window, (long long)b, t.q_len[b],
                         t.kv_len[b]);
            return FT_OK;
        }
    const ft_cudnn_att_shape shape = {FT_CUDNN_ATT_FWD, att_type(dt), B, bucket(t.longest), NH, C / NH, window};
    device_cudnn *d = cudnn_device(c);
    if (!d) return FT_OK;
    char err[1024] = "";
    size_t ws = 0;
    int st = g_api.prepare(d->att, &shape, &ws, err, sizeof err);
    ft_status out = FT_OK;
    if (st == FT_CUDNN_ATT_REFUSED) {
        note_refusal("%s", err);
    } else if (st != FT_CUDNN_ATT_OK) {
        out = cudnn_error(st, op, err);
    } else if ((out = grow_workspace(be, t.bytes + align256(ws))) == FT_OK) {
        unsigned char *w = static_cast<unsigned char *>(c->cudnn_ws);
        const cudaError_t e = cudaMemcpyAsync(w, t.host.data(), t.bytes, cudaMemcpyHostToDevice, c->stream);
        if (e != cudaSuccess) {
            out = cuda_fail(e, "attention_forward (cuDNN tables)");
        } else {
            device_tables dt_ = place_tables(t, w, B);
            st = g_api.forward(d->att, &shape, c->stream, &dt_.seqs, qkv, ctx, nullptr, w + t.bytes, err, sizeof err);
            if (st != FT_CUDNN_ATT_OK) out = cudnn_error(st, op, err);
            else *ran = true;
        }
    }
    pthread_mutex_unlock(&d->use);
    if (*ran) note_run(FT_CUDNN_ATT_FWD);
    return out;
}

namespace train_path {

// the training paths' device buffers after the tables and the cuDNN workspace: qkv and o in the
// products' type, the log-sum-exp rows, dO and dqkv (backward only)
struct train_bufs {
    void *qkv, *o, *dout, *dqkv;
    float *lse;
    unsigned char *ws;
    size_t bytes;
};

train_bufs layout(const call_tables &t, size_t ws, int64_t C, int64_t NH, bool backward) {
    train_bufs b{};
    const size_t N = (size_t)t.end;
    size_t at = t.bytes;
    b.ws = reinterpret_cast<unsigned char *>(at);
    at += align256(ws);
    b.qkv = reinterpret_cast<void *>(at);
    at += align256(N * 3 * C * 2);
    b.o = reinterpret_cast<void *>(at);
    at += align256(N * C * 2);
    b.lse = reinterpret_cast<float *>(at);
    at += align256(N * NH * 4);
    if (backward) {
        b.dout = reinterpret_cast<void *>(at);
        at += align256(N * C * 2);
        b.dqkv = reinterpret_cast<void *>(at);
        at += align256(N * 3 * C * 2);
    }
    b.bytes = at;
    return b;
}

template <typename P> P *at(void *base, P *offset) {
    return reinterpret_cast<P *>(static_cast<unsigned char *>(base) + reinterpret_cast<uintptr_t>(offset));
}

template <typename H> ft_status round_into(cuda_ctx *c, void *dst, const float *src, int64_t n, const char *op) {
    FT_LAUNCH(round_kernel<H>, grid_of(n, 256), 256, 0, c->stream)(static_cast<H *>(dst), src, n);
    return launched(op);
}

template <typename H>
ft_status widen_rows(cuda_ctx *c, float *dst, const void *src, const device_tables &d, int64_t B, int64_t width,
                     int64_t longest, const char *op) {
    for (int64_t b0 = 0; b0 < B; b0 += 65535) {
        const int64_t nb = B - b0 < 65535 ? B - b0 : 65535;
        const unsigned gx = grid_of(longest * width, 256) < 1024 ? grid_of(longest * width, 256) : 1024;
        FT_LAUNCH(widen_rows_kernel<H>, dim3(gx, (unsigned)nb), 256, 0, c->stream)(
            dst, static_cast<const H *>(src), d.first + b0, d.q_len + b0, width);
        FT_TRY(launched(op));
    }
    return FT_OK;
}

// the shared part of the two training paths: the first `values` floats of qkv rounded, then
// cuDNN's forward with statistics into b.o and b.lse
template <typename H>
int train_forward_run(cuda_ctx *c, device_cudnn *dv, const ft_cudnn_att_shape &fwd, const train_bufs &b,
                      const device_tables &d, const float *qkv, int64_t values, char *err, size_t n, ft_status *fail) {
    *fail = round_into<H>(c, b.qkv, qkv, values, "attention (cuDNN rounding)");
    if (*fail != FT_OK) return FT_CUDNN_ATT_FAILED;
    return g_api.forward(dv->att, &fwd, c->stream, &d.seqs, b.qkv, b.o, b.lse, b.ws, err, n);
}

}  // namespace train_path
using namespace train_path;

ft_status cudnn_attention_train_forward(ft_backend *be, ft_dtype prec, float *ctx, float *stats, const float *qkv,
                                        const int32_t *seqs, int64_t B, int64_t C, int64_t NH, int64_t window,
                                        bool *ran) {
    const char *op = "attention_train_forward";
    *ran = false;
    cuda_ctx *c = ctx_of(be);
    if (!cudnn_ready(c) || !g_training || !shape_ok(c, op, C, NH, ctx, qkv)) return FT_OK;
    call_tables t;
    if (!make_tables(t, seqs, B, C, NH, 1, 1)) {
        note_refusal("%s: an empty sequence (our kernel takes the batch)", op);
        return FT_OK;
    }
    const ft_cudnn_att_shape fwd = {FT_CUDNN_ATT_FWD_STATS, att_type(prec), B, bucket(t.longest), NH, C / NH, window};
    device_cudnn *d = cudnn_device(c);
    if (!d) return FT_OK;
    char err[1024] = "";
    size_t ws = 0;
    ft_status out = FT_OK;
    int st = g_api.prepare(d->att, &fwd, &ws, err, sizeof err);
    if (st == FT_CUDNN_ATT_REFUSED) note_refusal("%s", err);
    else if (st != FT_CUDNN_ATT_OK) out = cudnn_error(st, op, err);
    else {
        train_bufs b = layout(t, ws, C, NH, false);
        if ((out = grow_workspace(be, b.bytes)) == FT_OK) {
            void *w = c->cudnn_ws;
            b = train_bufs{at(w, b.qkv), at(w, b.o), nullptr, nullptr, at(w, b.lse), at(w, b.ws), b.bytes};
            const cudaError_t e = cudaMemcpyAsync(w, t.host.data(), t.bytes, cudaMemcpyHostToDevice, c->stream);
            if (e != cudaSuccess) out = cuda_fail(e, "attention_train_forward (cuDNN tables)");
            else {
                const device_tables dtab = place_tables(t, w, B);
                out = with_dtype(prec, op, [&](auto tag) -> ft_status {
                    typedef decltype(tag) H;
                    if constexpr (sizeof(H) == 2) {
                        ft_status f = FT_OK;
                        const int r = train_forward_run<H>(c, d, fwd, b, dtab, qkv, t.end * 3 * C, err, sizeof err, &f);
                        if (f != FT_OK) return f;
                        if (r != FT_CUDNN_ATT_OK) return cudnn_error(r, op, err);
                        FT_TRY(widen_rows<H>(c, ctx, b.o, dtab, B, C, t.longest, op));
                        for (int64_t b0 = 0; b0 < B; b0 += 65535) {
                            const int64_t nb = B - b0 < 65535 ? B - b0 : 65535;
                            FT_LAUNCH(stats_kernel, dim3(grid_of(t.longest * NH, 256), (unsigned)nb), 256, 0,
                                      c->stream)(stats, b.lse, dtab.first + b0, dtab.q_len + b0, NH);
                            FT_TRY(launched(op));
                        }
                        *ran = true;
                        return FT_OK;
                    }
                    return dtype_error(prec, op);
                });
            }
        }
    }
    pthread_mutex_unlock(&d->use);
    if (*ran) note_run(FT_CUDNN_ATT_FWD_STATS);
    return out;
}

ft_status cudnn_attention_backward(ft_backend *be, ft_dtype prec, float *dqkv, const float *dctx, const float *qkv,
                                   const int32_t *seqs, int64_t B, int64_t C, int64_t NH, int64_t window, bool *ran) {
    const char *op = "attention_backward";
    *ran = false;
    cuda_ctx *c = ctx_of(be);
    if (!cudnn_ready(c) || !g_training || !shape_ok(c, op, C, NH, dqkv, qkv) || !shape_ok(c, op, C, NH, dctx, qkv))
        return FT_OK;
    call_tables t;
    if (!make_tables(t, seqs, B, C, NH, 1, 1)) {
        note_refusal("%s: an empty sequence (our kernel takes the batch)", op);
        return FT_OK;
    }
    const int64_t S = bucket(t.longest);
    const ft_cudnn_att_shape fwd = {FT_CUDNN_ATT_FWD_STATS, att_type(prec), B, S, NH, C / NH, window};
    const ft_cudnn_att_shape bwd = {FT_CUDNN_ATT_BWD, att_type(prec), B, S, NH, C / NH, window};
    device_cudnn *d = cudnn_device(c);
    if (!d) return FT_OK;
    char err[1024] = "";
    size_t ws_f = 0, ws_b = 0;
    ft_status out = FT_OK;
    int st = g_api.prepare(d->att, &fwd, &ws_f, err, sizeof err);
    if (st == FT_CUDNN_ATT_OK) st = g_api.prepare(d->att, &bwd, &ws_b, err, sizeof err);
    if (st == FT_CUDNN_ATT_REFUSED) note_refusal("%s", err);
    else if (st != FT_CUDNN_ATT_OK) out = cudnn_error(st, op, err);
    else {
        train_bufs b = layout(t, ws_f > ws_b ? ws_f : ws_b, C, NH, true);
        if ((out = grow_workspace(be, b.bytes)) == FT_OK) {
            void *w = c->cudnn_ws;
            b = train_bufs{at(w, b.qkv), at(w, b.o), at(w, b.dout), at(w, b.dqkv), at(w, b.lse), at(w, b.ws), b.bytes};
            const cudaError_t e = cudaMemcpyAsync(w, t.host.data(), t.bytes, cudaMemcpyHostToDevice, c->stream);
            if (e != cudaSuccess) out = cuda_fail(e, "attention_backward (cuDNN tables)");
            else {
                const device_tables dtab = place_tables(t, w, B);
                out = with_dtype(prec, op, [&](auto tag) -> ft_status {
                    typedef decltype(tag) H;
                    if constexpr (sizeof(H) == 2) {
                        ft_status f = FT_OK;
                        // O and the log-sum-exp again (the op is not given the forward's output)
                        int r = train_forward_run<H>(c, d, fwd, b, dtab, qkv, t.end * 3 * C, err, sizeof err, &f);
                        if (f != FT_OK) return f;
                        if (r != FT_CUDNN_ATT_OK) return cudnn_error(r, op, err);
                        FT_TRY(round_into<H>(c, b.dout, dctx, t.end * C, op));
                        r = g_api.backward(d->att, &bwd, c->stream, &dtab.seqs, b.qkv, b.o, b.dout, b.lse, b.dqkv,
                                           b.ws, err, sizeof err);
                        if (r != FT_CUDNN_ATT_OK) return cudnn_error(r, op, err);
                        FT_TRY(widen_rows<H>(c, dqkv, b.dqkv, dtab, B, 3 * C, t.longest, op));
                        *ran = true;
                        return FT_OK;
                    }
                    return dtype_error(prec, op);
                });
            }
        }
    }
    pthread_mutex_unlock(&d->use);
    if (*ran) note_run(FT_CUDNN_ATT_BWD);
    return out;
}
#endif

}  // namespace ftcuda

// Which attention runs on the CUDA backend and why, for build_info() and memory_report(): the
// state ("cudnn: ..." or "wmma: <why not cuDNN>"), the calls cuDNN ran per kind (forward, forward
// with statistics, backward), the calls that went to our kernels and the last reason.
// device >= 0: also make that device's cuDNN handle (the first call on a device otherwise does).
extern "C" __attribute__((visibility("default"))) int ft_cuda_attention_info(int device, char *buf, size_t n) {
#ifndef FT_CUDA_EMU
    if (device >= 0 && device < 64) {
        cuda_ctx probe{};
        probe.device = device;
        cudnn_ready(&probe);
    } else {
        pthread_mutex_lock(&g_load_lock);
        if (!g_loaded) load_library();
        pthread_mutex_unlock(&g_load_lock);
    }
#else
    (void)device;
    cudnn_ready(nullptr);
#endif
    pthread_mutex_lock(&g_info_lock);
    snprintf(buf, n, "%s\x1f%lld\x1f%lld\x1f%lld\x1f%lld\x1f%s", g_state, g_runs[0], g_runs[1], g_runs[2], g_fallbacks,
             g_last_refusal);
    pthread_mutex_unlock(&g_info_lock);
    return 0;
}
