#include "dtype.h"

#include <string.h>

const char *ft_dtype_name(ft_dtype dt) {
    static const char *names[FT_DTYPE_COUNT] = {"float32", "float16", "bfloat16", "int64", "int32",
                                                "int16", "int8", "uint8", "bool", "float64"};
    return (unsigned)dt < FT_DTYPE_COUNT ? names[dt] : "unknown";
}

size_t ft_dtype_size(ft_dtype dt) {
    static const size_t sizes[FT_DTYPE_COUNT] = {4, 2, 2, 8, 4, 2, 1, 1, 1, 8};
    return (unsigned)dt < FT_DTYPE_COUNT ? sizes[dt] : 0;
}

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float ft_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));   /* inf / nan */
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);                               /* +-0 */
        /* subnormal: value = man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t ft_f32_to_f16(float f) {
    uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000u;
    uint32_t absu = u & 0x7fffffffu;
    if (absu >= 0x7f800000u)                                            /* inf / nan */
        return (uint16_t)(sign | 0x7c00u | (absu > 0x7f800000u ? 0x200u : 0));
    if (absu >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);          /* overflow -> inf */
    if (absu < 0x38800000u) {                                            /* subnormal / zero */
        /* value / 2^-24, rounded to nearest even by adding in float (exact in f32 range) */
        float v = bits_f32(absu) + 0.5f;   /* 0.5 = 2^-1 makes the mantissa hold ulp 2^-24 */
        uint32_t m = f32_bits(v) - f32_bits(0.5f);
        return (uint16_t)(sign | m);
    }
    uint32_t mant_odd = (absu >> 13) & 1u;
    absu += 0xc8000fffu + mant_odd;   /* re-bias exponent (-112 << 23) and round to nearest even */
    return (uint16_t)(sign | (absu >> 13));
}

float ft_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t ft_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  /* quiet nan */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void ft_convert_to_f32(float *dst, const void *src, ft_dtype src_dtype, size_t n) {
    if (src_dtype == FT_F32) { memcpy(dst, src, n * 4); return; }
    const uint16_t *s = (const uint16_t *)src;
    if (src_dtype == FT_F16) for (size_t i = 0; i < n; i++) dst[i] = ft_f16_to_f32(s[i]);
    else for (size_t i = 0; i < n; i++) dst[i] = ft_bf16_to_f32(s[i]);
}

void ft_convert_from_f32(void *dst, ft_dtype dst_dtype, const float *src, size_t n) {
    if (dst_dtype == FT_F32) { memcpy(dst, src, n * 4); return; }
    uint16_t *d = (uint16_t *)dst;
    if (dst_dtype == FT_F16) for (size_t i = 0; i < n; i++) d[i] = ft_f32_to_f16(src[i]);
    else for (size_t i = 0; i < n; i++) d[i] = ft_f32_to_bf16(src[i]);
}
