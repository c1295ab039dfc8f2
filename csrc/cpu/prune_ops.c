/* The CPU's ops for compressed models (fasttran.compress): a masked FFN group's columns set to zero
 * (zero_columns) and the per-row, per-component products of a gradient and an activation that
 * first-order significance sums (group_dot). Rows in parallel; each output element is one chain in
 * column order, so results never depend on the thread count. */
#include "cpu_ops.h"

ft_status cpu_zero_columns(ft_backend *be, ft_dtype dt, void *x, int64_t N, int64_t ld, int64_t col, int64_t ncols) {
    (void)be;
    FT_CPU_F32_ONLY(dt, "zero_columns");
    if (col < 0 || ncols < 0 || col + ncols > ld)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "zero_columns: columns [%lld, %lld) of rows of %lld",
                        (long long)col, (long long)(col + ncols), (long long)ld);
    float *f = x;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * ncols > 65536)
    for (int64_t r = 0; r < N; r++) memset(f + r * ld + col, 0, (size_t)ncols * sizeof(float));
    return FT_OK;
}

ft_status cpu_group_dot(ft_backend *be, float *out, int64_t ldo, const float *a, int64_t lda, const float *b,
                        int64_t ldb, int64_t N, int64_t W, int64_t group) {
    (void)be;
    if (group < 1 || W % group != 0)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "group_dot: groups of %lld do not divide %lld columns",
                        (long long)group, (long long)W);
    const int64_t G = W / group;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (N * W > 65536)
    for (int64_t r = 0; r < N; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *x = a + r * lda + g * group, *y = b + r * ldb + g * group;
            float acc = 0.0f;
            for (int64_t c = 0; c < group; c++) acc += x[c] * y[c];
            out[r * ldo + g] = acc;
        }
    return FT_OK;
}
