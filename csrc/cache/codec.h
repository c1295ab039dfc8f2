/* Internal pieces of the cache codecs shared by codec.c and store.c. */
#ifndef FT_CACHE_CODEC_H
#define FT_CACHE_CODEC_H
#include "fasttran.h"

int ft_cache_codec_ok(ft_dtype c);
/* o (C) = decoded row at src; `scale` is the row's I8 scale (ignored by other codecs). */
void ft_cache_decode_row(float *restrict o, const void *restrict src, float scale, ft_dtype codec, int64_t C);
/* Up to FT_CACHE_GROUP rows decoded together: dst[k] (C floats) = row at src[k] with scale[k].
 * The rows are read in turns, 64 bytes of each at a time, so their cache misses overlap, and the
 * next group's rows (next_src, n_next) are prefetched meanwhile: a batch of rows scattered over
 * the shards reads at close to the speed of one sequential copy. */
#define FT_CACHE_GROUP 8
typedef struct {
    float *dst[FT_CACHE_GROUP];
    const char *src[FT_CACHE_GROUP];
    float scale[FT_CACHE_GROUP];
    int n;
} ft_cache_rows;
void ft_cache_decode_group(float *const *dst, const char *const *src, const float *scale, int n,
                           const char *const *next_src, int n_next, ft_dtype codec, int64_t C);

/* store.c: the cache's width C, codec, and rows of example i (1 pooled, else its length) */
int64_t ft_cache_width(const ft_cache *c);
ft_dtype ft_cache_codec_of(const ft_cache *c);
int64_t ft_cache_example_rows(const ft_cache *c, int64_t i);
#endif
