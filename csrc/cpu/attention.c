/* Attention on the CPU over packed sequences: sequence b owns rows [first, first + rows) of
 * qkv and ctx, and its keys are its first `keys` rows (the real tokens; padded rows, when the
 * caller wants them computed, come after and are queries only). No mask is needed and no score
 * is computed for a padded key.
 *
 * One task per (sequence, head), run by any thread: K^T is packed into key panels once, then
 * per block of MR query rows: S = Q K^T (the micro-kernel, K = head size, Q read in place),
 * softmax with the scale in place, then P V into the head's columns of ctx (the micro-kernel,
 * K = keys, P read in place, V packed into panels once per task). Every score and every output element is one chain in a
 * fixed order (kernels.h, rowfun.h), so a query row's result depends on its own sequence only,
 * not on the rows computed beside it or on the thread count. A sequence with no real key gets a
 * zero output, as transformers' default (SDPA) path and torch's SDPA give.
 *
 * A training forward (attention_train_forward, train_layer.c) runs the same tasks: each row of
 * probabilities is also kept for the backward (or only its softmax statistics, from which the
 * backward recomputes it), then dropped out in place before P V. In mixed precision (prec bf16 /
 * fp16) Q, K, V and the dropped probabilities are rounded to it before their products, as the
 * GPU's tensor cores read them; the kept probabilities and the statistics stay float32.
 *
 * A window (local attention, ModernBERT): a block of query rows computes scores only over the key
 * panels its rows reach, softmax over each row's own reach, zeros elsewhere in the block (adding
 * 0 x V changes no bit), so a row's result still depends on its own sequence only. A training
 * forward keeps the row (0 outside its reach) and the statistics of its reach; no dropout.
 *
 * attention_heads_forward (compressed models: a mode per head, sign matching) is its own op, in
 * attention_heads.c; its exact heads run ft_cpu_attention_head, the tasks above. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "core/status.h"
#include "cpu_ops.h"
#include "kernels.h"
#include "rowfun.h"

size_t cpu_attention_scratch_bytes(ft_backend *be, ft_dtype dt, int64_t B, int64_t T, int64_t NH) {
    (void)be; (void)dt; (void)B; (void)T; (void)NH;
    return 0;   /* per-thread scratch is allocated by the op for the longest sequence */
}

/* A training forward's extras for one (sequence, head): the probabilities kept for the backward
 * and the dropout applied to them before P V */
typedef struct {
    float *probs;        /* (n, n) softmax output, row stride n, or NULL (not kept) */
    float *stats;        /* row i's {max, 1 / sum} at stats + i stats_ld, or NULL */
    int64_t stats_ld;
    uint8_t *dmask;      /* (n, n) 1 = kept, or NULL */
    uint64_t key, base;  /* element (i, j) keeps ft_dropout_keep(key, base + i n + j) */
    uint32_t thr;        /* 0: no dropout */
    float keep_scale;
    ft_dtype prec;       /* FT_BF16 / FT_F16: Q, K, V and the dropped P rounded to it before products */
} head_train;

/* one (sequence, head): q points at the head's columns of the sequence's first row; tr: NULL
 * for inference */
