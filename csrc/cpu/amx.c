/* Linear layers on Intel AMX at float32 accuracy (bf16x6): see amx.h for the method and the
 * layouts. Compiled for AMX with target attributes, so one build runs everywhere; the CPU and
 * the OS decide at run time (ft_amx_usable). */
#include "amx.h"

#include <math.h>
#include <string.h>

#include "rowfun.h"

#define STEP 32                  /* K per tile step: 16 bf16 pairs */
#define TILE_ELEMS 512           /* bf16 per 16 x 64-byte tile */
#define PARTS 3                  /* h, m, l */

static int64_t steps_of(int64_t K) { return (K + STEP - 1) / STEP; }
static int64_t panels_of(int64_t N) { return (N + FT_AMX_NR - 1) / FT_AMX_NR; }

size_t ft_amx_packed_bytes(int64_t N, int64_t K) {
    return (size_t)panels_of(N) * (size_t)steps_of(K) * PARTS * 2 * TILE_ELEMS * sizeof(uint16_t);
}

int64_t ft_amx_kblock(int64_t K) {
    const int64_t S = steps_of(K);
    return (S <= FT_AMX_WHOLE_K ? S : FT_AMX_KSTEPS) * STEP;
}

size_t ft_amx_scratch_bytes(int64_t rows, int64_t K, int64_t panels) {
    const int64_t blocks = (rows + FT_AMX_MR - 1) / FT_AMX_MR, kb_steps = ft_amx_kblock(K) / STEP;
    const int64_t accs = steps_of(K) > FT_AMX_WHOLE_K ? blocks * panels : 1;
    return (size_t)blocks * (size_t)kb_steps * PARTS * FT_AMX_MR * STEP * sizeof(uint16_t)   /* split rows */
           + (size_t)accs * 2 * FT_AMX_MR * FT_AMX_NR * sizeof(float)                        /* main, corr */
           + FT_AMX_MR * STEP * sizeof(float);                                               /* k-major lines */
}

#if defined(__x86_64__) && ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
                            (defined(__clang__) && __clang_major__ >= 12))
#define FT_HAVE_AMX 1
#include <immintrin.h>
#include <cpuid.h>

#include "vecmath.h"
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

static int usable;
static pthread_once_t usable_once = PTHREAD_ONCE_INIT;

/* the OS must enable the tile state for this process (Linux >= 5.16); asking again is harmless */
int ft_amx_tile_permission(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

static void probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    const int amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1;
    if (!(amx_bf16 && amx_tile && avx512f && avx512bw) || a < 1) return;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return;   /* AVX512_BF16 */
    usable = ft_amx_tile_permission();
}

int ft_amx_usable(void) {
    pthread_once(&usable_once, probe);
    return usable;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tiles 0-3: the 32 x 32 accumulator (four 16 x 16 float32 or int32); 4, 5: two 16-row A tiles;
 * 6, 7: two 16-column B tiles; all 16 rows x 64 bytes (amx_int8.c's layout too) */
__attribute__((target("amx-tile"))) void ft_amx_configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* the three bf16 parts of the 32 floats at src (element e read where mask lo/hi has bit e / e-16;
 * src NULL: 32 zeros), each 32 bf16 in element order: h = bf16(x) rounded to nearest even,
 * m = bf16(x - h), l = bf16(x - h - m), the subtractions exact. x infinite, NaN or beyond bf16's
 * range: h carries it, m = l = 0. */
AMX static inline void split32(const float *src, __mmask16 lo, __mmask16 hi, __m512i part[PARTS], int nparts) {
    __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps();
    if (src) {
        v0 = _mm512_maskz_loadu_ps(lo, src);
        v1 = _mm512_maskz_loadu_ps(hi, src + 16);
    }
    const __m512 inf = _mm512_set1_ps(INFINITY);
    for (int q = 0; q < nparts; q++) {
        part[q] = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
        if (q == nparts - 1) break;
        const __m512 p0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(part[q])), 16));
        const __m512 p1 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(part[q], 1)), 16));
        v0 = _mm512_sub_ps(v0, p0);
        v1 = _mm512_sub_ps(v1, p1);
        v0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(v0), inf, _CMP_LT_OQ), v0);
        v1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(v1), inf, _CMP_LT_OQ), v1);
    }
}

