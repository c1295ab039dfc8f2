/* fasttran._C.LayerStack: the trainable top layers of an encoder (ft_layer_stack), behind
 * fasttran/finetune.py. Buffers are NumPy arrays (CPU) or fasttran.Tensor (any device), checked
 * here once; the work runs in C with the GIL released. */
#include "binding.h"

typedef struct {
    PyObject_HEAD
    ft_layer_stack *stack;
    ft_device device;
    long long sig_group;   /* significance's FFN group size (0: not recorded) */
} LayerStack;

static PyTypeObject *layer_stack_type;

static void LayerStack_dealloc(LayerStack *self) {
    PyTypeObject *tp = Py_TYPE(self);
    ft_layer_stack_free(self->stack);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* a contiguous float32 / int32 buffer on the stack's device (NumPy: host) */
static void *buffer(LayerStack *self, PyObject *o, const char *what, ft_dtype dtype, int64_t numel, int optional) {
    if (o == Py_None && optional) return NULL;
    void *data = NULL;
    int64_t n = 0;
    ft_device dev = {FT_DEVICE_CPU, 0};
    if (PyArray_Check(o)) {
        PyArrayObject *a = (PyArrayObject *)o;
        if (PyArray_TYPE(a) != (dtype == FT_F32 ? NPY_FLOAT32 : NPY_INT32) || !PyArray_IS_C_CONTIGUOUS(a)) {
            ft_py_fail(ft_errors.input_type, "%s must be a C-contiguous %s array", what, ft_dtype_name(dtype));
            return NULL;
        }
        data = PyArray_DATA(a);
        n = (int64_t)PyArray_SIZE(a);
    } else if (ft_py_tensor_check(o)) {
        int ndim;
        const int64_t *shape, *strides;
        ft_dtype dt;
        data = ft_py_tensor_data(o, &ndim, &shape, &strides, &dt, &dev);
        n = 1;
        int64_t expect = 1;
        for (int d = ndim - 1; d >= 0; d--) {
            if (strides && shape[d] > 1 && strides[d] != expect) {
                ft_py_fail(ft_errors.input_type, "%s must be contiguous", what);
                return NULL;
            }
            expect *= shape[d];
            n *= shape[d];
        }
        if (dt != dtype) {
            ft_py_fail(ft_errors.input_type, "%s must be %s, got %s", what, ft_dtype_name(dtype), ft_dtype_name(dt));
            return NULL;
        }
    } else {
        ft_py_fail(ft_errors.input_type, "%s must be a NumPy array or a fasttran.Tensor, got %s", what,
                   Py_TYPE(o)->tp_name);
        return NULL;
    }
    if (dev.kind != self->device.kind || (dev.kind == FT_DEVICE_CUDA && dev.index != self->device.index)) {
        ft_py_fail(ft_errors.input, "%s is on %s but the layers are on %s", what,
                   dev.kind == FT_DEVICE_CPU ? "the CPU" : "a CUDA device",
                   self->device.kind == FT_DEVICE_CPU ? "the CPU" : "a CUDA device");
        return NULL;
    }
    if (numel >= 0 && n != numel) {
        ft_py_fail(ft_errors.input, "%s has %lld elements, expected %lld", what, (long long)n, (long long)numel);
        return NULL;
    }
    return data;
}

static int LayerStack_init(LayerStack *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"encoder", "first", "count", "device_index", "hidden_dropout", "attention_dropout",
                             "inplace_gelu", "inplace_layernorm", "recompute_attention_dropout", "matmul_precision",
                             "recompute_attention_probs", "extra", "shared_grads", "input_dropout", "train_embeddings",
                             NULL};
    PyObject *enc_o;
    long long first, count, extra = 0;
    int device_index = -1, ig = 0, il = 0, rd = 1, prec = FT_F32, rp = 0, shared = 0, te = 0;
    float hp = 0.0f, ap = 0.0f, ip = 0.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OLL|iffpppipLpfp", kwlist, &enc_o, &first, &count, &device_index, &hp,
                                     &ap, &ig, &il, &rd, &prec, &rp, &extra, &shared, &ip, &te))
        return -1;
    if (extra < 0) { ft_py_fail(ft_errors.input, "extra must be >= 0, got %lld", extra); return -1; }
    ft_encoder *enc = ft_py_encoder_of(enc_o);
    if (!enc) return -1;
    if (self->stack) { ft_py_fail(ft_errors.base, "LayerStack is already initialised"); return -1; }
    ft_layer_options opt = {hp, ap, ig, il, rd, rp, (ft_dtype)prec, ip, te};
    ft_device dev = {device_index < 0 ? FT_DEVICE_CPU : FT_DEVICE_CUDA, device_index < 0 ? 0 : device_index};
    shared = ft_py_shared_grads(shared);
    ft_status st;
    ft_layer_stack *s = NULL;
    Py_BEGIN_ALLOW_THREADS
    st = ft_layer_stack_create(enc, first, count, dev, &opt, (size_t)extra, shared, &s);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) { ft_py_raise(st); return -1; }
    self->stack = s;
    self->device = dev;
    return 0;
}

