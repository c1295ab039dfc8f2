// Device events for the backend profiler (core/profile.c): an event recorded on the backend's
// stream before and after each op; the elapsed time between the two is the op's device time.
#include "cuda_common.cuh"

using namespace ftcuda;

extern "C" {

__attribute__((visibility("default"))) ft_status ft_cuda_event_record(ft_backend *be, void **out) {
    *out = nullptr;
    cuda_ctx *c = ctx_of(be);
    cudaEvent_t ev;
    FT_CU(cudaSetDevice(c->device), "cudaSetDevice (profiler)");
    FT_CU(cudaEventCreate(&ev), "cudaEventCreate (profiler)");
    cudaError_t e = cudaEventRecord(ev, c->stream);
    if (e != cudaSuccess) {
        cudaEventDestroy(ev);
        return cuda_fail(e, "cudaEventRecord (profiler)");
    }
    *out = static_cast<void *>(ev);
    return FT_OK;
}

// waits for `stop`, then the milliseconds between the two events
__attribute__((visibility("default"))) ft_status ft_cuda_event_elapsed(void *start, void *stop, float *ms) {
    *ms = 0.0f;
    FT_CU(cudaEventSynchronize(static_cast<cudaEvent_t>(stop)), "cudaEventSynchronize (profiler)");
    FT_CU(cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(stop)),
          "cudaEventElapsedTime (profiler)");
    return FT_OK;
}

__attribute__((visibility("default"))) void ft_cuda_event_destroy(void *ev) {
    if (ev) cudaEventDestroy(static_cast<cudaEvent_t>(ev));
}

}  // extern "C"
