/* Prefetching reader: one thread per epoch reads the batches of an order ahead of the consumer.
 *
 *   producer (its own thread, no Python):  while fewer than depth batches are ready: take a free
 *     buffer -> read the next batch into it (ft_cache_read) -> put it in the ring -> post "item";
 *     when depth are ready, sleep for about the time the consumer takes to use half of them
 *     (measured), or until the consumer finds the ring empty and wakes it
 *   consumer (ft_cache_reader_next):       wait for an item -> take the oldest batch; the caller
 *     owns it until ft_cache_batch_release returns its buffer
 *
 * No lock is shared by the two: semaphores carry the waiting, a ring (one producer, one
 * consumer) carries the batches, and released buffers go on a lock-free stack that the producer
 * empties at once. On a loaded machine a mutex would be held by the producer just as the OS
 * preempts it, and the consumer would wait a time slice for a batch that is ready; and a consumer
 * that wakes the producer lets it preempt the consumer, which then waits for a core. So a
 * consumer that keeps up never makes a system call; the producer times its own naps.
 *
 * Batches are delivered in host memory, or in a CUDA device's memory. Then each buffer also keeps
 * its pinned staging and gather table (ft_cache_staging), so a steady epoch allocates nothing on
 * the device either, and the reader queues each batch's copies and decoding on its own side
 * stream without waiting for them: they overlap the consumer's kernels on the backend's stream.
 * Events order the two: the consumer's next() waits (host) for the batch's `ready` event before
 * handing it over (so a batch handed out is complete, for any stream, as DLPack promises), and
 * the release of a batch records `released` on the backend's stream, which the side stream waits
 * for before it overwrites that buffer.
 * Buffers are reused, so a steady epoch allocates (and page-faults) depth + 1 buffers once. The
 * reader lives until it is closed and every batch it handed out is released (a reference
 * count). The end of the order, and a failure, are marked in the ring after the last batch. */
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "cache/codec.h"
#include "core/rng.h"
#include "core/status.h"
#include "fasttran.h"

typedef struct rbatch {
    ft_cache_batch pub;            /* first: ft_cache_batch * <-> rbatch * */
    struct rbatch *next;           /* free-stack link */
    struct ft_cache_reader *owner;
    size_t capacity;               /* floats in pub.values */
    ft_cache_staging stg;          /* device readers: staging reused batch after batch */
    int64_t *index, *ids;          /* (index_cap) each */
    size_t index_cap;
    ft_status status;
    char message[1024];
} rbatch;

struct ft_cache_reader {
    ft_cache *cache;
    ft_encoder *enc;
    int64_t *order, n, batch_size, n_steps, hidden;
    int64_t *perm;                 /* shuffled epochs: the permutation being drawn (order = perm + skip) */
    int64_t perm_n, perm_done;     /* its length; positions < perm_done are final (see shuffle_to) */
    uint64_t perm_key;
    int64_t first_step;            /* the producer's first step (0 is read by ft_cache_reader_start) */
    int64_t part, parts;           /* each step delivers slice `part` of `parts` of its batch (1: all) */
    ft_cache_layout layout;
    ft_device device;              /* where the batches are delivered */
    uintptr_t stream;              /* device readers: the side stream the copies run on */
    int depth, threads;
    pthread_t thread;
    int started;
    sem_t wake, items;             /* "room again" for the producer, ring entries for the consumer */
    atomic_int ready;              /* batches in the ring */
    atomic_int napping;            /* the producer sleeps (or is about to) in nap() */
    atomic_llong taken_ns;         /* when the consumer last took a batch (CLOCK_MONOTONIC) */
    atomic_llong interval_ns;      /* its average time between batches */
    rbatch **ring;                 /* depth + 1 entries: batches, then NULL = the end */
    int64_t head, tail;            /* consumer's and producer's positions */
    _Atomic(rbatch *) released;    /* lock-free stack of buffers given back */
    rbatch *spare;                 /* the producer's own free list */
    atomic_int stop;
    int ended;                     /* the consumer saw the end (consumer only) */
    int oom;                       /* the producer stopped for want of memory (set before the end) */
    atomic_int refs;               /* owner + batches handed out */
};

