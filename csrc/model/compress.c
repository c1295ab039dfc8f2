/* A compressed copy of an encoder: the kept layers, heads and FFN neurons copied into an encoder of
 * the smaller structure (fasttran.h, ft_encoder_compress). The structure itself (per-layer heads and
 * FFN widths, attention mode per head) lives in the config; model/encoder.c lays the parameters out
 * from it, so a pruned layer's GEMMs are smaller, not masked.
 *
 * Layer l of src (heads NH_l of size hs, A_l = NH_l hs, FFN width I_l) -> layer j of dst:
 *   Wqkv (3 A, C)   rows of the kept heads, in Q, K and V;  bqkv likewise
 *   Wo (C, A)       the kept heads' columns;  bo, LayerNorm 1: as they are
 *   W1 (I, C), b1   rows / entries of the kept neurons;  W2 (C, I): their columns;  b2, LayerNorm 2
 * and, with a pruned vocabulary, the kept tokens' word-embedding rows (the config's vocab_map sends
 * every other id to the unknown token's row). */
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "model/encoder.h"

static int kept(const uint8_t *keep, int64_t i) { return !keep || keep[i]; }

/* dst (kept rows, cols) = the rows r of src (rows, cols) with keep[r / group] */
static int64_t copy_kept_rows(float *dst, const float *src, const uint8_t *keep, int64_t rows, int64_t cols,
                              int64_t group) {
    int64_t n = 0;
    for (int64_t r = 0; r < rows; r++)
        if (kept(keep, r / group)) memcpy(dst + (n++) * cols, src + r * cols, (size_t)cols * sizeof(float));
    return n;
}

/* dst (rows, kept columns) = the columns c of src (rows, cols) with keep[c / group] */
static void copy_kept_cols(float *dst, const float *src, const uint8_t *keep, int64_t rows, int64_t cols,
                           int64_t group, int64_t kept_cols) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = 0;
        for (int64_t c = 0; c < cols; c++)
            if (kept(keep, c / group)) dst[r * kept_cols + n++] = src[r * cols + c];
    }
}