/* the stack behind a LayerStack object (NULL with an exception) and its device */
ft_layer_stack *ft_py_layer_stack_of(PyObject *o, ft_device *dev) {
    if (!layer_stack_type || !PyObject_TypeCheck(o, layer_stack_type) || !((LayerStack *)o)->stack) {
        ft_py_fail(ft_errors.input_type, "expected an initialised fasttran._C.LayerStack, got %s", Py_TYPE(o)->tp_name);
        return NULL;
    }
    *dev = ((LayerStack *)o)->device;
    return ((LayerStack *)o)->stack;
}

static int ready(LayerStack *self) {
    if (!self->stack) { ft_py_fail(ft_errors.base, "LayerStack is not initialised"); return 0; }
    return 1;
}

/* tensors() -> [(name, shape, offset)], total floats */
static PyObject *LayerStack_tensors(LayerStack *self, PyObject *unused) {
    (void)unused;
    if (!ready(self)) return NULL;
    const size_t n = ft_layer_stack_num_tensors(self->stack);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        const char *name;
        int ndim;
        int64_t shape[2];
        size_t off;
        ft_layer_stack_tensor_info(self->stack, i, &name, &ndim, shape, &off);
        PyObject *t = ndim == 2 ? Py_BuildValue("(s(LL)n)", name, (long long)shape[0], (long long)shape[1], (Py_ssize_t)off)
                                : Py_BuildValue("(s(L)n)", name, (long long)shape[0], (Py_ssize_t)off);
        if (!t) { Py_CLEAR(list); break; }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    if (!list) return NULL;
    return Py_BuildValue("(Nn)", list, (Py_ssize_t)ft_layer_stack_param_count(self->stack));
}

/* params / grads: flat float32 Tensors over the stack's memory (they keep the stack alive) */
static PyObject *LayerStack_flat(LayerStack *self, void *grads) {
    if (!ready(self)) return NULL;
    return ft_py_flat_tensor((PyObject *)self, grads ? ft_layer_stack_grads(self->stack) : ft_layer_stack_params(self->stack),
                             (int64_t)ft_layer_stack_param_count(self->stack), self->device);
}

/* forward(x, lengths, out, training=False, seed=0, step=0): x, out (N, C) packed rows */
static PyObject *LayerStack_forward(LayerStack *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"x", "lengths", "out", "training", "seed", "step", "row_base", "sq_base", "ids", "types",
                             NULL};
    PyObject *xo, *lo, *oo, *ids_o = Py_None, *types_o = Py_None;
    int training = 0;
    unsigned long long seed = 0, step = 0, row_base = 0, sq_base = 0;
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kw, "OOO|pKKKKOO", kwlist, &xo, &lo, &oo, &training, &seed,
                                                     &step, &row_base, &sq_base, &ids_o, &types_o))
        return NULL;
    if (!PyArray_Check(lo) || PyArray_TYPE((PyArrayObject *)lo) != NPY_INT32 || PyArray_NDIM((PyArrayObject *)lo) != 1 ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)lo))
        return ft_py_fail(ft_errors.input_type, "lengths must be a 1-d int32 NumPy array (host memory)");
    const int32_t *lengths = PyArray_DATA((PyArrayObject *)lo);
    const int64_t B = (int64_t)PyArray_SIZE((PyArrayObject *)lo);
    int64_t N = 0;
    for (int64_t b = 0; b < B; b++) N += lengths[b];
    const int64_t C = ft_layer_stack_hidden_size(self->stack);
    const int tokens = ids_o != Py_None;   /* trained embeddings: the rows as token ids (and types), host int32 */
    if (tokens && xo != Py_None) return ft_py_fail(ft_errors.input, "give the rows as x or as token ids, not both");
    const int32_t *ids = NULL, *types = NULL;
    for (int k = 0; tokens && k < 2; k++) {
        PyObject *o = k ? types_o : ids_o;
        if (k && o == Py_None) break;
        if (!PyArray_Check(o) || PyArray_TYPE((PyArrayObject *)o) != NPY_INT32 ||
            !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o) || PyArray_SIZE((PyArrayObject *)o) != N)
            return ft_py_fail(ft_errors.input_type, "%s must be a C-contiguous int32 NumPy array of %lld tokens (host "
                              "memory, one per row)", k ? "types" : "ids", (long long)N);
        *(k ? &types : &ids) = PyArray_DATA((PyArrayObject *)o);
    }
    const float *x = tokens ? NULL : buffer(self, xo, "x", FT_F32, N * C, 0);
    if (!x && !tokens) return NULL;
    float *out = buffer(self, oo, "out", FT_F32, N * C, 0);
    if (!out) return NULL;
    ft_status st = FT_OK;
    Py_BEGIN_ALLOW_THREADS
    if (tokens) st = ft_layer_stack_set_tokens(self->stack, ids, types, N);
    if (st == FT_OK) st = ft_layer_stack_forward(self->stack, x, lengths, B, out, training, seed, step, row_base, sq_base);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

