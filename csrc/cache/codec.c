/* Activation-cache codecs, batch gather and checksums.
 *
 * A cache stores rows of C floats (one pooled vector, or one token's hidden state) in one of
 * four codecs: F32 (exact), F16 and BF16 (round to nearest even), I8 with one float32 scale per
 * row (s = max|x| / 127, q = round(x / s); |error| <= s / 2 per element). Encoding measures the
 * error it makes against the float32 input as it goes, so stats() reports the real error of
 * what was stored, not a bound.
 *
 * Decoding is exact for F32/F16/BF16 (every value is a float); I8 decodes q * s. Reading a
 * batch (which rows, from which tier, padding) is cache/store.c's; it decodes with
 * ft_cache_decode_row. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

#include "cache/codec.h"
#include "core/dtype.h"
#include "core/status.h"

/* ---- the codecs' row coders (one set per line of FT_CACHE_CODECS) ------------------------------
 * Decoding is exact for F32/F16/BF16 (every value is a float); I8 decodes q * s. The same decoder
 * reads stored rows (hits) and the encode/decode round trip of recomputed rows (misses), so both
 * give the same bits. */

static inline float bf16_bits(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32: stored as it is */
static void f32_encode(void *dst, float *scale, const float *x, int64_t C, double *me, double *se, double *sr) {
    (void)scale;
    (void)me;
    (void)se;
    memcpy(dst, x, (size_t)C * sizeof(float));
    double r = *sr;
    for (int64_t c = 0; c < C; c++) r += (double)x[c] * x[c];
    *sr = r;
}
static inline void f32_decode(float *restrict o, const void *restrict src, float scale, int64_t C) {
    (void)scale;
    memcpy(o, src, (size_t)C * sizeof(float));
}
static inline void f32_decode16(float *restrict o, const char *restrict s, float scale) {
    (void)scale;
    memcpy(o, s, 64);
}

/* float16 / bfloat16: rounded to nearest even */
static inline void half_encode(uint16_t *h, const float *x, int64_t C, int bf, double *me, double *se, double *sr) {
    double m = *me, q = *se, r = *sr;   /* (accumulated in registers) */
    for (int64_t c = 0; c < C; c++) {
        h[c] = bf ? ft_f32_to_bf16(x[c]) : ft_f32_to_f16(x[c]);
        double back = bf ? ft_bf16_to_f32(h[c]) : ft_f16_to_f32(h[c]);
        double e = fabs(back - x[c]);
        m = e > m ? e : m;
        q += e * e;
        r += (double)x[c] * x[c];
    }
    *me = m, *se = q, *sr = r;
}
static void f16_encode(void *dst, float *scale, const float *x, int64_t C, double *me, double *se, double *sr) {
    (void)scale;
    half_encode(dst, x, C, 0, me, se, sr);
}
static void bf16_encode(void *dst, float *scale, const float *x, int64_t C, double *me, double *se, double *sr) {
    (void)scale;
    half_encode(dst, x, C, 1, me, se, sr);
}
static inline void f16_decode(float *restrict o, const void *restrict src, float scale, int64_t C) {
    (void)scale;
    const uint16_t *s = src;
    int64_t c = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; c + 8 <= C; c += 8)   /* exact: every f16 is a float */
        _mm256_storeu_ps(o + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + c))));
#endif
    for (; c < C; c++) o[c] = ft_f16_to_f32(s[c]);
}
static inline void f16_decode16(float *restrict o, const char *restrict s, float scale) {
    (void)scale;
#if defined(__F16C__) && defined(__AVX__)
    _mm256_storeu_ps(o, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s)));
    _mm256_storeu_ps(o + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16))));
#else
    for (int k = 0; k < 16; k++) o[k] = ft_f16_to_f32(((const uint16_t *)s)[k]);
#endif
}
static inline void bf16_decode(float *restrict o, const void *restrict src, float scale, int64_t C) {
    (void)scale;
    const uint16_t *s = src;
#pragma omp simd
    for (int64_t c = 0; c < C; c++) o[c] = bf16_bits(s[c]);
}
static inline void bf16_decode16(float *restrict o, const char *restrict s, float scale) {
    (void)scale;
    uint16_t h[16];
    memcpy(h, s, 32);
#pragma omp simd
    for (int k = 0; k < 16; k++) o[k] = bf16_bits(h[k]);
}

