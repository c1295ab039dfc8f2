/* The int8 product on Intel AMX tiles (tdpbusd: u8 rows x s8 VNNI panels, int32 sums), behind CPUID
 * (AMX-TILE + AMX-INT8), the OS's permission for the tile state and FASTTRAN_CPU_ISA.
 *
 * NOT RUN ON AMX HARDWARE: the machine this was written on (AMD Zen 4) has no AMX. Its arithmetic
 * is the VNNI kernels' (lowp.h: the same layouts -- a prepared row's 64 bytes are an A-tile row, a
 * packed panel's 16 groups of 64 bytes are a B tile --, the same exact int32 sums, the same
 * epilogue, which is the AVX-512 VNNI kernel's own code run on the stored sums). The loops,
 * strides, guards and epilogue below are compiled twice: once on the real tiles, once on a C
 * model of the four tile instructions (Intel's pseudo-code for tileloadd, tilezero, tdpbusd,
 * tilestored); FASTTRAN_CPU_ISA=amx_int8_emulated runs the model (test infrastructure, like the
 * CUDA emulator), and tests/test_lowp.py checks it exact against an int32 reference. What the
 * model cannot check: the instructions' encoding, the tile configuration on real hardware, speed.
 *
 * Blocks of 32 rows x 32 columns: four 16 x 16 int32 accumulator tiles (0-3), two A tiles (4, 5:
 * rows r..r+15, r+16..r+31), two B tiles (6, 7: panels p, p + 1), K in steps of 64 (16 groups);
 * a block that would pass the prepared rows or the last panel uses its first half only. */
#include "lowp.h"

#include <string.h>

#if defined(__x86_64__) && ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
                            (defined(__clang__) && __clang_major__ >= 12))
#define FT_HAVE_AMX_INT8 1
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>

#include "amx.h"
#endif

#define BLK 32
#define STEP_GROUPS 16   /* a tile row: 64 bytes = 16 groups of 4 */

size_t ft_amx_int8_scratch_bytes(void) { return BLK * BLK * sizeof(int32_t); }

/* The finished block (int32 sums in acc, row stride BLK) into out: the AVX-512 VNNI kernel's
 * epilogue on them (kg = 0: nothing to multiply, the sums read back as accumulators) in place,
 * then the m x n values copied out. */
static void finish_block(const ft_lp_kernel *vnni, int32_t *acc, int m, int n, const ft_lp_epi *e, int64_t r,
                         int64_t col0, void *out, int64_t ldo) {
    for (int i = 0; i < m; i += vnni->mr) {
        const int mi = m - i < vnni->mr ? m - i : vnni->mr;
        const ft_lp_epi ei = {e->row_scale ? e->row_scale + r + i : NULL, e->row_zp + r + i,
                              e->col_scale ? e->col_scale + col0 : NULL, e->col_sum + col0, e->raw,
                              e->bias ? e->bias + col0 : NULL, e->act};
        vnni->tile(0, NULL, 0, NULL, 0, acc + i * BLK, BLK, mi, n, 1, &ei);
    }
    for (int i = 0; i < m; i++) memcpy((int32_t *)out + (r * ldo + col0) + i * ldo, acc + i * BLK, (size_t)n * 4);
}

/* The block loop over the tile operations T_* (real or modelled): rows [r0, r1) x panels [p0, p1)
 * of x's prepared rows and the packed weights; e's pointers index from row 0 and column 0 */
