// cuDNN's fused attention (SDPA) over our packed rows, behind the C interface of cudnn_att.h.
//
// Host C++17 over cudnn-frontend (header-only; PyPI nvidia-cudnn-frontend) and cuDNN 9 (PyPI
// nvidia-cudnn-cu13), built into fasttran/libfasttran_cudnn.so by setup.py wherever those headers
// are installed next to the nvcc build; the CUDA backend opens that library at run time
// (attention_cudnn.cu), so cuDNN is never a dependency of the rest.
//
// The graphs: padding-free ragged (THD) tensors over the packed QKV rows [T, 3, H, D] -- token
// stride 3 H D, head stride D, Q, K and V at element offsets 0, H D and 2 H D of the same buffer,
// one ragged-offset table (first row x 3 H D) shared by the three and by dQ, dK, dV; O and dO [T, H,
// D] with their own table; the statistics [T, H] floats with theirs. Sequence lengths through
// cuDNN's seq_len_q / seq_len_kv padding masks (never a bias mask: bias-mask attention gave NaN in
// dQ on H100/H200 at seq % 128 == 64). The backward is cuDNN's deterministic algorithm. A window
// (local attention) is the frontend's diagonal band on the same graphs (SDPA_attributes' and
// SDPA_backward_attributes' set_diagonal_band_left_bound / _right_bound, top-left aligned: our
// keys start at the queries' first row); a frontend without those setters refuses windowed shapes,
// saying so. A graph is built once per (kind, type, B, S, H, D, window) and kept with its workspace
// size; a configuration cuDNN refuses is remembered as refused, with cuDNN's reason.
#include "cudnn_att.h"

#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>
#include <cudnn_frontend.h>

namespace fe = cudnn_frontend;

namespace {

enum uid : int64_t {
    U_Q = 1, U_K, U_V, U_O, U_STATS, U_DO, U_DQ, U_DK, U_DV, U_SEQ_Q, U_SEQ_KV, U_OFF_QKV, U_OFF_O, U_OFF_STATS
};

int fail(int status, char *err, size_t n, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
int fail(int status, char *err, size_t n, const char *fmt, ...) {
    if (err && n) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, n, fmt, ap);
        va_end(ap);
    }
    return status;
}

const char *kind_name(int kind) {
    return kind == FT_CUDNN_ATT_FWD ? "forward" : kind == FT_CUDNN_ATT_FWD_STATS ? "forward with statistics"
                                                                                 : "backward";
}

// the shape's own check, before the frontend sees it
int check_shape(const ft_cudnn_att_shape *s, char *err, size_t n) {
    if (!s) return fail(FT_CUDNN_ATT_INVALID, err, n, "cuDNN attention: no shape given");
    if (s->kind < FT_CUDNN_ATT_FWD || s->kind > FT_CUDNN_ATT_BWD)
        return fail(FT_CUDNN_ATT_INVALID, err, n, "cuDNN attention: graph kind %d is not forward (0), forward with "
                    "statistics (1) or backward (2)", s->kind);
    if (s->type != FT_CUDNN_ATT_BF16 && s->type != FT_CUDNN_ATT_F16)
        return fail(FT_CUDNN_ATT_INVALID, err, n, "cuDNN attention: operand type %d is not bf16 (0) or fp16 (1)",
                    s->type);
    if (s->B < 1 || s->S < 1 || s->H < 1 || s->D < 1)
        return fail(FT_CUDNN_ATT_INVALID, err, n, "cuDNN attention: shape B %lld, S %lld, H %lld, D %lld: every "
                    "size must be at least 1", (long long)s->B, (long long)s->S, (long long)s->H, (long long)s->D);
    if (s->window < 0 || s->window > INT32_MAX - 2)
        return fail(FT_CUDNN_ATT_INVALID, err, n, "cuDNN attention: window %lld is not in [0, 2^31 - 3] (0: global)",
                    (long long)s->window);
    return FT_CUDNN_ATT_OK;
}

// whether this frontend's SDPA attributes (forward A = SDPA_attributes, backward
// SDPA_backward_attributes) take a diagonal band: set_diagonal_band_left_bound / _right_bound
template <typename A, typename = void> struct has_band : std::false_type {};
template <typename A>
struct has_band<A, std::void_t<decltype(std::declval<A &>().set_diagonal_band_left_bound(1)),
                               decltype(std::declval<A &>().set_diagonal_band_right_bound(1))>> : std::true_type {};

