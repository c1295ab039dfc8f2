// The cache's device tier on CUDA: pinned host staging memory, and cache_decode_rows, which
// decodes a batch's rows from device-resident shards into the batch buffer on the device (no
// host round trip). Decoding is exact and the CPU's: f16 and bf16 widen to float without
// rounding, int8 rows are one float multiply (q * scale), f32 rows are copied.
#include <cuda_fp16.h>

#include "cache/codecs.h"
#include "cuda_common.cuh"

using namespace ftcuda;

namespace {

constexpr int GATHER_THREADS = 256;

// the device decoders, one per line of FT_CACHE_CODECS (cache/codecs.h): value c of a stored row
struct codec_f32 {
    __device__ static float at(const void *s, int64_t c, float) { return static_cast<const float *>(s)[c]; }
};
struct codec_f16 {
    __device__ static float at(const void *s, int64_t c, float) {
        return __half2float(__ushort_as_half(static_cast<const unsigned short *>(s)[c]));
    }
};
struct codec_bf16 {
    __device__ static float at(const void *s, int64_t c, float) {
        return __uint_as_float((unsigned)static_cast<const unsigned short *>(s)[c] << 16);
    }
};
struct codec_i8 {
    __device__ static float at(const void *s, int64_t c, float scale) {
        return (float)static_cast<const signed char *>(s)[c] * scale;
    }
};

// one block per table entry: dst row rows[k].row = decode(rows[k].src), zeros for NULL
template <class Codec>
__global__ void cache_decode_rows_kernel(float *dst, const ft_gather_row *rows, int64_t C) {
    const ft_gather_row r = rows[blockIdx.x];
    float *o = dst + r.row * C;
    if (!r.src) {
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = 0.0f;
        return;
    }
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = Codec::at(r.src, c, r.scale);
}

typedef void (*decode_kernel)(float *, const ft_gather_row *, int64_t);
struct codec_kernel {
    int code;
    decode_kernel kernel;
};
#define FT_CODEC_KERNEL_(code, name, storage, scaled, lossless, tag) {code, cache_decode_rows_kernel<codec_##tag>},
const codec_kernel KERNELS[] = {FT_CACHE_CODECS(FT_CODEC_KERNEL_)};
#undef FT_CODEC_KERNEL_

decode_kernel kernel_of(ft_dtype codec) {
    for (const codec_kernel &e : KERNELS)
        if (e.code == (int)codec) return e.kernel;
    return nullptr;
}

}  // namespace

ft_status cuda_host_alloc(ft_backend *be, size_t bytes, void **out) {
    FT_CU(cudaSetDevice(ctx_of(be)->device), "cudaSetDevice");
    cudaError_t e = cudaHostAlloc(out, bytes ? bytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess)
        return g_host->error(e == cudaErrorMemoryAllocation ? FT_ERR_NOMEM : FT_ERR_DEVICE,
                             "cannot allocate %zu bytes of pinned host memory: %s", bytes, cudaGetErrorString(e));
    return FT_OK;
}

void cuda_host_free(ft_backend *be, void *p) {
    (void)be;
    if (p) cudaFreeHost(p);
}

// ---- side streams and events (the cache reader's prefetch) ----
static cudaStream_t stream_of(ft_backend *be, uintptr_t s) {
    return s ? reinterpret_cast<cudaStream_t>(s) : ctx_of(be)->stream;
}

ft_status cuda_stream_create(ft_backend *be, uintptr_t *out) {
    FT_CU(cudaSetDevice(ctx_of(be)->device), "cudaSetDevice");
    cudaStream_t s;
    FT_CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "creating a stream");
    *out = reinterpret_cast<uintptr_t>(s);
    return FT_OK;
}

void cuda_stream_destroy(ft_backend *be, uintptr_t stream) {
    (void)be;
    if (stream) cudaStreamDestroy(reinterpret_cast<cudaStream_t>(stream));
}

ft_status cuda_event_create(ft_backend *be, uintptr_t *out) {
    FT_CU(cudaSetDevice(ctx_of(be)->device), "cudaSetDevice");
    cudaEvent_t e;
    FT_CU(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "creating an event");
    *out = reinterpret_cast<uintptr_t>(e);
    return FT_OK;
}

void cuda_event_destroy(ft_backend *be, uintptr_t event) {
    (void)be;
    if (event) cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event));
}

ft_status cuda_event_record(ft_backend *be, uintptr_t event, uintptr_t stream) {
    FT_CU(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), stream_of(be, stream)), "recording an event");
    return FT_OK;
}

ft_status cuda_stream_wait_event(ft_backend *be, uintptr_t stream, uintptr_t event) {
    FT_CU(cudaStreamWaitEvent(stream_of(be, stream), reinterpret_cast<cudaEvent_t>(event), 0), "waiting for an event");
    return FT_OK;
}

ft_status cuda_event_synchronize(ft_backend *be, uintptr_t event) {
    (void)be;
    FT_CU(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event)), "waiting for an event");
    return FT_OK;
}

ft_status cuda_upload_async(ft_backend *be, void *dst, const void *src, size_t bytes, uintptr_t stream) {
    FT_CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_of(be, stream)), "upload");
    return FT_OK;
}

ft_status cuda_cache_decode_rows(ft_backend *be, float *dst, const ft_gather_row *rows, ft_gather_row *rows_dev, int64_t n,
                            int64_t C, ft_dtype codec, uintptr_t stream) {
    const decode_kernel cache_decode_rows = kernel_of(codec);
    if (!cache_decode_rows) return g_host->error(FT_ERR_DTYPE, "cache_decode_rows: codec %d is not a cache codec", (int)codec);
    if (n <= 0) return FT_OK;
    if (n > 0x7fffffff) return g_host->error(FT_ERR_INVALID_ARGUMENT, "cache_decode_rows: %lld rows in one call", (long long)n);
    cudaStream_t s = stream_of(be, stream);
    FT_CU(cudaMemcpyAsync(rows_dev, rows, (size_t)n * sizeof(ft_gather_row), cudaMemcpyHostToDevice, s),
          "cache_decode_rows table upload");
    FT_LAUNCH(cache_decode_rows, (unsigned)n, GATHER_THREADS, 0, s)(dst, rows_dev, C);
    return launched("cache_decode_rows");
}
