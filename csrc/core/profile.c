/* The backend profiler (see profile.h): timing wrappers generated from the op list, per-entry
 * accumulators, CUDA events resolved at stop. */
#define _GNU_SOURCE
#include "core/profile.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/status.h"

const char *const ft_prof_kind_names[FT_PROF_KINDS] = {"gemm", "attention", "row ops", "optimizer",
                                                         "cache read", "copy"};

static atomic_int prof_on;
static _Thread_local int depth;                  /* > 0 inside a timed call on this thread */
static _Atomic uint64_t calls[FT_PE_COUNT];
static _Atomic uint64_t host_ns[FT_PE_COUNT];
static double device_s[FT_PE_COUNT];             /* under lock */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* the original tables, one per device kind (all CUDA backends share one set of functions) */
static ft_backend orig[2];
static int have_orig[2];

uint64_t ft_profile_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int ft_profile_enabled(void) { return atomic_load_explicit(&prof_on, memory_order_relaxed); }

/* ---- CUDA events ------------------------------------------------------------------------- */
typedef struct { int entry; void *start, *stop; } pending_ev;
static pending_ev *pending;
static size_t n_pending, cap_pending;
static ft_cuda_event_record_fn ev_record;
static ft_cuda_event_elapsed_fn ev_elapsed;
static ft_cuda_event_destroy_fn ev_destroy;

static int cuda_events(void) {
    if (!ev_record) {
        ev_record = (ft_cuda_event_record_fn)ft_cuda_symbol("ft_cuda_event_record");
        ev_elapsed = (ft_cuda_event_elapsed_fn)ft_cuda_symbol("ft_cuda_event_elapsed");
        ev_destroy = (ft_cuda_event_destroy_fn)ft_cuda_symbol("ft_cuda_event_destroy");
    }
    return ev_record && ev_elapsed && ev_destroy;
}

/* lock held: add the device time of pending events [0, n) and drop them */
static void resolve_locked(size_t n) {
    for (size_t k = 0; k < n; k++) {
        float ms = 0.0f;
        if (ev_elapsed(pending[k].start, pending[k].stop, &ms) == FT_OK) device_s[pending[k].entry] += ms * 1e-3;
        ev_destroy(pending[k].start);
        ev_destroy(pending[k].stop);
    }
    memmove(pending, pending + n, (n_pending - n) * sizeof *pending);
    n_pending -= n;
}

static void add_pending(int entry, void *start, void *stop) {
    pthread_mutex_lock(&lock);
    if (n_pending == cap_pending) {
        if (cap_pending >= 8192) {
            resolve_locked(n_pending / 2);   /* bound the memory: the older half is done by now */
        } else {
            size_t cap = cap_pending ? 2 * cap_pending : 256;
            pending_ev *p = realloc(pending, cap * sizeof *p);
            if (!p) {   /* no room: drop this sample rather than fail the op */
                pthread_mutex_unlock(&lock);
                ev_destroy(start);
                ev_destroy(stop);
                return;
            }
            pending = p;
            cap_pending = cap;
        }
    }
    pending[n_pending++] = (pending_ev){entry, start, stop};
    pthread_mutex_unlock(&lock);
}

/* ---- the wrappers -------------------------------------------------------------------------- */
static inline const ft_backend *orig_of(const ft_backend *be) { return &orig[be->device.kind == FT_DEVICE_CPU ? 0 : 1]; }

static inline int timed_begin(ft_backend *be, void **ev) {
    if (!atomic_load_explicit(&prof_on, memory_order_relaxed) || depth) return 0;
    depth++;
    *ev = NULL;
    if (be->device.kind != FT_DEVICE_CPU && cuda_events() && ev_record(be, ev) != FT_OK) *ev = NULL;
    return 1;
}

static inline void timed_end(ft_backend *be, int entry, uint64_t t0, void *ev0) {
    uint64_t dt = ft_profile_now() - t0;
    if (ev0) {
        void *ev1 = NULL;
        if (ev_record(be, &ev1) == FT_OK) add_pending(entry, ev0, ev1);
        else ev_destroy(ev0);
    }
    atomic_fetch_add_explicit(&host_ns[entry], dt, memory_order_relaxed);
    atomic_fetch_add_explicit(&calls[entry], 1, memory_order_relaxed);
    depth--;
}

#define FT_PROF_WRAP(name, params, args)                                                                 \
    static ft_status prof_##name params {                                                          \
        void *ev0;                                                                                  \
        if (!timed_begin(be, &ev0)) return orig_of(be)->name args;                    \
        uint64_t t0 = ft_profile_now();                                                             \
        ft_status st = orig_of(be)->name args;                                        \
        timed_end(be, FT_PE_##name, t0, ev0);                                                      \
        return st;                                                                                  \
    }
FT_BACKEND_OPS(FT_PROF_WRAP)
#undef FT_PROF_WRAP

