/* Module functions behind fasttran.heads (and device memory for fasttran.optim): head parameter
 * tables, and a head forward/backward. Buffers are NumPy arrays
 * (host) or fasttran.Tensor (any device, e.g. imported in place from torch through DLPack); all
 * buffers of one call must be on one device. Checks happen here; the work runs in C with the
 * GIL released. */
#include "binding.h"

static const ft_device cpu_device = {FT_DEVICE_CPU, 0};

int ft_py_get_buf(PyObject *o, const char *what, Py_ssize_t index, ft_dtype dtype, int writeable, int optional,
                  ft_py_buf *buf) {
    char name[96];
    if (index >= 0) PyOS_snprintf(name, sizeof name, "%s[%zd]", what, index);
    else PyOS_snprintf(name, sizeof name, "%s", what);
    buf->data = NULL;
    buf->numel = 0;
    buf->device = cpu_device;
    if (o == Py_None && optional) return 1;
    if (PyArray_Check(o)) {
        PyArrayObject *a = (PyArrayObject *)o;
        /* bfloat16 has no NumPy dtype: its bits travel as uint16 */
        int npy = dtype == FT_F32 ? NPY_FLOAT32 : dtype == FT_I32 ? NPY_INT32 : dtype == FT_F16 ? NPY_FLOAT16 : NPY_UINT16;
        if (PyArray_TYPE(a) != npy) {
            ft_py_fail(ft_errors.input_type, "%s must be %s, got %S", name, ft_dtype_name(dtype), PyArray_DESCR(a));
            return 0;
        }
        if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a)) {
            ft_py_fail(ft_errors.input_type, "%s must be C-contiguous and aligned", name);
            return 0;
        }
        if (writeable && !PyArray_ISWRITEABLE(a)) {
            ft_py_fail(ft_errors.input_type, "%s must be writeable (it is updated in place)", name);
            return 0;
        }
        buf->data = PyArray_DATA(a);
        buf->numel = (int64_t)PyArray_SIZE(a);
        return 1;
    }
    if (ft_py_tensor_check(o)) {
        int ndim;
        const int64_t *shape, *strides;
        ft_dtype dt;
        buf->data = ft_py_tensor_data(o, &ndim, &shape, &strides, &dt, &buf->device);
        if (dt != dtype) {
            ft_py_fail(ft_errors.input_type, "%s must be %s, got %s", name, ft_dtype_name(dtype), ft_dtype_name(dt));
            return 0;
        }
        int64_t expect = 1, n = 1;
        for (int d = ndim - 1; d >= 0; d--) {
            if (strides && shape[d] > 1 && strides[d] != expect) {
                ft_py_fail(ft_errors.input_type, "%s must be contiguous (row-major, no gaps)", name);
                return 0;
            }
            expect *= shape[d];
            n *= shape[d];
        }
        buf->numel = n;
        return 1;
    }
    ft_py_fail(ft_errors.input_type, "%s must be a NumPy array or a fasttran.Tensor, got %s", name,
               Py_TYPE(o)->tp_name);
    return 0;
}

static int same_device(ft_device *have, int *set, ft_device d, const char *what) {
    if (!*set) { *have = d; *set = 1; return 1; }
    if (have->kind != d.kind || have->index != d.index) {
        ft_py_fail(ft_errors.input, "%s is on %s:%d but the other buffers are on %s:%d", what,
                   d.kind == FT_DEVICE_CUDA ? "cuda" : "cpu", d.index, have->kind == FT_DEVICE_CUDA ? "cuda" : "cpu",
                   have->index);
        return 0;
    }
    return 1;
}