#define FT_AMX_I8_ROWS(NAME, ATTR)                                                                                 \
    ATTR static void NAME(const ft_lp_kernel *vnni, const ft_lp_rows *x, const uint8_t *packed,                  \
                          const ft_lp_layout *lay, int64_t N, void *out, int64_t ldo, int64_t r0, int64_t r1,     \
                          int64_t p0, int64_t p1, const ft_lp_epi *e, int32_t *acc) {                             \
        T_CONFIG();                                                                                               \
        for (int64_t r = r0; r < r1; r += BLK) {                                                                  \
            const int two_a = r + BLK <= x->Mp; /* rows r + 16 .. r + 31 exist (zeros past M) */               \
            const int m = (int)(r1 - r < BLK ? r1 - r : BLK);                                                     \
            for (int64_t p = p0; p < p1; p += 2) {                                                                \
                const int two_b = p + 1 < p1; /* panel p + 1 is this task's (and exists: p1 <= panels) */        \
                const int64_t col0 = p * FT_LP_PANEL;                                                             \
                const int n = (int)(N - col0 < BLK ? N - col0 : BLK);                                             \
                const int nn = two_b ? n : (n < FT_LP_PANEL ? n : FT_LP_PANEL);                                   \
                T_ZERO(0); T_ZERO(1); T_ZERO(2); T_ZERO(3);                                                       \
                const uint8_t *a0 = x->data + r * x->lda, *b0 = packed + (size_t)p * lay->panel_bytes;           \
                for (int64_t g = 0; g < lay->groups; g += STEP_GROUPS) {                                          \
                    T_LOAD(4, a0 + g * 4, x->lda);                                                                \
                    T_LOAD(6, b0 + g * 64, 64);                                                                   \
                    T_DPBUSD(0, 4, 6);                                                                            \
                    if (two_b) { T_LOAD(7, b0 + lay->panel_bytes + g * 64, 64); T_DPBUSD(1, 4, 7); }              \
                    if (two_a) {                                                                                  \
                        T_LOAD(5, a0 + 16 * x->lda + g * 4, x->lda);                                              \
                        T_DPBUSD(2, 5, 6);                                                                        \
                        if (two_b) T_DPBUSD(3, 5, 7);                                                             \
                    }                                                                                             \
                }                                                                                                 \
                T_STORE(0, acc, BLK * 4); T_STORE(1, acc + 16, BLK * 4);                                          \
                T_STORE(2, acc + 16 * BLK, BLK * 4); T_STORE(3, acc + 16 * BLK + 16, BLK * 4);                    \
                finish_block(vnni, acc, m, nn, e, r, col0, out, ldo);                                             \
            }                                                                                                     \
        }                                                                                                         \
        T_RELEASE();                                                                                              \
    }

/* ---- the model of the tile instructions (Intel SDM, AMX: tileloadd, tilezero, tdpbusd,
 * tilestored; palette 1, every tile configured 16 rows x 64 bytes): one thread's tile registers ---- */
static _Thread_local uint8_t emu_tiles[8][16][64];
static void emu_load(int t, const void *base, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy(emu_tiles[t][r], (const uint8_t *)base + r * stride, 64);
}
static void emu_store(int t, void *base, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy((uint8_t *)base + r * stride, emu_tiles[t][r], 64);
}
static void emu_dpbusd(int c, int a, int b) {   /* C[m][n] += sum_k sum_i A.u8[m][4k + i] B.s8[k][4n + i] */
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            int32_t acc;
            memcpy(&acc, emu_tiles[c][m] + 4 * n, 4);
            for (int k = 0; k < 16; k++)
                for (int i = 0; i < 4; i++)
                    acc += (int32_t)emu_tiles[a][m][4 * k + i] * (int32_t)(int8_t)emu_tiles[b][k][4 * n + i];
            memcpy(emu_tiles[c][m] + 4 * n, &acc, 4);
        }
}
#define T_CONFIG() (void)0
#define T_RELEASE() (void)0
#define T_ZERO(t) memset(emu_tiles[t], 0, sizeof emu_tiles[t])
#define T_LOAD(t, base, stride) emu_load(t, base, stride)
#define T_STORE(t, base, stride) emu_store(t, base, stride)
#define T_DPBUSD(c, a, b) emu_dpbusd(c, a, b)
FT_AMX_I8_ROWS(rows_modelled, )
#undef T_CONFIG
#undef T_RELEASE
#undef T_ZERO
#undef T_LOAD
#undef T_STORE
#undef T_DPBUSD

#ifdef FT_HAVE_AMX_INT8
#define AMX_I8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))

static int usable;
static pthread_once_t usable_once = PTHREAD_ONCE_INIT;

static void probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    const int amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1;
    if (amx_tile && amx_int8) usable = ft_amx_tile_permission();
}

int ft_amx_int8_usable(void) {
    pthread_once(&usable_once, probe);
    return usable;
}

#define T_CONFIG() ft_amx_configure_tiles()   /* amx.c: 8 tiles of 16 rows x 64 bytes */
#define T_RELEASE() _tile_release()
#define T_ZERO(t) _tile_zero(t)
#define T_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define T_STORE(t, base, stride) _tile_stored(t, base, stride)
#define T_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
FT_AMX_I8_ROWS(rows_tiles, AMX_I8)
#else
int ft_amx_int8_usable(void) { return 0; }
#endif

void ft_amx_int8_rows(const ft_lp_kernel *vnni, int modelled, const ft_lp_rows *x, const uint8_t *packed,
                      const ft_lp_layout *lay, int64_t N, void *out, int64_t ldo, int64_t r0, int64_t r1, int64_t p0,
                      int64_t p1, const ft_lp_epi *e, void *scratch) {
#ifdef FT_HAVE_AMX_INT8
    if (!modelled) {
        rows_tiles(vnni, x, packed, lay, N, out, ldo, r0, r1, p0, p1, e, scratch);
        return;
    }
#endif
    rows_modelled(vnni, x, packed, lay, N, out, ldo, r0, r1, p0, p1, e, scratch);
}
