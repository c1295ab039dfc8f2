// Attention on the GPU over packed sequences (backend.h): queries = a sequence's rows, keys = its
// first `keys` rows, all real (no mask anywhere).
//
// float32: per sequence, S = Q K^T * scale by strided-batched cuBLAS SGEMMs over its heads, a
// softmax kernel over S in place, then P V written straight into the head's columns of ctx; S
// is materialised (NH, rows, keys) per sequence in fp32 scratch (true fp32, as the reference).
//
// float16 / bfloat16: one fused kernel for the whole batch (FlashAttention's online softmax), on
// the tensor cores through WMMA (16 x 16 x 16, float32 accumulation), so the emulator runs it
// too. A block takes 64 query rows of one (sequence, head) -- 16 per warp -- and sweeps the
// sequence's real keys in tiles of 32: S = Q K^T (float), the running row maximum and sum in
// float32 registers (a lane pair per row), P = exp2(S - max) rounded to the storage type, the
// float32 output rows rescaled and P V added. S never reaches global memory; no padded key is
// read. The head size is padded with zeros to D = 16, 32, 64 or 128 in shared memory (head
// sizes up to 128: every BERT-family model). The sequence table is read from `seqs_dev` (the
// encoder uploads it once per forward), else copied into `scratch` (B x 12 bytes).
//
// A sequence with no real key gets a zero output, the same as transformers' SDPA path and the
// CPU backend.
#include <math.h>
#include <string.h>

#include <mma.h>

#include "cuda_common.cuh"

using namespace ftcuda;
using namespace nvcuda;

namespace {

constexpr int ATT_WARPS = 4, ATT_BQ = 16 * ATT_WARPS, ATT_BK = 32;

// the fused kernel's shared memory, padded rows (WMMA: ldm a multiple of 8 halves / 4 floats,
// every tile 32-byte aligned)
template <int D> struct att_layout {
    static constexpr int DP = D + 8;        // halves per row of the Q, K, V tiles
    static constexpr int SP = ATT_BK + 4;   // floats per row of the scores
    static constexpr int PP = ATT_BK + 8;   // halves per row of the probabilities
    static constexpr int OP = D + 4;        // floats per row of the output accumulator
    static constexpr size_t q = 0, k = q + (size_t)ATT_BQ * DP * 2, v = k + (size_t)ATT_BK * DP * 2,
                            s = v + (size_t)ATT_BK * DP * 2, p = s + (size_t)ATT_BQ * SP * 4,
                            o = p + (size_t)ATT_BQ * PP * 2, bytes = o + (size_t)ATT_BQ * OP * 4;
};

// 16 bytes moved as one vector (nvcc: one 128-bit access; the emulator's host compiler: memcpy,
// which keeps C++'s aliasing rules)
__device__ inline uint4 load16(const void *p) {
#ifdef FT_CUDA_EMU
    uint4 v;
    memcpy(&v, p, 16);
    return v;
#else
    return *reinterpret_cast<const uint4 *>(p);
#endif
}
__device__ inline void store16(void *p, const void *src16) {
#ifdef FT_CUDA_EMU
    memcpy(p, src16, 16);
#else
    *reinterpret_cast<uint4 *>(p) = *reinterpret_cast<const uint4 *>(src16);
#endif
}

// rows [r0, r0 + n) of a (rows x D) shared tile = rows of a global matrix (stride ld, hs columns
// of them; the rest, and rows past `real`, zero). vec: hs and ld multiples of 8 and the source
// 16-byte aligned, so whole 16-byte chunks move (8 halves per load)
template <typename T, int D, int DP>
__device__ inline void load_tile(T *dst, const T *src, int64_t ld, int hs, int64_t real, int rows, bool vec) {
    if (vec) {
        constexpr int CH = D / 8;   // 16-byte chunks per row
        for (int i = threadIdx.x; i < rows * CH; i += blockDim.x) {
            const int r = i / CH, d = (i % CH) * 8;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (r < real && d < hs) v = load16(src + r * ld + d);
            store16(dst + r * DP + d, &v);
        }
        return;
    }
    for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        dst[r * DP + d] = r < real && d < hs ? src[r * ld + d] : from_f<T>(0.0f);
    }
}

