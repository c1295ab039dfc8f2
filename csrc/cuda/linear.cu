// Linear layers on the GPU; nothing is packed (`packed_weight_bytes` is 0), the weights are read
// as they are.
//
// float32: cuBLAS SGEMM (true fp32, no TF32) and the row kernels of rowops.cu as the epilogue
// (bias prefill + GEMM with beta = 1; GEMM + bias/activation; GEMM + bias/residual/LayerNorm).
//
// float16 / bfloat16: cuBLASLt on the tensor cores, float32 accumulation, the epilogue fused:
//   linear_forward            D = act(x W^T + bias): BIAS, RELU_BIAS or GELU_BIAS (cuBLASLt's GELU
//                             is the tanh form; bf16 takes it for GELU(erf) too, see below; fp16's
//                             GELU(erf) and tanh run as one row pass after BIAS)
//   linear_residual_ln_forward D = x W^T + bias + residual (C = residual, beta = 1, BIAS), then
//                             LayerNorm in place (statistics in float32); or, with
//                             FASTTRAN_CUDA_RESIDUAL_LN=rowpass, D = x W^T + bias (BIAS, no C
//                             operand) and the residual added in the LayerNorm's row pass (one more
//                             read of the residual there, in float32; x W^T + bias is rounded to
//                             the storage type before the sum, as transformers rounds it: MiniLM's
//                             last layer in bf16 vs float64, 1.099% against the epilogue's 1.042%
//                             and transformers' 1.092%, on the emulator): which of the two is faster
//                             is a device measurement (the GEMM reading C ran at 1.6x its floor on an
//                             H200); the default stays until it is measured
// Each (dtype, shape, epilogue) is planned once -- layouts, operation descriptor, the heuristic's
// algorithm for the fixed workspace -- and kept in the backend (LT_PLANS, oldest replaced).
//
// Row-major out (M, N) = x (M, K) W (N, K)^T is column-major out^T (N x M) = W^T' x^T': A = W read
// as a column-major (K x N) matrix with op T, B = x as a column-major (K x M) matrix, m = N, n = M.
// The bias (length m = N) runs along D's columns-major rows: one value per output column.
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "cuda_common.cuh"

using namespace ftcuda;

namespace {

void plan_release(lt_plan *p) {
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->c) cublasLtMatrixLayoutDestroy(p->c);
    memset(p, 0, sizeof *p);
}

ft_status lt_ready(ft_backend *be) {
    cuda_ctx *c = ctx_of(be);
    if (c->lt) return FT_OK;
    FT_CUBLAS(cublasLtCreate(&c->lt), "cublasLtCreate");
    cudaError_t e = cudaMalloc(&c->lt_ws, LT_WORKSPACE);
    if (e != cudaSuccess) {
        cudaGetLastError();   // not sticky: the next launch check must not see it
        cublasLtDestroy(c->lt);
        c->lt = nullptr;
        c->lt_ws = nullptr;
        return g_host->error(e == cudaErrorMemoryAllocation ? FT_ERR_NOMEM : FT_ERR_DEVICE,
                             "cannot allocate the %zu MiB cuBLASLt workspace on %s: %s", LT_WORKSPACE >> 20, c->name,
                             cudaGetErrorString(e));
    }
    return FT_OK;
}

ft_status plan_make(cuda_ctx *c, lt_plan *p) {
    const cudaDataType_t t = cuda_type(p->dt);
    const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    const int32_t epi = p->epilogue;
    FT_CUBLAS(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    FT_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT), "matmul transa");
    FT_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN), "matmul transb");
    FT_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), "matmul epilogue");
    FT_CUBLAS(cublasLtMatrixLayoutCreate(&p->a, t, (uint64_t)p->K, (uint64_t)p->N, p->K), "layout A");
    FT_CUBLAS(cublasLtMatrixLayoutCreate(&p->b, t, (uint64_t)p->K, (uint64_t)p->M, p->K), "layout B");
    FT_CUBLAS(cublasLtMatrixLayoutCreate(&p->c, t, (uint64_t)p->N, (uint64_t)p->M, p->N), "layout C");
    cublasLtMatmulPreference_t pref;
    FT_CUBLAS(cublasLtMatmulPreferenceCreate(&pref), "matmul preference");
    const size_t ws = LT_WORKSPACE;
    cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                             sizeof ws);
    // the alignment the operands really have: an algorithm chosen for 256-byte operands (the
    // default promise) may fault on others (weights of odd-sized models, workspace slots)
    const cublasLtMatmulPreferenceAttributes_t aligns[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; i++)
        st = cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &p->align, sizeof p->align);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS) return blas_fail(st, "cublasLtMatmulAlgoGetHeuristic");
    if (found < 1)
        return g_host->error(FT_ERR_UNSUPPORTED, "cuBLASLt has no algorithm for a %s %lld x %lld x %lld product "
                             "with epilogue %d on %s", p->dt == FT_BF16 ? "bfloat16" : "float16", (long long)p->M,
                             (long long)p->N, (long long)p->K, (int)epi, c->name);
    p->algo = res.algo;
    return FT_OK;
}

