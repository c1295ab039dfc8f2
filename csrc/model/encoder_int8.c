/* int8 encoders: a float32 CPU encoder quantized in place -- each layer's four
 * projection matrices (post-LN BERT's Wqkv, Wo, W1, W2; pre-LN ModernBERT's Wqkv, Wo, Wi of 2I rows, Wo of
 * the MLP, without biases), and optionally the word embeddings, become int8 with one float32 scale per
 * output channel (row); their float32 copies are freed, the other tensors stay float32 (ELECTRA's
 * embeddings_project among them: one small linear layer, run in float32) -- and the named int8
 * tensors (read, write) that saving and loading go through. */
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "model/encoder.h"

/* the view that starts at float offset `off`, or -1 */
static int64_t view_at(const ft_encoder *e, size_t off) {
    for (size_t k = 0; k < e->n_views; k++)
        if (e->views[k].offset == off) return (int64_t)k;
    return -1;
}

static size_t view_floats(const ft_param_view *v) { return (size_t)v->shape[0] * (size_t)v->shape[1]; }

ft_status ft_encoder_quantize(ft_encoder *e, int embeddings) {
    if (e->be->device.kind != FT_DEVICE_CPU)
        return ft_error(FT_ERR_UNSUPPORTED, "int8 encoders run on the CPU backend; quantize a CPU encoder");
    if (e->int8) return ft_error(FT_ERR_INVALID_ARGUMENT, "this encoder is already int8");
    if (e->wtype != FT_F32 || e->dtype != FT_F32)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "quantize a float32 encoder (this one is %s)",
                        ft_dtype_name(ft_encoder_dtype(e)));
    ft_backend *be = e->be;
    /* word embeddings are E wide (ELECTRA-small: embedding_size, projected to hidden_size after them) */
    const int64_t L = e->cfg.num_layers, E = ft_config_embedding_size(&e->cfg), V = ft_config_vocab_rows(&e->cfg);
    int64_t shapes[4][2];   /* each layer's own (a pruned layer's are smaller): ft_encoder_layer_shapes */
    ft_encoder_int8 *q = calloc(1, sizeof *q);
    if (!q || !(q->layer = calloc(L ? (size_t)L : 1, sizeof *q->layer))) {
        ft_encoder_int8_free(q);
        return ft_error(FT_ERR_NOMEM, "out of memory");
    }
    size_t qb = 0, sc = 0;
    for (int64_t l = 0; l < L; l++) {
        ft_encoder_layer_shapes(e, l, shapes);
        for (int k = 0; k < 4; k++) {
            q->layer[l][k].q = qb;
            q->layer[l][k].s = sc;
            qb += (size_t)(shapes[k][0] * shapes[k][1]);
            sc += (size_t)shapes[k][0];
        }
    }
    q->word = embeddings != 0;
    if (q->word) {
        q->word_q = qb;
        q->word_s = sc;
        qb += (size_t)(V * E);
        sc += (size_t)V;
    }
    q->data = aligned_alloc(64, (qb + 63) & ~(size_t)63);
    q->scale = malloc((sc ? sc : 1) * sizeof(float));
    q->data_bytes = qb;
    q->scales = sc;
    if (!q->data || !q->scale) {
        ft_encoder_int8_free(q);
        return ft_error(FT_ERR_NOMEM, "cannot allocate %zu bytes of int8 weights", qb);
    }
    /* a non-finite weight has no int8 value: refused naming its tensor, the encoder unchanged */
    for (size_t k = 0; k < e->n_views; k++) {
        const ft_param_view *v = &e->views[k];
        const float *w = e->host_params + v->offset;
        for (size_t j = 0; v->ndim == 2 && j < view_floats(v); j++)
            if (!(w[j] - w[j] == 0.0f)) {
                ft_encoder_int8_free(q);
                return ft_error(FT_ERR_INVALID_ARGUMENT, "%s[%lld, %lld] = %g: int8 weights need finite values", v->name,
                                (long long)(j / (size_t)v->shape[1]), (long long)(j % (size_t)v->shape[1]),
                                (double)w[j]);
            }
    }
    ft_status st = FT_OK;
    for (int64_t l = 0; l < L && st == FT_OK; l++) {
        const ft_layer_offsets *o = &e->layers[l];
        const size_t src[4] = {o->wqkv, o->wo, o->w1, o->w2};
        ft_encoder_layer_shapes(e, l, shapes);
        for (int k = 0; k < 4 && st == FT_OK; k++)
            st = be->quantize_weight(be, q->data + q->layer[l][k].q, q->scale + q->layer[l][k].s,
                                     e->host_params + src[k], shapes[k][0], shapes[k][1]);
    }
    if (st == FT_OK && q->word)
        st = be->quantize_weight(be, q->data + q->word_q, q->scale + q->word_s, e->host_params + e->word, V, E);
    if (st != FT_OK) {
        ft_encoder_int8_free(q);
        return st;
    }
    /* which views are now int8, and where their rows are */
    int *is_q = calloc(e->n_views ? e->n_views : 1, sizeof *is_q);
    if (!is_q) {
        ft_encoder_int8_free(q);
        return ft_error(FT_ERR_NOMEM, "out of memory");
    }
    for (size_t k = 0; k < e->n_views; k++) {
        ft_param_view *v = &e->views[k];
        for (int64_t l = 0; l < L && !is_q[k]; l++) {
            const ft_layer_offsets *o = &e->layers[l];
            const size_t src[4] = {o->wqkv, o->wo, o->w1, o->w2};
            ft_encoder_layer_shapes(e, l, shapes);
            for (int m = 0; m < 4; m++) {
                const size_t end = src[m] + (size_t)(shapes[m][0] * shapes[m][1]);
                if (v->ndim == 2 && v->offset >= src[m] && v->offset < end) {   /* Q, K, V: rows of the QKV block */
                    is_q[k] = 1;
                    v->qoffset = q->layer[l][m].q + (v->offset - src[m]);
                    v->soffset = q->layer[l][m].s + (v->offset - src[m]) / (size_t)shapes[m][1];
                    break;
                }
            }
        }
        if (q->word && v->offset == e->word) {
            is_q[k] = 1;
            v->qoffset = q->word_q;
            v->soffset = q->word_s;
        }
    }
    /* the float32 table without them, in the same order */
    size_t keep = 0;
    for (size_t k = 0; k < e->n_views; k++)
        if (!is_q[k]) keep += view_floats(&e->views[k]);
    float *np = calloc(keep ? keep : 1, sizeof(float));
    size_t *moved = malloc((e->n_views ? e->n_views : 1) * sizeof *moved);
    if (!np || !moved) {
        free(np);
        free(moved);
        free(is_q);
        ft_encoder_int8_free(q);
        return ft_error(FT_ERR_NOMEM, "out of memory");
    }
    size_t off = 0;
    for (size_t k = 0; k < e->n_views; k++) {
        if (is_q[k]) { moved[k] = FT_NO_OFFSET; continue; }
        memcpy(np + off, e->host_params + e->views[k].offset, view_floats(&e->views[k]) * sizeof(float));
        moved[k] = off;
        off += view_floats(&e->views[k]);
    }
    /* every offset the encoder keeps names a view's start: move it with its view (int8: gone) */
