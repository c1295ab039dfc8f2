/* fasttran._C.OptimizerTable: the tensor table of a fused optimizer (ft_optim_table), built once
 * per parameter set, then stepped with per-step checks only for what can change between steps:
 *   - the parameter groups: same parameter objects in the same order (else step() returns None
 *     and the caller rebuilds), and their hyper-parameters (lr, betas, eps, weight_decay,
 *     bias_correction; optional lr_scale: the step's lr is lr x lr_scale), read from the group
 *     dicts each step (learning-rate schedulers write them);
 *   - each gradient: present or not (a tensor without one sits the step out), its address (torch
 *     makes a new .grad after zero_grad(set_to_none=True)), dtype, device, shape, layout;
 *   - each parameter read through DLPack's exchange API: its address (p.data = ... swaps it).
 * Nothing is converted or allocated per step on the fast paths:
 *   - NumPy arrays and fasttran.Tensor: their fields;
 *   - objects whose type exposes DLPack's C exchange API (`__dlpack_c_exchange_api__`, e.g.
 *     torch.Tensor): dltensor_from_py_object_no_sync fills a DLTensor view on the stack;
 *   - any other DLPack producer goes through Tensor.from_dlpack (a capsule per tensor and step:
 *     correct, not fast).
 * For CUDA tensors read through the exchange API, one DLPack handshake per step asks the
 * producer to make its work visible to the backend's stream (what from_dlpack did per tensor). */
#include <math.h>
#include <time.h>

#include "binding.h"
#include "dlpack_abi.h"

#define OPT_MAXDIM 8

typedef struct {
    int ndim;
    int64_t shape[OPT_MAXDIM];
} opt_shape;

typedef struct {
    PyObject_HEAD
    ft_optim_table *table;
    int kind;
    Py_ssize_t count, num_groups;
    PyObject *params;          /* tuple: the parameter objects, in table order */
    PyObject *names;           /* tuple of str (messages) */
    PyObject **held;           /* (count) Tensor imported through __dlpack__ for a slow-path parameter, or NULL */
    PyObject **grad_refs;      /* (count) references kept during a step */
    Py_ssize_t *group_size;    /* (num_groups) */
    ft_optim_group *groups;    /* (num_groups) */
    opt_shape *shapes;         /* (count) */
    uint8_t *reread;           /* (count) 1: the parameter's address is re-read each step */
    int64_t kernel_ns[2];      /* the last ft_optim_table_step: wall and calling-thread CPU time */
    ft_optim_info info;        /* of the last step */
    Py_ssize_t active;         /* tensors the last step updated */
} OptTableObject;

static int64_t clock_ns(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static PyTypeObject *opt_table_type;   /* Model.train_steps checks its argument against it */
static PyObject *s_params, *s_lr, *s_lr_scale, *s_betas, *s_eps, *s_weight_decay, *s_bias_correction, *s_grad;

/* ---- reading tensors in place ----------------------------------------------------------------- */

typedef struct {
    void *data;
    opt_shape shape;
    int f32, contiguous, writeable, device_ok;
    ft_device device;
    const FTDLPackExchangeAPI *api;   /* read through the exchange API */
} tview;

/* the exchange API of a type (NULL: none), cached per type */
#define API_CACHE 16
static struct { PyTypeObject *type; const FTDLPackExchangeAPI *api; } api_cache[API_CACHE];
static int api_cached;

static const FTDLPackExchangeAPI *exchange_api(PyTypeObject *tp) {
    for (int i = 0; i < api_cached; i++)
        if (api_cache[i].type == tp) return api_cache[i].api;
    const FTDLPackExchangeAPI *api = NULL;
    PyObject *cap = PyObject_GetAttrString((PyObject *)tp, "__dlpack_c_exchange_api__");
    if (cap && PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
        /* the table lives as long as the process (DLPack's rule); walk to a major version 1 */
        const FTDLPackExchangeAPIHeader *h = PyCapsule_GetPointer(cap, "dlpack_exchange_api");
        while (h && h->version.major != 1) h = h->prev_api;
        if (h && ((const FTDLPackExchangeAPI *)h)->dltensor_from_py_object_no_sync) api = (const FTDLPackExchangeAPI *)h;
    }
    Py_XDECREF(cap);
    PyErr_Clear();
    if (api_cached < API_CACHE) {
        Py_INCREF(tp);
        api_cache[api_cached].type = tp;
        api_cache[api_cached].api = api;
        api_cached++;
    }
    return api;
}

static int contiguous(int ndim, const int64_t *shape, const int64_t *strides) {
    if (!strides) return 1;
    int64_t want = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        if (shape[d] != 1 && strides[d] != want) return 0;
        want *= shape[d];
    }
    return 1;
}

static PyObject *describe(PyObject *o, const char *attr) {
    PyObject *a = PyObject_GetAttrString(o, attr);
    if (!a) { PyErr_Clear(); return PyUnicode_FromString("?"); }
    PyObject *s = PyObject_Str(a);
    Py_DECREF(a);
    if (!s) { PyErr_Clear(); return PyUnicode_FromString("?"); }
    return s;
}