// the largest power of two (<= 256) dividing every address
uint32_t common_alignment(std::initializer_list<const void *> ps) {
    uintptr_t bits = 256;
    for (const void *p : ps)
        if (p) bits |= (uintptr_t)p;
    return (uint32_t)(bits & (~bits + 1));
}

// the kept plan of (dt, M, N, K, epilogue, accumulate, alignment), made on first use
ft_status plan_for(ft_backend *be, ft_dtype dt, int64_t M, int64_t N, int64_t K, int epilogue, int accumulate,
                   uint32_t align, lt_plan **out) {
    FT_TRY(lt_ready(be));
    cuda_ctx *c = ctx_of(be);
    for (int i = 0; i < c->n_plans; i++) {
        lt_plan *p = &c->plans[i];
        if (p->dt == dt && p->M == M && p->N == N && p->K == K && p->epilogue == epilogue &&
            p->accumulate == accumulate && p->align == align) {
            *out = p;
            return FT_OK;
        }
    }
    int slot = c->n_plans < LT_PLANS ? c->n_plans++ : (c->next_plan++ % LT_PLANS);
    lt_plan *p = &c->plans[slot];
    plan_release(p);
    p->dt = dt, p->M = M, p->N = N, p->K = K, p->epilogue = epilogue, p->accumulate = accumulate, p->align = align;
    ft_status st = plan_make(c, p);
    if (st != FT_OK) {
        plan_release(p);
        p->M = -1;   // never matches
        return st;
    }
    *out = p;
    return FT_OK;
}

// D (M, N) row-major = x W^T (+ C when residual) with the epilogue on bias
ft_status lt_linear(ft_backend *be, ft_dtype dt, void *out, const void *x, const void *w, const void *bias,
                    const void *residual, int64_t M, int64_t K, int64_t N, int epilogue) {
    lt_plan *p;
    FT_TRY(plan_for(be, dt, M, N, K, epilogue, residual != nullptr, common_alignment({w, x, residual, out}), &p));
    cuda_ctx *c = ctx_of(be);
    FT_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
              "matmul bias");
    const float one = 1.0f, zero = 0.0f;
    FT_CUBLAS(cublasLtMatmul(c->lt, p->op, &one, w, p->a, x, p->b, residual ? &one : &zero, residual ? residual : out,
                             p->c, out, p->c, &p->algo, c->lt_ws, LT_WORKSPACE, c->stream),
              "cublasLtMatmul");
    return FT_OK;
}

}  // namespace

namespace ftcuda {
void lt_release(cuda_ctx *c) {
    for (int i = 0; i < c->n_plans; i++) plan_release(&c->plans[i]);
    c->n_plans = 0;
    if (c->lt_ws) cudaFree(c->lt_ws);
    if (c->lt) cublasLtDestroy(c->lt);
    c->lt_ws = nullptr;
    c->lt = nullptr;
}
}  // namespace ftcuda

size_t cuda_packed_weight_bytes(ft_backend *, int64_t, int64_t) { return 0; }

ft_status cuda_pack_weight(ft_backend *, float *, const float *, int64_t, int64_t) { return FT_OK; }

