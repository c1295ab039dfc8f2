/* Per-op profiler of the backend table. ft_profile_attach() puts a timing wrapper, generated
 * from the op list (backend.h), in every slot of a backend table; the wrapper calls the
 * original op and, while profiling is on, adds its time to that op's accumulator: host wall
 * time (CLOCK_MONOTONIC) on the CPU; on CUDA the host time of the call plus the device time
 * between two events recorded on the backend's stream around it (resolved at ft_profile_stop).
 * Only the outermost wrapped call of a thread is timed, so nothing is counted twice. Work
 * outside the table reports itself with ft_profile_add (the cache gather). Off, a wrapper
 * costs one flag test and the indirect call. The profiler builds on the backend loader
 * (core/backend.c), which calls it only through the open hook ft_profile_install registers. */
#ifndef FT_CORE_PROFILE_H
#define FT_CORE_PROFILE_H
#include <stdint.h>

#include "backend.h"

/* what each entry counts as, for the breakdown */
typedef enum {
    FT_PROF_GEMM = 0,       /* gemm */
    FT_PROF_ATTENTION,      /* attention_forward (its batched matmuls and softmax) */
    FT_PROF_ROWOPS,         /* LayerNorm, bias+activation, pooling, dropout, loss, axis sums... */
    FT_PROF_OPTIMIZER,      /* optim_step */
    FT_PROF_CACHE_READ,     /* activation cache gather/decode */
    FT_PROF_COPY,           /* upload / download / copy (host <-> device, device <-> device) */
    FT_PROF_KINDS
} ft_prof_kind;

extern const char *const ft_prof_kind_names[FT_PROF_KINDS];

/* Entries: every op of the list, then the copy services, then work reported by the core. */
#define FT_PROF_ENTRY(name, params, args) FT_PE_##name,
typedef enum {
    FT_BACKEND_OPS(FT_PROF_ENTRY)
    FT_PE_upload, FT_PE_download, FT_PE_copy,
    FT_PE_cache_gather,
    FT_PE_COUNT
} ft_prof_entry;
#undef FT_PROF_ENTRY

typedef struct {
    const char *name;
    ft_prof_kind kind;
    const char *args;        /* the argument names the wrapper forwards (the op list's third field) */
    uint64_t calls;
    double host_seconds;     /* wall time of the calls on the calling thread */
    double device_seconds;   /* CUDA: event time on the device's stream; CPU: 0 */
} ft_prof_stat;

/* Wrap the ops of `be` (idempotent; CPU and CUDA tables). A table whose functions differ from
 * the first table of its device kind is left as it is. */
void ft_profile_attach(ft_backend *be);
/* Wrap the CPU table and every CUDA table opened from now on (ft_backend_set_open_hook). */
void ft_profile_install(void);
/* Zero the accumulators and start counting. */
ft_status ft_profile_start(void);
/* Stop counting; resolve the pending CUDA events (waits for the recorded work). */
ft_status ft_profile_stop(void);
int ft_profile_enabled(void);
/* Nanoseconds, CLOCK_MONOTONIC. */
uint64_t ft_profile_now(void);
/* Report `ns` of work of `entry` done outside the backend table (outermost calls only:
 * pass the time measured around a call that ran while ft_profile_begin() returned 1). */
int ft_profile_begin(void);
void ft_profile_end(ft_prof_entry entry, uint64_t t0);
/* Snapshot of entry i (0 <= i < FT_PE_COUNT). */
void ft_profile_stat(int i, ft_prof_stat *out);

/* Device events, exported by the CUDA library (csrc/cuda/profile.cu), looked up with dlsym. */
typedef ft_status (*ft_cuda_event_record_fn)(ft_backend *be, void **event);
typedef ft_status (*ft_cuda_event_elapsed_fn)(void *start, void *stop, float *ms);
typedef void (*ft_cuda_event_destroy_fn)(void *event);

#endif
