/* The read side of an activation cache: where every example's rows are, and one call that
 * reads a batch of them.
 *
 *   example i (0..N-1): id ids[i], rows_of(i) = 1 (pooled) or len(i) = offsets[i+1] - offsets[i]
 *   shard_of[i] = s >= 0: its rows are rows row_of[i] .. row_of[i] + rows_of(i) - 1 of shard s
 *                         (host memory, a memory-mapped file, or CUDA device memory: the device
 *                         tier; registered by their owner)
 *               = -1:     not cached: recomputed through the encoder when read
 *
 * ft_cache_read fills a caller's buffer in one of three layouts (pooled (n, C); padded
 * (n, T, C); ragged (sum len, C)): every output row is decoded straight from its shard row
 * (or zeroed, for padding) in one parallel loop; the examples that are not cached then run
 * through the encoder padded to their longest (the CPU encoder's output for an example does not
 * depend on its batch or padding), and through the codec and back, so they equal what the cache
 * would hold. Disk shards are checked against their CRC-32C before their first read.
 *
 * Device destinations (and host ones when the batch has rows in device shards) go through
 * read_device: a table of the rows device shards hold (and the padding rows) is gathered by the
 * backend's cache_decode_rows on the device; any other rows are decoded (or recomputed) on the host
 * into pinned staging memory that is copied up first. */
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cache/codec.h"
#include "core/status.h"
#include "fasttran.h"

typedef struct {
    char *name;
    const char *values;
    const float *scales;
    int64_t rows;
    const uint8_t *file;
    size_t file_bytes;
    uint32_t crc;
    int verified;                  /* under verify_lock once set; read with the acquire below */
    int on_device;                 /* values in the cache's device memory (the device tier) */
} shard;

struct ft_cache {
    int64_t N, C;
    ft_dtype codec;
    size_t row_bytes;
    int all_tokens;
    int64_t layer, recompute_batch;
    ft_pooling pooling;
    int64_t *ids;                  /* (N) */
    int64_t *sorted_ids, *sorted_pos;  /* (N) ids ascending, and their positions */
    int64_t id_min, id_span;       /* ids within [id_min, id_min + id_span) */
    int64_t *pos_of;               /* (id_span) position of id_min + k, or -1; NULL when ids are sparse */
    int32_t *tokens, *types;       /* (offsets[N]) */
    int64_t *offsets;              /* (N + 1) */
    int32_t *shard_of;             /* (N) */
    int64_t *row_of;               /* (N) */
    shard *shards;
    size_t n_shards, cap_shards;
    size_t n_device_shards;        /* shards in device memory, all on `device` */
    ft_device device;
    pthread_rwlock_t lock;         /* readers: ft_cache_read; writer: ft_cache_add_shard */
    pthread_mutex_t verify_lock;
    atomic_llong unverified;
    atomic_llong hits, misses;
};

#define FT_CACHE_BYTES_PER_THREAD (32u << 20)

static inline int64_t len_of(const ft_cache *c, int64_t i) { return c->offsets[i + 1] - c->offsets[i]; }
static inline int64_t rows_of(const ft_cache *c, int64_t i) { return c->all_tokens ? len_of(c, i) : 1; }

typedef struct { int64_t id, pos; } id_pos;
static int cmp_id(const void *a, const void *b) {
    const id_pos *x = a, *y = b;
    return x->id < y->id ? -1 : x->id > y->id;
}

void ft_cache_free(ft_cache *c) {
    if (!c) return;
    for (size_t s = 0; s < c->n_shards; s++) free(c->shards[s].name);
    free(c->shards);
    free(c->ids);
    free(c->sorted_ids);
    free(c->sorted_pos);
    free(c->pos_of);
    free(c->tokens);
    free(c->types);
    free(c->offsets);
    free(c->shard_of);
    free(c->row_of);
    pthread_rwlock_destroy(&c->lock);
    pthread_mutex_destroy(&c->verify_lock);
    free(c);
}