static void values_free(ft_device dev, float *p) {
    if (dev.kind == FT_DEVICE_CPU) free(p);
    else ft_device_free(dev, p);
}

static void batch_free(rbatch *b) {
    if (!b) return;
    if (b->owner) values_free(b->owner->device, b->pub.values);
    else free(b->pub.values);
    ft_cache_staging_free(&b->stg);
    free(b->index);
    free(b->ids);
    free(b);
}

static void free_list(rbatch *b) {
    while (b) {
        rbatch *nx = b->next;
        batch_free(b);
        b = nx;
    }
}

static void reader_destroy(ft_cache_reader *r) {
    for (int64_t k = r->head; k < r->tail; k++) batch_free(r->ring[k % (r->depth + 1)]);
    free_list(atomic_load(&r->released));
    free_list(r->spare);
    if (r->stream) {
        ft_backend *be = NULL;
        if (ft_backend_for(r->device, &be) == FT_OK) be->stream_destroy(be, r->stream);
    }
    sem_destroy(&r->wake);
    sem_destroy(&r->items);
    free(r->ring);
    free(r->perm ? r->perm : r->order);
    free(r);
}

static void unref(ft_cache_reader *r) {
    if (atomic_fetch_sub(&r->refs, 1) == 1) reader_destroy(r);
}

static int reader_cancelled(void *arg) { return atomic_load(&((ft_cache_reader *)arg)->stop); }

/* Forward Fisher-Yates over a (n): step i swaps position i with a uniform j in [i, n), after
 * which position i is final, so an epoch's first batches are known long before its last. j comes
 * from ft_mix64 (core/rng.h) of (key + i), scaled by a 64x64 -> 128-bit product (bias below
 * n / 2^64). Entries not yet touched hold 0 and mean their own position (a calloc'd array needs
 * no filling); touched entries not yet final hold value + 1; final entries hold the value. */
static void shuffle_to(int64_t *a, int64_t n, uint64_t key, int64_t *done, int64_t to) {
    if (to > n) to = n;
    for (int64_t i = *done; i < to; i++) {
        const uint64_t left = (uint64_t)(n - i);
        const int64_t j = i + (int64_t)(((unsigned __int128)ft_mix64(key + (uint64_t)i) * left) >> 64);
        const int64_t vi = a[i] ? a[i] - 1 : i;
        if (j != i) {
            const int64_t vj = a[j] ? a[j] - 1 : j;
            a[j] = vi + 1;
            a[i] = vj;
        } else
            a[i] = vi;
    }
    if (to > *done) *done = to;
}

static uint64_t shuffle_key(uint64_t seed) { return ft_mix64(seed ^ 0x243F6A8885A308D3ull); }

ft_status ft_epoch_order(uint64_t seed, int64_t n, int64_t *out) {
    if (n < 0) return ft_error(FT_ERR_INVALID_ARGUMENT, "epoch order: negative length %lld", (long long)n);
    memset(out, 0, (size_t)n * sizeof *out);
    int64_t done = 0;
    shuffle_to(out, n, shuffle_key(seed), &done, n);
    return FT_OK;
}

/* Shuffled readers: make the positions of steps first..last final. */
static void shuffle_steps(ft_cache_reader *r, int64_t last_step) {
    if (!r->perm) return;
    int64_t to = (r->order - r->perm) + (last_step + 1) * r->batch_size;
    shuffle_to(r->perm, r->perm_n, r->perm_key, &r->perm_done, to);
}

/* Where slice p of `parts` of a global batch begins: the position k in [0, gn] whose prefix of
 * the examples' costs (pre[k]; pre[gn] the whole batch's) is nearest p/parts of the total, ties
 * to the smaller k; 0 for p = 0 and gn for p = parts. Nondecreasing in p; with equal costs it is
 * gn p / parts rounded to the nearest (down at .5). */
static int64_t slice_start(const int64_t *pre, int64_t gn, int64_t p, int64_t parts) {
    if (p <= 0) return 0;
    if (p >= parts) return gn;
    const int64_t target = pre[gn] * p;   /* compared against pre[k] * parts: exact integers */
    int64_t k = 0;
    while (k < gn && pre[k + 1] * parts <= target) k++;   /* the last k with pre[k] <= total p / parts */
    if (k < gn && pre[k + 1] * parts - target < target - pre[k] * parts) k++;
    return k;
}

