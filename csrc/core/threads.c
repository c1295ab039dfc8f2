/* Thread count shared by OpenMP (fused row ops, attention blocks) and OpenBLAS (GEMMs). */
#include <omp.h>
#include <pthread.h>
#include <stdio.h>

#include "cpu/blas.h"
#include "fasttran.h"

/* OpenBLAS (pthreads build) keeps its own thread pool, whose workers spin after each GEMM and
 * fight our OpenMP workers for the same cores between a GEMM and the fused row op after it
 * (a quarter of the CPU time on 2 cores). OpenBLAS lets a callback run its jobs instead: we
 * run them on the OpenMP team, so there is one pool. Level-3 jobs synchronise with each
 * other, so they must run concurrently: one thread per job. Inside our own parallel regions
 * (attention blocks) BLAS is set to one thread, so no job list is ever split there. */
static void blas_jobs_on_openmp(int sync, openblas_dojob_callback dojob, int numjobs, size_t elsize,
                                void *jobdata, int dojob_data) {
    (void)sync;
#pragma omp parallel for num_threads(numjobs) schedule(static, 1)
    for (int i = 0; i < numjobs; i++) dojob(i, (char *)jobdata + (size_t)i * elsize, dojob_data);
}

static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
static void blas_init(void) { ft_blas_set_threads_callback(blas_jobs_on_openmp); }
void ft_blas_use_openmp(void) { pthread_once(&blas_once, blas_init); }

int ft_num_threads(void) { return omp_get_max_threads(); }

void ft_set_num_threads(int n) {
    if (n < 1) n = 1;
    omp_set_num_threads(n);
    ft_blas_set_threads(n);
}

const char *ft_blas_name(void) {
    static char buf[256];
    snprintf(buf, sizeof buf, "%s (core %s)", ft_blas_config(), ft_blas_corename());
    return buf;
}
