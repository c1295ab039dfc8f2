// fasttran's CUDA emulator: the runtime API (one device; memory, copies, streams, events, errors)
// and the settings. Device memory is host memory handed out by this file, so copies and kernels
// can check that a pointer is what the call says it is.
#include <atomic>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <deque>
#include <map>
#include <set>
#include <string>

#include "emu_internal.h"

namespace ftemu {

// ---- settings --------------------------------------------------------------------------------------
namespace {
settings g_settings;
char g_settings_error[256];
pthread_once_t g_settings_once = PTHREAD_ONCE_INIT;

size_t parse_bytes(const char *s, bool *ok) {
    char *end = nullptr;
    errno = 0;
    double v = strtod(s, &end);
    double mul = 1;
    if (end && *end) {
        switch (*end) {
        case 'k': case 'K': mul = 1024.0; break;
        case 'm': case 'M': mul = 1024.0 * 1024; break;
        case 'g': case 'G': mul = 1024.0 * 1024 * 1024; break;
        default: *ok = false; return 0;
        }
        end++;
        if (*end == 'i' || *end == 'I') end++;
        if (*end == 'b' || *end == 'B') end++;
    }
    *ok = errno == 0 && end && !*end && v > 0;
    return (size_t)(v * mul);
}

void read_settings() {
    g_settings.device_memory = (size_t)8 << 30;
    if (const char *s = getenv("FASTTRAN_EMU_SEED")) {
        if (!strcmp(s, "random")) {
            g_settings.seed = (unsigned long long)time(nullptr) ^ ((unsigned long long)getpid() << 20);
            fprintf(stderr, "fasttran CUDA emulator: FASTTRAN_EMU_SEED=random -> %llu\n", g_settings.seed);
        } else if (*s) {
            char *end = nullptr;
            g_settings.seed = strtoull(s, &end, 0);
            if (!end || *end)
                snprintf(g_settings_error, sizeof g_settings_error,
                         "FASTTRAN_EMU_SEED=%s is not an integer (or 'random')", s);
        }
    }
    if (const char *s = getenv("FASTTRAN_EMU_CHECK")) {
        std::string all(s);
        size_t pos = 0;
        while (pos <= all.size()) {
            size_t comma = all.find(',', pos);
            std::string w = all.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
            if (w == "barriers") g_settings.check_barriers = true;
            else if (w == "memory") g_settings.check_memory = true;
            else if (w == "all") g_settings.check_barriers = g_settings.check_memory = true;
            else if (!w.empty() && w != "0" && w != "none")
                snprintf(g_settings_error, sizeof g_settings_error,
                         "FASTTRAN_EMU_CHECK: unknown mode '%s' (known: barriers, memory, all)", w.c_str());
            if (comma == std::string::npos) break;
            pos = comma + 1;
        }
    }
    if (const char *s = getenv("FASTTRAN_EMU_MEMORY")) {
        bool ok = true;
        size_t v = parse_bytes(s, &ok);
        if (ok) g_settings.device_memory = v;
        else snprintf(g_settings_error, sizeof g_settings_error,
                      "FASTTRAN_EMU_MEMORY=%s is not a size (e.g. 4G, 512M)", s);
    }
}
}  // namespace

const settings &config() {
    pthread_once(&g_settings_once, read_settings);
    return g_settings;
}

// ---- errors ------------------------------------------------------------------------------------------
namespace {
thread_local cudaError_t g_pending = cudaSuccess;
thread_local cudaError_t g_msg_code = cudaSuccess;
thread_local char g_msg[2048];
}  // namespace

cudaError_t vfail(cudaError_t code, const char *fmt, va_list ap) {
    vsnprintf(g_msg, sizeof g_msg, fmt, ap);
    g_msg_code = code;
    g_pending = code;
    // what only a broken kernel does is printed as well: the caller may not look
    if (code == cudaErrorIllegalAddress || code == cudaErrorLaunchFailure)
        fprintf(stderr, "fasttran CUDA emulator: %s\n", g_msg);
    return code;
}

cudaError_t fail(cudaError_t code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(code, fmt, ap);
    va_end(ap);
    return code;
}

cudaError_t pending_error(bool clear) {
    cudaError_t e = g_pending;
    if (clear) g_pending = cudaSuccess;
    return e;
}

// ---- device memory -------------------------------------------------------------------------------------
namespace {
struct allocation {
    char *ptr;          // what the caller got
    size_t bytes;       // what the caller asked for
    char *map;          // the mapping (== ptr without memory checking)
    size_t map_bytes;   // readable part of the mapping (the guard page follows in memory-check mode)
    bool freed;         // quarantined after cudaFree (memory-check mode): PROT_NONE
};
pthread_mutex_t g_mem_lock = PTHREAD_MUTEX_INITIALIZER;
std::map<uintptr_t, allocation> g_allocs;   // by mapping start
std::deque<uintptr_t> g_quarantine;
size_t g_quarantine_bytes, g_used;
std::set<void *> g_host_allocs;
constexpr size_t QUARANTINE_LIMIT = (size_t)1 << 30;

size_t page() {
    static size_t p = (size_t)sysconf(_SC_PAGESIZE);
    return p;
}

// the allocation whose mapping (guard page included) contains p; caller holds the lock
const allocation *find_mapping(uintptr_t p) {
    auto it = g_allocs.upper_bound(p);
    if (it == g_allocs.begin()) return nullptr;
    --it;
    const allocation &a = it->second;
    const size_t span = a.map_bytes + (config().check_memory ? page() : 0);
    return p < (uintptr_t)a.map + span ? &a : nullptr;
}

void release_mapping(const allocation &a) {
    if (config().check_memory) munmap(a.map, a.map_bytes + page());
    else free(a.map);
}
}  // namespace

bool is_device_range(const void *p, size_t bytes) {
    pthread_mutex_lock(&g_mem_lock);
    const allocation *a = find_mapping((uintptr_t)p);
    bool ok = a && !a->freed && (const char *)p >= a->ptr && (const char *)p + bytes <= a->ptr + a->bytes;
    pthread_mutex_unlock(&g_mem_lock);
    return ok;
}

void describe_address(const void *addr, char *out, size_t len) {
    const uintptr_t p = (uintptr_t)addr;
    pthread_mutex_lock(&g_mem_lock);
    const allocation *a = find_mapping(p);
    if (!a) {
        snprintf(out, len, "not device memory (a host, null or wild pointer, or memory freed long ago)");
    } else {
        const uintptr_t s = (uintptr_t)a->ptr, e = s + a->bytes;
        if (a->freed)
            snprintf(out, len, "inside a device allocation of %zu bytes at %p that was freed (use after cudaFree)",
                     a->bytes, (void *)a->ptr);
        else if (p >= e)
            snprintf(out, len, "%zu bytes past the end of a device allocation of %zu bytes at %p",
                     (size_t)(p - e), a->bytes, (void *)a->ptr);
        else if (p < s)
            snprintf(out, len, "%zu bytes before the start of a device allocation of %zu bytes at %p",
                     (size_t)(s - p), a->bytes, (void *)a->ptr);
        else
            snprintf(out, len, "at offset %zu of a device allocation of %zu bytes at %p", (size_t)(p - s), a->bytes,
                     (void *)a->ptr);
    }
    pthread_mutex_unlock(&g_mem_lock);
}

bool check_canaries(const char *kernel) {
    bool ok = true;
    pthread_mutex_lock(&g_mem_lock);
    for (auto &kv : g_allocs) {
        const allocation &a = kv.second;
        if (a.freed) continue;
        const unsigned char *head = (const unsigned char *)a.map, *tail = (const unsigned char *)a.ptr + a.bytes;
        const unsigned char *end = (const unsigned char *)a.map + a.map_bytes;
        const unsigned char *bad = nullptr;
        for (const unsigned char *q = head; q < (const unsigned char *)a.ptr && !bad; q++) if (*q != 0xFF) bad = q;
        for (const unsigned char *q = tail; q < end && !bad; q++) if (*q != 0xFF) bad = q;
        if (bad) {
            const long off = bad >= tail ? (long)(bad - tail) : -(long)((const unsigned char *)a.ptr - bad);
            pthread_mutex_unlock(&g_mem_lock);
            fail(cudaErrorIllegalAddress,
                 "kernel %s wrote outside a device allocation of %zu bytes at %p: byte %s%ld %s its %s was changed",
                 kernel, a.bytes, (void *)a.ptr, off >= 0 ? "+" : "", off, off >= 0 ? "after" : "before",
                 off >= 0 ? "end" : "start");
            pthread_mutex_lock(&g_mem_lock);
            // re-arm the canary so one bug is reported once
            memset((void *)(bad >= tail ? tail : head), 0xFF, bad >= tail ? (size_t)(end - tail)
                                                                         : (size_t)((const unsigned char *)a.ptr - head));
            ok = false;
            break;
        }
    }
    pthread_mutex_unlock(&g_mem_lock);
    return ok;
}

// ---- faults inside kernels -------------------------------------------------------------------------------
namespace {
struct sigaction g_old_segv, g_old_bus;
pthread_once_t g_fault_once = PTHREAD_ONCE_INIT;

void chain(int sig, siginfo_t *si, void *uc) {
    struct sigaction *old = sig == SIGSEGV ? &g_old_segv : &g_old_bus;
    if ((old->sa_flags & SA_SIGINFO) && old->sa_sigaction) { old->sa_sigaction(sig, si, uc); return; }
    if (old->sa_handler != SIG_DFL && old->sa_handler != SIG_IGN) { old->sa_handler(sig); return; }
    signal(sig, SIG_DFL);   // the faulting instruction runs again and takes the default action
}

void on_fault(int sig, siginfo_t *si, void *uc) {
    bool write = false;
#if defined(__x86_64__) && defined(REG_ERR)
    write = (static_cast<ucontext_t *>(uc)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#endif
    if (!kernel_fault(si->si_addr, write)) chain(sig, si, uc);
}

void install() {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
}
}  // namespace

void install_fault_handler() {
#if !defined(__SANITIZE_ADDRESS__)   // AddressSanitizer reports faults itself
    pthread_once(&g_fault_once, install);
#endif
}

// ---- streams and events -------------------------------------------------------------------------------------
namespace {
std::set<cudaStream_t> g_streams;   // guarded by g_mem_lock
}
struct ftemu_event { long long t; bool recorded; unsigned flags; };

bool stream_valid(cudaStream_t s) {
    if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return true;
    pthread_mutex_lock(&g_mem_lock);
    bool ok = g_streams.count(s) != 0;
    pthread_mutex_unlock(&g_mem_lock);
    return ok;
}

}  // namespace ftemu

using namespace ftemu;

#define FTEMU_STREAM_OK(s, what) \
    if (!stream_valid(s)) return fail(cudaErrorInvalidResourceHandle, "%s on a stream that does not exist (%p)", what, (void *)(s))

// Counters of the runtime calls that cost a GPU time or memory (tests count what a training step
// does: device allocations, pinned allocations, copies each way). ftemu_counters() reads them.
namespace ftemu {
enum { C_MALLOC, C_FREE, C_HOST_ALLOC, C_H2D, C_H2D_BYTES, C_D2H, C_D2H_BYTES, C_D2D, C_STREAM_SYNC, C_EVENT_RECORD,
       C_STREAM_WAIT, C_EVENT_SYNC, C_HOST_FREE, C_EVENT_CREATE, C_COUNT };
static std::atomic<long long> g_counters[C_COUNT];
static void count_copy(cudaMemcpyKind kind, size_t bytes) {
    if (kind == cudaMemcpyHostToDevice) { g_counters[C_H2D]++; g_counters[C_H2D_BYTES] += (long long)bytes; }
    else if (kind == cudaMemcpyDeviceToHost) { g_counters[C_D2H]++; g_counters[C_D2H_BYTES] += (long long)bytes; }
    else if (kind == cudaMemcpyDeviceToDevice) g_counters[C_D2D]++;
}
}  // namespace ftemu

extern "C" {

// out[0..13] = cudaMalloc calls, cudaFree calls, pinned host allocations, host-to-device copies and
// bytes, device-to-host copies and bytes, device-to-device copies, stream synchronisations, event
// records, stream waits for events, event synchronisations, pinned host frees, events created, since
// the library loaded (streams run synchronously here: these counts show which orderings code asks
// for, not that they hold)
__attribute__((visibility("default"))) void ftemu_counters(long long *out) {
    for (int i = 0; i < C_COUNT; i++) out[i] = g_counters[i].load();
}

// ---- device ---------------------------------------------------------------------------------------------------
cudaError_t cudaGetDeviceCount(int *count) {
    config();
    if (g_settings_error[0]) { *count = 0; return fail(cudaErrorInitializationError, "%s", g_settings_error); }
    *count = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *device) { *device = 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int device) {
    if (device != 0) return fail(cudaErrorInvalidDevice, "cudaSetDevice(%d): the emulator has one device, 0", device);
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device) {
    if (device != 0) return fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties(%d): the emulator has one device", device);
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "fasttran CUDA emulator (runs on the CPU; test infrastructure, not a GPU)");
    p->totalGlobalMem = config().device_memory;
    p->sharedMemPerBlock = 48 * 1024;
    p->sharedMemPerBlockOptin = 227 * 1024;
    p->regsPerBlock = 65536;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 0x7fffffff;
    p->maxGridSize[1] = p->maxGridSize[2] = 65535;
    p->major = 8;
    p->minor = 0;
    p->multiProcessorCount = 4;
    p->l2CacheSize = 4 << 20;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    cudaDeviceProp p;
    cudaError_t e = cudaGetDeviceProperties(&p, device);
    if (e != cudaSuccess) return e;
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)p.sharedMemPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)p.sharedMemPerBlockOptin; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrL2CacheSize: *value = p.l2CacheSize; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    default: return fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute %d is not emulated", (int)attr);
    }
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return pending_error(false); }
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }
cudaError_t cudaDriverGetVersion(int *v) { *v = CUDART_VERSION; return cudaSuccess; }
cudaError_t cudaRuntimeGetVersion(int *v) { *v = CUDART_VERSION; return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    pthread_mutex_lock(&g_mem_lock);
    const size_t total = config().device_memory, used = g_used;
    pthread_mutex_unlock(&g_mem_lock);
    *total_bytes = total;
    *free_bytes = used < total ? total - used : 0;
    return cudaSuccess;
}