static int parse_head(PyObject *args_tuple, ft_head_config *cfg) {
    int kind, loss = FT_LOSS_XENT, pooling = FT_POOL_MEAN, act = FT_HEAD_ACT_TANH, no_bias = 0, norm = FT_HEAD_NORM_NONE;
    int dense = 0, dense_input_dropout = 0;
    long long hidden, labels;
    float dropout, norm_eps = 0.0f;
    if (!PyTuple_Check(args_tuple)) {
        ft_py_fail(ft_errors.input_type, "a head configuration is a tuple (kind, hidden, num_labels, dropout[, loss, "
                   "pooling, act, no_dense_bias, norm, norm_eps, dense, dense_input_dropout])");
        return 0;
    }
    if (!PyArg_ParseTuple(args_tuple, "iLLf|iiiiifii", &kind, &hidden, &labels, &dropout, &loss, &pooling, &act,
                          &no_bias, &norm, &norm_eps, &dense, &dense_input_dropout))
        return 0;
    *cfg = (ft_head_config){(ft_head_kind)kind, hidden, labels, dropout, (ft_head_loss)loss, (ft_pooling)pooling,
                            (ft_head_act)act, no_bias, (ft_head_norm)norm, norm_eps, dense, dense_input_dropout};
    ft_status st = ft_head_check(cfg);
    if (st != FT_OK) { ft_py_raise(st); return 0; }
    return 1;
}

int ft_py_parse_head(PyObject *config, ft_head_config *cfg) { return parse_head(config, cfg); }

/* head_tensors((kind, hidden, num_labels, dropout[, loss, pooling, act, no_dense_bias, norm, norm_eps, dense,
 * dense_input_dropout])) -> ([(name, shape, offset)], total) */
static PyObject *py_head_tensors(PyObject *self, PyObject *arg) {
    (void)self;
    ft_head_config cfg;
    if (!parse_head(arg, &cfg)) return NULL;
    size_t n = ft_head_num_tensors(&cfg);
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (!list) return NULL;
    for (size_t i = 0; i < n; i++) {
        const char *name;
        int ndim;
        int64_t shape[2];
        size_t off;
        ft_status st = ft_head_tensor_info(&cfg, i, &name, &ndim, shape, &off);
        if (st != FT_OK) { Py_DECREF(list); return ft_py_raise(st); }
        PyObject *shp = ndim == 2 ? Py_BuildValue("(LL)", (long long)shape[0], (long long)shape[1])
                                  : Py_BuildValue("(L)", (long long)shape[0]);
        PyObject *item = shp ? Py_BuildValue("(sNn)", name, shp, (Py_ssize_t)off) : NULL;
        if (!item) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    return Py_BuildValue("(Nn)", list, (Py_ssize_t)ft_head_param_count(&cfg));
}

/* head_counts(config, B, N) -> (logits, loss terms, targets, float_targets): element counts of a
 * batch of B sequences and N rows */
static PyObject *py_head_counts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cfg_o;
    long long B, N;
    if (!PyArg_ParseTuple(args, "OLL", &cfg_o, &B, &N)) return NULL;
    ft_head_config cfg;
    if (!parse_head(cfg_o, &cfg)) return NULL;
    return Py_BuildValue("(LLLO)", (long long)ft_head_logits_count(&cfg, B, N), (long long)ft_head_loss_count(&cfg, B, N),
                         (long long)ft_head_target_count(&cfg, B, N),
                         ft_head_float_targets(&cfg) ? Py_True : Py_False);
}

/* a temporary buffer on `dev` (host memory for the CPU), freed by release_tmp */
static ft_status tmp_alloc(ft_device dev, size_t bytes, void **out) { return ft_device_alloc(dev, bytes ? bytes : 4, out); }

/* head_step(config, params, x, lengths, targets|None, valid|None, logits, grads|None, dx|None, training, seed, step,
 *           scale=0, workspace=None, check=True) -> mean loss (the loss terms' sum times scale; 0: 1 / their
 *           count) or None without targets.
 *   x (N, C) packed rows: len(lengths) sequences of lengths[b] rows (host int32); buffers as above, on one device;
 *   targets int32 or float32 (the head's kind), valid (N) float32 (QA). */