/* split32 for 16 floats: the same parts, element for element */
AMX static inline void split16(__m512 v, __m256i part[PARTS], int nparts) {
    const __m512 inf = _mm512_set1_ps(INFINITY);
    for (int q = 0; q < nparts; q++) {
        part[q] = (__m256i)_mm512_cvtneps_pbh(v);
        if (q == nparts - 1) break;
        v = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(part[q]), 16)));
        v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(v), inf, _CMP_LT_OQ), v);
    }
}

/* k mask for the 32 elements of step s: (lo, hi) halves */
static inline void step_masks(int64_t K, int64_t s, __mmask16 *lo, __mmask16 *hi) {
    const int64_t left = K - s * STEP;
    *lo = ft_mask16(left);
    *hi = ft_mask16(left - 16);
}

/* 16 x 16 floats transposed in registers: r[i] lane j <- r[j] lane i */
AMX static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {   /* 32-bit pairs */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {   /* 64-bit pairs */
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int h = 0; h < 16; h += 8)     /* 128-bit lanes */
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {       /* 256-bit halves */
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* buf (16 groups x 16 lines, 32 floats each) = the 32 k of step s of lines [l0, l0 + 16 groups)
 * of a k-major matrix of `lines` lines and K k: zero past either */
AMX static void gather_kmajor(float *buf, ft_amx_matrix x, int64_t lines, int64_t K, int64_t l0, int groups,
                              int64_t s) {
    for (int g = 0; g < groups; g++) {
        const __mmask16 lm = ft_mask16(lines - l0 - 16 * g);
        for (int h = 0; h < 2; h++) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t k = s * STEP + 16 * h + i;
                r[i] = k < K ? _mm512_maskz_loadu_ps(lm, x.src + k * x.ld + l0 + 16 * g) : _mm512_setzero_ps();
            }
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_store_ps(buf + (16 * g + j) * STEP + 16 * h, r[j]);
        }
    }
}

/* lines [l0, l0 + 16 groups) of x (`lines` in all, K k) at step s -> parts[q][j] (32 bf16 each,
 * j-th line): zero past either end */
AMX static void split_lines(__m512i (*parts)[PARTS], ft_amx_matrix x, int64_t lines, int64_t K, int64_t l0,
                            int groups, int64_t s, float *buf, int nparts) {
    __mmask16 k_lo, k_hi;
    step_masks(K, s, &k_lo, &k_hi);
    if (x.kmajor) gather_kmajor(buf, x, lines, K, l0, groups, s);
    for (int j = 0; j < 16 * groups; j++) {
        if (x.kmajor) split32(buf + j * STEP, 0xFFFF, 0xFFFF, parts[j], nparts);
        else split32(l0 + j < lines ? x.src + (l0 + j) * x.ld + s * STEP : NULL, k_lo, k_hi, parts[j], nparts);
    }
}

/* rows [r, r + 32) of x (rows past `rows` zero), steps [s0, s1) -> a ((s1 - s0) steps x PARTS x
 * 32 rows x 32 bf16) */
AMX static void split_rows(uint16_t *a, ft_amx_matrix x, int64_t rows, int64_t K, int64_t r, int64_t s0, int64_t s1,
                           float *buf, int nparts) {
    __m512i parts[FT_AMX_MR][PARTS];
    for (int64_t s = s0; s < s1; s++) {
        split_lines(parts, x, rows, K, r, FT_AMX_MR / 16, s, buf, nparts);
        uint16_t *dst = a + (s - s0) * PARTS * FT_AMX_MR * STEP;
        for (int i = 0; i < FT_AMX_MR; i++)
            for (int q = 0; q < nparts; q++) _mm512_storeu_si512(dst + (q * FT_AMX_MR + i) * STEP, parts[i][q]);
    }
}

/* Panel p: per step, per 16-column half, each column's 32 k split at once, then the 16 x 16
 * pairs transposed into the tile's rows (pair r of column j at row r, position j). Columns past
 * N and k past K are zero. */
