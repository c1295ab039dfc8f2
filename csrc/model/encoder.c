/* BERT encoder: parameter table, weight loading/saving, workspace and the forward layer loop.
 * Device-agnostic: all math goes through the backend table. */
#include "model/encoder.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/status.h"
#include "io/safetensors.h"

/* ---- parameter table --------------------------------------------------------------------- */

static ft_status add_view(ft_encoder *e, size_t *cap, size_t *off, const char *name, int ndim,
                          int64_t d0, int64_t d1, int optional, size_t *where) {
    if (e->n_views == *cap) {
        size_t nc = *cap ? *cap * 2 : 64;
        ft_param_view *nv = realloc(e->views, nc * sizeof *nv);
        if (!nv) return ft_error(FT_ERR_NOMEM, "out of memory building the parameter table");
        e->views = nv;
        *cap = nc;
    }
    ft_param_view *v = &e->views[e->n_views++];
    memset(v, 0, sizeof *v);
    snprintf(v->name, sizeof v->name, "%s", name);
    v->offset = *off;
    v->ndim = ndim;
    v->shape[0] = d0;
    v->shape[1] = ndim == 2 ? d1 : 1;
    v->optional = optional;
    if (where) *where = *off;
    *off += (size_t)d0 * (size_t)(ndim == 2 ? d1 : 1);
    return FT_OK;
}

static ft_status build_layout(ft_encoder *e) {
    const ft_bert_config *c = &e->cfg;
    const int64_t C = c->hidden_size, hs = c->hidden_size / c->num_heads, E = ft_config_embedding_size(c);
    size_t cap = 0, off = 0, dummy;
    char nm[96];
    const int bias = !c->no_bias, pre = c->norm == FT_NORM_PRE;
    FT_TRY(add_view(e, &cap, &off, "embeddings.word_embeddings.weight", 2, ft_config_vocab_rows(c), E, 0, &e->word));
    e->pos = FT_NO_OFFSET;   /* rotary positions: no position table */
    if (!(c->rope_theta > 0))
        FT_TRY(add_view(e, &cap, &off, "embeddings.position_embeddings.weight", 2, c->max_position_embeddings, E, 0, &e->pos));
    e->type = FT_NO_OFFSET;   /* an architecture without token types has no type table */
    if (c->type_vocab_size > 0)
        FT_TRY(add_view(e, &cap, &off, "embeddings.token_type_embeddings.weight", 2, c->type_vocab_size, E, 0, &e->type));
    FT_TRY(add_view(e, &cap, &off, "embeddings.LayerNorm.weight", 1, E, 0, 0, &e->emb_ln_g));
    e->emb_ln_b = FT_NO_OFFSET;
    if (bias) FT_TRY(add_view(e, &cap, &off, "embeddings.LayerNorm.bias", 1, E, 0, 0, &e->emb_ln_b));
    e->proj_w = e->proj_b = FT_NO_OFFSET;
    if (E != C) {   /* ELECTRA's embeddings_project: (N, E) -> (N, C) */
        FT_TRY(add_view(e, &cap, &off, "embeddings_project.weight", 2, C, E, 0, &e->proj_w));
        FT_TRY(add_view(e, &cap, &off, "embeddings_project.bias", 1, C, 0, 0, &e->proj_b));
    }
    e->layers = calloc((size_t)c->num_layers, sizeof *e->layers);
    if (!e->layers) return ft_error(FT_ERR_NOMEM, "out of memory");
    for (int64_t l = 0; l < c->num_layers; l++) {
        ft_layer_offsets *L = &e->layers[l];
        const int64_t A = ft_config_layer_heads(c, l) * hs, I = ft_config_layer_intermediate(c, l);
#define LV(suffix, nd, a, b, slot)                                                   \
        { snprintf(nm, sizeof nm, "encoder.layer.%lld.%s", (long long)l, suffix);    \
          FT_TRY(add_view(e, &cap, &off, nm, nd, a, b, 0, slot)); }
        if (pre || c->no_bias || c->qkv_fused || c->gated_ffn) {
            /* ModernBERT's layer: one QKV tensor (or three), biases where it has them, the LayerNorms
             * before attention (none in layer 0: the embeddings' stands in) and before the FFN (pre-LN)
             * or after each (post-LN), a gated FFN's first projection of 2I rows */
            L->bqkv = L->bo = L->b1 = L->b2 = L->ln1_g = L->ln1_b = L->ln2_g = L->ln2_b = FT_NO_OFFSET;
            if (c->qkv_fused) {
                LV("attention.self.qkv.weight", 2, 3 * A, C, &L->wqkv)
            } else {
                LV("attention.self.query.weight", 2, A, C, &L->wqkv)
                LV("attention.self.key.weight", 2, A, C, &dummy)
                LV("attention.self.value.weight", 2, A, C, &dummy)
            }
            if (bias && c->qkv_fused) {
                LV("attention.self.qkv.bias", 1, 3 * A, 0, &L->bqkv)
            } else if (bias) {
                LV("attention.self.query.bias", 1, A, 0, &L->bqkv)
                LV("attention.self.key.bias", 1, A, 0, &dummy)
                LV("attention.self.value.bias", 1, A, 0, &dummy)
            }
            if (pre && l > 0) {
                LV("attention.LayerNorm.weight", 1, C, 0, &L->ln1_g)
                if (bias) LV("attention.LayerNorm.bias", 1, C, 0, &L->ln1_b)
            }
            LV("attention.output.dense.weight", 2, C, A, &L->wo)
            if (bias) LV("attention.output.dense.bias", 1, C, 0, &L->bo)
            if (!pre) {
                LV("attention.output.LayerNorm.weight", 1, C, 0, &L->ln1_g)
                if (bias) LV("attention.output.LayerNorm.bias", 1, C, 0, &L->ln1_b)
            } else {
                LV("intermediate.LayerNorm.weight", 1, C, 0, &L->ln2_g)
                if (bias) LV("intermediate.LayerNorm.bias", 1, C, 0, &L->ln2_b)
            }
            const int64_t I1 = c->gated_ffn ? 2 * I : I;
            LV("intermediate.dense.weight", 2, I1, C, &L->w1)
            if (bias) LV("intermediate.dense.bias", 1, I1, 0, &L->b1)
            LV("output.dense.weight", 2, C, I, &L->w2)
            if (bias) LV("output.dense.bias", 1, C, 0, &L->b2)
            if (!pre) {
                LV("output.LayerNorm.weight", 1, C, 0, &L->ln2_g)
                if (bias) LV("output.LayerNorm.bias", 1, C, 0, &L->ln2_b)
            }
            continue;
        }
        /* A = the layer's heads x head size (C unless heads were pruned) */
        LV("attention.self.query.weight", 2, A, C, &L->wqkv)   /* rows 0..A-1 of Wqkv */
        LV("attention.self.key.weight", 2, A, C, &dummy)       /* rows A..2A-1 */
        LV("attention.self.value.weight", 2, A, C, &dummy)     /* rows 2A..3A-1 */
        LV("attention.self.query.bias", 1, A, 0, &L->bqkv)
        LV("attention.self.key.bias", 1, A, 0, &dummy)
        LV("attention.self.value.bias", 1, A, 0, &dummy)
        LV("attention.output.dense.weight", 2, C, A, &L->wo)
        LV("attention.output.dense.bias", 1, C, 0, &L->bo)
        LV("attention.output.LayerNorm.weight", 1, C, 0, &L->ln1_g)
        LV("attention.output.LayerNorm.bias", 1, C, 0, &L->ln1_b)
        LV("intermediate.dense.weight", 2, I, C, &L->w1)
        LV("intermediate.dense.bias", 1, I, 0, &L->b1)
        LV("output.dense.weight", 2, C, I, &L->w2)
        LV("output.dense.bias", 1, C, 0, &L->b2)
        LV("output.LayerNorm.weight", 1, C, 0, &L->ln2_g)
        LV("output.LayerNorm.bias", 1, C, 0, &L->ln2_b)
#undef LV
    }
    e->final_g = e->final_b = FT_NO_OFFSET;
    if (pre) {   /* the LayerNorm after the last layer */
        FT_TRY(add_view(e, &cap, &off, "final_norm.weight", 1, C, 0, 0, &e->final_g));
        if (bias) FT_TRY(add_view(e, &cap, &off, "final_norm.bias", 1, C, 0, 0, &e->final_b));
    }
    FT_TRY(add_view(e, &cap, &off, "pooler.dense.weight", 2, C, C, 1, &e->pooler_w));
    FT_TRY(add_view(e, &cap, &off, "pooler.dense.bias", 1, C, 0, 1, &e->pooler_b));
    e->n_params = off;
    return FT_OK;
}

