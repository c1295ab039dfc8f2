// Attention of the layer-training ops on the GPU (backend.h: attention_train_forward and
// attention_backward), float32, over packed sequences: probabilities kept ((NH, n, n) per
// sequence one after another) or recomputed in the backward from Q K^T and each row's softmax
// statistics (max, 1/sum); the dropout mask kept or recomputed from core/rng.h by the
// probability's index (the CPU's elements exactly).
//
// fused (the default): one launch for the forward of the whole batch and two for the backward,
// whatever the batch's lengths. A block owns 32 rows of one (sequence, head) and 128 threads, a
// 2 x 4 register tile each of a 32 x 32 output tile; the operands move through shared memory in
// 32 x 32 chunks (any head size: its columns in chunks of 32, zero-padded).
//   forward, block = (query tile, head, sequence): S = Q K^T * scale over the real keys, tile by
//     tile, each row's maximum and sum of exp online (FlashAttention's rescaling, per thread, then
//     over the row's 8 threads in a fixed shuffle tree); then S again (the same bits), P = exp(S -
//     m) / sum written to probs when kept, the statistics when asked, dropout (the mask written
//     when kept) and ctx += Pd V into the block's own rows, key tile by key tile.
//   backward (FlashAttention-2's split, without its atomics; P read, or recomputed by the
//   forward's own expression from the same bits of Q K^T):
//     dQ kernel, block = (query tile, head, sequence): dPd = dO V^T tile by tile, dP its dropout
//     backward, D_r = sum_c P_rc dP_rc for each row (a fixed shuffle tree: deterministic) kept in
//     scratch; then again dS = P (dP - D) per key tile and dQ += dS K * scale, the block's own
//     rows of dqkv updated in place, key tile after key tile.
//     dK/dV kernel, block = (key tile, head, sequence): for each query tile, dP again and dS from
//     the kept D, then dV += Pd^T dO and dK += dS^T Q * scale into the block's own key rows.
//   Nothing is added by two blocks: the results do not depend on scheduling. Scratch: the
//   sequence table (first row, length, first probability) and D (N x NH floats).
//   Products' precision (prec, mixed-precision training): float32 on the SIMT cores, every thread
//   its register tile; bf16 / fp16 on the tensor cores (WMMA 16 x 16 x 16, float32 sums; so the
//   emulator runs it): the operands rounded as they enter shared memory -- Q, K, V, dO, and the
//   dropped probabilities and dS, which the threads write there rounded -- each warp a 16 x 16
//   quadrant of the 32 x 32 tile, handed to the threads' register tiles through a float tile in
//   shared memory, so softmax, dropout, D and dS are the same float32 code for every precision.
//   The CPU backend rounds at the same points (its reference).
// per_sequence (FASTTRAN_CUDA_TRAIN_ATTENTION=per_sequence, kept to measure against): a sequence
//   at a time, strided-batched cuBLAS GEMMs over its heads (FAST_16BF / FAST_16F in mixed
//   precision: the same rounding points) with softmax and dropout kernels in between: 4 launches
//   per sequence forward, 6 backward; scratch two (NH, T, T) score blocks.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include <mma.h>

#include "core/rng.h"
#include "cuda_common.cuh"

using namespace ftcuda;
using namespace nvcuda;

