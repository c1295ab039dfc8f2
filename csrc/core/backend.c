/* Backend selection at run time. The CPU backend is linked in; the CUDA backend is the
 * library libfasttran_cuda.so next to this module, opened with dlopen on first use so that a
 * machine without a CUDA driver or cuBLAS still imports fasttran and says why CUDA is off. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "core/status.h"

/* the registry of the op list (backend.h): tests look each entry up by name */
#define FT_REGISTRY_SERVICE(ret, name, params) {#name, "service", #ret, #params, offsetof(ft_backend, name)},
#define FT_REGISTRY_OP(name, params, args) {#name, "op", "ft_status", #params, offsetof(ft_backend, name)},
const ft_backend_entry ft_backend_registry[] = {
    FT_BACKEND_SERVICES(FT_REGISTRY_SERVICE)
    FT_BACKEND_OPS(FT_REGISTRY_OP)
};
#undef FT_REGISTRY_SERVICE
#undef FT_REGISTRY_OP
const size_t ft_backend_registry_count = sizeof ft_backend_registry / sizeof ft_backend_registry[0];

static pthread_mutex_t cuda_lock = PTHREAD_MUTEX_INITIALIZER;
static void *cuda_lib;
static char cuda_load_error[512];
static const ft_host_api host_api = {ft_error};
static _Atomic(ft_backend_open_hook) open_hook;   /* ft_backend_set_open_hook */

/* The CUDA backend library next to this module: libfasttran_cuda.so (built with nvcc), or, when
 * FASTTRAN_CUDA_EMU is set (not "0"), libfasttran_cuda_emu.so, the same sources built against the
 * CUDA emulator (test infrastructure: it runs the kernels on the CPU). */
static int emulator_requested(void) {
    const char *e = getenv("FASTTRAN_CUDA_EMU");
    return e && e[0] && strcmp(e, "0") != 0;
}

static int library_path(const char *name, char *path, size_t len) {
    Dl_info info;
    if (!dladdr((void *)&library_path, &info) || !info.dli_fname) return 0;
    snprintf(path, len, "%s", info.dli_fname);
    char *slash = strrchr(path, '/');
    size_t dir = slash ? (size_t)(slash - path + 1) : 0;
    snprintf(path + dir, len - dir, "%s", name);
    return 1;
}

static int library_exists(const char *name) {
    char path[4096];
    return library_path(name, path, sizeof path) && access(path, R_OK) == 0;
}

int ft_cuda_compiled(void) { return library_exists("libfasttran_cuda.so"); }
int ft_cuda_emulated(void) { return emulator_requested() && library_exists("libfasttran_cuda_emu.so"); }

/* Loads the library once; returns its handle or NULL with cuda_load_error set. */
static void *cuda_library(void) {
    pthread_mutex_lock(&cuda_lock);
    if (!cuda_lib && !cuda_load_error[0]) {
        const int emu = emulator_requested();
        const char *name = emu ? "libfasttran_cuda_emu.so" : "libfasttran_cuda.so";
        char path[4096];
        if (!library_path(name, path, sizeof path)) {
            snprintf(cuda_load_error, sizeof cuda_load_error, "cannot locate the fasttran module file");
        } else if (access(path, R_OK) != 0) {
            if (emu)
                snprintf(cuda_load_error, sizeof cuda_load_error,
                         "FASTTRAN_CUDA_EMU is set but this build has no emulated CUDA backend (%s): build with "
                         "FASTTRAN_CUDA=emu", name);
            else
                snprintf(cuda_load_error, sizeof cuda_load_error,
                         "fasttran was built without its CUDA backend (it is built when nvcc and a GPU are present "
                         "at install time, or with FASTTRAN_CUDA=1)");
        } else {
            cuda_lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
            if (!cuda_lib)
                snprintf(cuda_load_error, sizeof cuda_load_error, "cannot load the CUDA backend: %s", dlerror());
        }
    }
    void *lib = cuda_lib;
    pthread_mutex_unlock(&cuda_lock);
    return lib;
}