/* backward(dout, dx=None): gradients into grads */
static PyObject *LayerStack_backward(LayerStack *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dout", "dx", "loss_scale", NULL};
    PyObject *dout_o, *dx_o = Py_None;
    float loss_scale = 1.0f;
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kw, "O|Of", kwlist, &dout_o, &dx_o, &loss_scale)) return NULL;
    const float *dout = buffer(self, dout_o, "dout", FT_F32, -1, 0);
    if (!dout) return NULL;
    float *dx = buffer(self, dx_o, "dx", FT_F32, -1, 1);
    if (!dx && PyErr_Occurred()) return NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_layer_stack_backward(self->stack, dout, dx, loss_scale, NULL, NULL);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

/* memory(B, T) -> {"weights", "gradients", "activations": {kind: bytes}, "workspace"} */
/* memory(B, T, *, inplace_gelu=, inplace_layernorm=, recompute_attention_dropout=,
 * recompute_attention_probs=): the report under the stack's options, or with some of them changed */
static PyObject *LayerStack_memory(LayerStack *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"batch", "seq_len", "inplace_gelu", "inplace_layernorm", "recompute_attention_dropout",
                             "recompute_attention_probs", NULL};
    long long B, T;
    int ig = -1, il = -1, rd = -1, rp = -1;   /* -1: as the stack has it */
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kw, "LL|$iiii", kwlist, &B, &T, &ig, &il, &rd, &rp))
        return NULL;
    ft_layer_options opt;
    ft_layer_stack_options(self->stack, &opt);
    if (ig >= 0) opt.inplace_gelu = ig != 0;
    if (il >= 0) opt.inplace_layernorm = il != 0;
    if (rd >= 0) opt.recompute_attention_dropout = rd != 0;
    if (rp >= 0) opt.recompute_attention_probs = rp != 0;
    ft_layer_memory m;
    ft_status st = ft_layer_stack_memory(self->stack, &opt, B, T, &m);
    if (st != FT_OK) return ft_py_raise(st);
    PyObject *acts = PyDict_New();
    for (int k = 0; acts && k < FT_LAYER_ACT_KINDS; k++) {
        PyObject *v = PyLong_FromSize_t(m.activations[k]);
        if (!v || PyDict_SetItemString(acts, ft_layer_act_kind_names[k], v) < 0) { Py_XDECREF(v); Py_CLEAR(acts); break; }
        Py_DECREF(v);
    }
    if (!acts) return NULL;
    return Py_BuildValue("{snsnsNsn}", "weights", (Py_ssize_t)m.weights, "gradients", (Py_ssize_t)m.gradients,
                         "activations", acts, "workspace", (Py_ssize_t)m.workspace);
}

/* allocated() -> (bytes now, peak bytes) */
static PyObject *LayerStack_allocated(LayerStack *self, PyObject *unused) {
    (void)unused;
    if (!ready(self)) return NULL;
    size_t now, peak;
    ft_layer_stack_allocated(self->stack, &now, &peak);
    return Py_BuildValue("(nn)", (Py_ssize_t)now, (Py_ssize_t)peak);
}

