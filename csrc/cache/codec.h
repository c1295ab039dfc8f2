/* Internal pieces of the cache codecs shared by codec.c and store.c. */
#ifndef FT_CACHE_CODEC_H
#define FT_CACHE_CODEC_H
#include "cache/codecs.h"
#include "fasttran.h"

/* A codec (cache/codecs.h lists them): its name, storage, scale, and row coders. */
typedef struct {
    ft_dtype code;
    const char *name, *storage;   /* storage: NumPy's type string of the stored values */
    int scaled;                   /* one float32 scale per row */
    int lossless;                 /* decoding gives back the float32 row encoded */
    /* one row of C floats x into dst (and *scale when scaled); the error it makes: max |err|, and
     * the sums of err^2 and x^2 (exactly the codec's, for stats()) */
    void (*encode_row)(void *dst, float *scale, const float *x, int64_t C, double *max_err, double *sq_err,
                       double *sq_ref);
    /* o (C) = the row at src (`scale`: its scale when scaled); the 16-value step of
     * ft_cache_decode_group is codec.c's <tag>_decode16, dispatched by the list */
    void (*decode_row)(float *restrict o, const void *restrict src, float scale, int64_t C);
} ft_cache_codec;

/* the codec storing `c`, NULL when `c` is no codec */
const ft_cache_codec *ft_cache_codec_get(ft_dtype c);
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

/* Buffers a cache read into (or through) device memory reuses from call to call (store.c): the
 * reader keeps one per batch buffer, so a steady epoch allocates nothing. Zero-initialise. */
typedef struct {
    ft_device dev;                 /* the backend the buffers belong to */
    float *host;                   /* pinned host staging of the rows decoded on the host */
    size_t host_cap;               /* floats */
    void *rows;                    /* pinned host table of the rows gathered on the device */
    size_t rows_cap;               /* entries */
    void *rows_dev;                /* the table's device copy */
    size_t rows_dev_cap;
    float *tmp;                    /* device batch of a host destination with device rows */
    size_t tmp_cap;                /* floats */
    /* prefetch (device destinations): stream != 0 queues the batch's copies and decoding on that
     * side stream (borrowed: the reader's) without waiting; `ready` is recorded after them
     * (pending = 1 until someone waited for it: ft_cache_staging_wait); `released` is recorded on
     * the backend's stream by whoever gives the batch back (release_recorded = 1): the next read
     * into this buffer makes the side stream wait for it, so kernels still reading the old batch
     * finish first. */
    uintptr_t stream, ready, released;
    int pending, release_recorded;
} ft_cache_staging;
void ft_cache_staging_free(ft_cache_staging *s);
/* the host waits until the batch read with this staging is complete (nothing pending: FT_OK) */
ft_status ft_cache_staging_wait(ft_cache_staging *s);
/* the batch read with this staging is given back: record `released` on the backend's stream */
void ft_cache_staging_release(ft_cache_staging *s);
ft_status ft_cache_read_staged(ft_cache *c, const int64_t *index, int64_t n, ft_cache_layout layout, float *dst,
                               ft_device dst_device, size_t capacity, ft_encoder *enc, int threads,
                               ft_cancel_fn cancel, void *cancel_arg, ft_cache_staging *stg);
#endif