namespace {

constexpr int AT_TILE = 32;                  // rows of a block's tile, keys of a key tile, columns of a chunk
constexpr int AT_PAD = AT_TILE + 1;          // floats per row of a float32 shared tile (no bank conflicts)
constexpr int AT_HPAD = AT_TILE + 8;         // halves per row of a bf16 / fp16 tile (WMMA: ldm a multiple of 8)
constexpr int AT_RPAD = AT_TILE + 4;         // floats per row of a WMMA result tile (ldm a multiple of 4)
constexpr int AT_THREADS = 128;              // 16 x 8 threads, a 2 x 4 register tile each; 4 warps
// blocks per SM the kernels are compiled for: at most 80 registers a thread, no spill (ptxas -v,
// sm_80 and sm_90; left to itself ptxas took 64 and spilled in the dQ kernel, or 96-128 with 4)
constexpr int AT_MIN_BLOCKS = 6;

// a sequence of the batch as the fused kernels read it (device copy in the scratch)
struct seq_entry {
    int64_t first;   // its first row in the packed (N, .) matrices
    int64_t n;       // its rows (queries = keys)
    int64_t base;    // index of its first probability: sum over earlier sequences of NH n^2
};

// H, the products' operand type: float (exact float32 products on the SIMT cores, every thread its
// 2 x 4 register tile), or __nv_bfloat16 / __half (mixed precision: the operands rounded to H as
// they enter shared memory, products on the tensor cores through WMMA with float32 sums, each warp
// a 16 x 16 quadrant of the 32 x 32 tile, passed to the threads' register tiles through a float
// result tile). Everything else -- softmax, its statistics, dropout, D, dS -- is the same float32
// code for every H.
template <typename H> struct op_tile_of { typedef H type[AT_TILE][AT_HPAD]; };
template <> struct op_tile_of<float> { typedef float type[AT_TILE][AT_PAD]; };
template <typename H> using op_tile = typename op_tile_of<H>::type;
typedef float wmma_res_t[AT_TILE][AT_RPAD];   // a WMMA product on its way to the register tiles
template <typename H> struct res_tile_of { typedef wmma_res_t type; };
template <> struct res_tile_of<float> { typedef float type[1][1]; };   // float32 needs none
template <typename H> using res_tile = typename res_tile_of<H>::type;
template <typename H> constexpr bool is_f32 = std::is_same<H, float>::value;

// dst = rows [0, 32) x columns [d0, d0 + 32) of a row-major source (stride ld), zero past `rows`
// real rows and past column `cols`, rounded to H
template <typename H>
__device__ inline void load_chunk(op_tile<H> &dst, const float *src, int64_t ld, int64_t rows, int d0, int cols) {
    for (int i = threadIdx.x; i < AT_TILE * AT_TILE; i += AT_THREADS) {
        const int r = i / AT_TILE, d = i % AT_TILE;
        dst[r][d] = from_f<H>(r < rows && d0 + d < cols ? src[r * ld + d0 + d] : 0.0f);
    }
}

// the thread's register tile: rows 2 ty + i (i < 2), columns tx + 8 j (j < 4)
__device__ inline int tile_row(int i) { return (int)(threadIdx.x >> 3) * 2 + i; }
__device__ inline int tile_col(int j) { return (int)(threadIdx.x & 7) + 8 * j; }

// the three products of 32 x 32 tiles over k = 32: A B^T, A B, A^T B
enum product_kind { AB_T, A_B, AT_B };

// float32: acc += the product, the thread's register tile
template <int K> __device__ inline void simt_product(float acc[2][4], const op_tile<float> &A, const op_tile<float> &B) {
    const int r = tile_row(0), c = tile_col(0);
    for (int k = 0; k < AT_TILE; k++) {
        const float a0 = K == AT_B ? A[k][r] : A[r][k], a1 = K == AT_B ? A[k][r + 1] : A[r + 1][k];
        FT_UNROLL for (int j = 0; j < 4; j++) {
            const float b = K == AB_T ? B[c + 8 * j][k] : B[k][c + 8 * j];
            acc[0][j] += a0 * b;
            acc[1][j] += a1 * b;
        }
    }
}

// bf16 / fp16: f += the warp's 16 x 16 quadrant of the product (rows r0.., columns c0..)
template <int K, typename H>
__device__ inline void wmma_product(wmma::fragment<wmma::accumulator, 16, 16, 16, float> &f, const op_tile<H> &A,
                                    const op_tile<H> &B, int r0, int c0) {
    if constexpr (!wmma_type_ok<H>::value) {
        __trap();   // bf16 WMMA below sm_80: the op refuses before launching
    } else {
        typedef typename std::conditional<K == AT_B, wmma::col_major, wmma::row_major>::type la;
        typedef typename std::conditional<K == AB_T, wmma::col_major, wmma::row_major>::type lb;
        FT_UNROLL for (int k = 0; k < AT_TILE; k += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, H, la> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, H, lb> fb;
            wmma::load_matrix_sync(fa, K == AT_B ? &A[k][r0] : &A[r0][k], AT_HPAD);
            wmma::load_matrix_sync(fb, K == AB_T ? &B[c0][k] : &B[k][c0], AT_HPAD);
            wmma::mma_sync(f, fa, fb, f);
        }
    }
}

// the warp's quadrant of a 32 x 32 tile
__device__ inline int warp_row0() { return (int)(threadIdx.x >> 6) * 16; }
__device__ inline int warp_col0() { return (int)((threadIdx.x >> 5) & 1) * 16; }

// the warps' quadrants into R, then every thread its register tile from R (a barrier between:
// every thread of the block calls it; R is written again only after the caller's next barrier)
__device__ inline void wmma_result(float part[2][4], wmma::fragment<wmma::accumulator, 16, 16, 16, float> &f,
                                   wmma_res_t &R) {
    wmma::store_matrix_sync(&R[warp_row0()][warp_col0()], f, AT_RPAD, wmma::mem_row_major);
    __syncthreads();
    FT_UNROLL for (int i = 0; i < 2; i++)
        FT_UNROLL for (int j = 0; j < 4; j++) part[i][j] = R[tile_row(i)][tile_col(j)];
}

// part = the product of two shared tiles (K: A B^T, A B or A^T B), the thread's register tile
// (every thread of the block calls it: the WMMA path passes a barrier)
template <int K, typename H>
__device__ inline void tile_product(float part[2][4], const op_tile<H> &A, const op_tile<H> &B, res_tile<H> &R) {
    if constexpr (is_f32<H>) {
        FT_UNROLL for (int i = 0; i < 2; i++)
            FT_UNROLL for (int j = 0; j < 4; j++) part[i][j] = 0.0f;
        simt_product<K>(part, A, B);
    } else {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> f;
        wmma::fill_fragment(f, 0.0f);
        wmma_product<K, H>(f, A, B, warp_row0(), warp_col0());
        wmma_result(part, f, R);
    }
}

inline __device__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// rows [0, rows) x columns [d0, cols) of the block's own part of a global matrix (stride ld): the
// thread's register tile times `scale`, written on the first pass and added after (the same thread
// owns the same elements on every pass: no other block or thread touches them)
__device__ inline void tile_update(float *dst, int64_t ld, const float part[2][4], float scale, bool first,
                                   int64_t rows, int d0, int cols) {
    FT_UNROLL for (int i = 0; i < 2; i++)
        FT_UNROLL for (int j = 0; j < 4; j++) {
            const int r = tile_row(i), c = d0 + tile_col(j);
            if (r < rows && c < cols) {
                float *o = dst + r * ld + c;
                *o = first ? part[i][j] * scale : *o + part[i][j] * scale;
            }
        }
}

// the dropout of probability index i: 1 (kept) or 0, from the kept mask or the hash
__device__ inline int kept(const uint8_t *dmask, int64_t i, uint32_t thr, uint64_t key) {
    return !thr ? 1 : dmask ? dmask[i] : ft_dropout_keep(key, (uint64_t)i, thr);
}

// acc = A B^T for a 32 x 32 tile: rows of a (stride lda, na real) times rows of b (stride ldb, nb
// real) over `cols` columns, chunk by chunk through As and Bs (every thread of the block calls it)
template <typename H>
__device__ inline void product_tile_abt(float acc[2][4], op_tile<H> &As, op_tile<H> &Bs, res_tile<H> &R,
                                        const float *a, int64_t lda, int64_t na, const float *b, int64_t ldb,
                                        int64_t nb, int cols) {
    if constexpr (is_f32<H>) {
        FT_UNROLL for (int i = 0; i < 2; i++)
            FT_UNROLL for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
        for (int d0 = 0; d0 < cols; d0 += AT_TILE) {
            load_chunk<H>(As, a, lda, na, d0, cols);
            load_chunk<H>(Bs, b, ldb, nb, d0, cols);
            __syncthreads();
            simt_product<AB_T>(acc, As, Bs);
            __syncthreads();
        }
    } else {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> f;
        wmma::fill_fragment(f, 0.0f);
        for (int d0 = 0; d0 < cols; d0 += AT_TILE) {
            load_chunk<H>(As, a, lda, na, d0, cols);
            load_chunk<H>(Bs, b, ldb, nb, d0, cols);
            __syncthreads();
            wmma_product<AB_T, H>(f, As, Bs, warp_row0(), warp_col0());
            __syncthreads();
        }
        wmma_result(acc, f, R);
    }
}

// a probability from its scaled score and its row's statistics: the forward's and the backward's
// recomputation are the same expression over the same bits
__device__ inline float prob_of(float score_acc, float scale, float m, float inv) {
    return expf(score_acc * scale - m) * inv;
}

// local attention: query i sees key j when |i - j| <= half (half < 0: every key)
__device__ inline bool in_reach(int64_t i, int64_t j, int64_t half) {
    return half < 0 || (i - j <= half && j - i <= half);
}

// p = the probabilities of a tile (query rows q0.., keys k0..; zero outside the real ones): read
// from probs (P: the tile's P[0][0], row stride n), or recomputed from Q K^T and the rows' (m, 1/sum)
template <typename H>
__device__ inline void probs_tile(float p[2][4], op_tile<H> &As, op_tile<H> &Bs, res_tile<H> &R, const float *P,
                                  int64_t n, const float *qg, const float *kg, int64_t ld, int64_t nq, int64_t nk,
                                  int hs, float scale, const float m[2], const float inv[2], int64_t q0, int64_t k0,
                                  int64_t half) {
    if (!P) product_tile_abt<H>(p, As, Bs, R, qg, ld, nq, kg, ld, nk, hs);
    FT_UNROLL for (int i = 0; i < 2; i++)
        FT_UNROLL for (int j = 0; j < 4; j++) {
            const int r = tile_row(i), c = tile_col(j);
            p[i][j] = r >= nq || c >= nk || !in_reach(q0 + r, k0 + c, half) ? 0.0f
                      : P ? P[r * n + c] : prob_of(p[i][j], scale, m[i], inv[i]);
        }
}

// what the backward needs of a tile (query rows of qg / og, keys of kg / vg): p its probabilities
// (probs_tile), keep their dropout bits, dp the gradient reaching P = dropout's backward of dO V^T
// (zero outside the real rows and keys); element (r, c) has probability index pidx + r n + c
template <typename H>
__device__ inline void grad_tiles(float p[2][4], int keep[2][4], float dp[2][4], op_tile<H> &As, op_tile<H> &Bs,
                                  res_tile<H> &R, const float *P, int64_t n, const float *qg, const float *kg,
                                  const float *og, int64_t C, const float *vg, int64_t ld, int64_t nq, int64_t nk,
                                  int hs, float scale, const float m[2], const float inv[2], const uint8_t *dmask,
                                  int64_t pidx, uint32_t thr, float keep_scale, uint64_t key, int64_t q0, int64_t k0,
                                  int64_t half) {
    probs_tile<H>(p, As, Bs, R, P, n, qg, kg, ld, nq, nk, hs, scale, m, inv, q0, k0, half);
    product_tile_abt<H>(dp, As, Bs, R, og, C, nq, vg, ld, nk, hs);
    FT_UNROLL for (int i = 0; i < 2; i++)
        FT_UNROLL for (int j = 0; j < 4; j++) {
            const int r = tile_row(i), c = tile_col(j);
            keep[i][j] = r < nq && c < nk ? kept(dmask, pidx + r * n + c, thr, key) : 0;
            dp[i][j] = keep[i][j] ? dp[i][j] * keep_scale : 0.0f;
        }
}

// the rows' (m, 1/sum) from stats ((N, NH, 2); rows of the tile from `row0`), or nothing when the
// probabilities are kept
__device__ inline void row_stats(float m[2], float inv[2], const float *stats, int64_t row0, int64_t nq, int NH,
                                 int head) {
    FT_UNROLL for (int i = 0; i < 2; i++) {
        const int r = tile_row(i);
        m[i] = 0.0f;
        inv[i] = 0.0f;
        if (stats && r < nq) {
            m[i] = stats[((row0 + r) * NH + head) * 2];
            inv[i] = stats[((row0 + r) * NH + head) * 2 + 1];
        }
    }
}

// grid (query tiles x heads, sequences): the block's rows of ctx, probs (when kept) and stats (when
// asked). Pass 1: each row's maximum and sum of exp, online per thread over the key tiles, then over
// the row's 8 threads (a fixed shuffle tree, then its first lane's bits for all 8). Pass 2: the scores again
// (the same bits), P = exp(s - m) / sum, dropout, ctx += Pd V, the block's own rows of ctx updated
// in place key tile by key tile.
template <typename H>
__global__ void __launch_bounds__(AT_THREADS, AT_MIN_BLOCKS)
attention_train_forward_kernel(const seq_entry *seqs, float *ctx, float *probs, float *stats, uint8_t *dmask,
                               const float *qkv, int64_t C, int NH, int hs, int tiles, float scale, uint32_t thr,
                               float keep_scale, uint64_t key, int64_t half) {
    __align__(32) __shared__ op_tile<H> As, Bs, Ps;
    __align__(32) __shared__ res_tile<H> R;
    const seq_entry sq = seqs[blockIdx.y];
    const int tile = (int)(blockIdx.x % tiles), head = (int)(blockIdx.x / tiles);
    const int64_t n = sq.n, q0 = (int64_t)tile * AT_TILE;
    if (q0 >= n) return;   // the whole block: before any barrier
    const int64_t ld = 3 * C, nq = min64(n - q0, AT_TILE);
    const float *qg = qkv + (sq.first + q0) * ld + (int64_t)head * hs;
    const float *kg = qkv + sq.first * ld + C + (int64_t)head * hs, *vg = kg + C;
    const int64_t pbase = sq.base + ((int64_t)head * n + q0) * n;   // index of the tile's P[0][0]
    float *og = ctx + (sq.first + q0) * C + (int64_t)head * hs;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    for (int64_t k0 = 0; k0 < n; k0 += AT_TILE) {
        float acc[2][4];
        product_tile_abt<H>(acc, As, Bs, R, qg, ld, nq, kg + k0 * ld, ld, n - k0, hs);
        FT_UNROLL for (int i = 0; i < 2; i++) {
            float mt = -INFINITY;
            FT_UNROLL for (int j = 0; j < 4; j++)
                if (k0 + tile_col(j) < n && in_reach(q0 + tile_row(i), k0 + tile_col(j), half))
                    mt = fmaxf(mt, acc[i][j] * scale);
            if (mt != -INFINITY) {   // else none of this thread's columns is a key here
                const float mn = fmaxf(m[i], mt);
                float sum = l[i] * expf(m[i] - mn);
                FT_UNROLL for (int j = 0; j < 4; j++)
                    if (k0 + tile_col(j) < n && in_reach(q0 + tile_row(i), k0 + tile_col(j), half))
                        sum += expf(acc[i][j] * scale - mn);
                l[i] = sum;
                m[i] = mn;
            }
        }
    }
    float inv[2];
    FT_UNROLL for (int i = 0; i < 2; i++) {
        for (int o = 4; o > 0; o >>= 1) {   // the row's 8 threads are adjacent lanes of one warp
            const float mo = __shfl_xor_sync(0xffffffffu, m[i], o), lo = __shfl_xor_sync(0xffffffffu, l[i], o);
            const float mn = fmaxf(m[i], mo);
            l[i] = (m[i] == -INFINITY ? 0.0f : l[i] * expf(m[i] - mn)) + (mo == -INFINITY ? 0.0f : lo * expf(mo - mn));
            m[i] = mn;
        }
        // the row's first lane's bits for all 8 (nvcc may fuse either product into the sum, which
        // makes the pair's results differ in the last bit): the statistics written are the ones used
        const int first_lane = (int)(threadIdx.x & 31) & ~7;
        m[i] = __shfl_sync(0xffffffffu, m[i], first_lane);
        l[i] = __shfl_sync(0xffffffffu, l[i], first_lane);
        inv[i] = 1.0f / l[i];
        const int r = tile_row(i);
        if (stats && (threadIdx.x & 7) == 0 && r < nq) {
            stats[((sq.first + q0 + r) * NH + head) * 2] = m[i];
            stats[((sq.first + q0 + r) * NH + head) * 2 + 1] = inv[i];
        }
    }
    for (int64_t k0 = 0; k0 < n; k0 += AT_TILE) {
        float acc[2][4];
        product_tile_abt<H>(acc, As, Bs, R, qg, ld, nq, kg + k0 * ld, ld, n - k0, hs);
        FT_UNROLL for (int i = 0; i < 2; i++)
            FT_UNROLL for (int j = 0; j < 4; j++) {
                const int r = tile_row(i), c = tile_col(j);
                float pd = 0.0f;
                if (r < nq && k0 + c < n) {
                    const int64_t at = r * n + k0 + c;
                    const float p = in_reach(q0 + r, k0 + c, half) ? prob_of(acc[i][j], scale, m[i], inv[i]) : 0.0f;
                    if (probs) probs[pbase + at] = p;
                    pd = p;
                    if (thr) {
                        const int keep = ft_dropout_keep(key, (uint64_t)(pbase + at), thr);
                        if (dmask) dmask[pbase + at] = (uint8_t)keep;
                        pd = keep ? p * keep_scale : 0.0f;
                    }
                }
                Ps[r][c] = from_f<H>(pd);
            }
        for (int d0 = 0; d0 < hs; d0 += AT_TILE) {
            load_chunk<H>(Bs, vg + k0 * ld, ld, n - k0, d0, hs);
            __syncthreads();   // and Ps written
            float part[2][4];
            tile_product<A_B, H>(part, Ps, Bs, R);
            tile_update(og, C, part, 1.0f, k0 == 0, nq, d0, hs);
            __syncthreads();
        }
    }
}

// grid (query tiles x heads, sequences): the tile's rows of dQ, and D for them
template <typename H>
__global__ void __launch_bounds__(AT_THREADS, AT_MIN_BLOCKS)
attention_backward_dq_kernel(const seq_entry *seqs, float *dqkv, float *Dsum, const float *dctx, const float *qkv,
                             const float *probs, const float *stats, const uint8_t *dmask, int64_t C, int NH, int hs,
                             int tiles, float scale, uint32_t thr, float keep_scale, uint64_t key, int64_t half) {
    __align__(32) __shared__ op_tile<H> As, Bs, Ss;
    __align__(32) __shared__ res_tile<H> R;
    const seq_entry sq = seqs[blockIdx.y];
    const int tile = (int)(blockIdx.x % tiles), head = (int)(blockIdx.x / tiles);
    const int64_t n = sq.n, q0 = (int64_t)tile * AT_TILE;
    if (q0 >= n) return;
    const int64_t ld = 3 * C, nq = min64(n - q0, AT_TILE);
    const float *og = dctx + (sq.first + q0) * C + (int64_t)head * hs;
    const float *qg = qkv + (sq.first + q0) * ld + (int64_t)head * hs;
    const float *kg = qkv + sq.first * ld + C + (int64_t)head * hs, *vg = kg + C;
    float *dq = dqkv + (sq.first + q0) * ld + (int64_t)head * hs;
    const int64_t pbase = sq.base + ((int64_t)head * n + q0) * n;
    const float *P = probs ? probs + pbase : nullptr;
    float m[2], inv[2];
    row_stats(m, inv, probs ? nullptr : stats, sq.first + q0, nq, NH, head);
    // D_r = sum_c P_rc dP_rc
    float dsum[2] = {0.0f, 0.0f};
    for (int64_t k0 = 0; k0 < n; k0 += AT_TILE) {
        float p[2][4], dp[2][4];
        int keep[2][4];
        grad_tiles<H>(p, keep, dp, As, Bs, R, P ? P + k0 : nullptr, n, qg, kg + k0 * ld, og, C, vg + k0 * ld, ld, nq,
                      n - k0, hs, scale, m, inv, dmask, pbase + k0, thr, keep_scale, key, q0, k0, half);
        FT_UNROLL for (int i = 0; i < 2; i++)
            FT_UNROLL for (int j = 0; j < 4; j++) dsum[i] += dp[i][j] * p[i][j];   // zero outside the tile
    }
    FT_UNROLL for (int i = 0; i < 2; i++)   // over the row's 8 threads (adjacent lanes of one warp)
        for (int o = 4; o > 0; o >>= 1) dsum[i] += __shfl_xor_sync(0xffffffffu, dsum[i], o);
    if ((threadIdx.x & 7) == 0)
        FT_UNROLL for (int i = 0; i < 2; i++)
            if (tile_row(i) < nq) Dsum[(sq.first + q0 + tile_row(i)) * NH + head] = dsum[i];
    // dS = P (dP - D) per key tile, dQ += dS K scale
    for (int64_t k0 = 0; k0 < n; k0 += AT_TILE) {
        float p[2][4], dp[2][4];
        int keep[2][4];
        grad_tiles<H>(p, keep, dp, As, Bs, R, P ? P + k0 : nullptr, n, qg, kg + k0 * ld, og, C, vg + k0 * ld, ld, nq,
                      n - k0, hs, scale, m, inv, dmask, pbase + k0, thr, keep_scale, key, q0, k0, half);
        FT_UNROLL for (int i = 0; i < 2; i++)
            FT_UNROLL for (int j = 0; j < 4; j++) {
                const int r = tile_row(i), c = tile_col(j);
                Ss[r][c] = from_f<H>(r < nq && k0 + c < n ? p[i][j] * (dp[i][j] - dsum[i]) : 0.0f);
            }
        for (int d0 = 0; d0 < hs; d0 += AT_TILE) {
            load_chunk<H>(Bs, kg + k0 * ld, ld, n - k0, d0, hs);
            __syncthreads();   // and Ss written
            float part[2][4];
            tile_product<A_B, H>(part, Ss, Bs, R);
            tile_update(dq, ld, part, scale, k0 == 0, nq, d0, hs);
            __syncthreads();
        }
    }
}

// grid (key tiles x heads, sequences): the tile's key rows of dK and dV
template <typename H>
__global__ void __launch_bounds__(AT_THREADS, AT_MIN_BLOCKS)
attention_backward_dkv_kernel(const seq_entry *seqs, float *dqkv, const float *Dsum, const float *dctx,
                              const float *qkv, const float *probs, const float *stats, const uint8_t *dmask, int64_t C,
                              int NH, int hs, int tiles, float scale, uint32_t thr, float keep_scale, uint64_t key,
                              int64_t half) {
    __align__(32) __shared__ op_tile<H> As, Bs, Ss, Ps;
    __align__(32) __shared__ res_tile<H> R, R2;
    const seq_entry sq = seqs[blockIdx.y];
    const int tile = (int)(blockIdx.x % tiles), head = (int)(blockIdx.x / tiles);
    const int64_t n = sq.n, k0 = (int64_t)tile * AT_TILE;
    if (k0 >= n) return;
    const int64_t ld = 3 * C, nk = min64(n - k0, AT_TILE);
    const float *qg = qkv + sq.first * ld + (int64_t)head * hs;
    const float *kt = qg + C + k0 * ld, *vt = qg + 2 * C + k0 * ld;   // the tile's K and V rows
    const float *og = dctx + sq.first * C + (int64_t)head * hs;
    float *dk = dqkv + (sq.first + k0) * ld + C + (int64_t)head * hs, *dv = dk + C;
    const int64_t hbase = sq.base + (int64_t)head * n * n;   // index of the head's P[0][0]
    for (int64_t q0 = 0; q0 < n; q0 += AT_TILE) {
        const int64_t nq = min64(n - q0, AT_TILE);
        float m[2], inv[2], p[2][4], dp[2][4];
        int keep[2][4];
        row_stats(m, inv, probs ? nullptr : stats, sq.first + q0, nq, NH, head);
        grad_tiles<H>(p, keep, dp, As, Bs, R, probs ? probs + hbase + q0 * n + k0 : nullptr, n, qg + q0 * ld, kt,
                      og + q0 * C, C, vt, ld, nq, nk, hs, scale, m, inv, dmask, hbase + q0 * n + k0, thr, keep_scale,
                      key, q0, k0, half);
        FT_UNROLL for (int i = 0; i < 2; i++) {
            const int r = tile_row(i);
            const float D = r < nq ? Dsum[(sq.first + q0 + r) * NH + head] : 0.0f;
            FT_UNROLL for (int j = 0; j < 4; j++) {
                const int c = tile_col(j);
                Ss[r][c] = from_f<H>(r < nq && c < nk ? p[i][j] * (dp[i][j] - D) : 0.0f);
                Ps[r][c] = from_f<H>(keep[i][j] ? p[i][j] * keep_scale : 0.0f);
            }
        }
        for (int d0 = 0; d0 < hs; d0 += AT_TILE) {
            load_chunk<H>(As, og + q0 * C, C, nq, d0, hs);
            load_chunk<H>(Bs, qg + q0 * ld, ld, nq, d0, hs);
            __syncthreads();   // and Ss, Ps written
            float gv[2][4], gk[2][4];
            tile_product<AT_B, H>(gv, Ps, As, R);
            tile_product<AT_B, H>(gk, Ss, Bs, R2);
            tile_update(dv, ld, gv, 1.0f, q0 == 0, nk, d0, hs);
            tile_update(dk, ld, gk, scale, q0 == 0, nk, d0, hs);
            __syncthreads();
        }
    }
}

// ---- the per-sequence variant -------------------------------------------------------------------
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

// sequences run one after another: two (NH, T, T) score blocks
size_t per_sequence_scratch_bytes(int64_t T, int64_t NH) { return 2 * (size_t)NH * (size_t)T * (size_t)T * sizeof(float); }

// strided-batched C = alpha op(A) op(B) + beta C over float32 matrices (column-major, cuBLAS's
// view); below float32 the spans A and B cover are rounded to prec first (round_operands: nearest
// even, as the CPU rounds) and multiplied on tensor cores with float32 sums
ft_status gemm_batched(ft_backend *be, cublasHandle_t h, ft_dtype prec, cublasOperation_t ta, cublasOperation_t tb,
                       int m, int n, int k, const float *alpha, const float *A, int lda, long long sa, const float *B, int ldb,
                       long long sb, const float *beta, float *C, int ldc, long long sc, int batch, const char *what) {
    cublasStatus_t st;
    if (prec == FT_F32) {
        st = cublasSgemmStridedBatched(h, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch);
    } else {
        if (m == 0 || n == 0 || batch == 0) return FT_OK;
        // the floats each operand's matrices reach, from its first (column-major: rows x cols, ld)
        auto span = [batch](int64_t rows, int64_t cols, int64_t ld, int64_t stride) {
            return rows == 0 || cols == 0 ? (int64_t)0 : (int64_t)(batch - 1) * stride + (cols - 1) * ld + rows;
        };
        const int64_t na = ta == CUBLAS_OP_N ? span(m, k, lda, sa) : span(k, m, lda, sa);
        const int64_t nb = tb == CUBLAS_OP_N ? span(k, n, ldb, sb) : span(n, k, ldb, sb);
        void *ha, *hb;
        FT_TRY(round_operands(be, prec, A, 1, na, na, B, 1, nb, nb, &ha, &hb));
        st = cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, ha, half_type(prec), lda, sa, hb, half_type(prec),
                                        ldb, sb, beta, C, CUDA_R_32F, ldc, sc, batch, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT);
    }
    if (st != CUBLAS_STATUS_SUCCESS) return blas_fail(st, what);
    return FT_OK;
}

