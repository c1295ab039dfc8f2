/* fasttran._C.EncoderCore: a heap type owning one ft_encoder. The Python Encoder class
 * (fasttran/encoder.py) wraps it with config parsing, conveniences and reprs. */
#include "binding.h"

typedef struct {
    PyObject_HEAD
    ft_encoder *enc;
} EncoderCore;

static void EncoderCore_dealloc(EncoderCore *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->enc) {
        ft_encoder *e = self->enc;
        self->enc = NULL;
        Py_BEGIN_ALLOW_THREADS     /* waits for a forward running in another thread */
        ft_encoder_free(e);
        Py_END_ALLOW_THREADS
    }
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyTypeObject *encoder_core_type;   /* set at module init */

ft_encoder *ft_py_encoder_from(PyObject *obj) {
    if (!encoder_core_type || !PyObject_TypeCheck(obj, encoder_core_type) || !((EncoderCore *)obj)->enc) {
        ft_py_fail(ft_errors.input_type, "expected an initialised fasttran._C.EncoderCore, got %s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return ((EncoderCore *)obj)->enc;
}

/* "float32" / "float16" / "bfloat16" -> its ft_dtype; anything else FT_DTYPE_COUNT */
static ft_dtype float_dtype_named(const char *name) {
    for (int k = 0; k < FT_DTYPE_COUNT; k++)
        if (strcmp(name, ft_dtype_name((ft_dtype)k)) == 0)
            return k == FT_F32 || k == FT_F16 || k == FT_BF16 ? (ft_dtype)k : FT_DTYPE_COUNT;
    return FT_DTYPE_COUNT;
}

/* a sequence of n integers in [lo, hi] into out (n); what names it in errors */
static int int_list(PyObject *seq, const char *what, int64_t n, long long lo, long long hi, int64_t *out) {
    PyObject *fast = PySequence_Fast(seq, "");
    if (!fast) {
        PyErr_Clear();
        ft_py_fail(ft_errors.input_type, "%s must be a sequence of integers, got %s", what, Py_TYPE(seq)->tp_name);
        return 0;
    }
    int ok = 1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        ft_py_fail(ft_errors.input, "%s has %zd entries; the model needs %lld", what, PySequence_Fast_GET_SIZE(fast),
                   (long long)n);
        ok = 0;
    }
    for (int64_t i = 0; ok && i < n; i++) {
        PyObject *v = PySequence_Fast_GET_ITEM(fast, i);
        long long x = PyLong_Check(v) && !PyBool_Check(v) ? PyLong_AsLongLong(v) : (PyErr_Clear(), lo - 1);
        if (x == -1 && PyErr_Occurred()) { PyErr_Clear(); x = lo - 1; }
        if (x < lo || x > hi) {
            ft_py_fail(ft_errors.input, "%s[%lld] must be an integer in [%lld, %lld]", what, (long long)i, lo, hi);
            ok = 0;
        }
        out[i] = x;
    }
    Py_DECREF(fast);
    return ok;
}

static int EncoderCore_init(EncoderCore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                             "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "activation",
                             "pad_token_id", "device_index", "dtype", "layer_heads", "layer_intermediate",
                             "head_attention", "sign_match_keys", "vocab_map", "vocab_rows", "position_ids", "embedding_size",
                             "norm", "rope_theta", "rope_theta_local", "gated_ffn", "no_bias", "qkv_fused",
                             "attention_window", "global_every", NULL};
    ft_bert_config c;
    int act = 0, device_index = -1, position_ids = FT_POS_INDEX;
    const char *dtype = "float32";
    PyObject *heads_o = Py_None, *inter_o = Py_None, *attn_o = Py_None, *vmap_o = Py_None;
    long long sign_keys = 0, vocab_rows = 0, embedding_size = 0, window = 0, global_every = 0;
    int norm = FT_NORM_POST, gated = 0, no_bias = 0, qkv_fused = 0;
    double theta = 0.0, theta_local = 0.0;
    memset(&c, 0, sizeof c);
    if (!ft_py_keywords_only(args, "EncoderCore()") || !PyArg_ParseTupleAndKeywords(args, kw, "LLLLLLLfiL|isOOOLOLiLiddpppLL", kwlist, &c.vocab_size, &c.hidden_size,
                                     &c.num_layers, &c.num_heads, &c.intermediate_size,
                                     &c.max_position_embeddings, &c.type_vocab_size, &c.layer_norm_eps, &act,
                                     &c.pad_token_id, &device_index, &dtype, &heads_o, &inter_o, &attn_o, &sign_keys,
                                     &vmap_o, &vocab_rows, &position_ids, &embedding_size, &norm, &theta,
                                     &theta_local, &gated, &no_bias, &qkv_fused, &window, &global_every))
        return -1;
    /* the layer's shape beyond BERT's (ModernBERT): checked in C */
    c.norm = (ft_norm_placement)norm;
    c.rope_theta = theta;
    c.rope_theta_local = theta_local;
    c.gated_ffn = gated;
    c.no_bias = no_bias;
    c.qkv_fused = qkv_fused;
    c.attention_window = window;
    c.global_every = global_every;
    c.position_ids = (ft_position_ids)position_ids;   /* checked in C */
    c.embedding_size = embedding_size;
    if (vmap_o != Py_None) {   /* a pruned vocabulary: one int32 row per token id (checked for sense in C) */
        PyArrayObject *a = (PyArrayObject *)vmap_o;
        if (!PyArray_Check(vmap_o) || PyArray_TYPE(a) != NPY_INT32 || PyArray_NDIM(a) != 1 ||
            !PyArray_IS_C_CONTIGUOUS(a) || PyArray_SIZE(a) != c.vocab_size) {
            ft_py_fail(ft_errors.input, "vocab_map must be a contiguous int32 array of vocab_size = %lld rows",
                       (long long)c.vocab_size);
            return -1;
        }
        c.vocab_map = PyArray_DATA(a);
        c.vocab_rows = vocab_rows;
    }
    /* a compressed model's structure (fasttran.compress): checked for type and length here, for sense in C */
    int64_t *heads = NULL, *inter = NULL, *modes64 = NULL;
    uint8_t *modes = NULL;
    const int64_t L = c.num_layers >= 0 && c.num_layers <= 1024 ? c.num_layers : 0;
    int ok = 1;
    if (heads_o != Py_None) {
        ok = (heads = PyMem_Calloc((size_t)L + 1, sizeof *heads)) != NULL &&
             int_list(heads_o, "layer_heads", L, 1, c.num_heads, heads);
        c.layer_heads = heads;
    }
    if (ok && inter_o != Py_None) {
        ok = (inter = PyMem_Calloc((size_t)L + 1, sizeof *inter)) != NULL &&
             int_list(inter_o, "layer_intermediate", L, 1, 1 << 20, inter);
        c.layer_intermediate = inter;
    }
    if (ok && attn_o != Py_None) {
        int64_t total = 0;
        for (int64_t l = 0; l < L; l++) total += heads ? heads[l] : c.num_heads;
        ok = (modes64 = PyMem_Calloc((size_t)total + 1, sizeof *modes64)) != NULL &&
             (modes = PyMem_Calloc((size_t)total + 1, 1)) != NULL &&
             int_list(attn_o, "head_attention", total, FT_ATTN_EXACT, FT_ATTN_SIGN_MATCH, modes64);
        for (int64_t k = 0; ok && k < total; k++) modes[k] = (uint8_t)modes64[k];
        c.head_attention = modes;
    }
    c.sign_match_keys = sign_keys;
    if (!ok && !PyErr_Occurred()) PyErr_NoMemory();
    if (ok) ok = self->enc == NULL || (ft_py_fail(ft_errors.base, "EncoderCore is already initialised"), 0);
    if (!ok) {
        PyMem_Free(heads);
        PyMem_Free(inter);
        PyMem_Free(modes64);
        PyMem_Free(modes);
        return -1;
    }
    const ft_dtype dt = float_dtype_named(dtype);
    ft_status st = FT_OK;
    ft_encoder *e = NULL;
    if (dt == FT_DTYPE_COUNT) {
        ft_py_fail(ft_errors.input, "dtype must be 'float32', 'float16' or 'bfloat16', got '%s'", dtype);
    } else if (act < FT_ACT_GELU_ERF || act > FT_ACT_TANH) {
        ft_py_fail(ft_errors.input, "activation code %d is not one of _C.ACTIVATIONS", act);
    } else {
        c.activation = (ft_activation)act;
        ft_device dev = {device_index < 0 ? FT_DEVICE_CPU : FT_DEVICE_CUDA, device_index < 0 ? 0 : device_index};
        Py_BEGIN_ALLOW_THREADS
        st = ft_encoder_create(&c, dev, dt, &e);   /* copies the structure arrays */
        Py_END_ALLOW_THREADS
        if (st != FT_OK) ft_py_raise(st);
    }
    PyMem_Free(heads);
    PyMem_Free(inter);
    PyMem_Free(modes64);
    PyMem_Free(modes);
    if (!e) return -1;
    self->enc = e;
    return 0;
}