ft_status ft_cache_slice(const ft_cache *c, const int64_t *idx, int64_t gn, int64_t part, int64_t parts, int64_t *lo,
                         int64_t *hi) {
    *lo = 0, *hi = gn;
    if (parts <= 1) return FT_OK;
    int64_t *pre = malloc((size_t)(gn + 1) * sizeof *pre);   /* the costs' prefix sums */
    if (!pre) return ft_error(FT_ERR_NOMEM, "out of memory");
    const int64_t C = ft_cache_width(c);
    pre[0] = 0;
    for (int64_t k = 0; k < gn; k++) {
        const int64_t rk = ft_cache_example_rows(c, idx[k]);
        pre[k + 1] = pre[k] + rk * (6 * C + rk);
    }
    *lo = slice_start(pre, gn, part, parts);
    *hi = slice_start(pre, gn, part + 1, parts);
    free(pre);
    return FT_OK;
}

/* One step into b (buffers grown as needed); the status and message stay with the batch.
 * A step is a batch of the order (the global batch); with parts > 1 only slice `part` of it is
 * read (ft_cache_slice). */
static void read_step(ft_cache_reader *r, rbatch *b, int64_t step) {
    const int64_t a = step * r->batch_size, gn = r->n - a < r->batch_size ? r->n - a : r->batch_size;
    int64_t g_rows = 0, g_longest = 0;   /* the global batch's rows and longest example */
    int64_t lo = 0, hi = gn;
    for (int64_t k = 0; k < gn; k++) {
        const int64_t rk = ft_cache_example_rows(r->cache, r->order[a + k]);
        g_rows += rk;
        if (rk > g_longest) g_longest = rk;
    }
    ft_status st = ft_cache_slice(r->cache, r->order + a, gn, r->part, r->parts, &lo, &hi);
    int64_t nb = st == FT_OK ? hi - lo : 0;
    if (st != FT_OK) lo = 0;
    const int64_t *idx = r->order + a + lo;
    int64_t g_before = 0;                /* rows before the slice */
    for (int64_t k = 0; k < lo; k++) g_before += ft_cache_example_rows(r->cache, r->order[a + k]);
    ft_cache_batch_info info;
    if (st == FT_OK) st = ft_cache_batch_info_get(r->cache, idx, nb, r->layout, r->enc, &info);
    size_t need = st == FT_OK ? (size_t)info.rows * (size_t)r->hidden : 0;
    if (need < 16) need = 16;
    if (st == FT_OK && need > b->capacity) {
        values_free(r->device, b->pub.values);
        b->pub.values = NULL;
        b->capacity = 0;
        void *p = NULL;
        if (r->device.kind != FT_DEVICE_CPU) {
            if (need < (size_t)r->batch_size * (size_t)r->hidden) need = (size_t)r->batch_size * (size_t)r->hidden;
            need += need / 4;   /* room for a longer batch of the epoch: device allocations are slow */
            st = ft_device_alloc(r->device, need * sizeof(float), &p);
            if (st == FT_OK) { b->pub.values = p; b->capacity = need; }
        } else if (posix_memalign(&p, 64, need * sizeof(float)) != 0)
            st = ft_error(FT_ERR_NOMEM, "out of memory for a batch of %zu floats", need);
        else { b->pub.values = p; b->capacity = need; }
    }
    if (st == FT_OK && (size_t)nb > b->index_cap) {
        free(b->index);
        free(b->ids);
        b->index = malloc((size_t)nb * sizeof *b->index);
        b->ids = malloc((size_t)nb * sizeof *b->ids);
        b->index_cap = b->index && b->ids ? (size_t)nb : 0;
        if (!b->index_cap) st = ft_error(FT_ERR_NOMEM, "out of memory");
    }
    if (st == FT_OK) {
        b->stg.stream = r->stream;
        memcpy(b->index, idx, (size_t)nb * sizeof *idx);
        const int64_t *all = ft_cache_ids(r->cache);   /* here, not in the consumer's next() */
        for (int64_t k = 0; k < nb; k++) b->ids[k] = all[idx[k]];
        st = ft_cache_read_staged(r->cache, idx, nb, r->layout, b->pub.values, r->device, b->capacity, r->enc,
                                  r->threads, reader_cancelled, r, &b->stg);
    }
    b->pub.index = b->index;
    b->pub.ids = b->ids;
    b->pub.n = nb;
    b->pub.rows = st == FT_OK ? info.rows : 0;
    b->pub.T = st == FT_OK ? info.T : 0;
    b->pub.step = step;
    b->pub.global_n = gn;
    b->pub.offset = lo;
    b->pub.global_rows = g_rows;
    b->pub.row_offset = g_before;
    b->pub.global_T = g_longest;
    b->status = st;
    b->message[0] = '\0';
    if (st != FT_OK) {
        snprintf(b->message, sizeof b->message, "%s", ft_last_error());
        ft_clear_error();
    }
}