static void head_forward(const ft_cpu_kernel *kr, float *out, const float *q, int64_t nq, int64_t nk, int64_t hs,
                         int64_t ld, int64_t C, float scale, float *kp, float *vp, float *S, float *qpad,
                         const head_train *tr, int64_t half) {
    const int mr = kr->mr, nr = kr->nr;
    const float *k = q + C, *v = q + 2 * C;
    const int64_t kpanels = (nk + nr - 1) / nr, lds = kpanels * nr;
    /* K^T in panels: panel p, element (d, j) = K[p nr + j][d] (register transposes) */
    ft_cpu_pack_keys_t(kp, k, ld, nk, hs);
    const ft_dtype prec = tr ? tr->prec : FT_F32;
    if (prec != FT_F32) ft_cpu_round_row(kp, kp, kpanels * nr * hs, prec);
    /* V in panels of nr head columns, rows contiguous (read in place, each of its rows would sit
     * in another page: one TLB entry per key) */
    const int64_t vpanels = (hs + nr - 1) / nr;
    for (int64_t p = 0; p < vpanels; p++) {
        const int64_t n = hs - p * nr < nr ? hs - p * nr : nr;
        for (int64_t key = 0; key < nk; key++) {
            float *row = vp + (p * nk + key) * nr;
            const float *src = v + key * ld + p * nr;
            for (int64_t c = 0; c < nr; c++) row[c] = c < n ? src[c] : 0.0f;
            if (prec != FT_F32) ft_cpu_round_row(row, row, n, prec);
        }
    }
    for (int64_t i0 = 0; i0 < nq; i0 += mr) {
        const int m = (int)(nq - i0 < mr ? nq - i0 : mr);
        /* the block's keys: all, or (a window of half each side) the panels from the first key
         * its first row reaches to the last one its last row does; kb a multiple of nr */
        int64_t kb = 0, ke = nk;
        if (half >= 0) {
            kb = i0 - half > 0 ? (i0 - half) / nr * nr : 0;
            ke = i0 + m + half < nk ? i0 + m + half : nk;
            if (ke <= kb) {   /* no key in reach of any row of the block: zeros */
                for (int i = 0; i < m; i++) memset(out + (i0 + i) * C, 0, (size_t)hs * sizeof(float));
                continue;
            }
        }
        const int64_t nkb = ke - kb, p0 = kb / nr;
        const float *qa = q + i0 * ld;
        int64_t lda = ld;
        if (m < mr || prec != FT_F32) {   /* a short block: zero-padded copy of its rows, and no stale scores */
            ft_copy_rows(qpad, qa, ld, m, hs, mr);
            if (prec != FT_F32) ft_cpu_round_row(qpad, qpad, (int64_t)m * hs, prec);
            qa = qpad;
            lda = hs;
            for (int i = m; i < mr; i++) memset(S + i * lds, 0, (size_t)nkb * sizeof(float));
        }
        /* S (m x nkb) = Q K^T over the block's keys, unscaled */
        for (int64_t p = p0; p * nr < ke; p++) {
            const int n = (int)(ke - p * nr < nr ? ke - p * nr : nr);
            kr->tile(hs, qa, lda, kp + p * hs * nr, nr, S + (p - p0) * nr, lds, m, n, 0);
        }
        for (int i = 0; i < m && half >= 0; i++) {   /* a window: softmax over the row's reach, zeros around it */
            float *row = S + i * lds;
            const int64_t qi = i0 + i, lo = qi - half > kb ? qi - half : kb, hi = qi + half + 1 < ke ? qi + half + 1 : ke;
            float *st = tr && tr->stats ? tr->stats + qi * tr->stats_ld : NULL;
            if (hi <= lo) {
                memset(row, 0, (size_t)nkb * sizeof(float));
                if (st) st[0] = st[1] = 0.0f;   /* recomputed: exp(.) 0 = 0 */
                if (tr && tr->probs) memset(tr->probs + qi * nk, 0, (size_t)nk * sizeof(float));
                continue;
            }
            ft_cpu_softmax_row(row + (lo - kb), hi - lo, scale, st);
            memset(row, 0, (size_t)(lo - kb) * sizeof(float));
            memset(row + (hi - kb), 0, (size_t)(ke - hi) * sizeof(float));
            if (!tr) continue;   /* a training forward (no dropout with a window): the row kept, 0 outside its reach */
            if (tr->probs) {
                float *pr = tr->probs + qi * nk;
                memset(pr, 0, (size_t)nk * sizeof(float));
                memcpy(pr + lo, row + (lo - kb), (size_t)(hi - lo) * sizeof(float));
            }
            if (prec != FT_F32) ft_cpu_round_row(row, row, nkb, prec);
        }
        for (int i = 0; i < m && half < 0; i++) {
            float *row = S + i * lds;
            ft_cpu_softmax_row(row, nk, scale, tr && tr->stats ? tr->stats + (i0 + i) * tr->stats_ld : NULL);
            if (!tr) continue;
            const int64_t e = (i0 + i) * nk;   /* the row's first element in the (nq, nk) block */
            if (tr->probs) memcpy(tr->probs + e, row, (size_t)nk * sizeof(float));
            if (tr->thr) ft_cpu_dropout_row(row, tr->dmask ? tr->dmask + e : NULL, nk, tr->key, tr->base + e, tr->thr,
                                            tr->keep_scale);
            if (prec != FT_F32) ft_cpu_round_row(row, row, nk, prec);
        }
        /* out (m x hs) = P V, P read in place from S */
        for (int64_t p = 0; p < vpanels; p++) {
            const int n = (int)(hs - p * nr < nr ? hs - p * nr : nr);
            kr->tile(nkb, S, lds, vp + (p * nk + kb) * nr, nr, out + i0 * C + p * nr, C, m, n, 0);
        }
    }
}

/* per-thread scratch of one (sequence, head) task, sequences of at most maxk keys: K^T panels, V
 * panels, one block of scores, a padded Q block (floats) */
static size_t head_scratch_floats(const ft_cpu_kernel *kr, int64_t maxk, int64_t hs) {
    const int64_t lds = (maxk + kr->nr - 1) / kr->nr * kr->nr, hsp = (hs + kr->nr - 1) / kr->nr * kr->nr;
    return (size_t)(lds * hs + maxk * hsp + kr->mr * lds + hs * kr->mr);
}

/* one (sequence, head) task in buf (head_scratch_floats(maxk, hs)) */
static void head_task(const ft_cpu_kernel *kr, float *buf, int64_t maxk, float *out, const float *q, int64_t nq,
                      int64_t nk, int64_t hs, int64_t C, const head_train *tr, int64_t half) {
    const int64_t lds = (maxk + kr->nr - 1) / kr->nr * kr->nr, hsp = (hs + kr->nr - 1) / kr->nr * kr->nr;
    float *kp = buf, *vp = kp + lds * hs, *S = vp + maxk * hsp, *qpad = S + kr->mr * lds;
    head_forward(kr, out, q, nq, nk, hs, 3 * C, C, 1.0f / sqrtf((float)hs), kp, vp, S, qpad, tr, half);
}