ft_status ft_cache_create(const ft_cache_config *cfg, ft_cache **out) {
    *out = NULL;
    const int64_t N = cfg->examples, C = cfg->hidden;
    if (N < 1) return ft_error(FT_ERR_INVALID_ARGUMENT, "a cache needs at least one example, got %lld", (long long)N);
    if (C < 1 || C > (1 << 24)) return ft_error(FT_ERR_INVALID_ARGUMENT, "cache hidden size %lld is out of range", (long long)C);
    if (!ft_cache_codec_ok(cfg->codec))
        return ft_error(FT_ERR_DTYPE, "cache codec must be float32, float16, bfloat16 or int8, not %s", ft_dtype_name(cfg->codec));
    if (cfg->all_tokens ? cfg->pooling != FT_POOL_NONE : (cfg->pooling != FT_POOL_CLS && cfg->pooling != FT_POOL_MEAN))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "pooling %d does not go with all_tokens=%d", (int)cfg->pooling, cfg->all_tokens);
    if (cfg->layer < 0 || cfg->recompute_batch < 1)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "cache layer %lld / recompute batch %lld out of range",
                        (long long)cfg->layer, (long long)cfg->recompute_batch);
    if (!cfg->example_ids || !cfg->offsets || cfg->offsets[0] != 0)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "cache inputs: example_ids and offsets (starting at 0) are required");
    for (int64_t i = 0; i < N; i++)
        if (cfg->offsets[i + 1] < cfg->offsets[i])
            return ft_error(FT_ERR_INVALID_ARGUMENT, "cache inputs: offsets decrease at example %lld", (long long)i);
    const int64_t T = cfg->offsets[N];
    if (T > 0 && (!cfg->tokens || !cfg->types)) return ft_error(FT_ERR_INVALID_ARGUMENT, "cache inputs: tokens and types are required");

    ft_cache *c = calloc(1, sizeof *c);
    if (!c) return ft_error(FT_ERR_NOMEM, "out of memory");
    c->N = N;
    c->C = C;
    c->codec = cfg->codec;
    c->row_bytes = (size_t)C * ft_dtype_size(cfg->codec);
    c->all_tokens = cfg->all_tokens != 0;
    c->layer = cfg->layer;
    c->recompute_batch = cfg->recompute_batch;
    c->pooling = cfg->pooling;
    pthread_rwlock_init(&c->lock, NULL);
    pthread_mutex_init(&c->verify_lock, NULL);
    const size_t n8 = (size_t)N * 8, t4 = (size_t)(T ? T : 1) * 4;
    c->ids = malloc(n8);
    c->sorted_ids = malloc(n8);
    c->sorted_pos = malloc(n8);
    c->offsets = malloc(n8 + 8);
    c->tokens = malloc(t4);
    c->types = malloc(t4);
    c->shard_of = malloc((size_t)N * 4);
    c->row_of = calloc((size_t)N, 8);
    id_pos *ip = malloc((size_t)N * sizeof *ip);
    if (!c->ids || !c->sorted_ids || !c->sorted_pos || !c->offsets || !c->tokens || !c->types || !c->shard_of ||
        !c->row_of || !ip) {
        free(ip);
        ft_cache_free(c);
        return ft_error(FT_ERR_NOMEM, "out of memory for a cache of %lld examples", (long long)N);
    }
    memcpy(c->ids, cfg->example_ids, n8);
    memcpy(c->offsets, cfg->offsets, n8 + 8);
    if (T) {
        memcpy(c->tokens, cfg->tokens, (size_t)T * 4);
        memcpy(c->types, cfg->types, (size_t)T * 4);
    }
    for (int64_t i = 0; i < N; i++) {
        c->shard_of[i] = -1;
        ip[i] = (id_pos){c->ids[i], i};
    }
    qsort(ip, (size_t)N, sizeof *ip, cmp_id);
    for (int64_t i = 0; i < N; i++) {
        if (i && ip[i].id == ip[i - 1].id) {
            long long dup = (long long)ip[i].id;
            free(ip);
            ft_cache_free(c);
            return ft_error(FT_ERR_INVALID_ARGUMENT, "duplicate example id %lld", dup);
        }
        c->sorted_ids[i] = ip[i].id;
        c->sorted_pos[i] = ip[i].pos;
    }
    free(ip);
    /* ids in a range at most 4N wide (the usual 0..N-1 among them): a direct table */
    c->id_min = c->sorted_ids[0];
    const uint64_t span = (uint64_t)c->sorted_ids[N - 1] - (uint64_t)c->sorted_ids[0] + 1;
    if (span <= 4 * (uint64_t)N + 1024 && (c->pos_of = malloc(span * sizeof *c->pos_of))) {
        c->id_span = (int64_t)span;
        for (uint64_t k = 0; k < span; k++) c->pos_of[k] = -1;
        for (int64_t i = 0; i < N; i++) c->pos_of[c->ids[i] - c->id_min] = i;
    }
    *out = c;
    return FT_OK;
}

