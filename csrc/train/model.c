/* The training model: [frozen features] -> [top layers, optional] -> task head, over the backend
 * table (B sequences, N rows, C hidden).
 *
 *   step:  out (N, C)  = layers(x)                       ft_layer_stack_forward (or x itself)
 *          logits, loss = head(out), its terms / denominator           ft_head_step
 *          d head params, d out (N, C)                               (the head's backward)
 *          -> bucket 0 ready; d layer params, top layer first -> buckets 1..count ready
 *
 * Parameters and gradients are one flat table each: the layer stack's allocations with the head
 * after the layers, or the model's own for a head alone. Per-batch buffers (the layers' output
 * and its gradient, the sequence table, targets, context mask, logits, loss terms, the head's
 * workspace) are one allocation, grown to the largest batch and kept, so a steady training loop
 * allocates nothing. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "core/status.h"
#include "dist/shared.h"

struct ft_model {
    ft_backend *be;
    ft_head_config head;
    ft_layer_stack *layers;   /* borrowed, or NULL */
    int64_t C;
    size_t n_layers, n_params;
    float *params, *grads;
    int own;                  /* params / grads are the model's allocations (no layers) */
    void *buf;
    size_t buf_bytes;
    int64_t cap_B, cap_N;     /* what buf holds room for */
    int32_t *seqs;            /* host (2, B): first rows, then counts */
    float *loss_host;
    int64_t seqs_cap, loss_cap;
};

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

const ft_head_config *ft_model_head(const ft_model *m) { return &m->head; }
ft_device ft_model_device(const ft_model *m) { return m->be->device; }

void ft_model_free(ft_model *m) {
    if (!m) return;
    if (m->be) {
        if (m->own) {
            m->be->free(m->be, m->params);
            m->be->free(m->be, m->grads);
        }
        if (m->buf) m->be->free(m->be, m->buf);
    }
    free(m->seqs);
    free(m->loss_host);
    free(m);
}

ft_status ft_model_create(ft_device dev, const ft_head_config *head, ft_layer_stack *layers, int shared_grads,
                          ft_model **out) {
    *out = NULL;
    FT_TRY(ft_head_check(head));
    ft_model *m = calloc(1, sizeof *m);
    if (!m) return ft_error(FT_ERR_NOMEM, "out of memory");
    m->head = *head;
    m->layers = layers;
    m->C = head->hidden;
    ft_status st = ft_backend_for(dev, &m->be);
    const size_t nh = ft_head_param_count(head);
    if (st == FT_OK && layers) {
        if (ft_layer_stack_hidden_size(layers) != head->hidden)
            st = ft_error(FT_ERR_INVALID_ARGUMENT, "the head takes width %lld, the layers give %lld",
                          (long long)head->hidden, (long long)ft_layer_stack_hidden_size(layers));
        else if (ft_layer_stack_extra_floats(layers) != nh)
            st = ft_error(FT_ERR_INVALID_ARGUMENT, "the layers were made with room for %zu head parameters, this head "
                          "has %zu", ft_layer_stack_extra_floats(layers), nh);
        m->n_layers = ft_layer_stack_param_count(layers);
        m->params = ft_layer_stack_params(layers);
        m->grads = ft_layer_stack_grads(layers);
    } else if (st == FT_OK) {
        m->own = 1;
        st = m->be->alloc(m->be, nh * sizeof(float), (void **)&m->params);
        if (st == FT_OK) st = ft_backend_alloc_grads(m->be, nh * sizeof(float), shared_grads, (void **)&m->grads);
    }
    m->n_params = m->n_layers + nh;
    if (st == FT_OK) {   /* the head's parameters start at zero */
        float *zeros = calloc(nh ? nh : 1, sizeof *zeros);
        st = zeros ? m->be->upload(m->be, m->params + m->n_layers, zeros, nh * sizeof(float))
                   : ft_error(FT_ERR_NOMEM, "out of memory");
        if (st == FT_OK) st = m->be->upload(m->be, m->grads + m->n_layers, zeros, nh * sizeof(float));
        if (st == FT_OK) st = m->be->synchronize(m->be);
        free(zeros);
    }
    if (st != FT_OK) {
        if (m->own) m->params = m->grads = NULL, m->own = 0;
        ft_model_free(m);
        return st;
    }
    *out = m;
    return FT_OK;
}

