/* Reduced-precision linear layers of the CPU backend: int8 and bf16 products.
 *
 * int8: weights W (N, K) int8 with one float32 scale per output channel (row of W, symmetric:
 * w ~ s_n q, q in [-127, 127]); activations quantized per row when the layer runs (dynamic,
 * asymmetric: x ~ s_m (u - z_m), u in [0, 255], z_m the row's zero point, so 0 is exact). The
 * products are exact: acc = sum_k u q in int32 (no saturation anywhere: |acc| <= 255 * 128 * K,
 * K <= FT_LP_MAX_K), then acc - z_m colsum_n (colsum_n = sum_k q, packed with the weights) is
 * sum_k (u - z_m) q exactly, on every kernel (q = -128 too: 255 * 128 * K < 2^31). The epilogue dequantizes it,
 *     y = ((float)(acc - z_m colsum_n) * s_m) * s_n  [+ bias_n, activation]
 * (two roundings, in that order, on every kernel), so every path gives the same bits before the
 * activation. A row's quantization depends on that row alone: results stay independent of the
 * batch, the padding and the thread count.
 *
 * bf16: weights rounded to bf16 when packed, activations rounded to bf16 (nearest even) when the
 * layer runs, products exact, float32 sums (vdpbf16ps: denormal inputs read as zero, sums flushed
 * to zero below 2^-126).
 *
 * Layouts (both formats). A "group" is 32 bits: 4 int8 (u8 activations, s8 weights: the
 * vpdpbusd / tdpbusd form), 2 int16 (the int8 fallback without VNNI: u8 and s8 widened to int16,
 * multiplied by vpmaddwd, exact) or 2 bf16. K is zero-padded to Kp = a multiple of 64.
 *   packed weights: panels of 16 output columns; panel p = Kp / kgroup rows of 64 bytes, row g =
 *   16 columns x one group (column j's group at bytes 4j..4j+3: the VNNI layout, which is also
 *   AMX's B-tile layout); int8 adds col_scale (float) and col_sum (int32) for the 16 P columns.
 *   prepared rows (activations): Mp rows (M rounded up to 48, the extra rows zero) of Kp elements
 *   (u8, int16 or bf16), and for int8 each row's scale and zero point.
 * A register tile is MR rows x NR columns (NR = 16: one panel, or 32: two adjacent panels). */
#ifndef FT_CPU_LOWP_H
#define FT_CPU_LOWP_H
#include <stddef.h>
#include <stdint.h>

#include "fasttran.h"

#define FT_LP_PANEL 16        /* output columns per packed panel */
#define FT_LP_KALIGN 64       /* K padded to a multiple of this */
#define FT_LP_MALIGN 48       /* prepared rows: M padded to a multiple of this (every MR divides it) */
#define FT_LP_MAX_K 65536     /* int8: 255 * 128 * K < 2^31 */

/* the epilogue of a tile's last K block (NULL: store the raw accumulators) */
typedef struct {
    /* int8: the tile's rows' scales and zero points, its columns' scales and sums */
    const float *row_scale;
    const int32_t *row_zp;
    const float *col_scale;
    const int32_t *col_sum;
    int raw;              /* int8: store acc - z colsum as int32 (gemm_i8), no dequantization */
    const float *bias;    /* the tile's columns, or NULL */
    int act;              /* ft_activation or -1 (tanh: libm on the stored values, as ft_cpu_epilogue) */
} ft_lp_epi;

/* c (m x n, row stride ldc elements) = [c +] A B over the groups [0, kg) of a K block.
 *   a: MR rows of groups, row stride lda bytes, all readable (rows >= m are computed, not stored)
 *   b: the tile's first panel at the K block's first group; a second panel (columns 16..31 of the
 *      tile, n > 16) at b + pstride bytes
 *   c: int32 (int8) or float (bf16) accumulators, read when accumulate; on the last K block with
 *      epi the finished floats (int8: the dequantized values; raw: int32) are stored there */
typedef void (*ft_lp_tile_fn)(int64_t kg, const uint8_t *a, int64_t lda, const uint8_t *b, int64_t pstride, void *c,
                              int64_t ldc, int m, int n, int accumulate, const ft_lp_epi *epi);

typedef struct {
    const char *name;     /* int8: "amx_int8", "avx512_vnni", "avx_vnni", "avx512bw", "avx2", "generic";
                           * bf16: "avx512_bf16" */
    ft_dtype wt;          /* FT_I8 or FT_BF16 */
    int mr, nr;           /* register tile */
    int elem;             /* bytes per element in the layouts: 1 (u8 / s8), 2 (int16, bf16) */
    ft_lp_tile_fn tile;   /* NULL for AMX (rows go through amx_int8.c) */
    int amx;              /* 1: AMX-INT8 tiles; 2: their C model (FASTTRAN_CPU_ISA=amx_int8_emulated, tests) */
    int pays;             /* measured faster than the float32 kernels of the same CPU in the linear layers
                           * (benchmarks/int8_gemm.py): the encoder uses it; else int8 weights run dequantized */
} ft_lp_kernel;

/* this process's kernel for wt (FT_I8 or FT_BF16), from ft_cpu_features(); NULL: none (bf16 without
 * AVX512_BF16) */