ft_status ft_cache_add_shard(ft_cache *c, const ft_cache_shard *s) {
    const char *nm = s->name ? s->name : "host shard";
    const int on_device = s->device.kind == FT_DEVICE_CUDA;
    if (s->n < 0 || (s->n && !s->examples))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "%s: bad example list", nm);
    if (s->device.kind != FT_DEVICE_CPU && !on_device)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "%s: unknown device kind %d", nm, (int)s->device.kind);
    if (on_device && s->file)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "%s: a device shard has no file to check", nm);
    pthread_rwlock_wrlock(&c->lock);
    ft_status st = FT_OK;
    if (on_device && c->n_device_shards && c->device.index != s->device.index)
        st = ft_error(FT_ERR_INVALID_ARGUMENT, "%s: on cuda:%d, the cache's other device shards on cuda:%d", nm,
                      s->device.index, c->device.index);
    int64_t rows = 0, k = 0;
    for (; st == FT_OK && k < s->n; k++) {
        const int64_t i = s->examples[k];
        if (i < 0 || i >= c->N) { st = ft_error(FT_ERR_OUT_OF_RANGE, "%s: example %lld out of range 0..%lld", nm, (long long)i, (long long)c->N - 1); break; }
        if (c->shard_of[i] != -1) { st = ft_error(FT_ERR_INVALID_ARGUMENT, "%s: example %lld is already cached", nm, (long long)i); break; }
        c->shard_of[i] = -2;   /* claimed by this shard (undone on failure) */
        c->row_of[i] = rows;
        rows += rows_of(c, i);
    }
    if (st == FT_OK && rows != s->rows)
        st = ft_error(FT_ERR_INVALID_ARGUMENT, "%s: holds %lld rows, its examples have %lld", nm, (long long)s->rows, (long long)rows);
    const int scaled = ft_cache_codec_get(c->codec)->scaled;
    if (st == FT_OK && rows && (!s->values || scaled != (s->scales != NULL)))
        st = ft_error(FT_ERR_INVALID_ARGUMENT, "%s: values%s missing", nm, scaled ? " or int8 scales" : "");
    if (st == FT_OK && c->n_shards == c->cap_shards) {
        size_t cap = c->cap_shards ? 2 * c->cap_shards : 16;
        shard *ns = realloc(c->shards, cap * sizeof *ns);
        if (!ns) st = ft_error(FT_ERR_NOMEM, "out of memory");
        else { c->shards = ns; c->cap_shards = cap; }
    }
    char *name = NULL;
    if (st == FT_OK && !(name = strdup(nm))) st = ft_error(FT_ERR_NOMEM, "out of memory");
    if (st != FT_OK) {
        for (int64_t j = 0; j < k; j++)
            if (c->shard_of[s->examples[j]] == -2) c->shard_of[s->examples[j]] = -1;
        pthread_rwlock_unlock(&c->lock);
        return st;
    }
    const int32_t id = (int32_t)c->n_shards;
    c->shards[c->n_shards++] = (shard){name, s->values, s->scales, s->rows, s->file, s->file_bytes, s->crc32c,
                                       s->file == NULL, on_device};
    if (on_device) {
        c->device = s->device;
        c->n_device_shards++;
    }
    if (s->file) atomic_fetch_add(&c->unverified, 1);
    for (int64_t j = 0; j < s->n; j++) c->shard_of[s->examples[j]] = id;
    pthread_rwlock_unlock(&c->lock);
    return FT_OK;
}

ft_status ft_cache_lookup(const ft_cache *c, const int64_t *ids, int64_t n, int64_t *index_out) {
    int64_t unknown = 0, first = 0;
    for (int64_t k = 0; k < n; k++) {
        if (c->pos_of) {
            const uint64_t o = (uint64_t)ids[k] - (uint64_t)c->id_min;
            const int64_t pos = o < (uint64_t)c->id_span ? c->pos_of[o] : -1;
            if (pos >= 0) index_out[k] = pos;
            else if (unknown++ == 0) first = ids[k];
            continue;
        }
        int64_t lo = 0, hi = c->N;   /* first sorted id >= ids[k] */
        while (lo < hi) {
            int64_t mid = lo + (hi - lo) / 2;
            if (c->sorted_ids[mid] < ids[k]) lo = mid + 1;
            else hi = mid;
        }
        if (lo < c->N && c->sorted_ids[lo] == ids[k]) index_out[k] = c->sorted_pos[lo];
        else if (unknown++ == 0) first = ids[k];
    }
    if (unknown)
        return ft_error(FT_ERR_OUT_OF_RANGE, "unknown example id %lld (%lld unknown in this request)", (long long)first,
                        (long long)unknown);
    return FT_OK;
}