static PyObject *shape_str(const opt_shape *s) {
    char buf[256];
    size_t n = (size_t)snprintf(buf, sizeof buf, "(");
    for (int d = 0; d < s->ndim && n < 200; d++)
        n += (size_t)snprintf(buf + n, sizeof buf - n, "%s%lld", d ? ", " : "", (long long)s->shape[d]);
    snprintf(buf + n, sizeof buf - n, s->ndim == 1 ? ",)" : ")");
    return PyUnicode_FromString(buf);
}

static const char *device_str(ft_device d, char *buf, size_t n) {
    if (d.kind == FT_DEVICE_CPU) snprintf(buf, n, "cpu");
    else snprintf(buf, n, "cuda:%d", d.index);
    return buf;
}

/* A Tensor over a producer without the exchange API (the backend's stream for CUDA data). */
static PyObject *import_slow(PyObject *o) {
    PyObject *stream = Py_None, *dev = PyObject_CallMethod(o, "__dlpack_device__", NULL);
    int type = kDLCPU, id = 0;
    if (dev) {
        if (!PyArg_ParseTuple(dev, "i|i", &type, &id)) PyErr_Clear();
        Py_DECREF(dev);
    } else {
        PyErr_Clear();
    }
    PyObject *owned = NULL;
    if (type == kDLCUDA) {
        uintptr_t s = 0;
        ft_status st = ft_device_stream((ft_device){FT_DEVICE_CUDA, id}, &s);
        if (st != FT_OK) return ft_py_raise(st);
        stream = owned = PyLong_FromSize_t((size_t)s);
        if (!stream) return NULL;
    }
    PyObject *t = ft_py_tensor_import(o, stream);
    Py_XDECREF(owned);
    return t;
}

/* Fill `v` from `o`. `*slow` receives a new reference to a Tensor when `o` had to be imported
 * through __dlpack__ (keep it alive while the memory is used). 1: done; 0: exception set. */
static int read_tensor(PyObject *o, tview *v, PyObject **slow, const char *role, PyObject *name) {
    *slow = NULL;
    v->api = NULL;
    v->device = (ft_device){FT_DEVICE_CPU, 0};
    v->device_ok = 1;
    /* the exchange API first: torch tensors are the ones read on every step */
    const FTDLPackExchangeAPI *api = exchange_api(Py_TYPE(o));
    if (api) {
        DLTensor dl;
        if (api->dltensor_from_py_object_no_sync(o, &dl) != 0) {
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            PyObject *msg = ev ? PyObject_Str(ev) : NULL;
            if (!msg) { PyErr_Clear(); msg = PyUnicode_FromString("no message"); }
            /* the first line: torch appends a C++ stack */
            PyObject *lines = msg ? PyUnicode_Splitlines(msg, 0) : NULL;
            PyObject *first = lines && PyList_GET_SIZE(lines) ? PyList_GET_ITEM(lines, 0) : msg;
            ft_py_fail(ft_errors.input_type, "%s %R cannot be read in place (%s): %S", role, name,
                       Py_TYPE(o)->tp_name, first ? first : Py_None);
            Py_XDECREF(lines);
            Py_XDECREF(msg);
            Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(tb);
            return 0;
        }
        v->api = api;
        v->shape.ndim = dl.ndim;
        if (dl.ndim > OPT_MAXDIM || dl.ndim < 0) goto too_many_dims;
        for (int d = 0; d < dl.ndim; d++) v->shape.shape[d] = dl.shape[d];
        v->data = (char *)dl.data + dl.byte_offset;
        v->f32 = dl.dtype.code == kDLFloat && dl.dtype.bits == 32 && dl.dtype.lanes == 1;
        v->contiguous = contiguous(dl.ndim, dl.shape, dl.strides);
        v->writeable = 1;
        if (dl.device.device_type == kDLCUDA) v->device = (ft_device){FT_DEVICE_CUDA, dl.device.device_id};
        else v->device_ok = dl.device.device_type == kDLCPU || dl.device.device_type == kDLCUDAHost;
        return 1;
    }
    if (PyArray_Check(o)) {
        PyArrayObject *a = (PyArrayObject *)o;
        v->shape.ndim = PyArray_NDIM(a);
        if (v->shape.ndim > OPT_MAXDIM) goto too_many_dims;
        for (int d = 0; d < v->shape.ndim; d++) v->shape.shape[d] = (int64_t)PyArray_DIM(a, d);
        v->data = PyArray_DATA(a);
        v->f32 = PyArray_TYPE(a) == NPY_FLOAT32;
        v->contiguous = PyArray_IS_C_CONTIGUOUS(a) && PyArray_ISALIGNED(a);
        v->writeable = PyArray_ISWRITEABLE(a);
        return 1;
    }
    if (!ft_py_tensor_check(o)) {
        if (!PyObject_HasAttrString(o, "__dlpack__")) {
            ft_py_fail(ft_errors.input_type, "%s %R must be a NumPy array or a DLPack tensor (torch, ...), got %s", role,
                       name, Py_TYPE(o)->tp_name);
            return 0;
        }
        PyObject *t = import_slow(o);
        if (!t) {
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            ft_py_fail(ft_errors.input_type, "%s %R: cannot use this DLPack tensor in place: %S", role, name,
                       ev ? ev : Py_None);
            Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(tb);
            return 0;
        }
        *slow = t;
        o = t;
    }
    int ndim;
    const int64_t *shape, *strides;
    ft_dtype dt;
    v->data = ft_py_tensor_data(o, &ndim, &shape, &strides, &dt, &v->device);
    v->shape.ndim = ndim;
    for (int d = 0; d < ndim; d++) v->shape.shape[d] = shape[d];
    v->f32 = dt == FT_F32;
    v->contiguous = contiguous(ndim, shape, strides);
    v->writeable = !ft_py_tensor_readonly(o);
    return 1;
too_many_dims:
    ft_py_fail(ft_errors.input, "%s %R has more than %d dimensions", role, name, OPT_MAXDIM);
    return 0;
}

