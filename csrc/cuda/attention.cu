// Attention on the GPU over packed sequences (backend.h): per sequence, S = Q K^T * scale with
// cuBLAS strided-batched GEMMs over its heads (queries = its rows, keys = its first `keys` rows,
// all real), a softmax kernel over S in place, then P V written straight into the head's
// columns of ctx. S is materialised (NH, rows, keys) per sequence in fp32 scratch; the fused
// kernel that never writes S (flash-style) is the next step and has to be measured against this
// one on a GPU first (see the CUDA issue's closing note).
//
// A sequence with no real key gets a zero output, the same as transformers' SDPA path and the
// CPU backend.
#include <math.h>

#include "cuda_common.cuh"

using namespace ftcuda;

namespace {

// one warp per score row: max-subtracted softmax in place (every key is real)
__global__ void softmax_kernel(float *S, int64_t rows, int64_t nk) {
    const int64_t row = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float *s = S + row * nk;
    float mx = -INFINITY;
    for (int64_t j = lane; j < nk; j += 32) mx = fmaxf(mx, s[j]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int64_t j = lane; j < nk; j += 32) {
        float e = __expf(s[j] - mx);
        s[j] = e;
        sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = 1.0f / sum;
    for (int64_t j = lane; j < nk; j += 32) s[j] *= inv;
}

}  // namespace

size_t cuda_attention_scratch_bytes(ft_backend *, int64_t B, int64_t T, int64_t NH) {
    return (size_t)B * (size_t)NH * (size_t)T * (size_t)T * sizeof(float);
}

ft_status cuda_attention_forward(ft_backend *be, float *ctx, const float *qkv, const int32_t *seqs, int64_t B,
                                 int64_t C, int64_t NH, float *scratch) {
    cuda_ctx *c = ctx_of(be);
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
        FT_CUBLAS(cublasSgemmStridedBatched(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)nk, (int)nq, (int)hs, &scale, k,
                                            (int)ld, hs, q, (int)ld, hs, &zero, S, (int)nk, nq * nk, (int)NH),
                  "attention scores");
        const int64_t rows = NH * nq;
        const int warps = 8;
        FT_LAUNCH(softmax_kernel, (unsigned)((rows + warps - 1) / warps), warps * 32, 0, c->stream)(S, rows, nk);
        ft_status st = launched("attention softmax");
        if (st != FT_OK) return st;
        // row-major ctx_h (nq, hs) = P_h (nq, nk) V_h (nk, hs): column-major ctx_h^T = V_h^T P_h^T
        FT_CUBLAS(cublasSgemmStridedBatched(c->blas, CUBLAS_OP_N, CUBLAS_OP_N, (int)hs, (int)nq, (int)nk, &one, v,
                                            (int)ld, hs, S, (int)nk, nq * nk, &zero, out, (int)C, hs, (int)NH),
                  "attention output");
        S += NH * nq * nk;
    }
    return FT_OK;
}