static ft_status uncached_error(const ft_cache *c, int64_t i) {
    return ft_error(FT_ERR_INVALID_ARGUMENT,
                    "example id %lld is not cached and this cache has no encoder to compute it: open it with "
                    "ActivationCache.open(path, encoder=...)", (long long)c->ids[i]);
}

ft_status ft_cache_check_readable(const ft_cache *c, const ft_encoder *enc) {
    if (!enc)
        for (int64_t i = 0; i < c->N; i++)
            if (c->shard_of[i] < 0) return uncached_error(c, i);
    return FT_OK;
}

int64_t ft_cache_examples(const ft_cache *c) { return c->N; }
int64_t ft_cache_rows_of(const ft_cache *c, int64_t i) { return i >= 0 && i < c->N ? rows_of(c, i) : -1; }
const int64_t *ft_cache_ids(const ft_cache *c) { return c->ids; }

ft_status ft_cache_batch_info_get(const ft_cache *c, const int64_t *index, int64_t n, ft_cache_layout layout,
                                  const ft_encoder *enc, ft_cache_batch_info *info) {
    int64_t T = 0, total = 0, misses = 0, first_miss = -1;
    if (n < 0) return ft_error(FT_ERR_INVALID_ARGUMENT, "negative batch size");
    if (layout != FT_CACHE_PADDED && layout != FT_CACHE_RAGGED) return ft_error(FT_ERR_INVALID_ARGUMENT, "bad cache layout %d", (int)layout);
    for (int64_t p = 0; p < n; p++) {
        const int64_t i = index[p];
        if (i < 0 || i >= c->N)
            return ft_error(FT_ERR_OUT_OF_RANGE, "example index %lld out of range 0..%lld", (long long)i, (long long)c->N - 1);
        const int64_t r = rows_of(c, i);
        T = r > T ? r : T;
        total += r;
        if (c->shard_of[i] < 0 && misses++ == 0) first_miss = i;
    }
    if (misses && !enc) return uncached_error(c, first_miss);
    info->misses = misses;
    if (!c->all_tokens) { info->rows = n; info->T = 1; }
    else if (layout == FT_CACHE_RAGGED) { info->rows = total; info->T = T; }
    else {
        if (T && n > INT64_MAX / T / c->C) return ft_error(FT_ERR_INVALID_ARGUMENT, "batch too large");
        info->rows = n * T;
        info->T = T;
    }
    return FT_OK;
}

int64_t ft_cache_width(const ft_cache *c) { return c->C; }
ft_dtype ft_cache_codec_of(const ft_cache *c) { return c->codec; }
int64_t ft_cache_example_rows(const ft_cache *c, int64_t i) { return rows_of(c, i); }

void ft_cache_counters(const ft_cache *c, int64_t *hits, int64_t *misses) {
    *hits = atomic_load(&((ft_cache *)c)->hits);
    *misses = atomic_load(&((ft_cache *)c)->misses);
}

/* Output rows g * GROUP .. of a batch: zero the padding rows, skip the uncached ones, and list
 * the others (where to decode them from and to) in `out`. */
static void resolve_group(const ft_cache *c, const int64_t *index, const int64_t *start, const int32_t *row_ex,
                          int64_t T, int ragged, int64_t rows, int64_t g, float *dst, ft_cache_rows *out) {
    /* rows of device shards are left to the device (read_device) */
    out->n = 0;
    const int64_t C = c->C;
    for (int64_t r = g * FT_CACHE_GROUP; r < rows && r < (g + 1) * FT_CACHE_GROUP; r++) {
        const int64_t p = !c->all_tokens ? r : ragged ? row_ex[r] : r / (T ? T : 1);
        const int64_t t = r - start[p], i = index[p];
        if (t >= rows_of(c, i)) {   /* padding */
            if (dst) memset(dst + r * C, 0, (size_t)C * sizeof(float));
            continue;
        }
        const int32_t s = c->shard_of[i];
        if (s < 0) continue;        /* recomputed afterwards */
        const shard *sh = &c->shards[s];
        if (sh->on_device) continue;
        const int64_t k = c->row_of[i] + t;
        out->dst[out->n] = dst + r * C;
        out->src[out->n] = sh->values + (size_t)k * c->row_bytes;
        out->scale[out->n] = sh->scales ? sh->scales[k] : 0.0f;
        out->n++;
    }
}

