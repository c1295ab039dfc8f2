/* Attention on the CPU, one (batch, head) block at a time: S = Q K^T / sqrt(hs) for that
 * head only (T x Tk scratch per thread, never all heads' scores at once), masked softmax in
 * place, then P V written straight into the head's columns of ctx. Blocks run in parallel
 * over OpenMP threads, each calling single-threaded BLAS (a multi-threaded GEMM on a
 * 128 x 128 x 32 block spends more time waking threads than multiplying).
 *
 * Padding: keys at or after key_len[b] are all masked, so the GEMMs only span the first
 * key_len[b] keys (right padding costs no score work). Query rows of padded tokens are still
 * computed, because Hugging Face returns them too. A sequence with no real key at all gets a
 * zero attention output, as transformers' default (SDPA) path and torch's SDPA give (its eager
 * path would give uniform weights instead). */
#include <math.h>
#include <omp.h>

#include "blas.h"
#include "cpu_ops.h"
#include "mathfun.h"

size_t cpu_attention_scratch_bytes(ft_backend *be, int64_t B, int64_t T, int64_t NH) {
    (void)be; (void)B; (void)NH;
    return (size_t)omp_get_max_threads() * (size_t)T * (size_t)T * sizeof(float);
}

static void softmax_rows(float *S, const float *keymask, int64_t T, int64_t Tk) {
    for (int64_t i = 0; i < T; i++) {
        float *s = S + i * Tk;
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < Tk; j++) {
            float v = keymask[j] != 0.0f ? s[j] : -INFINITY;
            mx = v > mx ? v : mx;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < Tk; j++) {
            float e = keymask[j] != 0.0f ? ft_expf(s[j] - mx) : 0.0f;
            s[j] = e;
            sum += e;
        }
        float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t j = 0; j < Tk; j++) s[j] *= inv;
    }
}

ft_status cpu_attention_forward(ft_backend *be, float *ctx, const float *qkv, const float *keymask,
                                const int32_t *key_len, int64_t B, int64_t T, int64_t C, int64_t NH,
                                float *scratch) {
    (void)be;
    const int64_t hs = C / NH, ld = 3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    /* each worker runs whole blocks: BLAS must not split them further (its pool would contend
     * with ours for the same cores) */
    int blas_threads = ft_blas_get_threads();
    ft_blas_set_threads(1);
#pragma omp parallel
    {
        float *S = scratch + (size_t)omp_get_thread_num() * (size_t)T * (size_t)T;
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * NH; bh++) {
            int64_t b = bh / NH, h = bh % NH;
            const float *q = qkv + b * T * ld + h * hs, *k = q + C, *v = q + 2 * C;
            const int64_t Tk = key_len[b];
            float *out = ctx + b * T * C + h * hs;
            if (Tk == 0) {   /* no real key: zero output */
                for (int64_t i = 0; i < T; i++) memset(out + i * C, 0, (size_t)hs * sizeof(float));
                continue;
            }
            /* real query rows [0, Tk) and padded ones [Tk, T) in separate GEMMs: BLAS picks
             * its kernel (and so its rounding) by the problem size, and this keeps every real
             * token's result a function of the real length only. An example then gets the same
             * bits whatever its batch is padded to, which is what lets the Trainer's
             * encoder-in-the-loop baseline match the activation cache bit for bit. */
            for (int part = 0; part < 2; part++) {
                const int64_t r0 = part ? Tk : 0, rows = part ? T - Tk : Tk;
                if (rows == 0) continue;
                ft_blas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)rows, (blasint)Tk, (blasint)hs, scale,
                              q + r0 * ld, (blasint)ld, k, (blasint)ld, 0.0f, S, (blasint)Tk);
                softmax_rows(S, keymask + b * T, rows, Tk);
                ft_blas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)rows, (blasint)hs, (blasint)Tk, 1.0f,
                              S, (blasint)Tk, v, (blasint)ld, 0.0f, out + r0 * C, (blasint)C);
            }
        }
    }
    ft_blas_set_threads(blas_threads);
    return FT_OK;
}