// the window (0: none) as the band of |i - j| <= window / 2, top-left aligned (the frontend's
// default): the left bound keeps j > i - left, the right bound j <= i + right. false: this frontend
// has no band (the caller refuses the shape).
template <typename A> bool set_window(A &opts, int64_t window) {
    if (window == 0) return true;
    if constexpr (has_band<A>::value) {
        const int half = (int)(window / 2);
        opts.set_diagonal_band_left_bound(half + 1).set_diagonal_band_right_bound(half);
        return true;
    } else {
        (void)opts;
        return false;
    }
}

constexpr const char *NO_BAND = "this cudnn-frontend's SDPA has no diagonal band (set_diagonal_band_left_bound / "
                                "_right_bound): no sliding window";

// sm_version > 0: the target's compute capability (x 10) for a check without a device; the nodes
// copy the graph's context when they are made, so it is set first
std::shared_ptr<fe::graph::Graph> make_graph(const ft_cudnn_att_shape &s, int sm_version = 0) {
    using fe::graph::Tensor_attributes;
    auto g = std::make_shared<fe::graph::Graph>();
    if (sm_version > 0) g->set_sm_version(sm_version);
    g->set_io_data_type(s.type == FT_CUDNN_ATT_F16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const int64_t B = s.B, S = s.S, H = s.H, D = s.D, row = 3 * H * D;
    auto table = [&](const char *name, int64_t id, int64_t n, fe::DataType_t t) {
        return g->tensor(Tensor_attributes().set_name(name).set_uid(id).set_dim({n, 1, 1, 1}).set_stride({1, 1, 1, 1})
                             .set_data_type(t));
    };
    auto seq_q = table("seq_len_q", U_SEQ_Q, B, fe::DataType_t::INT32);
    auto seq_kv = table("seq_len_kv", U_SEQ_KV, B, fe::DataType_t::INT32);
    auto off_qkv = table("ragged_qkv", U_OFF_QKV, B + 1, fe::DataType_t::INT64);
    auto off_o = table("ragged_o", U_OFF_O, B + 1, fe::DataType_t::INT64);
    // one of Q, K, V (or dQ, dK, dV) in the packed rows
    auto qkv_attrs = [&](const char *name, int64_t id) {
        return Tensor_attributes().set_name(name).set_uid(id).set_dim({B, H, S, D}).set_stride({S * row, D, row, 1})
            .set_ragged_offset(off_qkv);
    };
    auto o_attrs = [&](const char *name, int64_t id) {
        return Tensor_attributes().set_name(name).set_uid(id).set_dim({B, H, S, D})
            .set_stride({S * H * D, D, H * D, 1}).set_ragged_offset(off_o);
    };
    const std::vector<int64_t> stats_dim = {B, H, S, 1}, stats_stride = {S * H, 1, H, 1};
    auto Q = g->tensor(qkv_attrs("Q", U_Q)), K = g->tensor(qkv_attrs("K", U_K)), V = g->tensor(qkv_attrs("V", U_V));
    const float scale = 1.0f / std::sqrt((float)D);
    if (s.kind != FT_CUDNN_ATT_BWD) {
        const bool stats = s.kind == FT_CUDNN_ATT_FWD_STATS;
        auto opts = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(stats)
                        .set_attn_scale(scale).set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
        if (!set_window(opts, s.window)) throw std::runtime_error(NO_BAND);
        auto [O, Stats] = g->sdpa(Q, K, V, opts);
        O->set_output(true).set_dim({B, H, S, D}).set_stride({S * H * D, D, H * D, 1}).set_uid(U_O)
            .set_ragged_offset(off_o);
        if (stats) {
            auto off_s = table("ragged_stats", U_OFF_STATS, B + 1, fe::DataType_t::INT64);
            Stats->set_output(true).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dim).set_stride(stats_stride)
                .set_uid(U_STATS).set_ragged_offset(off_s);
        }
        return g;
    }
    auto off_s = table("ragged_stats", U_OFF_STATS, B + 1, fe::DataType_t::INT64);
    auto O = g->tensor(o_attrs("O", U_O)), dO = g->tensor(o_attrs("dO", U_DO));
    auto Stats = g->tensor(Tensor_attributes().set_name("stats").set_uid(U_STATS).set_dim(stats_dim)
                               .set_stride(stats_stride).set_data_type(fe::DataType_t::FLOAT).set_ragged_offset(off_s));
    auto opts = fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_attn_scale(scale)
                    .set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv)
                    .set_deterministic_algorithm(true);
    if (!set_window(opts, s.window)) throw std::runtime_error(NO_BAND);
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, opts);
    auto out = [&](std::shared_ptr<Tensor_attributes> &t, int64_t id) {
        t->set_output(true).set_dim({B, H, S, D}).set_stride({S * row, D, row, 1}).set_uid(id)
            .set_ragged_offset(off_qkv);
    };
    out(dQ, U_DQ);
    out(dK, U_DK);
    out(dV, U_DV);
    return g;
}