static int ready(EncoderCore *self) {
    if (!self->enc) { ft_py_fail(ft_errors.base, "EncoderCore is not initialised"); return 0; }
    return 1;
}

/* names_o: None, or a list of one str per tensor (ft_encoder_num_tensors): the checkpoint's name of each
 * view. *out: NULL for None, else an array to PyMem_Free (its strings live as long as the list). 0: failed */
static int tensor_names(EncoderCore *self, PyObject *names_o, const char ***out) {
    const size_t n = ft_encoder_num_tensors(self->enc);
    *out = NULL;
    if (names_o == Py_None) return 1;
    if (!PyList_Check(names_o) || (size_t)PyList_GET_SIZE(names_o) != n) {
        ft_py_fail(ft_errors.input, "names must be a list of %zu tensor names (one per parameter)", n);
        return 0;
    }
    const char **names = PyMem_Calloc(n + 1, sizeof *names);
    if (!names) { PyErr_NoMemory(); return 0; }
    for (size_t k = 0; k < n; k++) {
        PyObject *o = PyList_GET_ITEM(names_o, (Py_ssize_t)k);
        names[k] = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
        if (!names[k]) {
            if (!PyErr_Occurred()) ft_py_fail(ft_errors.input, "names[%zu] must be a str", k);
            PyMem_Free(names);
            return 0;
        }
    }
    *out = names;
    return 1;
}

/* load(path, prefix=None, expect_bytes=-1, expect_crc32c=-1, names=None, layer_prefix="encoder.layer."):
 * names (tensor_names) the checkpoint's name of each view, without the prefix */