// ---- errors --------------------------------------------------------------------------------------------------
cudaError_t cudaGetLastError(void) { return pending_error(true); }
cudaError_t cudaPeekAtLastError(void) { return pending_error(false); }

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
    }
}

const char *cudaGetErrorString(cudaError_t e) {
    if (e == g_msg_code && g_msg[0]) return g_msg;   // the emulator's own account of the last failure
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    default: return cudaGetErrorName(e);
    }
}

// ---- memory -------------------------------------------------------------------------------------------------
cudaError_t cudaMalloc(void **out, size_t bytes) {
    *out = nullptr;
    g_counters[C_MALLOC]++;
    const settings &cfg = config();
    pthread_mutex_lock(&g_mem_lock);
    const size_t used = g_used;
    pthread_mutex_unlock(&g_mem_lock);
    if (bytes > cfg.device_memory || used > cfg.device_memory - bytes)
        return fail(cudaErrorMemoryAllocation, "out of memory: %zu bytes requested, %zu of the emulated device's %zu "
                    "in use (FASTTRAN_EMU_MEMORY sets its size)", bytes, used, cfg.device_memory);
    allocation a{};
    a.bytes = bytes;
    if (cfg.check_memory) {
        // the allocation ends right before an inaccessible page; its start is 32-byte aligned (what
        // WMMA and 16-byte vector loads need of a cudaMalloc pointer, which a GPU aligns to 256;
        // the up to 31 bytes between the end and the page are checked after every launch)
        const size_t pg = page(), data = (bytes + 32 + pg - 1) / pg * pg;
        void *m = mmap(nullptr, data + pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return fail(cudaErrorMemoryAllocation, "out of memory: mmap of %zu bytes failed", data + pg);
        a.map = static_cast<char *>(m);
        a.map_bytes = data;
        mprotect(a.map + data, pg, PROT_NONE);
        a.ptr = a.map + ((data - bytes) & ~(size_t)31);
        memset(a.map, 0xFF, data);
    } else {
        const size_t rounded = (bytes + 255) / 256 * 256;
        a.map = static_cast<char *>(aligned_alloc(256, rounded ? rounded : 256));
        if (!a.map) return fail(cudaErrorMemoryAllocation, "out of memory: %zu bytes of host memory", bytes);
        a.map_bytes = rounded ? rounded : 256;
        a.ptr = a.map;
        memset(a.map, 0xFF, a.map_bytes);   // uninitialised device memory reads as NaN / -1
    }
    pthread_mutex_lock(&g_mem_lock);
    g_allocs[(uintptr_t)a.map] = a;
    g_used += bytes;
    pthread_mutex_unlock(&g_mem_lock);
    *out = a.ptr;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    if (p) g_counters[C_FREE]++;
    if (!p) return cudaSuccess;
    pthread_mutex_lock(&g_mem_lock);
    const allocation *found = find_mapping((uintptr_t)p);
    if (!found || found->ptr != p || found->freed) {
        const bool twice = found && found->freed && found->ptr == p;
        pthread_mutex_unlock(&g_mem_lock);
        return fail(cudaErrorInvalidDevicePointer, twice ? "cudaFree(%p): freed twice"
                                                         : "cudaFree(%p): not the start of a device allocation", p);
    }
    allocation a = *found;
    g_used -= a.bytes;
    if (config().check_memory) {
        // quarantined: a later access faults as a use after free
        mprotect(a.map, a.map_bytes, PROT_NONE);
        g_allocs[(uintptr_t)a.map].freed = true;
        g_quarantine.push_back((uintptr_t)a.map);
        g_quarantine_bytes += a.map_bytes;
        while (g_quarantine_bytes > QUARANTINE_LIMIT && !g_quarantine.empty()) {
            auto it = g_allocs.find(g_quarantine.front());
            g_quarantine.pop_front();
            if (it == g_allocs.end()) continue;
            g_quarantine_bytes -= it->second.map_bytes;
            release_mapping(it->second);
            g_allocs.erase(it);
        }
    } else {
        g_allocs.erase((uintptr_t)a.map);
        release_mapping(a);
    }
    pthread_mutex_unlock(&g_mem_lock);
    return cudaSuccess;
}

cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s) {
    FTEMU_STREAM_OK(s, "cudaMallocAsync");
    return cudaMalloc(p, bytes);
}
cudaError_t cudaFreeAsync(void *p, cudaStream_t s) {
    FTEMU_STREAM_OK(s, "cudaFreeAsync");
    return cudaFree(p);
}