/* export(encoder): the trained weights written into that EncoderCore's layers */
static PyObject *LayerStack_export(LayerStack *self, PyObject *enc_o) {
    if (!ready(self)) return NULL;
    ft_encoder *enc = ft_py_encoder_of(enc_o);
    if (!enc) return NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_layer_stack_export(self->stack, enc);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

/* pool(h, pooled, cls=False) / pool_backward(dpooled, dh, cls=False): per sequence of the last
 * forward, h (N, C) -> pooled (B, C) (mean of its rows, or its first row), and back */
static PyObject *pool_common(LayerStack *self, PyObject *args, PyObject *kw, int backward) {
    static char *kwf[] = {"h", "pooled", "cls", NULL}, *kwb[] = {"dpooled", "dh", "cls", NULL};
    PyObject *in_o, *out_o;
    int cls = 0;
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kw, "OO|p", backward ? kwb : kwf, &in_o, &out_o, &cls))
        return NULL;
    int64_t B, N;
    ft_layer_stack_last_batch(self->stack, &B, &N);
    if (B < 1) return ft_py_fail(ft_errors.input, "pooling needs a forward first: it pools that batch's sequences");
    const int64_t C = (int64_t)ft_layer_stack_hidden_size(self->stack);
    const float *in = buffer(self, in_o, backward ? "dpooled" : "h", FT_F32, (backward ? B : N) * C, 0);
    if (!in) return NULL;
    float *out = buffer(self, out_o, backward ? "dh" : "pooled", FT_F32, (backward ? N : B) * C, 0);
    if (!out) return NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = backward ? ft_layer_stack_pool_backward(self->stack, in, cls, out) : ft_layer_stack_pool(self->stack, in, cls, out);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}
static PyObject *LayerStack_pool(LayerStack *self, PyObject *args, PyObject *kw) {
    return pool_common(self, args, kw, 0);
}
static PyObject *LayerStack_pool_backward(LayerStack *self, PyObject *args, PyObject *kw) {
    return pool_common(self, args, kw, 1);
}

/* last_batch() -> (B, N) of the last forward (0, 0 before one) */
static PyObject *LayerStack_last_batch(LayerStack *self, PyObject *unused) {
    (void)unused;
    if (!ready(self)) return NULL;
    int64_t B, N;
    ft_layer_stack_last_batch(self->stack, &B, &N);
    return Py_BuildValue("(LL)", (long long)B, (long long)N);
}

/* set_significance(ffn_group): later backwards record first-order significance (0: stop) */
static PyObject *LayerStack_set_significance(LayerStack *self, PyObject *arg) {
    if (!ready(self)) return NULL;
    const long long g = PyLong_AsLongLong(arg);
    if (g == -1 && PyErr_Occurred()) return NULL;
    ft_status st = ft_layer_stack_set_significance(self->stack, g);
    if (st != FT_OK) return ft_py_raise(st);
    self->sig_group = g;
    Py_RETURN_NONE;
}

/* layer_shapes() -> [(heads, intermediate)] per layer of the stack */
static PyObject *LayerStack_layer_shapes(LayerStack *self, PyObject *unused) {
    (void)unused;
    if (!ready(self)) return NULL;
    const Py_ssize_t count = (Py_ssize_t)ft_layer_stack_count(self->stack);
    PyObject *shapes = PyList_New(count);
    for (Py_ssize_t l = 0; shapes && l < count; l++) {
        int64_t nh, width;
        ft_layer_stack_layer_shape(self->stack, l, &nh, &width);
        PyObject *t = Py_BuildValue("(LL)", (long long)nh, (long long)width);
        if (!t) { Py_CLEAR(shapes); break; }
        PyList_SET_ITEM(shapes, l, t);
    }
    return shapes;
}

/* significance() -> (heads (B, H), ffn (B, G), layers (B, count)) float32, of the last backward */
static PyObject *LayerStack_significance(LayerStack *self, PyObject *unused) {
    (void)unused;
    if (!ready(self)) return NULL;
    if (self->sig_group < 1) return ft_py_fail(ft_errors.input, "significance is not recorded: set_significance(group) first");
    int64_t B, N;
    ft_layer_stack_last_batch(self->stack, &B, &N);
    const int64_t count = ft_layer_stack_count(self->stack);
    int64_t H = 0, G = 0;
    for (int64_t l = 0; l < count; l++) {
        int64_t nh, width;
        ft_layer_stack_layer_shape(self->stack, l, &nh, &width);
        H += nh;
        G += width / self->sig_group;
    }
    npy_intp dh[2] = {(npy_intp)B, (npy_intp)H}, dg[2] = {(npy_intp)B, (npy_intp)G}, dl[2] = {(npy_intp)B, (npy_intp)count};
    PyObject *h = PyArray_SimpleNew(2, dh, NPY_FLOAT32), *g = PyArray_SimpleNew(2, dg, NPY_FLOAT32),
             *l = PyArray_SimpleNew(2, dl, NPY_FLOAT32);
    if (!h || !g || !l) { Py_XDECREF(h); Py_XDECREF(g); Py_XDECREF(l); return NULL; }
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_layer_stack_significance(self->stack, PyArray_DATA((PyArrayObject *)h), PyArray_DATA((PyArrayObject *)g),
                                     PyArray_DATA((PyArrayObject *)l));
    Py_END_ALLOW_THREADS
    if (st != FT_OK) { Py_DECREF(h); Py_DECREF(g); Py_DECREF(l); return ft_py_raise(st); }
    return Py_BuildValue("(NNN)", h, g, l);
}

