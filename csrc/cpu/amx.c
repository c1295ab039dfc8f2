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

size_t ft_amx_scratch_bytes(int64_t rows, int64_t K) {
    const int64_t blocks = (rows + FT_AMX_MR - 1) / FT_AMX_MR;
    return (size_t)blocks * (size_t)steps_of(K) * PARTS * FT_AMX_MR * STEP * sizeof(uint16_t)   /* split rows */
           + 2 * FT_AMX_MR * FT_AMX_NR * sizeof(float);                                         /* main, corr */
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

static void probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    const int amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1;
    if (!(amx_bf16 && amx_tile && avx512f && avx512bw) || a < 1) return;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return;   /* AVX512_BF16 */
    /* the OS must enable the tile state for this process (Linux >= 5.16) */
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return;
    usable = 1;
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

/* tiles 0-3: the 32 x 32 accumulator (four 16 x 16 float32); 4, 5: two 16-row A tiles;
 * 6, 7: two 16-column B tiles; all 16 rows x 64 bytes */
AMX static void configure_tiles(void) {
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
AMX static inline void split32(const float *src, __mmask16 lo, __mmask16 hi, __m512i part[PARTS]) {
    __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps();
    if (src) {
        v0 = _mm512_maskz_loadu_ps(lo, src);
        v1 = _mm512_maskz_loadu_ps(hi, src + 16);
    }
    const __m512 inf = _mm512_set1_ps(INFINITY);
    for (int q = 0; q < PARTS; q++) {
        part[q] = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
        if (q == PARTS - 1) break;
        const __m512 p0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(part[q])), 16));
        const __m512 p1 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(part[q], 1)), 16));
        v0 = _mm512_sub_ps(v0, p0);
        v1 = _mm512_sub_ps(v1, p1);
        v0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(v0), inf, _CMP_LT_OQ), v0);
        v1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(v1), inf, _CMP_LT_OQ), v1);
    }
}

/* k mask for the 32 elements of step s: (lo, hi) halves */
static inline void step_masks(int64_t K, int64_t s, __mmask16 *lo, __mmask16 *hi) {
    const int64_t left = K - s * STEP;
    *lo = ft_mask16(left);
    *hi = ft_mask16(left - 16);
}

/* rows [0, m) of x (row stride K; rows m..31 zero) -> a (S steps x PARTS x 32 rows x 32 bf16) */
AMX static void split_rows(uint16_t *a, const float *x, int64_t K, int m) {
    const int64_t S = steps_of(K);
    for (int64_t s = 0; s < S; s++) {
        __mmask16 k_lo, k_hi;
        step_masks(K, s, &k_lo, &k_hi);
        uint16_t *dst = a + s * PARTS * FT_AMX_MR * STEP;
        for (int i = 0; i < FT_AMX_MR; i++) {
            __m512i part[PARTS];
            split32(i < m ? x + i * K + s * STEP : NULL, k_lo, k_hi, part);
            for (int q = 0; q < PARTS; q++) _mm512_storeu_si512(dst + (q * FT_AMX_MR + i) * STEP, part[q]);
        }
    }
}

/* Panel p: per step, per 16-column half, each column's 32 k split at once (its weights are
 * contiguous), then the 16 x 16 pairs transposed into the tile's rows (pair r of column j at
 * row r, position j). Columns past N and k past K are zero. */
AMX void ft_amx_pack_panel(uint16_t *dst, const float *w, int64_t N, int64_t K, int64_t p) {
    const int64_t S = steps_of(K);
    uint32_t *panel = (uint32_t *)(dst + p * S * PARTS * 2 * TILE_ELEMS);
    uint32_t col_pairs[PARTS][16][16] __attribute__((aligned(64)));   /* [part][column][pair] */
    for (int64_t s = 0; s < S; s++) {
        __mmask16 k_lo, k_hi;
        step_masks(K, s, &k_lo, &k_hi);
        for (int half = 0; half < 2; half++) {
            for (int j = 0; j < 16; j++) {
                const int64_t col = p * FT_AMX_NR + half * 16 + j;
                __m512i part[PARTS];
                split32(col < N ? w + col * K + s * STEP : NULL, k_lo, k_hi, part);
                for (int q = 0; q < PARTS; q++) _mm512_store_si512(col_pairs[q][j], part[q]);
            }
            for (int q = 0; q < PARTS; q++) {
                uint32_t *tile = panel + ((s * PARTS + q) * 2 + half) * (TILE_ELEMS / 2);
                for (int r = 0; r < 16; r++)
                    for (int j = 0; j < 16; j++) tile[r * 16 + j] = col_pairs[q][j][r];
            }
        }
    }
}

