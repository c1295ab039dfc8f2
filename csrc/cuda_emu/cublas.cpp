// fasttran's CUDA emulator: cuBLAS and cuBLASLt GEMMs over OpenBLAS (see cublas_v2.h, cublasLt.h).
//
// One routine serves every entry point: each operand is read in its storage type (fp32, fp16,
// bf16; TF32 modes round fp32 inputs to TF32), the product is an fp32 SGEMM, then the epilogue
// (beta * C, bias, activation, aux output) and the rounding to the output type. Plain fp32
// column-major GEMMs go straight to SGEMM. Operands are checked against the device allocations
// first: a GEMM reaching outside one fails as on a GPU.
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "cublasLt.h"
#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "emu_internal.h"

extern "C" {
#include "cpu/blas.h"
}

struct cublasContext {
    cudaStream_t stream;
    cublasMath_t math;
    cublasPointerMode_t pointer_mode;
};
struct cublasLtContext { int unused; };
struct cublasLtMatmulDescOpaque_t {
    cublasComputeType_t compute;
    cudaDataType_t scale;
    int pointer_mode;
    cublasOperation_t transa, transb;
    cublasLtEpilogue_t epilogue;
    const void *bias;
    long long bias_batch_stride;
    void *aux;
    long long aux_ld, aux_batch_stride;
    int aux_type_set, bias_type_set;
    cudaDataType_t aux_type, bias_type;
};
struct cublasLtMatrixLayoutOpaque_t {
    cudaDataType_t type;
    cublasLtOrder_t order;
    uint64_t rows, cols;
    int64_t ld;
    int batch;
    long long stride;
};
struct cublasLtMatmulPreferenceOpaque_t { size_t max_workspace; uint32_t min_align[4]; };   // A, B, C, D

namespace {

using namespace ftemu;

size_t type_size(cudaDataType_t t) {
    switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16F: case CUDA_R_16BF: return 2;
    default: return 0;
    }
}
const char *type_name(cudaDataType_t t) {
    switch (t) {
    case CUDA_R_32F: return "fp32";
    case CUDA_R_16F: return "fp16";
    case CUDA_R_16BF: return "bf16";
    default: return "an unsupported type";
    }
}
inline float load(cudaDataType_t t, const void *p, size_t i) {
    switch (t) {
    case CUDA_R_16F: return (float)static_cast<const __half *>(p)[i];
    case CUDA_R_16BF: return (float)static_cast<const __nv_bfloat16 *>(p)[i];
    default: return static_cast<const float *>(p)[i];
    }
}
inline void store(cudaDataType_t t, void *p, size_t i, float v) {
    switch (t) {
    case CUDA_R_16F: static_cast<__half *>(p)[i] = __half(v); break;
    case CUDA_R_16BF: static_cast<__nv_bfloat16 *>(p)[i] = __nv_bfloat16(v); break;
    default: static_cast<float *>(p)[i] = v; break;
    }
}

// a stored matrix: rows x cols, leading dimension ld, column- or row-major, `batch` of them
// `stride` elements apart
struct matrix {
    const char *name;
    const void *p;
    cudaDataType_t type;
    int64_t rows, cols, ld;
    bool row_major;
    int batch;
    long long stride;
    size_t index(int64_t i, int64_t j) const { return row_major ? (size_t)(i * ld + j) : (size_t)(i + j * ld); }
};

// every element the GEMM touches lies inside one live device allocation
bool in_bounds(const matrix &m, const char *api) {
    if (m.rows == 0 || m.cols == 0 || m.batch == 0) return true;
    const int64_t minor = m.row_major ? m.cols : m.rows, major = m.row_major ? m.rows : m.cols;
    const int64_t span = (major - 1) * m.ld + minor, last = (int64_t)(m.batch - 1) * m.stride;
    const int64_t lo = last < 0 ? last : 0, hi = (last > 0 ? last : 0) + span;
    const size_t es = type_size(m.type);
    const char *start = static_cast<const char *>(m.p) + lo * (int64_t)es;
    if (is_device_range(start, (size_t)(hi - lo) * es)) return true;
    char where[256];
    describe_address(m.p, where, sizeof where);
    fail(cudaErrorIllegalAddress, "%s: operand %s (%lld x %lld %s, ld %lld, %d batch(es) %lld apart) at %p does not lie "
         "inside one device allocation (its start is %s)", api, m.name, (long long)m.rows, (long long)m.cols,
         type_name(m.type), (long long)m.ld, m.batch, m.stride, m.p, where);
    return false;
}