ft_status ft_cuda_probe(int *device_count, char *desc, size_t desc_len) {
    *device_count = 0;
    if (desc_len) desc[0] = '\0';
    void *lib = cuda_library();
    if (!lib) return ft_error(FT_ERR_DEVICE, "%s", cuda_load_error);
    ft_cuda_probe_fn probe = (ft_cuda_probe_fn)dlsym(lib, "ft_cuda_probe_devices");
    if (!probe) return ft_error(FT_ERR_DEVICE, "the CUDA backend library lacks ft_cuda_probe_devices");
    return probe(&host_api, device_count, desc, desc_len);
}

ft_status ft_backend_cuda_open(int index, ft_backend **out) {
    void *lib = cuda_library();
    if (!lib) return ft_error(FT_ERR_DEVICE, "%s", cuda_load_error);
    ft_cuda_open_fn open_fn = (ft_cuda_open_fn)dlsym(lib, "ft_cuda_backend_open");
    if (!open_fn) return ft_error(FT_ERR_DEVICE, "the CUDA backend library lacks ft_cuda_backend_open");
    FT_TRY(open_fn(&host_api, index, out));
    if ((*out)->abi != FT_BACKEND_ABI) {
        (*out)->destroy(*out);
        *out = NULL;
        return ft_error(FT_ERR_DEVICE, "CUDA backend ABI mismatch: rebuild fasttran");
    }
    const ft_backend_open_hook hook = atomic_load(&open_hook);
    if (hook) hook(*out);   /* the profiler's timing wrappers (idle unless profiling): core/profile.c */
    return FT_OK;
}

void ft_backend_set_open_hook(ft_backend_open_hook hook) { atomic_store(&open_hook, hook); }

void *ft_cuda_symbol(const char *name) {
    void *lib = cuda_library();
    return lib ? dlsym(lib, name) : NULL;
}

/* One shared backend per CUDA device for memory services that have no encoder at hand
 * (reading a CUDA tensor to the host). Opened on first use, kept for the process. */
static ft_backend *shared_cuda[64];

static pthread_mutex_t shared_lock = PTHREAD_MUTEX_INITIALIZER;

void ft_backend_release_shared(void) {
    pthread_mutex_lock(&shared_lock);
    for (int i = 0; i < 64; i++)
        if (shared_cuda[i]) {
            shared_cuda[i]->destroy(shared_cuda[i]);
            shared_cuda[i] = NULL;
        }
    pthread_mutex_unlock(&shared_lock);
}

ft_status ft_backend_for(ft_device dev, ft_backend **out) {
    if (dev.kind == FT_DEVICE_CPU) { *out = ft_backend_cpu(); return FT_OK; }
    if (dev.index < 0 || dev.index >= 64) return ft_error(FT_ERR_DEVICE, "CUDA device index %d out of range", dev.index);
    pthread_mutex_lock(&shared_lock);
    ft_status st = FT_OK;
    if (!shared_cuda[dev.index]) st = ft_backend_cuda_open(dev.index, &shared_cuda[dev.index]);
    *out = shared_cuda[dev.index];
    pthread_mutex_unlock(&shared_lock);
    return st;
}

ft_status ft_device_read(ft_device dev, void *host_dst, const void *src, size_t bytes) {
    ft_backend *be = NULL;
    FT_TRY(ft_backend_for(dev, &be));
    return be->download(be, host_dst, src, bytes);
}

ft_status ft_device_stream(ft_device dev, uintptr_t *stream) {
    ft_backend *be = NULL;
    FT_TRY(ft_backend_for(dev, &be));
    *stream = be->stream;
    return FT_OK;
}

ft_status ft_device_alloc(ft_device dev, size_t bytes, void **out) {
    ft_backend *be = NULL;
    FT_TRY(ft_backend_for(dev, &be));
    return be->alloc(be, bytes, out);
}

void ft_device_free(ft_device dev, void *p) {
    ft_backend *be = NULL;
    if (!p || ft_backend_for(dev, &be) != FT_OK) return;
    be->free(be, p);
}

ft_status ft_device_write(ft_device dev, void *dst, const void *host_src, size_t bytes) {
    ft_backend *be = NULL;
    FT_TRY(ft_backend_for(dev, &be));
    return be->upload(be, dst, host_src, bytes);
}
