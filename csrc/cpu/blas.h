/* The CPU backend's BLAS: OpenBLAS from the scipy-openblas32 wheel (symbols prefixed
 * scipy_). Only this header knows the prefix. */
#ifndef FT_CPU_BLAS_H
#define FT_CPU_BLAS_H
#include <cblas.h>

/* openblas_config.h includes <complex.h>, whose macro `I` would clobber our (N, I) shapes */
#undef I
#undef complex

#define ft_blas_sgemm scipy_cblas_sgemm
#define ft_blas_set_threads scipy_openblas_set_num_threads
#define ft_blas_get_threads scipy_openblas_get_num_threads
#define ft_blas_config scipy_openblas_get_config
#define ft_blas_corename scipy_openblas_get_corename
#define ft_blas_set_threads_callback scipy_openblas_set_threads_callback_function

/* Route OpenBLAS's parallel jobs onto our OpenMP team (called once, before the first GEMM). */
void ft_blas_use_openmp(void);
#endif
