/* Linear layers of the CPU backend: weights packed once per model into the micro-kernel's
 * panel layout, then out = x W^T with the bias, the activation, or the residual and the
 * LayerNorm applied to each block of rows while it is still in cache.
 *
 * Packed layout (per kernel set, NR = its panel width): panel p holds output columns
 * [p NR, p NR + NR) as K rows of NR floats, element (k, j) = W[p NR + j][k]; the last panel is
 * zero-padded (AMX: amx.h's bf16x6 layout). A GEMM is cut into tasks of up to MC rows x a range
 * of panels, run in any order by any thread (dynamic schedule: a thread slowed by another
 * process takes fewer tasks), column range first so that consecutive tasks share their weights
 * in L2. Inside a task the K range is cut into KC blocks; the task's KC x (its columns) block of
 * weights stays in L2 while each block of MR rows of x, read in place from L1, sweeps across it
 * (A's rows are never packed: only a last block of fewer than MR rows is copied, zero-padded);
 * on AMX the task's rows are split into bf16 parts one K block at a time and each 32 x 32 block
 * meets the task's panels in the tiles (ft_amx_linear_rows). None of this changes a single bit
 * of the result (kernels.h, amx.h): every element is one chain over k in a fixed order. */
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include "core/status.h"
#include "amx.h"
#include "cpu_ops.h"
#include "kernels.h"
#include "lowp.h"
#include "mathfun.h"
#include "rowfun.h"

#define MC 96     /* rows per task (a multiple of every MR) */
#define AMX_ONE_CHUNK_PANELS 32
/* A task's block of weights (at most KC_MAX x NCB(kr) floats) should stay in L2: half of this
 * core's L2 (1 MiB on a 2 MiB Sapphire Rapids L2: k blocks of 256 x 512 columns; 128 KiB on a
 * 256 KiB Haswell L2: 256 x 128). K blocks of at most 256 keep a tile's A rows and its panel's
 * slice of weights in L1 together (AVX2: 6 KiB + 16 KiB; AVX-512: 12 KiB + 32 KiB; with 512,
 * 3-4% slower on both, measured). The blocking never changes a result, only the speed. */
static int64_t l2_budget_floats(void) {
    static int64_t budget;
    if (!budget) {
        long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        if (l2 <= 0) l2 = 1 << 20;   /* unknown: assume 1 MiB */
        budget = (int64_t)l2 / 2 / (int64_t)sizeof(float);
    }
    return budget;
}
#define KC_MAX(kr) ((void)(kr), 256)
static int64_t NCB(const ft_cpu_kernel *kr) {
    int64_t cols = l2_budget_floats() / KC_MAX(kr) / kr->nr * kr->nr;
    return cols < kr->nr ? kr->nr : cols > 512 ? 512 : cols;
}

/* AMX: columns per task so that its K block of packed weights (6 bytes per element) fills about
 * half of L2 */
static int64_t NCB_amx(int64_t K) {
    int64_t cols = l2_budget_floats() * (int64_t)sizeof(float) / (6 * ft_amx_kblock(K)) / FT_AMX_NR * FT_AMX_NR;
    return cols < FT_AMX_NR ? FT_AMX_NR : cols > 512 ? 512 : cols;
}

size_t cpu_packed_weight_bytes(ft_backend *be, int64_t N, int64_t K) {
    (void)be;
    if (ft_cpu_kernel_get()->amx) return ft_amx_packed_bytes(N, K);
    const int64_t nr = ft_cpu_kernel_get()->nr;
    return (size_t)((N + nr - 1) / nr) * (size_t)nr * (size_t)K * sizeof(float);
}

ft_status cpu_pack_weight(ft_backend *be, float *packed, const float *w, int64_t N, int64_t K) {
    (void)be;
    const int64_t nr = ft_cpu_kernel_get()->nr, panels = (N + nr - 1) / nr;
    if (ft_cpu_kernel_get()->amx) {
#pragma omp parallel for schedule(static) num_threads(ft_num_threads())
        for (int64_t p = 0; p < panels; p++) ft_amx_pack_panel((uint16_t *)packed, (ft_amx_matrix){w, K, 0}, N, K, p, 3);
        return FT_OK;
    }
#pragma omp parallel for schedule(static) num_threads(ft_num_threads())
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * K * nr;
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < nr; j++) {
                const int64_t col = p * nr + j;
                dst[k * nr + j] = col < N ? w[col * K + k] : 0.0f;
            }
    }
    return FT_OK;
}