#define MOVE(field) do { const int64_t vk = view_at(e, field); field = vk < 0 ? FT_NO_OFFSET : moved[vk]; } while (0)
    MOVE(e->word); MOVE(e->pos); MOVE(e->type); MOVE(e->emb_ln_g); MOVE(e->emb_ln_b);
    MOVE(e->pooler_w); MOVE(e->pooler_b); MOVE(e->proj_w); MOVE(e->proj_b); MOVE(e->final_g); MOVE(e->final_b);
    for (int64_t l = 0; l < L; l++) {
        ft_layer_offsets *o = &e->layers[l];
        MOVE(o->wqkv); MOVE(o->bqkv); MOVE(o->wo); MOVE(o->bo); MOVE(o->ln1_g); MOVE(o->ln1_b);
        MOVE(o->w1); MOVE(o->b1); MOVE(o->w2); MOVE(o->b2); MOVE(o->ln2_g); MOVE(o->ln2_b);
    }
#undef MOVE
    for (size_t k = 0; k < e->n_views; k++) {
        e->views[k].offset = moved[k];
        e->views[k].int8 = is_q[k];
    }
    free(moved);
    free(is_q);
    free(e->host_params);
    e->host_params = np;
    e->params = np;
    e->n_params = keep;
    e->int8 = q;
    e->wtype = FT_I8;
    e->lowp = be->linear_lp_pays(be, FT_I8);
    if (e->packed) be->free(be, e->packed);   /* remade, smaller, on the next forward */
    e->packed = NULL;
    e->packed_floats = 0;
    e->packed_ok = 0;
    return FT_OK;
}