static ft_status check_config(const ft_bert_config *c) {
#define REQ(cond, ...) if (!(cond)) return ft_error(FT_ERR_INVALID_ARGUMENT, __VA_ARGS__)
    REQ(c->vocab_size >= 1 && c->vocab_size <= INT32_MAX, "vocab_size must be in [1, 2^31), got %lld", (long long)c->vocab_size);
    REQ(c->hidden_size >= 1 && c->hidden_size <= 65536, "hidden_size must be in [1, 65536], got %lld", (long long)c->hidden_size);
    REQ(c->num_layers >= 0 && c->num_layers <= 1024, "num_hidden_layers must be in [0, 1024], got %lld", (long long)c->num_layers);
    REQ(c->num_heads >= 1 && c->hidden_size % c->num_heads == 0,
        "hidden_size %lld is not a multiple of num_attention_heads %lld", (long long)c->hidden_size, (long long)c->num_heads);
    REQ(c->intermediate_size >= 1 && c->intermediate_size <= 1 << 20, "intermediate_size must be in [1, 2^20], got %lld", (long long)c->intermediate_size);
    REQ(c->max_position_embeddings >= 1 && c->max_position_embeddings <= 1 << 20,
        "max_position_embeddings must be in [1, 2^20], got %lld", (long long)c->max_position_embeddings);
    REQ(c->type_vocab_size >= 0 && c->type_vocab_size <= 1 << 20, "type_vocab_size must be in [0, 2^20] (0: no token types), got %lld", (long long)c->type_vocab_size);
    REQ(c->embedding_size >= 0 && c->embedding_size <= 65536, "embedding_size must be in [0, 65536] (0: hidden_size), "
        "got %lld", (long long)c->embedding_size);
    REQ(c->position_ids == FT_POS_INDEX || c->position_ids == FT_POS_AFTER_PADDING, "unknown position_ids %d", (int)c->position_ids);
    REQ(c->position_ids != FT_POS_AFTER_PADDING || (c->pad_token_id >= 0 && c->pad_token_id + 1 < c->max_position_embeddings),
        "positions after the padding id need 0 <= pad_token_id < max_position_embeddings - 1, got pad_token_id %lld",
        (long long)c->pad_token_id);
    REQ(c->layer_norm_eps > 0.0f, "layer_norm_eps must be > 0, got %g", (double)c->layer_norm_eps);
    REQ(c->activation >= FT_ACT_GELU_ERF && c->activation <= FT_ACT_RELU, "unknown activation %d", (int)c->activation);
    REQ(c->norm == FT_NORM_POST || c->norm == FT_NORM_PRE, "unknown norm placement %d", (int)c->norm);
    REQ(c->norm != FT_NORM_PRE || c->num_layers >= 1, "pre-LN layers need num_hidden_layers >= 1");
    REQ(c->rope_theta >= 0.0 && c->rope_theta_local >= 0.0 && c->rope_theta < 1e300 && c->rope_theta_local < 1e300,
        "rotary theta must be >= 0 (0: none), got %g and %g", c->rope_theta, c->rope_theta_local);
    REQ(!(c->rope_theta > 0) || (c->hidden_size / c->num_heads) % 2 == 0,
        "rotary position embeddings need an even head size, got %lld", (long long)(c->hidden_size / c->num_heads));
    REQ(!(c->rope_theta > 0) || c->type_vocab_size == 0, "rotary models have no token type table");
    REQ(!(c->rope_theta > 0) || c->position_ids == FT_POS_INDEX, "rotary position embeddings take positions by index");
    REQ(c->attention_window >= 0 && c->attention_window <= INT32_MAX, "attention_window must be >= 0 (0: global), got %lld",
        (long long)c->attention_window);
    REQ(c->attention_window == 0 || c->global_every >= 1, "a local attention window needs global_every >= 1 (layer l "
        "is global when l %% global_every == 0), got %lld", (long long)c->global_every);
    REQ(c->attention_window == 0 || !(c->rope_theta > 0) || c->rope_theta_local > 0,
        "windowed rotary layers need rope_theta_local > 0");
    REQ(c->norm == FT_NORM_PRE || (!c->no_bias && !c->gated_ffn && !c->qkv_fused && !(c->rope_theta > 0) &&
                                   c->attention_window == 0),
        "layers without biases, gated FFNs, a fused QKV tensor, rotary positions and attention windows come with pre-LN "
        "layers (ModernBERT's)");
    REQ(c->embedding_size == 0 || c->embedding_size == c->hidden_size || c->norm == FT_NORM_POST,
        "pre-LN layers take embeddings of hidden_size");
    int sign_match = 0;
    for (int64_t l = 0; l < c->num_layers; l++) {
        const int64_t nh = ft_config_layer_heads(c, l), I = ft_config_layer_intermediate(c, l);
        REQ(nh >= 1 && nh <= c->num_heads, "layer %lld keeps %lld attention heads; a layer keeps 1 to "
            "num_attention_heads = %lld (remove the whole layer instead of all its heads)", (long long)l,
            (long long)nh, (long long)c->num_heads);
        REQ(I >= 1 && I <= 1 << 20, "layer %lld has intermediate size %lld; a layer keeps 1 to 2^20 FFN neurons "
            "(remove the whole layer instead of all of them)", (long long)l, (long long)I);
    }
    const int64_t heads = ft_config_total_heads(c);
    for (int64_t h = 0; c->head_attention && h < heads; h++) {
        REQ(c->head_attention[h] == FT_ATTN_EXACT || c->head_attention[h] == FT_ATTN_SIGN_MATCH,
            "head_attention[%lld] = %d; expected 0 (exact) or 1 (sign matching)", (long long)h, (int)c->head_attention[h]);
        sign_match |= c->head_attention[h] == FT_ATTN_SIGN_MATCH;
    }
    REQ(!sign_match || (c->sign_match_keys >= 1 && c->sign_match_keys <= INT32_MAX),
        "sign-matching heads need sign_match_keys >= 1, got %lld", (long long)c->sign_match_keys);
    REQ(!sign_match || c->hidden_size / c->num_heads <= 255, "sign-matching attention takes head sizes up to 255");
    if (c->vocab_map) {
        REQ(c->vocab_rows >= 1 && c->vocab_rows <= c->vocab_size, "a pruned vocabulary keeps 1 to vocab_size = %lld "
            "word-embedding rows, got %lld", (long long)c->vocab_size, (long long)c->vocab_rows);
        for (int64_t t = 0; t < c->vocab_size; t++)
            REQ(c->vocab_map[t] >= 0 && c->vocab_map[t] < c->vocab_rows, "vocab_map[%lld] = %d is not a row of the %lld "
                "kept", (long long)t, (int)c->vocab_map[t], (long long)c->vocab_rows);
    }
#undef REQ
    return FT_OK;
}

int64_t ft_config_layer_window(const ft_bert_config *c, int64_t l) {
    return c->attention_window > 0 && l % c->global_every != 0 ? c->attention_window : 0;
}

double ft_config_layer_rope_theta(const ft_bert_config *c, int64_t l) {
    return ft_config_layer_window(c, l) > 0 ? c->rope_theta_local : c->rope_theta;
}

int64_t ft_config_layer_heads(const ft_bert_config *c, int64_t l) {
    return c->layer_heads ? c->layer_heads[l] : c->num_heads;
}

int64_t ft_config_layer_intermediate(const ft_bert_config *c, int64_t l) {
    return c->layer_intermediate ? c->layer_intermediate[l] : c->intermediate_size;
}

int64_t ft_config_embedding_size(const ft_bert_config *c) {
    return c->embedding_size > 0 ? c->embedding_size : c->hidden_size;
}
int64_t ft_config_max_tokens(const ft_bert_config *c) {
    return c->max_position_embeddings - (c->position_ids == FT_POS_AFTER_PADDING ? c->pad_token_id + 1 : 0);
}
int64_t ft_config_position(const ft_bert_config *c, int64_t t, int64_t id, int real, int64_t *before) {
    if (c->position_ids != FT_POS_AFTER_PADDING) return t;
    if (id == c->pad_token_id) return c->pad_token_id;
    return c->pad_token_id + 1 + (real ? (*before)++ : *before);
}
int64_t ft_config_vocab_rows(const ft_bert_config *c) { return c->vocab_map ? c->vocab_rows : c->vocab_size; }

int64_t ft_config_total_heads(const ft_bert_config *c) {
    int64_t n = 0;
    for (int64_t l = 0; l < c->num_layers; l++) n += ft_config_layer_heads(c, l);
    return n;
}

int ft_bert_config_equal(const ft_bert_config *a, const ft_bert_config *b) {
    if (a->vocab_size != b->vocab_size || a->hidden_size != b->hidden_size || a->num_layers != b->num_layers ||
        a->num_heads != b->num_heads || a->intermediate_size != b->intermediate_size ||
        a->max_position_embeddings != b->max_position_embeddings || a->type_vocab_size != b->type_vocab_size ||
        a->layer_norm_eps != b->layer_norm_eps || a->activation != b->activation || a->pad_token_id != b->pad_token_id ||
        a->position_ids != b->position_ids || ft_config_embedding_size(a) != ft_config_embedding_size(b) ||
        a->norm != b->norm || a->rope_theta != b->rope_theta || a->rope_theta_local != b->rope_theta_local ||
        a->gated_ffn != b->gated_ffn || a->no_bias != b->no_bias || a->qkv_fused != b->qkv_fused ||
        a->attention_window != b->attention_window || (a->attention_window && a->global_every != b->global_every))
        return 0;
    for (int64_t l = 0; l < a->num_layers; l++)
        if (ft_config_layer_heads(a, l) != ft_config_layer_heads(b, l) ||
            ft_config_layer_intermediate(a, l) != ft_config_layer_intermediate(b, l))
            return 0;
    if (!a->vocab_map != !b->vocab_map || ft_config_vocab_rows(a) != ft_config_vocab_rows(b) ||
        (a->vocab_map && memcmp(a->vocab_map, b->vocab_map, (size_t)a->vocab_size * sizeof(int32_t)) != 0))
        return 0;
    const int64_t heads = ft_config_total_heads(a);
    int sign_match = 0;
    for (int64_t h = 0; h < heads; h++) {
        const int ma = a->head_attention ? a->head_attention[h] : FT_ATTN_EXACT;
        const int mb = b->head_attention ? b->head_attention[h] : FT_ATTN_EXACT;
        if (ma != mb) return 0;
        sign_match |= ma == FT_ATTN_SIGN_MATCH;
    }
    return !sign_match || a->sign_match_keys == b->sign_match_keys;
}