ft_status forward_per_sequence(ft_backend *be, ft_dtype prec, float *ctx, float *probs, uint8_t *dmask, const float *qkv,
                               const int32_t *seqs, int64_t B, int64_t C, int64_t NH, float p, uint64_t key,
                               float *scratch) {
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
        FT_TRY(gemm_batched(be, blas.h, prec, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)n, (int)hs, &scale, k, (int)ld, hs,
                            q, (int)ld, hs, &zero, P, (int)n, n * n, (int)NH, "attention scores"));
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
        FT_TRY(gemm_batched(be, blas.h, prec, CUBLAS_OP_N, CUBLAS_OP_N, (int)hs, (int)n, (int)n, &one, v, (int)ld, hs,
                            Pd, (int)n, n * n, &zero, ctx + first * C, (int)C, hs, (int)NH, "attention output"));
        base += NH * n * n;
    }
    return FT_OK;
}

ft_status backward_per_sequence(ft_backend *be, ft_dtype prec, float *dqkv, const float *dctx, const float *qkv, const float *probs,
                                const uint8_t *dmask, const int32_t *seqs, int64_t B, int64_t C, int64_t NH, float p,
                                uint64_t key, float *scratch) {
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
        FT_TRY(gemm_batched(be, blas.h, prec, CUBLAS_OP_N, CUBLAS_OP_T, (int)hs, (int)n, (int)n, &one, dout, (int)C, hs,
                            pd, (int)n, n * n, &zero, dv, (int)ld, hs, (int)NH, "attention dV"));
        // dPd_h (n, n) = dctx_h V_h^T: column-major dPd_h^T = V_h dctx_h^T
        FT_TRY(gemm_batched(be, blas.h, prec, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)n, (int)hs, &one, v, (int)ld, hs,
                            dout, (int)C, hs, &zero, dS, (int)n, n * n, (int)NH, "attention dP"));
        FT_LAUNCH(softmax_dropout_backward_kernel, (unsigned)((rows + 7) / 8), 256, 0, c->stream)(
            dS, P, dmask ? dmask + base : nullptr, rows, n, base, thr, keep_scale, key);
        FT_TRY(launched("attention_backward"));
        // dQ_h (n, hs) = dS_h K_h scale: column-major dQ_h^T = K_h^T dS_h^T
        FT_TRY(gemm_batched(be, blas.h, prec, CUBLAS_OP_N, CUBLAS_OP_N, (int)hs, (int)n, (int)n, &scale, k, (int)ld, hs,
                            dS, (int)n, n * n, &zero, dq, (int)ld, hs, (int)NH, "attention dQ"));
        // dK_h (n, hs) = dS_h^T Q_h scale: column-major dK_h^T = Q_h^T dS_h
        FT_TRY(gemm_batched(be, blas.h, prec, CUBLAS_OP_N, CUBLAS_OP_T, (int)hs, (int)n, (int)n, &scale, q, (int)ld, hs,
                            dS, (int)n, n * n, &zero, dk, (int)ld, hs, (int)NH, "attention dK"));
        base += NH * n * n;
    }
    return FT_OK;
}