int ft_encoder_int8_products(const ft_encoder *e) { return e->wtype == FT_I8 && e->lowp; }
int ft_encoder_int8_embeddings(const ft_encoder *e) { return e->int8 && e->int8->word; }

int ft_encoder_tensor_is_int8(const ft_encoder *e, size_t i) { return i < e->n_views && e->views[i].int8; }

ft_status ft_encoder_tensor_int8(const ft_encoder *e, size_t i, int8_t **data, float **scale) {
    if (i >= e->n_views) return ft_error(FT_ERR_OUT_OF_RANGE, "tensor index %zu out of range", i);
    const ft_param_view *v = &e->views[i];
    if (!v->int8) return ft_error(FT_ERR_INVALID_ARGUMENT, "%s is a float32 tensor", v->name);
    *data = e->int8->data + v->qoffset;
    *scale = e->int8->scale + v->soffset;
    return FT_OK;
}

ft_status ft_encoder_set_tensor(ft_encoder *e, size_t i, const float *data) {
    if (i >= e->n_views) return ft_error(FT_ERR_OUT_OF_RANGE, "tensor index %zu out of range", i);
    const ft_param_view *v = &e->views[i];
    if (v->int8)
        return ft_error(FT_ERR_DTYPE, "%s is int8 in this encoder: set it with its int8 values and scales", v->name);
    pthread_mutex_lock(&e->lock);
    memcpy(e->host_params + v->offset, data, view_floats(v) * sizeof(float));
    if (v->optional) e->has_pooler = 1;
    const ft_status st = ft_encoder_sync_params(e);
    pthread_mutex_unlock(&e->lock);
    return st;
}

ft_status ft_encoder_set_tensor_int8(ft_encoder *e, size_t i, const int8_t *data, const float *scale) {
    if (i >= e->n_views) return ft_error(FT_ERR_OUT_OF_RANGE, "tensor index %zu out of range", i);
    const ft_param_view *v = &e->views[i];
    if (!v->int8) return ft_error(FT_ERR_DTYPE, "%s is a float32 tensor in this encoder", v->name);
    for (int64_t r = 0; r < v->shape[0]; r++)
        if (!(scale[r] >= 0.0f && scale[r] < 1e30f))
            return ft_error(FT_ERR_INVALID_ARGUMENT, "%s: scale[%lld] = %g; scales must be finite and >= 0", v->name,
                            (long long)r, (double)scale[r]);
    const size_t n = view_floats(v);
    pthread_mutex_lock(&e->lock);
    memcpy(e->int8->data + v->qoffset, data, n);
    memcpy(e->int8->scale + v->soffset, scale, (size_t)v->shape[0] * sizeof(float));
    e->packed_ok = 0;
    pthread_mutex_unlock(&e->lock);
    return FT_OK;
}
