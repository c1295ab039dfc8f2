// The reduced-precision ops (int8 weights with dynamically quantized activations,
// bf16 products over float32 activations) are CPU kernels (csrc/cpu/lowp.c): VNNI / AVX-VNNI /
// AMX-INT8 / AVX512_BF16. The CUDA backend has its own half precision (Encoder(dtype="bfloat16"
// or "float16") on cuBLASLt) and no int8 path: each op here refuses with that reason, the
// services say there is nothing to pack and nothing that pays.
#include "cuda_common.cuh"

using namespace ftcuda;

namespace {
ft_status refuse(const char *op) {
    return g_host->error(FT_ERR_UNSUPPORTED, "%s: int8 weights and the CPU's bf16 products run on the CPU backend only "
                         "(on CUDA use Encoder(dtype='bfloat16' or 'float16'))", op);
}
}  // namespace

size_t cuda_packed_weight_lp_bytes(ft_backend *, ft_dtype, int64_t, int64_t) { return 0; }
int cuda_linear_lp_pays(ft_backend *, ft_dtype) { return 0; }

ft_status cuda_quantize_weight(ft_backend *, int8_t *, float *, const float *, int64_t, int64_t) {
    return refuse("quantize_weight");
}
ft_status cuda_quantize_rows(ft_backend *, uint8_t *, float *, int32_t *, const float *, int64_t, int64_t) {
    return refuse("quantize_rows");
}
ft_status cuda_pack_weight_i8(ft_backend *, void *, const int8_t *, const float *, int64_t, int64_t) {
    return refuse("pack_weight_i8");
}
ft_status cuda_pack_weight_bf16(ft_backend *, void *, const float *, int64_t, int64_t) {
    return refuse("pack_weight_bf16");
}
ft_status cuda_gemm_i8(ft_backend *, int32_t *, const uint8_t *, const int32_t *, const void *, int64_t, int64_t,
                       int64_t, int64_t, int64_t) {
    return refuse("gemm_i8");
}
ft_status cuda_linear_lp_forward(ft_backend *, ft_dtype, float *, const float *, const void *, const float *, int64_t,
                                 int64_t, int64_t, int) {
    return refuse("linear_lp_forward");
}
ft_status cuda_linear_lp_residual_ln_forward(ft_backend *, ft_dtype, float *, const float *, const void *,
                                             const float *, const float *, const float *, const float *, int64_t,
                                             int64_t, int64_t, float) {
    return refuse("linear_lp_residual_ln_forward");
}
ft_status cuda_embed_i8_ln_forward(ft_backend *, float *, const int32_t *, const int32_t *, const int32_t *,
                                   const int8_t *, const float *, const float *, const float *, const float *,
                                   const float *, int64_t, int64_t, float) {
    return refuse("embed_i8_ln_forward");
}