float gelu_tanh(float x) { return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x))); }

struct epilogue {
    cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
    const void *bias = nullptr;
    cudaDataType_t bias_type = CUDA_R_32F;
    long long bias_batch_stride = 0;
    void *aux = nullptr;
    cudaDataType_t aux_type = CUDA_R_32F;
    long long aux_ld = 0, aux_batch_stride = 0;
};

// how fp32 inputs are rounded as the tensor cores read them: the *_FAST_* compute types (and
// TF32 math mode) convert A and B to TF32 / bf16 / fp16 (nearest; fp16 overflows to inf), then
// multiply exactly and accumulate in fp32
enum input_rounding { ROUND_NONE, ROUND_TF32, ROUND_BF16, ROUND_F16 };

float round_input(float v, input_rounding r) {
    switch (r) {
    case ROUND_TF32: return f32_to_tf32(v);
    case ROUND_BF16: return bf16_to_f32(f32_to_bf16(v));
    case ROUND_F16: return f16_to_f32(f32_to_f16(v));
    default: return v;
    }
}

// D = act(alpha op(A) op(B) + beta C + bias), m x n, op(A) m x k, op(B) k x n, per batch
cublasStatus_t gemm(const char *api, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const matrix &A,
                    const matrix &B, float beta, const matrix &C, const matrix &D, input_rounding rnd, const epilogue &ep) {
    if (m < 0 || n < 0 || k < 0 || D.batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
    for (const matrix *x : {&A, &B, &C, &D})
        if (!type_size(x->type)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m == 0 || n == 0 || D.batch == 0) return CUBLAS_STATUS_SUCCESS;
    const bool use_c = beta != 0.0f;
    if (!in_bounds(A, api) || !in_bounds(B, api) || (use_c && !in_bounds(C, api)) || !in_bounds(D, api))
        return CUBLAS_STATUS_SUCCESS;   // the error surfaces at the next synchronisation, as on a GPU
    const bool has_bias = ep.kind == CUBLASLT_EPILOGUE_BIAS || ep.kind == CUBLASLT_EPILOGUE_RELU_BIAS ||
                          ep.kind == CUBLASLT_EPILOGUE_GELU_BIAS || ep.kind == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    const bool has_aux = ep.kind == CUBLASLT_EPILOGUE_GELU_AUX || ep.kind == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    if (has_bias) {
        matrix bias{"bias", ep.bias, ep.bias_type, m, 1, m, false, D.batch, ep.bias_batch_stride};
        if (!ep.bias) return CUBLAS_STATUS_INVALID_VALUE;
        if (!in_bounds(bias, api)) return CUBLAS_STATUS_SUCCESS;
    }
    if (has_aux) {
        matrix aux{"aux", ep.aux, ep.aux_type, m, n, ep.aux_ld, false, D.batch, ep.aux_batch_stride};
        if (!ep.aux || ep.aux_ld < m) return CUBLAS_STATUS_INVALID_VALUE;
        if (!in_bounds(aux, api)) return CUBLAS_STATUS_SUCCESS;
    }
    const bool plain = A.type == CUDA_R_32F && B.type == CUDA_R_32F && C.type == CUDA_R_32F && D.type == CUDA_R_32F &&
                       rnd == ROUND_NONE && !A.row_major && !B.row_major && !D.row_major && C.p == D.p && C.ld == D.ld &&
                       !C.row_major && C.stride == D.stride && ep.kind == CUBLASLT_EPILOGUE_DEFAULT;
    if (m > 0x7fffffff || n > 0x7fffffff || k > 0x7fffffff) return CUBLAS_STATUS_NOT_SUPPORTED;
    std::vector<float> a, b, d;
    for (int bi = 0; bi < D.batch; bi++) {
        const long long oa = bi * A.stride, ob = bi * B.stride, oc = bi * C.stride, od = bi * D.stride;
        if (plain) {
            const float *pa = static_cast<const float *>(A.p) + oa, *pb = static_cast<const float *>(B.p) + ob;
            float *pd = static_cast<float *>(const_cast<void *>(D.p)) + od;
            if (k == 0 || alpha == 0.0f) {   // BLAS semantics: C = beta C, A and B not read
                for (int64_t j = 0; j < n; j++)
                    for (int64_t i = 0; i < m; i++) pd[i + j * D.ld] = use_c ? beta * pd[i + j * D.ld] : 0.0f;
                continue;
            }
            ft_blas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (blasint)m,
                          (blasint)n, (blasint)k, alpha, pa, (blasint)A.ld, pb, (blasint)B.ld, beta, pd, (blasint)D.ld);
            continue;
        }
        // op(A) as an m x k and op(B) as a k x n column-major fp32 matrix, inputs rounded as the
        // GPU reads them
        a.assign((size_t)m * (size_t)k, 0.0f);
        b.assign((size_t)k * (size_t)n, 0.0f);
        d.assign((size_t)m * (size_t)n, 0.0f);
        for (int64_t j = 0; j < k; j++)
            for (int64_t i = 0; i < m; i++) {
                float v = load(A.type, A.p, (size_t)oa + (ta ? A.index(j, i) : A.index(i, j)));
                a[(size_t)(i + j * m)] = round_input(v, rnd);
            }
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < k; i++) {
                float v = load(B.type, B.p, (size_t)ob + (tb ? B.index(j, i) : B.index(i, j)));
                b[(size_t)(i + j * k)] = round_input(v, rnd);
            }
        if (k > 0)
            ft_blas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, (blasint)m, (blasint)n, (blasint)k, 1.0f, a.data(),
                          (blasint)m, b.data(), (blasint)k, 0.0f, d.data(), (blasint)m);
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < m; i++) {
                float v = alpha * d[(size_t)(i + j * m)];
                if (use_c) v += beta * load(C.type, C.p, (size_t)oc + C.index(i, j));
                if (has_bias) v += load(ep.bias_type, ep.bias, (size_t)(bi * ep.bias_batch_stride + i));
                if (has_aux) store(ep.aux_type, ep.aux, (size_t)(bi * ep.aux_batch_stride + i + j * ep.aux_ld), v);
                switch (ep.kind) {
                case CUBLASLT_EPILOGUE_RELU: case CUBLASLT_EPILOGUE_RELU_BIAS: v = v > 0.0f ? v : 0.0f; break;
                case CUBLASLT_EPILOGUE_GELU: case CUBLASLT_EPILOGUE_GELU_BIAS: case CUBLASLT_EPILOGUE_GELU_AUX:
                case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: v = gelu_tanh(v); break;
                default: break;
                }
                store(D.type, const_cast<void *>(D.p), (size_t)od + D.index(i, j), v);
            }
    }
    return CUBLAS_STATUS_SUCCESS;
}