#define A_TILE(s, q, t) (a + (((s) * PARTS + (q)) * FT_AMX_MR + 16 * (t)) * STEP)
#define B_TILE(s, q, t) (b + (((s) * PARTS + (q)) * 2 + (t)) * TILE_ELEMS)
#define LOAD_A(s, q) do { _tile_loadd(4, A_TILE(s, q, 0), 64); _tile_loadd(5, A_TILE(s, q, 1), 64); } while (0)
#define LOAD_B(s, q) do { _tile_loadd(6, B_TILE(s, q, 0), 64); _tile_loadd(7, B_TILE(s, q, 1), 64); } while (0)
#define DP4() do { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); } while (0)
#define ZERO4() do { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); } while (0)
#define STORE4(c) do { _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128); _tile_stored(2, c + 512, 128); \
                       _tile_stored(3, c + 528, 128); } while (0)

/* main (32 x 32) = sum_k a_h b_h; corr = the five correction terms, k in order, the terms in
 * the order h m, h l, m m, m h, l h within each step (the B tiles loaded fewest times) */
AMX static void block(const uint16_t *a, const uint16_t *b, int64_t S, float *acc_main, float *acc_corr) {
    ZERO4();
    for (int64_t s = 0; s < S; s++) {
        LOAD_A(s, 0);
        LOAD_B(s, 0);
        DP4();
    }
    STORE4(acc_main);
    ZERO4();
    for (int64_t s = 0; s < S; s++) {
        LOAD_A(s, 0);
        LOAD_B(s, 1);
        DP4();   /* h m */
        LOAD_B(s, 2);
        DP4();   /* h l */
        LOAD_A(s, 1);
        LOAD_B(s, 1);
        DP4();   /* m m */
        LOAD_B(s, 0);
        DP4();   /* m h */
        LOAD_A(s, 2);
        DP4();   /* l h */
    }
    STORE4(acc_corr);
}

AMX void ft_amx_linear_rows(const float *x, int64_t K, int64_t r0, int64_t r1, const uint16_t *wp, int64_t N,
                            int64_t p0, int64_t p1, float *out, const float *bias, int act, void *scratch) {
    const int64_t S = steps_of(K), rows = r1 - r0, blocks = (rows + FT_AMX_MR - 1) / FT_AMX_MR;
    const int64_t a_block = S * PARTS * FT_AMX_MR * STEP;
    const int vec_act = act >= 0 && ft_vec_act(act);
    uint16_t *a = (uint16_t *)scratch;
    float *acc_main = (float *)(a + blocks * a_block), *acc_corr = acc_main + FT_AMX_MR * FT_AMX_NR;
    for (int64_t bl = 0; bl < blocks; bl++) {
        const int64_t r = r0 + bl * FT_AMX_MR;
        split_rows(a + bl * a_block, x + r * K, K, (int)(r1 - r < FT_AMX_MR ? r1 - r : FT_AMX_MR));
    }
    configure_tiles();
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *b = wp + p * S * PARTS * 2 * TILE_ELEMS;
        const int64_t c0 = p * FT_AMX_NR;
        const int n = (int)(N - c0 < FT_AMX_NR ? N - c0 : FT_AMX_NR);
        const __mmask16 n_lo = ft_mask16(n), n_hi = ft_mask16(n - 16);
        __m512 b_lo = _mm512_setzero_ps(), b_hi = _mm512_setzero_ps();
        if (bias) {
            b_lo = _mm512_maskz_loadu_ps(n_lo, bias + c0);
            b_hi = _mm512_maskz_loadu_ps(n_hi, bias + c0 + 16);
        }
        for (int64_t bl = 0; bl < blocks; bl++) {
            const int64_t r = r0 + bl * FT_AMX_MR;
            const int m = (int)(r1 - r < FT_AMX_MR ? r1 - r : FT_AMX_MR);
            block(a + bl * a_block, b, S, acc_main, acc_corr);
            for (int i = 0; i < m; i++) {
                float *o = out + (r + i) * N + c0;
                __m512 v0 = _mm512_add_ps(_mm512_load_ps(acc_main + i * 32), _mm512_load_ps(acc_corr + i * 32));
                __m512 v1 = _mm512_add_ps(_mm512_load_ps(acc_main + i * 32 + 16), _mm512_load_ps(acc_corr + i * 32 + 16));
                if (bias) {
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
    _tile_release();
}
#else   /* no AMX in this compiler: ft_amx_usable() is 0, so nothing below is ever called */
int ft_amx_usable(void) { return 0; }
void ft_amx_pack_panel(uint16_t *dst, const float *w, int64_t N, int64_t K, int64_t p) {
    (void)dst; (void)w; (void)N; (void)K; (void)p;
}
void ft_amx_linear_rows(const float *x, int64_t K, int64_t r0, int64_t r1, const uint16_t *wp, int64_t N,
                        int64_t p0, int64_t p1, float *out, const float *bias, int act, void *scratch) {
    (void)x; (void)K; (void)r0; (void)r1; (void)wp; (void)N; (void)p0; (void)p1; (void)out; (void)bias;
    (void)act; (void)scratch;
}
#endif