// ---- which variant ------------------------------------------------------------------------------
enum variant_id { FUSED, PER_SEQUENCE, UNKNOWN };

variant_id read_variant() {
    const char *s = getenv("FASTTRAN_CUDA_TRAIN_ATTENTION");
    if (!s || !*s || !strcmp(s, "fused")) return FUSED;
    return !strcmp(s, "per_sequence") ? PER_SEQUENCE : UNKNOWN;
}

// FASTTRAN_CUDA_TRAIN_ATTENTION, read once per process (scratch sizes and ops always agree)
variant_id variant() {
    static const variant_id v = read_variant();
    return v;
}

ft_status unknown_variant(const char *op) {
    return g_host->error(FT_ERR_INVALID_ARGUMENT, "%s: FASTTRAN_CUDA_TRAIN_ATTENTION=%s is not a variant: use fused "
                         "(the default) or per_sequence", op, getenv("FASTTRAN_CUDA_TRAIN_ATTENTION"));
}

// ---- the fused variant's launches ---------------------------------------------------------------
size_t table_bytes(int64_t B) { return ((size_t)B * sizeof(seq_entry) + 255) / 256 * 256; }

// the table and D: N <= B T rows of NH floats
size_t fused_scratch_bytes(int64_t B, int64_t T, int64_t NH) {
    return table_bytes(B) + (size_t)B * (size_t)T * (size_t)NH * sizeof(float);
}

