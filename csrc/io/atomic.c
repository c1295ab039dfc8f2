/* The one atomic file writer: every file fasttran writes (safetensors checkpoints, cache shards,
 * manifests, trainer state, config.json) goes through ft_atomic_write.
 *
 *   write <path>.tmp.<pid>.<n> -> fsync it -> rename over <path> -> fsync the directory
 *
 * A reader (or a process started after a crash) sees either the old file or the whole new one,
 * never a torn one, and the rename itself survives a power cut. On any failure the temporary
 * file is removed and <path> is left as it was. */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/status.h"
#include "fasttran.h"

static ft_status write_all(int fd, const void *buf, size_t n, const char *path) {
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return ft_error_errno(FT_ERR_IO, errno, "cannot write '%s'", path);
        }
        p += w;
        n -= (size_t)w;
    }
    return FT_OK;
}

/* fsync the directory holding `path` (the rename's durability). Filesystems that cannot sync a
 * directory say EINVAL; that is not an error of ours. */
static ft_status sync_dir(const char *path) {
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, (size_t)(slash - path) + (slash == path)) : strdup(".");
    if (!dir) return ft_error(FT_ERR_NOMEM, "out of memory");
    ft_status st = FT_OK;
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) st = ft_error_errno(FT_ERR_IO, errno, "cannot open directory '%s' to sync it", dir);
    else {
        if (fsync(dfd) != 0 && errno != EINVAL && errno != ENOTSUP)
            st = ft_error_errno(FT_ERR_IO, errno, "cannot fsync directory '%s'", dir);
        close(dfd);
    }
    free(dir);
    return st;
}

ft_status ft_atomic_write(const char *path, const ft_chunk *chunks, size_t n, uint64_t *bytes_out,
                          uint32_t *crc_out) {
    static atomic_ulong seq;
    if (!path || !path[0]) return ft_error(FT_ERR_INVALID_ARGUMENT, "empty file path");
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 64);
    if (!tmp) return ft_error(FT_ERR_NOMEM, "out of memory");
    snprintf(tmp, plen + 64, "%s.tmp.%ld.%lu", path, (long)getpid(), (unsigned long)atomic_fetch_add(&seq, 1));
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        ft_status st = ft_error_errno(FT_ERR_IO, errno, "cannot create '%s'", tmp);
        free(tmp);
        return st;
    }
    uint64_t bytes = 0;
    uint32_t crc = 0;
    ft_status st = FT_OK;
    for (size_t k = 0; k < n && st == FT_OK; k++) {
        if (!chunks[k].bytes) continue;
        st = write_all(fd, chunks[k].data, chunks[k].bytes, path);
        crc = ft_crc32c(crc, chunks[k].data, chunks[k].bytes);
        bytes += chunks[k].bytes;
    }
    if (st == FT_OK && fsync(fd) != 0) st = ft_error_errno(FT_ERR_IO, errno, "cannot fsync '%s'", tmp);
    if (close(fd) != 0 && st == FT_OK) st = ft_error_errno(FT_ERR_IO, errno, "cannot close '%s'", tmp);
    if (st == FT_OK && rename(tmp, path) != 0) st = ft_error_errno(FT_ERR_IO, errno, "cannot rename '%s' to '%s'", tmp, path);
    if (st != FT_OK) unlink(tmp);
    else st = sync_dir(path);
    free(tmp);
    if (st == FT_OK) {
        if (bytes_out) *bytes_out = bytes;
        if (crc_out) *crc_out = crc;
    }
    return st;
}
