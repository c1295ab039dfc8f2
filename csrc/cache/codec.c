/* Activation-cache codecs, batch gather and checksums.
 *
 * A cache stores rows of C floats (one pooled vector, or one token's hidden state) in one of
 * four codecs: F32 (exact), F16 and BF16 (round to nearest even), I8 with one float32 scale per
 * row (s = max|x| / 127, q = round(x / s); |error| <= s / 2 per element). Encoding measures the
 * error it makes against the float32 input as it goes, so stats() reports the real error of
 * what was stored, not a bound.
 *
 * Reading a batch is one gather: output row k decodes the encoded row at src[k] (any tier:
 * host arrays or memory-mapped shards), or is zero when src[k] is NULL (padding). Rows run in
 * parallel; the caller releases the GIL. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "core/dtype.h"
#include "core/status.h"
#include "fasttran.h"

static int codec_ok(ft_dtype c) { return c == FT_F32 || c == FT_F16 || c == FT_BF16 || c == FT_I8; }

ft_status ft_cache_encode(void *dst, float *scales, ft_dtype codec, const float *src, int64_t n, int64_t C,
                          ft_codec_error *err) {
    if (!codec_ok(codec)) return ft_error(FT_ERR_DTYPE, "cache codec must be float32, float16, bfloat16 or int8, not %s", ft_dtype_name(codec));
    if (codec == FT_I8 && !scales) return ft_error(FT_ERR_INVALID_ARGUMENT, "int8 codec needs a scale per row");
    double max_err = 0.0, sq_err = 0.0, sq_ref = 0.0;
#pragma omp parallel for schedule(static) reduction(max : max_err) reduction(+ : sq_err, sq_ref)
    for (int64_t r = 0; r < n; r++) {
        const float *x = src + r * C;
        double me = 0.0, se = 0.0, sr = 0.0;
        if (codec == FT_F32) {
            memcpy((float *)dst + r * C, x, (size_t)C * sizeof(float));
            for (int64_t c = 0; c < C; c++) sr += (double)x[c] * x[c];
        } else if (codec == FT_I8) {
            float amax = 0.0f;
            for (int64_t c = 0; c < C; c++) amax = fmaxf(amax, fabsf(x[c]));
            const float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = (int8_t *)dst + r * C;
            scales[r] = s;
            for (int64_t c = 0; c < C; c++) {
                float v = nearbyintf(x[c] * inv);
                v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                q[c] = (int8_t)v;
                double e = fabs((double)v * s - x[c]);
                me = e > me ? e : me;
                se += e * e;
                sr += (double)x[c] * x[c];
            }
        } else {
            uint16_t *h = (uint16_t *)dst + r * C;
            for (int64_t c = 0; c < C; c++) {
                h[c] = codec == FT_F16 ? ft_f32_to_f16(x[c]) : ft_f32_to_bf16(x[c]);
                double back = codec == FT_F16 ? ft_f16_to_f32(h[c]) : ft_bf16_to_f32(h[c]);
                double e = fabs(back - x[c]);
                me = e > me ? e : me;
                se += e * e;
                sr += (double)x[c] * x[c];
            }
        }
        max_err = me > max_err ? me : max_err;
        sq_err += se;
        sq_ref += sr;
    }
    if (err) {
        if (max_err > err->max_abs_err) err->max_abs_err = max_err;
        err->sum_sq_err += sq_err;
        err->sum_sq_ref += sq_ref;
    }
    return FT_OK;
}

ft_status ft_cache_gather(float *dst, int64_t n, int64_t C, ft_dtype codec, const void *const *src,
                          const float *scales) {
    if (!codec_ok(codec)) return ft_error(FT_ERR_DTYPE, "cache codec must be float32, float16, bfloat16 or int8, not %s", ft_dtype_name(codec));
#pragma omp parallel for schedule(static) if (n * C > 65536)
    for (int64_t r = 0; r < n; r++) {
        float *o = dst + r * C;
        const void *s = src[r];
        if (!s) { memset(o, 0, (size_t)C * sizeof(float)); continue; }
        switch (codec) {
        case FT_F32: memcpy(o, s, (size_t)C * sizeof(float)); break;
        case FT_F16: for (int64_t c = 0; c < C; c++) o[c] = ft_f16_to_f32(((const uint16_t *)s)[c]); break;
        case FT_BF16: for (int64_t c = 0; c < C; c++) o[c] = ft_bf16_to_f32(((const uint16_t *)s)[c]); break;
        default: {
            const float k = scales[r];
            const int8_t *q = s;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) o[c] = (float)q[c] * k;
        }
        }
    }
    return FT_OK;
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