static int same_shape(const opt_shape *a, const opt_shape *b) {
    if (a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

static int same_device(ft_device a, ft_device b) { return a.kind == b.kind && (a.kind == FT_DEVICE_CPU || a.index == b.index); }

/* the checks every tensor of a table passes; `param` NULL for a parameter, else the parameter
 * the gradient belongs to */
static int check_view(PyObject *o, const tview *v, PyObject *name, const opt_shape *param, ft_device dev, int dev_set) {
    const char *role = param ? "the gradient of" : "parameter";
    if (!v->f32) {
        PyObject *dt = describe(o, "dtype");
        ft_py_fail(ft_errors.input_type, "%s %R must be float32, got %S (the fused step keeps float32 weights%s)", role,
                   name, dt, param ? "" : "; keep a float32 master copy for lower-precision models");
        Py_DECREF(dt);
        return 0;
    }
    if (!v->device_ok) {
        PyObject *d = describe(o, "device");
        ft_py_fail(ft_errors.unsupported, "%s %R is on device %S: only the CPU and CUDA are supported", role, name, d);
        Py_DECREF(d);
        return 0;
    }
    if (dev_set && !same_device(v->device, dev)) {
        char a[32], b[32];
        if (param)
            ft_py_fail(ft_errors.input, "the gradient of %R is on %s, the parameters on %s", name,
                       device_str(v->device, a, sizeof a), device_str(dev, b, sizeof b));
        else
            ft_py_fail(ft_errors.input, "all parameters must be on one device: %R is on %s, the others on %s", name,
                       device_str(v->device, a, sizeof a), device_str(dev, b, sizeof b));
        return 0;
    }
    if (param && !same_shape(&v->shape, param)) {
        PyObject *gs = shape_str(&v->shape), *ps = shape_str(param);
        ft_py_fail(ft_errors.input, "the gradient of %R has shape %S, the parameter %S", name, gs, ps);
        Py_XDECREF(gs);
        Py_XDECREF(ps);
        return 0;
    }
    if (!v->contiguous) {
        ft_py_fail(ft_errors.input_type, "%s %R must be contiguous (row-major, no gaps): call .contiguous() on it%s",
                   role, name, param ? "" : " before creating the optimizer");
        return 0;
    }
    if (!param && !v->writeable) {
        ft_py_fail(ft_errors.input_type, "parameter %R is read-only; the optimizer updates it in place", name);
        return 0;
    }
    return 1;
}

/* ---- construction --------------------------------------------------------------------------- */

static int OptTable_traverse(OptTableObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->params);
    Py_VISIT(self->names);
    if (self->held)
        for (Py_ssize_t k = 0; k < self->count; k++) Py_VISIT(self->held[k]);
    return 0;
}

static int OptTable_clear(OptTableObject *self) {
    Py_CLEAR(self->params);
    Py_CLEAR(self->names);
    if (self->held)
        for (Py_ssize_t k = 0; k < self->count; k++) Py_CLEAR(self->held[k]);
    return 0;
}

static void OptTable_dealloc(OptTableObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    OptTable_clear(self);
    ft_optim_table_free(self->table);
    PyMem_Free(self->held);
    PyMem_Free(self->grad_refs);
    PyMem_Free(self->group_size);
    PyMem_Free(self->groups);
    PyMem_Free(self->shapes);
    PyMem_Free(self->reread);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* OptimizerTable(kind, params, group_sizes, decay, names): kind 0 = AdamW, 1 = LAMB; params in
 * table order (the groups' parameters one group after the other); decay[k] false: no weight
 * decay for tensor k. */
static PyObject *OptTable_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"kind", "params", "group_sizes", "decay", "names", NULL};
    int kind;
    PyObject *po, *go, *dco, *no;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOOO", kwlist, &kind, &po, &go, &dco, &no)) return NULL;
    if (kind != FT_OPT_ADAMW && kind != FT_OPT_LAMB) return ft_py_fail(ft_errors.input, "unknown optimizer kind %d", kind);
    PyObject *params = PySequence_Tuple(po), *sizes = params ? PySequence_Tuple(go) : NULL,
             *decay = sizes ? PySequence_Tuple(dco) : NULL, *names = decay ? PySequence_Tuple(no) : NULL;
    if (!names) {
        Py_XDECREF(params); Py_XDECREF(sizes); Py_XDECREF(decay);
        return NULL;
    }
    const Py_ssize_t n = PyTuple_GET_SIZE(params), G = PyTuple_GET_SIZE(sizes);
    OptTableObject *self = NULL;
    int64_t *numel = NULL;
    int32_t *grp = NULL, *dec = NULL;
    if (PyTuple_GET_SIZE(decay) != n || PyTuple_GET_SIZE(names) != n) {
        ft_py_fail(ft_errors.input, "OptimizerTable: %zd parameters, %zd decay flags, %zd names", n,
                   PyTuple_GET_SIZE(decay), PyTuple_GET_SIZE(names));
        goto fail;
    }
    self = (OptTableObject *)type->tp_alloc(type, 0);
    if (!self) goto fail;
    self->kind = kind;
    self->count = n;
    self->num_groups = G;
    self->params = Py_NewRef(params);
    self->names = Py_NewRef(names);
    const size_t c = n ? (size_t)n : 1, g = G ? (size_t)G : 1;
    self->held = PyMem_Calloc(c, sizeof *self->held);
    self->grad_refs = PyMem_Calloc(c, sizeof *self->grad_refs);
    self->group_size = PyMem_Calloc(g, sizeof *self->group_size);
    self->groups = PyMem_Calloc(g, sizeof *self->groups);
    self->shapes = PyMem_Calloc(c, sizeof *self->shapes);
    self->reread = PyMem_Calloc(c, 1);
    numel = PyMem_Calloc(c, sizeof *numel);
    grp = PyMem_Calloc(c, sizeof *grp);
    dec = PyMem_Calloc(c, sizeof *dec);
    if (!self->held || !self->grad_refs || !self->group_size || !self->groups || !self->shapes || !self->reread ||
        !numel || !grp || !dec) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < G; i++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, i));
        if (s == -1 && PyErr_Occurred()) goto fail;
        if (s < 0 || k + s > n) {
            ft_py_fail(ft_errors.input, "OptimizerTable: group sizes do not add up to %zd parameters", n);
            goto fail;
        }
        self->group_size[i] = s;
        for (Py_ssize_t j = 0; j < s; j++) grp[k + j] = (int32_t)i;
        k += s;
    }
    if (k != n) {
        ft_py_fail(ft_errors.input, "OptimizerTable: group sizes add up to %zd, there are %zd parameters", k, n);
        goto fail;
    }
    ft_device dev = {FT_DEVICE_CPU, 0};
    for (k = 0; k < n; k++) {
        PyObject *p = PyTuple_GET_ITEM(params, k), *name = PyTuple_GET_ITEM(names, k);
        tview v;
        if (!read_tensor(p, &v, &self->held[k], "parameter", name) || !check_view(p, &v, name, NULL, dev, k > 0))
            goto fail;
        dev = v.device;
        self->shapes[k] = v.shape;
        self->reread[k] = self->held[k] == NULL && !ft_py_tensor_check(p);
        numel[k] = 1;
        for (int d = 0; d < v.shape.ndim; d++) numel[k] *= v.shape.shape[d];
        int t = PyObject_IsTrue(PyTuple_GET_ITEM(decay, k));
        if (t < 0) goto fail;
        dec[k] = t;
        for (Py_ssize_t j = 0; j < k; j++)
            if (PyTuple_GET_ITEM(params, j) == p) {
                ft_py_fail(ft_errors.input, "parameter %R appears twice in the optimizer's parameter groups", name);
                goto fail;
            }
    }
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_optim_table_create(dev, (size_t)n, numel, grp, dec, &self->table);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) {
        ft_py_raise(st);
        goto fail;
    }
    /* the parameters' current addresses (re-read each step where they can change) */
    for (k = 0; k < n; k++) {
        tview v;
        PyObject *slow;
        PyObject *p = self->held[k] ? self->held[k] : PyTuple_GET_ITEM(params, k);
        if (!read_tensor(p, &v, &slow, "parameter", PyTuple_GET_ITEM(names, k))) goto fail;
        Py_XDECREF(slow);   /* held[k] is a Tensor already: never imported again */
        self->table->tensors[k].param = v.data;
    }
    PyMem_Free(numel); PyMem_Free(grp); PyMem_Free(dec);
    Py_DECREF(params); Py_DECREF(sizes); Py_DECREF(decay); Py_DECREF(names);
    return (PyObject *)self;