ft_status ft_encoder_compress(const ft_encoder *src, const ft_compress_spec *spec, ft_encoder **out) {
    *out = NULL;
    const ft_bert_config *c = &src->cfg;
    const int64_t L = c->num_layers, C = c->hidden_size, hs = C / c->num_heads;
    const ft_compress_spec none = {NULL, NULL, NULL, NULL, 0, NULL, 0};
    if (!spec) spec = &none;
    if (src->cfg.norm != FT_NORM_POST)   /* its ops are post-LN BERT layers' */
        return ft_error(FT_ERR_UNSUPPORTED, "compression (ft_encoder_compress) is not supported for pre-LN encoders (ModernBERT) yet");
    if (src->proj_w != FT_NO_OFFSET)
        return ft_error(FT_ERR_UNSUPPORTED, "compress: an encoder whose embeddings are projected (embedding_size %lld != "
                        "hidden_size %lld, ELECTRA-small) is not supported", (long long)ft_config_embedding_size(c),
                        (long long)C);
    if (src->int8)
        return ft_error(FT_ERR_UNSUPPORTED, "compress: this encoder is int8; prune or approximate the float32 model, "
                        "then quantize the result");
    int64_t *heads = calloc((size_t)L + 1, sizeof *heads), *inter = calloc((size_t)L + 1, sizeof *inter);
    uint8_t *modes = calloc((size_t)src->head_first[L] + 1, 1);
    ft_status st = heads && inter && modes ? FT_OK : ft_error(FT_ERR_NOMEM, "out of memory");
    int64_t Lk = 0, neuron0 = 0, sign_match = 0, nmodes = 0;
    for (int64_t l = 0; st == FT_OK && l < L; neuron0 += src->layer_intermediate[l], l++) {
        if (!kept(spec->keep_layers, l)) continue;
        int64_t nh = 0, ni = 0;
        for (int64_t h = src->head_first[l]; h < src->head_first[l + 1]; h++) {
            if (!kept(spec->keep_heads, h)) continue;
            const uint8_t m = spec->head_attention ? spec->head_attention[h] : src->head_attention[h];
            if (m != FT_ATTN_EXACT && m != FT_ATTN_SIGN_MATCH) {
                st = ft_error(FT_ERR_INVALID_ARGUMENT, "compress: head %lld of layer %lld has attention mode %d; expected "
                              "0 (exact) or 1 (sign matching)", (long long)(h - src->head_first[l]), (long long)l, (int)m);
                break;
            }
            modes[nmodes++] = m;
            sign_match |= m == FT_ATTN_SIGN_MATCH;
            nh++;
        }
        for (int64_t i = 0; i < src->layer_intermediate[l]; i++) ni += kept(spec->keep_neurons, neuron0 + i);
        if (st == FT_OK && nh == 0)
            st = ft_error(FT_ERR_INVALID_ARGUMENT, "compress: the plan removes every attention head of layer %lld; a "
                          "layer needs at least one head (remove the whole layer instead)", (long long)l);
        if (st == FT_OK && ni == 0)
            st = ft_error(FT_ERR_INVALID_ARGUMENT, "compress: the plan removes every FFN neuron of layer %lld; a layer "
                          "needs at least one (remove the whole layer instead)", (long long)l);
        heads[Lk] = nh;
        inter[Lk++] = ni;
    }
    if (st == FT_OK && L > 0 && Lk == 0)
        st = ft_error(FT_ERR_INVALID_ARGUMENT, "compress: the plan removes every layer; keep at least one");
    /* the vocabulary: the kept tokens' rows in id order, every other id reading unknown_token's; rows
     * (the source row of each new one) */
    const int64_t V = c->vocab_size, src_rows = ft_config_vocab_rows(c);
    int32_t *vmap = NULL, *rows = NULL;
    int64_t vrows = src_rows;
    if (st == FT_OK && (spec->keep_tokens || src->vocab_map)) {
        vmap = malloc((size_t)V * sizeof *vmap);
        rows = malloc((size_t)src_rows * sizeof *rows);
        uint8_t *seen = calloc((size_t)src_rows, 1);
        if (!vmap || !rows || !seen) st = ft_error(FT_ERR_NOMEM, "out of memory");
        const int64_t unk = spec->unknown_token;
        if (st == FT_OK && spec->keep_tokens && (unk < 0 || unk >= V || !spec->keep_tokens[unk]))
            st = ft_error(FT_ERR_INVALID_ARGUMENT, "compress: the unknown token %lld must be one of the kept tokens: the "
                          "ids whose rows are removed read its row", (long long)unk);
        vrows = 0;
        for (int64_t t = 0; st == FT_OK && t < V; t++) {
            if (spec->keep_tokens ? !spec->keep_tokens[t] : 0) continue;
            const int64_t r = src->vocab_map ? src->vocab_map[t] : t;
            if (!spec->keep_tokens) {   /* src's own pruned vocabulary, as it is */
                vmap[t] = (int32_t)r;
                continue;
            }
            if (seen[r]) {
                st = ft_error(FT_ERR_INVALID_ARGUMENT, "compress: token %lld has no word-embedding row of its own in this "
                              "model (its vocabulary was pruned before); keep only tokens it has", (long long)t);
                break;
            }
            seen[r] = 1;
            vmap[t] = (int32_t)vrows;
            rows[vrows++] = (int32_t)r;
        }
        if (!spec->keep_tokens)
            for (int64_t r = 0; r < src_rows; r++) rows[r] = (int32_t)r;
        if (st == FT_OK && spec->keep_tokens)
            for (int64_t t = 0; t < V; t++)
                if (!spec->keep_tokens[t]) vmap[t] = vmap[unk];
        if (!spec->keep_tokens) vrows = src_rows;
        free(seen);
    }
    ft_bert_config cfg = *c;
    cfg.vocab_map = vmap;
    cfg.vocab_rows = vmap ? vrows : 0;
    cfg.num_layers = Lk;
    cfg.layer_heads = heads;
    cfg.layer_intermediate = inter;
    cfg.head_attention = modes;
    cfg.sign_match_keys = sign_match ? (spec->sign_match_keys > 0 ? spec->sign_match_keys : c->sign_match_keys) : 0;
    ft_encoder *e = NULL;
    if (st == FT_OK) st = ft_encoder_create(&cfg, src->be->device, src->dtype, &e);
    free(heads);
    free(inter);
    free(modes);
    free(vmap);
    if (st != FT_OK) {
        free(rows);
        return st;
    }

    const float *S = src->host_params;
    float *D = e->host_params;
    /* embeddings (the word rows kept) and the pooler: the same tensors at their own offsets */
    for (int64_t r = 0; r < ft_config_vocab_rows(&e->cfg); r++)
        memcpy(D + e->word + r * C, S + src->word + (rows ? rows[r] : r) * C, (size_t)C * sizeof(float));
    free(rows);
    memcpy(D + e->pos, S + src->pos, (size_t)(src->emb_ln_b + C - src->pos) * sizeof(float));
    memcpy(D + e->pooler_w, S + src->pooler_w, (src->n_params - src->pooler_w) * sizeof(float));
    e->has_pooler = src->has_pooler;
    int64_t j = 0;
    neuron0 = 0;
    for (int64_t l = 0; l < L; neuron0 += src->layer_intermediate[l], l++) {
        if (!kept(spec->keep_layers, l)) continue;
        const ft_layer_offsets *a = &src->layers[l], *b = &e->layers[j];
        const int64_t A = src->layer_heads[l] * hs, I = src->layer_intermediate[l];
        const int64_t Ak = e->layer_heads[j] * hs, Ik = e->layer_intermediate[j];
        const uint8_t *kh = spec->keep_heads ? spec->keep_heads + src->head_first[l] : NULL;
        const uint8_t *kn = spec->keep_neurons ? spec->keep_neurons + neuron0 : NULL;
        for (int k = 0; k < 3; k++) {   /* Q, K, V rows and biases of the kept heads */
            copy_kept_rows(D + b->wqkv + k * Ak * C, S + a->wqkv + k * A * C, kh, A, C, hs);
            copy_kept_rows(D + b->bqkv + k * Ak, S + a->bqkv + k * A, kh, A, 1, hs);
        }
        copy_kept_cols(D + b->wo, S + a->wo, kh, C, A, hs, Ak);
        memcpy(D + b->bo, S + a->bo, (size_t)C * sizeof(float));
        memcpy(D + b->ln1_g, S + a->ln1_g, (size_t)C * sizeof(float));
        memcpy(D + b->ln1_b, S + a->ln1_b, (size_t)C * sizeof(float));
        copy_kept_rows(D + b->w1, S + a->w1, kn, I, C, 1);
        copy_kept_rows(D + b->b1, S + a->b1, kn, I, 1, 1);
        copy_kept_cols(D + b->w2, S + a->w2, kn, C, I, 1, Ik);
        memcpy(D + b->b2, S + a->b2, (size_t)C * sizeof(float));
        memcpy(D + b->ln2_g, S + a->ln2_g, (size_t)C * sizeof(float));
        memcpy(D + b->ln2_b, S + a->ln2_b, (size_t)C * sizeof(float));
        j++;
    }
    st = ft_encoder_sync_params(e);
    if (st != FT_OK) { ft_encoder_free(e); return st; }
    *out = e;
    return FT_OK;
}
