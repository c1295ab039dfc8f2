// Linear layers on the GPU: cuBLAS reads the weights as they are (nothing is packed), and the
// epilogue is the row kernels of rowops.cu. The calls are those the encoder made before the
// backend had linear ops (bias prefill + GEMM with beta = 1; GEMM + bias/activation; GEMM +
// bias/residual/LayerNorm), so the CUDA path computes what it computed then.
#include "cuda_common.cuh"

using namespace ftcuda;

size_t cuda_packed_weight_bytes(ft_backend *, int64_t, int64_t) { return 0; }

ft_status cuda_pack_weight(ft_backend *, float *, const float *, int64_t, int64_t) { return FT_OK; }

ft_status cuda_linear_forward(ft_backend *be, float *out, const float *x, const float *w, const float *w_packed,
                              const float *bias, int64_t M, int64_t K, int64_t N, int act) {
    (void)w_packed;
    if (M == 0) return FT_OK;
    if (act < 0) {   // out = bias (prefilled) + x w^T
        ft_status st = bias ? cuda_broadcast_rows(be, out, bias, M, N) : FT_OK;
        if (st != FT_OK) return st;
        return cuda_gemm(be, 0, 1, M, N, K, 1.0f, x, K, w, K, bias ? 1.0f : 0.0f, out, N);
    }
    ft_status st = cuda_gemm(be, 0, 1, M, N, K, 1.0f, x, K, w, K, 0.0f, out, N);
    if (st != FT_OK) return st;
    return cuda_bias_act_forward(be, out, bias, M, N, (ft_activation)act);
}

ft_status cuda_linear_residual_ln_forward(ft_backend *be, float *out, const float *x, const float *w,
                                          const float *w_packed, const float *bias, const float *residual,
                                          const float *gamma, const float *beta, int64_t M, int64_t K, int64_t N,
                                          float eps) {
    (void)w_packed;
    if (M == 0) return FT_OK;
    ft_status st = cuda_gemm(be, 0, 1, M, N, K, 1.0f, x, K, w, K, 0.0f, out, N);
    if (st != FT_OK) return st;
    return cuda_bias_residual_ln_forward(be, out, residual, out, bias, gamma, beta, M, N, eps);
}