// ctx rows of sequence blockIdx.y, head blockIdx.x / tiles, query tile blockIdx.x % tiles
template <typename T, int D>
__device__ void flash_attention_body(T *ctx, const T *qkv, const int32_t *seqs, int64_t C, int hs, int tiles,
                                     float scale_log2, int64_t reach) {
    typedef att_layout<D> L;
    FT_DYNAMIC_SHARED(unsigned char, smem);
    T *Qs = reinterpret_cast<T *>(smem + L::q), *Ks = reinterpret_cast<T *>(smem + L::k);
    T *Vs = reinterpret_cast<T *>(smem + L::v), *Ps = reinterpret_cast<T *>(smem + L::p);
    float *Ss = reinterpret_cast<float *>(smem + L::s), *Os = reinterpret_cast<float *>(smem + L::o);
    const int64_t b = blockIdx.y;
    const int tile = blockIdx.x % tiles, head = blockIdx.x / tiles;
    const int64_t first = seqs[3 * b], nk = seqs[3 * b + 1], nq = seqs[3 * b + 2];
    const int64_t q0 = (int64_t)tile * ATT_BQ;
    if (q0 >= nq) return;   // the whole block: before any barrier
    const int64_t ld = 3 * C;
    const T *qg = qkv + first * ld + (int64_t)head * hs, *kg = qg + C, *vg = qg + 2 * C;
    T *og = ctx + first * C + (int64_t)head * hs;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int64_t nrows = nq - q0 < ATT_BQ ? nq - q0 : ATT_BQ;
    if (nk == 0) {   // no real key: zeros
        for (int64_t i = tid; i < nrows * hs; i += blockDim.x) og[(q0 + i / hs) * C + i % hs] = from_f<T>(0.0f);
        return;
    }
    const bool vec = hs % 8 == 0 && C % 8 == 0 && ((uintptr_t)qkv & 15) == 0 && ((uintptr_t)ctx & 15) == 0;
    load_tile<T, D, L::DP>(Qs, qg + q0 * ld, ld, hs, nrows, ATT_BQ, vec);
    for (int i = tid; i < ATT_BQ * D; i += blockDim.x) Os[(i / D) * L::OP + i % D] = 0.0f;
    __syncthreads();
    const int row = lane >> 1, half = lane & 1;   // a lane pair per row of this warp's 16
    const T *Q = Qs + warp * 16 * L::DP;
    float *S = Ss + warp * 16 * L::SP, *O = Os + warp * 16 * L::OP;
    T *P = Ps + warp * 16 * L::PP;
    float m = -INFINITY, l = 0.0f;   // the row's running maximum (log2 units) and sum
    // a window (reach = half its width >= 0): only the key tiles the block's rows reach, each row masked to its own reach
    const int64_t qi = q0 + warp * 16 + row;
    int64_t kbeg = 0, kend = nk;
    if (reach >= 0) {
        kbeg = q0 - reach > 0 ? (q0 - reach) / ATT_BK * ATT_BK : 0;
        kend = q0 + ATT_BQ + reach < nk ? q0 + ATT_BQ + reach : nk;
    }
    for (int64_t k0 = kbeg; k0 < kend; k0 += ATT_BK) {
        load_tile<T, D, L::DP>(Ks, kg + k0 * ld, ld, hs, nk - k0, ATT_BK, vec);
        load_tile<T, D, L::DP>(Vs, vg + k0 * ld, ld, hs, nk - k0, ATT_BK, vec);
        __syncthreads();
        // S (16 x BK) = Q K^T
        for (int j = 0; j < ATT_BK / 16; j++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.0f);
            for (int d = 0; d < D; d += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
                wmma::load_matrix_sync(fa, Q + d, L::DP);
                wmma::load_matrix_sync(fb, Ks + j * 16 * L::DP + d, L::DP);
                wmma::mma_sync(acc, fa, fb, acc);
            }
            wmma::store_matrix_sync(S + j * 16, acc, L::SP, wmma::mem_row_major);
        }
        __syncwarp();
        // online softmax over this lane's half of the row's columns
        float *sr = S + row * L::SP;
        const int c0 = half * (ATT_BK / 2);
        float mx = -INFINITY;
        for (int c = c0; c < c0 + ATT_BK / 2; c++) {
            const int64_t j = k0 + c;
            const bool in = j < nk && (reach < 0 || (j >= qi - reach && j <= qi + reach));
            const float s = in ? sr[c] * scale_log2 : -INFINITY;
            sr[c] = s;
            mx = fmaxf(mx, s);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        // finite without a window (every tile holds a real key); with one, -inf until the row's first key
        const float m_new = fmaxf(m, mx);
        const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = exp2f(m - m_ref);
        float sum = 0.0f;
        for (int c = c0; c < c0 + ATT_BK / 2; c++) {
            const float p = exp2f(sr[c] - m_ref);
            const T pr = from_f<T>(p);
            P[row * L::PP + c] = pr;
            sum += to_f(pr);   // the weights P V uses: each row sums to 1 exactly
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        for (int d = half * (D / 2); d < (half + 1) * (D / 2); d++) O[row * L::OP + d] *= alpha;
        __syncwarp();
        // O (16 x D) += P V
        for (int d = 0; d < D; d += 16) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, O + d, L::OP, wmma::mem_row_major);
            for (int j = 0; j < ATT_BK / 16; j++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
                wmma::load_matrix_sync(fa, P + j * 16, L::PP);
                wmma::load_matrix_sync(fb, Vs + j * 16 * L::DP + d, L::DP);
                wmma::mma_sync(acc, fa, fb, acc);
            }
            wmma::store_matrix_sync(O + d, acc, L::OP, wmma::mem_row_major);
        }
        __syncthreads();   // K and V are overwritten next
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;   // a windowed row that reached no key: zeros
    const int r = warp * 16 + row;
    if (!vec) {
        if (r < nrows)
            for (int d = half; d < hs; d += 2) og[(q0 + r) * C + d] = from_f<T>(O[row * L::OP + d] * inv);
        return;
    }
    // normalise this warp's rows in place, then write them 16 bytes (8 values) per store
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); d++) O[row * L::OP + d] *= inv;
    __syncwarp();
    const int chunks = hs / 8;
    for (int i = lane; i < 16 * chunks; i += 32) {
        const int rr = i / chunks, d = (i % chunks) * 8;
        if (warp * 16 + rr >= nrows) continue;
        alignas(16) T pack[8];
        for (int j = 0; j < 8; j++) pack[j] = from_f<T>(O[rr * L::OP + d + j]);
        store16(og + (q0 + warp * 16 + rr) * C + d, pack);
    }
}