typedef struct {
    const float *x, *w;     /* x (M, K) with row stride ldx (AMX: or k-major, x_kmajor); w packed */
    int64_t ldx;
    int x_kmajor;
    float *out;             /* (M, N) with row stride ldo (AMX: or stored transposed, out_t) */
    int64_t ldo;
    int out_t;
    int64_t M, K, N;
    float alpha, beta;      /* AMX: out = alpha x w^T + beta out; elsewhere 1 and 0 */
    const float *bias;      /* (N) or NULL */
    int act;                /* ft_activation, or -1 for none */
    const float *residual;  /* (M, N): out = LN(residual + out + bias) per row, or NULL */
    const float *gamma, *beta_ln;
    float eps;
    int bf16_only;          /* AMX: products of bf16-rounded inputs (ft_amx_product.bf16_only) */
    /* reduced precision (lowp.h): x is prepared rows, w packed by lp; raw: int8 sums stored as int32 */
    const ft_lp_kernel *lp;
    const ft_lp_rows *xr;
    const ft_lp_layout *lay;
    int raw;
} linear_args;

/* K in equal blocks of at most KC_MAX (384 -> 2 x 192, 1536 -> 6 x 256) */
static int64_t kblock(const ft_cpu_kernel *kr, int64_t K) {
    const int64_t blocks = (K + KC_MAX(kr) - 1) / KC_MAX(kr);
    return (K + blocks - 1) / blocks;
}

/* groups per K block of a reduced-precision product: at most 256 (a 12-row block of A and a
 * 32-column slice of weights: 12 + 32 KiB, as KC_MAX floats), equal blocks */
static int64_t kblock_lp(int64_t groups) {
    const int64_t blocks = (groups + 255) / 256;
    return (groups + blocks - 1) / blocks;
}

/* columns of a reduced-precision task's chunk: its K block of weights in half of L2 */
static int64_t ncb_lp(const ft_lp_kernel *kl, int64_t groups) {
    const int64_t cols = l2_budget_floats() * (int64_t)sizeof(float) / (4 * kblock_lp(groups)) / kl->nr * kl->nr;
    return cols < kl->nr ? kl->nr : cols > 512 ? 512 : cols;
}

/* rows [r0, r1) x tiles [u0, u1) (of NR columns) of a reduced-precision product: the same loops as
 * run_task's, over prepared rows and packed groups; int8 sums wait in `out` as int32 between K
 * blocks (the same 4 bytes as the floats they become) */
static void run_task_lp(const linear_args *a, int64_t r0, int64_t r1, int64_t u0, int64_t u1, void *scratch) {
    const ft_lp_kernel *kl = a->lp;
    const ft_lp_layout *L = a->lay;
    const ft_lp_rows *x = a->xr;
    const int mr = kl->mr, nr = kl->nr, per = nr / FT_LP_PANEL;
    const int64_t N = a->N;
    const float *cscale = kl->wt == FT_I8 ? (const float *)((const uint8_t *)a->w + L->scale_off) : NULL;
    const int32_t *csum = kl->wt == FT_I8 ? (const int32_t *)((const uint8_t *)a->w + L->sum_off) : NULL;
    const float *bias = a->residual ? NULL : a->bias;
    const int act = a->residual ? -1 : a->act;
    if (kl->amx) {   /* AMX-INT8: all of K in the tiles (amx_int8.c) */
        const ft_lp_epi e = {x->scale, x->zp, cscale, csum, a->raw, bias, act};
        ft_amx_int8_rows(ft_lp_vnni512(), kl->amx == 2, x, (const uint8_t *)a->w, L, N, a->out, a->ldo, r0, r1,
                         u0 * per, u1 * per < L->panels ? u1 * per : L->panels, &e, scratch);
        return;
    }
    const int64_t G = L->groups, KG = kblock_lp(G);
    for (int64_t g0 = 0; g0 < G; g0 += KG) {
        const int64_t kg = G - g0 < KG ? G - g0 : KG;
        const int last = g0 + kg == G;
        for (int64_t r = r0; r < r1; r += mr) {
            const int m = (int)(r1 - r < mr ? r1 - r : mr);
            const uint8_t *ar = x->data + r * x->lda + g0 * 4;
            for (int64_t u = u0; u < u1; u++) {
                const int n = (int)(N - u * nr < nr ? N - u * nr : nr);
                const uint8_t *wb = (const uint8_t *)a->w + (size_t)(u * per) * L->panel_bytes + g0 * 64;
                float *c = a->out + r * a->ldo + u * nr;
                if (!last) {
                    kl->tile(kg, ar, x->lda, wb, (int64_t)L->panel_bytes, c, a->ldo, m, n, g0 > 0, NULL);
                    continue;
                }
                const ft_lp_epi e = {x->scale ? x->scale + r : NULL, x->zp ? x->zp + r : NULL,
                                     cscale ? cscale + u * nr : NULL, csum ? csum + u * nr : NULL, a->raw,
                                     bias ? bias + u * nr : NULL, act};
                kl->tile(kg, ar, x->lda, wb, (int64_t)L->panel_bytes, c, a->ldo, m, n, g0 > 0, &e);
            }
        }
    }
}