static void push(ft_cache_reader *r, rbatch *b) {   /* producer only */
    r->ring[r->tail % (r->depth + 1)] = b;
    r->tail++;
    if (b) atomic_fetch_add(&r->ready, 1);
    sem_post(&r->items);
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Nap while the ring is full: for the time the consumer needs to take half of it (at least
 * 0.1 ms), or until it wakes us (ring empty) or close() does. `idle` counts the naps in a row
 * during which the consumer took nothing: they double, and after 100 ms the producer sleeps
 * until woken (a consumer that stopped, or has not started, costs no CPU). */
static void nap(ft_cache_reader *r, int idle) {
    const long long interval = atomic_load(&r->interval_ns);
    long long ns = interval ? (long long)(atomic_load(&r->ready) - r->depth / 2) * interval : 1000000;
    ns = (ns < 100000 ? 100000 : ns) << (idle < 20 ? idle : 20);
    atomic_store(&r->napping, 1);   /* then look again: a consumer that emptied the ring meanwhile */
    if (atomic_load(&r->ready) >= r->depth && !atomic_load(&r->stop)) {   /* ... posts "wake" */
        if (ns > 100000000) {
            while (sem_wait(&r->wake) != 0 && errno == EINTR) {}
        } else {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += ns;
            until.tv_sec += until.tv_nsec / 1000000000L;
            until.tv_nsec %= 1000000000L;
            sem_timedwait(&r->wake, &until);
        }
    }
    atomic_store(&r->napping, 0);
}

static void *producer(void *arg) {
    ft_cache_reader *r = arg;
    for (int64_t step = r->first_step; step < r->n_steps; step++) {
        for (int idle = 0; !atomic_load(&r->stop) && atomic_load(&r->ready) >= r->depth; idle++) {
            const long long seen = atomic_load(&r->taken_ns);
            nap(r, idle);
            if (atomic_load(&r->taken_ns) != seen) idle = -1;   /* the consumer is taking batches */
        }
        if (atomic_load(&r->stop)) break;
        if (!r->spare) r->spare = atomic_exchange(&r->released, NULL);   /* take every buffer given back */
        rbatch *b = r->spare;
        if (b) r->spare = b->next;
        else if (!(b = calloc(1, sizeof *b))) {
            r->oom = 1;
            break;
        }
        b->owner = r;
        shuffle_steps(r, step);
        read_step(r, b, step);
        if (b->status == FT_ERR_INTERRUPTED && atomic_load(&r->stop)) {   /* stopped: no error, just the end */
            batch_free(b);
            break;
        }
        const int failed = b->status != FT_OK;   /* once pushed, b is the consumer's (it frees a failed one) */
        push(r, b);
        if (failed) break;
    }
    push(r, NULL);   /* the end: its slot is the ring's extra one */
    return NULL;
}

/* The common part of both starts: r->order, n (and perm) set; takes r (destroyed on failure). */
static ft_status reader_begin(ft_cache_reader *r, ft_cache *c, int64_t batch_size, int64_t part, int64_t parts,
                              ft_cache_layout layout, int depth, ft_encoder *enc, int threads, ft_device device,
                              ft_cache_reader **out) {
    r->ring = calloc((size_t)depth + 1, sizeof *r->ring);
    if (!r->ring) {
        free(r->perm ? r->perm : r->order);
        free(r);
        return ft_error(FT_ERR_NOMEM, "out of memory");
    }
    r->cache = c;
    r->enc = enc;
    r->batch_size = batch_size;
    r->part = part;
    r->parts = parts;
    r->n_steps = (r->n + batch_size - 1) / batch_size;
    r->hidden = ft_cache_width(c);
    r->layout = layout;
    r->device = device;
    r->depth = depth;
    r->threads = threads;
    atomic_init(&r->refs, 1);
    atomic_init(&r->released, NULL);
    sem_init(&r->wake, 0, 0);
    sem_init(&r->items, 0, 0);
    if (device.kind == FT_DEVICE_CUDA) {   /* the side stream of the prefetch */
        ft_backend *be = NULL;
        ft_status st = ft_backend_for(device, &be);
        if (st == FT_OK) st = be->stream_create(be, &r->stream);
        if (st != FT_OK) {
            r->stream = 0;
            reader_destroy(r);
            return st;
        }
    }
    /* the first batch is read here: the consumer asks for it next, and a thread just started
     * may wait for a core longer than the read takes */
    if (r->n_steps) {
        rbatch *b = calloc(1, sizeof *b);
        if (!b) {
            reader_destroy(r);
            return ft_error(FT_ERR_NOMEM, "out of memory");
        }
        b->owner = r;
        shuffle_steps(r, 0);
        read_step(r, b, 0);
        r->first_step = b->status == FT_OK ? 1 : r->n_steps;   /* after a failure, only the end follows */
        push(r, b);
    }
    int e = pthread_create(&r->thread, NULL, producer, r);
    if (e) {
        reader_destroy(r);
        return ft_error_errno(FT_ERR_INTERNAL, e, "cannot start the cache reader thread");
    }
    r->started = 1;
    *out = r;
    return FT_OK;
}

static ft_status check_reader_args(ft_device device, int64_t n, int64_t batch_size, int64_t part, int64_t parts,
                                   int depth) {
    if (device.kind != FT_DEVICE_CPU && device.kind != FT_DEVICE_CUDA)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "reader: unknown device kind %d", (int)device.kind);
    if (parts < 1 || parts > (1 << 24) || part < 0 || part >= parts)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "reader: need 1 <= parts <= 2^24 and 0 <= part < parts (got part %lld "
                        "of %lld)", (long long)part, (long long)parts);
    if (n < 0 || batch_size < 1 || depth < 1 || depth > 1024)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "reader: need n >= 0, batch_size >= 1, 1 <= depth <= 1024 (got %lld, %lld, %d)",
                        (long long)n, (long long)batch_size, depth);
    return FT_OK;
}