template <typename T, int D>
__global__ void flash_attention_kernel(T *ctx, const T *qkv, const int32_t *seqs, int64_t C, int hs, int tiles,
                                       float scale_log2, int64_t half) {
    if constexpr (wmma_type_ok<T>::value) flash_attention_body<T, D>(ctx, qkv, seqs, C, hs, tiles, scale_log2, half);
    else __trap();
}

template <typename T, int D>
ft_status flash_attention_launch(cuda_ctx *c, T *ctx, const T *qkv, const int32_t *seqs_dev, int64_t B, int64_t C,
                                 int64_t NH, int tiles, int64_t half) {
    const size_t bytes = att_layout<D>::bytes;
    constexpr auto flash_attention = flash_attention_kernel<T, D>;
    static bool opted_in[64];   // the shared-memory opt-in, once per device (set twice is harmless)
    if (bytes > 48 * 1024 && !opted_in[c->device & 63]) {
        FT_CU(cudaFuncSetAttribute(flash_attention, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
              "attention shared memory");
        opted_in[c->device & 63] = true;
    }
    const int hs = (int)(C / NH);
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)hs);
    for (int64_t b0 = 0; b0 < B; b0 += 65535) {   // gridDim.y <= 65535
        const int64_t nb = B - b0 < 65535 ? B - b0 : 65535;
        dim3 grid((unsigned)(tiles * NH), (unsigned)nb);
        FT_LAUNCH(flash_attention, grid, ATT_WARPS * 32, bytes, c->stream)(
            ctx, qkv, seqs_dev + 3 * b0, C, hs, tiles, scale_log2, half);
        FT_TRY(launched("attention_forward"));
    }
    return FT_OK;
}