using graph_key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t>;
graph_key key_of(const ft_cudnn_att_shape &s) { return graph_key{s.kind, s.type, s.B, s.S, s.H, s.D, s.window}; }

struct entry {
    std::shared_ptr<fe::graph::Graph> graph;   // null: refused
    int64_t workspace = 0;
    std::string refused;
};

constexpr size_t MAX_GRAPHS = 64;   // the cache's bound: the oldest graph goes first past it

}  // namespace

struct ft_cudnn_att {
    int device = 0;
    cudnnHandle_t handle = nullptr;
    std::map<graph_key, entry> graphs;
    std::map<uint64_t, graph_key> order;   // build order -> key (eviction)
    uint64_t built = 0;
};

extern "C" {

void ft_cudnn_att_versions(size_t *built, size_t *loaded) {
    if (built) *built = CUDNN_VERSION;
    if (loaded) *loaded = cudnnGetVersion();
}

int ft_cudnn_att_validate(int sm_version, const ft_cudnn_att_shape *shape, char *err, size_t err_len) {
    int st = check_shape(shape, err, err_len);
    if (st) return st;
    try {
        auto g = make_graph(*shape, sm_version);
        auto e = g->validate();
        if (!e.is_good())
            return fail(FT_CUDNN_ATT_REFUSED, err, err_len, "cuDNN attention %s (B %lld, S %lld, H %lld, D %lld, "
                        "window %lld, sm %d): %s", kind_name(shape->kind), (long long)shape->B, (long long)shape->S,
                        (long long)shape->H, (long long)shape->D, (long long)shape->window, sm_version,
                        e.get_message().c_str());
    } catch (const std::exception &ex) {
        return fail(FT_CUDNN_ATT_REFUSED, err, err_len, "cuDNN attention %s: %s", kind_name(shape->kind), ex.what());
    }
    return FT_CUDNN_ATT_OK;
}

int ft_cudnn_att_create(int device, ft_cudnn_att **out, char *err, size_t err_len) {
    if (!out) return fail(FT_CUDNN_ATT_INVALID, err, err_len, "ft_cudnn_att_create: out is NULL");
    *out = nullptr;
    cudaError_t ce = cudaSetDevice(device);
    if (ce != cudaSuccess)
        return fail(FT_CUDNN_ATT_FAILED, err, err_len, "cuDNN attention: CUDA device %d: %s", device,
                    cudaGetErrorString(ce));
    cudnnHandle_t h = nullptr;
    cudnnStatus_t cs = cudnnCreate(&h);
    if (cs != CUDNN_STATUS_SUCCESS)
        return fail(FT_CUDNN_ATT_FAILED, err, err_len, "cudnnCreate on device %d: %s (%d)", device,
                    cudnnGetErrorString(cs), (int)cs);
    ft_cudnn_att *a = new (std::nothrow) ft_cudnn_att;
    if (!a) {
        cudnnDestroy(h);
        return fail(FT_CUDNN_ATT_FAILED, err, err_len, "cuDNN attention: out of host memory");
    }
    a->device = device;
    a->handle = h;
    *out = a;
    return FT_CUDNN_ATT_OK;
}

void ft_cudnn_att_destroy(ft_cudnn_att *a) {
    if (!a) return;
    a->graphs.clear();
    cudaSetDevice(a->device);
    if (a->handle) cudnnDestroy(a->handle);
    delete a;
}

int ft_cudnn_att_prepare(ft_cudnn_att *a, const ft_cudnn_att_shape *shape, size_t *workspace_bytes, char *err,
                         size_t err_len) {
    if (!a) return fail(FT_CUDNN_ATT_INVALID, err, err_len, "ft_cudnn_att_prepare: no context");
    int st = check_shape(shape, err, err_len);
    if (st) return st;
    const graph_key k = key_of(*shape);
    auto it = a->graphs.find(k);
    if (it == a->graphs.end()) {
        entry e;
        try {
            auto g = make_graph(*shape);
            fe::error_t r = g->validate();
            if (r.is_good()) r = g->build_operation_graph(a->handle);
            if (r.is_good()) r = g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
            if (r.is_good()) r = g->check_support(a->handle);
            if (r.is_good()) r = g->build_plans(a->handle);
            if (r.is_good()) r = g->get_workspace_size(e.workspace);
            if (r.is_good()) e.graph = g;
            else e.refused = r.get_message();
        } catch (const std::exception &ex) {
            e.refused = ex.what();
        }
        if (e.graph && a->graphs.size() >= MAX_GRAPHS) {   // drop the oldest graph built
            auto oldest = a->order.begin();
            a->graphs.erase(oldest->second);
            a->order.erase(oldest);
        }
        it = a->graphs.emplace(k, std::move(e)).first;
        if (it->second.graph) a->order.emplace(a->built++, k);
    }
    if (!it->second.graph)
        return fail(FT_CUDNN_ATT_REFUSED, err, err_len, "cuDNN refused the attention %s (B %lld, S %lld, H %lld, "
                    "D %lld, window %lld, %s): %s", kind_name(shape->kind), (long long)shape->B, (long long)shape->S,
                    (long long)shape->H, (long long)shape->D, (long long)shape->window,
                    shape->type == FT_CUDNN_ATT_F16 ? "fp16" : "bf16", it->second.refused.c_str());
    if (workspace_bytes) *workspace_bytes = (size_t)it->second.workspace;
    return FT_CUDNN_ATT_OK;
}

}  // extern "C"

