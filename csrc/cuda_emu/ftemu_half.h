// fasttran's CUDA emulator: __half and __nv_bfloat16 (cuda_fp16.h / cuda_bf16.h).
// Conversions round to nearest even; NaN becomes the canonical 0x7fff, as CUDA's do. Arithmetic
// on half types is computed in double and rounded once (what the hardware's half instructions
// give; fast-math variants are not emulated).
#ifndef FTEMU_HALF_H
#define FTEMU_HALF_H
#include <stdint.h>
#include <string.h>

#include <cmath>

namespace ftemu {

inline uint32_t f32_bits(float f) { uint32_t x; memcpy(&x, &f, 4); return x; }
inline float bits_f32(uint32_t x) { float f; memcpy(&f, &x, 4); return f; }

inline uint16_t f32_to_f16(float f) {
    const uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fff;                 // NaN
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);   // >= 65520 rounds to infinity
    if (a < 0x38800000u) {                               // below 2^-14: a half subnormal or zero
        if (a <= 0x33000000u) return (uint16_t)sign;     // <= 2^-25 rounds to (signed) zero
        const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)e;                  // value in units of 2^-24 = m >> shift
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (uint16_t)(sign | q);
    }
    const uint32_t r = a - 0x38000000u;                  // rebias the exponent 127 -> 15
    uint32_t q = r >> 13;
    const uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1))) q++;   // a carry rounds up to infinity
    return (uint16_t)(sign | q);
}

inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        if (m == 0) return bits_f32(sign);
        const float v = (float)m * 5.9604644775390625e-8f;   // m * 2^-24, exact
        return bits_f32(f32_bits(v) | sign);
    }
    if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t f32_to_bf16(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fff;    // NaN
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

// double -> float rounded to odd: a second rounding to a narrower format is then correct (once)
inline float f64_to_f32_odd(double d) {
    float f = (float)d;
    if ((double)f != d && std::isfinite(f) && !std::isnan(d)) {
        uint32_t b = f32_bits(f);
        if ((b & 1u) == 0) b = std::fabs((double)f) < std::fabs(d) ? b + 1 : b - 1;
        f = bits_f32(b);
    }
    return f;
}
inline uint16_t f64_to_f16(double d) { return f32_to_f16(f64_to_f32_odd(d)); }
inline uint16_t f64_to_bf16(double d) { return f32_to_bf16(f64_to_f32_odd(d)); }

// tf32: the 10-bit mantissa the tensor cores read, rounded to nearest, ties away (cvt.rna.tf32)
inline float f32_to_tf32(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7f800000u) == 0x7f800000u) return f;      // Inf / NaN unchanged
    x = (x + 0x1000u) & 0xffffe000u;
    return bits_f32(x);
}

}  // namespace ftemu

struct __half_raw { unsigned short x; };
struct __nv_bfloat16_raw { unsigned short x; };

struct __half {
    unsigned short __x;
    __half() = default;
    constexpr __half(__half_raw r) : __x(r.x) {}
    __half(float f) : __x(ftemu::f32_to_f16(f)) {}
    __half(double d) : __x(ftemu::f64_to_f16(d)) {}
    __half(int i) : __x(ftemu::f64_to_f16((double)i)) {}
    __half(unsigned i) : __x(ftemu::f64_to_f16((double)i)) {}
    __half(long long i) : __x(ftemu::f64_to_f16((double)i)) {}
    __half(long i) : __x(ftemu::f64_to_f16((double)i)) {}
    operator float() const { return ftemu::f16_to_f32(__x); }
    operator __half_raw() const { return __half_raw{__x}; }
};

struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    constexpr __nv_bfloat16(__nv_bfloat16_raw r) : __x(r.x) {}
    __nv_bfloat16(float f) : __x(ftemu::f32_to_bf16(f)) {}
    __nv_bfloat16(double d) : __x(ftemu::f64_to_bf16(d)) {}
    __nv_bfloat16(int i) : __x(ftemu::f64_to_bf16((double)i)) {}
    __nv_bfloat16(unsigned i) : __x(ftemu::f64_to_bf16((double)i)) {}
    __nv_bfloat16(long long i) : __x(ftemu::f64_to_bf16((double)i)) {}
    __nv_bfloat16(long i) : __x(ftemu::f64_to_bf16((double)i)) {}
    operator float() const { return ftemu::bf16_to_f32(__x); }
    operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
};
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;

struct alignas(4) __half2 { __half x, y; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __half2 half2;
typedef __nv_bfloat162 nv_bfloat162;

// ---- conversions ------------------------------------------------------------------------------
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half(d); }
inline float __half2float(__half h) { return (float)h; }
inline __half __ushort_as_half(unsigned short u) { return __half(__half_raw{u}); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline __half2 __float2half2_rn(float a) { return __half2{__half(a), __half(a)}; }
inline __half2 __halves2half2(__half a, __half b) { return __half2{a, b}; }
inline float2 __half22float2(__half2 h) { return float2{(float)h.x, (float)h.y}; }
inline __half2 __float22half2_rn(float2 f) { return __half2{__half(f.x), __half(f.y)}; }
inline float __low2float(__half2 h) { return (float)h.x; }
inline float __high2float(__half2 h) { return (float)h.y; }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }
inline float __bfloat162float(__nv_bfloat16 b) { return (float)b; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16(__nv_bfloat16_raw{u}); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(b)}; }
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(a)}; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162{a, b}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{(float)h.x, (float)h.y}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __nv_bfloat162{__nv_bfloat16(f.x), __nv_bfloat16(f.y)}; }
inline float __low2float(__nv_bfloat162 h) { return (float)h.x; }
inline float __high2float(__nv_bfloat162 h) { return (float)h.y; }

