// fasttran's CUDA emulator: what scheduler.cpp, runtime.cpp and cublas.cpp share.
#ifndef FTEMU_INTERNAL_H
#define FTEMU_INTERNAL_H
#include <stdarg.h>

#include "cuda_runtime.h"

namespace ftemu {

// settings from the environment, read once (FASTTRAN_EMU_SEED, FASTTRAN_EMU_CHECK, FASTTRAN_EMU_MEMORY)
struct settings {
    unsigned long long seed;   // 0: deterministic order (blocks in order, lowest runnable thread first)
    bool check_barriers;       // FASTTRAN_EMU_CHECK contains "barriers"
    bool check_memory;         // FASTTRAN_EMU_CHECK contains "memory": guard pages and tail checks
    size_t device_memory;      // bytes the emulated device reports and allows
};
const settings &config();

// Record an error of the calling host thread: returned by the next cudaGetLastError (and the
// next synchronising call), its text by cudaGetErrorString; also printed to stderr.
cudaError_t fail(cudaError_t code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
cudaError_t vfail(cudaError_t code, const char *fmt, va_list ap);
// the pending error (cleared when `clear`)
cudaError_t pending_error(bool clear);

// device allocations: is [p, p + bytes) inside one live allocation?
bool is_device_range(const void *p, size_t bytes);
// describe an address relative to the device allocations ("4 bytes past the end of ...")
void describe_address(const void *addr, char *out, size_t len);
// memory-check mode: the bytes around each allocation still hold their canary? (after a launch)
bool check_canaries(const char *kernel);

// faults inside a kernel become cudaErrorIllegalAddress (runtime.cpp installs the handler)
void install_fault_handler();
// called by the fault handler: inside a kernel, records the fault and leaves the launch (does not
// return); elsewhere returns false
bool kernel_fault(void *addr, bool write);
cudaError_t set_max_dynamic_shared(const void *fn, int bytes);
bool stream_valid(cudaStream_t s);

}  // namespace ftemu
#endif