input_rounding rounding_of(cublasComputeType_t c, cudaDataType_t a, cublasMath_t math) {
    if (a != CUDA_R_32F) return ROUND_NONE;
    if (c == CUBLAS_COMPUTE_32F_FAST_TF32 || (c == CUBLAS_COMPUTE_32F && math == CUBLAS_TF32_TENSOR_OP_MATH))
        return ROUND_TF32;
    if (c == CUBLAS_COMPUTE_32F_FAST_16BF) return ROUND_BF16;
    if (c == CUBLAS_COMPUTE_32F_FAST_16F) return ROUND_F16;
    return ROUND_NONE;
}

float scalar(const void *p, cublasComputeType_t c) {
    return c == CUBLAS_COMPUTE_16F || c == CUBLAS_COMPUTE_16F_PEDANTIC ? (float)*static_cast<const __half *>(p)
                                                                       : *static_cast<const float *>(p);
}

bool valid_op(cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T; }

cublasStatus_t gemm_ex(cublasHandle_t h, const char *api, cublasOperation_t transa, cublasOperation_t transb, int m,
                       int n, int k, const void *alpha, const void *A, cudaDataType_t Atype, int lda, long long sa,
                       const void *B, cudaDataType_t Btype, int ldb, long long sb, const void *beta, void *C,
                       cudaDataType_t Ctype, int ldc, long long sc, int batch, cublasComputeType_t compute) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!stream_valid(h->stream)) {
        fail(cudaErrorInvalidResourceHandle, "%s on a stream that does not exist", api);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    if (!valid_op(transa) || !valid_op(transb) || m < 0 || n < 0 || k < 0 || batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
    const int64_t arows = transa == CUBLAS_OP_N ? m : k, acols = transa == CUBLAS_OP_N ? k : m;
    const int64_t brows = transb == CUBLAS_OP_N ? k : n, bcols = transb == CUBLAS_OP_N ? n : k;
    if (lda < (arows > 1 ? arows : 1) || ldb < (brows > 1 ? brows : 1) || ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    const matrix Am{"A", A, Atype, arows, acols, lda, false, batch, sa};
    const matrix Bm{"B", B, Btype, brows, bcols, ldb, false, batch, sb};
    const matrix Cm{"C", C, Ctype, m, n, ldc, false, batch, sc};
    return gemm(api, transa == CUBLAS_OP_T, transb == CUBLAS_OP_T, m, n, k, scalar(alpha, compute), Am, Bm,
                scalar(beta, compute), Cm, Cm, rounding_of(compute, Atype, h->math), epilogue());
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = new cublasContext{nullptr, CUBLAS_DEFAULT_MATH, CUBLAS_POINTER_MODE_HOST};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) { delete h; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream(cublasHandle_t h, cudaStream_t *s) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    *s = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->math = mode;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetMathMode(cublasHandle_t h, cublasMath_t *mode) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    *mode = h->math;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetPointerMode(cublasHandle_t h, cublasPointerMode_t mode) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->pointer_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *, size_t) {
    return h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    default: return "CUBLAS_STATUS_INTERNAL_ERROR";
    }
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc) {
    return gemm_ex(h, "cublasSgemm", ta, tb, m, n, k, alpha, A, CUDA_R_32F, lda, 0, B, CUDA_R_32F, ldb, 0, beta, C,
                   CUDA_R_32F, ldc, 0, 1, CUBLAS_COMPUTE_32F);
}
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                         int k, const float *alpha, const float *A, int lda, long long sa,
                                         const float *B, int ldb, long long sb, const float *beta, float *C, int ldc,
                                         long long sc, int batch) {
    return gemm_ex(h, "cublasSgemmStridedBatched", ta, tb, m, n, k, alpha, A, CUDA_R_32F, lda, sa, B, CUDA_R_32F, ldb,
                   sb, beta, C, CUDA_R_32F, ldc, sc, batch, CUBLAS_COMPUTE_32F);
}
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType_t At, int lda, const void *B,
                            cudaDataType_t Bt, int ldb, const void *beta, void *C, cudaDataType_t Ct, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t) {
    return gemm_ex(h, "cublasGemmEx", ta, tb, m, n, k, alpha, A, At, lda, 0, B, Bt, ldb, 0, beta, C, Ct, ldc, 0, 1,
                   compute);
}
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                          int k, const void *alpha, const void *A, cudaDataType_t At, int lda,
                                          long long sa, const void *B, cudaDataType_t Bt, int ldb, long long sb,
                                          const void *beta, void *C, cudaDataType_t Ct, int ldc, long long sc,
                                          int batch, cublasComputeType_t compute, cublasGemmAlgo_t) {
    return gemm_ex(h, "cublasGemmStridedBatchedEx", ta, tb, m, n, k, alpha, A, At, lda, sa, B, Bt, ldb, sb, beta, C, Ct,
                   ldc, sc, batch, compute);
}

