/* The CPU backend's matrix micro-kernels: one register tile of C (MR x NR) += A B over a
 * K range, for AVX-512, AVX2+FMA and portable C, chosen once at run time (CPUID, or the
 * FASTTRAN_CPU_ISA environment variable: amx | avx512 | avx2 | generic).
 *
 * "amx" is "avx512" whose linear layers run on Intel's AMX tiles instead, at float32 accuracy
 * (amx.h); attention keeps the AVX-512 tile.
 *
 * The one rule that makes the encoder's results independent of the batch, the padding and the
 * thread count: every C element is one sequential chain over k = 0..K-1 (an FMA per k on the
 * SIMD paths, a multiply then an add on the portable path), whatever the tile it lands in, the
 * rows beside it, the K blocking or the thread that runs it. A kernel always computes MR rows
 * (rows past m read zero-padded A and are not stored) and masks columns past n, so a short
 * tile runs exactly the same instructions per element as a full one. Different paths may give
 * different bits (FMA against multiply-add); each path on its own is invariant. */
#ifndef FT_CPU_KERNELS_H
#define FT_CPU_KERNELS_H
#include <stdint.h>

/* C (m x n, row stride ldc) = [C +] A B over K.
 *   a:  MR rows of K floats, row stride lda, all readable (rows >= m are computed, not stored:
 *       a short block passes a zero-padded copy, ft_copy_rows)
 *   b:  element (k, j) at b[k * ldb + j], j < n <= NR (columns >= n are never read)
 *   accumulate: 0 starts from zero, 1 continues from the values in C */
typedef void (*ft_tile_fn)(int64_t K, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                           int64_t ldc, int m, int n, int accumulate);

/* the same tile, then C = act(C + bias) on its registers before the store (the operations of
 * ft_cpu_epilogue on the stored values, hence the same bits): bias (n) or NULL, act an
 * ft_activation or -1 (tanh: libm's tanhf on the stored values, as ft_cpu_epilogue) */
typedef void (*ft_tile_epi_fn)(int64_t K, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                               int64_t ldc, int m, int n, int accumulate, const float *bias, int act);

typedef struct {
    const char *name;   /* "amx", "avx512", "avx2", "generic" */
    int mr, nr;
    ft_tile_fn tile;
    ft_tile_epi_fn tile_epi;   /* NULL: tile, then ft_cpu_epilogue */
    int amx;            /* 1: linear layers run on the AMX tiles (amx.h); `tile` serves the rest */
} ft_cpu_kernel;

/* c (m x n tile, row stride ldc) = act(c + bias): bias (n) or NULL, act an ft_activation or -1;
 * on the kernel set's registers (vecmath.h; tanh with libm's tanhf), portable C on "generic" */
void ft_cpu_epilogue(float *c, int64_t ldc, int m, int n, const float *bias, int act);

/* K^T in key panels for attention: panel p (hs x NR floats), element (d, j) = k[(p NR + j) ld + d],
 * zero for keys >= nk; 8 x 8 register transposes where a block is whole */
void ft_cpu_pack_keys_t(float *kp, const float *k, int64_t ld, int64_t nk, int64_t hs);

/* s[0..n) = softmax(scale s) in place: max, exp, sum in 16 fixed lanes (rowfun.h's order);
 * stats (or NULL) = {m, 1 / sum}: the maximum of scale s and the inverse of the sum of exp(scale s - m) */
void ft_cpu_softmax_row(float *s, int64_t n, float scale, float *stats);

/* dh[0..n) = df * act'(x) on the kernel set's registers (vecmath.h's ft_act_grad512/256; the
 * portable path: mathfun.h's ft_act_gradf); dh may alias df */
void ft_cpu_act_grad_row(float *dh, const float *df, const float *x, int64_t n, int act);

/* ft_cpu_features()' bit for the C model of AMX-INT8's tiles (FASTTRAN_CPU_ISA=amx_int8_emulated:
 * test infrastructure, run where there is AVX512_VNNI but no AMX; amx_int8.c) */
#define FT_CPU_AMX_INT8_MODEL (1u << 16)

/* The kernel set of this process (chosen on first call). */
const ft_cpu_kernel *ft_cpu_kernel_get(void);

/* dst (mr x kc, row stride kc) = rows [0, m) of a (row stride lda), columns [0, kc); rows m..mr-1
 * zero: the A block of a tile with fewer than MR rows */
static inline void ft_copy_rows(float *dst, const float *a, int64_t lda, int m, int64_t kc, int mr) {
    for (int i = 0; i < mr; i++)
        for (int64_t k = 0; k < kc; k++) dst[i * kc + k] = i < m ? a[i * lda + k] : 0.0f;
}
#endif