fail:
    PyMem_Free(numel); PyMem_Free(grp); PyMem_Free(dec);
    Py_DECREF(params); Py_DECREF(sizes); Py_DECREF(decay); Py_DECREF(names);
    Py_XDECREF(self);
    return NULL;
}

/* ---- a step ------------------------------------------------------------------------------------ */

static int group_number(PyObject *d, PyObject *key, Py_ssize_t g, double *out) {
    PyObject *o = PyDict_GetItemWithError(d, key);
    if (!o) {
        if (!PyErr_Occurred()) ft_py_fail(ft_errors.input, "parameter group %zd has no %R", g, key);
        return 0;
    }
    *out = PyFloat_AsDouble(o);
    if (*out == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        ft_py_fail(ft_errors.input_type, "parameter group %zd: %S must be a number, got %R", g, key, o);
        return 0;
    }
    return 1;
}

/* 1: same parameters, hyper-parameters read; 0: exception; -1: the parameter set changed */
static int read_groups(OptTableObject *self, PyObject *groups) {
    if (!PyList_Check(groups) || PyList_GET_SIZE(groups) != self->num_groups) return -1;
    Py_ssize_t k = 0;
    for (Py_ssize_t g = 0; g < self->num_groups; g++) {
        PyObject *d = PyList_GET_ITEM(groups, g);
        if (!PyDict_Check(d)) {
            ft_py_fail(ft_errors.input_type, "parameter group %zd must be a dict, got %s", g, Py_TYPE(d)->tp_name);
            return 0;
        }
        PyObject *ps = PyDict_GetItemWithError(d, s_params);
        if (!ps) {
            if (PyErr_Occurred()) return 0;
            return -1;
        }
        if (!(PyList_Check(ps) || PyTuple_Check(ps)) || PySequence_Fast_GET_SIZE(ps) != self->group_size[g]) return -1;
        for (Py_ssize_t i = 0; i < self->group_size[g]; i++)
            if (PySequence_Fast_GET_ITEM(ps, i) != PyTuple_GET_ITEM(self->params, k + i)) return -1;
        k += self->group_size[g];
        ft_optim_group *h = &self->groups[g];
        if (!group_number(d, s_lr, g, &h->lr) || !group_number(d, s_eps, g, &h->eps) ||
            !group_number(d, s_weight_decay, g, &h->weight_decay))
            return 0;
        /* 'lr_scale' (optional, 1): the group's factor of the lr; the step runs at lr x lr_scale */
        h->lr_scale = 1.0;
        PyObject *sc = PyDict_GetItemWithError(d, s_lr_scale);
        if (!sc && PyErr_Occurred()) return 0;
        if (sc && !group_number(d, s_lr_scale, g, &h->lr_scale)) return 0;
        if (!(h->lr_scale > 0.0) || !isfinite(h->lr_scale)) {
            ft_py_fail(ft_errors.input, "parameter group %zd: lr_scale must be a finite number > 0, got %R", g, sc);
            return 0;
        }
        h->lr *= h->lr_scale;
        PyObject *b = PyDict_GetItemWithError(d, s_betas);
        if (!b) {
            if (!PyErr_Occurred()) ft_py_fail(ft_errors.input, "parameter group %zd has no 'betas'", g);
            return 0;
        }
        PyObject *b0 = PySequence_Check(b) && PySequence_Size(b) == 2 ? PySequence_GetItem(b, 0) : NULL;
        PyObject *b1 = b0 ? PySequence_GetItem(b, 1) : NULL;
        h->beta1 = b1 ? PyFloat_AsDouble(b0) : -1.0;
        h->beta2 = b1 ? PyFloat_AsDouble(b1) : -1.0;
        Py_XDECREF(b0);
        Py_XDECREF(b1);
        if (!b1 || PyErr_Occurred()) {
            PyErr_Clear();
            ft_py_fail(ft_errors.input_type, "parameter group %zd: betas must be two numbers, got %R", g, b);
            return 0;
        }
        PyObject *bc = PyDict_GetItemWithError(d, s_bias_correction);
        if (!bc && PyErr_Occurred()) return 0;
        h->bias_correction = 1;
        if (bc && (h->bias_correction = PyObject_IsTrue(bc)) < 0) return 0;
    }
    return 1;
}

