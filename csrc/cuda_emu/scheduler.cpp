// fasttran's CUDA emulator: kernel execution. The blocks of a grid run one after another; the
// threads of a block are coroutines on the calling OS thread, switched at barriers and warp
// operations (see ftemu.h for the model and the checking modes).
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <string>
#include <vector>

#include "emu_check.h"
#include "emu_internal.h"

#if defined(__SANITIZE_ADDRESS__)
#define FTEMU_ASAN 1
extern "C" void __sanitizer_start_switch_fiber(void **fake_stack_save, const void *bottom, size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void *fake_stack_save, const void **bottom_old, size_t *size_old);
extern "C" void __asan_unpoison_memory_region(void const volatile *addr, size_t size);
#else
#define FTEMU_ASAN 0
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace ftemu {

thread_local thread_builtins *g_thread;
thread_local block_builtins *g_block;

namespace {

constexpr unsigned MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 256 * 1024;   // per emulated thread; kernels use little stack
constexpr size_t MAX_DYNAMIC_SHARED = 227 * 1024;
constexpr size_t DEFAULT_DYNAMIC_SHARED = 48 * 1024;

// ---- contexts: a hand-written switch on x86-64 (callee-saved registers, MXCSR, x87 control
// word), ucontext elsewhere ------------------------------------------------------------------------
#if defined(__x86_64__)
struct context { void *sp; };
extern "C" void ftemu_switch(void **save_sp, void *load_sp);
extern "C" void ftemu_trampoline();
__asm__(
    ".text\n"
    ".globl ftemu_switch\n"
    ".hidden ftemu_switch\n"
    ".type ftemu_switch,@function\n"
    "ftemu_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    subq $8, %rsp\n"
    "    stmxcsr (%rsp)\n"
    "    fnstcw 4(%rsp)\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    ldmxcsr (%rsp)\n"
    "    fldcw 4(%rsp)\n"
    "    addq $8, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size ftemu_switch, .-ftemu_switch\n"
    // first entry of a coroutine: r12 = function, r13 = its argument
    ".globl ftemu_trampoline\n"
    ".hidden ftemu_trampoline\n"
    ".type ftemu_trampoline,@function\n"
    "ftemu_trampoline:\n"
    "    movq %r13, %rdi\n"
    "    andq $-16, %rsp\n"
    "    callq *%r12\n"
    "    ud2\n"
    ".size ftemu_trampoline, .-ftemu_trampoline\n");

void context_init(context *c, char *stack, size_t bytes, void (*fn)(void *), void *arg) {
    uint64_t *sp = reinterpret_cast<uint64_t *>(stack + bytes);
    *--sp = 0;                                                   // alignment slot
    *--sp = reinterpret_cast<uint64_t>(&ftemu_trampoline);       // return address of ftemu_switch
    *--sp = 0;                                                   // rbp
    *--sp = 0;                                                   // rbx
    *--sp = reinterpret_cast<uint64_t>(fn);                      // r12
    *--sp = reinterpret_cast<uint64_t>(arg);                     // r13
    *--sp = 0;                                                   // r14
    *--sp = 0;                                                   // r15
    uint32_t mxcsr;
    uint16_t fpcw;
    __asm__ __volatile__("stmxcsr %0" : "=m"(mxcsr));
    __asm__ __volatile__("fnstcw %0" : "=m"(fpcw));
    --sp;
    memcpy(sp, &mxcsr, 4);
    memcpy(reinterpret_cast<char *>(sp) + 4, &fpcw, 2);
    c->sp = sp;
}
inline void context_switch(context *from, context *to) { ftemu_switch(&from->sp, to->sp); }
#else
struct context { ucontext_t uc; };
void (*g_entry_fn)(void *);
void entry_thunk(unsigned hi, unsigned lo, unsigned fhi, unsigned flo) {
    void *arg = reinterpret_cast<void *>(((uintptr_t)hi << 32) | lo);
    auto fn = reinterpret_cast<void (*)(void *)>(((uintptr_t)fhi << 32) | flo);
    fn(arg);
    abort();
}
void context_init(context *c, char *stack, size_t bytes, void (*fn)(void *), void *arg) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = bytes;
    c->uc.uc_link = nullptr;
    uintptr_t a = reinterpret_cast<uintptr_t>(arg), f = reinterpret_cast<uintptr_t>(fn);
    makecontext(&c->uc, reinterpret_cast<void (*)()>(entry_thunk), 4, (unsigned)(a >> 32), (unsigned)a,
                (unsigned)(f >> 32), (unsigned)f);
}
inline void context_switch(context *from, context *to) { swapcontext(&from->uc, &to->uc); }
#endif

enum tstate : uint8_t { T_RUNNABLE, T_RUNNING, T_SYNC, T_WARP, T_EXITED };

struct thread_state : thread_builtins {
    context ctx;
    tstate state;
    // __syncthreads*
    int sync_kind, sync_pred, sync_result;
    // warp operation
    warp_op wop;
    unsigned wmask;
    uint64_t wvalue, wresult;
    int warg, wwidth;
    // where it waits
    const char *file;
    int line;
#if FTEMU_ASAN
    void *fake_stack;
#endif
};

struct block_state : block_builtins {
    unsigned n, nlive, nsync;
    uint64_t runnable[MAX_THREADS / 64];
    context sched;
    const char *kernel;
    thread_body body;
    void *body_ctx;
    bool failed;
    uint64_t rng;
    thread_state *threads;
};

// per OS thread: stacks, thread states, dynamic shared memory, the fault escape
struct os_thread_resources {
    char *stacks = nullptr;          // MAX_THREADS x (guard page + STACK_BYTES)
    size_t stride = 0;
    thread_state *threads = nullptr;
    std::vector<unsigned char> dynamic_shared;
    char *alt_stack = nullptr;
    ~os_thread_resources() {
        if (stacks) munmap(stacks, stride * MAX_THREADS);
        free(threads);
        if (alt_stack) {
            stack_t ss{};
            ss.ss_flags = SS_DISABLE;
            sigaltstack(&ss, nullptr);
            free(alt_stack);
        }
    }
};
thread_local os_thread_resources g_res;
thread_local sigjmp_buf g_fault_jmp;
thread_local volatile sig_atomic_t g_in_kernel;
thread_local context *g_sched_ctx;
#if FTEMU_ASAN
thread_local const void *g_sched_stack_bottom;
thread_local size_t g_sched_stack_size;
thread_local void *g_sched_fake;
#endif

size_t page_size() {
    static size_t p = (size_t)sysconf(_SC_PAGESIZE);
    return p;
}

bool ensure_resources() {
    os_thread_resources &r = g_res;
    if (r.stacks) return true;
    r.stride = page_size() + STACK_BYTES;
    void *m = mmap(nullptr, r.stride * MAX_THREADS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED) return false;
    r.stacks = static_cast<char *>(m);
    for (unsigned k = 0; k < MAX_THREADS; k++) mprotect(r.stacks + k * r.stride, page_size(), PROT_NONE);
    r.threads = static_cast<thread_state *>(calloc(MAX_THREADS, sizeof(thread_state)));
    if (!r.threads) return false;
#if !FTEMU_ASAN
    // faults on a coroutine stack (stack overflow included) are handled on this stack
    const size_t alt = 64 * 1024;
    r.alt_stack = static_cast<char *>(malloc(alt));
    if (r.alt_stack) {
        stack_t ss{};
        ss.ss_sp = r.alt_stack;
        ss.ss_size = alt;
        sigaltstack(&ss, nullptr);
    }
#endif
    return true;
}

inline uint64_t splitmix(uint64_t &s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

inline block_state *blk() { return static_cast<block_state *>(g_block); }
inline thread_state *cur() { return static_cast<thread_state *>(g_thread); }

inline void set_runnable(block_state *b, thread_state *t) {
    t->state = T_RUNNABLE;
    b->runnable[t->linear >> 6] |= 1ull << (t->linear & 63);
}

const char *kind_name(int kind) {
    static const char *names[] = {"__syncthreads", "__syncthreads_count", "__syncthreads_and", "__syncthreads_or"};
    return names[kind];
}
const char *wop_name(warp_op op) {
    static const char *names[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                  "__ballot_sync", "__any_sync", "__all_sync", "__reduce_add_sync",
                                  "__reduce_min_sync", "__reduce_max_sync", "__reduce_and_sync", "__reduce_or_sync",
                                  "__reduce_xor_sync", "__reduce_min_sync", "__reduce_max_sync", "a wmma operation"};
    return names[op];
}
const char *base_name(const char *file) {
    const char *s = file ? strrchr(file, '/') : nullptr;
    return s ? s + 1 : (file ? file : "?");
}

std::string thread_str(const block_state *b, unsigned linear) {
    const thread_state &t = b->threads[linear];
    char buf[64];
    if (b->block_dim.y == 1 && b->block_dim.z == 1) snprintf(buf, sizeof buf, "%u", t.thread_idx.x);
    else snprintf(buf, sizeof buf, "(%u,%u,%u)", t.thread_idx.x, t.thread_idx.y, t.thread_idx.z);
    return buf;
}

std::string block_str(const block_state *b) {
    char buf[96];
    snprintf(buf, sizeof buf, "block (%u,%u,%u) of grid (%u,%u,%u), %u threads", b->block_idx.x, b->block_idx.y,
             b->block_idx.z, b->grid_dim.x, b->grid_dim.y, b->grid_dim.z, b->n);
    return buf;
}

// where every thread of the block is, grouped over runs of threads in the same place
std::string where_threads_are(const block_state *b) {
    std::string out;
    auto place = [&](unsigned k) {
        const thread_state &t = b->threads[k];
        char buf[160];
        switch (t.state) {
        case T_EXITED: return std::string("returned");
        case T_SYNC:
            snprintf(buf, sizeof buf, "waiting in %s at %s:%d", kind_name(t.sync_kind), base_name(t.file), t.line);
            return std::string(buf);
        case T_WARP:
            snprintf(buf, sizeof buf, "waiting in %s (mask 0x%08x) at %s:%d", wop_name(t.wop), t.wmask, base_name(t.file),
                     t.line);
            return std::string(buf);
        default: return std::string("runnable");
        }
    };
    unsigned k = 0;
    while (k < b->n) {
        std::string p = place(k);
        unsigned j = k + 1;
        while (j < b->n && place(j) == p) j++;
        if (!out.empty()) out += "; ";
        out += "thread" + std::string(j - k > 1 ? "s " : " ") + thread_str(b, k) +
               (j - k > 1 ? "-" + thread_str(b, j - 1) : std::string()) + " " + p;
        k = j;
    }
    return out;
}

[[noreturn]] void back_to_scheduler_final();

// abandon the block: the scheduler sees `failed` and stops the launch
void block_fail(block_state *b, cudaError_t code, const std::string &msg) {
    if (!b->failed) fail(code, "kernel %s: %s: %s", b->kernel, block_str(b).c_str(), msg.c_str());
    b->failed = true;
}

// switch from the running emulated thread back to the scheduler; returns when resumed
void yield_to_scheduler() {
    thread_state *t = cur();
#if FTEMU_ASAN
    __sanitizer_start_switch_fiber(&t->fake_stack, g_sched_stack_bottom, g_sched_stack_size);
#endif
    context_switch(&t->ctx, g_sched_ctx);
#if FTEMU_ASAN
    __sanitizer_finish_switch_fiber(t->fake_stack, nullptr, nullptr);
#endif
}

[[noreturn]] void back_to_scheduler_final() {
    thread_state *t = cur();
#if FTEMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, g_sched_stack_bottom, g_sched_stack_size);
#endif
    context_switch(&t->ctx, g_sched_ctx);
    abort();   // an exited thread is never resumed
}

void try_complete_warp(block_state *b, thread_state *arriving);

void thread_exit(block_state *b, thread_state *t) {
    t->state = T_EXITED;
    b->nlive--;
    // lanes of this warp waiting for this one: their operation may be complete now
    const unsigned base = t->warp * 32;
    for (unsigned k = base; k < base + 32 && k < b->n && !b->failed; k++) {
        thread_state &o = b->threads[k];
        if (o.state != T_WARP || !(o.wmask & (1u << t->lane))) continue;
        if (config().check_barriers) {
            char buf[200];
            snprintf(buf, sizeof buf, "thread %s returned while lane %u waits for it in %s (mask 0x%08x) at %s:%d",
                     thread_str(b, t->linear).c_str(), o.lane, wop_name(o.wop), o.wmask, base_name(o.file), o.line);
            block_fail(b, cudaErrorLaunchFailure, buf);
            return;
        }
        try_complete_warp(b, &o);
    }
}

void thread_main(void *arg) {
    thread_state *t = static_cast<thread_state *>(arg);
#if FTEMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &g_sched_stack_bottom, &g_sched_stack_size);
#endif
    block_state *b = blk();
    b->body(b->body_ctx);
    thread_exit(b, t);
    back_to_scheduler_final();
}

int pick_runnable(block_state *b) {
    const unsigned words = (b->n + 63) / 64;
    if (!config().seed) {
        for (unsigned w = 0; w < words; w++)
            if (b->runnable[w]) return (int)(w * 64 + (unsigned)__builtin_ctzll(b->runnable[w]));
        return -1;
    }
    unsigned total = 0;
    for (unsigned w = 0; w < words; w++) total += (unsigned)__builtin_popcountll(b->runnable[w]);
    if (!total) return -1;
    unsigned k = (unsigned)(splitmix(b->rng) % total);
    for (unsigned w = 0; w < words; w++) {
        unsigned c = (unsigned)__builtin_popcountll(b->runnable[w]);
        if (k >= c) { k -= c; continue; }
        uint64_t bits = b->runnable[w];
        while (k--) bits &= bits - 1;
        return (int)(w * 64 + (unsigned)__builtin_ctzll(bits));
    }
    return -1;
}

void resume(block_state *b, int k) {
    thread_state *t = &b->threads[k];
    b->runnable[k >> 6] &= ~(1ull << (k & 63));
    t->state = T_RUNNING;
    g_thread = t;
#if FTEMU_ASAN
    __sanitizer_start_switch_fiber(&g_sched_fake, g_res.stacks + (size_t)k * g_res.stride + page_size(), STACK_BYTES);
#endif
    context_switch(&b->sched, &t->ctx);
#if FTEMU_ASAN
    __sanitizer_finish_switch_fiber(g_sched_fake, nullptr, nullptr);
#endif
    g_thread = nullptr;
}

// every live thread waits at a __syncthreads*: check they agree, compute the result, release
void release_sync(block_state *b) {
    const thread_state *first = nullptr;
    int count = 0, all = 1, any = 0;
    if (config().check_barriers && b->nlive < b->n) {
        // the programming guide's rule: a __syncthreads() must be reached by every thread of the
        // block (plain mode lets returned threads leave barriers, as the hardware does)
        block_fail(b, cudaErrorLaunchFailure,
                   "a __syncthreads() reached by only " + std::to_string(b->nlive) + " of the block's " +
                       std::to_string(b->n) + " threads (inside a branch, or after some threads returned): " +
                       where_threads_are(b));
        return;
    }
    for (unsigned k = 0; k < b->n; k++) {
        thread_state &t = b->threads[k];
        if (t.state != T_SYNC) continue;
        if (!first) first = &t;
        if (config().check_barriers && (t.sync_kind != first->sync_kind || t.line != first->line ||
                                        strcmp(t.file ? t.file : "", first->file ? first->file : "") != 0)) {
            block_fail(b, cudaErrorLaunchFailure,
                       "the threads of the block reached different barriers (a __syncthreads() inside a branch "
                       "taken by part of the block?): " + where_threads_are(b));
            return;
        }
        count += t.sync_pred != 0;
        all &= t.sync_pred != 0;
        any |= t.sync_pred != 0;
    }
    for (unsigned k = 0; k < b->n; k++) {
        thread_state &t = b->threads[k];
        if (t.state != T_SYNC) continue;
        t.sync_result = t.sync_kind == SYNC_COUNT ? count : t.sync_kind == SYNC_AND ? all : t.sync_kind == SYNC_OR ? any : 0;
        set_runnable(b, &t);
    }
    b->nsync = 0;
}

uint64_t lane_result(const block_state *b, const thread_state &t, unsigned participants) {
    const unsigned base = t.warp * 32;
    auto value_of = [&](int lane) -> uint64_t {
        if (lane < 0 || lane > 31 || !(participants & (1u << lane))) return ~0ull;   // undefined: poison
        return b->threads[base + (unsigned)lane].wvalue;
    };
    const int lane = (int)t.lane, width = t.wwidth, seg = lane & ~(width - 1);
    switch (t.wop) {
    case WOP_SYNC: return 0;
    case WOP_SHFL: return value_of(seg + (t.warg & (width - 1)));
    case WOP_SHFL_UP: return (lane - seg) >= t.warg ? value_of(lane - t.warg) : t.wvalue;
    case WOP_SHFL_DOWN: return (lane - seg) + t.warg < width ? value_of(lane + t.warg) : t.wvalue;
    case WOP_SHFL_XOR: {
        const int src = lane ^ t.warg;
        return src < seg + width ? value_of(src) : t.wvalue;
    }
    default: break;
    }
    uint64_t acc = 0;
    bool firstv = true;
    for (unsigned l = 0; l < 32; l++) {
        if (!(participants & (1u << l))) continue;
        const uint64_t v = b->threads[base + l].wvalue;
        const uint32_t u = (uint32_t)v;
        const int32_t s = (int32_t)u;
        switch (t.wop) {
        case WOP_BALLOT: acc |= (uint64_t)(v != 0) << l; break;
        case WOP_ANY: acc |= v != 0; break;
        case WOP_ALL: acc = firstv ? (v != 0) : (acc && v != 0); break;
        case WOP_REDUCE_ADD: acc = (uint32_t)(acc + u); break;
        case WOP_REDUCE_MIN: acc = firstv ? u : std::min<uint32_t>((uint32_t)acc, u); break;
        case WOP_REDUCE_MAX: acc = firstv ? u : std::max<uint32_t>((uint32_t)acc, u); break;
        case WOP_REDUCE_MIN_S: acc = (uint32_t)(firstv ? s : std::min<int32_t>((int32_t)(uint32_t)acc, s)); break;
        case WOP_REDUCE_MAX_S: acc = (uint32_t)(firstv ? s : std::max<int32_t>((int32_t)(uint32_t)acc, s)); break;
        case WOP_REDUCE_AND: acc = firstv ? u : (acc & u); break;
        case WOP_REDUCE_OR: acc |= u; break;
        case WOP_REDUCE_XOR: acc ^= u; break;
        default: break;
        }
        firstv = false;
    }
    return acc;
}

// `arriving` waits in a warp operation: when every live lane of its mask waits too, compute all
// their results and make them runnable
void try_complete_warp(block_state *b, thread_state *arriving) {
    const unsigned base = arriving->warp * 32;
    unsigned participants = 0;
    for (unsigned l = 0; l < 32; l++) {
        if (!(arriving->wmask & (1u << l))) continue;
        const unsigned k = base + l;
        if (k >= b->n || b->threads[k].state == T_EXITED) continue;
        if (b->threads[k].state != T_WARP) return;   // not everyone is here yet
        participants |= 1u << l;
    }
    if (config().check_barriers) {
        for (unsigned l = 0; l < 32; l++) {
            if (!(participants & (1u << l))) continue;
            const thread_state &o = b->threads[base + l];
            if (o.wop != arriving->wop || o.wmask != arriving->wmask || o.line != arriving->line ||
                strcmp(o.file, arriving->file) != 0) {
                block_fail(b, cudaErrorLaunchFailure,
                           "the lanes of warp " + std::to_string(arriving->warp) +
                               " disagree on a warp-synchronous operation (call site, kind or mask): " +
                               where_threads_are(b));
                return;
            }
        }
        const unsigned missing = arriving->wmask & ~participants;
        if (missing) {
            char buf[220];
            snprintf(buf, sizeof buf, "%s at %s:%d names lanes 0x%08x of warp %u that have returned or do not exist",
                     wop_name(arriving->wop), base_name(arriving->file), arriving->line, missing, arriving->warp);
            block_fail(b, cudaErrorLaunchFailure, buf);
            return;
        }
    }
    uint64_t results[32];
    for (unsigned l = 0; l < 32; l++)
        if (participants & (1u << l)) results[l] = lane_result(b, b->threads[base + l], participants);
    for (unsigned l = 0; l < 32; l++) {
        if (!(participants & (1u << l))) continue;
        thread_state &o = b->threads[base + l];
        o.wresult = results[l];
        if (&o == arriving && arriving->state == T_WARP && arriving == cur()) o.state = T_RUNNING;
        else set_runnable(b, &o);
    }
}

void run_block(block_state *b) {
    for (;;) {
        const int k = pick_runnable(b);
        if (k >= 0) {
            resume(b, k);
            if (b->failed) return;
            continue;
        }
        if (b->nlive == 0) return;
        if (b->nsync == b->nlive) {
            release_sync(b);
            if (b->failed) return;
            continue;
        }
        block_fail(b, cudaErrorLaunchFailure, "deadlock, no thread can make progress: " + where_threads_are(b));
        return;
    }
}

struct func_attributes {
    const void *fn;
    int max_dynamic_shared;
};
std::vector<func_attributes> g_func_attr;   // guarded by g_attr_lock
pthread_mutex_t g_attr_lock = PTHREAD_MUTEX_INITIALIZER;

size_t dynamic_shared_limit(const void *fn) {
    pthread_mutex_lock(&g_attr_lock);
    size_t lim = DEFAULT_DYNAMIC_SHARED;
    for (auto &a : g_func_attr)
        if (a.fn == fn) lim = (size_t)a.max_dynamic_shared;
    pthread_mutex_unlock(&g_attr_lock);
    return lim;
}

std::atomic<uint64_t> g_launches{0};

}  // namespace

void wmma_arrive(const char *file, int line) {
    thread_state *t = cur();
    block_state *b = blk();
    if (!t) return;
    const unsigned base = t->warp * 32, lanes = b->n - base < 32 ? b->n - base : 32;
    warp_collective(WOP_WMMA, lanes == 32 ? 0xffffffffu : (1u << lanes) - 1, 0, 0, 32, file, line);
}

[[noreturn]] void trap(const char *file, int line) {
    block_state *b = blk();
    char buf[160];
    snprintf(buf, sizeof buf, "__trap() at %s:%d", base_name(file), line);
    if (b && cur()) {
        block_fail(b, cudaErrorLaunchFailure, buf);
        back_to_scheduler_final();
    }
    fail(cudaErrorLaunchFailure, "%s called outside a kernel", buf);
    abort();
}

void wmma_operand(const void *p, unsigned ldm, size_t elem_bytes, const char *what, const char *file, int line) {
    thread_state *t = cur();
    block_state *b = blk();
    if (!t) return;
    const bool aligned = ((uintptr_t)p & 31) == 0, ld_ok = ((size_t)ldm * elem_bytes) % 16 == 0;
    if (aligned && ld_ok) return;
    char buf[256];
    snprintf(buf, sizeof buf, "%s at %s:%d: %s (pointer %p must be 32-byte aligned, ldm %u x %zu bytes a multiple "
             "of 16)", what, base_name(file), line, !aligned ? "misaligned pointer" : "bad leading dimension", p, ldm,
             elem_bytes);
    block_fail(b, cudaErrorLaunchFailure, buf);
    back_to_scheduler_final();
}

cudaError_t set_max_dynamic_shared(const void *fn, int bytes) {
    if (bytes < 0 || (size_t)bytes > MAX_DYNAMIC_SHARED)
        return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: %d bytes of dynamic shared memory exceeds the "
                                           "device limit of %zu", bytes, MAX_DYNAMIC_SHARED);
    pthread_mutex_lock(&g_attr_lock);
    bool found = false;
    for (auto &a : g_func_attr)
        if (a.fn == fn) { a.max_dynamic_shared = bytes; found = true; }
    if (!found) g_func_attr.push_back({fn, bytes});
    pthread_mutex_unlock(&g_attr_lock);
    return cudaSuccess;
}