/* rows [r0, r1) x panels [p0, p1) of one linear layer; pad: the thread's scratch (task_scratch) */
static void run_task(const ft_cpu_kernel *kr, const linear_args *a, int64_t r0, int64_t r1, int64_t p0, int64_t p1,
                     float *pad, int split) {
    const int mr = kr->mr, nr = kr->nr;
    const int64_t K = a->K, N = a->N, KC = kblock(kr, K);
    if (a->lp) {
        run_task_lp(a, r0, r1, p0, p1, pad);
        goto rows_done;
    }
    if (kr->amx) {   /* K blocks inside (amx.c); the residual rows get their bias in the LayerNorm */
        const ft_amx_product g = {{a->x, a->ldx, a->x_kmajor}, K, N, (const uint16_t *)a->w, a->out, a->ldo, a->out_t,
                                  a->alpha, a->beta, a->residual ? NULL : a->bias, a->residual ? -1 : a->act,
                                  a->bf16_only};
        ft_amx_linear_rows(&g, r0, r1, p0, p1, pad, split);
        goto rows_done;
    }
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        const int last = k0 + kc == K;
        /* the task's block of weights (kc x its panels) stays in L2; each MR-row block of A
         * (in L1) is used across all of it */
        for (int64_t r = r0; r < r1; r += mr) {
            const int m = (int)(r1 - r < mr ? r1 - r : mr);
            const float *ar = a->x + r * a->ldx + k0;
            int64_t lda = a->ldx;
            if (m < mr) {   /* a short block: a zero-padded copy */
                ft_copy_rows(pad, ar, a->ldx, m, kc, mr);
                ar = pad;
                lda = kc;
            }
            for (int64_t p = p0; p < p1; p++) {
                const int n = (int)(N - p * nr < nr ? N - p * nr : nr);
                float *c = a->out + r * a->ldo + p * nr;
                const float *wb = a->w + p * K * nr + k0 * nr;
                const int epi = last && !a->residual && (a->bias || a->act >= 0);
                if (epi && kr->tile_epi) {   /* on the registers */
                    kr->tile_epi(kc, ar, lda, wb, nr, c, a->ldo, m, n, k0 > 0, a->bias ? a->bias + p * nr : NULL,
                                 a->act);
                    continue;
                }
                kr->tile(kc, ar, lda, wb, nr, c, a->ldo, m, n, k0 > 0);
                if (epi) ft_cpu_epilogue(c, a->ldo, m, n, a->bias ? a->bias + p * nr : NULL, a->act);
            }
        }
    }
rows_done:
    if (a->residual)   /* the task holds whole rows: residual + bias + LayerNorm while they are hot */
        for (int64_t r = r0; r < r1; r++)
            ft_bias_residual_ln_row(a->out + r * a->ldo, a->residual + r * N, a->out + r * a->ldo, a->bias, a->gamma,
                                    a->beta_ln, N, a->eps);
}

/* bytes of a thread's scratch for tasks of up to mc rows: a zero-padded copy of a short block of
 * A (MR x KC floats), or for AMX the split rows and the accumulators */