static void drop_grads(OptTableObject *self) {
    for (Py_ssize_t k = 0; k < self->count; k++) Py_CLEAR(self->grad_refs[k]);
}

/* A step's set-up, shared by step() and Model.train_steps: the groups' hyper-parameters read, each
 * gradient read and pointed to (held in grad_refs until ft_py_optim_finish). 1: ready, cfg filled;
 * 0: an exception; -1: the groups no longer hold the table's parameters (nothing held). */
static int prepare(OptTableObject *self, PyObject *groups, PyObject *grads, double max_norm, int check_finite,
                   ft_optim_config *cfg) {
    ft_optim_table *t = self->table;
    int r = read_groups(self, groups);
    if (r <= 0) return r;
    PyObject *seq = NULL;
    if (grads != Py_None) {
        seq = PySequence_Fast(grads, "grads must be a list of gradients (or None to read each parameter's .grad)");
        if (!seq) return 0;
        if (PySequence_Fast_GET_SIZE(seq) != self->count) {
            ft_py_fail(ft_errors.input, "got %zd gradients for %zd parameters", PySequence_Fast_GET_SIZE(seq),
                       self->count);
            Py_DECREF(seq);
            return 0;
        }
    }
    PyObject *sync_with = NULL;   /* a CUDA gradient read through the exchange API */
    Py_ssize_t active = 0;
    for (Py_ssize_t k = 0; k < self->count; k++) {
        PyObject *p = PyTuple_GET_ITEM(self->params, k), *name = PyTuple_GET_ITEM(self->names, k);
        ft_optim_tensor *e = &t->tensors[k];
        tview v;
        PyObject *slow;
        if (self->reread[k]) {   /* p.data = ... gives a parameter new memory */
            if (!read_tensor(p, &v, &slow, "parameter", name)) goto fail;
            Py_XDECREF(slow);
            if (v.data != e->param) {
                if (!same_shape(&v.shape, &self->shapes[k])) {
                    PyObject *a = shape_str(&self->shapes[k]), *b = shape_str(&v.shape);
                    ft_py_fail(ft_errors.input, "parameter %R changed shape from %S to %S since the optimizer was "
                               "created; create a new optimizer for the new parameters", name, a, b);
                    Py_XDECREF(a); Py_XDECREF(b);
                    goto fail;
                }
                if (!check_view(p, &v, name, NULL, t->device, 1)) goto fail;
                e->param = v.data;
            }
        }
        PyObject *g = seq ? Py_NewRef(PySequence_Fast_GET_ITEM(seq, k)) : PyObject_GetAttr(p, s_grad);
        if (!g) goto fail;
        if (g == Py_None) {
            Py_DECREF(g);
            t->active[k] = 0;
            continue;
        }
        if (!read_tensor(g, &v, &slow, "the gradient of", name)) { Py_DECREF(g); goto fail; }
        if (slow) { Py_SETREF(g, slow); }   /* the Tensor keeps the producer's memory alive */
        self->grad_refs[k] = g;
        if (!check_view(g, &v, name, &self->shapes[k], t->device, 1)) goto fail;
        if (v.api && t->device.kind == FT_DEVICE_CUDA && !sync_with) sync_with = g;
        e->grad = v.data;
        t->active[k] = 1;
        active++;
    }
    if (sync_with) {   /* the producer's pending work (the backward pass) before our kernels */
        PyObject *s = import_slow(sync_with);
        if (!s) goto fail;
        Py_DECREF(s);
    }
    Py_XDECREF(seq);
    *cfg = (ft_optim_config){(ft_optimizer)self->kind, self->groups, (size_t)self->num_groups, max_norm, check_finite};
    self->active = active;
    return 1;
fail:
    drop_grads(self);
    Py_XDECREF(seq);
    return 0;
}

