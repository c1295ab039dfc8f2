/* Linear layers on Intel AMX (Sapphire Rapids and later) at float32 accuracy: "bf16x6".
 *
 * Every float32 x is split into three bfloat16 parts, x = h + m + l (h = bf16(x),
 * m = bf16(x - h), l = bf16(x - h - m)): 24 significant bits, all of x but its last rounding.
 * A product a b is then the six terms of order <= 2,
 *     a_h b_h  +  (a_h b_m + a_h b_l + a_m b_m + a_m b_h + a_l b_h),
 * dropping a_m b_l, a_l b_m, a_l b_l (below 2^-26 of |a b|). The tiles multiply bf16 pairs
 * exactly and add in float32. The main term and the five corrections add into two separate
 * accumulators, so the large one is rounded only as often as a float32 GEMM rounds and the
 * small one's roundings are 2^-8 smaller; out = main + corrections. Measured on MiniLM's weights:
 * the error against float64 is that of a float32 GEMM (tests/test_cpu_kernels.py); three terms
 * (bf16x3, dropping those of order 2) were about 10x less accurate in the same simulation: not
 * used.
 *
 * The same invariance rule as the SIMD kernels (kernels.h): a row's result depends only on
 * its own row and the weights. Rows go through the tiles 32 at a time (zero rows fill a short
 * block), the K order (steps of 32, the six terms in a fixed order) never depends on M, N,
 * the blocking or the thread.
 *
 * Weights are packed once (ft_amx_pack_panel): panel p holds output columns [32p, 32p + 32),
 * per K step of 32 the three parts of two 16-column halves, each a 16 x 64-byte tile of
 * (k pair, column, k parity) -- the tiles' VNNI layout -- K and the columns zero-padded. */
#ifndef FT_CPU_AMX_H
#define FT_CPU_AMX_H
#include <stddef.h>
#include <stdint.h>

#define FT_AMX_NR 32   /* columns per panel */
#define FT_AMX_MR 32   /* rows per block */

/* 1 when this CPU has AMX-BF16 and AVX512-BF16 and the OS let this process use the tiles
 * (asked once: arch_prctl ARCH_REQ_XCOMP_PERM); 0 otherwise, and always 0 in builds whose
 * compiler has no AMX support. */
int ft_amx_usable(void);
/* ask the OS for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM): 1 when granted */
int ft_amx_tile_permission(void);
/* palette 1, every one of the 8 tiles 16 rows x 64 bytes (call on the thread that runs the tiles) */
void ft_amx_configure_tiles(void);

/* bytes of the packed copy of an (N, K) weight */
size_t ft_amx_packed_bytes(int64_t N, int64_t K);

/* Where a matrix's (line, k) element lives: line-major (k contiguous: src[line * ld + k]) or
 * k-major (src[k * ld + line], a transposed operand of a GEMM, read through 16 x 16 register
 * transposes: never copied whole) */
typedef struct {
    const float *src;
    int64_t ld;
    int kmajor;
} ft_amx_matrix;

/* pack panel p (output columns [32p, 32p + 32)) of the (N, K) weight w into its place in dst;
 * nparts 3 (all), or 1: only h, for products with bf16_only (the other parts left unwritten) */
void ft_amx_pack_panel(uint16_t *dst, ft_amx_matrix w, int64_t N, int64_t K, int64_t p, int nparts);

#define FT_AMX_KSTEPS 8     /* K steps of 32 per K block... */
#define FT_AMX_WHOLE_K 48   /* ...when K has more steps than this; else one block of all of K */

/* K per K block (at most FT_AMX_KSTEPS steps): a task's weights are read one K block at a time */
int64_t ft_amx_kblock(int64_t K);

/* bytes of one thread's scratch for blocks of up to `rows` rows of K and `panels` panels */
size_t ft_amx_scratch_bytes(int64_t rows, int64_t K, int64_t panels);

/* One product out = alpha (x w^T) + beta out, or out = act(x w^T + bias):
 * x (M, K) as an ft_amx_matrix; w packed (N, K); out (M, N) with row stride ldo; beta 0: out is
 * only written; bias (N) or NULL; act an ft_activation or -1 (bias, act with alpha 1, beta 0
 * and out_t 0 only). */
typedef struct {
    ft_amx_matrix x;
    int64_t K, N;
    const uint16_t *wp;
    float *out;
    int64_t ldo;
    int out_t;              /* 1: out is stored transposed, element (r, c) at out[c * ldo + r] */
    float alpha, beta;
    const float *bias;
    int act;
    int bf16_only;          /* 1: the main term a_h b_h alone -- products of the inputs rounded to
                             * bf16, float32 sums (mixed precision, the backend's gemm_prec); 0: all
                             * six terms, float32 accuracy */
} ft_amx_product;

/* rows [r0, r1) x the output columns of panels [p0, p1) of one product. scratch:
 * ft_amx_scratch_bytes(r1 - r0, K, p1 - p0), 64-byte aligned. split 0: K is one block
 * (ft_amx_kblock(K) >= K) and scratch already holds these rows split by the previous call (the
 * same rows, other panels); 1: split them first. */
void ft_amx_linear_rows(const ft_amx_product *g, int64_t r0, int64_t r1, int64_t p0, int64_t p1, void *scratch,
                        int split);
#endif
