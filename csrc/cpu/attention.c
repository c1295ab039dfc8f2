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
 * attention_heads_forward (compressed models) gives each head a mode: exact (the tasks above),
 * off (zeros, nothing computed) or sign-matching (Nagarajan et al. 2020): per query row, every key's
 * sign agreement with the query -- head size minus the popcount of the XOR of their sign bits, one
 * 64-bit word per 64 dimensions -- picks the sign_keys best keys (ties: the earlier key), and
 * softmax(q.k / sqrt(d)) V is taken over those keys only, in key order; a sequence with no more keys
 * than sign_keys gets exact attention (the same keys, the exact path's bits). Its cost per query is nk popcounts plus 2 sign_keys d multiply-adds against 2 nk d. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

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
                         const head_train *tr) {
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
        const float *qa = q + i0 * ld;
        int64_t lda = ld;
        if (m < mr || prec != FT_F32) {   /* a short block: zero-padded copy of its rows, and no stale scores */
            ft_copy_rows(qpad, qa, ld, m, hs, mr);
            if (prec != FT_F32) ft_cpu_round_row(qpad, qpad, (int64_t)m * hs, prec);
            qa = qpad;
            lda = hs;
            for (int i = m; i < mr; i++) memset(S + i * lds, 0, (size_t)nk * sizeof(float));
        }
        /* S (m x nk) = Q K^T, unscaled */
        for (int64_t p = 0; p < kpanels; p++) {
            const int n = (int)(nk - p * nr < nr ? nk - p * nr : nr);
            kr->tile(hs, qa, lda, kp + p * hs * nr, nr, S + p * nr, lds, m, n, 0);
        }
        for (int i = 0; i < m; i++) {
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
            kr->tile(nk, S, lds, vp + p * nk * nr, nr, out + i0 * C + p * nr, C, m, n, 0);
        }
    }
}

/* sign bits of n rows of d values (row stride ld) into words (n, nw): bit j of word w = sign of
 * element 64 w + j (the float's own sign bit, so -0.0 counts as negative) */
static void sign_bits(uint64_t *words, const float *x, int64_t n, int64_t d, int64_t ld, int64_t nw) {
    for (int64_t r = 0; r < n; r++) {
        uint64_t *w = words + r * nw;
        memset(w, 0, (size_t)nw * sizeof *w);
        for (int64_t c = 0; c < d; c++) {
            uint32_t u;
            memcpy(&u, x + r * ld + c, sizeof u);
            w[c >> 6] |= (uint64_t)(u >> 31) << (c & 63);
        }
    }
}

/* Sign matching's per-query work over the keys -- agreements, their threshold, the chosen keys --
 * in portable C and on AVX-512 (BW + DQ + VPOPCNTDQ: a zmm of 8 keys' popcounts, 64 keys' compares in
 * one mask); integer work, the same keys on both. */
typedef struct {
    void (*sign_bits)(uint64_t *words, const float *x, int64_t n, int64_t d, int64_t ld, int64_t nw);
    void (*agree)(uint8_t *agree, const uint64_t *qbits, const uint64_t *kbits, int64_t nk, int64_t hs, int64_t nw);
    int64_t (*count_at_least)(const uint8_t *agree, int64_t n, int t);
    int64_t (*select)(int32_t *sel, const uint8_t *agree, int64_t n, int t, int64_t at_t);
} sm_kernels;

static void agree_c(uint8_t *agree, const uint64_t *qbits, const uint64_t *kbits, int64_t nk, int64_t hs, int64_t nw) {
    for (int64_t j = 0; j < nk; j++) {
        int64_t diff = 0;
        for (int64_t w = 0; w < nw; w++) diff += __builtin_popcountll(qbits[w] ^ kbits[j * nw + w]);
        agree[j] = (uint8_t)(hs - diff);
    }
}

static int64_t count_at_least_c(const uint8_t *agree, int64_t n, int t) {
    int32_t c = 0;
    for (int64_t j = 0; j < n; j++) c += agree[j] >= t;
    return c;
}