static ft_status attend_exact(ft_backend *be, ft_dtype dt, void *ctx, const void *qkv, const int32_t *seqs,
                              const int32_t *seqs_dev, int64_t B, int64_t C, int64_t NH, const uint8_t *modes,
                              int64_t sign_keys, void *scratch) {
    (void)modes; (void)sign_keys;
    return be->attention_forward(be, dt, ctx, qkv, seqs, seqs_dev, B, C, NH, 0, scratch);
}

static ft_status attend_modes(ft_backend *be, ft_dtype dt, void *ctx, const void *qkv, const int32_t *seqs,
                              const int32_t *seqs_dev, int64_t B, int64_t C, int64_t NH, const uint8_t *modes,
                              int64_t sign_keys, void *scratch) {
    return be->attention_heads_forward(be, dt, ctx, qkv, seqs, seqs_dev, B, C, NH, modes, sign_keys, scratch);
}

/* the encoder's own copies of a compressed model's arrays (always present, so the layer loop reads
 * them without a NULL test); the config points at them */
static ft_status copy_structure(ft_encoder *e, const ft_bert_config *c) {
    const int64_t L = c->num_layers, heads = ft_config_total_heads(c);
    e->layer_heads = malloc((size_t)(L + 1) * sizeof(int64_t));
    e->layer_intermediate = malloc((size_t)(L + 1) * sizeof(int64_t));
    e->head_first = malloc((size_t)(L + 1) * sizeof(int64_t));
    e->head_attention = malloc((size_t)heads + 1);
    e->attend = malloc((size_t)(L + 1) * sizeof *e->attend);
    if (!e->layer_heads || !e->layer_intermediate || !e->head_first || !e->head_attention || !e->attend)
        return ft_error(FT_ERR_NOMEM, "out of memory");
    int64_t h = 0;
    for (int64_t l = 0; l < L; l++) {
        e->layer_heads[l] = ft_config_layer_heads(c, l);
        e->layer_intermediate[l] = ft_config_layer_intermediate(c, l);
        e->head_first[l] = h;
        h += e->layer_heads[l];
    }
    e->head_first[L] = h;
    int sign_match = 0;
    for (int64_t k = 0; k < heads; k++) {
        e->head_attention[k] = c->head_attention ? c->head_attention[k] : FT_ATTN_EXACT;
        sign_match |= e->head_attention[k] == FT_ATTN_SIGN_MATCH;
    }
    for (int64_t l = 0; l < L; l++) {   /* each layer's attention, once: sign matching is its own op */
        e->attend[l] = attend_exact;
        for (int64_t k = e->head_first[l]; k < e->head_first[l + 1]; k++)
            if (e->head_attention[k] != FT_ATTN_EXACT) e->attend[l] = attend_modes;
    }
    e->cfg.layer_heads = e->layer_heads;
    e->cfg.layer_intermediate = e->layer_intermediate;
    e->cfg.head_attention = e->head_attention;
    e->cfg.sign_match_keys = sign_match ? c->sign_match_keys : 0;
    e->cfg.vocab_map = NULL;
    e->cfg.vocab_rows = 0;
    if (c->vocab_map) {
        if (!(e->vocab_map = malloc((size_t)c->vocab_size * sizeof(int32_t))))
            return ft_error(FT_ERR_NOMEM, "out of memory");
        memcpy(e->vocab_map, c->vocab_map, (size_t)c->vocab_size * sizeof(int32_t));
        e->cfg.vocab_map = e->vocab_map;
        e->cfg.vocab_rows = c->vocab_rows;
    }
    return FT_OK;
}

ft_status ft_encoder_create(const ft_bert_config *cfg, ft_device device, ft_dtype dtype, ft_encoder **out) {
    *out = NULL;
    FT_TRY(check_config(cfg));
    if (dtype != FT_F32 && dtype != FT_F16 && dtype != FT_BF16)
        return ft_error(FT_ERR_DTYPE, "an encoder computes in float32, float16 or bfloat16, not %s", ft_dtype_name(dtype));
    ft_dtype wtype = FT_F32;
    if (dtype != FT_F32 && device.kind == FT_DEVICE_CPU) {
        /* bf16 on the CPU: bf16 weights (packed copies of the float32 masters) and products, float32
         * activations and sums */
        if (dtype == FT_F16)
            return ft_error(FT_ERR_UNSUPPORTED, "dtype float16: the CPU backend computes in float32, or in bfloat16 on "
                            "CPUs with AVX512_BF16 (float16 runs on CUDA); use dtype float32 or bfloat16 on the CPU");
        ft_backend *cpu = ft_backend_cpu();
        if (!cpu->linear_lp_pays(cpu, FT_BF16))
            return ft_error(FT_ERR_UNSUPPORTED, "dtype bfloat16 on the CPU needs bf16 dot products (avx512_bf16: Intel "
                            "Cooper Lake, Sapphire Rapids or later, AMD Zen 4 or later); this CPU runs the '%s' kernels "
                            "without avx512_bf16. Use dtype float32 here (or device='cuda')", ft_cpu_isa());
        wtype = FT_BF16;
        dtype = FT_F32;
    }
    ft_encoder *e = calloc(1, sizeof *e);
    if (!e) return ft_error(FT_ERR_NOMEM, "out of memory");
    e->cfg = *cfg;
    e->dtype = dtype;
    e->esz = ft_dtype_size(dtype);
    e->wtype = wtype;
    e->lowp = wtype != FT_F32;
    pthread_mutex_init(&e->lock, NULL);
    ft_status st = FT_OK;
    if (device.kind == FT_DEVICE_CPU) e->be = ft_backend_cpu();
    else st = ft_backend_cuda_open(device.index, &e->be);
    if (st == FT_OK) st = copy_structure(e, cfg);
    if (st == FT_OK) st = build_layout(e);
    if (st == FT_OK) {
        e->host_params = calloc(e->n_params, sizeof(float));
        if (!e->host_params) st = ft_error(FT_ERR_NOMEM, "cannot allocate %zu parameters", e->n_params);
    }
    if (st == FT_OK) {
        if (e->be->device.kind == FT_DEVICE_CPU) e->params = e->host_params;
        else st = e->be->alloc(e->be, e->n_params * e->esz, &e->params);
    }
    if (st != FT_OK) { ft_encoder_free(e); return st; }
    *out = e;
    return FT_OK;
}

void ft_encoder_free(ft_encoder *e) {
    if (!e) return;
    if (e->be) {
        if (e->ws) e->be->free(e->be, e->ws);
        if (e->packed) e->be->free(e->be, e->packed);
        if (e->params && e->params != e->host_params) e->be->free(e->be, e->params);
        e->be->destroy(e->be);
    }
    ft_encoder_int8_free(e->int8);
    free(e->host_params);
    free(e->host_ws);
    free(e->views);
    free(e->layers);
    free(e->layer_heads);
    free(e->layer_intermediate);
    free(e->head_first);
    free(e->head_attention);
    free(e->attend);
    free(e->vocab_map);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

const ft_bert_config *ft_encoder_config(const ft_encoder *e) { return &e->cfg; }
ft_dtype ft_encoder_dtype(const ft_encoder *e) { return e->wtype != FT_F32 ? e->wtype : e->dtype; }

ft_status ft_encoder_set_tf32(ft_encoder *e, int on) {
    pthread_mutex_lock(&e->lock);
    ft_status st = e->be->set_tf32(e->be, on);
    pthread_mutex_unlock(&e->lock);
    return st;
}
int ft_encoder_has_pooler(const ft_encoder *e) { return e->has_pooler; }
size_t ft_encoder_param_count(const ft_encoder *e) { return e->n_params; }
size_t ft_encoder_workspace_bytes(const ft_encoder *e) { return e->ws_bytes; }

ft_status ft_encoder_memory_report(ft_encoder *e, ft_encoder_memory *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_lock(&e->lock);
    const int on_host = e->params == (void *)e->host_params;
    m->parameters = e->n_params * e->esz + (e->int8 ? e->int8->data_bytes + e->int8->scales * sizeof(float) : 0);
    m->packed_weights = e->packed_floats * sizeof(float);
    m->workspace = e->ws_bytes;
    m->host = e->host_ws_bytes + (on_host ? 0 : e->n_params * sizeof(float));
    ft_status st = e->be->memory_info(e->be, &m->device_free, &m->device_total, &m->backend);
    pthread_mutex_unlock(&e->lock);
    return st;
}
size_t ft_encoder_num_tensors(const ft_encoder *e) { return e->n_views; }

ft_status ft_encoder_tensor_info(const ft_encoder *e, size_t i, const char **name, int *ndim,
                                 int64_t shape[2], float **host_data) {
    if (i >= e->n_views) return ft_error(FT_ERR_OUT_OF_RANGE, "tensor index %zu out of range", i);
    const ft_param_view *v = &e->views[i];
    *name = v->name;
    *ndim = v->ndim;
    shape[0] = v->shape[0];
    shape[1] = v->shape[1];
    *host_data = v->int8 ? NULL : e->host_params + v->offset;
    if (v->int8)
        return ft_error(FT_ERR_UNSUPPORTED, "%s is stored in int8 in this quantized encoder: read it with "
                        "ft_encoder_tensor_int8", v->name);
    return FT_OK;
}

ft_status ft_encoder_copy_weights(ft_encoder *dst, const ft_encoder *src) {
    if (dst->int8 || src->int8)
        return ft_error(FT_ERR_UNSUPPORTED, "copy_weights: an int8 encoder's weights are int8 (no float32 masters) and "
                        "run on the CPU only; quantize a float32 copy instead");
    if (!ft_bert_config_equal(&dst->cfg, &src->cfg) || dst->n_params != src->n_params)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "copy_weights: the two encoders have different configs");
    memcpy(dst->host_params, src->host_params, src->n_params * sizeof(float));
    dst->has_pooler = src->has_pooler;
    return ft_encoder_sync_params(dst);
}