/* After the steps: the references dropped; st != FT_OK: its exception (a refused step names the
 * tensor) and NULL; else the info kept and the number of tensors that made their first update. */
static PyObject *finish(OptTableObject *self, ft_status st, const ft_optim_info *info) {
    drop_grads(self);
    if (st != FT_OK) {
        self->active = 0;
        if (info->bad_tensor >= 0 && info->bad_tensor < self->count) {
            PyObject *msg = PyUnicode_FromFormat("%s (parameter %R)", ft_last_error(),
                                                 PyTuple_GET_ITEM(self->names, info->bad_tensor));
            ft_clear_error();
            if (msg) { PyErr_SetObject(ft_errors.input, msg); Py_DECREF(msg); }
            return NULL;
        }
        return ft_py_raise(st);
    }
    self->info = *info;
    ft_optim_table *t = self->table;
    Py_ssize_t first = 0;
    for (Py_ssize_t k = 0; k < self->count; k++) first += t->active[k] && t->steps[k] == 1;
    return PyLong_FromSsize_t(first);
}

/* step(param_groups, grads, max_grad_norm, check_finite)
 *   grads: None (read each parameter's .grad) or a sequence aligned with the table (None = no
 *   gradient: the tensor sits this step out).
 *   -> None when the groups no longer hold the table's parameters (rebuild), else the number of
 *      tensors that made their first update. The rest (grad_norm, clip_scale, kernel_launches,
 *      updated) are attributes: nothing is allocated for them on a step. */
static PyObject *OptTable_step(OptTableObject *self, PyObject *args) {
    PyObject *groups, *grads;
    double max_norm;
    int check_finite;
    if (!PyArg_ParseTuple(args, "OOdp", &groups, &grads, &max_norm, &check_finite)) return NULL;
    ft_optim_config cfg;
    int r = prepare(self, groups, grads, max_norm, check_finite, &cfg);
    if (r <= 0) {
        if (r < 0) Py_RETURN_NONE;
        return NULL;
    }
    ft_optim_table *t = self->table;
    ft_optim_info info;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    const int64_t w0 = clock_ns(CLOCK_MONOTONIC), c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    st = ft_optim_table_step(t, &cfg, &info);
    self->kernel_ns[1] = clock_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
    self->kernel_ns[0] = clock_ns(CLOCK_MONOTONIC) - w0;
    Py_END_ALLOW_THREADS
    return finish(self, st, &info);
}