static PyObject *py_head_step(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"config", "params", "x", "lengths", "targets", "valid", "logits", "grads", "dx", "training",
                             "seed", "step", "scale", "workspace", "check", NULL};
    PyObject *cfg_o, *po, *xo, *lo, *to, *vo, *zo, *go, *dxo, *wso = Py_None;
    int training, check = 1;
    unsigned long long seed, step;
    double scale = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOpKK|dOp", kwlist, &cfg_o, &po, &xo, &lo, &to, &vo, &zo, &go,
                                     &dxo, &training, &seed, &step, &scale, &wso, &check))
        return NULL;
    ft_head_config cfg;
    if (!parse_head(cfg_o, &cfg)) return NULL;
    const int mask = (ft_head_needs(&cfg) & FT_HEAD_NEEDS_MASK) != 0;
    if (!PyArray_Check(lo) || PyArray_TYPE((PyArrayObject *)lo) != NPY_INT32 || PyArray_NDIM((PyArrayObject *)lo) != 1 ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)lo) || PyArray_SIZE((PyArrayObject *)lo) < 1)
        return ft_py_fail(ft_errors.input_type, "lengths must be a non-empty 1-d int32 NumPy array (host memory)");
    const int32_t *lengths = PyArray_DATA((PyArrayObject *)lo);
    const int64_t B = (int64_t)PyArray_SIZE((PyArrayObject *)lo);
    int64_t N = 0;
    for (int64_t b = 0; b < B; b++) {
        if (lengths[b] < 1) return ft_py_fail(ft_errors.input, "sequence %lld has %d rows; each needs at least one",
                                              (long long)b, lengths[b]);
        N += lengths[b];
    }
    const ft_dtype tdt = ft_head_float_targets(&cfg) ? FT_F32 : FT_I32;
    ft_py_buf p, x, t, v, z, g, dx, ws;
    if (!ft_py_get_buf(po, "params", -1, FT_F32, 0, 0, &p) || !ft_py_get_buf(xo, "x", -1, FT_F32, 0, 0, &x) ||
        !ft_py_get_buf(to, "targets", -1, tdt, 0, 1, &t) || !ft_py_get_buf(vo, "valid", -1, FT_F32, 0, !mask, &v) ||
        !ft_py_get_buf(zo, "logits", -1, FT_F32, 1, 0, &z) || !ft_py_get_buf(go, "grads", -1, FT_F32, 1, 1, &g) ||
        !ft_py_get_buf(dxo, "dx", -1, FT_F32, 1, 1, &dx) || !ft_py_get_buf(wso, "workspace", -1, FT_F32, 1, 1, &ws))
        return NULL;
    const int64_t C = cfg.hidden, np_ = (int64_t)ft_head_param_count(&cfg);
    const int64_t nloss = ft_head_loss_count(&cfg, B, N);
    struct { ft_py_buf *b; const char *what; int64_t need; } want[] = {
        {&p, "params", np_}, {&x, "x", N * C}, {&t, "targets", ft_head_target_count(&cfg, B, N)},
        {&v, "valid", mask ? N : 0}, {&z, "logits", ft_head_logits_count(&cfg, B, N)}, {&g, "grads", np_},
        {&dx, "dx", N * C}};
    ft_device dev = cpu_device;
    int dev_set = 0;
    for (size_t k = 0; k < sizeof want / sizeof *want; k++) {
        if (!want[k].b->data) continue;
        if (want[k].b->numel != want[k].need)
            return ft_py_fail(ft_errors.input, "%s has %lld elements, expected %lld", want[k].what,
                              (long long)want[k].b->numel, (long long)want[k].need);
        if (!same_device(&dev, &dev_set, want[k].b->device, want[k].what)) return NULL;
    }
    if (ws.data) {
        if (!same_device(&dev, &dev_set, ws.device, "workspace")) return NULL;
        const size_t need = ft_head_workspace_floats(&cfg, B, N, g.data != NULL, dx.data != NULL, training);
        if ((size_t)ws.numel < need)
            return ft_py_fail(ft_errors.input, "workspace has %lld floats, this step needs %zu", (long long)ws.numel, need);
    }
    if (scale == 0.0) scale = 1.0 / (double)nloss;
    int32_t *seqs = malloc((size_t)(2 * B) * sizeof *seqs);
    float *loss_host = malloc((size_t)nloss * sizeof *loss_host);
    if (!seqs || !loss_host) {
        free(seqs);
        free(loss_host);
        return PyErr_NoMemory();
    }
    for (int64_t b = 0, f = 0; b < B; f += lengths[b], b++) {
        seqs[b] = (int32_t)f;
        seqs[B + b] = lengths[b];
    }
    void *seqs_dev = NULL, *loss_dev = NULL;
    double sum = 0.0;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = tmp_alloc(dev, (size_t)(2 * B) * sizeof(int32_t), &seqs_dev);
    if (st == FT_OK) st = ft_device_write(dev, seqs_dev, seqs, (size_t)(2 * B) * sizeof(int32_t));
    if (st == FT_OK && t.data) st = tmp_alloc(dev, (size_t)nloss * sizeof(float), &loss_dev);
    const ft_head_batch hb = {B, N, seqs, seqs_dev, 0, 0};
    if (st == FT_OK)
        st = ft_head_step(dev, &cfg, p.data, x.data, &hb, t.data, v.data, z.data, loss_dev, g.data, dx.data,
                          (float)scale, training, seed, step, ws.data, (size_t)ws.numel, check);
    if (st == FT_OK && loss_dev) st = ft_device_read(dev, loss_host, loss_dev, (size_t)nloss * sizeof(float));
    for (int64_t i = 0; st == FT_OK && loss_dev && i < nloss; i++) sum += loss_host[i];
    ft_device_free(dev, seqs_dev);
    ft_device_free(dev, loss_dev);
    Py_END_ALLOW_THREADS
    free(seqs);
    free(loss_host);
    if (st != FT_OK) return ft_py_raise(st);
    if (!t.data) Py_RETURN_NONE;
    return PyFloat_FromDouble(sum * scale);
}