ft_status ft_cache_reader_start(ft_cache *c, const int64_t *order, int64_t n, int64_t batch_size, int64_t part,
                                int64_t parts, ft_cache_layout layout, int depth, ft_encoder *enc, int threads,
                                ft_device device, ft_cache_reader **out) {
    *out = NULL;
    FT_TRY(check_reader_args(device, n, batch_size, part, parts, depth));
    /* every example of the order is checked now, not when its batch comes up */
    ft_cache_batch_info info;
    FT_TRY(ft_cache_batch_info_get(c, order, n, FT_CACHE_RAGGED, enc, &info));
    ft_cache_reader *r = calloc(1, sizeof *r);
    if (!r) return ft_error(FT_ERR_NOMEM, "out of memory");
    if (!(r->order = malloc((size_t)(n ? n : 1) * sizeof *r->order))) {
        free(r);
        return ft_error(FT_ERR_NOMEM, "out of memory");
    }
    memcpy(r->order, order, (size_t)n * sizeof *order);
    r->n = n;
    return reader_begin(r, c, batch_size, part, parts, layout, depth, enc, threads, device, out);
}

ft_status ft_cache_reader_start_shuffled(ft_cache *c, uint64_t seed, int64_t keep, int64_t skip, int64_t batch_size,
                                         int64_t part, int64_t parts, ft_cache_layout layout, int depth,
                                         ft_encoder *enc, int threads, ft_device device, ft_cache_reader **out) {
    *out = NULL;
    const int64_t N = ft_cache_examples(c);
    if (keep < 0 || keep > N || skip < 0)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "reader: need 0 <= keep <= %lld and skip >= 0 (got %lld, %lld)",
                        (long long)N, (long long)keep, (long long)skip);
    if (skip > keep) skip = keep;
    FT_TRY(check_reader_args(device, keep - skip, batch_size, part, parts, depth));
    /* the order holds every example: each is checked now (cheaply: in storage order) */
    FT_TRY(ft_cache_check_readable(c, enc));
    ft_cache_reader *r = calloc(1, sizeof *r);
    if (!r) return ft_error(FT_ERR_NOMEM, "out of memory");
    if (!(r->perm = calloc((size_t)(N ? N : 1), sizeof *r->perm))) {   /* zero pages: nothing to fill */
        free(r);
        return ft_error(FT_ERR_NOMEM, "out of memory");
    }
    r->perm_n = N;
    r->perm_key = shuffle_key(seed);
    r->order = r->perm + skip;
    r->n = keep - skip;
    return reader_begin(r, c, batch_size, part, parts, layout, depth, enc, threads, device, out);
}

