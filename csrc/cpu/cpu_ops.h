/* The CPU backend's ops (one file per op family; the table is in backend_cpu.c). */
#ifndef FT_CPU_OPS_H
#define FT_CPU_OPS_H
#include <string.h>

#include "backend.h"

ft_status cpu_embed_ln_forward(ft_backend *be, float *out, const int32_t *ids, const int32_t *types,
                               const float *word, const float *pos, const float *type,
                               const float *gamma, const float *beta, int64_t B, int64_t T,
                               int64_t C, float eps);
ft_status cpu_broadcast_rows(ft_backend *be, float *dst, const float *bias, int64_t N, int64_t C);
ft_status cpu_bias_act_forward(ft_backend *be, float *h, const float *bias, int64_t N, int64_t I,
                               ft_activation act);
ft_status cpu_bias_residual_ln_forward(ft_backend *be, float *out, const float *residual,
                                       const float *y, const float *bias, const float *gamma,
                                       const float *beta, int64_t N, int64_t C, float eps);
ft_status cpu_pool_forward(ft_backend *be, float *out, const float *h, const float *keymask,
                           int64_t B, int64_t T, int64_t C, ft_pooling mode);
size_t cpu_attention_scratch_bytes(ft_backend *be, int64_t B, int64_t T, int64_t NH);
ft_status cpu_attention_forward(ft_backend *be, float *ctx, const float *qkv, const float *keymask,
                                const int32_t *key_len, int64_t B, int64_t T, int64_t C, int64_t NH,
                                float *scratch);
/* training: train_ops.c, optim.c */
ft_status cpu_dropout(ft_backend *be, float *y, const float *x, int64_t n, float p, uint64_t key);
ft_status cpu_tanh_backward(ft_backend *be, float *dx, const float *dy, const float *y, int64_t n);
ft_status cpu_softmax_xent(ft_backend *be, float *loss, float *dlogits, const float *logits, const float *valid,
                           int64_t valid_rows, const int32_t *labels, int64_t N, int64_t K, float scale);
ft_status cpu_sum_axis(ft_backend *be, float *out, const float *x, int64_t N, int64_t K, int axis);
ft_status cpu_optim_step(ft_backend *be, const ft_optim_config *cfg, const ft_optim_tensor *t, size_t count,
                         ft_optim_info *info);
#endif