size_t ft_model_param_count(const ft_model *m) { return m->n_params; }
float *ft_model_params(ft_model *m) { return m->params; }
float *ft_model_grads(ft_model *m) { return m->grads; }
size_t ft_model_head_offset(const ft_model *m) { return m->n_layers; }
size_t ft_model_num_buckets(const ft_model *m) { return 1 + (size_t)(m->layers ? ft_layer_stack_count(m->layers) : 0); }

void ft_model_bucket(const ft_model *m, size_t i, size_t *offset, size_t *floats) {
    if (i == 0) {
        *offset = m->n_layers;
        *floats = m->n_params - m->n_layers;
        return;
    }
    ft_layer_stack_layer_range(m->layers, ft_layer_stack_count(m->layers) - (int64_t)i, offset, floats);
}

static ft_status check_range(const ft_model *m, size_t offset, size_t n) {
    if (offset > m->n_params || n > m->n_params - offset)
        return ft_error(FT_ERR_OUT_OF_RANGE, "parameters [%zu, %zu) are outside the model's %zu", offset, offset + n,
                        m->n_params);
    return FT_OK;
}

ft_status ft_model_write_params(ft_model *m, size_t offset, const float *host, size_t n) {
    FT_TRY(check_range(m, offset, n));
    FT_TRY(m->be->upload(m->be, m->params + offset, host, n * sizeof(float)));
    return m->be->synchronize(m->be);
}

ft_status ft_model_zero_grads(ft_model *m) {
    float *zeros = calloc(m->n_params ? m->n_params : 1, sizeof *zeros);
    if (!zeros) return ft_error(FT_ERR_NOMEM, "out of memory");
    ft_status st = m->be->upload(m->be, m->grads, zeros, m->n_params * sizeof(float));
    if (st == FT_OK) st = m->be->synchronize(m->be);
    free(zeros);
    return st;
}

ft_status ft_model_idle(ft_model *m, ft_bucket_fn ready, void *arg) {
    FT_TRY(ft_model_zero_grads(m));
    for (size_t i = 0; ready && i < ft_model_num_buckets(m); i++) ready(arg, i);
    return FT_OK;
}

ft_status ft_model_read_params(ft_model *m, size_t offset, float *host, size_t n) {
    FT_TRY(check_range(m, offset, n));
    return m->be->download(m->be, host, m->params + offset, n * sizeof(float));
}

/* ---- per-batch buffers ----------------------------------------------------------------------- */
typedef struct {
    float *out, *dout, *valid, *logits, *loss, *ws;
    int32_t *seqs;
    void *targets;
    size_t ws_floats;
} batch_bufs;

static size_t layout(const ft_model *m, int64_t B, int64_t N, batch_bufs *v, char *base) {
    const ft_head_config *h = &m->head;
    const int layers = m->layers != NULL;
    const size_t ws = ft_head_workspace_floats(h, B, N, 1, layers, 1);
    const size_t sizes[8] = {
        layers ? (size_t)(N * m->C) * 4 : 0, layers ? (size_t)(N * m->C) * 4 : 0, (size_t)(2 * B) * 4,
        (size_t)ft_head_target_count(h, B, N) * 4, (ft_head_needs(h) & FT_HEAD_NEEDS_MASK) ? (size_t)N * 4 : 0,
        (size_t)ft_head_logits_count(h, B, N) * 4, (size_t)ft_head_loss_count(h, B, N) * 4, ws * 4};
    size_t o = 0;
    char *at[8];
    for (int k = 0; k < 8; k++) {
        at[k] = base ? base + o : NULL;
        o += align256(sizes[k]);
    }
    if (v) *v = (batch_bufs){(float *)at[0], (float *)at[1], (float *)at[4], (float *)at[5], (float *)at[6],
                            (float *)at[7], (int32_t *)at[2], at[3], ws};
    return o;
}