int syncthreads(int kind, int predicate, const char *file, int line) {
    thread_state *t = cur();
    block_state *b = blk();
    if (!t) {
        fail(cudaErrorLaunchFailure, "%s called outside a kernel (%s:%d)", kind_name(kind), base_name(file), line);
        return 0;
    }
    compiler_barrier();
    t->state = T_SYNC;
    t->sync_kind = kind;
    t->sync_pred = predicate;
    t->file = file;
    t->line = line;
    b->nsync++;
    yield_to_scheduler();
    compiler_barrier();
    return t->sync_result;
}

uint64_t warp_collective(warp_op op, unsigned mask, uint64_t value, int arg, int width, const char *file, int line) {
    thread_state *t = cur();
    block_state *b = blk();
    if (!t) {
        fail(cudaErrorLaunchFailure, "%s called outside a kernel (%s:%d)", wop_name(op), base_name(file), line);
        return 0;
    }
    if (width < 1 || width > 32 || (width & (width - 1))) {
        char buf[160];
        snprintf(buf, sizeof buf, "%s at %s:%d: width %d is not a power of two in [1, 32]", wop_name(op),
                 base_name(file), line, width);
        block_fail(b, cudaErrorLaunchFailure, buf);
        back_to_scheduler_final();
    }
    if (!(mask & (1u << t->lane)) && config().check_barriers) {
        char buf[160];
        snprintf(buf, sizeof buf, "%s at %s:%d: lane %u is not in its own mask 0x%08x", wop_name(op), base_name(file),
                 line, t->lane, mask);
        block_fail(b, cudaErrorLaunchFailure, buf);
        back_to_scheduler_final();
    }
    compiler_barrier();
    t->state = T_WARP;
    t->wop = op;
    t->wmask = mask | (1u << t->lane);
    t->wvalue = value;
    t->warg = arg;
    t->wwidth = width;
    t->file = file;
    t->line = line;
    try_complete_warp(b, t);
    if (b->failed) back_to_scheduler_final();
    if (t->state != T_RUNNING) yield_to_scheduler();
    if (b->failed) back_to_scheduler_final();
    compiler_barrier();
    return t->wresult;
}