AMX void ft_amx_pack_panel(uint16_t *dst, ft_amx_matrix w, int64_t N, int64_t K, int64_t p, int nparts) {
    const int64_t S = steps_of(K);
    uint32_t *panel = (uint32_t *)(dst + p * S * PARTS * 2 * TILE_ELEMS);
    if (w.kmajor) {   /* k-major: tile row r interleaves the parts of source rows k = 2r and 2r + 1 */
        for (int64_t s = 0; s < S; s++)
            for (int half = 0; half < 2; half++) {
                const int64_t c0 = p * FT_AMX_NR + half * 16;
                const __mmask16 cm = ft_mask16(N - c0);
                for (int r = 0; r < 16; r++) {
                    const int64_t k = s * STEP + 2 * r;
                    __m256i even[PARTS], odd[PARTS];
                    split16(k < K ? _mm512_maskz_loadu_ps(cm, w.src + k * w.ld + c0) : _mm512_setzero_ps(), even,
                            nparts);
                    split16(k + 1 < K ? _mm512_maskz_loadu_ps(cm, w.src + (k + 1) * w.ld + c0) : _mm512_setzero_ps(),
                            odd, nparts);
                    for (int q = 0; q < nparts; q++) {
                        uint32_t *row = panel + ((s * PARTS + q) * 2 + half) * (TILE_ELEMS / 2) + r * 16;
                        const __m256i lo = _mm256_unpacklo_epi16(even[q], odd[q]);   /* columns 0-3, 8-11 */
                        const __m256i hi = _mm256_unpackhi_epi16(even[q], odd[q]);   /* columns 4-7, 12-15 */
                        _mm256_storeu_si256((__m256i *)row, _mm256_permute2x128_si256(lo, hi, 0x20));
                        _mm256_storeu_si256((__m256i *)(row + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
                    }
                }
            }
        return;
    }
    uint32_t col_pairs[PARTS][16][16] __attribute__((aligned(64)));   /* [part][column][pair] */
    float buf[16 * STEP] __attribute__((aligned(64)));
    __m512i parts[16][PARTS];
    for (int64_t s = 0; s < S; s++) {
        for (int half = 0; half < 2; half++) {
            split_lines(parts, w, N, K, p * FT_AMX_NR + half * 16, 1, s, buf, nparts);
            for (int j = 0; j < 16; j++)
                for (int q = 0; q < nparts; q++) _mm512_store_si512(col_pairs[q][j], parts[j][q]);
            for (int q = 0; q < nparts; q++) {
                uint32_t *tile = panel + ((s * PARTS + q) * 2 + half) * (TILE_ELEMS / 2);
                for (int r = 0; r < 16; r++)
                    for (int j = 0; j < 16; j++) tile[r * 16 + j] = col_pairs[q][j][r];
            }
        }
    }
}

#define A_TILE(s, q, t) (a + (((s) * PARTS + (q)) * FT_AMX_MR + 16 * (t)) * STEP)
#define B_TILE(s, q, t) (b + (((s) * PARTS + (q)) * 2 + (t)) * TILE_ELEMS)
/* the tile number must be a literal */
#define LA(s, q, t) do { if (t) _tile_loadd(5, A_TILE(s, q, 1), 64); else _tile_loadd(4, A_TILE(s, q, 0), 64); } while (0)
#define LB(s, q, t) do { if (t) _tile_loadd(7, B_TILE(s, q, 1), 64); else _tile_loadd(6, B_TILE(s, q, 0), 64); } while (0)
#define T00 _tile_dpbf16ps(0, 4, 6)
#define T01 _tile_dpbf16ps(1, 4, 7)
#define T10 _tile_dpbf16ps(2, 5, 6)
#define T11 _tile_dpbf16ps(3, 5, 7)
/* The four products of a 32 x 32 block, ordered so that the tiles of the next term are loaded
 * as soon as their last reader has been issued (tiles are not renamed: a load waits for the
 * products reading the old contents, the next product for the load): */
#define DP4() do { T00; T01; T10; T11; } while (0)
/* ... the next term changes B (part q of step s) */
#define DP4_NEXT_B(s, q) do { T00; T10; LB(s, q, 0); T01; T11; LB(s, q, 1); } while (0)
/* ... the next term changes A */
#define DP4_NEXT_A(s, q) do { T00; T01; LA(s, q, 0); T10; T11; LA(s, q, 1); } while (0)
/* ... the next term changes both (A part qa, B part qb of step s) */
#define DP4_NEXT_AB(s, qa, qb) do { T00; T01; LA(s, qa, 0); T10; LB(s, qb, 0); T11; LA(s, qa, 1); LB(s, qb, 1); } while (0)
#define ZERO4() do { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); } while (0)
#define LOAD4(c) do { _tile_loadd(0, c, 128); _tile_loadd(1, c + 16, 128); _tile_loadd(2, c + 512, 128); \
                      _tile_loadd(3, c + 528, 128); } while (0)
#define STORE4(c) do { _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128); _tile_stored(2, c + 512, 128); \
                       _tile_stored(3, c + 528, 128); } while (0)