ft_status ft_model_reserve(ft_model *m, int64_t B, int64_t N) {
    if (B < 1 || N < B) return ft_error(FT_ERR_INVALID_ARGUMENT, "model: a batch of %lld sequences and %lld rows",
                                        (long long)B, (long long)N);
    if (B <= m->cap_B && N <= m->cap_N) return FT_OK;
    B = B > m->cap_B ? B : m->cap_B;
    N = N > m->cap_N ? N : m->cap_N;
    const size_t need = layout(m, B, N, NULL, NULL);
    if (need > m->buf_bytes) {
        if (m->buf) {
            FT_TRY(m->be->synchronize(m->be));
            m->be->free(m->be, m->buf);
        }
        m->buf = NULL;
        m->buf_bytes = 0;
        FT_TRY(m->be->alloc(m->be, need, &m->buf));
        m->buf_bytes = need;
    }
    const int64_t nl = ft_head_loss_count(&m->head, B, N);
    if (B > m->seqs_cap) {
        int32_t *s = realloc(m->seqs, (size_t)(2 * B) * sizeof *s);
        if (!s) return ft_error(FT_ERR_NOMEM, "out of memory");
        m->seqs = s;
        m->seqs_cap = B;
    }
    if (nl > m->loss_cap) {
        float *l = realloc(m->loss_host, (size_t)nl * sizeof *l);
        if (!l) return ft_error(FT_ERR_NOMEM, "out of memory");
        m->loss_host = l;
        m->loss_cap = nl;
    }
    m->cap_B = B;
    m->cap_N = N;
    return FT_OK;
}

size_t ft_model_allocated(const ft_model *m) {
    size_t now = m->buf_bytes, peak;
    if (m->layers) {
        size_t stack;
        ft_layer_stack_allocated(m->layers, &stack, &peak);
        now += stack;
    } else {
        now += 2 * m->n_params * sizeof(float);
    }
    return now;
}

/* the batch's rows, its sequence table on the host and the device, and its targets uploaded */
static ft_status stage(ft_model *m, const ft_model_batch *b, batch_bufs *v, int64_t *N_out) {
    if (!b || b->B < 1 || (!b->x && !b->ids) || !b->lengths) return ft_error(FT_ERR_INVALID_ARGUMENT, "model: empty batch");
    if (b->ids && (b->x || !m->layers))
        return ft_error(FT_ERR_INVALID_ARGUMENT, "model: a batch of token ids is for layers that train the embeddings, "
                        "and then without x");
    int64_t N = 0;
    for (int64_t i = 0; i < b->B; i++) {
        if (b->lengths[i] < 1)
            return ft_error(FT_ERR_INVALID_ARGUMENT, "model: sequence %lld of the batch has %d rows", (long long)i,
                            b->lengths[i]);
        N += b->lengths[i];
    }
    const unsigned needs = ft_head_needs(&m->head);
    if ((needs & FT_HEAD_NEEDS_MASK) && !b->valid)
        return ft_error(FT_ERR_INVALID_ARGUMENT, "model: the %s head needs its row mask (valid: QA's context rows)",
                        ft_head_kind_name((int)m->head.kind));
    FT_TRY(ft_model_reserve(m, b->B, N));
    layout(m, b->B, N, v, m->buf);
    for (int64_t i = 0, f = 0; i < b->B; f += b->lengths[i], i++) {
        m->seqs[i] = (int32_t)f;
        m->seqs[b->B + i] = b->lengths[i];
    }
    if (N != b->B || (needs & FT_HEAD_NEEDS_ROWS))   /* pooling and row heads read it on the device */
        FT_TRY(m->be->upload(m->be, v->seqs, m->seqs, (size_t)(2 * b->B) * sizeof(int32_t)));
    if (b->targets)
        FT_TRY(m->be->upload(m->be, v->targets, b->targets, (size_t)ft_head_target_count(&m->head, b->B, N) * 4));
    if (b->valid) FT_TRY(m->be->upload(m->be, v->valid, b->valid, (size_t)N * sizeof(float)));
    *N_out = N;
    return FT_OK;
}