// the sequence table copied into the scratch (queued on the stream; the pageable copy has read the
// host table when it returns); *tiles = 32-row tiles of the longest sequence. with_d: the scratch
// must also hold D, NH floats per row
ft_status upload_table(cuda_ctx *c, const int32_t *seqs, int64_t B, int64_t NH, void *scratch, size_t scratch_bytes,
                       bool with_d, const char *op, int64_t *tiles) {
    seq_entry *t = static_cast<seq_entry *>(malloc((size_t)B * sizeof(seq_entry)));
    if (!t) return g_host->error(FT_ERR_NOMEM, "%s: out of memory for the table of %lld sequences", op, (long long)B);
    int64_t base = 0, longest = 0, end = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t first = seqs[3 * b], n = seqs[3 * b + 1];
        t[b] = seq_entry{first, n, base};
        base += NH * n * n;
        longest = n > longest ? n : longest;
        end = first + n > end ? first + n : end;
    }
    const size_t need = table_bytes(B) + (with_d ? (size_t)end * (size_t)NH * sizeof(float) : 0);
    *tiles = (longest + AT_TILE - 1) / AT_TILE;
    if (scratch_bytes < need) {
        free(t);
        return g_host->error(FT_ERR_INVALID_ARGUMENT, "%s: scratch of %zu bytes given, %zu needed "
                             "(attention_train_scratch_bytes)", op, scratch_bytes, need);
    }
    if (*tiles * NH > 0x7fffffff) {
        free(t);
        return g_host->error(FT_ERR_INVALID_ARGUMENT, "%s: %lld heads x %lld row tiles is too many", op, (long long)NH,
                             (long long)*tiles);
    }
    const cudaError_t e = cudaMemcpyAsync(scratch, t, (size_t)B * sizeof(seq_entry), cudaMemcpyHostToDevice, c->stream);
    free(t);
    return e == cudaSuccess ? FT_OK : cuda_fail(e, op);
}

