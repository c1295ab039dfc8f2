/* Host memory the other processes of this machine can map: an anonymous file (memfd) mapped
 * MAP_SHARED, which a process with the same user opens as /proc/<pid>/fd/<fd>. A training
 * model's gradient table lives in one when its maker asks (ft_layer_stack_create /
 * ft_model_create's shared_grads: a data-parallel rank's model), so that the ranks on one machine
 * sum each other's gradients in place (host_sum.c) instead of copying them through sockets. */
#ifndef FT_DIST_SHARED_H
#define FT_DIST_SHARED_H
#include <stddef.h>

#include "backend.h"

/* `bytes` of zeroed shared host memory, page-aligned. FT_ERR_UNSUPPORTED when the OS has no memfd. */
ft_status ft_shared_alloc(size_t bytes, void **out);
/* 1 (and unmapped) when p is the start of a shared allocation, else 0 (p untouched). */
int ft_shared_free(void *p);
/* 1 when p lies in a shared allocation: its file descriptor, p's offset in it and the bytes from p to its
 * end; else 0. */
int ft_shared_find(const void *p, int *fd, size_t *offset, size_t *bytes);

/* A gradient table: shared host memory on the CPU when `shared` (plain memory if the OS refuses: the
 * ranks then sum through the process group), else the backend's alloc. Freed by be->free either way
 * (the CPU backend knows both). */
ft_status ft_backend_alloc_grads(ft_backend *be, size_t bytes, int shared, void **out);

#endif