static PyObject *EncoderCore_load(EncoderCore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "prefix", "expect_bytes", "expect_crc32c", "names", "layer_prefix", NULL};
    const char *path, *prefix = NULL, *layer_prefix = "encoder.layer.";
    long long eb = -1, ec = -1;
    PyObject *names_o = Py_None;
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kw, "s|zLLOs", kwlist, &path, &prefix, &eb, &ec, &names_o,
                                                     &layer_prefix))
        return NULL;
    const char **names;
    if (!tensor_names(self, names_o, &names)) return NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS   /* names stays alive: the list holds its strings, and the call holds the list */
    st = ft_encoder_load_safetensors_named(self->enc, path, prefix, names, layer_prefix, eb, ec);
    Py_END_ALLOW_THREADS
    PyMem_Free(names);
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *EncoderCore_save(EncoderCore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "dtype", "names", NULL};
    const char *path, *dtype = "float32";
    PyObject *names_o = Py_None;
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kw, "s|sO", kwlist, &path, &dtype, &names_o)) return NULL;
    const ft_dtype dt = float_dtype_named(dtype);
    if (dt == FT_DTYPE_COUNT)
        return ft_py_fail(ft_errors.input_type, "save dtype must be 'float32', 'float16' or 'bfloat16', got '%s'", dtype);
    const char **names;
    if (!tensor_names(self, names_o, &names)) return NULL;
    ft_status st;
    uint64_t bytes = 0;
    uint32_t crc = 0;
    Py_BEGIN_ALLOW_THREADS
    st = ft_encoder_save_safetensors_named(self->enc, path, dt, names, &bytes, &crc);
    Py_END_ALLOW_THREADS
    PyMem_Free(names);
    if (st != FT_OK) return ft_py_raise(st);
    return Py_BuildValue("(KI)", (unsigned long long)bytes, (unsigned int)crc);
}

static PyObject *EncoderCore_copy_weights_from(EncoderCore *self, PyObject *arg) {
    if (!ready(self)) return NULL;
    if (Py_TYPE(arg) != Py_TYPE(self) || !((EncoderCore *)arg)->enc)
        return ft_py_fail(ft_errors.input_type, "copy_weights_from needs an initialised EncoderCore");
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_encoder_copy_weights(self->enc, ((EncoderCore *)arg)->enc);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

/* ---- inputs ------------------------------------------------------------------------------- */

/* index arrays (ids, types, masks): integers, bool, and float32/float64 masks */
static int npy_to_ft(int npy, ft_dtype *out) { return npy != NPY_FLOAT16 && ft_py_npy_dtype(npy, out); }

/* View `obj` (an ndarray) as a 2-D index array in place. Non-contiguous and read-only arrays
 * are read as they are; only misaligned or byte-swapped ones are copied. `*keep` receives the
 * array to hold while C reads it. */
static int index_view(PyObject *obj, const char *what, const npy_intp *expect_shape, ft_index2d *out,
                      PyArrayObject **keep) {
    *keep = NULL;
    if (!PyArray_Check(obj)) {
        ft_py_fail(ft_errors.input_type, "%s must be a NumPy array or a DLPack tensor, got %s", what,
                   Py_TYPE(obj)->tp_name);
        return 0;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_NDIM(a) != 2) {
        ft_py_fail(ft_errors.input, "%s must be 2-D (batch, sequence), got a %d-D array", what, PyArray_NDIM(a));
        return 0;
    }
    ft_dtype dt;
    if (!npy_to_ft(PyArray_TYPE(a), &dt)) {
        PyObject *r = PyObject_Repr((PyObject *)PyArray_DESCR(a));
        ft_py_fail(ft_errors.input_type, "%s has dtype %U; expected int32 or int64", what, r ? r : Py_None);
        Py_XDECREF(r);
        return 0;
    }
    if (expect_shape && (PyArray_DIM(a, 0) != expect_shape[0] || PyArray_DIM(a, 1) != expect_shape[1])) {
        ft_py_fail(ft_errors.input, "%s has shape (%zd, %zd) but input_ids has shape (%zd, %zd)", what,
                   (Py_ssize_t)PyArray_DIM(a, 0), (Py_ssize_t)PyArray_DIM(a, 1), (Py_ssize_t)expect_shape[0],
                   (Py_ssize_t)expect_shape[1]);
        return 0;
    }
    npy_intp isz = PyArray_ITEMSIZE(a);
    int ok = PyArray_ISALIGNED(a) && PyArray_ISNOTSWAPPED(a) && PyArray_STRIDE(a, 0) % isz == 0 &&
             PyArray_STRIDE(a, 1) % isz == 0;
    if (ok) {
        Py_INCREF(a);
    } else {
        /* native byte order, aligned, C order (PyArray_FromAny steals the descr reference) */
        a = (PyArrayObject *)PyArray_FromAny(obj, PyArray_DescrFromType(PyArray_TYPE(a)), 2, 2,
                                             NPY_ARRAY_CARRAY_RO | NPY_ARRAY_ENSURECOPY, NULL);
        if (!a) return 0;
        npy_to_ft(PyArray_TYPE(a), &dt);
    }
    *keep = a;
    out->data = PyArray_DATA(a);
    out->dtype = dt;
    out->stride[0] = PyArray_STRIDE(a, 0) / (npy_intp)PyArray_ITEMSIZE(a);
    out->stride[1] = PyArray_STRIDE(a, 1) / (npy_intp)PyArray_ITEMSIZE(a);
    return 1;
}

/* Device outputs are encoder memory: the Tensor holds the EncoderCore, which frees it. */
static void release_device_output(PyObject *owner, void *ctx, void *data) {
    (void)ctx;
    EncoderCore *core = (EncoderCore *)owner;
    if (core->enc) ft_encoder_device_free(core->enc, data);
}

/* An output array: NumPy on the host, or a fasttran.Tensor in the encoder's device memory. */
static PyObject *new_output(EncoderCore *self, int on_device, int nd, const npy_intp *dims, float **ptr) {
    if (!on_device) {
        PyObject *a = PyArray_SimpleNew(nd, dims, NPY_FLOAT32);
        if (a) *ptr = PyArray_DATA((PyArrayObject *)a);
        return a;
    }
    int64_t shape[3];
    size_t n = 1;
    for (int d = 0; d < nd; d++) { shape[d] = dims[d]; n *= (size_t)dims[d]; }
    void *p = NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_encoder_device_alloc(self->enc, n * sizeof(float), &p);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    *ptr = p;
    return ft_py_tensor_new(p, nd, shape, NULL, FT_F32, ft_encoder_device(self->enc), 0, (PyObject *)self,
                            release_device_output, NULL);
}

/* forward(*, input_ids, attention_mask, token_type_ids, layers, pooling, want_hidden, on_device=False)
 *   -> (hidden list | None, pooled list | None); arrays are NumPy, or fasttran.Tensor in the
 *   encoder's device memory with on_device. pooling: a value of _C.POOLINGS. */
/* a forward mask: None, or a 1-d uint8 / bool NumPy array of n entries (0 or 1) */
static int mask_array(PyObject *o, const char *what, int64_t n, const char *per, const uint8_t **out) {
    *out = NULL;
    if (o == Py_None) return 1;
    if (!PyArray_Check(o) || (PyArray_TYPE((PyArrayObject *)o) != NPY_UINT8 && PyArray_TYPE((PyArrayObject *)o) != NPY_BOOL) ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o)) {
        ft_py_fail(ft_errors.input_type, "%s must be a contiguous uint8 or bool NumPy array", what);
        return 0;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_NDIM(a) != 1 || PyArray_SIZE(a) != n) {
        ft_py_fail(ft_errors.input, "%s has shape %s%zd%s; this model needs (%lld,): %s", what,
                   PyArray_NDIM(a) == 1 ? "(" : "a ", PyArray_NDIM(a) == 1 ? (Py_ssize_t)PyArray_SIZE(a) : (Py_ssize_t)PyArray_NDIM(a),
                   PyArray_NDIM(a) == 1 ? ",)" : "-d array", (long long)n, per);
        return 0;
    }
    const uint8_t *d = PyArray_DATA(a);
    for (int64_t i = 0; i < n; i++)
        if (d[i] > 1) { ft_py_fail(ft_errors.input, "%s[%lld] = %d; masks hold 0 or 1", what, (long long)i, (int)d[i]); return 0; }
    *out = d;
    return 1;
}