cudaError_t cudaMallocHost(void **p, size_t bytes) {
    g_counters[C_HOST_ALLOC]++;
    *p = aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    if (!*p) return fail(cudaErrorMemoryAllocation, "cudaMallocHost: cannot allocate %zu bytes", bytes);
    pthread_mutex_lock(&g_mem_lock);
    g_host_allocs.insert(*p);
    pthread_mutex_unlock(&g_mem_lock);
    return cudaSuccess;
}
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned int) { return cudaMallocHost(p, bytes); }
cudaError_t cudaFreeHost(void *p) {
    if (p) g_counters[C_HOST_FREE]++;
    if (!p) return cudaSuccess;
    pthread_mutex_lock(&g_mem_lock);
    const bool known = g_host_allocs.erase(p) != 0;
    pthread_mutex_unlock(&g_mem_lock);
    if (!known) return fail(cudaErrorInvalidValue, "cudaFreeHost(%p): not memory from cudaMallocHost", p);
    free(p);
    return cudaSuccess;
}
cudaError_t cudaHostRegister(void *, size_t, unsigned int) { return cudaSuccess; }
cudaError_t cudaHostUnregister(void *) { return cudaSuccess; }

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *attr, const void *p) {
    memset(attr, 0, sizeof *attr);
    if (is_device_range(p, 1)) {
        attr->type = cudaMemoryTypeDevice;
        attr->devicePointer = const_cast<void *>(p);
    } else {
        pthread_mutex_lock(&g_mem_lock);
        bool host = g_host_allocs.count(const_cast<void *>(p)) != 0;
        pthread_mutex_unlock(&g_mem_lock);
        attr->type = host ? cudaMemoryTypeHost : cudaMemoryTypeUnregistered;
        attr->hostPointer = const_cast<void *>(p);
    }
    return cudaSuccess;
}

