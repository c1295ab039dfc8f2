/* Gradient sums in shared memory among the ranks on one machine (see host_sum.h). */
#define _GNU_SOURCE
#include "dist/host_sum.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core/status.h"

#define CTRL_MAGIC 0x6674686f73747375ull   /* "fthostsu" */

typedef struct {   /* a rank's control block: written by that rank only */
    uint64_t magic, token;
    int64_t world, rank, n_buckets, table_floats;
    _Atomic int64_t summed;   /* the last step whose parts this rank has summed */
    double loss[2];           /* this rank's loss of step s in loss[s % 2], written before `summed` */
    char pad[64 - 16];
    _Atomic int64_t posted[]; /* per bucket: the last step it was posted in */
} ctrl_block;

struct ft_host_sum {
    int rank, world, n_buckets;
    int64_t *boff, *bn;
    size_t table_floats;
    float **table;              /* per rank: its table, mapped here */
    void **table_map;           /* the mappings (page-aligned) and their sizes */
    size_t *table_map_bytes;
    ctrl_block **ctrl;          /* per rank; ctrl[rank] this rank's, writable */
    size_t ctrl_bytes;
    int ctrl_fd;
    int64_t step;               /* finish's state: the step it works on, */
    int next;                   /* the next bucket to sum, */
    int summed;                 /* and whether this rank's parts are done */
    int64_t done;               /* the last step finish completed */
};

static size_t page_size(void) { return (size_t)sysconf(_SC_PAGESIZE); }

/* map `floats` floats at byte `offset` of fd (read-write, shared) */
static ft_status map_table(ft_host_sum *h, int r, int fd, size_t offset) {
    const size_t page = page_size(), base = offset / page * page;
    const size_t bytes = offset - base + h->table_floats * sizeof(float);
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (size_t)sb.st_size < offset + h->table_floats * sizeof(float))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "rank %d's gradient table is not the size this rank's is", r);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)base);
    if (p == MAP_FAILED) return ft_error_errno(FT_ERR_IO, errno, "cannot map rank %d's gradient table", r);
    h->table_map[r] = p;
    h->table_map_bytes[r] = bytes;
    h->table[r] = (float *)((char *)p + (offset - base));
    return FT_OK;
}

void ft_host_sum_free(ft_host_sum *h) {
    if (!h) return;
    for (int r = 0; r < h->world; r++) {
        if (h->table_map && h->table_map[r]) munmap(h->table_map[r], h->table_map_bytes[r]);
        if (h->ctrl && h->ctrl[r]) munmap(h->ctrl[r], h->ctrl_bytes);
    }
    if (h->ctrl_fd >= 0) close(h->ctrl_fd);
    free(h->boff);
    free(h->bn);
    free(h->table);
    free(h->table_map);
    free(h->table_map_bytes);
    free(h->ctrl);
    free(h);
}

ft_status ft_host_sum_create(int rank, int world, int table_fd, size_t table_offset, size_t table_floats,
                             const int64_t *bucket_offset, const int64_t *bucket_floats, int n_buckets,
                             uint64_t token, ft_host_sum **out) {
    *out = NULL;
    if (world < 2 || rank < 0 || rank >= world || n_buckets < 1)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "host sum: rank %d of %d with %d buckets", rank, world, n_buckets);
    for (int b = 0; b < n_buckets; b++)
        if (bucket_offset[b] < 0 || bucket_floats[b] < 0 || (size_t)(bucket_offset[b] + bucket_floats[b]) > table_floats)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "gradient bucket %d lies outside the table", b);
    ft_host_sum *h = calloc(1, sizeof *h);
    if (!h) return ft_error(FT_ERR_NOMEM, "out of memory");
    h->rank = rank, h->world = world, h->n_buckets = n_buckets, h->table_floats = table_floats, h->ctrl_fd = -1;
    h->boff = malloc((size_t)n_buckets * sizeof *h->boff);
    h->bn = malloc((size_t)n_buckets * sizeof *h->bn);
    h->table = calloc((size_t)world, sizeof *h->table);
    h->table_map = calloc((size_t)world, sizeof *h->table_map);
    h->table_map_bytes = calloc((size_t)world, sizeof *h->table_map_bytes);
    h->ctrl = calloc((size_t)world, sizeof *h->ctrl);
    if (!h->boff || !h->bn || !h->table || !h->table_map || !h->table_map_bytes || !h->ctrl) {
        ft_host_sum_free(h);
        return ft_error(FT_ERR_NOMEM, "out of memory");
    }
    memcpy(h->boff, bucket_offset, (size_t)n_buckets * sizeof *h->boff);
    memcpy(h->bn, bucket_floats, (size_t)n_buckets * sizeof *h->bn);
    ft_status st = map_table(h, rank, table_fd, table_offset);   /* our own, mapped again: independent of the model */
    const size_t page = page_size();
    h->ctrl_bytes = (sizeof(ctrl_block) + (size_t)n_buckets * sizeof(int64_t) + page - 1) / page * page;
    if (st == FT_OK) {
#ifdef SYS_memfd_create
        h->ctrl_fd = (int)syscall(SYS_memfd_create, "fasttran-host-sum", 1u);
#endif
        if (h->ctrl_fd < 0 || ftruncate(h->ctrl_fd, (off_t)h->ctrl_bytes) != 0)
            st = ft_error_errno(FT_ERR_UNSUPPORTED, errno, "cannot make the gradient sums' control block");
    }
    if (st == FT_OK) {
        void *p = mmap(NULL, h->ctrl_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, h->ctrl_fd, 0);
        if (p == MAP_FAILED) st = ft_error_errno(FT_ERR_IO, errno, "cannot map the gradient sums' control block");
        else h->ctrl[rank] = p;
    }
    if (st != FT_OK) { ft_host_sum_free(h); return st; }
    ctrl_block *c = h->ctrl[rank];
    c->token = token, c->world = world, c->rank = rank, c->n_buckets = n_buckets, c->table_floats = (int64_t)table_floats;
    atomic_store(&c->summed, 0);
    for (int b = 0; b < n_buckets; b++) atomic_store(&c->posted[b], 0);
    atomic_thread_fence(memory_order_release);
    c->magic = CTRL_MAGIC;
    *out = h;
    return FT_OK;
}

