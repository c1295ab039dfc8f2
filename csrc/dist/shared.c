/* Shared host allocations (see shared.h): memfd + mmap, with a registry so that cpu_free and
 * ft_shared_find know them. The registry is a short list under a mutex: a process has one
 * gradient table per model. Whether a table is shared is its maker's argument, never a
 * process-wide setting. */
#define _GNU_SOURCE
#include "dist/shared.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/status.h"

typedef struct region {
    struct region *next;
    char *p;
    size_t bytes;
    int fd;
} region;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static region *regions;

static int memfd(const char *name) {
#ifdef SYS_memfd_create
    return (int)syscall(SYS_memfd_create, name, 1u /* MFD_CLOEXEC */);
#else
    (void)name;
    errno = ENOSYS;
    return -1;
#endif
}

ft_status ft_shared_alloc(size_t bytes, void **out) {
    *out = NULL;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t size = bytes ? (bytes + page - 1) / page * page : page;
    region *r = calloc(1, sizeof *r);
    if (!r) return ft_error(FT_ERR_NOMEM, "out of memory");
    r->fd = memfd("fasttran-gradients");
    if (r->fd < 0) {
        free(r);
        return ft_error_errno(FT_ERR_UNSUPPORTED, errno, "memfd_create");
    }
    if (ftruncate(r->fd, (off_t)size) != 0) {
        const int e = errno;
        close(r->fd);
        free(r);
        return ft_error_errno(FT_ERR_NOMEM, e, "cannot size %zu bytes of shared memory", size);
    }
    /* reserve the pages now: a full tmpfs must fail here, not as SIGBUS on the first write */
    int e = posix_fallocate(r->fd, 0, (off_t)size);
    void *p = e == 0 ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0) : MAP_FAILED;
    if (p == MAP_FAILED) {
        if (!e) e = errno;
        close(r->fd);
        free(r);
        return ft_error_errno(FT_ERR_NOMEM, e, "cannot map %zu bytes of shared memory", size);
    }
    r->p = p;
    r->bytes = size;
    pthread_mutex_lock(&lock);
    r->next = regions;
    regions = r;
    pthread_mutex_unlock(&lock);
    *out = p;
    return FT_OK;
}

int ft_shared_free(void *p) {
    if (!p) return 0;
    pthread_mutex_lock(&lock);
    region **at = &regions;
    while (*at && (*at)->p != (char *)p) at = &(*at)->next;
    region *r = *at;
    if (r) *at = r->next;
    pthread_mutex_unlock(&lock);
    if (!r) return 0;
    munmap(r->p, r->bytes);
    close(r->fd);
    free(r);
    return 1;
}

int ft_shared_find(const void *p, int *fd, size_t *offset, size_t *bytes) {
    const char *c = p;
    int found = 0;
    pthread_mutex_lock(&lock);
    for (region *r = regions; r; r = r->next)
        if (c >= r->p && c < r->p + r->bytes) {
            *fd = r->fd;
            *offset = (size_t)(c - r->p);
            *bytes = r->bytes - *offset;
            found = 1;
            break;
        }
    pthread_mutex_unlock(&lock);
    return found;
}

ft_status ft_backend_alloc_grads(ft_backend *be, size_t bytes, int shared, void **out) {
    if (be->device.kind == FT_DEVICE_CPU && shared) {
        if (ft_shared_alloc(bytes, out) == FT_OK) return FT_OK;
        ft_clear_error();   /* no memfd, or no room: plain memory, and the ranks sum through the process group */
    }
    return be->alloc(be, bytes, out);
}
