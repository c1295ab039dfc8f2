/* The CPU backend's services and ops, cpu_<name> for every entry of the op list (backend.h);
 * one file per op family, the table in backend_cpu.c. */
#ifndef FT_CPU_OPS_H
#define FT_CPU_OPS_H
#include <string.h>

#include "backend.h"
#include "core/dtype.h"
#include "core/status.h"

#define FT_CPU_SERVICE(ret, name, params) ret cpu_##name params;
#define FT_CPU_OP(name, params, args) ft_status cpu_##name params;
FT_BACKEND_SERVICES(FT_CPU_SERVICE)
FT_BACKEND_OPS(FT_CPU_OP)
#undef FT_CPU_SERVICE
#undef FT_CPU_OP

/* the encoder ops' storage type: the CPU computes in float32 only */
#define FT_CPU_F32_ONLY(dt, op)                                                                       \
    do {                                                                                            \
        if ((dt) != FT_F32)                                                                         \
            return ft_error(FT_ERR_UNSUPPORTED, "%s: the CPU backend computes in float32, not %s; "  \
                            "half-precision storage runs on CUDA (the CPU's bf16 and int8 products: "   \
                            "linear_lp_*)", op, ft_dtype_name(dt));                                   \
    } while (0)

/* gemm on the linear layers' AMX kernels (linear.c), same contract as the op: taken when the
 * kernel set is "amx" and the product is large enough to pay for packing op(B) once per call
 * (ft_cpu_gemm_on_amx); OpenBLAS otherwise */
int ft_cpu_gemm_on_amx(int64_t M, int64_t N, int64_t K);
ft_status ft_cpu_amx_gemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                          int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc, int bf16_only);

/* gemm_prec's bf16 products on AVX512_BF16 (lowp_ops.c: op(B)^T packed as bf16 once per call, op(A)'s
 * rows rounded as the product runs, vdpbf16ps, float32 sums): taken for products of at least
 * 16 x 16 x 32 and 2^18 multiply-adds where there is no AMX */
int ft_cpu_bf16_gemm_fast(int64_t M, int64_t N, int64_t K);
ft_status ft_cpu_bf16_gemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                           int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);

/* v rounded to bf16 (nearest even; a NaN stays a quiet NaN), as float: the same bits as
 * ft_bf16_to_f32(ft_f32_to_bf16(v)), inline and branch-free so row loops vectorise */
static inline float ft_cpu_round_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const uint32_t o = (u & 0x7fffffffu) > 0x7f800000u ? (u & 0xffff0000u) | 0x00400000u : r;
    memcpy(&v, &o, sizeof v);
    return v;
}

/* dst[0..n) = x[0..n) rounded to prec (FT_BF16 / FT_F16, nearest even: what tensor cores read);
 * dst may be x. Serial (a worker inside a parallel region calls it) */
static inline void ft_cpu_round_row(float *dst, const float *x, int64_t n, ft_dtype prec) {
    if (prec == FT_BF16) {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) dst[j] = ft_cpu_round_bf16(x[j]);
    } else {
        for (int64_t j = 0; j < n; j++) dst[j] = ft_f16_to_f32(ft_f32_to_f16(x[j]));
    }
}

/* the products' precision an op was given (gemm_prec, the attention ops): float32, bfloat16 or
 * float16, else the error naming op (backend_cpu.c) */
ft_status ft_cpu_check_prec(ft_dtype prec, const char *op);

/* row[0..n) = row * keep_scale where ft_dropout_keep(key, e0 + j, thr), else 0; mask[j] = kept
 * (mask NULL: not stored). Vectorised over j (train_ops.c). */
void ft_cpu_dropout_row(float *row, uint8_t *mask, int64_t n, uint64_t key, uint64_t e0, uint32_t thr,
                        float keep_scale);

/* attention_train_forward's work (attention.c): the inference tasks, keeping each (sequence,
 * head)'s probabilities (probs) and/or their rows' softmax statistics (stats, (N, NH, 2)) and
 * dropping them out before P V, on at most `workers` threads; prec FT_BF16 / FT_F16: Q, K, V and
 * the dropped probabilities rounded to it before their products (float32 sums); half >= 0: local
 * attention, row i sees the keys j with |i - j| <= half (the kept row 0 elsewhere; no dropout) */
ft_status ft_cpu_attention_train_heads(ft_dtype prec, float *ctx, float *probs, float *stats, uint8_t *dmask,
                                       const float *qkv, const int32_t *seqs, int64_t B, int64_t C, int64_t NH, float p,
                                       uint64_t key, int workers, int64_t half);

/* one (sequence, head) of inference attention, exactly as attention_forward computes it (the
 * same bits): out (nq rows, stride C) from q = the head's Q columns of the sequence's first row of
 * qkv (stride 3C), its first nk rows the keys; scratch: ft_cpu_attention_head_floats(maxk, hs)
 * floats for sequences of at most maxk keys (attention.c; attention_heads.c's exact heads) */
size_t ft_cpu_attention_head_floats(int64_t maxk, int64_t hs);
void ft_cpu_attention_head(float *scratch, int64_t maxk, float *out, const float *q, int64_t nq, int64_t nk,
                           int64_t hs, int64_t C);
#endif