/* After host_params changed: the backend's copy (in the encoder's dtype), packed copies made
 * again on the next forward. Half precision is converted in slices through a small host buffer. */
ft_status ft_encoder_sync_params(ft_encoder *e) {
    e->packed_ok = 0;
    if (e->params == (void *)e->host_params) return FT_OK;
    if (e->dtype == FT_F32) {
        FT_TRY(e->be->upload(e->be, e->params, e->host_params, e->n_params * sizeof(float)));
        return e->be->synchronize(e->be);
    }
    enum { SLICE = 1 << 20 };
    void *buf = malloc((size_t)SLICE * e->esz);
    if (!buf) return ft_error(FT_ERR_NOMEM, "out of memory converting the parameters to %s", ft_dtype_name(e->dtype));
    ft_status st = FT_OK;
    for (size_t k = 0; st == FT_OK && k < e->n_params; k += SLICE) {
        const size_t n = e->n_params - k < SLICE ? e->n_params - k : SLICE;
        ft_convert_from_f32(buf, e->dtype, e->host_params + k, n);
        st = e->be->upload(e->be, (char *)e->params + k * e->esz, buf, n * e->esz);
        /* the copy reads buf before it returns (pageable memory); wait anyway before reusing it */
        if (st == FT_OK) st = e->be->synchronize(e->be);
    }
    free(buf);
    return st;
}

/* ---- loading and saving ------------------------------------------------------------------ */

/* "[a, b]" into buf (64 bytes) */
static const char *shape_str(int ndim, const int64_t *shape, char *buf) {
    size_t n = 0;
    buf[n++] = '[';
    for (int d = 0; d < ndim && n < 40; d++)
        n += (size_t)snprintf(buf + n, 64 - n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    snprintf(buf + n, 64 - n, "]");
    return buf;
}

static ft_status detect_prefix(const ft_st_file *f, const char *key, char *prefix, size_t len) {
    const size_t kl = strlen(key);
    for (size_t k = 0; k < f->n_entries; k++) {
        size_t nl = strlen(f->entries[k].name);
        if (nl >= kl && strcmp(f->entries[k].name + nl - kl, key) == 0 && nl - kl < len) {
            memcpy(prefix, f->entries[k].name, nl - kl);
            prefix[nl - kl] = '\0';
            return FT_OK;
        }
    }
    return ft_error(FT_ERR_FORMAT, "%s: no tensor named '[prefix]%s': not a checkpoint of this architecture", f->path, key);
}

ft_status ft_encoder_load_safetensors(ft_encoder *e, const char *path, const char *prefix_in) {
    return ft_encoder_load_safetensors_expect(e, path, prefix_in, -1, -1);
}

ft_status ft_encoder_load_safetensors_expect(ft_encoder *e, const char *path, const char *prefix_in,
                                             int64_t expect_bytes, int64_t expect_crc32c) {
    return ft_encoder_load_safetensors_named(e, path, prefix_in, NULL, "encoder.layer.", expect_bytes, expect_crc32c);
}

ft_status ft_encoder_load_safetensors_named(ft_encoder *e, const char *path, const char *prefix_in,
                                            const char *const *names, const char *layer_prefix,
                                            int64_t expect_bytes, int64_t expect_crc32c) {
    if (e->int8)
        return ft_error(FT_ERR_UNSUPPORTED, "%s: this encoder is int8; load float weights into a float32 encoder, then "
                        "quantize it", path);
    ft_st_file f;
    FT_TRY(ft_st_open_expect(path, expect_bytes, expect_crc32c, &f));
    char prefix[128];
    ft_status st = FT_OK;
    if (prefix_in) snprintf(prefix, sizeof prefix, "%s", prefix_in);
    else st = detect_prefix(&f, names ? names[0] : e->views[0].name, prefix, sizeof prefix);
    size_t plen = strlen(prefix), lplen = strlen(layer_prefix);
    /* a checkpoint with more layers than the config is a mismatch, not something to ignore */
    for (size_t k = 0; st == FT_OK && k < f.n_entries; k++) {
        const char *nm = f.entries[k].name;
        long long idx;
        char dot;
        if (strncmp(nm, prefix, plen) == 0 && strncmp(nm + plen, layer_prefix, lplen) == 0 &&
            sscanf(nm + plen + lplen, "%lld%c", &idx, &dot) == 2 && dot == '.' &&
            (idx < 0 || idx >= e->cfg.num_layers))
            st = ft_error(FT_ERR_FORMAT, "%s: tensor '%s' belongs to layer %lld but the config has num_hidden_layers = %lld",
                          path, nm, idx, (long long)e->cfg.num_layers);
    }
    char full[256], sbuf[64];
    int pooler_found = 0;
    for (size_t k = 0; st == FT_OK && k < e->n_views; k++) {
        const ft_param_view *v = &e->views[k];
        snprintf(full, sizeof full, "%s%s", prefix, names ? names[k] : v->name);
        const ft_st_entry *t = ft_st_find(&f, full);
        if (!t) {
            if (v->optional) continue;
            st = ft_error(FT_ERR_FORMAT, "%s: missing tensor '%s' (expected shape %s)", path, full, shape_str(v->ndim, v->shape, sbuf));
            break;
        }
        if (t->dtype != FT_F32 && t->dtype != FT_F16 && t->dtype != FT_BF16) {
            st = ft_error(FT_ERR_FORMAT, "%s: tensor '%s' has dtype %s; expected F32, F16 or BF16", path, full, t->dtype_name);
            break;
        }
        if (t->ndim != v->ndim || t->shape[0] != v->shape[0] || (v->ndim == 2 && t->shape[1] != v->shape[1])) {
            char want[64];
            st = ft_error(FT_ERR_FORMAT, "%s: tensor '%s' has shape %s; the config needs %s", path, full,
                          shape_str(t->ndim, t->shape, sbuf), shape_str(v->ndim, v->shape, want));
            break;
        }
        ft_convert_to_f32(e->host_params + v->offset, f.data + t->begin, (ft_dtype)t->dtype,
                          (size_t)v->shape[0] * (size_t)v->shape[1]);
        if (v->optional) pooler_found++;
    }
    ft_st_close(&f);
    if (st != FT_OK) return st;
    e->has_pooler = pooler_found == 2;
    if (!e->has_pooler)   /* half a pooler is as good as none */
        memset(e->host_params + e->pooler_w, 0,
               (e->n_params - e->pooler_w) * sizeof(float));
    return ft_encoder_sync_params(e);
}

ft_status ft_encoder_save_safetensors(const ft_encoder *e, const char *path, ft_dtype dtype) {
    return ft_encoder_save_safetensors_record(e, path, dtype, NULL, NULL);
}

ft_status ft_encoder_save_safetensors_record(const ft_encoder *e, const char *path, ft_dtype dtype, uint64_t *bytes,
                                             uint32_t *crc32c) {
    return ft_encoder_save_safetensors_named(e, path, dtype, NULL, bytes, crc32c);
}

ft_status ft_encoder_save_safetensors_named(const ft_encoder *e, const char *path, ft_dtype dtype,
                                            const char *const *names, uint64_t *bytes, uint32_t *crc32c) {
    if (e->int8)
        return ft_error(FT_ERR_UNSUPPORTED, "%s: an int8 encoder has no float32 weights to write in Hugging Face's "
                        "layout; its int8 weights and scales are named tensors (ft_encoder_tensor_int8)", path);
    if (dtype != FT_F32 && dtype != FT_F16 && dtype != FT_BF16)
        return ft_error(FT_ERR_DTYPE, "checkpoints are saved as float32, float16 or bfloat16, not %s", ft_dtype_name(dtype));
    size_t n = e->n_views - (e->has_pooler ? 0 : 2);
    ft_st_tensor *ts = calloc(n, sizeof *ts);
    void *conv = NULL;
    if (!ts) return ft_error(FT_ERR_NOMEM, "out of memory");
    if (dtype != FT_F32) {
        conv = malloc(e->n_params * 2);
        if (!conv) { free(ts); return ft_error(FT_ERR_NOMEM, "out of memory"); }
        ft_convert_from_f32(conv, dtype, e->host_params, e->n_params);
    }
    for (size_t k = 0; k < n; k++) {
        const ft_param_view *v = &e->views[k];
        ts[k].name = names ? names[k] : v->name;
        ts[k].dtype = dtype;
        ts[k].ndim = v->ndim;
        ts[k].shape[0] = v->shape[0];
        ts[k].shape[1] = v->shape[1];
        ts[k].data = dtype == FT_F32 ? (const void *)(e->host_params + v->offset)
                                     : (const void *)((const uint16_t *)conv + v->offset);
    }
    const ft_st_meta meta = {"format", "pt"};
    ft_status st = ft_safetensors_write(path, ts, n, &meta, 1, bytes, crc32c);
    free(conv);
    free(ts);
    return st;
}

/* ---- packed weights ------------------------------------------------------------------------ */

/* The backend's packed copies of the four layer weights (made on the first forward after the
 * weights change; a backend that reads weights as they are packs nothing): float32 panels; bf16 or
 * int8 ones where the linear layers run in reduced precision (e->lowp); an int8 encoder whose
 * backend gains nothing from int8 products (no VNNI / AMX-INT8) packs its weights dequantized
 * into float32 panels. Offsets in floats, each copy 64-byte aligned. */
void ft_encoder_layer_shapes(const ft_encoder *e, int64_t l, int64_t shapes[4][2]) {
    const int64_t C = e->cfg.hidden_size, A = e->layer_heads[l] * (C / e->cfg.num_heads), I = e->layer_intermediate[l];
    const int64_t s[4][2] = {{3 * A, C}, {C, A}, {e->cfg.gated_ffn ? 2 * I : I, C}, {C, I}};
    memcpy(shapes, s, sizeof s);
}

static size_t packed_floats_of(const ft_encoder *e, int64_t N, int64_t K) {
    ft_backend *be = e->be;
    const size_t bytes = e->lowp ? be->packed_weight_lp_bytes(be, e->wtype, N, K) : be->packed_weight_bytes(be, N, K);
    return (bytes + 63) / 64 * 16;
}

static ft_status pack_one(ft_encoder *e, float *dst, int64_t l, int k, int64_t N, int64_t K) {
    ft_backend *be = e->be;
    const ft_layer_offsets *o = &e->layers[l];
    const size_t src[4] = {o->wqkv, o->wo, o->w1, o->w2};
    if (!e->int8) {
        const float *w = (const float *)e->params + src[k];
        return e->lowp ? be->pack_weight_bf16(be, dst, w, N, K) : be->pack_weight(be, dst, w, N, K);
    }
    const int8_t *q = e->int8->data + e->int8->layer[l][k].q;
    const float *scale = e->int8->scale + e->int8->layer[l][k].s;
    if (e->lowp) return be->pack_weight_i8(be, dst, q, scale, N, K);
    float *w = malloc((size_t)N * (size_t)K * sizeof(float));   /* dequantized: w = scale q per row */
    if (!w) return ft_error(FT_ERR_NOMEM, "out of memory dequantizing a %lld x %lld weight", (long long)N, (long long)K);
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < K; c++) w[n * K + c] = (float)q[n * K + c] * scale[n];
    const ft_status st = be->pack_weight(be, dst, w, N, K);
    free(w);
    return st;
}

