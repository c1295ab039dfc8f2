// fasttran's CUDA emulator: the warp matrix API (nvcuda::wmma). Each lane's fragment holds the
// whole tile (row-major, num_elements = rows x cols), so loads, stores and mma_sync need no
// communication between lanes: every lane computes the same tile, in fp32 with fused multiply-adds
// in k order from inputs in the fragment's type (TF32 fragments are rounded to TF32 by mma_sync).
// As the CUDA documentation says of load_matrix_sync, store_matrix_sync and mma_sync, each first
// waits until all lanes of the warp have arrived (a warp barrier; with FASTTRAN_EMU_CHECK=barriers
// the lanes must also agree on the call site). What a GPU leaves unspecified is not emulated: the
// mapping of x[i] to tile positions (code that depends on it is not portable), and the tensor
// cores' internal accumulation order.
// Shapes: m16n16k16, m32n8k16, m8n32k16 (fp16, bf16), m16n16k8 (tf32).
#ifndef FTEMU_MMA_H
#define FTEMU_MMA_H
#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "emu_check.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision { struct tf32 {}; }

inline float __float_to_tf32(float f) { return ftemu::f32_to_tf32(f); }

namespace detail {
template <typename T> struct storage { typedef T type; };
template <> struct storage<precision::tf32> { typedef float type; };
template <typename Use, int M, int N, int K> struct dims;
template <int M, int N, int K> struct dims<matrix_a, M, N, K> { static constexpr int rows = M, cols = K; };
template <int M, int N, int K> struct dims<matrix_b, M, N, K> { static constexpr int rows = K, cols = N; };
template <int M, int N, int K> struct dims<accumulator, M, N, K> { static constexpr int rows = M, cols = N; };
template <typename T, int M, int N, int K> constexpr bool valid_shape() {
    return std::is_same<T, precision::tf32>::value ? (M == 16 && N == 16 && K == 8)
                                                   : ((M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) ||
                                                      (M == 8 && N == 32 && K == 16));
}
inline void warp_arrive(const char *file, int line) { ftemu::wmma_arrive(file, line); }
}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    static_assert(std::is_same<Use, accumulator>::value || !std::is_same<Layout, void>::value,
                  "matrix_a / matrix_b fragments need a row_major or col_major layout");
    typedef typename detail::storage<T>::type storage_element_type;
    typedef storage_element_type element_type;
    static constexpr int rows = detail::dims<Use, M, N, K>::rows, cols = detail::dims<Use, M, N, K>::cols;
    static constexpr int num_elements = rows * cols;
    storage_element_type x[num_elements];   // row-major tile
};

template <typename Use, int M, int N, int K, typename T, typename L, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, L> &f, const V &v) {
    typedef typename fragment<Use, M, N, K, T, L>::storage_element_type E;
    for (int i = 0; i < f.num_elements; i++) f.x[i] = E(v);
}

// matrix_a / matrix_b: the layout is the fragment's
template <typename Use, int M, int N, int K, typename T, typename L, typename P>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L> &f, const P *p, unsigned ldm,
                             const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    ftemu::wmma_operand(p, ldm, sizeof(P), "wmma::load_matrix_sync", file, line);
    detail::warp_arrive(file, line);
    static_assert(!std::is_same<Use, accumulator>::value, "an accumulator load needs a layout_t");
    static_assert(detail::valid_shape<T, M, N, K>(), "not a wmma shape");
    typedef typename fragment<Use, M, N, K, T, L>::storage_element_type E;
    const bool row = std::is_same<L, row_major>::value;
    for (int r = 0; r < f.rows; r++)
        for (int c = 0; c < f.cols; c++) f.x[r * f.cols + c] = E(p[row ? (size_t)r * ldm + c : (size_t)c * ldm + r]);
}

template <int M, int N, int K, typename T, typename P>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T> &f, const P *p, unsigned ldm, layout_t layout,
                             const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    ftemu::wmma_operand(p, ldm, sizeof(P), "wmma::load_matrix_sync", file, line);
    detail::warp_arrive(file, line);
    typedef typename fragment<accumulator, M, N, K, T>::storage_element_type E;
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++)
            f.x[r * N + c] = E(p[layout == mem_row_major ? (size_t)r * ldm + c : (size_t)c * ldm + r]);
}

template <int M, int N, int K, typename T, typename P>
inline void store_matrix_sync(P *p, const fragment<accumulator, M, N, K, T> &f, unsigned ldm, layout_t layout,
                              const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    ftemu::wmma_operand(p, ldm, sizeof(P), "wmma::store_matrix_sync", file, line);
    detail::warp_arrive(file, line);
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++)
            p[layout == mem_row_major ? (size_t)r * ldm + c : (size_t)c * ldm + r] = P((float)f.x[r * N + c]);
}

template <int M, int N, int K, typename TA, typename LA, typename TB, typename LB, typename TC, typename TD>
inline void mma_sync(fragment<accumulator, M, N, K, TD> &d, const fragment<matrix_a, M, N, K, TA, LA> &a,
                     const fragment<matrix_b, M, N, K, TB, LB> &b, const fragment<accumulator, M, N, K, TC> &c,
                     const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    detail::warp_arrive(file, line);
    static_assert(detail::valid_shape<TA, M, N, K>(), "not a wmma shape");
    const bool tf32 = std::is_same<TA, precision::tf32>::value;
    float acc[M * N];
    for (int i = 0; i < M * N; i++) acc[i] = (float)c.x[i];
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float s = acc[i * N + j];
            for (int k = 0; k < K; k++) {
                float av = (float)a.x[i * K + k], bv = (float)b.x[k * N + j];
                if (tf32) { av = ftemu::f32_to_tf32(av); bv = ftemu::f32_to_tf32(bv); }
                s = fmaf(av, bv, s);
            }
            acc[i * N + j] = s;
        }
    typedef typename fragment<accumulator, M, N, K, TD>::storage_element_type E;
    for (int i = 0; i < M * N; i++) d.x[i] = E(acc[i]);
}

}  // namespace wmma
}  // namespace nvcuda
#endif