// ---- copies: direction checked against the allocations ---------------------------------------------------------
static cudaError_t check_copy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, const char *what) {
    if (!bytes) return cudaSuccess;
    const bool dd = is_device_range(dst, bytes), sd = is_device_range(src, bytes);
    char where[256];
    switch (kind) {
    case cudaMemcpyHostToDevice:
        if (!dd) { describe_address(dst, where, sizeof where);
                   return fail(cudaErrorInvalidValue, "%s HostToDevice of %zu bytes: the destination %p is %s", what, bytes, dst, where); }
        if (sd) return fail(cudaErrorInvalidValue, "%s HostToDevice: the source %p is device memory", what, src);
        break;
    case cudaMemcpyDeviceToHost:
        if (!sd) { describe_address(src, where, sizeof where);
                   return fail(cudaErrorInvalidValue, "%s DeviceToHost of %zu bytes: the source %p is %s", what, bytes, src, where); }
        if (dd) return fail(cudaErrorInvalidValue, "%s DeviceToHost: the destination %p is device memory", what, dst);
        break;
    case cudaMemcpyDeviceToDevice:
        if (!dd || !sd) { describe_address(dd ? src : dst, where, sizeof where);
                          return fail(cudaErrorInvalidValue, "%s DeviceToDevice of %zu bytes: the %s %p is %s", what, bytes,
                                      dd ? "source" : "destination", dd ? src : dst, where); }
        break;
    case cudaMemcpyHostToHost:
    case cudaMemcpyDefault: break;
    default: return fail(cudaErrorInvalidMemcpyDirection, "%s: unknown copy kind %d", what, (int)kind);
    }
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    cudaError_t e = check_copy(dst, src, bytes, kind, "cudaMemcpy");
    if (e != cudaSuccess) return e;
    count_copy(kind, bytes);
    if (bytes) memmove(dst, src, bytes);
    return pending_error(false);   // a synchronising call reports an earlier asynchronous failure
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
    FTEMU_STREAM_OK(s, "cudaMemcpyAsync");
    cudaError_t e = check_copy(dst, src, bytes, kind, "cudaMemcpyAsync");
    if (e != cudaSuccess) return e;
    count_copy(kind, bytes);
    if (bytes) memmove(dst, src, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t s) {
    FTEMU_STREAM_OK(s, "cudaMemcpy2DAsync");
    if (width > dpitch || width > spitch) return fail(cudaErrorInvalidValue, "cudaMemcpy2DAsync: width exceeds a pitch");
    for (size_t r = 0; r < height; r++) {
        cudaError_t e = check_copy((char *)dst + r * dpitch, (const char *)src + r * spitch, width, kind, "cudaMemcpy2DAsync");
        if (e != cudaSuccess) return e;
        memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    }
    return cudaSuccess;
}
cudaError_t cudaMemset(void *dst, int value, size_t bytes) {
    if (bytes && !is_device_range(dst, bytes)) {
        char where[256];
        describe_address(dst, where, sizeof where);
        return fail(cudaErrorInvalidValue, "cudaMemset of %zu bytes at %p: %s", bytes, dst, where);
    }
    if (bytes) memset(dst, value, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t s) {
    FTEMU_STREAM_OK(s, "cudaMemsetAsync");
    return cudaMemset(dst, value, bytes);
}

// ---- streams ---------------------------------------------------------------------------------------------------
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int) {
    *s = reinterpret_cast<cudaStream_t>(malloc(16));
    if (!*s) return fail(cudaErrorMemoryAllocation, "cudaStreamCreate: out of memory");
    pthread_mutex_lock(&g_mem_lock);
    g_streams.insert(*s);
    pthread_mutex_unlock(&g_mem_lock);
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    pthread_mutex_lock(&g_mem_lock);
    const bool known = g_streams.erase(s) != 0;
    pthread_mutex_unlock(&g_mem_lock);
    if (!known) return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy(%p): not a stream", (void *)s);
    free(s);
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    g_counters[C_STREAM_SYNC]++;
    FTEMU_STREAM_OK(s, "cudaStreamSynchronize");
    return pending_error(false);
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
    FTEMU_STREAM_OK(s, "cudaStreamQuery");
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
    g_counters[C_STREAM_WAIT]++;
    FTEMU_STREAM_OK(s, "cudaStreamWaitEvent");
    if (!e) return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: null event");
    return cudaSuccess;
}

// ---- events (host time) -----------------------------------------------------------------------------------------
cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
    ftemu_event *ev = static_cast<ftemu_event *>(calloc(1, sizeof(ftemu_event)));
    if (!ev) return fail(cudaErrorMemoryAllocation, "cudaEventCreate: out of memory");
    g_counters[C_EVENT_CREATE]++;
    ev->flags = flags;
    *e = reinterpret_cast<cudaEvent_t>(ev);
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { free(e); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    g_counters[C_EVENT_RECORD]++;
    FTEMU_STREAM_OK(s, "cudaEventRecord");
    ftemu_event *ev = reinterpret_cast<ftemu_event *>(e);
    ev->t = clock64();
    ev->recorded = true;
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) {
    g_counters[C_EVENT_SYNC]++;
    return pending_error(false);
}
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    const ftemu_event *x = reinterpret_cast<ftemu_event *>(a), *y = reinterpret_cast<ftemu_event *>(b);
    if (!x->recorded || !y->recorded || (x->flags & cudaEventDisableTiming) || (y->flags & cudaEventDisableTiming))
        return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: an event was not recorded or has no timing");
    *ms = (float)((double)(y->t - x->t) / 1e6);
    return cudaSuccess;
}

}  // extern "C"