// one warp per score row: max-subtracted softmax in place (every key is real); half >= 0: row i of
// each head's nq sees the keys j with |i - j| <= half only, the others get 0 (a row with none: zeros)
__global__ void softmax_kernel(float *S, int64_t rows, int64_t nk, int64_t nq, int64_t half) {
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float *s = S + row * nk;
    int64_t lo = 0, hi = nk;
    if (half >= 0) {
        const int64_t i = row % nq;
        lo = i - half > 0 ? i - half : 0;
        hi = i + half + 1 < nk ? i + half + 1 : nk;
        for (int64_t j = lane; j < nk; j += 32)
            if (j < lo || j >= hi) s[j] = 0.0f;
        if (hi <= lo) return;
    }
    float mx = -INFINITY;
    for (int64_t j = lo + lane; j < hi; j += 32) mx = fmaxf(mx, s[j]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int64_t j = lo + lane; j < hi; j += 32) {
        float e = __expf(s[j] - mx);
        s[j] = e;
        sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = 1.0f / sum;
    for (int64_t j = lo + lane; j < hi; j += 32) s[j] *= inv;
}

}  // namespace

size_t cuda_attention_scratch_bytes(ft_backend *, ft_dtype dt, int64_t B, int64_t T, int64_t NH) {
    if (dt != FT_F32) return (size_t)B * 3 * sizeof(int32_t);   // the fused kernel: the sequence table
    return (size_t)B * (size_t)NH * (size_t)T * (size_t)T * sizeof(float);
}

static ft_status attention_f32(ft_backend *be, float *ctx, const float *qkv, const int32_t *seqs, int64_t B,
                               int64_t C, int64_t NH, int64_t half, float *scratch) {
    cuda_ctx *c = ctx_of(be);
    blas_use blas(c);
    FT_TRY(blas.status);
    const int64_t hs = C / NH, ld = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs), one = 1.0f, zero = 0.0f;
    float *S = scratch;
    for (int64_t b = 0; b < B; b++) {
        const int64_t first = seqs[3 * b], nk = seqs[3 * b + 1], nq = seqs[3 * b + 2];
        if (nq == 0) continue;
        float *out = ctx + first * C;
        if (nk == 0) {   // no real key: zero output
            FT_CU(cudaMemsetAsync(out, 0, (size_t)(nq * C) * sizeof(float), c->stream), "attention zero output");
            continue;
        }
        const float *q = qkv + first * ld, *k = q + C, *v = q + 2 * C;
        // row-major S_h (nq, nk) = Q_h K_h^T is column-major S_h^T = K_h Q_h^T: (op T on K, op N on Q)
        FT_CUBLAS(cublasSgemmStridedBatched(blas.h, CUBLAS_OP_T, CUBLAS_OP_N, (int)nk, (int)nq, (int)hs, &scale, k,
                                            (int)ld, hs, q, (int)ld, hs, &zero, S, (int)nk, nq * nk, (int)NH),
                  "attention scores");
        const int64_t rows = NH * nq;
        const int warps = 8;
        FT_LAUNCH(softmax_kernel, (unsigned)((rows + warps - 1) / warps), warps * 32, 0, c->stream)(S, rows, nk, nq, half);
        ft_status st = launched("attention softmax");
        if (st != FT_OK) return st;
        // row-major ctx_h (nq, hs) = P_h (nq, nk) V_h (nk, hs): column-major ctx_h^T = V_h^T P_h^T
        FT_CUBLAS(cublasSgemmStridedBatched(blas.h, CUBLAS_OP_N, CUBLAS_OP_N, (int)hs, (int)nq, (int)nk, &one, v,
                                            (int)ld, hs, S, (int)nk, nq * nk, &zero, out, (int)C, hs, (int)NH),
                  "attention output");
        S += NH * nq * nk;
    }
    return FT_OK;
}

