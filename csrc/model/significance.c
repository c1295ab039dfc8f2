/* First-order significance recorded by the layers' backward (see significance.h): per row of the
 * batch, group_dot(dctx, ctx) per head, group_dot(dL/dact, act) per FFN group and group_dot(dout,
 * out), group_dot(dout, x) per layer, into the columns of a table the stack grows with the batch.
 * The sums per sequence are taken on the host in row order, so they never depend on the thread
 * count or on the other sequences of the batch. */
#include "model/significance.h"

#include <stdlib.h>

#include "core/status.h"

typedef struct {
    int64_t first, count, group, heads, groups;
    int64_t *head_col, *ffn_col;   /* per layer of the stack: its first head's and FFN group's column */
} significance;

static const significance *of(const ft_layer_recorder *r) { return r->self; }

static ft_status record_output(const ft_layer_recorder *r, ft_backend *be, int64_t layer, const float *dout,
                               const float *out, const float *x, int64_t N, int64_t C) {
    const significance *s = of(r);
    float *col = r->rows + s->heads + s->groups + 2 * (layer - s->first);
    FT_TRY(be->group_dot(be, col, r->ld, dout, C, out, C, N, C, C));
    return be->group_dot(be, col + 1, r->ld, dout, C, x, C, N, C, C);
}

static ft_status record_ffn(const ft_layer_recorder *r, ft_backend *be, int64_t layer, const float *dact,
                            const float *act, int64_t N, int64_t I) {
    const significance *s = of(r);
    return be->group_dot(be, r->rows + s->ffn_col[layer - s->first], r->ld, dact, I, act, I, N, I, s->group);
}

static ft_status record_heads(const ft_layer_recorder *r, ft_backend *be, int64_t layer, const float *dctx,
                              const float *ctx, int64_t N, int64_t A, int64_t NH) {
    const significance *s = of(r);
    return be->group_dot(be, r->rows + s->head_col[layer - s->first], r->ld, dctx, A, ctx, A, N, A, A / NH);
}

static void release(ft_layer_recorder *r) {
    significance *s = r->self;
    if (s) {
        free(s->head_col);
        free(s->ffn_col);
        free(s);
    }
    r->self = NULL;
}

ft_status ft_significance_recorder(ft_layer_recorder *r, const ft_layer_shape *shapes, int64_t first, int64_t count,
                                   int64_t ffn_group) {
    if (ffn_group < 1) return ft_error(FT_ERR_INVALID_ARGUMENT, "significance: FFN group size %lld", (long long)ffn_group);
    for (int64_t l = 0; l < count; l++)
        if (shapes[l].inter % ffn_group)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "significance: FFN group size %lld does not divide layer %lld's "
                            "intermediate size %lld", (long long)ffn_group, (long long)(first + l),
                            (long long)shapes[l].inter);
    significance *s = calloc(1, sizeof *s);
    if (s) {
        s->head_col = malloc((size_t)count * sizeof(int64_t));
        s->ffn_col = malloc((size_t)count * sizeof(int64_t));
    }
    if (!s || !s->head_col || !s->ffn_col) {
        if (s) { free(s->head_col); free(s->ffn_col); free(s); }
        return ft_error(FT_ERR_NOMEM, "out of memory");
    }
    *s = (significance){first, count, ffn_group, 0, 0, s->head_col, s->ffn_col};
    for (int64_t l = 0; l < count; l++) {   /* the heads' columns, then the groups' */
        s->head_col[l] = s->heads;
        s->heads += shapes[l].heads;
    }
    for (int64_t l = 0; l < count; l++) {
        s->ffn_col[l] = s->heads + s->groups;
        s->groups += shapes[l].inter / ffn_group;
    }
    *r = (ft_layer_recorder){s, s->heads + s->groups + 2 * count, NULL, record_output, record_ffn, record_heads,
                             release};
    return FT_OK;
}

ft_status ft_significance_sums(const ft_layer_recorder *r, ft_backend *be, const int32_t *seqs, int64_t B, int64_t N,
                               float *heads, float *ffn, float *layers) {
    const significance *s = of(r);
    const int64_t ld = r->ld, nh = s->heads, ng = s->groups;
    float *rows = malloc((size_t)N * (size_t)ld * sizeof(float) + 1);
    if (!rows) return ft_error(FT_ERR_NOMEM, "out of memory");
    ft_status st = be->download(be, rows, r->rows, (size_t)N * (size_t)ld * sizeof(float));
    for (int64_t b = 0; st == FT_OK && b < B; b++) {
        const int64_t first = seqs[3 * b], n = seqs[3 * b + 1];
        for (int64_t j = 0; j < ld; j++) {   /* each column summed over the sequence's rows, in row order */
            double acc = 0.0;
            for (int64_t i = first; i < first + n; i++) acc += rows[i * ld + j];
            if (j < nh) { if (heads) heads[b * nh + j] = (float)acc; }
            else if (j < nh + ng) { if (ffn) ffn[b * ng + j - nh] = (float)acc; }
            else if (layers && (j - nh - ng) % 2 == 0) layers[b * s->count + (j - nh - ng) / 2] = (float)acc;
            else if (layers) layers[b * s->count + (j - nh - ng) / 2] -= (float)acc;
        }
    }
    free(rows);
    return st;
}