namespace {

// the lengths, on the host, before anything is queued: every sequence has queries and keys, at
// most S of them, and its keys are among its queries' rows
int check_seqs(const ft_cudnn_att_shape *s, const ft_cudnn_att_seqs *q, char *err, size_t n) {
    if (!q || !q->q_len || !q->kv_len || !q->qkv_off || !q->o_off || !q->host_q_len || !q->host_kv_len)
        return fail(FT_CUDNN_ATT_INVALID, err, n, "cuDNN attention: a sequence table is NULL");
    for (int64_t b = 0; b < s->B; b++) {
        const int32_t nq = q->host_q_len[b], nk = q->host_kv_len[b];
        if (nq < 1 || nk < 1)
            return fail(FT_CUDNN_ATT_INVALID, err, n, "cuDNN attention: sequence %lld has %d query rows and %d keys; "
                        "zero-length sequences are refused (cuDNN before 9.25 gave NaN for them)", (long long)b, nq, nk);
        if (nq > s->S || nk > nq)
            return fail(FT_CUDNN_ATT_INVALID, err, n, "cuDNN attention: sequence %lld has %d query rows and %d keys; "
                        "the graph takes at most S = %lld rows, keys no more than queries", (long long)b, nq, nk,
                        (long long)s->S);
    }
    return FT_CUDNN_ATT_OK;
}

int run(ft_cudnn_att *a, const ft_cudnn_att_shape *shape, void *stream, std::unordered_map<int64_t, void *> &pack,
        void *workspace, char *err, size_t n) {
    size_t ws = 0;
    int st = ft_cudnn_att_prepare(a, shape, &ws, err, n);
    if (st) return st;
    if (ws && !workspace) return fail(FT_CUDNN_ATT_INVALID, err, n, "cuDNN attention: %zu bytes of workspace needed, "
                                      "none given", ws);
    cudnnStatus_t cs = cudnnSetStream(a->handle, (cudaStream_t)stream);
    if (cs != CUDNN_STATUS_SUCCESS)
        return fail(FT_CUDNN_ATT_FAILED, err, n, "cudnnSetStream: %s", cudnnGetErrorString(cs));
    try {
        auto r = a->graphs.at(key_of(*shape)).graph->execute(a->handle, pack, workspace);
        if (!r.is_good())
            return fail(FT_CUDNN_ATT_FAILED, err, n, "cuDNN attention %s: %s", kind_name(shape->kind),
                        r.get_message().c_str());
    } catch (const std::exception &ex) {
        return fail(FT_CUDNN_ATT_FAILED, err, n, "cuDNN attention %s: %s", kind_name(shape->kind), ex.what());
    }
    return FT_CUDNN_ATT_OK;
}

}  // namespace