#define FT_PROF_WRAP_COPY(name, dst, src)                                                          \
    static ft_status prof_##name(ft_backend *be, void *dst, const void *src, size_t bytes) {       \
        void *ev0;                                                                                  \
        if (!timed_begin(be, &ev0)) return orig_of(be)->name(be, dst, src, bytes);                 \
        uint64_t t0 = ft_profile_now();                                                             \
        ft_status st = orig_of(be)->name(be, dst, src, bytes);                                     \
        timed_end(be, FT_PE_##name, t0, ev0);                                                      \
        return st;                                                                                  \
    }
FT_PROF_WRAP_COPY(upload, dst, host_src)
FT_PROF_WRAP_COPY(download, host_dst, src)
FT_PROF_WRAP_COPY(copy, dst, src)
#undef FT_PROF_WRAP_COPY

/* ---- entries ------------------------------------------------------------------------------- */
static ft_prof_kind kind_of_op(const char *name) {
    if (!strncmp(name, "gemm", 4) || !strncmp(name, "linear", 6) || !strncmp(name, "pack_weight", 11))
        return FT_PROF_GEMM;   /* gemm and gemm_prec (the layers' projections) */
    if (strstr(name, "attention")) return FT_PROF_ATTENTION;
    if (!strcmp(name, "optim_step")) return FT_PROF_OPTIMIZER;
    return FT_PROF_ROWOPS;   /* every other op of the list: fused elementwise / row kernels */
}

#define FT_PROF_NAME(name, params, args) #name,
static const char *const entry_names[FT_PE_COUNT] = {FT_BACKEND_OPS(FT_PROF_NAME) "upload", "download", "copy",
                                                     "cache_gather"};
#undef FT_PROF_NAME
#define FT_PROF_ARGS_STR(name, params, args) FT_PROF_STR(args),
#define FT_PROF_STR(x) FT_PROF_STR2(x)
#define FT_PROF_STR2(x) #x
static const char *const entry_args[FT_PE_COUNT] = {FT_BACKEND_OPS(FT_PROF_ARGS_STR) "(be, dst, host_src, bytes)",
                                                    "(be, host_dst, src, bytes)", "(be, dst, src, bytes)", ""};
#undef FT_PROF_ARGS_STR

void ft_profile_stat(int i, ft_prof_stat *out) {
    memset(out, 0, sizeof *out);
    if (i < 0 || i >= FT_PE_COUNT) return;
    out->name = entry_names[i];
    out->args = entry_args[i];
    out->kind = i < FT_PE_upload ? kind_of_op(entry_names[i]) : i == FT_PE_cache_gather ? FT_PROF_CACHE_READ : FT_PROF_COPY;
    out->calls = atomic_load(&calls[i]);
    out->host_seconds = (double)atomic_load(&host_ns[i]) * 1e-9;
    pthread_mutex_lock(&lock);
    out->device_seconds = device_s[i];
    pthread_mutex_unlock(&lock);
}

/* ---- control ------------------------------------------------------------------------------- */
void ft_profile_attach(ft_backend *be) {
    if (!be) return;
    int k = be->device.kind == FT_DEVICE_CPU ? 0 : 1;
    pthread_mutex_lock(&lock);
    if (be->gemm != prof_gemm) {
        if (!have_orig[k]) {
            orig[k] = *be;
            have_orig[k] = 1;
        }
        if (be->gemm == orig[k].gemm && be->upload == orig[k].upload) {   /* the same functions */
#define FT_PROF_INSTALL(name, params, args) if (be->name) be->name = prof_##name;
            FT_BACKEND_OPS(FT_PROF_INSTALL)
#undef FT_PROF_INSTALL
            if (be->upload) be->upload = prof_upload;
            if (be->download) be->download = prof_download;
            if (be->copy) be->copy = prof_copy;
        }
    }
    pthread_mutex_unlock(&lock);
}

void ft_profile_install(void) {
    ft_profile_attach(ft_backend_cpu());
    ft_backend_set_open_hook(ft_profile_attach);
}

ft_status ft_profile_start(void) {
    ft_profile_install();
    pthread_mutex_lock(&lock);
    if (n_pending) resolve_locked(n_pending);
    for (int i = 0; i < FT_PE_COUNT; i++) {
        atomic_store(&calls[i], 0);
        atomic_store(&host_ns[i], 0);
        device_s[i] = 0.0;
    }
    pthread_mutex_unlock(&lock);
    atomic_store(&prof_on, 1);
    return FT_OK;
}

ft_status ft_profile_stop(void) {
    atomic_store(&prof_on, 0);
    pthread_mutex_lock(&lock);
    if (n_pending) resolve_locked(n_pending);
    pthread_mutex_unlock(&lock);
    return FT_OK;
}

int ft_profile_begin(void) {
    if (!atomic_load_explicit(&prof_on, memory_order_relaxed) || depth) return 0;
    depth++;
    return 1;
}

void ft_profile_end(ft_prof_entry entry, uint64_t t0) {
    atomic_fetch_add_explicit(&host_ns[entry], ft_profile_now() - t0, memory_order_relaxed);
    atomic_fetch_add_explicit(&calls[entry], 1, memory_order_relaxed);
    depth--;
}