static size_t task_scratch(const ft_cpu_kernel *kr, const linear_args *a, int64_t mc, int64_t K, int64_t panels) {
    const size_t bytes = a->lp ? (a->lp->amx ? ft_amx_int8_scratch_bytes() : 64)
                         : kr->amx ? ft_amx_scratch_bytes(mc, K, panels) : (size_t)kr->mr * kblock(kr, K) * sizeof(float);
    return (bytes + 63) & ~(size_t)63;
}

static ft_status run_linear(const linear_args *a) {
    const ft_cpu_kernel *kr = ft_cpu_kernel_get();
    const int nt = ft_num_threads();
    const int nr = a->lp ? a->lp->nr : kr->nr;   /* reduced precision: "panels" are its tiles' columns */
    const int amx = kr->amx && !a->lp;
    const int64_t panels = (a->N + nr - 1) / nr, want = 4 * (int64_t)nt;
    const int64_t granule = a->lp ? a->lp->mr : amx ? FT_AMX_MR : kr->mr;   /* rows of a full block */
    int64_t mc = MC, chunks = 1;
    if (a->residual) {   /* whole rows per task: shrink the row blocks until there are enough tasks */
        int64_t per = (a->M + want - 1) / want;
        per = (per + granule - 1) / granule * granule;
        mc = per < MC ? per : MC;
    } else {             /* column blocks that fit L2, more of them when there are few row blocks */
        const int64_t rb = (a->M + MC - 1) / MC;
        const int64_t per_block = (a->lp ? ncb_lp(a->lp, a->lay->groups) : amx ? NCB_amx(a->K) : NCB(kr)) / nr;
        chunks = (panels + per_block - 1) / per_block;
        if (rb * chunks < want) chunks = (want + rb - 1) / rb;
        if (chunks > panels) chunks = panels;
        /* AMX with K in several blocks: every chunk would split the task's rows again, one K block
         * at a time (k-major rows through register transposes: a third of such a product); with
         * rows enough for every thread and few panels, one chunk of all of them (its accumulators,
         * blocks x panels x 8 KiB, wait in L2 between K blocks) */
        if (amx && ft_amx_kblock(a->K) < a->K && rb >= want && panels <= AMX_ONE_CHUNK_PANELS) chunks = 1;
    }
    const int64_t row_blocks = (a->M + mc - 1) / mc, per_chunk = (panels + chunks - 1) / chunks;
    /* AMX with all of K in one block and rows enough for every thread: a task takes a row block
     * across every chunk of weights in turn, so its rows are split into bf16 parts once, not once
     * per chunk (the chunks come from L3; the split was 10-20% of the product) */
    const int row_major = amx && !a->residual && ft_amx_kblock(a->K) >= a->K && row_blocks >= want;
    const int64_t tasks = row_major ? row_blocks : row_blocks * chunks;
    int failed = 0;
#pragma omp parallel num_threads(tasks < nt ? (int)tasks : nt)
    {
        float *ap = aligned_alloc(64, task_scratch(kr, a, mc, a->K, per_chunk));
        if (!ap) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!ap) continue;
            if (row_major) {
                const int64_t r0 = t * mc, r1 = r0 + mc < a->M ? r0 + mc : a->M;
                for (int64_t p0 = 0; p0 < panels; p0 += per_chunk)
                    run_task(kr, a, r0, r1, p0, p0 + per_chunk < panels ? p0 + per_chunk : panels, ap, p0 == 0);
                continue;
            }
            const int64_t ch = t / row_blocks, rb = t % row_blocks;   /* chunk-major: a chunk of weights stays in L2 */
            const int64_t r0 = rb * mc, r1 = r0 + mc < a->M ? r0 + mc : a->M;
            const int64_t p0 = ch * per_chunk, p1 = p0 + per_chunk < panels ? p0 + per_chunk : panels;
            if (p0 < p1) run_task(kr, a, r0, r1, p0, p1, ap, 1);
        }
        free(ap);
    }
    if (failed) return ft_error(FT_ERR_NOMEM, "out of memory for linear-layer scratch");
    return FT_OK;
}