size_t ft_cpu_attention_head_floats(int64_t maxk, int64_t hs) {
    return head_scratch_floats(ft_cpu_kernel_get(), maxk, hs);
}

void ft_cpu_attention_head(float *scratch, int64_t maxk, float *out, const float *q, int64_t nq, int64_t nk,
                           int64_t hs, int64_t C) {
    head_task(ft_cpu_kernel_get(), scratch, maxk, out, q, nq, nk, hs, C, NULL, -1);
}

/* the (sequence, head) tasks on at most `workers` threads; probs and stats NULL: inference, else
 * a training forward (every query row real: nq = nk) whose (sequence b, head h) block of probs
 * starts at NH sum_{b' < b} n_b'^2 + h n_b^2 (the dropout's element index, kept or not) */
static ft_status attention_run(float *ctx, const float *qkv, const int32_t *seqs, int64_t B, int64_t C, int64_t NH,
                               int workers, float *probs, float *stats, uint8_t *dmask, float p, uint64_t key,
                               ft_dtype prec, int64_t half) {
    const int training = probs || stats;
    const ft_cpu_kernel *kr = ft_cpu_kernel_get();
    const int64_t hs = C / NH, ld = 3 * C;
    int64_t maxk = 0;
    for (int64_t b = 0; b < B; b++) maxk = seqs[3 * b + 1] > maxk ? seqs[3 * b + 1] : maxk;
    int64_t *base = NULL;
    if (training) {
        if (!(base = malloc((size_t)(B > 0 ? B : 1) * sizeof *base)))
            return ft_error(FT_ERR_NOMEM, "attention_train_forward: out of memory");
        int64_t at = 0;
        for (int64_t b = 0; b < B; b++) {
            base[b] = at;
            at += NH * (int64_t)seqs[3 * b + 1] * seqs[3 * b + 1];
        }
    }
    const size_t floats = head_scratch_floats(kr, maxk, hs);
    const int64_t tasks = B * NH;
    const uint32_t thr = training && p > 0.0f ? ft_dropout_threshold(p) : 0;
    const float keep_scale = training && p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
    int failed = 0;
#pragma omp parallel num_threads(tasks < workers ? (int)tasks : workers)
    {
        float *buf = aligned_alloc(64, (floats * sizeof(float) + 63) & ~(size_t)63);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!buf) continue;
            const int64_t b = t / NH, h = t % NH;
            const int64_t first = seqs[3 * b], nk = seqs[3 * b + 1], nq = training ? nk : seqs[3 * b + 2];
            float *out = ctx + first * C + h * hs;
            if (nk == 0) {   /* no real key: zero output */
                for (int64_t i = 0; i < nq; i++) memset(out + i * C, 0, (size_t)hs * sizeof(float));
                continue;
            }
            head_train tr, *trp = NULL;
            if (training) {
                const int64_t at = base[b] + h * nk * nk;
                tr = (head_train){probs ? probs + at : NULL, stats ? stats + (first * NH + h) * 2 : NULL, NH * 2,
                                  dmask ? dmask + at : NULL, key, (uint64_t)at, thr, keep_scale, prec};
                trp = &tr;
            }
            head_task(kr, buf, maxk, out, qkv + first * ld + h * hs, nq, nk, hs, C, trp, half);
        }
        free(buf);
    }
    free(base);
    if (failed) return ft_error(FT_ERR_NOMEM, "out of memory for attention scratch");
    return FT_OK;
}

ft_status cpu_attention_forward(ft_backend *be, ft_dtype dt, void *ctx, const void *qkv, const int32_t *seqs,
                                const int32_t *seqs_dev, int64_t B, int64_t C, int64_t NH, int64_t window,
                                void *scratch) {
    (void)be; (void)scratch; (void)seqs_dev;
    FT_CPU_F32_ONLY(dt, "attention_forward");
    if (window < 0) return ft_error(FT_ERR_INVALID_ARGUMENT, "attention_forward: window %lld < 0", (long long)window);
    return attention_run(ctx, qkv, seqs, B, C, NH, ft_num_threads(), NULL, NULL, NULL, 0.0f, 0, FT_F32,
                         window > 0 ? window / 2 : -1);
}

ft_status ft_cpu_attention_train_heads(ft_dtype prec, float *ctx, float *probs, float *stats, uint8_t *dmask,
                                       const float *qkv, const int32_t *seqs, int64_t B, int64_t C, int64_t NH, float p,
                                       uint64_t key, int workers, int64_t half) {
    return attention_run(ctx, qkv, seqs, B, C, NH, workers, probs, stats, dmask, p, key, prec, half);
}