/* every key above t, and the first at_t at it, in key order */
static int64_t select_c(int32_t *sel, const uint8_t *agree, int64_t n, int t, int64_t at_t) {
    int64_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        const int a = agree[j];
        if (a > t || (a == t && at_t-- > 0)) sel[m++] = (int32_t)j;
    }
    return m;
}

#if defined(__x86_64__)
#define FT_SM_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vpopcntdq")))
FT_SM_TARGET static void sign_bits_avx512(uint64_t *words, const float *x, int64_t n, int64_t d, int64_t ld,
                                          int64_t nw) {
    for (int64_t r = 0; r < n; r++) {
        uint64_t *w = words + r * nw;
        memset(w, 0, (size_t)nw * sizeof *w);
        int64_t c = 0;
        for (; c + 16 <= d; c += 16)   /* the 16 floats' sign bits, one mask */
            w[c >> 6] |= (uint64_t)_mm512_movepi32_mask(_mm512_castps_si512(_mm512_loadu_ps(x + r * ld + c))) << (c & 63);
        for (; c < d; c++) {
            uint32_t u;
            memcpy(&u, x + r * ld + c, sizeof u);
            w[c >> 6] |= (uint64_t)(u >> 31) << (c & 63);
        }
    }
}

FT_SM_TARGET static void agree_avx512(uint8_t *agree, const uint64_t *qbits, const uint64_t *kbits, int64_t nk,
                                      int64_t hs, int64_t nw) {
    if (nw != 1) {
        agree_c(agree, qbits, kbits, nk, hs, nw);
        return;
    }
    const __m512i q = _mm512_set1_epi64((long long)qbits[0]), h = _mm512_set1_epi64(hs);
    int64_t j = 0;
    for (; j + 8 <= nk; j += 8) {
        const __m512i a = _mm512_sub_epi64(h, _mm512_popcnt_epi64(_mm512_xor_si512(q, _mm512_loadu_si512(kbits + j))));
        _mm_storel_epi64((__m128i *)(agree + j), _mm512_cvtepi64_epi8(a));
    }
    for (; j < nk; j++) agree[j] = (uint8_t)(hs - __builtin_popcountll(qbits[0] ^ kbits[j]));
}

FT_SM_TARGET static int64_t count_at_least_avx512(const uint8_t *agree, int64_t n, int t) {
    const __m512i tv = _mm512_set1_epi8((char)t);
    int64_t c = 0;
    for (int64_t j = 0; j < n; j += 64) {
        const __mmask64 live = n - j >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (n - j)) - 1);
        c += __builtin_popcountll(_mm512_mask_cmpge_epu8_mask(live, _mm512_maskz_loadu_epi8(live, agree + j), tv));
    }
    return c;
}

FT_SM_TARGET static int64_t select_avx512(int32_t *sel, const uint8_t *agree, int64_t n, int t, int64_t at_t) {
    const __m512i tv = _mm512_set1_epi8((char)t);
    int64_t m = 0;
    for (int64_t j = 0; j < n; j += 64) {
        const __mmask64 live = n - j >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (n - j)) - 1);
        const __m512i a = _mm512_maskz_loadu_epi8(live, agree + j);
        uint64_t chosen = _mm512_mask_cmpgt_epu8_mask(live, a, tv), eq = _mm512_mask_cmpeq_epu8_mask(live, a, tv);
        for (; eq && at_t > 0; at_t--) {   /* the earliest keys at the threshold */
            chosen |= eq & (~eq + 1);
            eq &= eq - 1;
        }
        for (; chosen; chosen &= chosen - 1) sel[m++] = (int32_t)(j + __builtin_ctzll(chosen));
    }
    return m;
}
#endif

static const sm_kernels *sm_kernels_get(void) {
    static const sm_kernels portable = {sign_bits, agree_c, count_at_least_c, select_c};
#if defined(__x86_64__)
    static const sm_kernels avx512 = {sign_bits_avx512, agree_avx512, count_at_least_avx512, select_avx512};
    if ((ft_cpu_features() & FT_CPU_AVX512) && __builtin_cpu_supports("avx512vpopcntdq")) return &avx512;
#endif
    return &portable;
}