// kernel(args...) over grid (tiles x NH, B) in slices of 65535 sequences (gridDim.y); the kernel's
// sequence-table argument is the slice's
template <typename K, typename... A>
ft_status launch_over_sequences(cuda_ctx *c, K kernel, const char *op, int64_t B, int64_t tiles, int64_t NH,
                                const seq_entry *table, A... args) {
    for (int64_t b0 = 0; b0 < B; b0 += 65535) {
        const int64_t nb = B - b0 < 65535 ? B - b0 : 65535;
        FT_LAUNCH(kernel, dim3((unsigned)(tiles * NH), (unsigned)nb), AT_THREADS, 0, c->stream)(table + b0, args...);
        FT_TRY(launched(op));
    }
    return FT_OK;
}

}  // namespace

size_t cuda_attention_train_scratch_bytes(ft_backend *, int64_t B, int64_t T, int64_t NH) {
    return variant() == PER_SEQUENCE ? per_sequence_scratch_bytes(T, NH) : fused_scratch_bytes(B, T, NH);
}

namespace {

// the products' precision of the attention ops: float32, or bfloat16 / float16 on a device that has
// them on its tensor cores
ft_status check_prec(cuda_ctx *c, ft_dtype prec, const char *op) {
    if (prec != FT_F32 && prec != FT_BF16 && prec != FT_F16)
        return g_host->error(FT_ERR_INVALID_ARGUMENT, "%s: the products' precision must be float32, bfloat16 or "
                             "float16, got dtype %d", op, (int)prec);
    if (prec == FT_BF16 && c->cc_major < 8)
        return g_host->error(FT_ERR_UNSUPPORTED, "%s: bfloat16 products need an Ampere or newer GPU (compute "
                             "capability 8.0+); %s is %d.x: use float16", op, c->name, c->cc_major);
    if (prec == FT_F16 && c->cc_major < 7)
        return g_host->error(FT_ERR_UNSUPPORTED, "%s: float16 products need tensor cores (compute capability 7.0+); "
                             "%s is %d.x: use float32", op, c->name, c->cc_major);
    return FT_OK;
}

// local attention (window > 0): the fused kernels only, and no dropout
ft_status check_window(int64_t window, float p, variant_id v, const char *op) {
    if (window < 0) return g_host->error(FT_ERR_INVALID_ARGUMENT, "%s: window %lld < 0", op, (long long)window);
    if (window > 0 && p > 0.0f)
        return g_host->error(FT_ERR_UNSUPPORTED, "%s: dropout on local attention's probabilities (window %lld, p %g) "
                             "is not supported; use attention dropout 0", op, (long long)window, (double)p);
    if (window > 0 && v == PER_SEQUENCE)
        return g_host->error(FT_ERR_UNSUPPORTED, "%s: the per_sequence variant (FASTTRAN_CUDA_TRAIN_ATTENTION) has no "
                             "local attention (window %lld): use the fused one", op, (long long)window);
    return FT_OK;
}

// f(H()) with H the products' operand type of prec (float for FT_F32)
template <typename F> ft_status with_prec(ft_dtype prec, F &&f) {
    return prec == FT_BF16 ? f(__nv_bfloat16()) : prec == FT_F16 ? f(__half()) : f(float());
}

}  // namespace