static PyMethodDef LayerStack_methods[] = {
    {"set_significance", (PyCFunction)LayerStack_set_significance, METH_O,
     "set_significance(ffn_group): later backwards record each head's, FFN group's and layer's gradient x "
     "activation per sequence (0: stop)."},
    {"significance", (PyCFunction)LayerStack_significance, METH_NOARGS,
     "significance() -> (heads (B, H), ffn (B, G), layers (B, count)) of the last backward."},
    {"layer_shapes", (PyCFunction)LayerStack_layer_shapes, METH_NOARGS, "[(heads, intermediate)] per layer."},
    {"last_batch", (PyCFunction)LayerStack_last_batch, METH_NOARGS, "(sequences, rows) of the last forward."},
    {"pool", (PyCFunction)(void (*)(void))LayerStack_pool, METH_VARARGS | METH_KEYWORDS,
     "pool(h, pooled, cls=False): pooled (B, C) = mean (or first) rows of each sequence of the last forward."},
    {"pool_backward", (PyCFunction)(void (*)(void))LayerStack_pool_backward, METH_VARARGS | METH_KEYWORDS,
     "pool_backward(dpooled, dh, cls=False): the pooling's backward into dh (N, C)."},
    {"tensors", (PyCFunction)LayerStack_tensors, METH_NOARGS, "[(name, shape, offset)], total floats."},
    {"forward", (PyCFunction)(void (*)(void))LayerStack_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(x, lengths, out, training=False, seed=0, step=0, row_base=0, sq_base=0, ids=None, types=None) over "
     "packed rows: x (N, C), or (train_embeddings) x None and the rows' token ids and types (host int32, N each)."},
    {"backward", (PyCFunction)(void (*)(void))LayerStack_backward, METH_VARARGS | METH_KEYWORDS,
     "backward(dout, dx=None, loss_scale=1.0): gradients of the last training forward into grads (loss_scale: "
     "the backward runs on dout * loss_scale and the gradients are scaled back)."},
    {"memory", (PyCFunction)(void (*)(void))LayerStack_memory, METH_VARARGS | METH_KEYWORDS,
     "memory(B, T, *, inplace_gelu=, inplace_layernorm=, recompute_attention_dropout=, recompute_attention_probs=): "
     "bytes a training step over (B, T) holds, by category, under the stack's options or with some changed."},
    {"allocated", (PyCFunction)LayerStack_allocated, METH_NOARGS, "(bytes allocated now, peak)."},
    {"export", (PyCFunction)LayerStack_export, METH_O, "Write the trained weights into an EncoderCore."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef LayerStack_getset[] = {
    {"params", (getter)LayerStack_flat, NULL, "the layers' parameters, one flat float32 Tensor", NULL},
    {"grads", (getter)LayerStack_flat, NULL, "their gradients, one flat float32 Tensor", (void *)1},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot LayerStack_slots[] = {
    {Py_tp_dealloc, LayerStack_dealloc}, {Py_tp_init, LayerStack_init}, {Py_tp_new, PyType_GenericNew},
    {Py_tp_methods, LayerStack_methods}, {Py_tp_getset, LayerStack_getset},
    {Py_tp_doc, "LayerStack(encoder, first, count, device_index=-1, hidden_dropout=0, attention_dropout=0, "
                "inplace_gelu=False, inplace_layernorm=False, recompute_attention_dropout=True, matmul_precision=0 (ft_dtype), "
                "recompute_attention_probs=False, extra=0 (floats after the layers in params/grads: a task head's room), "
                "shared_grads=False (the gradients in shared memory: a data-parallel rank's), "
                "input_dropout=0 (dropout on the stack's input in training: at layer 0, the embeddings'), "
                "train_embeddings=False (first 0: the embeddings trained too, the input token ids))"},
    {0, NULL}};

static PyType_Spec LayerStack_spec = {"fasttran._C.LayerStack", sizeof(LayerStack), 0, Py_TPFLAGS_DEFAULT,
                                      LayerStack_slots};

int ft_py_add_layer_type(PyObject *m) {
    PyObject *tp = PyType_FromModuleAndSpec(m, &LayerStack_spec, NULL);
    if (!tp) return -1;
    layer_stack_type = (PyTypeObject *)tp;
    int r = PyModule_AddObjectRef(m, "LayerStack", tp);
    Py_DECREF(tp);
    return r;
}