// ---- cuBLASLt --------------------------------------------------------------------------------------------
cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) { *h = new cublasLtContext{0}; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) { delete h; return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType_t scale) {
    *d = new cublasLtMatmulDescOpaque_t();
    (*d)->compute = compute;
    (*d)->scale = scale;
    (*d)->transa = (*d)->transb = CUBLAS_OP_N;
    (*d)->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { delete d; return CUBLAS_STATUS_SUCCESS; }

#define FTEMU_GET(type, field)                                \
    do {                                                      \
        if (size != sizeof(type)) return CUBLAS_STATUS_INVALID_VALUE; \
        type v;                                               \
        memcpy(&v, buf, sizeof v);                            \
        field = v;                                            \
    } while (0)

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: FTEMU_GET(cublasComputeType_t, d->compute); break;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: FTEMU_GET(cudaDataType_t, d->scale); break;
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: FTEMU_GET(int32_t, d->pointer_mode); break;
    case CUBLASLT_MATMUL_DESC_TRANSA: FTEMU_GET(cublasOperation_t, d->transa); break;
    case CUBLASLT_MATMUL_DESC_TRANSB: FTEMU_GET(cublasOperation_t, d->transb); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE: FTEMU_GET(cublasLtEpilogue_t, d->epilogue); break;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: FTEMU_GET(const void *, d->bias); break;
    case CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE: FTEMU_GET(int64_t, d->bias_batch_stride); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: FTEMU_GET(void *, d->aux); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: FTEMU_GET(int64_t, d->aux_ld); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE: FTEMU_GET(int64_t, d->aux_batch_stride); break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: FTEMU_GET(cudaDataType_t, d->aux_type); d->aux_type_set = 1; break;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: FTEMU_GET(cudaDataType_t, d->bias_type); d->bias_type_set = 1; break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
    *l = new cublasLtMatrixLayoutOpaque_t{type, CUBLASLT_ORDER_COL, rows, cols, ld, 1, 0};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) { delete l; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr,
                                                const void *buf, size_t size) {
    switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE: { uint32_t t = 0; FTEMU_GET(uint32_t, t); l->type = (cudaDataType_t)t; break; }
    case CUBLASLT_MATRIX_LAYOUT_ORDER: { int32_t o = 0; FTEMU_GET(int32_t, o); l->order = (cublasLtOrder_t)o; break; }
    case CUBLASLT_MATRIX_LAYOUT_ROWS: FTEMU_GET(uint64_t, l->rows); break;
    case CUBLASLT_MATRIX_LAYOUT_COLS: FTEMU_GET(uint64_t, l->cols); break;
    case CUBLASLT_MATRIX_LAYOUT_LD: FTEMU_GET(int64_t, l->ld); break;
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: FTEMU_GET(int32_t, l->batch); break;
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: FTEMU_GET(int64_t, l->stride); break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
}
#undef FTEMU_GET

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
    *p = new cublasLtMatmulPreferenceOpaque_t{0, {256, 256, 256, 256}};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) { delete p; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size) {
    if (attr >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && attr <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
        if (size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&p->min_align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf, sizeof(uint32_t));
        return CUBLAS_STATUS_SUCCESS;
    }
    if (attr != CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES || size != sizeof(uint64_t)) return CUBLAS_STATUS_NOT_SUPPORTED;
    uint64_t v;
    memcpy(&v, buf, sizeof v);
    p->max_workspace = (size_t)v;
    return CUBLAS_STATUS_SUCCESS;
}