static PyObject *EncoderCore_forward(EncoderCore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"input_ids", "attention_mask", "token_type_ids", "layers", "pooling", "want_hidden",
                             "on_device", "skip_layers", "head_keep", "ffn_keep", "ffn_group", "start_layer",
                             "start_hidden", NULL};
    PyObject *ids_obj, *mask_obj, *types_obj, *layers, *skip_o = Py_None, *heads_o = Py_None, *ffn_o = Py_None,
             *start_o = Py_None;
    int pooling, want_hidden, on_device = 0;
    long long ffn_group = 0, start_layer = 0;
    if (!ready(self) || !ft_py_keywords_only(args, "EncoderCore.forward()") ||
        !PyArg_ParseTupleAndKeywords(args, kw, "OOOO!ip|pOOOLLO", kwlist, &ids_obj, &mask_obj, &types_obj, &PyTuple_Type,
                                     &layers, &pooling, &want_hidden, &on_device, &skip_o, &heads_o, &ffn_o, &ffn_group,
                                     &start_layer, &start_o))
        return NULL;
    const ft_bert_config *cfg = ft_encoder_config(self->enc);
    const int64_t L = cfg->num_layers, C = cfg->hidden_size;
    if (pooling < FT_POOL_NONE || pooling > FT_POOL_MEAN) return ft_py_fail(ft_errors.input, "bad pooling code %d", pooling);
    ft_forward_masks masks = {NULL, NULL, NULL, ffn_group};
    if (!mask_array(skip_o, "skip_layers", L, "one entry per layer", &masks.skip_layers) ||
        !mask_array(heads_o, "head_keep", ft_config_total_heads(cfg), "one entry per attention head, layer after layer",
                    &masks.head_keep))
        return NULL;
    if (ffn_o != Py_None) {
        int64_t groups = 0;
        for (int64_t l = 0; l < L; l++) {
            const int64_t width = ft_config_layer_intermediate(cfg, l);
            if (ffn_group < 1 || width % ffn_group)
                return ft_py_fail(ft_errors.input, "ffn_group %lld does not divide layer %lld's intermediate size %lld",
                                  ffn_group, (long long)l, (long long)width);
            groups += width / ffn_group;
        }
        if (!mask_array(ffn_o, "ffn_keep", groups, "one entry per FFN group, layer after layer", &masks.ffn_keep))
            return NULL;
    }
    masks.start_layer = start_layer;
    const int masked = masks.skip_layers || masks.head_keep || masks.ffn_keep || start_layer != 0;
    ft_index2d ids, mask, types;
    PyArrayObject *k_ids = NULL, *k_mask = NULL, *k_types = NULL;
    PyObject *hidden = NULL, *pooled = NULL, *result = NULL;
    float **hptr = NULL, **pptr = NULL;
    if (!index_view(ids_obj, "input_ids", NULL, &ids, &k_ids)) return NULL;
    npy_intp shape[3] = {PyArray_DIM(k_ids, 0), PyArray_DIM(k_ids, 1), (npy_intp)C};
    if (mask_obj != Py_None && !index_view(mask_obj, "attention_mask", shape, &mask, &k_mask)) goto done;
    if (types_obj != Py_None && !index_view(types_obj, "token_type_ids", shape, &types, &k_types)) goto done;
    if (start_layer != 0) {   /* the hidden states of start_layer, as forward returned them */
        PyArrayObject *a = (PyArrayObject *)start_o;
        if (!PyArray_Check(start_o) || PyArray_TYPE(a) != NPY_FLOAT32 || !PyArray_IS_C_CONTIGUOUS(a) ||
            PyArray_NDIM(a) != 3 || PyArray_DIM(a, 0) != shape[0] || PyArray_DIM(a, 1) != shape[1] ||
            PyArray_DIM(a, 2) != shape[2]) {
            ft_py_fail(ft_errors.input, "start_hidden must be a C-contiguous float32 array of shape (%zd, %zd, %zd): "
                       "layer %lld's hidden states for these inputs", (Py_ssize_t)shape[0], (Py_ssize_t)shape[1],
                       (Py_ssize_t)shape[2], start_layer);
            goto done;
        }
        masks.start_hidden = PyArray_DATA(a);
    }

    Py_ssize_t nl = PyTuple_GET_SIZE(layers);
    hptr = PyMem_Calloc((size_t)L + 1, sizeof *hptr);
    pptr = PyMem_Calloc((size_t)L + 1, sizeof *pptr);
    if (!hptr || !pptr) { PyErr_NoMemory(); goto done; }
    hidden = want_hidden ? PyList_New(nl) : Py_NewRef(Py_None);
    pooled = pooling ? PyList_New(nl) : Py_NewRef(Py_None);
    if (!hidden || !pooled) goto done;
    for (Py_ssize_t k = 0; k < nl; k++) {
        long l = PyLong_AsLong(PyTuple_GET_ITEM(layers, k));
        if (l == -1 && PyErr_Occurred()) goto done;
        if (l < 0 || l > L) { ft_py_fail(ft_errors.input, "layer %ld out of range 0..%lld", l, (long long)L); goto done; }
        if (hptr[l] || pptr[l]) { ft_py_fail(ft_errors.input, "layer %ld requested twice", l); goto done; }
        if (want_hidden) {
            PyObject *a = new_output(self, on_device, 3, shape, &hptr[l]);
            if (!a) goto done;
            PyList_SET_ITEM(hidden, k, a);
        }
        if (pooling) {
            npy_intp ps[2] = {shape[0], (npy_intp)C};
            PyObject *a = new_output(self, on_device, 2, ps, &pptr[l]);
            if (!a) goto done;
            PyList_SET_ITEM(pooled, k, a);
        }
    }
    {
        ft_status st;
        ft_py_cancel cs;
        ft_py_cancel_begin(&cs);
        st = ft_encoder_forward_masked(self->enc, shape[0], shape[1], &ids, k_mask ? &mask : NULL,
                                       k_types ? &types : NULL, hptr, pptr, (ft_pooling)pooling, on_device,
                                       masked ? &masks : NULL, ft_py_cancel_check, &cs);
        ft_py_cancel_end(&cs);
        if (st != FT_OK) { ft_py_raise(st); goto done; }
    }
    result = PyTuple_Pack(2, hidden, pooled);