ft_status cuda_attention_forward(ft_backend *be, ft_dtype dt, void *ctx, const void *qkv, const int32_t *seqs,
                                 const int32_t *seqs_dev_in, int64_t B, int64_t C, int64_t NH, int64_t window,
                                 void *scratch) {
    if (window < 0)
        return g_host->error(FT_ERR_INVALID_ARGUMENT, "attention_forward: window %lld < 0", (long long)window);
    const int64_t half = window > 0 ? window / 2 : -1;
    if (dt == FT_F32)
        return attention_f32(be, (float *)ctx, (const float *)qkv, seqs, B, C, NH, half, (float *)scratch);
    if (dt != FT_F16 && dt != FT_BF16) return dtype_error(dt, "attention_forward");
    const int64_t hs = C / NH;
    if (hs > 128)
        return g_host->error(FT_ERR_UNSUPPORTED, "attention_forward: head size %lld; half-precision attention takes "
                             "head sizes up to 128 (use dtype float32 for this model)", (long long)hs);
    int64_t max_rows = 0;
    for (int64_t b = 0; b < B; b++) max_rows = seqs[3 * b + 2] > max_rows ? seqs[3 * b + 2] : max_rows;
    if (max_rows == 0) return FT_OK;
    const int64_t tiles = (max_rows + ATT_BQ - 1) / ATT_BQ;
    if (tiles * NH > 0x7fffffff)
        return g_host->error(FT_ERR_INVALID_ARGUMENT, "attention_forward: %lld heads x %lld query tiles is too many",
                             (long long)NH, (long long)tiles);
    cuda_ctx *c = ctx_of(be);
    if (dt == FT_BF16 && c->cc_major < 8)
        return g_host->error(FT_ERR_UNSUPPORTED, "bfloat16 needs an Ampere or newer GPU (compute capability 8.0+); "
                             "%s is %d.x: use dtype float16", c->name, c->cc_major);
    bool ran = false;   // cuDNN's fused attention where it takes this configuration (attention_cudnn.cu),
                        // a window as its diagonal band
    FT_TRY(cudnn_attention_forward(be, dt, ctx, qkv, seqs, B, C, NH, window, &ran));
    if (ran) return FT_OK;
    const int32_t *seqs_dev = seqs_dev_in;
    if (!seqs_dev) {   // pageable source: the copy has read it when the call returns
        FT_CU(cudaMemcpyAsync(scratch, seqs, (size_t)B * 3 * sizeof(int32_t), cudaMemcpyHostToDevice, c->stream),
              "attention sequence table");
        seqs_dev = (const int32_t *)scratch;
    }
    return with_dtype(dt, "attention_forward", [&](auto tag) -> ft_status {
        typedef decltype(tag) T;
        if constexpr (sizeof(T) == 2) {
            T *o = (T *)ctx;
            const T *x = (const T *)qkv;
            if (hs <= 16) return flash_attention_launch<T, 16>(c, o, x, seqs_dev, B, C, NH, (int)tiles, half);
            if (hs <= 32) return flash_attention_launch<T, 32>(c, o, x, seqs_dev, B, C, NH, (int)tiles, half);
            if (hs <= 64) return flash_attention_launch<T, 64>(c, o, x, seqs_dev, B, C, NH, (int)tiles, half);
            return flash_attention_launch<T, 128>(c, o, x, seqs_dev, B, C, NH, (int)tiles, half);
        }
        return dtype_error(dt, "attention_forward");
    });
}