/* one (sequence, head) by sign matching (see the top of the file), nk > keys. scratch: kbits (nk nw
 * words), agree (nk bytes), sel (nk), scores (nk) */
static void head_sign_match(float *out, const float *q, int64_t nq, int64_t nk, int64_t hs, int64_t ld, int64_t C,
                            float scale, int64_t keys, uint64_t *kbits, uint8_t *agree, int32_t *sel, float *scores) {
    const sm_kernels *sk = sm_kernels_get();
    const float *k = q + C, *v = q + 2 * C;
    const int64_t nw = (hs + 63) / 64;
    sk->sign_bits(kbits, k, nk, hs, ld, nw);
    uint64_t qbits[4];   /* head sizes up to 255 (checked by the caller): agreements fit a byte */
    for (int64_t i = 0; i < nq; i++) {
        const float *qi = q + i * ld;
        sk->sign_bits(qbits, qi, 1, hs, ld, nw);
        sk->agree(agree, qbits, kbits, nk, hs, nw);   /* dimensions whose signs match, per key */
        /* t = the largest agreement that at least `keys` keys reach (binary search over 0..hs): every
         * key above it is chosen, and the earliest keys at it until there are `keys` */
        int lo = 0, hi = (int)hs;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (sk->count_at_least(agree, nk, mid) >= keys) lo = mid;
            else hi = mid - 1;
        }
        const int64_t m = sk->select(sel, agree, nk, lo, keys - (lo < hs ? sk->count_at_least(agree, nk, lo + 1) : 0));
        for (int64_t s = 0; s < m; s++) {   /* unscaled q.k of the chosen keys (a fixed vector order) */
            const float *kj = k + (int64_t)sel[s] * ld;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t c = 0; c < hs; c++) acc += qi[c] * kj[c];
            scores[s] = acc;
        }
        ft_cpu_softmax_row(scores, m, scale, NULL);
        float *o = out + i * C;
        for (int64_t c = 0; c < hs; c++) o[c] = 0.0f;
        for (int64_t s = 0; s < m; s++) {
            const float *vj = v + (int64_t)sel[s] * ld, ps = scores[s];
            for (int64_t c = 0; c < hs; c++) o[c] += ps * vj[c];
        }
    }
}

/* the (sequence, head) tasks on at most `workers` threads; probs and stats NULL: inference, else
 * a training forward (every query row real: nq = nk) whose (sequence b, head h) block of probs
 * starts at NH sum_{b' < b} n_b'^2 + h n_b^2 (the dropout's element index, kept or not). modes
 * (inference only): NULL = every head exact, else ft_attention_mode per head */
