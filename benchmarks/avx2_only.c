/* Preload library for benchmarks/test_cpu_peers.py: make this process see an AVX2 machine.
 *
 * Every engine picks its kernels from the CPUID instruction (fasttran, OpenBLAS, torch/oneDNN,
 * CTranslate2, ONNX Runtime's MLAS), and ONNX Runtime has no switch to force its AVX2 path. Linux
 * can make CPUID fault in user space (arch_prctl ARCH_SET_CPUID, on CPUs with CPUID faulting;
 * inherited by the threads the process creates): the SIGSEGV handler below executes the real
 * CPUID, clears the AVX-512, AVX-VNNI, AVX512-BF16/FP16 and AMX bits -- Haswell's feature set is
 * left -- and steps over the instruction. Nothing else changes: same machine, same run, each
 * library's own choice of kernels.
 *
 *   cc -O2 -shared -fPIC benchmarks/avx2_only.c -o /tmp/avx2_only.so
 *   LD_PRELOAD=/tmp/avx2_only.so python -m pytest benchmarks/test_cpu_peers.py -s -p no:faulthandler
 *
 * A real segmentation fault still ends the process (the handler restores the default action and
 * returns, so the instruction faults again). A library that installs its own SIGSEGV handler
 * later breaks the scheme (pytest's faulthandler: hence -p no:faulthandler). Benchmarks only. */
#define _GNU_SOURCE
#include <cpuid.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define ARCH_SET_CPUID 0x1012
#define BIT(n) (1u << (n))

static void on_segv(int sig, siginfo_t *info, void *context) {
    (void)info;
    greg_t *reg = ((ucontext_t *)context)->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)reg[REG_RIP];
    if (ip[0] != 0x0F || ip[1] != 0xA2) {   /* not CPUID: a real fault */
        signal(sig, SIG_DFL);
        return;
    }
    unsigned a, b, c, d;
    const unsigned leaf = (unsigned)reg[REG_RAX], sub = (unsigned)reg[REG_RCX];
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
    __cpuid_count(leaf, sub, a, b, c, d);
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
    if (leaf == 7 && sub == 0) {
        /* EBX: AVX512 F DQ IFMA PF ER CD BW VL; ECX: VBMI VBMI2 VNNI BITALG VPOPCNTDQ;
         * EDX: 4VNNIW 4FMAPS VP2INTERSECT, AMX-BF16, AVX512-FP16, AMX-TILE, AMX-INT8 */
        b &= ~(BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31));
        c &= ~(BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14));
        d &= ~(BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25));
    } else if (leaf == 7 && sub == 1) {
        a &= ~(BIT(4) | BIT(5));   /* AVX-VNNI, AVX512-BF16 */
    }
    reg[REG_RAX] = a;
    reg[REG_RBX] = b;
    reg[REG_RCX] = c;
    reg[REG_RDX] = d;
    reg[REG_RIP] += 2;
}

__attribute__((constructor)) static void mask_cpuid(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigaction(SIGSEGV, &sa, NULL);
    if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0)
        perror("avx2_only: this CPU or kernel cannot make CPUID fault (arch_prctl ARCH_SET_CPUID); nothing is masked");
}