/* CRC-32C of every not yet verified disk shard this batch touches (once per shard). */
static ft_status verify_shards(ft_cache *c, const int64_t *index, int64_t n) {
    if (atomic_load(&c->unverified) == 0) return FT_OK;
    for (int64_t p = 0; p < n; p++) {
        const int32_t s = c->shard_of[index[p]];
        if (s < 0) continue;
        shard *sh = &c->shards[s];
        if (__atomic_load_n(&sh->verified, __ATOMIC_ACQUIRE)) continue;
        pthread_mutex_lock(&c->verify_lock);
        ft_status st = FT_OK;
        if (!sh->verified) {
            if (ft_crc32c(0, sh->file, sh->file_bytes) != sh->crc)
                st = ft_error(FT_ERR_FORMAT, "cache file %s fails its checksum: the data was altered or damaged", sh->name);
            else {
                __atomic_store_n(&sh->verified, 1, __ATOMIC_RELEASE);
                atomic_fetch_sub(&c->unverified, 1);
            }
        }
        pthread_mutex_unlock(&c->verify_lock);
        if (st != FT_OK) return st;
    }
    return FT_OK;
}

/* The uncached examples of the batch, recompute_batch at a time: encoder at their longest,
 * codec round trip, rows into their places (start[p] = first output row of example p). */
static ft_status recompute(ft_cache *c, const int64_t *index, int64_t n, const int64_t *start, float *dst,
                           ft_encoder *enc, ft_cancel_fn cancel, void *cancel_arg) {
    const ft_bert_config *cfg = ft_encoder_config(enc);
    const int64_t C = c->C, L = cfg->num_layers;
    if (cfg->hidden_size != C || c->layer > L)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "the encoder (hidden size %lld, %lld layers) cannot compute this "
                        "cache's examples (hidden size %lld, layer %lld)", (long long)cfg->hidden_size, (long long)L,
                        (long long)C, (long long)c->layer);
    int64_t *miss = malloc((size_t)n * sizeof *miss), m = 0;
    float **hid = calloc((size_t)L + 1, sizeof *hid), **pool = calloc((size_t)L + 1, sizeof *pool);
    ft_status st = FT_OK;
    if (!miss || !hid || !pool) st = ft_error(FT_ERR_NOMEM, "out of memory");
    for (int64_t p = 0; st == FT_OK && p < n; p++)
        if (c->shard_of[index[p]] < 0) miss[m++] = p;
    const int64_t B = c->recompute_batch;
    for (int64_t a = 0; st == FT_OK && a < m; a += B) {
        const int64_t b = m - a < B ? m - a : B;
        int64_t T = 1;
        for (int64_t q = 0; q < b; q++) {
            const int64_t l = len_of(c, index[miss[a + q]]);
            T = l > T ? l : T;
        }
        const int64_t out_rows = c->all_tokens ? b * T : b;
        int32_t *in = calloc((size_t)(3 * b * T), sizeof *in);
        float *out = malloc((size_t)(out_rows * C) * sizeof *out);
        const ft_cache_codec *kd = ft_cache_codec_get(c->codec);
        void *enc_rows = kd->lossless ? NULL : malloc((size_t)out_rows * c->row_bytes);
        float *scales = kd->scaled ? malloc((size_t)out_rows * sizeof *scales) : NULL;
        if (!in || !out || (!kd->lossless && !enc_rows) || (kd->scaled && !scales)) {
            st = ft_error(FT_ERR_NOMEM, "out of memory recomputing %lld uncached examples", (long long)b);
        } else {
            int32_t *ids = in, *tys = in + b * T, *msk = in + 2 * b * T;
            for (int64_t q = 0; q < b; q++) {
                const int64_t i = index[miss[a + q]], o = c->offsets[i], l = len_of(c, i);
                memcpy(ids + q * T, c->tokens + o, (size_t)l * 4);
                memcpy(tys + q * T, c->types + o, (size_t)l * 4);
                for (int64_t t = 0; t < l; t++) msk[q * T + t] = 1;
            }
            const ft_index2d vi = {ids, FT_I32, {T, 1}}, vt = {tys, FT_I32, {T, 1}}, vm = {msk, FT_I32, {T, 1}};
            (c->all_tokens ? hid : pool)[c->layer] = out;
            st = ft_encoder_forward(enc, b, T, &vi, &vm, &vt, hid, pool, c->pooling, 0, cancel, cancel_arg);
            (c->all_tokens ? hid : pool)[c->layer] = NULL;
            if (st == FT_OK && !kd->lossless) {   /* what the cache would have stored */
                st = ft_cache_encode(enc_rows, scales, c->codec, out, out_rows, C, NULL);
                if (st == FT_OK) ft_cache_decode(out, enc_rows, scales, c->codec, out_rows, C);
            }
            for (int64_t q = 0; st == FT_OK && q < b; q++) {
                const int64_t p = miss[a + q];
                if (c->all_tokens)
                    memcpy(dst + start[p] * C, out + q * T * C, (size_t)(len_of(c, index[p]) * C) * sizeof(float));
                else
                    memcpy(dst + start[p] * C, out + q * C, (size_t)C * sizeof(float));
            }
        }
        free(in);
        free(out);
        free(enc_rows);
        free(scales);
    }
    free(miss);
    free(hid);
    free(pool);
    return st;
}