ft_status cuda_attention_train_forward(ft_backend *be, ft_dtype prec, float *ctx, float *probs, float *stats,
                                       uint8_t *dmask, const float *qkv, const int32_t *seqs, int64_t B, int64_t C,
                                       int64_t NH, int64_t window, float p, uint64_t key, float *scratch,
                                       size_t scratch_bytes) {
    const char *op = "attention_train_forward";
    const variant_id v = variant();
    if (v == UNKNOWN) return unknown_variant(op);
    cuda_ctx *c = ctx_of(be);
    FT_TRY(check_prec(c, prec, op));
    FT_TRY(check_window(window, p, v, op));
    if (!probs && !stats)
        return g_host->error(FT_ERR_INVALID_ARGUMENT, "%s: probs and stats are both NULL (the backward needs one of "
                             "them)", op);
    if (B == 0) return FT_OK;
    if (v == PER_SEQUENCE) {
        if (!probs || stats)
            return g_host->error(FT_ERR_UNSUPPORTED, "%s: the per_sequence variant (FASTTRAN_CUDA_TRAIN_ATTENTION) "
                                 "keeps the probabilities and no statistics: recomputing them needs the fused one", op);
        return forward_per_sequence(be, prec, ctx, probs, dmask, qkv, seqs, B, C, NH, p, key, scratch);
    }
    if (prec != FT_F32 && !probs && !dmask && p == 0.0f) {   // cuDNN where it can (attention_cudnn.cu)
        bool ran = false;
        FT_TRY(cudnn_attention_train_forward(be, prec, ctx, stats, qkv, seqs, B, C, NH, window, &ran));
        if (ran) return FT_OK;
    }
    int64_t tiles = 0;
    FT_TRY(upload_table(c, seqs, B, NH, scratch, scratch_bytes, false, op, &tiles));
    if (tiles == 0) return FT_OK;
    const int hs = (int)(C / NH);
    const uint32_t thr = p > 0.0f ? ft_dropout_threshold(p) : 0;
    return with_prec(prec, [&](auto tag) {
        typedef decltype(tag) H;
        return launch_over_sequences(c, attention_train_forward_kernel<H>, op, B, tiles, NH,
                                     reinterpret_cast<const seq_entry *>(scratch), ctx, probs, stats, dmask, qkv, C,
                                     (int)NH, hs, (int)tiles, 1.0f / sqrtf((float)hs), thr,
                                     p > 0.0f ? 1.0f / (1.0f - p) : 1.0f, key, window > 0 ? window / 2 : (int64_t)-1);
    });
}