/* head_workspace(config, B, N, has_grads, has_dx, training) -> floats head_step's workspace needs */
static PyObject *py_head_workspace(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cfg_o;
    long long B, N;
    int gr, dx, training;
    if (!PyArg_ParseTuple(args, "OLLppp", &cfg_o, &B, &N, &gr, &dx, &training)) return NULL;
    ft_head_config cfg;
    if (!parse_head(cfg_o, &cfg)) return NULL;
    if (B < 1 || N < B) return ft_py_fail(ft_errors.input, "head_workspace: bad batch shape (%lld, %lld)", B, N);
    return PyLong_FromSize_t(ft_head_workspace_floats(&cfg, B, N, gr, dx, training));
}

static void release_device(PyObject *owner, void *ctx, void *data) {
    (void)owner;
    ft_device dev = {FT_DEVICE_CUDA, (int)(intptr_t)ctx};
    ft_device_free(dev, data);
}

/* device_zeros(n, device_index, int32=False) -> fasttran.Tensor of n float32 (or int32) zeros in that
 * CUDA device's memory (optimizer state, head buffers of CUDA training) */
static PyObject *py_device_zeros(PyObject *self, PyObject *args) {
    (void)self;
    long long n;
    int index, i32 = 0;
    if (!PyArg_ParseTuple(args, "Li|p", &n, &index, &i32)) return NULL;
    if (n < 0) return ft_py_fail(ft_errors.input, "device_zeros: negative size %lld", n);
    ft_device dev = {FT_DEVICE_CUDA, index};
    size_t bytes = (size_t)(n ? n : 1) * sizeof(float);
    void *host = calloc(1, bytes), *p = NULL;
    if (!host) return PyErr_NoMemory();
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_device_alloc(dev, bytes, &p);
    if (st == FT_OK) st = ft_device_write(dev, p, host, bytes);
    Py_END_ALLOW_THREADS
    free(host);
    if (st != FT_OK) {
        ft_device_free(dev, p);
        return ft_py_raise(st);
    }
    int64_t shape[1] = {n};
    return ft_py_tensor_new(p, 1, shape, NULL, i32 ? FT_I32 : FT_F32, dev, 0, NULL, release_device,
                            (void *)(intptr_t)index);
}