/* the packed floats of the embeddings' projection: float32 in an int8 encoder (its weights stay float32),
 * else as the layers' */
static size_t proj_packed_floats(const ft_encoder *e) {
    const int64_t C = e->cfg.hidden_size, E = ft_config_embedding_size(&e->cfg);
    if (e->proj_w == FT_NO_OFFSET) return 0;
    return e->int8 ? (e->be->packed_weight_bytes(e->be, C, E) + 63) / 64 * 16 : packed_floats_of(e, C, E);
}

static ft_status ensure_packed(ft_encoder *e) {
    if (e->packed_ok) return FT_OK;
    ft_backend *be = e->be;
    const int64_t C = e->cfg.hidden_size, E = ft_config_embedding_size(&e->cfg);
    /* the embeddings' projection first (float32 or bf16; float32 in an int8 encoder) */
    size_t total = proj_packed_floats(e);
    for (int64_t l = 0; l < e->cfg.num_layers; l++) {
        int64_t shapes[4][2];   /* a pruned layer's are smaller */
        ft_encoder_layer_shapes(e, l, shapes);
        for (int k = 0; k < 4; k++) total += packed_floats_of(e, shapes[k][0], shapes[k][1]);
    }
    if (total > e->packed_floats) {
        if (e->packed) be->free(be, e->packed);
        e->packed = NULL;
        e->packed_floats = 0;
        FT_TRY(be->alloc(be, total * sizeof(float), (void **)&e->packed));
        e->packed_floats = total;
    }
    size_t off = 0;
    if (e->proj_w != FT_NO_OFFSET) {
        const size_t size = proj_packed_floats(e);
        const float *w = (const float *)e->params + e->proj_w;
        e->pproj = 0;
        if (size)
            FT_TRY(e->lowp && !e->int8 ? be->pack_weight_bf16(be, e->packed, w, C, E) : be->pack_weight(be, e->packed, w, C, E));
        off = size;
    }
    for (int64_t l = 0; l < e->cfg.num_layers; l++) {
        int64_t shapes[4][2];
        ft_encoder_layer_shapes(e, l, shapes);
        ft_layer_offsets *o = &e->layers[l];
        size_t *dst[4] = {&o->pqkv, &o->po, &o->p1, &o->p2};
        for (int k = 0; k < 4; k++) {
            const size_t size = packed_floats_of(e, shapes[k][0], shapes[k][1]);
            *dst[k] = off;
            if (size) FT_TRY(pack_one(e, e->packed + off, l, k, shapes[k][0], shapes[k][1]));
            off += size;
        }
    }
    e->packed_ok = 1;
    return FT_OK;
}

/* out = act(x W^T + bias) and out = LN(residual + x W^T + bias) for the weight at float offset
 * w_off (FT_NO_OFFSET in an int8 encoder) with its packed copy at p_off: the backend's float32
 * linear ops, or the reduced-precision ones */
static ft_status linear(ft_encoder *e, void *out, const void *x, size_t w_off, size_t p_off, const void *bias,
                        int64_t M, int64_t K, int64_t N, int act) {
    ft_backend *be = e->be;
    const float *packed = e->packed ? e->packed + p_off : NULL;
    if (e->lowp) return be->linear_lp_forward(be, e->wtype, out, x, packed, bias, M, K, N, act);
    const void *w = w_off == FT_NO_OFFSET ? NULL : (const char *)e->params + w_off * e->esz;
    return be->linear_forward(be, e->dtype, out, x, w, packed, bias, M, K, N, act);
}

static ft_status linear_residual_ln(ft_encoder *e, void *out, const void *x, size_t w_off, size_t p_off,
                                   const void *bias, const void *residual, const void *gamma, const void *beta,
                                   int64_t M, int64_t K, int64_t N, float eps) {
    ft_backend *be = e->be;
    const float *packed = e->packed ? e->packed + p_off : NULL;
    if (e->lowp)
        return be->linear_lp_residual_ln_forward(be, e->wtype, out, x, packed, bias, residual, gamma, beta, M, K, N,
                                                 eps);
    const void *w = w_off == FT_NO_OFFSET ? NULL : (const char *)e->params + w_off * e->esz;
    return be->linear_residual_ln_forward(be, e->dtype, out, x, w, packed, bias, residual, gamma, beta, M, K, N, eps);
}

/* ---- forward ------------------------------------------------------------------------------ */

/* Activations are "packed rows": sequence b owns rows [first, first + rows) of x, t, ctx and
 * big: its real tokens (mask 1) in position order, then, only when the caller asked for padded
 * positions (hidden states, or a CLS row that is padding), its padded tokens. Padded tokens are
 * queries only, never keys (no mask needed anywhere), so a ragged batch computes its real
 * tokens and nothing else, and a row's result does not depend on the padding around it. */
typedef struct {
    void *x, *t, *ctx, *big, *scratch;   /* in the encoder's dtype */
    float *pooled, *stage;
    int32_t *ids, *types, *positions, *src, *pool_first, *pool_count, *seqs;
} fwd_buffers;