ft_status cuda_attention_backward(ft_backend *be, ft_dtype prec, float *dqkv, const float *dctx, const float *qkv,
                                  const float *probs, const float *stats, const uint8_t *dmask, const int32_t *seqs,
                                  int64_t B, int64_t C, int64_t NH, int64_t window, float p, uint64_t key,
                                  float *scratch, size_t scratch_bytes) {
    const char *op = "attention_backward";
    const variant_id v = variant();
    if (v == UNKNOWN) return unknown_variant(op);
    cuda_ctx *c = ctx_of(be);
    FT_TRY(check_prec(c, prec, op));
    FT_TRY(check_window(window, p, v, op));
    if (!probs && !stats) return g_host->error(FT_ERR_INVALID_ARGUMENT, "%s: probs and stats are both NULL", op);
    if (B == 0) return FT_OK;
    if (v == PER_SEQUENCE) {
        if (!probs)
            return g_host->error(FT_ERR_UNSUPPORTED, "%s: the per_sequence variant (FASTTRAN_CUDA_TRAIN_ATTENTION) "
                                 "reads kept probabilities: recomputing them needs the fused one", op);
        return backward_per_sequence(be, prec, dqkv, dctx, qkv, probs, dmask, seqs, B, C, NH, p, key, scratch);
    }
    if (prec != FT_F32 && !probs && !dmask && p == 0.0f) {   // cuDNN where it can (attention_cudnn.cu)
        bool ran = false;
        FT_TRY(cudnn_attention_backward(be, prec, dqkv, dctx, qkv, seqs, B, C, NH, window, &ran));
        if (ran) return FT_OK;
    }
    int64_t tiles = 0;
    FT_TRY(upload_table(c, seqs, B, NH, scratch, scratch_bytes, true, op, &tiles));
    if (tiles == 0) return FT_OK;
    const int hs = (int)(C / NH);
    const uint32_t thr = p > 0.0f ? ft_dropout_threshold(p) : 0;
    const float scale = 1.0f / sqrtf((float)hs), keep_scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
    const seq_entry *table = reinterpret_cast<const seq_entry *>(scratch);
    float *D = reinterpret_cast<float *>(reinterpret_cast<char *>(scratch) + table_bytes(B));
    const int64_t half = window > 0 ? window / 2 : -1;
    return with_prec(prec, [&](auto tag) {
        typedef decltype(tag) H;
        FT_TRY(launch_over_sequences(c, attention_backward_dq_kernel<H>, op, B, tiles, NH, table, dqkv, D, dctx, qkv,
                                     probs, stats, dmask, C, (int)NH, hs, (int)tiles, scale, thr, keep_scale, key, half));
        return launch_over_sequences(c, attention_backward_dkv_kernel<H>, op, B, tiles, NH, table, dqkv,
                                     static_cast<const float *>(D), dctx, qkv, probs, stats, dmask, C, (int)NH, hs,
                                     (int)tiles, scale, thr, keep_scale, key, half);
    });
}