/* The host part of a batch into host memory `dst` (rows, C): padding zeroed, rows of host and
 * disk shards decoded, uncached examples recomputed; rows of device shards left untouched. */
static ft_status fill_host(ft_cache *c, const int64_t *index, int64_t n, const ft_cache_batch_info *info,
                           const int64_t *start, const int32_t *row_ex, int ragged, float *dst, ft_encoder *enc,
                           int threads, ft_cancel_fn cancel, void *cancel_arg) {
    const int64_t C = c->C, rows = info->rows, T = info->T;
    /* threads = 0: one per FT_CACHE_BYTES_PER_THREAD of output (a thread copies a few GB/s, and a
     * parallel region costs a wake-up of every thread: on a loaded machine, one descheduled
     * thread stalls the whole region) */
    const uint64_t out_bytes = (uint64_t)rows * (uint64_t)C * sizeof(float);
    int nt = threads;
    if (nt <= 0) {
        const uint64_t want = out_bytes / FT_CACHE_BYTES_PER_THREAD;
        nt = ft_num_threads();
        if (want < (uint64_t)nt) nt = want ? (int)want : 1;
    }
    const int64_t n_groups = (rows + FT_CACHE_GROUP - 1) / FT_CACHE_GROUP;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t g = 0; g < n_groups; g++) {
        /* a group of output rows: padding zeroed, misses left for the recompute, the rest
         * decoded together, while the next group's rows are prefetched */
        ft_cache_rows cur, next;
        resolve_group(c, index, start, row_ex, T, ragged, rows, g, dst, &cur);
        resolve_group(c, index, start, row_ex, T, ragged, rows, g + 1, dst, &next);
        ft_cache_decode_group(cur.dst, cur.src, cur.scale, cur.n, next.src, next.n, c->codec, C);
    }
    if (info->misses) return recompute(c, index, n, start, dst, enc, cancel, cancel_arg);
    return FT_OK;
}

/* grow a staging buffer of `elem`-byte entries to at least `need` entries (never shrinks):
 * host = 1 takes pinned host memory, 0 device memory, both from `be` */
static ft_status grow(ft_backend *be, void **p, size_t *cap, size_t need, size_t elem, int host) {
    if (need <= *cap && *p) return FT_OK;
    if (*p) (host ? be->host_free : be->free)(be, *p);
    *p = NULL;
    *cap = 0;
    size_t want = need + need / 4 + 16;   /* room for the next, slightly larger batch */
    FT_TRY((host ? be->host_alloc : be->alloc)(be, want * elem, p));
    *cap = want;
    return FT_OK;
}

void ft_cache_staging_free(ft_cache_staging *s) {
    if (!s || (!s->host && !s->rows && !s->rows_dev && !s->tmp && !s->ready && !s->released)) return;
    ft_backend *be = NULL;
    if (ft_backend_for(s->dev, &be) == FT_OK) {
        if (s->pending) (void)be->event_synchronize(be, s->ready);   /* copies from the staging in flight */
        if (s->ready) be->event_destroy(be, s->ready);
        if (s->released) be->event_destroy(be, s->released);
        if (s->host) be->host_free(be, s->host);
        if (s->rows) be->host_free(be, s->rows);
        if (s->rows_dev) be->free(be, s->rows_dev);
        if (s->tmp) be->free(be, s->tmp);
    }
    const uintptr_t stream = s->stream;   /* borrowed: kept */
    *s = (ft_cache_staging){0};
    s->stream = stream;
}

ft_status ft_cache_staging_wait(ft_cache_staging *s) {
    if (!s->pending) return FT_OK;
    ft_backend *be = NULL;
    FT_TRY(ft_backend_for(s->dev, &be));
    FT_TRY(be->event_synchronize(be, s->ready));
    s->pending = 0;
    return FT_OK;
}