typedef struct {   /* host staging of the same tables */
    int32_t *ids, *types, *positions, *src, *pool_first, *pool_count, *seqs;
    int64_t rows, max_rows;
    int identity;   /* rows are exactly (b, t) in order: outputs need no scatter */
} fwd_plan;

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Grow the workspaces to fit (B, T); never shrinks, so steady-state batches allocate nothing. */
static ft_status ensure_workspace(ft_encoder *e, int64_t B, int64_t T, fwd_buffers *w, fwd_plan *h) {
    const int64_t C = e->cfg.hidden_size, N = B * T, hs = C / e->cfg.num_heads;
    int64_t wide = 0;   /* qkv (N, 3A) and ffn (N, I) share a buffer: its widest layer */
    for (int64_t l = 0; l < e->cfg.num_layers; l++) {
        const int64_t A = e->layer_heads[l] * hs, I = e->layer_intermediate[l] * (e->cfg.gated_ffn ? 3 : 1);
        wide = I > wide ? I : wide;   /* a gated FFN: (N, 2I) projections and (N, I) activations */
        wide = 3 * A > wide ? 3 * A : wide;
    }
    if (wide < C) wide = C;
    if (wide < ft_config_embedding_size(&e->cfg)) wide = ft_config_embedding_size(&e->cfg);   /* the embeddings before
                                                                                               * their projection */
    const int host_mem = e->be->device.kind == FT_DEVICE_CPU;
    const size_t es = e->esz;
    enum { NW = 14 };
    size_t sizes[NW] = {
        align64((size_t)N * C * es), align64((size_t)N * C * es), align64((size_t)N * C * es),
        align64((size_t)N * wide * es), align64(e->be->attention_scratch_bytes(e->be, e->dtype, B, T, e->cfg.num_heads)),
        align64((size_t)B * C * 4), host_mem ? 0 : align64((size_t)N * C * 4),
        align64((size_t)N * 4), align64((size_t)N * 4), align64((size_t)N * 4), align64((size_t)N * 4),
        align64((size_t)B * 4), align64((size_t)B * 4), host_mem ? 0 : align64((size_t)B * 12)};
    size_t total = 0;
    for (int k = 0; k < NW; k++) total += sizes[k];
    if (total > e->ws_bytes) {
        if (e->ws) e->be->free(e->be, e->ws);
        e->ws = NULL;
        e->ws_bytes = 0;
        ft_status st = e->be->alloc(e->be, total, &e->ws);
        if (st == FT_ERR_NOMEM) {   /* say what fits: the workspace grows linearly with the batch */
            e->ws = NULL;
            size_t free_b = 0, total_b = 0, own = 0;
            if (e->be->memory_info(e->be, &free_b, &total_b, &own) != FT_OK) free_b = 0;
            ft_clear_error();
            const double per_seq = (double)total / (double)B;
            const long long fits = (long long)((double)free_b / per_seq);
            return ft_error(FT_ERR_NOMEM, "a batch of %lld x %lld tokens needs %.1f MiB of activations on %s and %.1f MiB "
                            "are free: the largest batch of %lld-token sequences that fits is about %lld; split the "
                            "batch into chunks of at most that many sequences (the encoder stays usable)",
                            (long long)B, (long long)T, total / 1048576.0, e->be->name, free_b / 1048576.0, (long long)T,
                            fits);
        }
        FT_TRY(st);
        e->ws_bytes = total;
    }
    char *p = e->ws;
    void **slots[NW] = {(void **)&w->x, (void **)&w->t, (void **)&w->ctx, (void **)&w->big, (void **)&w->scratch,
                        (void **)&w->pooled, (void **)&w->stage, (void **)&w->ids, (void **)&w->types,
                        (void **)&w->positions, (void **)&w->src, (void **)&w->pool_first, (void **)&w->pool_count,
                        (void **)&w->seqs};
    for (int k = 0; k < NW; k++) { *slots[k] = sizes[k] ? p : NULL; p += sizes[k]; }

    const size_t hsz[7] = {align64((size_t)N * 4), align64((size_t)N * 4), align64((size_t)N * 4),
                           align64((size_t)N * 4), align64((size_t)B * 4), align64((size_t)B * 4),
                           align64((size_t)B * 12)};
    size_t host_need = 0;
    for (int k = 0; k < 7; k++) host_need += hsz[k];
    if (host_need > e->host_ws_bytes) {
        free(e->host_ws);
        e->host_ws = aligned_alloc(64, host_need);
        e->host_ws_bytes = e->host_ws ? host_need : 0;
        if (!e->host_ws) return ft_error(FT_ERR_NOMEM, "cannot allocate %zu bytes of staging memory", host_need);
    }
    char *q = e->host_ws;
    int32_t **hslots[7] = {&h->ids, &h->types, &h->positions, &h->src, &h->pool_first, &h->pool_count, &h->seqs};
    for (int k = 0; k < 7; k++) { *hslots[k] = (int32_t *)q; q += hsz[k]; }
    return FT_OK;
}

static const char *index_dtype_ok(const ft_index2d *v, int is_mask) {
    switch (v->dtype) {
    case FT_I64: case FT_I32: return NULL;
    case FT_I16: case FT_I8: case FT_U8: case FT_BOOL: case FT_F32: case FT_F64: return is_mask ? NULL : "";
    default: return "";
    }
}

static float mask_at(const ft_index2d *mask, int64_t b, int64_t t) {
    if (!mask) return 1.0f;
    if (mask->dtype == FT_F32 || mask->dtype == FT_F64) {
        int64_t k = b * mask->stride[0] + t * mask->stride[1];
        return mask->dtype == FT_F32 ? ((const float *)mask->data)[k] : (float)((const double *)mask->data)[k];
    }
    return (float)ft_index2d_get(mask, b, t);
}

/* Range checks over every position, then the packed-row tables (fwd_plan). with_pad: every
 * padded position is computed too; cls_pad: position 0 is, when it is padding. */
static ft_status stage_inputs(const ft_encoder *e, int64_t B, int64_t T, const ft_index2d *ids,
                              const ft_index2d *mask, const ft_index2d *types, int with_pad, int cls_pad,
                              ft_pooling pooling, fwd_plan *h) {
    const ft_bert_config *c = &e->cfg;
    if (index_dtype_ok(ids, 0)) return ft_error(FT_ERR_DTYPE, "input_ids must be int32 or int64, got %s", ft_dtype_name(ids->dtype));
    if (types && index_dtype_ok(types, 0))
        return ft_error(FT_ERR_DTYPE, "token_type_ids must be int32 or int64, got %s", ft_dtype_name(types->dtype));
    if (mask && index_dtype_ok(mask, 1))
        return ft_error(FT_ERR_DTYPE, "attention_mask must be bool, an integer type or float, got %s", ft_dtype_name(mask->dtype));
    int64_t r = 0;
    h->max_rows = 0;
    h->identity = 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t first = r;
        h->pool_first[b] = (int32_t)first;
        /* pass 0: check every position, add the real tokens; pass 1: add the wanted padded ones */
        for (int pass = 0; pass < 2; pass++) {
            int64_t before = 0;   /* FT_POS_AFTER_PADDING: real tokens so far whose id is not the padding id */
            for (int64_t t = 0; t < T; t++) {
                const float m = mask_at(mask, b, t);
                const int64_t id = ft_index2d_get(ids, b, t);
                const int64_t ty = types ? ft_index2d_get(types, b, t) : 0;
                if (pass == 0) {
                    if (m != 0.0f && m != 1.0f)
                        return ft_error(FT_ERR_OUT_OF_RANGE, "attention_mask[%lld, %lld] = %g; expected 0 or 1",
                                        (long long)b, (long long)t, (double)m);
                    if (id < 0 || id >= c->vocab_size)
                        return ft_error(FT_ERR_OUT_OF_RANGE, "input_ids[%lld, %lld] = %lld is out of range for vocab_size %lld",
                                        (long long)b, (long long)t, (long long)id, (long long)c->vocab_size);
                    if (ty != 0 && c->type_vocab_size == 0)
                        return ft_error(FT_ERR_OUT_OF_RANGE, "token_type_ids[%lld, %lld] = %lld: this model has no token types "
                                        "(pass zeros or no token_type_ids)", (long long)b, (long long)t, (long long)ty);
                    if (ty < 0 || (c->type_vocab_size > 0 && ty >= c->type_vocab_size))
                        return ft_error(FT_ERR_OUT_OF_RANGE, "token_type_ids[%lld, %lld] = %lld is out of range for type_vocab_size %lld",
                                        (long long)b, (long long)t, (long long)ty, (long long)c->type_vocab_size);
                }
                int64_t pos = ft_config_position(c, t, id, m != 0.0f, &before);
                if (pass == 0) {
                    if (m == 0.0f) continue;
                    if (pos >= c->max_position_embeddings)
                        return ft_error(FT_ERR_INVALID_ARGUMENT, "input_ids[%lld, %lld]: position %lld exceeds "
                                        "max_position_embeddings %lld (sequence %lld is too long: at most %lld tokens)",
                                        (long long)b, (long long)t, (long long)pos, (long long)c->max_position_embeddings,
                                        (long long)b, (long long)ft_config_max_tokens(c));
                } else {
                    if (m != 0.0f || !(with_pad || (cls_pad && t == 0))) continue;
                    if (pos >= c->max_position_embeddings) pos = c->pad_token_id;   /* a padded row: any valid one */
                    if (t == 0) h->pool_first[b] = (int32_t)r;   /* a padded CLS row */
                }
                h->ids[r] = c->vocab_map ? c->vocab_map[id] : (int32_t)id;   /* a pruned vocabulary's row */
                h->types[r] = (int32_t)ty;
                h->positions[r] = c->rope_theta > 0 ? (int32_t)(r - first) : (int32_t)pos;   /* rotary: the row's
                                                                                              * index in its sequence */
                h->src[r] = (int32_t)(b * T + t);
                if (h->src[r] != r) h->identity = 0;
                r++;
            }
            if (pass == 0) h->seqs[3 * b + 1] = (int32_t)(r - first);   /* keys: the real tokens */
        }
        const int64_t nreal = h->seqs[3 * b + 1], rows = r - first;
        h->seqs[3 * b] = (int32_t)first;
        h->seqs[3 * b + 2] = (int32_t)rows;
        if (rows > h->max_rows) h->max_rows = rows;
        /* mean: the real rows; CLS: position 0, the first row when it is real (else set above) */
        h->pool_count[b] = pooling == FT_POOL_MEAN ? (int32_t)nreal : 1;
    }
    h->rows = r;
    if (r != B * T) h->identity = 0;
    return FT_OK;
}