int ft_py_optim_prepare(PyObject *obj, PyObject *groups, PyObject *grads, double max_norm, int check_finite,
                        ft_optim_table **table, ft_optim_config *cfg) {
    if (!opt_table_type || !PyObject_TypeCheck(obj, opt_table_type) || !((OptTableObject *)obj)->table) {
        ft_py_fail(ft_errors.input_type, "expected a fasttran.OptimizerTable, got %s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    OptTableObject *self = (OptTableObject *)obj;
    *table = self->table;
    return prepare(self, groups, grads, max_norm, check_finite, cfg);
}

PyObject *ft_py_optim_finish(PyObject *obj, ft_status st, const ft_optim_info *info) {
    return finish((OptTableObject *)obj, st, info);
}

/* ---- state access ---------------------------------------------------------------------------- */

/* moments() -> (m, v, steps): 1-D Tensors over all moment estimates (device memory) and the
 * float32 update counts (host), views that keep the table alive */
static PyObject *OptTable_moments(OptTableObject *self, PyObject *unused) {
    (void)unused;
    ft_optim_table *t = self->table;
    int64_t n[1] = {t->total}, c[1] = {(int64_t)t->count};
    PyObject *m = ft_py_tensor_new(t->m, 1, n, NULL, FT_F32, t->device, 0, (PyObject *)self, NULL, NULL);
    PyObject *v = m ? ft_py_tensor_new(t->v, 1, n, NULL, FT_F32, t->device, 0, (PyObject *)self, NULL, NULL) : NULL;
    PyObject *s = v ? ft_py_tensor_new(t->steps_f32, 1, c, NULL, FT_F32, (ft_device){FT_DEVICE_CPU, 0}, 0,
                                       (PyObject *)self, NULL, NULL)
                    : NULL;
    if (!s) {
        Py_XDECREF(m);
        Py_XDECREF(v);
        return NULL;
    }
    return Py_BuildValue("(NNN)", m, v, s);
}

/* views() -> [(m, v)] per tensor: Tensors with the parameter's shape over its moment estimates */
static PyObject *OptTable_views(OptTableObject *self, PyObject *unused) {
    (void)unused;
    ft_optim_table *t = self->table;
    PyObject *list = PyList_New(self->count);
    for (Py_ssize_t k = 0; list && k < self->count; k++) {
        const opt_shape *s = &self->shapes[k];
        PyObject *m = ft_py_tensor_new(t->tensors[k].m, s->ndim, s->shape, NULL, FT_F32, t->device, 0,
                                       (PyObject *)self, NULL, NULL);
        PyObject *v = m ? ft_py_tensor_new(t->tensors[k].v, s->ndim, s->shape, NULL, FT_F32, t->device, 0,
                                           (PyObject *)self, NULL, NULL)
                        : NULL;
        PyObject *pair = v ? Py_BuildValue("(NN)", m, v) : NULL;
        if (!pair) {
            if (!v) Py_XDECREF(m);
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, k, pair);
    }
    return list;
}

/* offsets() -> [offset of tensor k's moments in m and v] */
static PyObject *OptTable_offsets(OptTableObject *self, PyObject *unused) {
    (void)unused;
    PyObject *list = PyList_New(self->count);
    for (Py_ssize_t k = 0; list && k < self->count; k++) {
        PyObject *o = PyLong_FromSsize_t((Py_ssize_t)(self->table->tensors[k].m - self->table->m));
        if (!o) { Py_CLEAR(list); break; }
        PyList_SET_ITEM(list, k, o);
    }
    return list;
}

static PyObject *OptTable_get_steps(OptTableObject *self, PyObject *unused) {
    (void)unused;
    PyObject *list = PyList_New(self->count);
    for (Py_ssize_t k = 0; list && k < self->count; k++) {
        PyObject *o = PyLong_FromLongLong(self->table->steps[k]);
        if (!o) { Py_CLEAR(list); break; }
        PyList_SET_ITEM(list, k, o);
    }
    return list;
}

/* set_steps([count per tensor]): after moments were loaded from a state */
static PyObject *OptTable_set_steps(OptTableObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "set_steps takes a list of update counts");
    if (!seq) return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != self->count) {
        Py_DECREF(seq);
        return ft_py_fail(ft_errors.input, "set_steps: %zd counts for %zd tensors", PySequence_Fast_GET_SIZE(seq),
                          self->count);
    }
    int64_t *tmp = PyMem_Calloc(self->count ? (size_t)self->count : 1, sizeof *tmp);
    if (!tmp) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t k = 0; k < self->count; k++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, k);
        double d = PyFloat_AsDouble(o);
        if ((d == -1.0 && PyErr_Occurred()) || !(d >= 0.0) || d != (double)(int64_t)d || d > 9.0e15) {
            PyErr_Clear();
            PyMem_Free(tmp);
            Py_DECREF(seq);
            return ft_py_fail(ft_errors.input, "the step count of %R must be a whole number >= 0, got %R",
                              PyTuple_GET_ITEM(self->names, k), o);
        }
        tmp[k] = (int64_t)d;
    }
    for (Py_ssize_t k = 0; k < self->count; k++) {
        self->table->steps[k] = tmp[k];
        self->table->steps_f32[k] = (float)tmp[k];
    }
    PyMem_Free(tmp);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *OptTable_get_device(OptTableObject *self, void *c) {
    (void)c;
    char buf[32];
    return PyUnicode_FromString(device_str(self->table->device, buf, sizeof buf));
}

static PyObject *OptTable_get_params(OptTableObject *self, void *c) { (void)c; return Py_NewRef(self->params); }

static PyObject *OptTable_get_total(OptTableObject *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(self->table->total);
}