extern "C" {

int ft_cudnn_att_forward(ft_cudnn_att *a, const ft_cudnn_att_shape *shape, void *stream, const ft_cudnn_att_seqs *seqs,
                         const void *qkv, void *o, float *stats, void *workspace, char *err, size_t err_len) {
    int st = check_shape(shape, err, err_len);
    if (st) return st;
    if (shape->kind == FT_CUDNN_ATT_BWD)
        return fail(FT_CUDNN_ATT_INVALID, err, err_len, "ft_cudnn_att_forward: a backward shape");
    const bool with_stats = shape->kind == FT_CUDNN_ATT_FWD_STATS;
    if (!qkv || !o || (with_stats && (!stats || !seqs || !seqs->stats_off)))
        return fail(FT_CUDNN_ATT_INVALID, err, err_len, "ft_cudnn_att_forward: qkv, o%s is NULL",
                    with_stats ? ", stats or their offsets" : "");
    st = check_seqs(shape, seqs, err, err_len);
    if (st) return st;
    if (!a) return fail(FT_CUDNN_ATT_INVALID, err, err_len, "ft_cudnn_att_forward: no context");
    char *base = (char *)const_cast<void *>(qkv);
    const int64_t hd = shape->H * shape->D * 2;   // bytes from Q to K, K to V (2-byte operands)
    std::unordered_map<int64_t, void *> pack = {
        {U_Q, base}, {U_K, base + hd}, {U_V, base + 2 * hd}, {U_O, o},
        {U_SEQ_Q, (void *)seqs->q_len}, {U_SEQ_KV, (void *)seqs->kv_len},
        {U_OFF_QKV, (void *)seqs->qkv_off}, {U_OFF_O, (void *)seqs->o_off}};
    if (with_stats) {
        pack[U_STATS] = stats;
        pack[U_OFF_STATS] = (void *)seqs->stats_off;
    }
    return run(a, shape, stream, pack, workspace, err, err_len);
}

int ft_cudnn_att_backward(ft_cudnn_att *a, const ft_cudnn_att_shape *shape, void *stream,
                          const ft_cudnn_att_seqs *seqs, const void *qkv, const void *o, const void *do_,
                          const float *stats, void *dqkv, void *workspace, char *err, size_t err_len) {
    int st = check_shape(shape, err, err_len);
    if (st) return st;
    if (shape->kind != FT_CUDNN_ATT_BWD)
        return fail(FT_CUDNN_ATT_INVALID, err, err_len, "ft_cudnn_att_backward: a forward shape");
    if (!qkv || !o || !do_ || !stats || !dqkv || !seqs || !seqs->stats_off)
        return fail(FT_CUDNN_ATT_INVALID, err, err_len, "ft_cudnn_att_backward: qkv, o, do, stats, dqkv or the "
                    "statistics' offsets is NULL");
    st = check_seqs(shape, seqs, err, err_len);
    if (st) return st;
    if (!a) return fail(FT_CUDNN_ATT_INVALID, err, err_len, "ft_cudnn_att_backward: no context");
    char *base = (char *)const_cast<void *>(qkv), *dbase = (char *)dqkv;
    const int64_t hd = shape->H * shape->D * 2;
    std::unordered_map<int64_t, void *> pack = {
        {U_Q, base}, {U_K, base + hd}, {U_V, base + 2 * hd}, {U_O, const_cast<void *>(o)},
        {U_DO, const_cast<void *>(do_)}, {U_STATS, const_cast<float *>(stats)},
        {U_DQ, dbase}, {U_DK, dbase + hd}, {U_DV, dbase + 2 * hd},
        {U_SEQ_Q, (void *)seqs->q_len}, {U_SEQ_KV, (void *)seqs->kv_len},
        {U_OFF_QKV, (void *)seqs->qkv_off}, {U_OFF_O, (void *)seqs->o_off}, {U_OFF_STATS, (void *)seqs->stats_off}};
    return run(a, shape, stream, pack, workspace, err, err_len);
}

}  // extern "C"
