/* Module functions behind fasttran.heads (and device memory for fasttran.optim): head parameter
 * tables, and a head forward/backward. Buffers are NumPy arrays
 * (host) or fasttran.Tensor (any device, e.g. imported in place from torch through DLPack); all
 * buffers of one call must be on one device. Checks happen here; the work runs in C with the
 * GIL released. */
#include "binding.h"

typedef struct {
    void *data;
    int64_t numel;
    ft_device device;
} ft_py_buf;

static const ft_device cpu_device = {FT_DEVICE_CPU, 0};

/* A contiguous buffer of `dtype` from an ndarray or a fasttran.Tensor; None allowed when
 * `optional`. Returns 1 (buf->data NULL for None) or 0 with an exception set. */
static int get_buf(PyObject *o, const char *what, Py_ssize_t index, ft_dtype dtype, int writeable, int optional,
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
    int kind;
    long long hidden, labels;
    float dropout;
    if (!PyArg_ParseTuple(args_tuple, "iLLf", &kind, &hidden, &labels, &dropout)) return 0;
    *cfg = (ft_head_config){(ft_head_kind)kind, hidden, labels, dropout};
    ft_status st = ft_head_check(cfg);
    if (st != FT_OK) { ft_py_raise(st); return 0; }
    return 1;
}

/* head_tensors((kind, hidden, num_labels, dropout)) -> ([(name, shape, offset)], total) */
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

/* head_step(config, params, x, B, T, valid|None, labels|None, logits, grads|None, dx|None,
 *           training, seed, step, workspace=None, labels_checked=False) -> mean loss or None.
 *           workspace: float32 memory of the buffers' device with room for head_workspace(...)
 *           floats, kept across steps (None: the call allocates its own). labels_checked: the
 *           caller checked every label already (ft_head_forward_backward_ws's check = 0). */
static PyObject *py_head_step(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cfg_o, *po, *xo, *vo, *lo, *zo, *go, *dxo, *wso = Py_None;
    long long B, T;
    int training, checked = 0;
    unsigned long long seed, step;
    if (!PyArg_ParseTuple(args, "OOOLLOOOOOpKK|Op", &cfg_o, &po, &xo, &B, &T, &vo, &lo, &zo, &go, &dxo, &training, &seed,
                          &step, &wso, &checked))
        return NULL;
    ft_head_config cfg;
    if (!parse_head(cfg_o, &cfg)) return NULL;
    const int qa = cfg.kind == FT_HEAD_QA;
    if (B < 1 || T < 1 || (!qa && T != 1)) return ft_py_fail(ft_errors.input, "head_step: bad batch shape (%lld, %lld)", B, T);
    ft_py_buf p, x, v, l, z, g, dx, ws;
    if (!get_buf(po, "params", -1, FT_F32, 0, 0, &p) || !get_buf(xo, "x", -1, FT_F32, 0, 0, &x) ||
        !get_buf(vo, "valid", -1, FT_F32, 0, !qa, &v) || !get_buf(lo, "labels", -1, FT_I32, 0, 1, &l) ||
        !get_buf(zo, "logits", -1, FT_F32, 1, 0, &z) || !get_buf(go, "grads", -1, FT_F32, 1, 1, &g) ||
        !get_buf(dxo, "dx", -1, FT_F32, 1, 1, &dx) || !get_buf(wso, "workspace", -1, FT_F32, 1, 1, &ws))
        return NULL;
    const int64_t C = cfg.hidden, K = cfg.num_labels, np_ = (int64_t)ft_head_param_count(&cfg);
    struct { ft_py_buf *b; const char *what; int64_t need; } want[] = {
        {&p, "params", np_}, {&x, "x", B * T * C}, {&v, "valid", qa ? B * T : 0}, {&l, "labels", qa ? 2 * B : B},
        {&z, "logits", qa ? 2 * B * T : B * K}, {&g, "grads", np_}, {&dx, "dx", B * T * C}};
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
        const size_t need = ft_head_workspace_floats(&cfg, B, T, l.data != NULL, g.data != NULL, dx.data != NULL, training);
        if ((size_t)ws.numel < need)
            return ft_py_fail(ft_errors.input, "workspace has %lld floats, this step needs %zu", (long long)ws.numel, need);
    }
    double loss = 0.0;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_head_forward_backward_ws(dev, &cfg, p.data, x.data, B, T, v.data, l.data, z.data, l.data ? &loss : NULL,
                                     g.data, dx.data, training, seed, step, ws.data, (size_t)ws.numel, !checked);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    if (!l.data) Py_RETURN_NONE;
    return PyFloat_FromDouble(loss);
}

/* head_workspace(config, B, T, has_labels, has_grads, has_dx, training) -> floats head_step's
 * workspace needs */
static PyObject *py_head_workspace(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cfg_o;
    long long B, T;
    int lab, gr, dx, training;
    if (!PyArg_ParseTuple(args, "OLLpppp", &cfg_o, &B, &T, &lab, &gr, &dx, &training)) return NULL;
    ft_head_config cfg;
    if (!parse_head(cfg_o, &cfg)) return NULL;
    if (B < 1 || T < 1) return ft_py_fail(ft_errors.input, "head_workspace: bad batch shape (%lld, %lld)", B, T);
    return PyLong_FromSize_t(ft_head_workspace_floats(&cfg, B, T, lab, gr, dx, training));
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
    if (!get_buf(to, "destination", -1, dt, 1, 0, &dst) || !get_buf(ao, "source", -1, dt, 0, 0, &src)) return NULL;
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
    {"head_step", py_head_step, METH_VARARGS, "Head forward (+ loss and backward with labels)."},
    {"head_workspace", py_head_workspace, METH_VARARGS, "Floats of head_step's workspace for a shape and buffers."},
    {NULL, NULL, 0, NULL}};

int ft_py_add_train_functions(PyObject *m) { return PyModule_AddFunctions(m, train_methods); }
