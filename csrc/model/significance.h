/* First-order significance (fasttran.compress; Michel et al. 2019, Molchanov et al. 2019) as a layer
 * backward's recorder (model/layer.h): the layer stack switches it on once
 * (ft_layer_stack_set_significance); the layers' backward calls it without knowing what it is. */
#ifndef FT_MODEL_SIGNIFICANCE_H
#define FT_MODEL_SIGNIFICANCE_H
#include "model/layer.h"

/* r = a recorder of the per-row gradient x activation of every head, FFN group (ffn_group neurons,
 * dividing each layer's FFN width) and residual branch of the count layers of shapes `shapes`, the
 * first being the encoder's layer `first`. Its rows: the stack's heads, then its FFN groups, then
 * two columns per layer (dL/dout . out and dL/dout . x). */
ft_status ft_significance_recorder(ft_layer_recorder *r, const ft_layer_shape *shapes, int64_t first, int64_t count,
                                   int64_t ffn_group);

/* the recorder's rows of the last backward (N rows; B sequences of seqs (B, 3): first row, length)
 * summed per sequence, in row order: heads (B, heads), ffn (B, groups), layers (B, count) = the out
 * column minus the x column; host memory, NULL: not wanted */
ft_status ft_significance_sums(const ft_layer_recorder *r, ft_backend *be, const int32_t *seqs, int64_t B, int64_t N,
                               float *heads, float *ffn, float *layers);
#endif
