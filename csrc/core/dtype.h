/* dtype sizes, names and the f16/bf16 <-> f32 conversions (round to nearest even). */
#ifndef FT_CORE_DTYPE_H
#define FT_CORE_DTYPE_H
#include "fasttran.h"

float ft_f16_to_f32(uint16_t h);
uint16_t ft_f32_to_f16(float f);
float ft_bf16_to_f32(uint16_t h);
uint16_t ft_f32_to_bf16(float f);

/* Convert n elements of src (F32/F16/BF16) into f32 dst. */
void ft_convert_to_f32(float *dst, const void *src, ft_dtype src_dtype, size_t n);
/* Convert n f32 elements into dst of dtype F32/F16/BF16. */
void ft_convert_from_f32(void *dst, ft_dtype dst_dtype, const float *src, size_t n);

/* Read element (i, j) of an integer 2-D view as int64 (BOOL as 0/1; float masks are read by
 * the caller, which checks they hold exactly 0 or 1). */
static inline int64_t ft_index2d_get(const ft_index2d *v, int64_t i, int64_t j) {
    int64_t k = i * v->stride[0] + j * v->stride[1];
    switch (v->dtype) {
    case FT_I64: return ((const int64_t *)v->data)[k];
    case FT_I32: return ((const int32_t *)v->data)[k];
    case FT_I16: return ((const int16_t *)v->data)[k];
    case FT_I8: return ((const int8_t *)v->data)[k];
    case FT_U8: return ((const uint8_t *)v->data)[k];
    case FT_BOOL: return ((const uint8_t *)v->data)[k] != 0;
    default: return 0;
    }
}
#endif