const ft_lp_kernel *ft_lp_kernel_for(ft_dtype wt);
/* the AVX-512 VNNI kernel (AMX's blocks finish through its epilogue) */
const ft_lp_kernel *ft_lp_vnni512(void);

/* Layout of the packed weights of an (N, K) product for kernel kl */
typedef struct {
    int64_t Kp, groups;       /* padded K; groups per panel row block (Kp * elem / 4) */
    int64_t panels;           /* of 16 columns */
    size_t panel_bytes;       /* groups * 64 */
    size_t scale_off, sum_off;/* int8: offsets of col_scale and col_sum (bytes) */
    size_t bytes;             /* total, a multiple of 64 */
} ft_lp_layout;
ft_lp_layout ft_lp_layout_of(const ft_lp_kernel *kl, int64_t N, int64_t K);

/* pack panel p of an (N, K) weight: int8 q (N, K) row-major with scales (N), or (bf16) float w
 * as a matrix line-major (w[n * ld + k]) or k-major (w[k * ld + n]) */
void ft_lp_pack_panel_i8(const ft_lp_kernel *kl, uint8_t *packed, const int8_t *q, const float *scale, int64_t N,
                         int64_t K, int64_t p);
void ft_lp_pack_panel_bf16(const ft_lp_kernel *kl, uint8_t *packed, const float *w, int64_t ld, int kmajor, int64_t N,
                           int64_t K, int64_t p);

/* Prepared activations */
typedef struct {
    uint8_t *data;            /* Mp rows of lda bytes */
    int64_t lda, Mp, Kp;
    float *scale;             /* int8: (Mp) */
    int32_t *zp;              /* int8: (Mp) */
} ft_lp_rows;
/* bytes of the prepared rows of an (M, K) operand (64-byte aligned parts) */
size_t ft_lp_rows_bytes(const ft_lp_kernel *kl, int64_t M, int64_t K);
/* carve the prepared rows out of mem (ft_lp_rows_bytes) */
void ft_lp_rows_init(ft_lp_rows *r, const ft_lp_kernel *kl, void *mem, int64_t M, int64_t K);
/* prepare rows [r0, r1) of x (line-major x[m * ld + k], or k-major x[k * ld + m]); rows >= M zero.
 * int8: per row lo = min(0, min x), hi = max(0, max x), s = (hi - lo) / 255, z = rint(-lo * (1 / s)),
 * u = clamp(rint(x * (1 / s)) + z, 0, 255) (s = 0, z = 0 for a zero row; a row with a non-finite
 * value gets s = NaN, so its outputs are NaN as a float32 product's would be); bf16: nearest even. */
#define FT_LP_GATHER 16   /* k-major rows gathered at a time: tmp holds FT_LP_GATHER x K floats */
void ft_lp_prepare_rows(const ft_lp_kernel *kl, ft_lp_rows *r, const float *x, int64_t ld, int kmajor, int64_t M,
                        int64_t K, int64_t r0, int64_t r1, float *tmp);
/* the int8 quantizer of one row alone (the op quantize_rows): u (K) u8, *scale, *zp */
void ft_lp_quantize_row(const float *x, int64_t K, uint8_t *u, float *scale, int32_t *zp);
/* a weight's symmetric per-row quantization: q (N, K) = rint(w * (127 / amax)) in [-127, 127],
 * scale (N) = amax / 127 (0 for a zero row); FT_ERR_INVALID_ARGUMENT when a value is not finite */
ft_status ft_lp_quantize_weight(int8_t *q, float *scale, const float *w, int64_t N, int64_t K, const char *what);

/* out (M, N) = the product of prepared rows x (M, K) and packed weights (N, K) on linear.c's tasks:
 * act(. + bias), or (residual != NULL) LayerNorm(residual + . + bias) per row; raw (int8): the exact
 * int32 sums acc - z colsum, no dequantization. out's row stride ldo (elements). */
ft_status ft_cpu_lp_product(const ft_lp_kernel *kl, const ft_lp_rows *x, const void *packed, int64_t M, int64_t K,
                            int64_t N, void *out, int64_t ldo, const float *bias, int act, const float *residual,
                            const float *gamma, const float *beta, float eps, int raw);

/* AMX-INT8 (amx_int8.c): 1 when the CPU has AMX-INT8 tiles and the OS granted the tile state */
int ft_amx_int8_usable(void);
/* the int8 product of prepared rows [r0, r1) (r0 a multiple of 32) x panels [p0, p1) (p0 even) on
 * the tiles (modelled: on their C model), all of K in the accumulator tiles; each finished 32 x 32
 * block through vnni's epilogue (the AVX-512 VNNI kernel); e's pointers index rows and columns from
 * 0; out (int32 / float) row stride ldo; scratch ft_amx_int8_scratch_bytes() */
void ft_amx_int8_rows(const ft_lp_kernel *vnni, int modelled, const ft_lp_rows *x, const uint8_t *packed,
                      const ft_lp_layout *lay, int64_t N, void *out, int64_t ldo, int64_t r0, int64_t r1, int64_t p0,
                      int64_t p1, const ft_lp_epi *e, void *scratch);
size_t ft_amx_int8_scratch_bytes(void);
#endif