/* the masks' own consistency with the model (sizes come from the model; the arrays' lengths are the
 * caller's to get right: the binding checks them against its arrays) */
static ft_status check_masks(const ft_encoder *e, const ft_forward_masks *m) {
    if (m && e->cfg.norm == FT_NORM_PRE && (m->skip_layers || m->head_keep || m->ffn_keep || m->start_layer > 0))
        return ft_error(FT_ERR_UNSUPPORTED, "forward masks (skipped layers, heads, FFN groups, a start layer) are for "
                        "post-LN encoders; this one is pre-LN (ModernBERT)");
    if (m && (m->start_layer < 0 || m->start_layer > e->cfg.num_layers))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "start_layer %lld is not a layer of this %lld-layer encoder",
                        (long long)m->start_layer, (long long)e->cfg.num_layers);
    if (m && m->start_layer > 0 && !m->start_hidden)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "start_layer %lld needs its hidden states", (long long)m->start_layer);
    if (m && m->start_layer > 0 && e->dtype != FT_F32)
        return ft_error(FT_ERR_UNSUPPORTED, "a forward from a layer's hidden states runs in float32 only");
    if (!m || !m->ffn_keep) return FT_OK;
    if (m->ffn_group < 1)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "FFN masks need a group size >= 1, got %lld", (long long)m->ffn_group);
    for (int64_t l = 0; l < e->cfg.num_layers; l++)
        if (e->layer_intermediate[l] % m->ffn_group)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "FFN group size %lld does not divide layer %lld's intermediate "
                            "size %lld", (long long)m->ffn_group, (long long)l, (long long)e->layer_intermediate[l]);
    return FT_OK;
}

/* layer l's attention heads under masks that switch heads off (modes: a NH buffer): the model's mode
 * per head, or off where masked. Returns 1 when any head is not exact (attention_heads_forward). */
static int head_modes(const ft_encoder *e, int64_t l, const ft_forward_masks *m, uint8_t *modes) {
    int other = 0;
    for (int64_t h = 0; h < e->layer_heads[l]; h++) {
        const int64_t k = e->head_first[l] + h;
        modes[h] = m && m->head_keep && !m->head_keep[k] ? FT_ATTN_OFF : e->head_attention[k];
        other |= modes[h] != FT_ATTN_EXACT;
    }
    return other;
}

/* big (N, I): the FFN groups masked in layer l set to zero, adjacent ones in one call */
static ft_status mask_ffn(ft_encoder *e, int64_t l, const ft_forward_masks *m, void *big, int64_t N) {
    if (!m || !m->ffn_keep) return FT_OK;
    const int64_t I = e->layer_intermediate[l], G = I / m->ffn_group;
    int64_t first = 0;
    for (int64_t k = 0; k < l; k++) first += e->layer_intermediate[k] / m->ffn_group;
    const uint8_t *keep = m->ffn_keep + first;
    for (int64_t g = 0; g < G;) {
        if (keep[g]) { g++; continue; }
        int64_t end = g;
        while (end < G && !keep[end]) end++;
        FT_TRY(e->be->zero_columns(e->be, e->dtype, big, N, I, g * m->ffn_group, (end - g) * m->ffn_group));
        g = end;
    }
    return FT_OK;
}

/* Layer l of a pre-LN encoder (ModernBERT): on entry ctx holds its attention's input, LN_attn(x) (x itself
 * in layer 0, whose attention norm is the identity); on return x holds the layer's output and ctx the
 * next layer's attention input, or final_norm(x) after the last layer.
 *   big (N, 3A) = in Wqkv^T; RoPE on Q and K; ctx = attention (the layer's window); t = ctx Wo^T;
 *   x += t, ctx = LN_mlp(x); big (N, 2I) = ctx Wi^T; act (N, I) = GELU(first I) * last I, after it in big;
 *   t = act W2^T; x += t, ctx = LN_next(x) */
static ft_status pre_ln_layer(ft_encoder *e, int64_t l, const fwd_buffers *w, const fwd_plan *h, int64_t B, int64_t N) {
    const ft_bert_config *c = &e->cfg;
    ft_backend *be = e->be;
    const ft_dtype dt = e->dtype;
    const char *Pb = e->params;
#define P(off) ((const void *)(Pb + (off) * e->esz))
#define PN(off) ((off) == FT_NO_OFFSET ? NULL : P(off))
    const ft_layer_offsets *o = &e->layers[l];
    const int64_t C = c->hidden_size, nh = e->layer_heads[l], A = nh * (C / c->num_heads), I = e->layer_intermediate[l];
    const int64_t I1 = c->gated_ffn ? 2 * I : I;
    const void *in = l == 0 ? w->x : w->ctx;
    FT_TRY(linear(e, w->big, in, o->wqkv, o->pqkv, PN(o->bqkv), N, C, 3 * A, -1));
    const double theta = ft_config_layer_rope_theta(c, l);
    if (theta > 0) FT_TRY(be->rotary_forward(be, dt, w->big, w->positions, N, A, nh, theta));
    FT_TRY(be->attention_forward(be, dt, w->ctx, w->big, h->seqs, w->seqs, B, A, nh, ft_config_layer_window(c, l),
                                 w->scratch));
    FT_TRY(linear(e, w->t, w->ctx, o->wo, o->po, PN(o->bo), N, A, C, -1));
    FT_TRY(be->residual_ln_forward(be, dt, w->x, w->ctx, w->t, P(o->ln2_g), PN(o->ln2_b), N, C, c->layer_norm_eps));
    void *act = c->gated_ffn ? (char *)w->big + (size_t)N * I1 * e->esz : w->big;
    FT_TRY(linear(e, w->big, w->ctx, o->w1, o->p1, PN(o->b1), N, C, I1, c->gated_ffn ? -1 : (int)c->activation));
    if (c->gated_ffn) FT_TRY(be->gated_act_forward(be, dt, act, w->big, N, I, c->activation));
    FT_TRY(linear(e, w->t, act, o->w2, o->p2, PN(o->b2), N, I, C, -1));
    const int last = l + 1 == c->num_layers;
    const size_t g = last ? e->final_g : e->layers[l + 1].ln1_g, b = last ? e->final_b : e->layers[l + 1].ln1_b;
    FT_TRY(be->residual_ln_forward(be, dt, w->x, w->ctx, w->t, P(g), PN(b), N, C, c->layer_norm_eps));
#undef PN
#undef P
    return FT_OK;
}

static ft_status forward_locked(ft_encoder *e, int64_t B, int64_t T, const ft_index2d *ids,
                                const ft_index2d *mask, const ft_index2d *types,
                                float *const *hidden_out, float *const *pooled_out, ft_pooling pooling,
                                int on_device, const ft_forward_masks *masks, ft_cancel_fn cancel, void *cancel_arg) {
    const ft_bert_config *c = &e->cfg;
    ft_backend *be = e->be;
    const int64_t C = c->hidden_size, NH = c->num_heads, L = c->num_layers, hs = C / NH;
    uint8_t modes[NH];
    if (B < 1) return ft_error(FT_ERR_INVALID_ARGUMENT, "empty batch: batch size must be >= 1");
    if (T < 1) return ft_error(FT_ERR_INVALID_ARGUMENT, "empty sequences: sequence length must be >= 1");
    if (c->position_ids == FT_POS_INDEX && T > c->max_position_embeddings)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "sequence length %lld exceeds max_position_embeddings %lld",
                        (long long)T, (long long)c->max_position_embeddings);
    if (B * T > INT32_MAX) return ft_error(FT_ERR_INVALID_ARGUMENT, "batch of %lld x %lld tokens is too large",
                                           (long long)B, (long long)T);
    if (!ids || !ids->data) return ft_error(FT_ERR_INVALID_ARGUMENT, "input_ids is required");
    if (pooling < FT_POOL_NONE || pooling > FT_POOL_MEAN) return ft_error(FT_ERR_INVALID_ARGUMENT, "unknown pooling %d", (int)pooling);
    FT_TRY(check_masks(e, masks));
    int want_hidden = 0, want_pooled = 0;
    int64_t last = -1;   /* the deepest layer asked for: the layers above it are not run */
    for (int64_t l = 0; l <= L; l++) {
        if (hidden_out && hidden_out[l]) want_hidden = 1, last = l;
        if (pooled_out && pooled_out[l] && pooling != FT_POOL_NONE) want_pooled = 1, last = l;
    }
    if (last < 0) last = L;   /* nothing asked for: run the whole encoder, as a timing call would expect */
    const int64_t start = masks ? masks->start_layer : 0;
    const int masked_heads = masks && masks->head_keep;
    for (int64_t l = 0; l < start; l++)
        if ((hidden_out && hidden_out[l]) || (pooled_out && pooled_out[l] && pooling != FT_POOL_NONE))
            return ft_error(FT_ERR_INVALID_ARGUMENT, "output of layer %lld asked for, below start_layer %lld",
                            (long long)l, (long long)start);
    fwd_buffers w;
    fwd_plan h;
    FT_TRY(ensure_workspace(e, B, T, &w, &h));
    FT_TRY(ensure_packed(e));
    FT_TRY(stage_inputs(e, B, T, ids, mask, types, want_hidden, want_pooled && pooling == FT_POOL_CLS,
                        pooling == FT_POOL_NONE ? FT_POOL_MEAN : pooling, &h));
    const int64_t N = h.rows;
    FT_TRY(be->upload(be, w.ids, h.ids, (size_t)N * 4));
    FT_TRY(be->upload(be, w.types, h.types, (size_t)N * 4));
    FT_TRY(be->upload(be, w.positions, h.positions, (size_t)N * 4));
    FT_TRY(be->upload(be, w.src, h.src, (size_t)N * 4));
    FT_TRY(be->upload(be, w.pool_first, h.pool_first, (size_t)B * 4));
    FT_TRY(be->upload(be, w.pool_count, h.pool_count, (size_t)B * 4));
    if (w.seqs) FT_TRY(be->upload(be, w.seqs, h.seqs, (size_t)B * 12));   /* the attention's, once per forward */
    const int host_mem = be->device.kind == FT_DEVICE_CPU;

    const ft_dtype dt = e->dtype;
    const char *Pb = e->params;