/* main (32 x 32) += sum_k a_h b_h over S steps; corr += the five correction terms, k in order,
 * the terms in the order h l, h m, m m, m h, l h within each step (one operand changes from each
 * term to the next). resume 0: both start from zero; 1: from the values stored by the previous
 * K block (a tile's float32 store and load are exact, so K blocks never change a bit). */
AMX static void block(const uint16_t *a, const uint16_t *b, int64_t S, float *acc_main, float *acc_corr,
                      int resume, int bf16_only) {
    if (resume) LOAD4(acc_main);
    else ZERO4();
    LA(0, 0, 0); LA(0, 0, 1); LB(0, 0, 0); LB(0, 0, 1);
    for (int64_t s = 0; s + 1 < S; s++) DP4_NEXT_AB(s + 1, 0, 0);
    DP4();
    STORE4(acc_main);
    if (bf16_only) {   /* no corrections: they stay zero (set by the first K block) */
        if (!resume) {
            ZERO4();
            STORE4(acc_corr);
        }
        return;
    }
    if (resume) LOAD4(acc_corr);
    else ZERO4();
    LA(0, 0, 0); LA(0, 0, 1); LB(0, 2, 0); LB(0, 2, 1);
    for (int64_t s = 0; s < S; s++) {
        DP4_NEXT_B(s, 1);   /* h l */
        DP4_NEXT_A(s, 1);   /* h m */
        DP4_NEXT_B(s, 0);   /* m m */
        DP4_NEXT_A(s, 2);   /* m h */
        if (s + 1 < S) DP4_NEXT_AB(s + 1, 0, 2);   /* l h */
        else DP4();
    }
    STORE4(acc_corr);
}

/* out (row stride ldo) element (c0 + j, r + i) = alpha (main + corr)[i][j] + beta out, for i < m,
 * j < n: each 16 x 16 quarter of the block transposed in registers */
AMX static void store_transposed(const ft_amx_product *g, const float *acc_main, const float *acc_corr, int64_t r,
                                 int m, int64_t c0, int n) {
    const __m512 alpha = _mm512_set1_ps(g->alpha), beta = _mm512_set1_ps(g->beta);
    for (int ih = 0; ih < 2; ih++) {
        const __mmask16 rows = ft_mask16(m - 16 * ih);
        for (int jh = 0; jh < 2; jh++) {
            __m512 v[16];
            for (int t = 0; t < 16; t++) {
                const int e = (16 * ih + t) * FT_AMX_NR + 16 * jh;
                v[t] = _mm512_add_ps(_mm512_load_ps(acc_main + e), _mm512_load_ps(acc_corr + e));
            }
            transpose16(v);   /* v[j] = column 16 jh + j of rows 16 ih .. 16 ih + 15 */
            for (int j = 0; j < 16 && 16 * jh + j < n; j++) {
                float *o = g->out + (c0 + 16 * jh + j) * g->ldo + r + 16 * ih;
                __m512 x = v[j];
                if (g->alpha != 1.0f) x = _mm512_mul_ps(alpha, x);
                if (g->beta != 0.0f) x = _mm512_fmadd_ps(beta, _mm512_maskz_loadu_ps(rows, o), x);
                _mm512_mask_storeu_ps(o, rows, x);
            }
        }
    }
}

/* K in one block (up to FT_AMX_WHOLE_K steps) or in blocks of FT_AMX_KSTEPS steps: the task's
 * rows are split one K block at a time and each block of 32 rows meets every panel's slice of
 * that K block (in L2) before the next; with several K blocks the accumulators of every (row
 * block, panel) wait in scratch between them */