void ft_cache_staging_release(ft_cache_staging *s) {
    ft_backend *be = NULL;
    s->release_recorded = 0;
    if (!s->released || ft_backend_for(s->dev, &be) != FT_OK) return;
    if (be->event_record(be, s->released, 0) == FT_OK) s->release_recorded = 1;
    else ft_clear_error();   /* the next read then waits for the whole backend stream instead */
}

/* The batch into `out`, memory of backend `be` (a CUDA device): rows of device shards, and the
 * padding, gathered on the device; any other rows decoded (or recomputed) into pinned host
 * staging and copied up first. Returns when `out` is complete; with a side stream
 * (stg->stream), as soon as the work is queued there (stg->ready marks its end). */
static ft_status read_device(ft_cache *c, const int64_t *index, int64_t n, const ft_cache_batch_info *info,
                             const int64_t *start, const int32_t *row_ex, int ragged, float *out, ft_backend *be,
                             ft_encoder *enc, int threads, ft_cancel_fn cancel, void *cancel_arg,
                             ft_cache_staging *stg) {
    const int64_t C = c->C, rows = info->rows, T = info->T;
    const uintptr_t side = stg->stream;
    /* the staging and the table may still feed the previous batch's copies */
    FT_TRY(ft_cache_staging_wait(stg));
    if (side) {
        if (!stg->ready) FT_TRY(be->event_create(be, &stg->ready));
        if (!stg->released) FT_TRY(be->event_create(be, &stg->released));
        /* kernels may still read the batch this buffer held: the side stream waits for them */
        if (stg->release_recorded) FT_TRY(be->stream_wait_event(be, side, stg->released));
        else FT_TRY(be->synchronize(be));   /* first use, or a release that could not record */
        stg->release_recorded = 0;
    }
    /* which rows the host fills: rows of host / disk shards, and misses */
    int64_t host_rows = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = !c->all_tokens ? r : ragged ? row_ex[r] : r / (T ? T : 1);
        const int64_t t = r - start[p], i = index[p];
        if (t >= rows_of(c, i)) continue;
        const int32_t s = c->shard_of[i];
        if (s < 0 || !c->shards[s].on_device) host_rows++;
    }
    FT_TRY(grow(be, &stg->rows, &stg->rows_cap, (size_t)(rows ? rows : 1), sizeof(ft_gather_row), 1));
    ft_gather_row *tab = stg->rows;
    int64_t m = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = !c->all_tokens ? r : ragged ? row_ex[r] : r / (T ? T : 1);
        const int64_t t = r - start[p], i = index[p];
        if (t >= rows_of(c, i)) {   /* padding: zeroed by the host staging when there is one */
            if (!host_rows) tab[m++] = (ft_gather_row){NULL, r, 0.0f, 0};
            continue;
        }
        const int32_t s = c->shard_of[i];
        if (s < 0 || !c->shards[s].on_device) continue;
        const shard *sh = &c->shards[s];
        const int64_t k = c->row_of[i] + t;
        tab[m++] = (ft_gather_row){sh->values + (size_t)k * c->row_bytes, r, sh->scales ? sh->scales[k] : 0.0f, 0};
    }
    if (host_rows) {
        FT_TRY(grow(be, (void **)&stg->host, &stg->host_cap, (size_t)(rows * C), sizeof(float), 1));
        FT_TRY(fill_host(c, index, n, info, start, row_ex, ragged, stg->host, enc, threads, cancel, cancel_arg));
        FT_TRY(be->upload_async(be, out, stg->host, (size_t)(rows * C) * sizeof(float), side));
    }
    if (m) {
        FT_TRY(grow(be, &stg->rows_dev, &stg->rows_dev_cap, (size_t)m, sizeof(ft_gather_row), 0));
        FT_TRY(be->cache_decode_rows(be, out, tab, stg->rows_dev, m, C, c->codec, side));
    }
    if (side) {   /* the consumer waits for `ready` before it uses the batch (ft_cache_staging_wait) */
        FT_TRY(be->event_record(be, stg->ready, side));
        stg->pending = 1;
        return FT_OK;
    }
    /* the staging and the table are reused by the next read: wait for the copies */
    return be->synchronize(be);
}

