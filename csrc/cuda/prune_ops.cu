// CUDA ops for compressed models (fasttran.compress; see backend.h): a head mode per attention head
// (exact or off; sign matching runs on the CPU only), a masked FFN group's columns set to zero, and
// the per-row, per-component gradient x activation sums of first-order significance. Each output
// element is one chain in column order, as on the CPU.
#include "cuda_common.cuh"

using namespace ftcuda;

namespace {

template <typename T> __global__ void zero_columns_kernel(T *x, int64_t N, int64_t ld, int64_t col, int64_t ncols) {
    const int64_t total = N * ncols;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
        x[(i / ncols) * ld + col + i % ncols] = from_f<T>(0.0f);
}

__global__ void group_dot_kernel(float *out, int64_t ldo, const float *a, int64_t lda, const float *b, int64_t ldb,
                                 int64_t N, int64_t G, int64_t group) {
    const int64_t total = N * G;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / G, g = i % G;
        const float *x = a + r * lda + g * group, *y = b + r * ldb + g * group;
        float acc = 0.0f;
        for (int64_t c = 0; c < group; c++) acc = __fadd_rn(acc, __fmul_rn(x[c], y[c]));   // the CPU's chain, unfused
        out[r * ldo + g] = acc;
    }
}

}  // namespace

ft_status cuda_zero_columns(ft_backend *be, ft_dtype dt, void *x, int64_t N, int64_t ld, int64_t col, int64_t ncols) {
    if (col < 0 || ncols < 0 || col + ncols > ld)
        return g_host->error(FT_ERR_INVALID_ARGUMENT, "zero_columns: columns [%lld, %lld) of rows of %lld",
                             (long long)col, (long long)(col + ncols), (long long)ld);
    if (N == 0 || ncols == 0) return FT_OK;
    return with_dtype(dt, "zero_columns", [&](auto tag) -> ft_status {
        typedef decltype(tag) T;
        FT_LAUNCH(zero_columns_kernel<T>, grid_of(N * ncols, 256), 256, 0, ctx_of(be)->stream)((T *)x, N, ld, col,
                                                                                              ncols);
        return launched("zero_columns");
    });
}

ft_status cuda_group_dot(ft_backend *be, float *out, int64_t ldo, const float *a, int64_t lda, const float *b,
                         int64_t ldb, int64_t N, int64_t W, int64_t group) {
    if (group < 1 || W % group != 0)
        return g_host->error(FT_ERR_INVALID_ARGUMENT, "group_dot: groups of %lld do not divide %lld columns",
                             (long long)group, (long long)W);
    if (N == 0 || W == 0) return FT_OK;
    FT_LAUNCH(group_dot_kernel, grid_of(N * (W / group), 256), 256, 0, ctx_of(be)->stream)(out, ldo, a, lda, b, ldb,
                                                                                           N, W / group, group);
    return launched("group_dot");
}

// exact heads through attention_forward (all of them), then the heads that are off zeroed
ft_status cuda_attention_heads_forward(ft_backend *be, ft_dtype dt, void *ctx, const void *qkv, const int32_t *seqs,
                                       const int32_t *seqs_dev, int64_t B, int64_t C, int64_t NH, const uint8_t *modes,
                                       int64_t sign_keys, void *scratch) {
    (void)sign_keys;
    if (!modes) return g_host->error(FT_ERR_INVALID_ARGUMENT, "attention_heads_forward: no head modes");
    for (int64_t h = 0; h < NH; h++) {
        if (modes[h] == FT_ATTN_SIGN_MATCH)
            return g_host->error(FT_ERR_UNSUPPORTED, "attention_heads_forward: head %lld uses sign-matching attention, "
                                 "which runs on the CPU only; run this model with device='cpu'", (long long)h);
        if (modes[h] > FT_ATTN_OFF)
            return g_host->error(FT_ERR_INVALID_ARGUMENT, "attention_heads_forward: head %lld has mode %d; expected "
                                 "0 (exact), 1 (sign matching) or 2 (off)", (long long)h, (int)modes[h]);
    }
    FT_TRY(cuda_attention_forward(be, dt, ctx, qkv, seqs, seqs_dev, B, C, NH, 0, scratch));
    int64_t rows = 0;
    for (int64_t b = 0; b < B; b++) rows = seqs[3 * b] + seqs[3 * b + 2] > rows ? seqs[3 * b] + seqs[3 * b + 2] : rows;
    const int64_t hs = C / NH;
    for (int64_t h = 0; h < NH; h++)
        if (modes[h] == FT_ATTN_OFF) FT_TRY(cuda_zero_columns(be, dt, ctx, rows, C, h * hs, hs));
    return FT_OK;
}