ft_status ft_cache_reader_next(ft_cache_reader *r, int timeout_ms, ft_cache_batch **out, int *timed_out) {
    *out = NULL;
    if (timed_out) *timed_out = 0;
    if (r->ended) return FT_OK;
    int w = sem_trywait(&r->items);
    if (w != 0 && atomic_load(&r->napping)) sem_post(&r->wake);   /* nothing ready: wake a napping producer */
    if (w == 0) {
    } else if (timeout_ms < 0) {
        while ((w = sem_wait(&r->items)) != 0 && errno == EINTR) {}
    } else {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += timeout_ms / 1000;
        until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) { until.tv_sec++; until.tv_nsec -= 1000000000L; }
        while ((w = sem_timedwait(&r->items, &until)) != 0 && errno == EINTR) {}
        if (w != 0) {
            if (timed_out) *timed_out = 1;
            return FT_OK;
        }
    }
    rbatch *b = r->ring[r->head % (r->depth + 1)];
    r->head++;
    if (!b) {   /* the end (after the last batch, or after a failed one) */
        r->ended = 1;
        return r->oom ? ft_error(FT_ERR_NOMEM, "out of memory in the cache reader") : FT_OK;
    }
    atomic_fetch_sub(&r->ready, 1);
    const long long t = now_ns(), last = atomic_exchange(&r->taken_ns, t);
    if (last) atomic_store(&r->interval_ns, (7 * atomic_load(&r->interval_ns) + (t - last)) / 8);
    if (b->status != FT_OK) {
        ft_status st = ft_error(b->status, "%s", b->message);
        batch_free(b);
        return st;
    }
    ft_status ws = ft_cache_staging_wait(&b->stg);   /* its copies, queued on the side stream */
    if (ws != FT_OK) {
        batch_free(b);
        return ws;
    }
    atomic_fetch_add(&r->refs, 1);
    *out = &b->pub;
    return FT_OK;
}

void ft_cache_batch_release(ft_cache_batch *pub) {
    if (!pub) return;
    rbatch *b = (rbatch *)pub;
    ft_cache_reader *r = b->owner;
    if (r->stream) ft_cache_staging_release(&b->stg);   /* kernels queued on the batch finish before reuse */
    rbatch *head = atomic_load(&r->released);
    do b->next = head;
    while (!atomic_compare_exchange_weak(&r->released, &head, b));   /* ABA-free: the producer only takes all */
    unref(r);
}

void ft_cache_reader_stop(ft_cache_reader *r) {
    atomic_store(&r->stop, 1);
    sem_post(&r->wake);   /* wakes a napping producer; it sees stop (nap() looks at stop after napping = 1) */
}

void ft_cache_reader_close(ft_cache_reader *r) {
    if (!r) return;
    ft_cache_reader_stop(r);
    if (r->started) pthread_join(r->thread, NULL);
    unref(r);
}