unsigned active_mask() {
    thread_state *t = cur();
    block_state *b = blk();
    if (!t) return 0;
    unsigned m = 0;
    for (unsigned l = 0; l < 32; l++) {
        unsigned k = t->warp * 32 + l;
        if (k < b->n && b->threads[k].state != T_EXITED) m |= 1u << l;
    }
    return m;
}

// a fault inside a kernel (runtime.cpp's signal handler): report it and leave the launch
bool kernel_fault(void *addr, bool write) {
    if (!g_in_kernel) return false;
    block_state *b = blk();
    thread_state *t = cur();
    char where[256];
    describe_address(addr, where, sizeof where);
    if (b) {
        std::string who = t ? "thread " + thread_str(b, t->linear) : std::string("the scheduler");
        fail(cudaErrorIllegalAddress, "kernel %s: %s: %s %s address %p: %s", b->kernel, block_str(b).c_str(),
             who.c_str(), write ? "wrote" : "read", addr, where);
    }
    g_in_kernel = 0;
    siglongjmp(g_fault_jmp, 1);
}

int run_grid(const char *kernel, const void *kernel_id, dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
             thread_body body, void *ctx) {
    if (g_block)
        return fail(cudaErrorNotSupported, "kernel %s launched from inside kernel %s: dynamic parallelism is not "
                                           "emulated", kernel, static_cast<block_state *>(g_block)->kernel);
    const uint64_t nthreads = (uint64_t)block.x * block.y * block.z;
    if (block.x < 1 || block.y < 1 || block.z < 1 || block.x > 1024 || block.y > 1024 || block.z > 64 || nthreads > 1024)
        return fail(cudaErrorInvalidConfiguration, "kernel %s: block (%u,%u,%u) is not a valid block shape "
                    "(each side >= 1, x, y <= 1024, z <= 64, at most 1024 threads)", kernel, block.x, block.y, block.z);
    if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
        return fail(cudaErrorInvalidConfiguration, "kernel %s: grid (%u,%u,%u) is not a valid grid shape "
                    "(each side >= 1, x < 2^31, y, z <= 65535)", kernel, grid.x, grid.y, grid.z);
    const size_t limit = dynamic_shared_limit(kernel_id);
    if (shared > limit)
        return fail(cudaErrorInvalidValue, "kernel %s: %zu bytes of dynamic shared memory requested, the limit is %zu "
                    "(raise it with cudaFuncSetAttribute up to %zu)", kernel, shared, limit, MAX_DYNAMIC_SHARED);
    if (!stream_valid(stream))
        return fail(cudaErrorInvalidResourceHandle, "kernel %s launched on a stream that does not exist (%p)", kernel,
                    (void *)stream);
    if (!ensure_resources()) return fail(cudaErrorMemoryAllocation, "kernel %s: cannot allocate the emulator's thread "
                                                                    "stacks", kernel);
    install_fault_handler();
    os_thread_resources &res = g_res;
    // 128-byte aligned, as `extern __shared__ __align__(128)` is on a GPU (WMMA tiles need 32)
    if (res.dynamic_shared.size() < shared + 128) res.dynamic_shared.resize(shared + 128);
    unsigned char *dyn = res.dynamic_shared.data() + ((128 - ((uintptr_t)res.dynamic_shared.data() & 127)) & 127);

    const uint64_t nblocks = (uint64_t)grid.x * grid.y * grid.z;
    const settings &cfg = config();
    uint64_t rng = cfg.seed ^ (0x5851F42D4C957F2Dull * (++g_launches));
    // block order: in order, or a seeded random permutation (only its prefix is materialised
    // lazily for huge grids: a random rotation and stride visit every block once)
    uint64_t start = 0, step = 1;
    if (cfg.seed && nblocks > 1) {
        start = splitmix(rng) % nblocks;
        do step = splitmix(rng) % nblocks; while (step == 0 || std::gcd(step, nblocks) != 1);
    }

    block_state b;
    memset(static_cast<void *>(&b), 0, sizeof b);
    b.block_dim = block;
    b.grid_dim = grid;
    b.dynamic_shared = shared ? dyn : nullptr;
    b.dynamic_shared_bytes = shared;
    b.n = (unsigned)nthreads;
    b.kernel = kernel;
    b.body = body;
    b.body_ctx = ctx;
    b.threads = res.threads;
    b.rng = rng;

    context *saved_sched = g_sched_ctx;
    g_sched_ctx = &b.sched;
    int result = cudaSuccess;
    if (sigsetjmp(g_fault_jmp, 1) == 0) {
        g_in_kernel = 1;
        uint64_t idx = start;
        for (uint64_t nb = 0; nb < nblocks && !b.failed; nb++, idx = (idx + step) % nblocks) {
            b.block_idx = uint3{(unsigned)(idx % grid.x), (unsigned)((idx / grid.x) % grid.y),
                                (unsigned)(idx / ((uint64_t)grid.x * grid.y))};
            if (shared) memset(b.dynamic_shared, 0xFF, shared);   // uninitialised shared memory reads as NaN
            b.nlive = b.n;
            b.nsync = 0;
            memset(b.runnable, 0, sizeof b.runnable);
            for (unsigned k = 0; k < b.n; k++) {
                thread_state &t = b.threads[k];
                t.thread_idx = uint3{k % block.x, (k / block.x) % block.y, k / (block.x * block.y)};
                t.linear = k;
                t.lane = k & 31;
                t.warp = k >> 5;
                t.file = nullptr;
                t.line = 0;
                char *stack = res.stacks + (size_t)k * res.stride + page_size();
#if FTEMU_ASAN
                __asan_unpoison_memory_region(stack, STACK_BYTES);
                t.fake_stack = nullptr;
#endif
                context_init(&t.ctx, stack, STACK_BYTES, thread_main, &t);
                set_runnable(&b, &t);
            }
            g_block = &b;
            run_block(&b);
            g_block = nullptr;
        }
        g_in_kernel = 0;
        result = b.failed ? (int)pending_error(false) : cudaSuccess;
    } else {
        // a fault: kernel_fault recorded the error; the block's threads are abandoned
        g_block = nullptr;
        g_thread = nullptr;
        result = cudaErrorIllegalAddress;
    }
    g_sched_ctx = saved_sched;
    if (result == cudaSuccess && cfg.check_memory && !check_canaries(kernel)) result = cudaErrorIllegalAddress;
    return result;
}

}  // namespace ftemu

long long clock64() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

extern "C" cudaError_t cudaFuncSetAttribute(const void *func, cudaFuncAttribute attr, int value) {
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) return ftemu::set_max_dynamic_shared(func, value);
    return cudaSuccess;
}