done:
    PyMem_Free(hptr);
    PyMem_Free(pptr);
    Py_XDECREF(hidden);
    Py_XDECREF(pooled);
    Py_XDECREF(k_ids);
    Py_XDECREF(k_mask);
    Py_XDECREF(k_types);
    return result;
}

/* compressed(keep_layers=None, keep_heads=None, keep_neurons=None, head_attention=None, sign_match_keys=0)
 * -> a new EncoderCore: the kept parts of this one (ft_encoder_compress); arrays are 1-d uint8 */
static PyObject *EncoderCore_compressed(EncoderCore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"keep_layers", "keep_heads", "keep_neurons", "head_attention", "sign_match_keys",
                             "keep_tokens", "unknown_token", NULL};
    PyObject *lo = Py_None, *ho = Py_None, *no = Py_None, *ao = Py_None, *to = Py_None;
    long long keys = 0, unk = -1;
    if (!ready(self) || !ft_py_keywords_only(args, "EncoderCore.compressed()") ||
        !PyArg_ParseTupleAndKeywords(args, kw, "|OOOOLOL", kwlist, &lo, &ho, &no, &ao, &keys, &to, &unk))
        return NULL;
    const ft_bert_config *cfg = ft_encoder_config(self->enc);
    int64_t neurons = 0;
    for (int64_t l = 0; l < cfg->num_layers; l++) neurons += ft_config_layer_intermediate(cfg, l);
    ft_compress_spec spec = {NULL, NULL, NULL, NULL, keys, NULL, unk};
    if (!mask_array(to, "keep_tokens", cfg->vocab_size, "one entry per token id", &spec.keep_tokens) ||
        !mask_array(lo, "keep_layers", cfg->num_layers, "one entry per layer", &spec.keep_layers) ||
        !mask_array(ho, "keep_heads", ft_config_total_heads(cfg), "one entry per attention head, layer after layer",
                    &spec.keep_heads) ||
        !mask_array(no, "keep_neurons", neurons, "one entry per FFN neuron, layer after layer", &spec.keep_neurons))
        return NULL;
    if (ao != Py_None) {
        if (!PyArray_Check(ao) || PyArray_TYPE((PyArrayObject *)ao) != NPY_UINT8 ||
            !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)ao) || PyArray_NDIM((PyArrayObject *)ao) != 1 ||
            PyArray_SIZE((PyArrayObject *)ao) != ft_config_total_heads(cfg))
            return ft_py_fail(ft_errors.input, "head_attention must be a contiguous uint8 array with one mode per head "
                              "(%lld)", (long long)ft_config_total_heads(cfg));
        spec.head_attention = PyArray_DATA((PyArrayObject *)ao);
    }
    ft_encoder *e = NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_encoder_compress(self->enc, &spec, &e);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    EncoderCore *core = (EncoderCore *)PyType_GenericAlloc(Py_TYPE(self), 0);
    if (!core) {
        ft_encoder_free(e);
        return NULL;
    }
    core->enc = e;   /* (the allocation took the heap type's reference that dealloc drops) */
    return (PyObject *)core;
}