AMX void ft_amx_linear_rows(const ft_amx_product *g, int64_t r0, int64_t r1, int64_t p0, int64_t p1,
                            void *scratch, int split) {
    const int64_t K = g->K, N = g->N, S = steps_of(K), rows = r1 - r0, blocks = (rows + FT_AMX_MR - 1) / FT_AMX_MR;
    const int64_t kb_steps = ft_amx_kblock(K) / STEP, a_block = kb_steps * PARTS * FT_AMX_MR * STEP;
    const int64_t panel_elems = S * PARTS * 2 * TILE_ELEMS, acc_elems = 2 * FT_AMX_MR * FT_AMX_NR;
    const int several = S > kb_steps;
    const int act = g->act, vec_act = act >= 0 && ft_vec_act(act);
    const __m512 alpha = _mm512_set1_ps(g->alpha), beta = _mm512_set1_ps(g->beta);
    uint16_t *a = (uint16_t *)scratch;
    float *accs = (float *)(a + blocks * a_block);
    float *buf = accs + (several ? blocks * (p1 - p0) : 1) * acc_elems;
    ft_amx_configure_tiles();
    for (int64_t s0 = 0; s0 < S; s0 += kb_steps) {
        const int64_t s1 = s0 + kb_steps < S ? s0 + kb_steps : S, last = s1 == S;
        if (split || several)
            for (int64_t bl = 0; bl < blocks; bl++)
                split_rows(a + bl * a_block, g->x, r1, K, r0 + bl * FT_AMX_MR, s0, s1, buf, g->bf16_only ? 1 : PARTS);
        for (int64_t p = p0; p < p1; p++) {
            const uint16_t *b = g->wp + p * panel_elems + s0 * PARTS * 2 * TILE_ELEMS;
            const int64_t c0 = p * FT_AMX_NR;
            const int n = (int)(N - c0 < FT_AMX_NR ? N - c0 : FT_AMX_NR);
            const __mmask16 n_lo = ft_mask16(n), n_hi = ft_mask16(n - 16);
            __m512 b_lo = _mm512_setzero_ps(), b_hi = _mm512_setzero_ps();
            if (g->bias) {
                b_lo = _mm512_maskz_loadu_ps(n_lo, g->bias + c0);
                b_hi = _mm512_maskz_loadu_ps(n_hi, g->bias + c0 + 16);
            }
            for (int64_t bl = 0; bl < blocks; bl++) {
                float *acc_main = accs + (several ? bl * (p1 - p0) + (p - p0) : 0) * acc_elems;
                float *acc_corr = acc_main + FT_AMX_MR * FT_AMX_NR;
                block(a + bl * a_block, b, s1 - s0, acc_main, acc_corr, s0 > 0, g->bf16_only);
                if (!last) continue;
                const int64_t r = r0 + bl * FT_AMX_MR;
                const int m = (int)(r1 - r < FT_AMX_MR ? r1 - r : FT_AMX_MR);
                if (g->out_t) {
                    store_transposed(g, acc_main, acc_corr, r, m, c0, n);
                    continue;
                }
                for (int i = 0; i < m; i++) {
                    float *o = g->out + (r + i) * g->ldo + c0;
                    __m512 v0 = _mm512_add_ps(_mm512_load_ps(acc_main + i * 32), _mm512_load_ps(acc_corr + i * 32));
                    __m512 v1 = _mm512_add_ps(_mm512_load_ps(acc_main + i * 32 + 16),
                                              _mm512_load_ps(acc_corr + i * 32 + 16));
                    if (g->alpha != 1.0f) {
                        v0 = _mm512_mul_ps(alpha, v0);
                        v1 = _mm512_mul_ps(alpha, v1);
                    }
                    if (g->beta != 0.0f) {
                        v0 = _mm512_fmadd_ps(beta, _mm512_maskz_loadu_ps(n_lo, o), v0);
                        v1 = _mm512_fmadd_ps(beta, _mm512_maskz_loadu_ps(n_hi, o + 16), v1);
                    }
                    if (g->bias) {
                        v0 = _mm512_add_ps(v0, b_lo);
                        v1 = _mm512_add_ps(v1, b_hi);
                    }
                    if (vec_act) {
                        v0 = ft_act512(v0, act);
                        v1 = ft_act512(v1, act);
                    }
                    _mm512_mask_storeu_ps(o, n_lo, v0);
                    _mm512_mask_storeu_ps(o + 16, n_hi, v1);
                    if (act >= 0 && !vec_act) ft_activation_row(o, n, (ft_activation)act);   /* tanh */
                }
            }
        }
    }
    _tile_release();
}
#else   /* no AMX in this compiler: ft_amx_usable() is 0, so nothing below is ever called */
int ft_amx_usable(void) { return 0; }
int ft_amx_tile_permission(void) { return 0; }
void ft_amx_configure_tiles(void) {}

void ft_amx_pack_panel(uint16_t *dst, ft_amx_matrix w, int64_t N, int64_t K, int64_t p, int nparts) {
    (void)dst; (void)w; (void)N; (void)K; (void)p; (void)nparts;
}
void ft_amx_linear_rows(const ft_amx_product *g, int64_t r0, int64_t r1, int64_t p0, int64_t p1,
                        void *scratch, int split) {
    (void)g; (void)r0; (void)r1; (void)p0; (void)p1; (void)scratch; (void)split;
}
#endif