ft_status cuda_linear_forward(ft_backend *be, ft_dtype dt, void *out, const void *x, const void *w,
                              const float *w_packed, const void *bias, int64_t M, int64_t K, int64_t N, int act) {
    (void)w_packed;
    if (M == 0) return FT_OK;
    if (dt == FT_F32) {
        float *o = (float *)out;
        if (act < 0) {   // out = bias (prefilled) + x w^T
            ft_status st = bias ? cuda_broadcast_rows(be, o, (const float *)bias, M, N) : FT_OK;
            if (st != FT_OK) return st;
            return cuda_gemm(be, 0, 1, M, N, K, 1.0f, (const float *)x, K, (const float *)w, K, bias ? 1.0f : 0.0f, o, N);
        }
        ft_status st = cuda_gemm(be, 0, 1, M, N, K, 1.0f, (const float *)x, K, (const float *)w, K, 0.0f, o, N);
        if (st != FT_OK) return st;
        return cuda_bias_act_forward(be, o, (const float *)bias, M, N, (ft_activation)act);
    }
    if (dt != FT_F16 && dt != FT_BF16) return dtype_error(dt, "linear_forward");
    // the activations cuBLASLt fuses: ReLU and GELU's tanh form; the others run as a row pass after.
    // bfloat16 also fuses GELU(erf) as the tanh form: the forms differ by < 5e-4, less than one bf16
    // rounding, and the fused epilogue never rounds the pre-activation, so the result is closer to
    // the erf model than the exact pass over a rounded input (MiniLM, last layer vs float64: 0.98%
    // against 1.02%). float16 keeps the exact pass (there the form's difference is the larger error).
    const bool gelu_fused = act == FT_ACT_GELU_TANH || (act == FT_ACT_GELU_ERF && dt == FT_BF16);
    const bool fused = act == FT_ACT_RELU || gelu_fused;
    int epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    if (act == FT_ACT_RELU) epi = bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    if (gelu_fused) epi = bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    FT_TRY(lt_linear(be, dt, out, x, w, bias, nullptr, M, K, N, epi));
    if (act >= 0 && !fused) return act_rows(ctx_of(be), dt, out, nullptr, M, N, act);
    return FT_OK;
}

namespace {

// FASTTRAN_CUDA_RESIDUAL_LN (epilogue, the default, or rowpass), read once per process
enum residual_mode { RESIDUAL_EPILOGUE, RESIDUAL_ROWPASS, RESIDUAL_UNKNOWN };

residual_mode read_residual_mode() {
    const char *s = getenv("FASTTRAN_CUDA_RESIDUAL_LN");
    if (!s || !*s || !strcmp(s, "epilogue")) return RESIDUAL_EPILOGUE;
    return !strcmp(s, "rowpass") ? RESIDUAL_ROWPASS : RESIDUAL_UNKNOWN;
}

residual_mode residual_ln_mode() {
    static const residual_mode m = read_residual_mode();
    return m;
}

}  // namespace

ft_status cuda_linear_residual_ln_forward(ft_backend *be, ft_dtype dt, void *out, const void *x, const void *w,
                                          const float *w_packed, const void *bias, const void *residual,
                                          const void *gamma, const void *beta, int64_t M, int64_t K, int64_t N,
                                          float eps) {
    (void)w_packed;
    if (M == 0) return FT_OK;
    if (dt == FT_F32) {
        FT_TRY(cuda_gemm(be, 0, 1, M, N, K, 1.0f, (const float *)x, K, (const float *)w, K, 0.0f, (float *)out, N));
        return layernorm_rows(ctx_of(be), dt, out, residual, out, bias, gamma, beta, M, N, eps);
    }
    if (dt != FT_F16 && dt != FT_BF16) return dtype_error(dt, "linear_residual_ln_forward");
    const int epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    switch (residual_ln_mode()) {
    case RESIDUAL_EPILOGUE:
        FT_TRY(lt_linear(be, dt, out, x, w, bias, residual, M, K, N, epi));
        return layernorm_rows(ctx_of(be), dt, out, nullptr, out, nullptr, gamma, beta, M, N, eps);
    case RESIDUAL_ROWPASS:   // out is not the residual (as in float32 above): the GEMM writes it first
        FT_TRY(lt_linear(be, dt, out, x, w, bias, nullptr, M, K, N, epi));
        return layernorm_rows(ctx_of(be), dt, out, residual, out, nullptr, gamma, beta, M, N, eps);
    default:
        return g_host->error(FT_ERR_INVALID_ARGUMENT, "linear_residual_ln_forward: FASTTRAN_CUDA_RESIDUAL_LN=%s is not "
                             "a mode: use epilogue (the default) or rowpass", getenv("FASTTRAN_CUDA_RESIDUAL_LN"));
    }
}