typedef struct { ft_bucket_fn ready; void *arg; int64_t count; } layer_hook;
static void layer_done(void *arg, int64_t layer) {
    const layer_hook *h = arg;
    h->ready(h->arg, (size_t)(h->count - layer));
}

static ft_status run(ft_model *m, const ft_model_batch *b, int training, double *loss, float *logits_host,
                     ft_bucket_fn ready, void *arg) {
    batch_bufs v = {0};
    int64_t N = 0;
    FT_TRY(stage(m, b, &v, &N));
    const int on_device = N != b->B || (ft_head_needs(&m->head) & FT_HEAD_NEEDS_ROWS);
    const ft_head_batch hb = {b->B, N, m->seqs, on_device ? v.seqs : NULL, b->row_base, b->seq_base};
    const float *x = b->x;
    if (m->layers) {
        if (b->ids) FT_TRY(ft_layer_stack_set_tokens(m->layers, b->ids, b->types, N));
        FT_TRY(ft_layer_stack_forward(m->layers, b->x, b->lengths, b->B, v.out, training, b->seed, b->step,
                                      b->row_base, b->sq_base));
        x = v.out;
    }
    const int grads = training && b->targets;
    const double denom = b->denominator > 0.0 ? b->denominator : 1.0;
    const float scale = (float)(1.0 / denom);
    const ft_device dev = m->be->device;
    FT_TRY(ft_head_step(dev, &m->head, m->params + m->n_layers, x, &hb, grads ? v.targets : NULL, v.valid, v.logits,
                        grads ? v.loss : NULL, grads ? m->grads + m->n_layers : NULL,
                        grads && m->layers ? v.dout : NULL, scale, training, b->seed, b->step, v.ws, v.ws_floats, 0));
    if (logits_host)
        FT_TRY(m->be->download(m->be, logits_host, v.logits,
                               (size_t)ft_head_logits_count(&m->head, b->B, N) * sizeof(float)));
    if (!grads) return m->be->synchronize(m->be);
    const int64_t nl = ft_head_loss_count(&m->head, b->B, N);
    FT_TRY(m->be->download(m->be, m->loss_host, v.loss, (size_t)nl * sizeof(float)));
    double s = 0.0;
    for (int64_t i = 0; i < nl; i++) s += m->loss_host[i];
    *loss = s / denom;
    if (ready) ready(arg, 0);   /* (the download waited for the head's gradients) */
    if (!m->layers) return FT_OK;
    layer_hook hook = {ready, arg, ft_layer_stack_count(m->layers)};
    return ft_layer_stack_backward(m->layers, v.dout, NULL, b->loss_scale > 0.0f ? b->loss_scale : 1.0f,
                                   ready ? layer_done : NULL, &hook);
}

ft_status ft_model_step(ft_model *m, const ft_model_batch *b, double *loss, float *logits_host, ft_bucket_fn ready,
                        void *arg) {
    if (!loss) return ft_error(FT_ERR_INVALID_ARGUMENT, "model step: no place for the loss");
    if (!b || !b->targets) return ft_error(FT_ERR_INVALID_ARGUMENT, "model step: a training step needs targets");
    return run(m, b, 1, loss, logits_host, ready, arg);
}

ft_status ft_model_forward(ft_model *m, const ft_model_batch *b, float *logits_host) {
    if (!logits_host) return ft_error(FT_ERR_INVALID_ARGUMENT, "model forward: no place for the logits");
    ft_model_batch inference = *b;
    inference.targets = NULL;
    return run(m, &inference, 0, NULL, logits_host, NULL, NULL);
}