#define P(off) ((const void *)(Pb + (off) * e->esz))
#define PN(off) ((off) == FT_NO_OFFSET ? NULL : P(off))   /* a tensor the model may lack */
#define TYPES PN(e->type)   /* no token types: no type table */
    const int64_t E = ft_config_embedding_size(c);
    void *emb = e->proj_w != FT_NO_OFFSET ? w.big : w.x;   /* (N, E): projected into x when E != C */
    if (N > 0 && start == 0 && e->int8 && e->int8->word)   /* int8 word embeddings (per-row scales) */
        FT_TRY(be->embed_i8_ln_forward(be, emb, w.ids, w.types, w.positions, e->int8->data + e->int8->word_q,
                                       e->int8->scale + e->int8->word_s, PN(e->pos), TYPES, P(e->emb_ln_g),
                                       PN(e->emb_ln_b), N, E, c->layer_norm_eps));
    else if (N > 0 && start == 0)
        FT_TRY(be->embed_ln_forward(be, dt, emb, w.ids, w.types, w.positions, P(e->word), PN(e->pos), TYPES,
                                    P(e->emb_ln_g), PN(e->emb_ln_b), N, E, c->layer_norm_eps));
    if (N > 0 && start == 0 && e->proj_w != FT_NO_OFFSET && e->int8)   /* float32 in an int8 encoder */
        FT_TRY(be->linear_forward(be, FT_F32, w.x, emb, P(e->proj_w), e->packed ? e->packed + e->pproj : NULL,
                                  P(e->proj_b), N, E, C, -1));
    else if (N > 0 && start == 0 && e->proj_w != FT_NO_OFFSET)   /* x (N, C) = emb W^T + b (ELECTRA) */
        FT_TRY(linear(e, w.x, emb, e->proj_w, e->pproj, P(e->proj_b), N, E, C, -1));
    if (N > 0 && start > 0) {   /* x = the given layer's rows, gathered into the packed order */
        float *rows = host_mem ? (float *)w.x : malloc((size_t)N * (size_t)C * sizeof(float));
        if (!rows) return ft_error(FT_ERR_NOMEM, "out of memory staging start_hidden");
        for (int64_t r = 0; r < N; r++)
            memcpy(rows + r * C, masks->start_hidden + (int64_t)h.src[r] * C, (size_t)C * sizeof(float));
        ft_status st = host_mem ? FT_OK : be->upload(be, w.x, rows, (size_t)N * (size_t)C * sizeof(float));
        if (!host_mem) {
            if (st == FT_OK) st = be->synchronize(be);
            free(rows);
        }
        FT_TRY(st);
    }
    const int pre = c->norm == FT_NORM_PRE;
    for (int64_t l = start; l <= last; l++) {
        if (pre && l > start && N > 0) {
            if (cancel && cancel(cancel_arg)) return ft_error(FT_ERR_INTERRUPTED, "forward interrupted");
            FT_TRY(pre_ln_layer(e, l - 1, &w, &h, B, N));
        } else if (l > start && N > 0 && !(masks && masks->skip_layers && masks->skip_layers[l - 1])) {
            if (cancel && cancel(cancel_arg)) return ft_error(FT_ERR_INTERRUPTED, "forward interrupted");
            const ft_layer_offsets *o = &e->layers[l - 1];
            /* A = this layer's heads x head size, I its FFN width (smaller when pruned) */
            const int64_t nh = e->layer_heads[l - 1], A = nh * hs, I = e->layer_intermediate[l - 1];
            /* qkv (N, 3A) = x Wqkv^T + bqkv: one GEMM for Q, K and V */
            FT_TRY(linear(e, w.big, w.x, o->wqkv, o->pqkv, P(o->bqkv), N, C, 3 * A, -1));
            /* the layer's attention, picked when the structure was set; a forward whose masks switch
             * heads off gives their modes to attention_heads_forward */
            ft_attend_fn attend = e->attend[l - 1];
            const uint8_t *lmodes = e->head_attention + e->head_first[l - 1];
            if (masked_heads && head_modes(e, l - 1, masks, modes)) attend = attend_modes, lmodes = modes;
            FT_TRY(attend(be, dt, w.ctx, w.big, h.seqs, w.seqs, B, A, nh, lmodes, c->sign_match_keys, w.scratch));
            /* t = LN(x + ctx Wo^T + bo) */
            FT_TRY(linear_residual_ln(e, w.t, w.ctx, o->wo, o->po, P(o->bo), w.x, P(o->ln1_g), P(o->ln1_b), N, A, C,
                                      c->layer_norm_eps));
            /* big (N, I) = act(t W1^T + b1) */
            FT_TRY(linear(e, w.big, w.t, o->w1, o->p1, P(o->b1), N, C, I, c->activation));
            FT_TRY(mask_ffn(e, l - 1, masks, w.big, N));
            /* x = LN(t + big W2^T + b2) */
            FT_TRY(linear_residual_ln(e, w.x, w.big, o->w2, o->p2, P(o->b2), w.t, P(o->ln2_g), P(o->ln2_b), N, I, C,
                                      c->layer_norm_eps));
        }
        /* pre-LN: the last layer's output is final_norm(x), which its residual op left in ctx */
        const void *out_l = pre && l == L && N > 0 ? w.ctx : w.x;
        if (hidden_out && hidden_out[l]) {   /* every position was computed (with_pad); float32 out */
            const size_t bytes = (size_t)N * C * 4;
            if (h.identity && dt == FT_F32) FT_TRY((on_device ? be->copy : be->download)(be, hidden_out[l], out_l, bytes));
            else if (on_device || host_mem) FT_TRY(be->scatter_rows(be, dt, hidden_out[l], out_l, w.src, N, C));
            else {
                FT_TRY(be->scatter_rows(be, dt, w.stage, out_l, w.src, N, C));
                FT_TRY(be->download(be, hidden_out[l], w.stage, bytes));
            }
        }
        if (pooled_out && pooled_out[l] && pooling != FT_POOL_NONE) {
            /* device outputs (and host memory on the CPU): pool straight into the output */
            float *dst = on_device || host_mem ? pooled_out[l] : w.pooled;
            FT_TRY(be->pool_forward(be, dt, dst, out_l, w.pool_first, w.pool_count, B, C));
            if (dst != pooled_out[l]) FT_TRY(be->download(be, pooled_out[l], w.pooled, (size_t)B * C * 4));
        }
    }
#undef TYPES
#undef PN
#undef P
    return be->synchronize(be);
}

ft_status ft_encoder_forward(ft_encoder *e, int64_t B, int64_t T, const ft_index2d *ids,
                             const ft_index2d *mask, const ft_index2d *types,
                             float *const *hidden_out, float *const *pooled_out, ft_pooling pooling,
                             int outputs_on_device, ft_cancel_fn cancel, void *cancel_arg) {
    return ft_encoder_forward_masked(e, B, T, ids, mask, types, hidden_out, pooled_out, pooling, outputs_on_device,
                                     NULL, cancel, cancel_arg);
}

ft_status ft_encoder_forward_masked(ft_encoder *e, int64_t B, int64_t T, const ft_index2d *ids,
                                    const ft_index2d *mask, const ft_index2d *types, float *const *hidden_out,
                                    float *const *pooled_out, ft_pooling pooling, int outputs_on_device,
                                    const ft_forward_masks *masks, ft_cancel_fn cancel, void *cancel_arg) {
    pthread_mutex_lock(&e->lock);
    ft_status st = forward_locked(e, B, T, ids, mask, types, hidden_out, pooled_out, pooling, outputs_on_device != 0,
                                  masks, cancel, cancel_arg);
    pthread_mutex_unlock(&e->lock);
    return st;
}

/* ---- device memory for outputs ------------------------------------------------------------- */

ft_device ft_encoder_device(const ft_encoder *e) { return e->be->device; }

ft_status ft_encoder_device_alloc(ft_encoder *e, size_t bytes, void **out) {
    return e->be->alloc(e->be, bytes, out);
}

void ft_encoder_device_free(ft_encoder *e, void *p) {
    if (p) e->be->free(e->be, p);
}

ft_status ft_encoder_device_read(ft_encoder *e, void *host_dst, const void *src, size_t bytes) {
    pthread_mutex_lock(&e->lock);   /* the backend's stream is shared with forward */
    ft_status st = e->be->download(e->be, host_dst, src, bytes);
    pthread_mutex_unlock(&e->lock);
    return st;
}