/* tensors() -> [(name, shape)] in parameter-table order */
static PyObject *EncoderCore_tensors(EncoderCore *self, PyObject *unused) {
    (void)unused;
    if (!ready(self)) return NULL;
    size_t n = ft_encoder_num_tensors(self->enc);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        const char *name;
        int nd;
        int64_t sh[2];
        float *data;
        ft_encoder_tensor_info(self->enc, i, &name, &nd, sh, &data);
        PyObject *t = nd == 2 ? Py_BuildValue("(s(LL))", name, (long long)sh[0], (long long)sh[1])
                              : Py_BuildValue("(s(L))", name, (long long)sh[0]);
        if (!t) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    return out;
}

/* tensor(i) -> a NumPy copy of parameter i (host copy of the weights): float32, or int8 for a
 * view an int8 encoder stores in int8 (its scales: tensor_scale(i)) */
static PyObject *EncoderCore_tensor(EncoderCore *self, PyObject *arg) {
    if (!ready(self)) return NULL;
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    const char *name;
    int nd;
    int64_t sh[2];
    float *data;
    if (i < 0 || (size_t)i >= ft_encoder_num_tensors(self->enc))
        return ft_py_fail(ft_errors.input_range, "tensor index %zd out of range", i);
    const int q = ft_encoder_tensor_is_int8(self->enc, (size_t)i);
    ft_status st = ft_encoder_tensor_info(self->enc, (size_t)i, &name, &nd, sh, &data);
    if (st != FT_OK && !q) return ft_py_raise(st);
    ft_clear_error();
    npy_intp dims[2] = {(npy_intp)sh[0], (npy_intp)sh[1]};
    PyObject *a = PyArray_SimpleNew(nd, dims, q ? NPY_INT8 : NPY_FLOAT32);
    if (!a) return NULL;
    if (q) {
        int8_t *qd;
        float *scale;
        if ((st = ft_encoder_tensor_int8(self->enc, (size_t)i, &qd, &scale)) != FT_OK) { Py_DECREF(a); return ft_py_raise(st); }
        memcpy(PyArray_DATA((PyArrayObject *)a), qd, (size_t)(sh[0] * sh[1]));
    } else {
        memcpy(PyArray_DATA((PyArrayObject *)a), data, (size_t)(sh[0] * sh[1]) * sizeof(float));
    }
    return a;
}

static int tensor_index(EncoderCore *self, PyObject *arg, size_t *out) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return 0;
    if (i < 0 || (size_t)i >= ft_encoder_num_tensors(self->enc)) {
        ft_py_fail(ft_errors.input_range, "tensor index %zd out of range", i);
        return 0;
    }
    *out = (size_t)i;
    return 1;
}

/* tensor_scale(i) -> the per-row float32 scales of an int8 view, or None for a float32 one */
static PyObject *EncoderCore_tensor_scale(EncoderCore *self, PyObject *arg) {
    size_t i;
    if (!ready(self) || !tensor_index(self, arg, &i)) return NULL;
    if (!ft_encoder_tensor_is_int8(self->enc, i)) Py_RETURN_NONE;
    const char *name;
    int nd;
    int64_t sh[2];
    float *data, *scale;
    int8_t *qd;
    ft_encoder_tensor_info(self->enc, i, &name, &nd, sh, &data);
    ft_clear_error();
    ft_status st = ft_encoder_tensor_int8(self->enc, i, &qd, &scale);
    if (st != FT_OK) return ft_py_raise(st);
    npy_intp dims[1] = {(npy_intp)sh[0]};
    PyObject *a = PyArray_SimpleNew(1, dims, NPY_FLOAT32);
    if (a) memcpy(PyArray_DATA((PyArrayObject *)a), scale, (size_t)sh[0] * sizeof(float));
    return a;
}

/* set_tensor(i, values, scale=None): write parameter i from a C-contiguous array of its shape:
 * float32 for a float view; int8 values and float32 scales (its rows) for an int8 view */