/* device_write(tensor, ndarray): copy a float32 (or int32) host array into a device Tensor of the
 * same dtype and size */
static PyObject *py_device_write(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *to, *ao;
    if (!PyArg_ParseTuple(args, "OO", &to, &ao)) return NULL;
    if (!PyArray_Check(ao)) return ft_py_fail(ft_errors.input_type, "device_write: the source must be a NumPy array");
    const ft_dtype dt = PyArray_TYPE((PyArrayObject *)ao) == NPY_INT32 ? FT_I32 : FT_F32;
    ft_py_buf dst, src;
    if (!ft_py_get_buf(to, "destination", -1, dt, 1, 0, &dst) || !ft_py_get_buf(ao, "source", -1, dt, 0, 0, &src)) return NULL;
    if (dst.numel != src.numel)
        return ft_py_fail(ft_errors.input, "device_write: %lld elements into %lld", (long long)src.numel, (long long)dst.numel);
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_device_write(dst.device, dst.data, src.data, (size_t)src.numel * 4);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

static PyMethodDef train_methods[] = {
    {"device_write", py_device_write, METH_VARARGS, "Copy a float32 host array into a device Tensor."},
    {"device_zeros", py_device_zeros, METH_VARARGS, "n float32 zeros in CUDA device memory, as a Tensor."},
    {"head_tensors", py_head_tensors, METH_O, "Parameter table of a head: [(name, shape, offset)], total."},
    {"head_step", (PyCFunction)(void (*)(void))py_head_step, METH_VARARGS | METH_KEYWORDS,
     "Head forward (+ loss and backward with targets) over packed rows."},
    {"head_counts", py_head_counts, METH_VARARGS, "(logits, loss terms, targets, float targets) of a batch."},
    {"head_workspace", py_head_workspace, METH_VARARGS, "Floats of head_step's workspace for a shape and buffers."},
    {NULL, NULL, 0, NULL}};

/* HEAD_KINDS {name: (code, needs: FT_HEAD_NEEDS_* as {"rows": bool, "mask": bool})}, from FT_HEAD_KINDS */
static int add_head_kinds(PyObject *m) {
    PyObject *d = PyDict_New();
    if (!d) return -1;
    for (int k = 0; k < FT_HEAD_KIND_END_; k++) {
        const char *name = ft_head_kind_name(k);
        if (!name) continue;
        const ft_head_config probe = {.kind = (ft_head_kind)k};
        const unsigned needs = ft_head_needs(&probe);
        PyObject *v = Py_BuildValue("(i{sOsO})", k, "rows", (needs & FT_HEAD_NEEDS_ROWS) ? Py_True : Py_False, "mask",
                                    (needs & FT_HEAD_NEEDS_MASK) ? Py_True : Py_False);
        if (!v || PyDict_SetItemString(d, name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    int r = PyModule_AddObjectRef(m, "HEAD_KINDS", d);
    Py_DECREF(d);
    if (r < 0) return r;
    /* HEAD_ACTS {name: code} of a head's dense layer, from FT_HEAD_ACTS */
    PyObject *acts = PyDict_New();
    if (!acts) return -1;
    for (int k = 0; k < FT_HEAD_ACT_END_; k++) {
        PyObject *v = PyLong_FromLong(k);
        if (!v || PyDict_SetItemString(acts, ft_head_act_name(k), v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(acts);
            return -1;
        }
        Py_DECREF(v);
    }
    r = PyModule_AddObjectRef(m, "HEAD_ACTS", acts);
    Py_DECREF(acts);
    return r;
}

int ft_py_add_train_functions(PyObject *m) {
    return PyModule_AddFunctions(m, train_methods) < 0 ? -1 : add_head_kinds(m);
}