int ft_host_sum_ctrl_fd(const ft_host_sum *h) { return h->ctrl_fd; }

static int open_peer_fd(int64_t pid, int64_t fd, int r) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/fd/%lld", (long long)pid, (long long)fd);
    return open(path, O_RDWR | O_CLOEXEC);
}

ft_status ft_host_sum_connect(ft_host_sum *h, const int64_t *pids, const int64_t *table_fds,
                              const int64_t *table_offsets, const int64_t *ctrl_fds, const uint64_t *tokens) {
    for (int r = 0; r < h->world; r++) {
        if (r == h->rank || h->ctrl[r]) continue;
        int fd = open_peer_fd(pids[r], ctrl_fds[r], r);
        if (fd < 0) return ft_error_errno(FT_ERR_IO, errno, "cannot open rank %d's control block (process %lld)", r,
                                          (long long)pids[r]);
        struct stat sb;
        void *p = fstat(fd, &sb) == 0 && (size_t)sb.st_size >= h->ctrl_bytes
                      ? mmap(NULL, h->ctrl_bytes, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
        close(fd);
        if (p == MAP_FAILED) return ft_error(FT_ERR_INVALID_ARGUMENT, "rank %d's control block is not one", r);
        h->ctrl[r] = p;
        const ctrl_block *c = p;
        if (c->magic != CTRL_MAGIC || c->token != tokens[r] || c->world != h->world || c->rank != r ||
            c->n_buckets != h->n_buckets || c->table_floats != (int64_t)h->table_floats)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "rank %d's control block is not the one it announced (another "
                            "machine with the same host name?)", r);
        fd = open_peer_fd(pids[r], table_fds[r], r);
        if (fd < 0) return ft_error_errno(FT_ERR_IO, errno, "cannot open rank %d's gradient table", r);
        ft_status st = map_table(h, r, fd, (size_t)table_offsets[r]);
        close(fd);
        FT_TRY(st);
    }
    return FT_OK;
}

ft_status ft_host_sum_post(ft_host_sum *h, int b, int64_t step) {
    if (b < 0 || b >= h->n_buckets) return ft_error(FT_ERR_INVALID_ARGUMENT, "no gradient bucket %d", b);
    if (step <= h->done)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "gradient bucket %d is handed over for step %lld, whose sums were "
                        "already made: a step was repeated or one was not begun", b, (long long)step);
    for (int r = 0; r < h->world; r++)
        if (!h->ctrl[r]) return ft_error(FT_ERR_INVALID_ARGUMENT, "the host sum is not connected");
    atomic_store_explicit(&h->ctrl[h->rank]->posted[b], step, memory_order_release);
    return FT_OK;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Wait until every rank's counter (posted[b], or summed when b < 0) reaches `step`: 0 done, 1 the
 * deadline passed, -1 a rank is past it (the ranks diverged; *who is that rank). */
static int wait_all(ft_host_sum *h, int b, int64_t step, double deadline, int *who, int64_t *seen) {
    for (long spins = 0;; spins++) {
        int all = 1;
        for (int r = 0; r < h->world; r++) {
            const ctrl_block *c = h->ctrl[r];
            const int64_t v = b < 0 ? atomic_load_explicit(&c->summed, memory_order_acquire)
                                    : atomic_load_explicit(&c->posted[b], memory_order_acquire);
            if (v > step) { *who = r; *seen = v; return -1; }
            if (v < step) all = 0;
        }
        if (all) return 0;
        if (spins < 4000) { cpu_relax(); continue; }           /* ~ tens of microseconds */
        if ((spins & 63) == 0 && now_s() > deadline) return 1;
        if (spins < 4200) sched_yield();
        else nanosleep(&(struct timespec){0, 50000}, NULL);   /* a busy machine: give the core away */
    }
}

