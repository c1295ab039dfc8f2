/* attention_heads_forward on the CPU (compressed models, fasttran.compress): a mode per head --
 * exact (attention.c's task: the plain attention_forward's bits), off (zeros, nothing computed) or
 * sign matching (Nagarajan et al. 2020, "Optimizing Transformers with Approximate Computing"): per
 * query row, every key's sign agreement with the query -- head size minus the popcount of the XOR of
 * their sign bits, one 64-bit word per 64 dimensions -- picks the sign_keys best keys (ties: the
 * earlier key), and softmax(q.k / sqrt(d)) V is taken over those keys only, in key order; a sequence
 * with no more keys than sign_keys gets exact attention (the same keys, the exact path's bits). Its
 * cost per query is nk popcounts plus 2 sign_keys d multiply-adds against 2 nk d.
 *
 * The encoder runs this op only for a layer that holds sign-matching heads or a forward whose masks
 * switch heads off (model/encoder.c picks a layer's attention once); attention_forward never looks
 * at head modes. One task per (sequence, head), as in attention.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/status.h"
#include "cpu_ops.h"
#include "kernels.h"
#include "rowfun.h"

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
    const int64_t hs = C / NH, ld = 3 * C, nw = (hs + 63) / 64;
    const float scale = 1.0f / sqrtf((float)hs);
    int64_t maxk = 0;
    for (int64_t b = 0; b < B; b++) maxk = seqs[3 * b + 1] > maxk ? seqs[3 * b + 1] : maxk;
    size_t floats = ft_cpu_attention_head_floats(maxk, hs);
    /* sign matching: key sign words (maxk nw, 8-byte units), agreements (bytes), chosen keys, scores */
    const size_t sm_floats = sign_match ? (size_t)(2 * maxk * nw + (maxk + 3) / 4 + 2 * maxk + 2) : 0;
    if (sm_floats > floats) floats = sm_floats;
    const int64_t tasks = B * NH;
    const int workers = ft_num_threads();
    float *out0 = ctx;
    const float *qkv0 = qkv;
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
            const int64_t first = seqs[3 * b], nk = seqs[3 * b + 1], nq = seqs[3 * b + 2];
            float *out = out0 + first * C + h * hs;
            const float *q = qkv0 + first * ld + h * hs;
            if (nk == 0 || modes[h] == FT_ATTN_OFF) {   /* no real key, or a head switched off: zero output */
                for (int64_t i = 0; i < nq; i++) memset(out + i * C, 0, (size_t)hs * sizeof(float));
            } else if (modes[h] == FT_ATTN_SIGN_MATCH && nk > sign_keys) {   /* (no more keys: exact) */
                uint64_t *kbits = (uint64_t *)buf;
                int32_t *sel = (int32_t *)(kbits + maxk * nw);
                float *scores = (float *)(sel + maxk);
                head_sign_match(out, q, nq, nk, hs, ld, C, scale, sign_keys, kbits, (uint8_t *)(scores + maxk), sel,
                                scores);
            } else {
                ft_cpu_attention_head(buf, maxk, out, q, nq, nk, hs, C);
            }
        }
        free(buf);
    }
    if (failed) return ft_error(FT_ERR_NOMEM, "out of memory for attention scratch");
    return FT_OK;
}