/* int8: one scale per row, s = max|x| / 127, q = round(x / s) */
static void i8_encode(void *dst, float *scale, const float *x, int64_t C, double *me, double *se, double *sr) {
    float amax = 0.0f;
    for (int64_t c = 0; c < C; c++) amax = fmaxf(amax, fabsf(x[c]));
    const float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t *q = dst;
    *scale = s;
    double m = *me, sq = *se, r = *sr;   /* (accumulated in registers) */
    for (int64_t c = 0; c < C; c++) {
        float v = nearbyintf(x[c] * inv);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[c] = (int8_t)v;
        double e = fabs((double)v * s - x[c]);
        m = e > m ? e : m;
        sq += e * e;
        r += (double)x[c] * x[c];
    }
    *me = m, *se = sq, *sr = r;
}
static inline void i8_decode(float *restrict o, const void *restrict src, float scale, int64_t C) {
    const int8_t *q = src;
#pragma omp simd
    for (int64_t c = 0; c < C; c++) o[c] = (float)q[c] * scale;
}
static inline void i8_decode16(float *restrict o, const char *restrict s, float scale) {
    int8_t q[16];
    memcpy(q, s, 16);
#pragma omp simd
    for (int k = 0; k < 16; k++) o[k] = (float)q[k] * scale;
}

#define FT_CODEC_ENTRY_(code, name, storage, scaled, lossless, tag) \
    [code] = {code, name, storage, scaled, lossless, tag##_encode, tag##_decode},
static const ft_cache_codec CODECS[FT_DTYPE_COUNT] = {FT_CACHE_CODECS(FT_CODEC_ENTRY_)};
#undef FT_CODEC_ENTRY_

const ft_cache_codec *ft_cache_codec_get(ft_dtype c) {
    return (int)c >= 0 && (int)c < FT_DTYPE_COUNT && CODECS[c].name ? &CODECS[c] : NULL;
}

int ft_cache_codec_ok(ft_dtype c) { return ft_cache_codec_get(c) != NULL; }

ft_status ft_cache_encode(void *dst, float *scales, ft_dtype codec, const float *src, int64_t n, int64_t C,
                          ft_codec_error *err) {
    const ft_cache_codec *kd = ft_cache_codec_get(codec);
    if (!kd) return ft_error(FT_ERR_DTYPE, "cache codec must be float32, float16, bfloat16 or int8, not %s", ft_dtype_name(codec));
    if (kd->scaled && !scales) return ft_error(FT_ERR_INVALID_ARGUMENT, "%s codec needs a scale per row", kd->name);
    const size_t row_bytes = (size_t)C * ft_dtype_size(codec);
    /* the error sums go into the manifest: summed per block of rows, then the blocks in order, so
     * they do not depend on the thread count (a reduction clause would) */
    enum { BLOCK_ROWS = 64 };
    const int64_t n_blocks = (n + BLOCK_ROWS - 1) / BLOCK_ROWS;
    double *part = malloc((size_t)(n_blocks ? n_blocks : 1) * 2 * sizeof *part);
    if (!part) return ft_error(FT_ERR_NOMEM, "out of memory");
    double max_err = 0.0, sq_err = 0.0, sq_ref = 0.0;
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) reduction(max : max_err)
    for (int64_t blk = 0; blk < n_blocks; blk++) {
        double block_err = 0.0, block_ref = 0.0;
        for (int64_t r = blk * BLOCK_ROWS; r < n && r < (blk + 1) * BLOCK_ROWS; r++) {
            double me = 0.0, se = 0.0, sr = 0.0;
            kd->encode_row((char *)dst + (size_t)r * row_bytes, kd->scaled ? scales + r : NULL, src + r * C, C, &me,
                           &se, &sr);
            max_err = me > max_err ? me : max_err;
            block_err += se;
            block_ref += sr;
        }
        part[2 * blk] = block_err;
        part[2 * blk + 1] = block_ref;
    }
    for (int64_t blk = 0; blk < n_blocks; blk++) {
        sq_err += part[2 * blk];
        sq_ref += part[2 * blk + 1];
    }
    free(part);
    if (err) {
        if (max_err > err->max_abs_err) err->max_abs_err = max_err;
        err->sum_sq_err += sq_err;
        err->sum_sq_ref += sq_ref;
    }
    return FT_OK;
}