/* the parameters the last step updated (the table's tuple when it updated all) */
static PyObject *OptTable_get_updated(OptTableObject *self, void *c) {
    (void)c;
    if (self->active == self->count) return Py_NewRef(self->params);
    PyObject *u = PyTuple_New(self->active);
    for (Py_ssize_t k = 0, j = 0; u && k < self->count && j < self->active; k++)
        if (self->table->active[k]) PyTuple_SET_ITEM(u, j++, Py_NewRef(PyTuple_GET_ITEM(self->params, k)));
    return u;
}

static PyObject *OptTable_get_grad_norm(OptTableObject *self, void *c) { (void)c; return PyFloat_FromDouble(self->info.grad_norm); }
static PyObject *OptTable_get_clip_scale(OptTableObject *self, void *c) { (void)c; return PyFloat_FromDouble(self->info.clip_scale); }
static PyObject *OptTable_get_launches(OptTableObject *self, void *c) { (void)c; return PyLong_FromLong(self->info.kernel_launches); }

static PyObject *OptTable_get_kernel_ns(OptTableObject *self, void *c) {
    (void)c;
    return Py_BuildValue("(LL)", (long long)self->kernel_ns[0], (long long)self->kernel_ns[1]);
}

static PyObject *OptTable_repr(OptTableObject *self) {
    char buf[32];
    return PyUnicode_FromFormat("OptimizerTable(%s, %zd tensors in %zd groups, %lld moment elements on %s)",
                                self->kind == FT_OPT_LAMB ? "lamb" : "adamw", self->count, self->num_groups,
                                (long long)self->table->total, device_str(self->table->device, buf, sizeof buf));
}

static PyMethodDef OptTable_methods[] = {
    {"step", (PyCFunction)OptTable_step, METH_VARARGS,
     "step(param_groups, grads, max_grad_norm, check_finite) -> None (parameters changed: rebuild) or the "
     "number of tensors that made their first update"},
    {"moments", (PyCFunction)OptTable_moments, METH_NOARGS, "(m, v, steps) flat Tensors over the state"},
    {"offsets", (PyCFunction)OptTable_offsets, METH_NOARGS, "offset of each tensor's moments"},
    {"views", (PyCFunction)OptTable_views, METH_NOARGS, "[(m, v)] per tensor, shaped like the parameters"},
    {"get_steps", (PyCFunction)OptTable_get_steps, METH_NOARGS, "update count of each tensor"},
    {"set_steps", (PyCFunction)OptTable_set_steps, METH_O, "set the update count of each tensor"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef OptTable_getset[] = {
    {"device", (getter)OptTable_get_device, NULL, "'cpu' or 'cuda:N'", NULL},
    {"params", (getter)OptTable_get_params, NULL, "the parameter objects, table order", NULL},
    {"total", (getter)OptTable_get_total, NULL, "elements of m (and of v), padding included", NULL},
    {"updated", (getter)OptTable_get_updated, NULL, "the parameters the last step updated (tuple)", NULL},
    {"grad_norm", (getter)OptTable_get_grad_norm, NULL, "global gradient norm of the last step (NaN: not taken)", NULL},
    {"clip_scale", (getter)OptTable_get_clip_scale, NULL, "gradient scale of the last step's clipping", NULL},
    {"kernel_launches", (getter)OptTable_get_launches, NULL, "CUDA kernels the last step launched", NULL},
    {"kernel_ns", (getter)OptTable_get_kernel_ns, NULL,
     "(wall, calling-thread CPU) nanoseconds of the last step's C call (ft_optim_table_step)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot OptTable_slots[] = {
    {Py_tp_new, OptTable_new},
    {Py_tp_dealloc, OptTable_dealloc},
    {Py_tp_traverse, OptTable_traverse},
    {Py_tp_clear, OptTable_clear},
    {Py_tp_methods, OptTable_methods},
    {Py_tp_getset, OptTable_getset},
    {Py_tp_repr, OptTable_repr},
    {Py_tp_doc, "The tensor table and moment estimates of a fused optimizer (fasttran.optim builds it)."},
    {0, NULL}};

static PyType_Spec OptTable_spec = {"fasttran.OptimizerTable", sizeof(OptTableObject), 0,
                                    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, OptTable_slots};

int ft_py_add_optimizer_type(PyObject *m) {
    struct { PyObject **slot; const char *s; } keys[] = {
        {&s_params, "params"}, {&s_lr, "lr"}, {&s_lr_scale, "lr_scale"}, {&s_betas, "betas"}, {&s_eps, "eps"}, {&s_weight_decay, "weight_decay"},
        {&s_bias_correction, "bias_correction"}, {&s_grad, "grad"}};
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++)
        if (!(*keys[i].slot = PyUnicode_InternFromString(keys[i].s))) return -1;
    PyObject *tp = PyType_FromModuleAndSpec(m, &OptTable_spec, NULL);
    if (!tp) return -1;
    int r = PyModule_AddObjectRef(m, "OptimizerTable", tp);
    opt_table_type = (PyTypeObject *)tp;   /* the module holds it */
    Py_DECREF(tp);
    return r;
}