static PyObject *EncoderCore_set_tensor(EncoderCore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"index", "values", "scale", NULL};
    PyObject *idx, *values, *scale = Py_None;
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kw, "OO|O", kwlist, &idx, &values, &scale)) return NULL;
    size_t i;
    if (!tensor_index(self, idx, &i)) return NULL;
    const char *name;
    int nd;
    int64_t sh[2];
    float *data;
    const int q = ft_encoder_tensor_is_int8(self->enc, i);
    ft_encoder_tensor_info(self->enc, i, &name, &nd, sh, &data);
    ft_clear_error();
    const npy_intp want = (npy_intp)(sh[0] * sh[1]);
    if (!PyArray_Check(values) || PyArray_TYPE((PyArrayObject *)values) != (q ? NPY_INT8 : NPY_FLOAT32) ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)values) || PyArray_SIZE((PyArrayObject *)values) != want)
        return ft_py_fail(ft_errors.input_type, "%s: expected a C-contiguous %s array of %lld x %lld values", name,
                          q ? "int8" : "float32", (long long)sh[0], (long long)sh[1]);
    if (q && (!PyArray_Check(scale) || PyArray_TYPE((PyArrayObject *)scale) != NPY_FLOAT32 ||
              !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)scale) || PyArray_SIZE((PyArrayObject *)scale) != sh[0]))
        return ft_py_fail(ft_errors.input_type, "%s is int8: its scales must be a C-contiguous float32 array of %lld "
                          "values (one per row)", name, (long long)sh[0]);
    if (!q && scale != Py_None) return ft_py_fail(ft_errors.input, "%s is a float32 tensor: it takes no scales", name);
    ft_status st;
    const void *vd = PyArray_DATA((PyArrayObject *)values);
    const float *sd = q ? PyArray_DATA((PyArrayObject *)scale) : NULL;
    Py_BEGIN_ALLOW_THREADS
    st = q ? ft_encoder_set_tensor_int8(self->enc, i, vd, sd) : ft_encoder_set_tensor(self->enc, i, vd);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

/* quantize(embeddings): int8 in place (ft_encoder_quantize) */
static PyObject *EncoderCore_quantize(EncoderCore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"embeddings", NULL};
    int embeddings = 1;
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kw, "|p", kwlist, &embeddings)) return NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_encoder_quantize(self->enc, embeddings);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *EncoderCore_memory_report(EncoderCore *self, PyObject *unused) {
    (void)unused;
    if (!ready(self)) return NULL;
    ft_encoder_memory m;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_encoder_memory_report(self->enc, &m);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    return Py_BuildValue("{sKsKsKsKsKsKsK}", "parameters", (unsigned long long)m.parameters, "packed_weights",
                         (unsigned long long)m.packed_weights, "workspace", (unsigned long long)m.workspace,
                         "backend", (unsigned long long)m.backend, "host", (unsigned long long)m.host,
                         "device_free", (unsigned long long)m.device_free, "device_total",
                         (unsigned long long)m.device_total);
}