static bool lt_epilogue_supported(cublasLtEpilogue_t e) {
    switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: case CUBLASLT_EPILOGUE_RELU: case CUBLASLT_EPILOGUE_BIAS:
    case CUBLASLT_EPILOGUE_RELU_BIAS: case CUBLASLT_EPILOGUE_GELU: case CUBLASLT_EPILOGUE_GELU_BIAS:
    case CUBLASLT_EPILOGUE_GELU_AUX: case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return true;
    default: return false;
    }
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t,
                                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int *returned) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
    *returned = 0;
    if (!lt_epilogue_supported(d->epilogue)) return CUBLAS_STATUS_NOT_SUPPORTED;
    memset(&results[0], 0, sizeof results[0]);
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    for (int i = 0; i < 4; i++) results[0].algo.data[i] = pref ? pref->min_align[i] : 256;   // what it needs
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t Al, const void *B, cublasLtMatrixLayout_t Bl, const void *beta,
                              const void *C, cublasLtMatrixLayout_t Cl, void *D, cublasLtMatrixLayout_t Dl,
                              const cublasLtMatmulAlgo_t *algo, void *, size_t, cudaStream_t stream) {
    if (!h || !d || !Al || !Bl || !Cl || !Dl) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (algo) {   // the heuristic's algorithm needs the alignments its preference promised
        const void *ops[4] = {A, B, C, D};
        for (int i = 0; i < 4; i++) {
            uint64_t need = algo->data[i] ? algo->data[i] : 256;
            // memory-check mode starts allocations 32-byte aligned (to end them at a guard page),
            // not at cudaMalloc's 256: there only what that mode can hold is checked
            if (config().check_memory && need > 32) need = 32;
            if ((uintptr_t)ops[i] % need) {
                // a GPU faults (misaligned address) in the kernel: the error surfaces at the next sync
                fail(cudaErrorIllegalAddress, "cublasLtMatmul: matrix %c at %p is not %llu-byte aligned, as the "
                     "preference its algorithm was chosen with promised (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%c_BYTES)",
                     "ABCD"[i], ops[i], (unsigned long long)need, "ABCD"[i]);
                return CUBLAS_STATUS_SUCCESS;
            }
        }
    }
    if (!stream_valid(stream)) {
        fail(cudaErrorInvalidResourceHandle, "cublasLtMatmul on a stream that does not exist");
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    if (!lt_epilogue_supported(d->epilogue) || !valid_op(d->transa) || !valid_op(d->transb))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    const bool ta = d->transa == CUBLAS_OP_T, tb = d->transb == CUBLAS_OP_T;
    const int64_t m = (int64_t)Dl->rows, n = (int64_t)Dl->cols, k = (int64_t)(ta ? Al->rows : Al->cols);
    if ((int64_t)(ta ? Al->cols : Al->rows) != m || (int64_t)(tb ? Bl->cols : Bl->rows) != k ||
        (int64_t)(tb ? Bl->rows : Bl->cols) != n || (int64_t)Cl->rows != m || (int64_t)Cl->cols != n)
        return CUBLAS_STATUS_INVALID_VALUE;
    const int batch = Dl->batch;
    for (auto *l : {Al, Bl, Cl})
        if (l->batch != batch) return CUBLAS_STATUS_INVALID_VALUE;
    auto mat = [](const char *name, const void *p, cublasLtMatrixLayout_t l) {
        return matrix{name, p, l->type, (int64_t)l->rows, (int64_t)l->cols, l->ld, l->order == CUBLASLT_ORDER_ROW,
                      l->batch, l->stride};
    };
    for (auto *l : {Al, Bl, Cl, Dl}) {
        const int64_t minor = l->order == CUBLASLT_ORDER_ROW ? (int64_t)l->cols : (int64_t)l->rows;
        if (l->ld < (minor > 1 ? minor : 1)) return CUBLAS_STATUS_INVALID_VALUE;
    }
    epilogue ep;
    ep.kind = d->epilogue;
    ep.bias = d->bias;
    ep.bias_type = d->bias_type_set ? d->bias_type : Dl->type;
    ep.bias_batch_stride = d->bias_batch_stride;
    ep.aux = d->aux;
    ep.aux_type = d->aux_type_set ? d->aux_type : Dl->type;
    ep.aux_ld = d->aux_ld;
    ep.aux_batch_stride = d->aux_batch_stride;
    const float a = scalar(alpha, d->compute), b = scalar(beta, d->compute);
    return gemm("cublasLtMatmul", ta, tb, m, n, k, a, mat("A", A, Al), mat("B", B, Bl), b, mat("C", C, Cl),
                mat("D", D, Dl), rounding_of(d->compute, Al->type, CUBLAS_DEFAULT_MATH), ep);
}

}  // extern "C"