static ft_status attention_run(float *ctx, const float *qkv, const int32_t *seqs, int64_t B, int64_t C, int64_t NH,
                               int workers, float *probs, float *stats, uint8_t *dmask, float p, uint64_t key,
                               ft_dtype prec, const uint8_t *modes, int64_t sign_keys) {
    const int training = probs || stats;
    const ft_cpu_kernel *kr = ft_cpu_kernel_get();
    const int64_t hs = C / NH, ld = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
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
    const int64_t lds = (maxk + kr->nr - 1) / kr->nr * kr->nr;
    /* per thread: K^T panels, V panels, one block of scores, a padded Q block */
    const int64_t hsp = (hs + kr->nr - 1) / kr->nr * kr->nr;
    size_t floats = (size_t)(lds * hs + maxk * hsp + kr->mr * lds + hs * kr->mr);
    int sign_match = 0;
    for (int64_t h = 0; modes && h < NH; h++) sign_match |= modes[h] == FT_ATTN_SIGN_MATCH;
    const int64_t nw = (hs + 63) / 64;
    /* sign matching: key sign words (maxk nw, 8-byte units), agreements (bytes), chosen keys, scores */
    const size_t sm_floats = sign_match ? (size_t)(2 * maxk * nw + (maxk + 3) / 4 + 2 * maxk + 2) : 0;
    if (sm_floats > floats) floats = sm_floats;
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
            const int mode = modes ? modes[h] : FT_ATTN_EXACT;
            if (mode == FT_ATTN_OFF) {   /* a masked head: zero output */
                for (int64_t i = 0; i < nq; i++) memset(out + i * C, 0, (size_t)hs * sizeof(float));
                continue;
            }
            if (mode == FT_ATTN_SIGN_MATCH && nk > sign_keys) {   /* (no more keys than that: exact attention) */
                uint64_t *kbits = (uint64_t *)buf;
                int32_t *sel = (int32_t *)(kbits + maxk * nw);
                float *scores = (float *)(sel + maxk);
                head_sign_match(out, qkv + first * ld + h * hs, nq, nk, hs, ld, C, scale, sign_keys, kbits,
                                (uint8_t *)(scores + maxk), sel, scores);
                continue;
            }
            head_train tr, *trp = NULL;
            if (training) {
                const int64_t at = base[b] + h * nk * nk;
                tr = (head_train){probs ? probs + at : NULL, stats ? stats + (first * NH + h) * 2 : NULL, NH * 2,
                                  dmask ? dmask + at : NULL, key, (uint64_t)at, thr, keep_scale, prec};
                trp = &tr;
            }
            float *kp = buf, *vp = kp + lds * hs, *S = vp + maxk * hsp, *qpad = S + kr->mr * lds;
            head_forward(kr, out, qkv + first * ld + h * hs, nq, nk, hs, ld, C, scale, kp, vp, S, qpad, trp);
        }
        free(buf);
    }
    free(base);
    if (failed) return ft_error(FT_ERR_NOMEM, "out of memory for attention scratch");
    return FT_OK;
}

ft_status cpu_attention_forward(ft_backend *be, ft_dtype dt, void *ctx, const void *qkv, const int32_t *seqs,
                                const int32_t *seqs_dev, int64_t B, int64_t C, int64_t NH, void *scratch) {
    (void)be; (void)scratch; (void)seqs_dev;
    FT_CPU_F32_ONLY(dt, "attention_forward");
    return attention_run(ctx, qkv, seqs, B, C, NH, ft_num_threads(), NULL, NULL, NULL, 0.0f, 0, FT_F32, NULL, 0);
}

ft_status cpu_attention_heads_forward(ft_backend *be, ft_dtype dt, void *ctx, const void *qkv, const int32_t *seqs,
                                      const int32_t *seqs_dev, int64_t B, int64_t C, int64_t NH, const uint8_t *modes,
                                      int64_t sign_keys, void *scratch) {
    (void)be; (void)scratch; (void)seqs_dev;
    FT_CPU_F32_ONLY(dt, "attention_heads_forward");
    if (!modes) return ft_error(FT_ERR_INVALID_ARGUMENT, "attention_heads_forward: no head modes");
    int sign_match = 0;
    for (int64_t h = 0; h < NH; h++) {
        if (modes[h] > FT_ATTN_OFF)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "attention_heads_forward: head %lld has mode %d; expected "
                            "0 (exact), 1 (sign matching) or 2 (off)", (long long)h, (int)modes[h]);
        sign_match |= modes[h] == FT_ATTN_SIGN_MATCH;
    }
    if (sign_match && sign_keys < 1)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "attention_heads_forward: sign matching needs sign_keys >= 1, got %lld",
                        (long long)sign_keys);
    if (sign_match && C / NH > 255)
        return ft_error(FT_ERR_UNSUPPORTED, "attention_heads_forward: sign matching takes head sizes up to 255, "
                        "not %lld", (long long)(C / NH));
    return attention_run(ctx, qkv, seqs, B, C, NH, ft_num_threads(), NULL, NULL, NULL, 0.0f, 0, FT_F32, modes,
                         sign_keys);
}

ft_status ft_cpu_attention_train_heads(ft_dtype prec, float *ctx, float *probs, float *stats, uint8_t *dmask,
                                       const float *qkv, const int32_t *seqs, int64_t B, int64_t C, int64_t NH, float p,
                                       uint64_t key, int workers) {
    return attention_run(ctx, qkv, seqs, B, C, NH, workers, probs, stats, dmask, p, key, prec, NULL, 0);
}