/* rank `h->rank`'s part of bucket b: [lo, hi) of its floats, 16-float aligned so no two ranks write one cache line */
static void part_of(const ft_host_sum *h, int b, int64_t *lo, int64_t *hi) {
    const int64_t n = h->bn[b], W = h->world, r = h->rank;
    *lo = r == 0 ? 0 : (n * r / W) & ~(int64_t)15;
    *hi = r + 1 == W ? n : (n * (r + 1) / W) & ~(int64_t)15;
    if (*hi < *lo) *hi = *lo;
}

static void sum_part(ft_host_sum *h, int b) {
    int64_t lo, hi;
    part_of(h, b, &lo, &hi);
    const int W = h->world;
    enum { BLOCK = 1024 };
    float acc[BLOCK] __attribute__((aligned(64)));
    for (int64_t i = h->boff[b] + lo, end = h->boff[b] + hi; i < end; i += BLOCK) {
        const int64_t m = end - i < BLOCK ? end - i : BLOCK;
        memcpy(acc, h->table[0] + i, (size_t)m * sizeof(float));
        for (int r = 1; r < W; r++) {   /* in rank order: the same bits whoever sums */
            const float *t = h->table[r] + i;
            for (int64_t k = 0; k < m; k++) acc[k] += t[k];
        }
        for (int r = 0; r < W; r++) memcpy(h->table[r] + i, acc, (size_t)m * sizeof(float));
    }
}

ft_status ft_host_sum_finish(ft_host_sum *h, int64_t step, double loss, double wait_s, int *pending,
                             double *loss_sum) {
    *pending = 0;
    for (int r = 0; r < h->world; r++)
        if (!h->ctrl[r]) return ft_error(FT_ERR_INVALID_ARGUMENT, "the host sum is not connected");
    if (step <= h->done)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "the gradient sums of step %lld were already made: a step was "
                        "repeated or one was not begun", (long long)step);
    if (step != h->step) {
        if (step < h->step) return ft_error(FT_ERR_INVALID_ARGUMENT, "step %lld after step %lld", (long long)step,
                                            (long long)h->step);
        h->step = step, h->next = 0, h->summed = 0;
        h->ctrl[h->rank]->loss[step & 1] = loss;
    }
    const double deadline = now_s() + wait_s;
    int who = 0;
    int64_t seen = 0;
    while (h->next < h->n_buckets) {
        const int w = wait_all(h, h->next, step, deadline, &who, &seen);
        if (w < 0)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "rank %d posted gradient bucket %d of step %lld while rank %d "
                            "sums step %lld: the ranks diverged", who, h->next, (long long)seen, h->rank, (long long)step);
        if (w > 0) { *pending = 1; return FT_OK; }
        sum_part(h, h->next++);
    }
    if (!h->summed) {
        atomic_store_explicit(&h->ctrl[h->rank]->summed, step, memory_order_release);
        h->summed = 1;
    }
    const int w = wait_all(h, -1, step, deadline, &who, &seen);
    if (w < 0)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "rank %d finished the gradient sums of step %lld while rank %d is at "
                        "step %lld: the ranks diverged", who, (long long)seen, h->rank, (long long)step);
    if (w > 0) { *pending = 1; return FT_OK; }
    double s = 0;
    for (int r = 0; r < h->world; r++) s += h->ctrl[r]->loss[step & 1];
    *loss_sum = s;
    h->done = step;
    return FT_OK;
}

/* ---- the C training loop's reduction (see host_sum.h) ------------------------------------------ */
static ft_status loop_begin(void *ctx, uint64_t step) {
    (void)step;
    ft_host_sum_loop *l = ctx;
    l->step++;
    l->error = FT_OK;
    return FT_OK;
}

static void loop_ready(void *ctx, size_t bucket) {
    ft_host_sum_loop *l = ctx;
    if (l->error != FT_OK) return;
    l->error = ft_host_sum_post(l->h, (int)bucket, l->step);
    if (l->error != FT_OK) l->failed = 1;
}

static ft_status loop_finish(void *ctx, double loss, double *total) {
    ft_host_sum_loop *l = ctx;
    if (l->error != FT_OK) return l->error;
    const double t0 = now_s();
    for (;;) {
        int pending = 0;
        ft_status st = ft_host_sum_finish(l->h, l->step, loss, l->slice_s, &pending, total);
        if (st != FT_OK) { l->failed = 1; return st; }
        if (!pending) return FT_OK;
        if (!l->watch) continue;
        const ft_status w = l->watch(l->watch_arg, l->step, now_s() - t0);
        if (w == FT_OK) continue;
        st = ft_host_sum_finish(l->h, l->step, loss, 0.0, &pending, total);   /* the last look */
        if (st == FT_OK && !pending) {
            if (l->dismiss) l->dismiss(l->watch_arg);
            ft_clear_error();
            return FT_OK;
        }
        return w;
    }
}

ft_train_reduction ft_host_sum_reduction(ft_host_sum_loop *loop) {
    return (ft_train_reduction){loop_begin, loop_ready, loop_finish, loop};
}
