/* The CPU backend's part of the cache's device tier: host staging memory (plain
 * aligned memory: host memory is this backend's memory) and cache_decode_rows, the reference the CUDA
 * kernel (cuda/cache.cu) is checked against op by op. */
#include <stdlib.h>
#include <string.h>

#include "cache/codec.h"
#include "core/status.h"
#include "cpu_ops.h"

ft_status cpu_host_alloc(ft_backend *be, size_t bytes, void **out) { return cpu_alloc(be, bytes, out); }
void cpu_host_free(ft_backend *be, void *p) { cpu_free(be, p); }

/* the CPU is synchronous: no streams, no events; an "asynchronous" upload is a copy */
ft_status cpu_stream_create(ft_backend *be, uintptr_t *out) { (void)be; *out = 0; return FT_OK; }
void cpu_stream_destroy(ft_backend *be, uintptr_t stream) { (void)be; (void)stream; }
ft_status cpu_event_create(ft_backend *be, uintptr_t *out) { (void)be; *out = 0; return FT_OK; }
void cpu_event_destroy(ft_backend *be, uintptr_t event) { (void)be; (void)event; }
ft_status cpu_event_record(ft_backend *be, uintptr_t event, uintptr_t stream) {
    (void)be; (void)event; (void)stream;
    return FT_OK;
}
ft_status cpu_stream_wait_event(ft_backend *be, uintptr_t stream, uintptr_t event) {
    (void)be; (void)stream; (void)event;
    return FT_OK;
}
ft_status cpu_event_synchronize(ft_backend *be, uintptr_t event) { (void)be; (void)event; return FT_OK; }
ft_status cpu_upload_async(ft_backend *be, void *dst, const void *host_src, size_t bytes, uintptr_t stream) {
    (void)stream;
    return cpu_upload(be, dst, host_src, bytes);
}

ft_status cpu_cache_decode_rows(ft_backend *be, float *dst, const ft_gather_row *rows, ft_gather_row *rows_dev, int64_t n,
                           int64_t C, ft_dtype codec, uintptr_t stream) {
    (void)be;
    (void)rows_dev;
    (void)stream;
    if (!ft_cache_codec_ok(codec)) return ft_error(FT_ERR_DTYPE, "cache_decode_rows: codec %s", ft_dtype_name(codec));
    for (int64_t k = 0; k < n; k++) {
        float *o = dst + rows[k].row * C;
        if (rows[k].src) ft_cache_decode_row(o, rows[k].src, rows[k].scale, codec, C);
        else memset(o, 0, (size_t)C * sizeof(float));
    }
    return FT_OK;
}