ft_status cpu_linear_forward(ft_backend *be, ft_dtype dt, void *out, const void *x, const void *w,
                             const float *w_packed, const void *bias, int64_t M, int64_t K, int64_t N, int act) {
    (void)be; (void)w;
    FT_CPU_F32_ONLY(dt, "linear_forward");
    if (M == 0) return FT_OK;
    linear_args a = {x, w_packed, K, 0, out, N, 0, M, K, N, 1.0f, 0.0f, bias, act, NULL, NULL, NULL, 0.0f};
    return run_linear(&a);
}

ft_status cpu_linear_residual_ln_forward(ft_backend *be, ft_dtype dt, void *out, const void *x, const void *w,
                                         const float *w_packed, const void *bias, const void *residual,
                                         const void *gamma, const void *beta, int64_t M, int64_t K, int64_t N,
                                         float eps) {
    (void)be; (void)w;
    FT_CPU_F32_ONLY(dt, "linear_residual_ln_forward");
    if (M == 0) return FT_OK;
    linear_args a = {x, w_packed, K, 0, out, N, 0, M, K, N, 1.0f, 0.0f, bias, -1, residual, gamma, beta, eps};
    return run_linear(&a);
}

ft_status ft_cpu_lp_product(const ft_lp_kernel *kl, const ft_lp_rows *x, const void *packed, int64_t M, int64_t K,
                            int64_t N, void *out, int64_t ldo, const float *bias, int act, const float *residual,
                            const float *gamma, const float *beta, float eps, int raw) {
    if (M == 0 || N == 0) return FT_OK;
    const ft_lp_layout lay = ft_lp_layout_of(kl, N, K);
    linear_args a = {NULL, packed, 0, 0, out, ldo, 0, M, K, N, 1.0f, 0.0f, bias, act, residual, gamma, beta, eps, 0,
                     kl, x, &lay, raw};
    return run_linear(&a);
}

/* A product of at least 32 x 32 x 64 and 2^20 multiply-adds: below that, packing op(B) costs more
 * than the tiles save (the classification head's 2-column GEMMs stay on OpenBLAS) */
int ft_cpu_gemm_on_amx(int64_t M, int64_t N, int64_t K) {
    return M >= 32 && N >= 32 && K >= 64 && M * N * K >= (int64_t)1 << 20 && ft_cpu_kernel_get()->amx;
}

/* C = alpha op(A) op(B) + beta C as the product x w^T of amx.h, each operand read in place,
 * line-major or k-major (a transposed operand: A^T's lines are A's columns). The operand with
 * fewer lines is packed once for the call, the other split block by block in the tasks: for
 * M >= N, x = op(A) (M, K) and w = op(B)^T (N, K); for M < N, C^T = op(B)^T op(A)^T, x = op(B)^T,
 * w = op(A), C stored transposed (the weight gradients of a layer, M = out < N = in, run twice as
 * fast so). The orientation depends on the shape alone, and every C element is one fixed chain
 * over k whatever the threads (amx.h). */
ft_status ft_cpu_amx_gemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                          int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc, int bf16_only) {
    if (M == 0 || N == 0) return FT_OK;
    const ft_amx_matrix opA = {A, lda, trans_a}, opBt = {B, ldb, !trans_b};   /* op(A) (M, K), op(B)^T (N, K) */
    const int swap = M < N;
    const ft_amx_matrix x = swap ? opBt : opA, w = swap ? opA : opBt;
    const int64_t rows = swap ? N : M, cols = swap ? M : N, panels = (cols + FT_AMX_NR - 1) / FT_AMX_NR;
    uint16_t *wp = aligned_alloc(64, (ft_amx_packed_bytes(cols, K) + 63) & ~(size_t)63);
    if (!wp) return ft_error(FT_ERR_NOMEM, "out of memory packing a %lld x %lld GEMM operand", (long long)cols,
                             (long long)K);
#pragma omp parallel for schedule(static) num_threads(ft_num_threads())
    for (int64_t p = 0; p < panels; p++) ft_amx_pack_panel(wp, w, cols, K, p, bf16_only ? 1 : 3);
    linear_args a = {x.src, (const float *)wp, x.ld, x.kmajor, C, ldc, swap, rows, K, cols, alpha, beta,
                     NULL, -1, NULL, NULL, NULL, 0.0f, bf16_only};
    const ft_status st = run_linear(&a);
    free(wp);
    return st;
}