// ---- arithmetic (double, rounded once) ------------------------------------------------------------
#define FTEMU_HALF_OPS(H)                                                                              \
    inline H operator+(const H &a, const H &b) { return H((double)(float)a + (double)(float)b); }     \
    inline H operator-(const H &a, const H &b) { return H((double)(float)a - (double)(float)b); }     \
    inline H operator*(const H &a, const H &b) { return H((double)(float)a * (double)(float)b); }     \
    inline H operator/(const H &a, const H &b) { return H((double)(float)a / (double)(float)b); }     \
    inline H operator-(const H &a) { H r = a; r.__x ^= 0x8000u; return r; }                           \
    inline H &operator+=(H &a, const H &b) { return a = a + b; }                                       \
    inline H &operator-=(H &a, const H &b) { return a = a - b; }                                       \
    inline H &operator*=(H &a, const H &b) { return a = a * b; }                                       \
    inline H &operator/=(H &a, const H &b) { return a = a / b; }                                       \
    inline bool operator==(const H &a, const H &b) { return (float)a == (float)b; }                    \
    inline bool operator!=(const H &a, const H &b) { return (float)a != (float)b; }                    \
    inline bool operator<(const H &a, const H &b) { return (float)a < (float)b; }                      \
    inline bool operator<=(const H &a, const H &b) { return (float)a <= (float)b; }                    \
    inline bool operator>(const H &a, const H &b) { return (float)a > (float)b; }                      \
    inline bool operator>=(const H &a, const H &b) { return (float)a >= (float)b; }                    \
    inline H __hadd(H a, H b) { return a + b; }                                                        \
    inline H __hsub(H a, H b) { return a - b; }                                                        \
    inline H __hmul(H a, H b) { return a * b; }                                                        \
    inline H __hdiv(H a, H b) { return a / b; }                                                        \
    inline H __hfma(H a, H b, H c) { return H(std::fma((double)(float)a, (double)(float)b, (double)(float)c)); } \
    inline H __hneg(H a) { return -a; }                                                                \
    inline H __habs(H a) { H r = a; r.__x &= 0x7fffu; return r; }                                      \
    inline H __hmax(H a, H b) { return (float)a >= (float)b || std::isnan((float)b) ? a : b; }         \
    inline H __hmin(H a, H b) { return (float)a <= (float)b || std::isnan((float)b) ? a : b; }         \
    inline bool __heq(H a, H b) { return a == b; }                                                      \
    inline bool __hne(H a, H b) { return a != b; }                                                      \
    inline bool __hlt(H a, H b) { return a < b; }                                                       \
    inline bool __hle(H a, H b) { return a <= b; }                                                      \
    inline bool __hgt(H a, H b) { return a > b; }                                                       \
    inline bool __hge(H a, H b) { return a >= b; }                                                      \
    inline bool __hisnan(H a) { return std::isnan((float)a); }                                         \
    inline int __hisinf(H a) { float f = (float)a; return std::isinf(f) ? (f > 0 ? 1 : -1) : 0; }      \
    inline H hexp(H a) { return H(std::exp((double)(float)a)); }                                       \
    inline H hlog(H a) { return H(std::log((double)(float)a)); }                                       \
    inline H hsqrt(H a) { return H(std::sqrt((double)(float)a)); }                                     \
    inline H hrsqrt(H a) { return H(1.0 / std::sqrt((double)(float)a)); }
FTEMU_HALF_OPS(__half)
FTEMU_HALF_OPS(__nv_bfloat16)
#undef FTEMU_HALF_OPS

#define FTEMU_HALF2_OPS(H2, H)                                                                        \
    inline H2 __hadd2(H2 a, H2 b) { return H2{a.x + b.x, a.y + b.y}; }                                 \
    inline H2 __hsub2(H2 a, H2 b) { return H2{a.x - b.x, a.y - b.y}; }                                 \
    inline H2 __hmul2(H2 a, H2 b) { return H2{a.x * b.x, a.y * b.y}; }                                 \
    inline H2 __hfma2(H2 a, H2 b, H2 c) { return H2{__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; }  \
    inline H2 operator+(const H2 &a, const H2 &b) { return __hadd2(a, b); }                           \
    inline H2 operator-(const H2 &a, const H2 &b) { return __hsub2(a, b); }                           \
    inline H2 operator*(const H2 &a, const H2 &b) { return __hmul2(a, b); }
FTEMU_HALF2_OPS(__half2, __half)
FTEMU_HALF2_OPS(__nv_bfloat162, __nv_bfloat16)
#undef FTEMU_HALF2_OPS

#define CUDART_INF_FP16 __ushort_as_half((unsigned short)0x7C00U)
#define CUDART_NAN_FP16 __ushort_as_half((unsigned short)0x7FFFU)
#define CUDART_INF_BF16 __ushort_as_bfloat16((unsigned short)0x7F80U)
#define CUDART_NAN_BF16 __ushort_as_bfloat16((unsigned short)0x7FFFU)

#endif
