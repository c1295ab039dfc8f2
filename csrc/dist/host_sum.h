/* The sum of the ranks' gradient tables for the ranks on one machine, in place in shared
 * memory (shared.h): every rank maps every rank's table; after a step's backward, rank r sums
 * its part of each bucket over the tables, in rank order, and writes the sum into every
 * table. No copies: each rank reads and writes its table's size once per step. The sum of each
 * float is made once, by one rank, in one order, so every rank ends with the same bits.
 *
 * Per step s, on each rank:  post(b, s) as bucket b's gradients are final (the backward: the
 * head first, then the top layer down), then finish(s, loss): for each bucket, wait until every
 * rank has posted it and sum this rank's part; say so; wait until every rank has; the loss is
 * the sum of the ranks' losses in rank order. A rank writes into another's table only where
 * that rank posted and has not yet finished, so a table is never written while its own rank
 * computes in it. Waits spin briefly, then yield, then sleep, and give up after `wait_s`
 * (FT_OK with *pending = 1: call finish again), so the caller can look at the other ranks
 * between slices. Each rank writes only its own control block (its counters), which the others
 * map read-only. */
#ifndef FT_DIST_HOST_SUM_H
#define FT_DIST_HOST_SUM_H
#include <stddef.h>
#include <stdint.h>

#include "fasttran.h"

typedef struct ft_host_sum ft_host_sum;

/* This rank's side: its table (a shared allocation: fd, byte offset, floats), the buckets
 * (offset, floats each, in the table), and `token`, which the other ranks check in its control
 * block. */
ft_status ft_host_sum_create(int rank, int world, int table_fd, size_t table_offset, size_t table_floats,
                             const int64_t *bucket_offset, const int64_t *bucket_floats, int n_buckets,
                             uint64_t token, ft_host_sum **out);
/* This rank's control block's file descriptor (for the others). */
int ft_host_sum_ctrl_fd(const ft_host_sum *h);
/* Map the other ranks' tables and control blocks: per rank its pid, table fd and byte offset, control fd
 * and token (this rank's entries are ignored). Fails when one cannot be opened or is not what it claims. */
ft_status ft_host_sum_connect(ft_host_sum *h, const int64_t *pids, const int64_t *table_fds,
                              const int64_t *table_offsets, const int64_t *ctrl_fds, const uint64_t *tokens);
/* Bucket b of step `step` (from 1, increasing) is final in this rank's table. */
ft_status ft_host_sum_post(ft_host_sum *h, int b, int64_t step);
/* See above: *pending = 1 when wait_s ran out first (call again with the same arguments); else
 * *loss_sum holds the ranks' losses summed and every table the summed gradients. */
ft_status ft_host_sum_finish(ft_host_sum *h, int64_t step, double loss, double wait_s, int *pending,
                             double *loss_sum);
void ft_host_sum_free(ft_host_sum *h);

/* The sums as the C training loop's reduction (ft_train_reduction, csrc/train/loop.c), no Python
 * in the way: begin counts the step (`step`: the steps begun so far, the sums' numbering, which the
 * caller keeps between calls), ready posts the bucket, finish waits for the sums in slices of
 * `slice_s` seconds and between slices calls watch(watch_arg, step, seconds waited) -- the caller
 * looks at the other ranks (exited, failed, moved on, silent, the timeout) and returns non-FT_OK to
 * give up. A watch that gave up while the sums completed (a rank finished them and went on between
 * the last look at the counters and the watch's look) is told so by dismiss(watch_arg) after one
 * last look, and the step goes on. A failure of the sums themselves (the ranks' steps disagree)
 * sets `failed`. */
typedef struct {
    ft_host_sum *h;
    int64_t step;
    double slice_s;
    ft_status (*watch)(void *arg, int64_t step, double waited_s);
    void (*dismiss)(void *arg);
    void *watch_arg;
    ft_status error;             /* a post's failure, returned by the step's finish */
    int failed;                  /* the sums (post / finish) failed, not the watch */
} ft_host_sum_loop;
ft_train_reduction ft_host_sum_reduction(ft_host_sum_loop *loop);

#endif