static PyObject *EncoderCore_set_tf32(EncoderCore *self, PyObject *arg) {
    if (!ready(self)) return NULL;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    ft_status st = ft_encoder_set_tf32(self->enc, on);
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *EncoderCore_get_dtype(EncoderCore *self, void *c) {
    (void)c;
    if (!ready(self)) return NULL;
    return PyUnicode_FromString(ft_dtype_name(ft_encoder_dtype(self->enc)));
}

static PyObject *EncoderCore_get_int8_products(EncoderCore *self, void *c) {
    (void)c;
    if (!ready(self)) return NULL;
    return PyBool_FromLong(ft_encoder_int8_products(self->enc));
}
static PyObject *EncoderCore_get_int8_embeddings(EncoderCore *self, void *c) {
    (void)c;
    if (!ready(self)) return NULL;
    return PyBool_FromLong(ft_encoder_int8_embeddings(self->enc));
}

static PyObject *EncoderCore_get_has_pooler(EncoderCore *self, void *c) {
    (void)c;
    if (!ready(self)) return NULL;
    return PyBool_FromLong(ft_encoder_has_pooler(self->enc));
}
static PyObject *EncoderCore_get_num_parameters(EncoderCore *self, void *c) {
    (void)c;
    if (!ready(self)) return NULL;
    return PyLong_FromSize_t(ft_encoder_param_count(self->enc));
}
/* {"layer_heads": [...], "layer_intermediate": [...], "head_attention": [...], "sign_match_keys": n} */
static PyObject *EncoderCore_get_structure(EncoderCore *self, void *unused) {
    (void)unused;
    if (!ready(self)) return NULL;
    const ft_bert_config *c = ft_encoder_config(self->enc);
    const int64_t L = c->num_layers, total = ft_config_total_heads(c);
    PyObject *heads = PyList_New(L), *inter = PyList_New(L), *modes = PyList_New(total);
    for (int64_t l = 0; heads && inter && l < L; l++) {
        PyList_SET_ITEM(heads, l, PyLong_FromLongLong(ft_config_layer_heads(c, l)));
        PyList_SET_ITEM(inter, l, PyLong_FromLongLong(ft_config_layer_intermediate(c, l)));
    }
    for (int64_t k = 0; modes && k < total; k++)
        PyList_SET_ITEM(modes, k, PyLong_FromLong(c->head_attention ? c->head_attention[k] : FT_ATTN_EXACT));
    if (!heads || !inter || !modes) {
        Py_XDECREF(heads);
        Py_XDECREF(inter);
        Py_XDECREF(modes);
        return NULL;
    }
    return Py_BuildValue("{sNsNsNsLsL}", "layer_heads", heads, "layer_intermediate", inter, "head_attention", modes,
                         "sign_match_keys", (long long)c->sign_match_keys, "vocab_rows",
                         (long long)ft_config_vocab_rows(c));
}

static PyObject *EncoderCore_get_device(EncoderCore *self, void *c) {
    (void)c;
    if (!ready(self)) return NULL;
    ft_device d = ft_encoder_device(self->enc);
    if (d.kind == FT_DEVICE_CPU) return PyUnicode_FromString("cpu");
    return PyUnicode_FromFormat("cuda:%d", d.index);
}
static PyObject *EncoderCore_get_workspace_bytes(EncoderCore *self, void *c) {
    (void)c;
    if (!ready(self)) return NULL;
    return PyLong_FromSize_t(ft_encoder_workspace_bytes(self->enc));
}

static PyMethodDef EncoderCore_methods[] = {
    {"load", (PyCFunction)(void (*)(void))EncoderCore_load, METH_VARARGS | METH_KEYWORDS,
     "load(path, prefix=None, expect_bytes=-1, expect_crc32c=-1, names=None, layer_prefix='encoder.layer.'): read a "
     "safetensors file (its size and CRC-32C checked first when given; names: each tensor's name in the file)."},
    {"save", (PyCFunction)(void (*)(void))EncoderCore_save, METH_VARARGS | METH_KEYWORDS,
     "save(path, dtype='float32', names=None) -> (bytes, crc32c): write safetensors atomically (names: each "
     "tensor's name in the file)."},
    {"forward", (PyCFunction)(void (*)(void))EncoderCore_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(*, input_ids, attention_mask, token_type_ids, layers, pooling, want_hidden, on_device=False, "
     "skip_layers=None, head_keep=None, ffn_keep=None, ffn_group=0) -> (hidden, pooled)."},
    {"copy_weights_from", (PyCFunction)EncoderCore_copy_weights_from, METH_O, "copy all weights of another core."},
    {"compressed", (PyCFunction)(void (*)(void))EncoderCore_compressed, METH_VARARGS | METH_KEYWORDS,
     "compressed(keep_layers=None, keep_heads=None, keep_neurons=None, head_attention=None, sign_match_keys=0, "
     "keep_tokens=None, unknown_token=-1) -> a new EncoderCore holding the kept layers, heads, FFN neurons and "
     "word-embedding rows."},
    {"tensors", (PyCFunction)EncoderCore_tensors, METH_NOARGS, "[(name, shape)] of the parameter table."},
    {"set_tf32", (PyCFunction)EncoderCore_set_tf32, METH_O, "set_tf32(on): fp32 products on TF32 tensor cores (CUDA)."},
    {"memory_report", (PyCFunction)EncoderCore_memory_report, METH_NOARGS,
     "memory_report() -> {parameters, packed_weights, workspace, backend, host, device_free, device_total} in bytes."},
    {"tensor", (PyCFunction)EncoderCore_tensor, METH_O, "tensor(i): copy of parameter i (float32, or int8)."},
    {"tensor_scale", (PyCFunction)EncoderCore_tensor_scale, METH_O,
     "tensor_scale(i): the per-row scales of an int8 parameter (None for a float32 one)."},
    {"set_tensor", (PyCFunction)(void (*)(void))EncoderCore_set_tensor, METH_VARARGS | METH_KEYWORDS,
     "set_tensor(index, values, scale=None): write parameter i (int8 ones with their per-row scales)."},
    {"quantize", (PyCFunction)(void (*)(void))EncoderCore_quantize, METH_VARARGS | METH_KEYWORDS,
     "quantize(embeddings=True): int8 weights with per-output-channel scales, in place."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef EncoderCore_getset[] = {
    {"has_pooler", (getter)EncoderCore_get_has_pooler, NULL, "whether the checkpoint had pooler weights", NULL},
    {"dtype", (getter)EncoderCore_get_dtype, NULL,
     "the encoder's type: float32, float16 / bfloat16 (CUDA storage; CPU: bf16 weights and products), int8", NULL},
    {"int8_products", (getter)EncoderCore_get_int8_products, NULL,
     "int8 encoders: whether the linear layers run int8 products (else float32 over dequantized weights)", NULL},
    {"int8_embeddings", (getter)EncoderCore_get_int8_embeddings, NULL, "whether the word embeddings are int8", NULL},
    {"num_parameters", (getter)EncoderCore_get_num_parameters, NULL, "float parameters in the table", NULL},
    {"device", (getter)EncoderCore_get_device, NULL, "'cpu' or 'cuda:N'", NULL},
    {"structure", (getter)EncoderCore_get_structure, NULL,
     "a compressed model's structure: heads and FFN width per layer, attention mode per head", NULL},
    {"workspace_bytes", (getter)EncoderCore_get_workspace_bytes, NULL, "bytes in the activation workspace", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot EncoderCore_slots[] = {
    {Py_tp_dealloc, EncoderCore_dealloc},
    {Py_tp_init, EncoderCore_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_methods, EncoderCore_methods},
    {Py_tp_getset, EncoderCore_getset},
    {Py_tp_doc, "The C encoder behind fasttran.Encoder."},
    {0, NULL}};

static PyType_Spec EncoderCore_spec = {"fasttran._C.EncoderCore", sizeof(EncoderCore), 0, Py_TPFLAGS_DEFAULT,
                                       EncoderCore_slots};

static PyTypeObject *encoder_core_type;

ft_encoder *ft_py_encoder_of(PyObject *obj) {
    if (!encoder_core_type || !PyObject_TypeCheck(obj, encoder_core_type) || !((EncoderCore *)obj)->enc) {
        ft_py_fail(ft_errors.input_type, "expected an initialised fasttran._C.EncoderCore, got %s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return ((EncoderCore *)obj)->enc;
}

int ft_py_add_encoder_type(PyObject *m) {
    PyObject *tp = PyType_FromModuleAndSpec(m, &EncoderCore_spec, NULL);
    if (!tp) return -1;
    encoder_core_type = (PyTypeObject *)tp;   /* the module keeps it alive */
    int r = PyModule_AddObjectRef(m, "EncoderCore", tp);
    if (r == 0) encoder_core_type = (PyTypeObject *)tp;   /* the module holds the reference */
    Py_DECREF(tp);
    return r;
}