ft_status ft_cache_read_staged(ft_cache *c, const int64_t *index, int64_t n, ft_cache_layout layout, float *dst,
                               ft_device dst_device, size_t capacity, ft_encoder *enc, int threads,
                               ft_cancel_fn cancel, void *cancel_arg, ft_cache_staging *stg) {
    if (dst_device.kind != FT_DEVICE_CPU && dst_device.kind != FT_DEVICE_CUDA)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "cache read: unknown destination device kind %d", (int)dst_device.kind);
    ft_cache_batch_info info;
    FT_TRY(ft_cache_batch_info_get(c, index, n, layout, enc, &info));
    const int64_t C = c->C, rows = info.rows, T = info.T;
    if ((uint64_t)rows * (uint64_t)C > capacity)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "the output holds %zu floats, the batch needs %lld x %lld", capacity,
                        (long long)rows, (long long)C);
    if (n == 0) return FT_OK;
    const int ragged = c->all_tokens && layout == FT_CACHE_RAGGED;
    /* start[p] = first output row of example p; for ragged batches also the example of each row */
    int64_t *start = malloc((size_t)(n + 1) * sizeof *start);
    int32_t *row_ex = ragged ? malloc((size_t)(rows ? rows : 1) * sizeof *row_ex) : NULL;
    if (!start || (ragged && !row_ex)) {
        free(start);
        free(row_ex);
        return ft_error(FT_ERR_NOMEM, "out of memory");
    }
    start[0] = 0;
    for (int64_t p = 0; p < n; p++) {
        const int64_t r = !c->all_tokens ? 1 : ragged ? len_of(c, index[p]) : T;
        start[p + 1] = start[p] + r;
        if (ragged)
            for (int64_t k = start[p]; k < start[p + 1]; k++) row_ex[k] = (int32_t)p;
    }
    pthread_rwlock_rdlock(&c->lock);
    ft_status st = verify_shards(c, index, n);
    int device_rows = 0;
    for (int64_t p = 0; st == FT_OK && c->n_device_shards && p < n && !device_rows; p++) {
        const int32_t s = c->shard_of[index[p]];
        device_rows = s >= 0 && c->shards[s].on_device;
    }
    if (st == FT_OK && dst_device.kind == FT_DEVICE_CPU && !device_rows) {
        st = fill_host(c, index, n, &info, start, row_ex, ragged, dst, enc, threads, cancel, cancel_arg);
    } else if (st == FT_OK) {
        /* through device memory: the destination's device, or (host destination) the cache's */
        const ft_device dev = dst_device.kind == FT_DEVICE_CUDA ? dst_device : c->device;
        ft_backend *be = NULL;
        ft_cache_staging local = {0};
        if (!stg) stg = &local;
        if (device_rows && dev.index != c->device.index)
            st = ft_error(FT_ERR_INVALID_ARGUMENT, "this cache's device tier is on cuda:%d; it cannot be read into "
                          "memory of cuda:%d", c->device.index, dev.index);
        if (st == FT_OK && (stg->host || stg->rows || stg->rows_dev || stg->tmp) &&
            (stg->dev.kind != dev.kind || stg->dev.index != dev.index))
            ft_cache_staging_free(stg);   /* buffers of another device */
        stg->dev = dev;
        if (st == FT_OK) st = ft_backend_for(dev, &be);
        if (st == FT_OK && (!be->cache_decode_rows || !be->host_alloc))
            st = ft_error(FT_ERR_UNSUPPORTED, "the %s backend cannot read a cache into device memory", be->name);
        float *out = dst;
        if (st == FT_OK && dst_device.kind == FT_DEVICE_CPU)
            st = grow(be, (void **)&stg->tmp, &stg->tmp_cap, (size_t)(rows * C), sizeof(float), 0);
        if (st == FT_OK && dst_device.kind == FT_DEVICE_CPU) out = stg->tmp;
        const uintptr_t side = stg->stream;
        if (out != dst) stg->stream = 0;   /* a host destination waits for its batch anyway */
        if (st == FT_OK)
            st = read_device(c, index, n, &info, start, row_ex, ragged, out, be, enc, threads, cancel, cancel_arg, stg);
        stg->stream = side;
        if (st == FT_OK && out != dst) st = be->download(be, dst, out, (size_t)(rows * C) * sizeof(float));
        if (stg == &local) ft_cache_staging_free(&local);
    }
    pthread_rwlock_unlock(&c->lock);
    free(start);
    free(row_ex);
    if (st == FT_OK) {
        atomic_fetch_add(&c->hits, n - info.misses);
        atomic_fetch_add(&c->misses, info.misses);
    }
    return st;
}

ft_status ft_cache_read(ft_cache *c, const int64_t *index, int64_t n, ft_cache_layout layout, float *dst,
                        ft_device dst_device, size_t capacity, ft_encoder *enc, int threads, ft_cancel_fn cancel,
                        void *cancel_arg) {
    return ft_cache_read_staged(c, index, n, layout, dst, dst_device, capacity, enc, threads, cancel, cancel_arg, NULL);
}