/* ---- decoding ------------------------------------------------------------------------------ */
void ft_cache_decode_row(float *restrict o, const void *restrict src, float scale, ft_dtype codec, int64_t C) {
    ft_cache_codec_get(codec)->decode_row(o, src, scale, C);
}

/* 16 values (64 bytes of output) of one row, by codec (the cases generated from the list) */
static inline void decode16(float *restrict o, const char *restrict s, float scale, ft_dtype codec) {
    switch (codec) {
#define FT_CODEC_CASE_(code, name, storage, scaled, lossless, tag) \
    case code: tag##_decode16(o, s, scale); return;
        FT_CACHE_CODECS(FT_CODEC_CASE_)
#undef FT_CODEC_CASE_
    default: return;
    }
}

void ft_cache_decode_group(float *const *dst, const char *const *src, const float *scale, int n,
                           const char *const *next_src, int n_next, ft_dtype codec, int64_t C) {
    const int64_t es = (int64_t)ft_dtype_size(codec);
    int64_t c = 0;
    for (; c + 16 <= C; c += 16) {
        const int64_t off = c * es;   /* source bytes of this step: 16 * es (16..64) */
        if (off % 64 == 0)
            for (int k = 0; k < n_next; k++) __builtin_prefetch(next_src[k] + off, 0, 3);
        for (int k = 0; k < n; k++) decode16(dst[k] + c, src[k] + off, scale[k], codec);
    }
    if (c < C)
        for (int k = 0; k < n; k++) ft_cache_decode_row(dst[k] + c, src[k] + c * es, scale[k], codec, C - c);
}

void ft_cache_decode(float *dst, const void *src, const float *scales, ft_dtype codec, int64_t n, int64_t C) {
    const size_t rb = (size_t)C * ft_dtype_size(codec);
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (n * C > 65536)
    for (int64_t r = 0; r < n; r++)
        ft_cache_decode_row(dst + r * C, (const char *)src + (size_t)r * rb, scales ? scales[r] : 0.0f, codec, C);
}

/* Input fingerprint of example i: CRC-32C of its token ids (seeded) and of its type ids
 * (seeded with its length), as one u64. Equal inputs give equal fingerprints. */
void ft_input_fingerprints(const int32_t *tokens, const int32_t *types, const int64_t *offsets, int64_t n,
                           uint64_t *out) {
#pragma omp parallel for schedule(static) num_threads(ft_num_threads()) if (n > 4096)
    for (int64_t i = 0; i < n; i++) {
        const int64_t a = offsets[i], len = offsets[i + 1] - offsets[i];
        const uint64_t hi = ft_crc32c(0x9E37u, tokens + a, (size_t)len * 4);
        const uint64_t lo = ft_crc32c((uint32_t)len, types + a, (size_t)len * 4);
        out[i] = hi << 32 | lo;
    }
}

/* ---- CRC-32C (Castagnoli): SSE4.2 instruction when the CPU has it, else a table ------------- */

static uint32_t crc_table[8][256];

static void crc_init_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

static uint32_t crc_sw(uint32_t c, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= c;
        c = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^ crc_table[5][(v >> 16) & 0xff] ^
            crc_table[4][(v >> 24) & 0xff] ^ crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
            crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n) {
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c64 = __builtin_ia32_crc32di(c64, v);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--) c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}
#endif

#include <pthread.h>
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static int crc_use_hw;
static void crc_setup(void) {
    crc_init_table();
#if defined(__x86_64__)
    __builtin_cpu_init();
    crc_use_hw = __builtin_cpu_supports("sse4.2");
#endif
}

uint32_t ft_crc32c(uint32_t crc, const void *data, size_t n) {
    pthread_once(&crc_once, crc_setup);
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (crc_use_hw) return ~crc_hw(c, data, n);
#endif
    return ~crc_sw(c, data, n);
}
