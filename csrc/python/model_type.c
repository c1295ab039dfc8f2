/* fasttran._C.Model: the training model (ft_model: [frozen features] -> [top layers] -> task head)
 * behind fasttran/model.py. Buffers are NumPy arrays (host) or fasttran.Tensor on the model's
 * device, checked here once; a step runs in C with the GIL released, which it takes back only to
 * hand each finished gradient bucket to the Python callable `ready` (data-parallel reduction). */
#include <math.h>
#include <stdio.h>

#include "binding.h"
#include "core/status.h"
#include "dist/host_sum.h"

typedef struct {
    PyObject_HEAD
    ft_model *model;
    PyObject *layers;        /* the LayerStack whose allocations hold the parameters, or NULL */
    ft_device device;
    ft_head_config head;
    int64_t hidden;
} Model;

static void Model_dealloc(Model *self) {
    PyTypeObject *tp = Py_TYPE(self);
    ft_model_free(self->model);
    Py_XDECREF(self->layers);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int Model_init(Model *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"head", "layers", "device_index", "shared_grads", NULL};
    PyObject *head_o, *layers_o = Py_None;
    int device_index = -1, shared = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Oip", kwlist, &head_o, &layers_o, &device_index, &shared))
        return -1;
    shared = ft_py_shared_grads(shared);
    if (self->model) { ft_py_fail(ft_errors.base, "Model is already initialised"); return -1; }
    if (!ft_py_parse_head(head_o, &self->head)) return -1;
    ft_device dev = {device_index < 0 ? FT_DEVICE_CPU : FT_DEVICE_CUDA, device_index < 0 ? 0 : device_index};
    ft_layer_stack *stack = NULL;
    if (layers_o != Py_None) {
        ft_device ldev;
        stack = ft_py_layer_stack_of(layers_o, &ldev);
        if (!stack) return -1;
        if (ldev.kind != dev.kind || ldev.index != dev.index) {
            ft_py_fail(ft_errors.input, "the layers are on another device than the model");
            return -1;
        }
    }
    ft_status st;
    ft_model *m = NULL;
    Py_BEGIN_ALLOW_THREADS
    st = ft_model_create(dev, &self->head, stack, shared, &m);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) { ft_py_raise(st); return -1; }
    self->model = m;
    self->device = dev;
    self->hidden = self->head.hidden;
    if (layers_o != Py_None) { Py_INCREF(layers_o); self->layers = layers_o; }
    return 0;
}

static int ready_model(Model *self) {
    if (!self->model) { ft_py_fail(ft_errors.base, "Model is not initialised"); return 0; }
    return 1;
}

static PyObject *Model_flat(Model *self, void *grads) {
    if (!ready_model(self)) return NULL;
    return ft_py_flat_tensor((PyObject *)self, grads ? ft_model_grads(self->model) : ft_model_params(self->model),
                             (int64_t)ft_model_param_count(self->model), self->device);
}
static PyObject *Model_head_offset(Model *self, void *c) {
    (void)c;
    return ready_model(self) ? PyLong_FromSize_t(ft_model_head_offset(self->model)) : NULL;
}

/* buckets() -> int64 array (buckets, 2) of (offset, floats): the head, then the top layer down to the
 * bottom one */
static PyObject *Model_buckets(Model *self, PyObject *unused) {
    (void)unused;
    if (!ready_model(self)) return NULL;
    npy_intp dims[2] = {(npy_intp)ft_model_num_buckets(self->model), 2};
    PyObject *out = PyArray_SimpleNew(2, dims, NPY_INT64);
    int64_t *v = out ? PyArray_DATA((PyArrayObject *)out) : NULL;
    for (npy_intp i = 0; v && i < dims[0]; i++) {
        size_t off, count;
        ft_model_bucket(self->model, (size_t)i, &off, &count);
        v[2 * i] = (int64_t)off;
        v[2 * i + 1] = (int64_t)count;
    }
    return out;
}

/* write_params(offset, array) / read_params(offset, n) -> array: host <-> the flat parameter table */
static PyObject *Model_write_params(Model *self, PyObject *args) {
    Py_ssize_t offset;
    PyObject *ao;
    if (!ready_model(self) || !PyArg_ParseTuple(args, "nO", &offset, &ao)) return NULL;
    PyArrayObject *a = ft_py_want_array(ao, "parameters", NPY_FLOAT32, -1, 0);
    if (!a) return NULL;
    if (offset < 0) return ft_py_fail(ft_errors.input, "offset must be >= 0");
    ft_status st;
    const float *src = PyArray_DATA(a);
    FT_PY_NOGIL(st, ft_model_write_params(self->model, (size_t)offset, src, (size_t)PyArray_SIZE(a)));
    return ft_py_none_or_raise(st);
}

static PyObject *Model_read_params(Model *self, PyObject *args) {
    Py_ssize_t offset, n;
    if (!ready_model(self) || !PyArg_ParseTuple(args, "nn", &offset, &n)) return NULL;
    if (offset < 0 || n < 0) return ft_py_fail(ft_errors.input, "offset and count must be >= 0");
    npy_intp dims[1] = {n};
    PyObject *out = PyArray_SimpleNew(1, dims, NPY_FLOAT32);
    if (!out) return NULL;
    float *dst = PyArray_DATA((PyArrayObject *)out);
    ft_status st;
    FT_PY_NOGIL(st, ft_model_read_params(self->model, (size_t)offset, dst, (size_t)n));
    if (st != FT_OK) { Py_DECREF(out); return ft_py_raise(st); }
    return out;
}

static PyObject *Model_reserve(Model *self, PyObject *args) {
    long long B, N;
    if (!ready_model(self) || !PyArg_ParseTuple(args, "LL", &B, &N)) return NULL;
    ft_status st;
    FT_PY_NOGIL(st, ft_model_reserve(self->model, B, N));
    return ft_py_none_or_raise(st);
}

static PyObject *Model_allocated(Model *self, PyObject *unused) {
    (void)unused;
    return ready_model(self) ? PyLong_FromSize_t(ft_model_allocated(self->model)) : NULL;
}

/* the callback a step hands each finished bucket to: back on the GIL, call ready(bucket); the
 * first exception is kept and raised when the step returns */
typedef struct { PyObject *ready, *error_type, *error_value, *error_tb; } bucket_hook;
static void on_bucket(void *arg, size_t bucket) {
    bucket_hook *h = arg;
    PyGILState_STATE g = PyGILState_Ensure();
    if (!h->error_type) {
        PyObject *r = PyObject_CallFunction(h->ready, "n", (Py_ssize_t)bucket);
        if (r) Py_DECREF(r);
        else PyErr_Fetch(&h->error_type, &h->error_value, &h->error_tb);
    }
    PyGILState_Release(g);
}

/* *data = the memory of a host float32 / int32 array `o` of `need` elements (NULL for None); 0 with
 * an exception */
static int host_array(PyObject *o, const char *what, int npy, int64_t need, int writeable, void **data) {
    *data = NULL;
    if (o == Py_None) return 1;
    PyArrayObject *a = ft_py_want_array(o, what, npy, -1, writeable);
    if (!a) return 0;
    if ((int64_t)PyArray_SIZE(a) != need) {
        ft_py_fail(ft_errors.input, "%s has %lld elements, this batch takes %lld", what, (long long)PyArray_SIZE(a),
                   (long long)need);
        return 0;
    }
    *data = PyArray_DATA(a);
    return 1;
}

/* the batch arguments of step() and forward(), checked: fills b; 0 with an exception */
static int parse_batch(Model *self, PyObject *xo, PyObject *lo, PyObject *to, PyObject *vo, PyObject *zo,
                       PyObject *ids_o, PyObject *types_o, ft_model_batch *b, float **logits) {
    if (!PyArray_Check(lo) || PyArray_TYPE((PyArrayObject *)lo) != NPY_INT32 || PyArray_NDIM((PyArrayObject *)lo) != 1 ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)lo) || PyArray_SIZE((PyArrayObject *)lo) < 1) {
        ft_py_fail(ft_errors.input_type, "lengths must be a non-empty 1-d int32 NumPy array (host memory)");
        return 0;
    }
    const int32_t *lengths = PyArray_DATA((PyArrayObject *)lo);
    const int64_t B = (int64_t)PyArray_SIZE((PyArrayObject *)lo);
    int64_t N = 0;
    for (int64_t i = 0; i < B; i++) {
        if (lengths[i] < 1) {
            ft_py_fail(ft_errors.input, "sequence %lld of the batch has %d rows; each needs at least one", (long long)i,
                       lengths[i]);
            return 0;
        }
        N += lengths[i];
    }
    b->lengths = lengths;
    b->B = B;
    if (ids_o != Py_None) {   /* layers that train the embeddings: the rows as tokens (host int32) */
        if (xo != Py_None) {
            ft_py_fail(ft_errors.input, "give the rows as x or as token ids, not both");
            return 0;
        }
        if (!host_array(ids_o, "ids", NPY_INT32, N, 0, (void **)&b->ids) ||
            !host_array(types_o, "types", NPY_INT32, N, 0, (void **)&b->types))
            return 0;
        b->x = NULL;
    }
    ft_py_buf x = {0};
    if (ids_o == Py_None && !ft_py_get_buf(xo, "x", -1, FT_F32, 0, 0, &x)) return 0;
    if (ids_o != Py_None) {
    } else if (x.device.kind != self->device.kind || (x.device.kind == FT_DEVICE_CUDA && x.device.index != self->device.index)) {
        ft_py_fail(ft_errors.input, "the batch is on another device than the model (%s)",
                   self->device.kind == FT_DEVICE_CPU ? "the CPU" : "a CUDA device");
        return 0;
    }
    if (ids_o == Py_None && x.numel != N * self->hidden) {
        ft_py_fail(ft_errors.input, "x has %lld elements; %lld rows of width %lld expected", (long long)x.numel,
                   (long long)N, (long long)self->hidden);
        return 0;
    }
    if (ids_o == Py_None) b->x = x.data;
    const int fl = ft_head_float_targets(&self->head);
    return host_array(to, "targets", fl ? NPY_FLOAT32 : NPY_INT32, ft_head_target_count(&self->head, B, N), 0,
                      (void **)&b->targets) &&
           host_array(vo, "valid", NPY_FLOAT32, N, 0, (void **)&b->valid) &&
           host_array(zo, "logits", NPY_FLOAT32, ft_head_logits_count(&self->head, B, N), 1, (void **)logits);
}

/* step(x, lengths, targets, valid=None, denominator=0 (the batch's loss terms), seed=0, step=0, row_base=0,
 *      seq_base=0, sq_base=0, loss_scale=1.0, logits=None, ready=None) -> loss */
static PyObject *Model_step(Model *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"x", "lengths", "targets", "valid", "denominator", "seed", "step", "row_base", "seq_base",
                             "sq_base", "loss_scale", "logits", "ready", "ids", "types", NULL};
    PyObject *xo, *lo, *to, *vo = Py_None, *zo = Py_None, *ro = Py_None, *ids_o = Py_None, *types_o = Py_None;
    double denom = 0.0;
    unsigned long long seed = 0, step = 0, row_base = 0, seq_base = 0, sq_base = 0;
    float loss_scale = 1.0f;
    if (!ready_model(self) ||
        !PyArg_ParseTupleAndKeywords(args, kw, "OOO|OdKKKKKfOOOO", kwlist, &xo, &lo, &to, &vo, &denom, &seed, &step,
                                     &row_base, &seq_base, &sq_base, &loss_scale, &zo, &ro, &ids_o, &types_o))
        return NULL;
    if (to == Py_None) return ft_py_fail(ft_errors.input, "a training step needs targets");
    if (ro != Py_None && !PyCallable_Check(ro)) return ft_py_fail(ft_errors.input_type, "ready must be callable or None");
    ft_model_batch b = {0};
    float *logits;
    if (!parse_batch(self, xo, lo, to, vo, zo, ids_o, types_o, &b, &logits)) return NULL;
    int64_t N = 0;
    for (int64_t i = 0; i < b.B; i++) N += b.lengths[i];
    b.denominator = denom > 0.0 ? denom : (double)ft_head_loss_count(&self->head, b.B, N);
    b.seed = seed;
    b.step = step;
    b.row_base = row_base;
    b.seq_base = seq_base;
    b.sq_base = sq_base;
    b.loss_scale = loss_scale;
    bucket_hook hook = {ro, NULL, NULL, NULL};
    double loss = 0.0;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_model_step(self->model, &b, &loss, logits, ro != Py_None ? on_bucket : NULL, &hook);
    Py_END_ALLOW_THREADS
    if (hook.error_type) {
        PyErr_Restore(hook.error_type, hook.error_value, hook.error_tb);
        return NULL;
    }
    if (st != FT_OK) return ft_py_raise(st);
    return PyFloat_FromDouble(loss);
}

/* idle(ready=None) -> 0.0: a step without examples (ft_model_idle) */
static PyObject *Model_idle(Model *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ready", NULL};
    PyObject *ro = Py_None;
    if (!ready_model(self) || !PyArg_ParseTupleAndKeywords(args, kw, "|O", kwlist, &ro)) return NULL;
    if (ro != Py_None && !PyCallable_Check(ro)) return ft_py_fail(ft_errors.input_type, "ready must be callable or None");
    bucket_hook hook = {ro, NULL, NULL, NULL};
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_model_idle(self->model, ro != Py_None ? on_bucket : NULL, &hook);
    Py_END_ALLOW_THREADS
    if (hook.error_type) {
        PyErr_Restore(hook.error_type, hook.error_value, hook.error_tb);
        return NULL;
    }
    if (st != FT_OK) return ft_py_raise(st);
    return PyFloat_FromDouble(0.0);
}

/* forward(x, lengths, logits, valid=None): inference */
static PyObject *Model_forward(Model *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"x", "lengths", "logits", "valid", "ids", "types", NULL};
    PyObject *xo, *lo, *zo, *vo = Py_None, *ids_o = Py_None, *types_o = Py_None;
    if (!ready_model(self) ||
        !PyArg_ParseTupleAndKeywords(args, kw, "OOO|OOO", kwlist, &xo, &lo, &zo, &vo, &ids_o, &types_o))
        return NULL;
    if (zo == Py_None) return ft_py_fail(ft_errors.input, "forward needs a logits array to write into");
    ft_model_batch b = {0};
    float *logits;
    if (!parse_batch(self, xo, lo, Py_None, vo, zo, ids_o, types_o, &b, &logits)) return NULL;
    b.denominator = 1.0;
    ft_status st;
    FT_PY_NOGIL(st, ft_model_forward(self->model, &b, logits));
    return ft_py_none_or_raise(st);
}

/* the callback of train_steps: back on the GIL, Ctrl-C's handler (PyErr_CheckSignals), then
 * callback(done); an exception or a true result stops the steps (the exception is raised after) */
typedef struct { PyObject *callback, *error_type, *error_value, *error_tb; } steps_hook;
static int on_steps(void *arg, int64_t done) {
    steps_hook *h = arg;
    PyGILState_STATE g = PyGILState_Ensure();
    int stop = 0;
    if (PyErr_CheckSignals() < 0) {
        stop = 1;
    } else if (h->callback != Py_None) {
        PyObject *r = PyObject_CallFunction(h->callback, "L", (long long)done);
        if (r) {
            stop = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (stop < 0) stop = 1;
        } else {
            stop = 1;
        }
    }
    if (PyErr_Occurred()) PyErr_Fetch(&h->error_type, &h->error_value, &h->error_tb);
    PyGILState_Release(g);
    return stop;
}

static void *host_exact(PyObject *o, const char *what, int npy, int64_t need, int writeable, int64_t *size);

/* ---- the C loop's gradient reduction (ft_train_reduction) -----------------------------------------
 * train_steps(reduction=...) takes one of:
 *   (host_sum, steps, watch): the shared-memory sums in C (dist/host_sum.h: ft_host_sum_reduction),
 *       the GIL released: `steps` a 1-element int64 array, the steps begun (read and written back),
 *       watch(step, waited_s) called with the GIL only while the sums wait longer than a slice
 *       (it raises to give up: a rank exited, failed, moved on, or the timeout);
 *   an object with begin(step), ready(bucket), finish(loss) -> the ranks' loss: a transport that
 *       exists only in Python (torch.distributed), called back with the GIL for the reduction only.
 * The first exception a callback raises stops the steps and is raised by train_steps. */
typedef struct {
    PyObject *obj, *watch;                        /* borrowed */
    int rank;                                     /* the host sum's */
    PyObject *error_type, *error_value, *error_tb;
    ft_host_sum_loop hs;
} loop_reduction;

static ft_status keep_error(loop_reduction *r) {   /* with the GIL and an exception set */
    if (!r->error_type) PyErr_Fetch(&r->error_type, &r->error_value, &r->error_tb);
    else PyErr_Clear();
    return ft_error(FT_ERR_INVALID_ARGUMENT, "the gradient reduction raised an exception");
}

static ft_status py_begin(void *ctx, uint64_t step) {
    loop_reduction *r = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *res = PyObject_CallMethod(r->obj, "begin", "K", (unsigned long long)step);
    ft_status st = res ? FT_OK : keep_error(r);
    Py_XDECREF(res);
    PyGILState_Release(g);
    return st;
}

static void py_ready(void *ctx, size_t bucket) {
    loop_reduction *r = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    if (!r->error_type) {
        PyObject *res = PyObject_CallMethod(r->obj, "ready", "n", (Py_ssize_t)bucket);
        if (res) Py_DECREF(res);
        else (void)keep_error(r);
    }
    PyGILState_Release(g);
}

static ft_status py_finish(void *ctx, double loss, double *total) {
    loop_reduction *r = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    ft_status st = FT_OK;
    if (r->error_type) {
        st = ft_error(FT_ERR_INVALID_ARGUMENT, "the gradient reduction raised an exception");
    } else {
        PyObject *res = PyObject_CallMethod(r->obj, "finish", "d", loss);
        const double t = res ? PyFloat_AsDouble(res) : -1.0;
        if (!res || (t == -1.0 && PyErr_Occurred())) st = keep_error(r);
        else *total = t;
        Py_XDECREF(res);
    }
    PyGILState_Release(g);
    return st;
}

static ft_status hs_watch(void *arg, int64_t step, double waited_s) {
    loop_reduction *r = arg;
    PyGILState_STATE g = PyGILState_Ensure();
    ft_status st = FT_OK;
    PyObject *res = PyErr_CheckSignals() < 0 ? NULL : PyObject_CallFunction(r->watch, "Ld", (long long)step, waited_s);
    if (!res) st = keep_error(r);
    Py_XDECREF(res);
    PyGILState_Release(g);
    return st;
}

static void hs_dismiss(void *arg) {   /* the sums completed after all: the watch's exception is void */
    loop_reduction *r = arg;
    PyGILState_STATE g = PyGILState_Ensure();
    Py_CLEAR(r->error_type);
    Py_CLEAR(r->error_value);
    Py_CLEAR(r->error_tb);
    PyGILState_Release(g);
}

/* reduction=... (above) into *out; 0 with an exception. *steps: the host sum's count to write back. */
static int parse_reduction(PyObject *o, loop_reduction *r, ft_train_reduction *out, int64_t **steps) {
    *steps = NULL;
    if (PyTuple_Check(o)) {
        PyObject *h, *so, *watch;
        if (!PyArg_ParseTuple(o, "OOO", &h, &so, &watch)) return 0;
        ft_host_sum *hs = ft_py_host_sum_of(h, &r->rank);
        if (!hs) {
            ft_py_fail(ft_errors.input_type, "reduction=(host_sum, steps, watch) needs a connected fasttran._C.HostSum");
            return 0;
        }
        if (!PyCallable_Check(watch)) {
            ft_py_fail(ft_errors.input_type, "reduction=(host_sum, steps, watch): watch must be callable");
            return 0;
        }
        if (!(*steps = host_exact(so, "the reduction's steps", NPY_INT64, 1, 1, NULL))) return 0;
        r->watch = watch;
        r->hs = (ft_host_sum_loop){.h = hs, .step = **steps, .slice_s = 0.5, .watch = hs_watch,
                                   .dismiss = hs_dismiss, .watch_arg = r};
        *out = ft_host_sum_reduction(&r->hs);
        return 1;
    }
    static const char *methods[] = {"begin", "ready", "finish"};
    for (int k = 0; k < 3; k++) {
        PyObject *m = PyObject_GetAttrString(o, methods[k]);
        const int ok = m && PyCallable_Check(m);
        Py_XDECREF(m);
        if (!ok) {
            PyErr_Clear();
            ft_py_fail(ft_errors.input_type, "reduction must have begin(step), ready(bucket) and finish(loss), or be "
                       "(host_sum, steps, watch)");
            return 0;
        }
    }
    r->obj = o;
    *out = (ft_train_reduction){py_begin, py_ready, py_finish, r};
    return 1;
}

/* a host array `o` of `npy`, C-contiguous, exactly `need` elements (need < 0: any), named `what` */
static void *host_exact(PyObject *o, const char *what, int npy, int64_t need, int writeable, int64_t *size) {
    PyArrayObject *a = ft_py_want_array(o, what, npy, -1, writeable);
    if (!a) return NULL;
    if (need >= 0 && (int64_t)PyArray_SIZE(a) != need) {
        ft_py_fail(ft_errors.input, "%s has %lld elements, %lld expected", what, (long long)PyArray_SIZE(a),
                   (long long)need);
        return NULL;
    }
    if (size) *size = (int64_t)PyArray_SIZE(a);
    return PyArray_DATA(a);
}

/* train_steps(optimizer, groups, grads, max_grad_norm, check_finite, x, lengths, examples, targets,
 *             denominators, lrs, seed, first_step, losses, logits=None, every=0, phase=0, callback=None,
 *             cache=None, index=None, valid=None, scaler=None)
 *   -> (done, stop, message): ft_model_train_steps over the steps the arrays lay out (see
 *   fasttran.h); stop 0 all done, 1 non-finite loss at step `done`, 2 the optimizer refused step
 *   `done` (message: its error), 3 the callback stopped after `done` steps. */
static PyObject *Model_train_steps(Model *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"optimizer", "groups", "grads", "max_grad_norm", "check_finite", "x", "lengths",
                             "examples", "targets", "denominators", "lrs", "seed", "first_step", "losses", "logits",
                             "every", "phase", "callback", "cache", "index", "valid", "scaler", "place", "reduction",
                             "ids", "types", NULL};
    PyObject *opt_o, *groups, *grads, *xo, *lo, *eo, *to, *do_, *ro, *so, *zo = Py_None, *cb = Py_None;
    PyObject *cache_o = Py_None, *index_o = Py_None, *valid_o = Py_None, *scaler_o = Py_None;
    PyObject *place_o = Py_None, *red_o = Py_None, *ids_o = Py_None, *types_o = Py_None;
    double max_norm;
    int check_finite;
    unsigned long long seed, first_step;
    long long every = 0, phase = 0;
    if (!ready_model(self) ||
        !PyArg_ParseTupleAndKeywords(args, kw, "OOOdpOOOOOOKKO|OLLOOOOOOOOO", kwlist, &opt_o, &groups, &grads, &max_norm,
                                     &check_finite, &xo, &lo, &eo, &to, &do_, &ro, &seed, &first_step, &so, &zo,
                                     &every, &phase, &cb, &cache_o, &index_o, &valid_o, &scaler_o, &place_o, &red_o,
                                     &ids_o, &types_o))
        return NULL;
    const int reducing = red_o != Py_None;
    if (cb != Py_None && !PyCallable_Check(cb)) return ft_py_fail(ft_errors.input_type, "callback must be callable or None");
    int64_t n_lengths, n_examples;
    const int32_t *lengths = host_exact(lo, "lengths", NPY_INT32, -1, 0, &n_lengths);
    const int64_t *examples = lengths ? host_exact(eo, "examples", NPY_INT64, -1, 0, &n_examples) : NULL;
    if (!examples) return NULL;
    if (n_examples < 1 || examples[0] != 0 || examples[n_examples - 1] != n_lengths)
        return ft_py_fail(ft_errors.input, "examples must run from 0 to the number of lengths (%lld)",
                          (long long)n_lengths);
    const int64_t steps = n_examples - 1;
    int64_t N = 0, n_targets = 0, n_logits = 0;
    for (int64_t k = 0; k < steps; k++) {
        const int64_t B = examples[k + 1] - examples[k];
        if (B < 0 || (B == 0 && !reducing))   /* an empty slice of a global batch: only with a reduction */
            return ft_py_fail(ft_errors.input, "step %lld has no examples", (long long)k);
        int64_t n = 0;
        for (int64_t i = examples[k]; i < examples[k + 1]; i++) {
            if (lengths[i] < 1)
                return ft_py_fail(ft_errors.input, "example %lld has %d rows; each needs at least one", (long long)i,
                                  lengths[i]);
            n += lengths[i];
        }
        N += n;
        n_targets += ft_head_target_count(&self->head, B, n);
        n_logits += ft_head_logits_count(&self->head, B, n);
    }
    ft_py_buf x = {0};
    ft_cache *cache = NULL;
    const int64_t *index = NULL;
    const int32_t *ids = NULL, *types = NULL;
    if ((xo != Py_None) + (cache_o != Py_None) + (ids_o != Py_None) != 1 || (cache_o == Py_None) != (index_o == Py_None))
        return ft_py_fail(ft_errors.input, "train_steps takes x, or a cache and the index of every example in it, or "
                          "(layers that train the embeddings) the rows' token ids");
    if (ids_o != Py_None) {   /* every step's rows as tokens: host int32, one step after another */
        if (!(ids = host_exact(ids_o, "ids", NPY_INT32, N, 0, NULL))) return NULL;
        if (types_o != Py_None && !(types = host_exact(types_o, "types", NPY_INT32, N, 0, NULL))) return NULL;
    } else if (cache_o != Py_None) {   /* each step's rows read from the cache into the model's memory */
        if (!(cache = ft_py_cache_from(cache_o))) return NULL;
        if (!(index = host_exact(index_o, "index", NPY_INT64, n_lengths, 0, NULL))) return NULL;
        for (int64_t i = 0; i < n_lengths; i++) {
            const int64_t rows = ft_cache_rows_of(cache, index[i]);
            if (rows < 0)
                return ft_py_fail(ft_errors.input, "index[%lld] = %lld is not an example of the cache (0..%lld)",
                                  (long long)i, (long long)index[i], (long long)ft_cache_examples(cache) - 1);
            if (rows != lengths[i])
                return ft_py_fail(ft_errors.input, "lengths[%lld] = %d, but cache example %lld has %lld rows",
                                  (long long)i, lengths[i], (long long)index[i], (long long)rows);
        }
        const ft_status readable = ft_cache_check_readable(cache, NULL);
        if (readable != FT_OK) return ft_py_raise_cache(readable);
    } else {
        if (!ft_py_get_buf(xo, "x", -1, FT_F32, 0, 0, &x)) return NULL;
        if (x.device.kind != self->device.kind ||
            (x.device.kind == FT_DEVICE_CUDA && x.device.index != self->device.index))
            return ft_py_fail(ft_errors.input, "the batches are on another device than the model");
        if (x.numel != N * self->hidden)
            return ft_py_fail(ft_errors.input, "x has %lld elements; %lld rows of width %lld expected",
                              (long long)x.numel, (long long)N, (long long)self->hidden);
    }
    const int fl = ft_head_float_targets(&self->head);
    const void *targets = host_exact(to, "targets", fl ? NPY_FLOAT32 : NPY_INT32, n_targets, 0, NULL);
    const double *denom = targets ? host_exact(do_, "denominators", NPY_FLOAT64, steps, 0, NULL) : NULL;
    const double *lrs = denom ? host_exact(ro, "lrs", NPY_FLOAT64, steps, 0, NULL) : NULL;
    double *losses = lrs ? host_exact(so, "losses", NPY_FLOAT64, steps, 1, NULL) : NULL;
    if (!losses) return NULL;
    float *logits = NULL;
    if (zo != Py_None && !(logits = host_exact(zo, "logits", NPY_FLOAT32, n_logits, 1, NULL))) return NULL;
    const int masked = (ft_head_needs(&self->head) & FT_HEAD_NEEDS_MASK) != 0;
    if (masked != (valid_o != Py_None))
        return ft_py_fail(ft_errors.input, masked ? "the %s head needs valid: its row mask, a float32 per row"
                                                  : "the %s head takes no row mask (valid)",
                          ft_head_kind_name((int)self->head.kind));
    const float *valid = masked ? host_exact(valid_o, "valid", NPY_FLOAT32, N, 0, NULL) : NULL;
    if (masked && !valid) return NULL;
    /* float16 loss scaling: (scale, clean steps, growth steps, max scale, skipped steps), read and
     * written back */
    double *sc = NULL;
    ft_loss_scaler scaler = {0};
    if (scaler_o != Py_None) {
        if (!(sc = host_exact(scaler_o, "scaler", NPY_FLOAT64, 5, 1, NULL))) return NULL;
        if (!(sc[0] > 0.0 && isfinite(sc[0]) && sc[3] > 0.0 && isfinite(sc[3])) || !(sc[1] >= 0.0) || !(sc[2] >= 1.0) ||
            !(sc[4] >= 0.0) || sc[1] != floor(sc[1]) || sc[2] != floor(sc[2]) || sc[4] != floor(sc[4]) ||
            sc[1] > 9e15 || sc[2] > 9e15 || sc[4] > 9e15)
            return ft_py_fail(ft_errors.input, "scaler must be (scale > 0, clean steps >= 0, growth steps >= 1, "
                              "max scale > 0, skipped steps >= 0), finite, whole counts, got (%g, %g, %g, %g, %g)",
                              sc[0], sc[1], sc[2], sc[3], sc[4]);
        scaler = (ft_loss_scaler){sc[0], sc[3], (int64_t)sc[1], (int64_t)sc[2], (int64_t)sc[4]};
    }
    for (int64_t k = 0; k < steps; k++) {
        if (!(denom[k] > 0.0) || !isfinite(denom[k]) || !(lrs[k] >= 0.0) || !isfinite(lrs[k]))
            return ft_py_fail(ft_errors.input, "step %lld: the denominator must be > 0 and the lr >= 0, both finite",
                              (long long)k);
    }
    const int64_t *place = NULL;
    if (place_o != Py_None && !(place = host_exact(place_o, "place", NPY_INT64, 3 * steps, 0, NULL))) return NULL;
    for (int64_t k = 0; place && k < 3 * steps; k++)
        if (place[k] < 0) return ft_py_fail(ft_errors.input, "place[%lld] = %lld < 0", (long long)k, (long long)place[k]);
    loop_reduction lr = {0};
    ft_train_reduction red;
    int64_t *red_steps = NULL;
    if (reducing && !parse_reduction(red_o, &lr, &red, &red_steps)) return NULL;
    ft_optim_table *table;
    ft_optim_config cfg;
    int r = ft_py_optim_prepare(opt_o, groups, grads, max_norm, check_finite, &table, &cfg);
    if (r < 0) return ft_py_fail(ft_errors.input, "the optimizer's groups no longer hold its table's parameters");
    if (r == 0) return NULL;
    const ft_train_plan plan = {steps, x.data, lengths, examples, targets, denom, lrs, seed, first_step, cache, index,
                                valid, scaler, place, reducing ? &red : NULL, ids, types};
    ft_train_result res = {.loss = losses, .logits = logits, .stop = FT_TRAIN_DONE, .scaler = scaler};
    res.info.bad_tensor = -1;
    steps_hook hook = {cb, NULL, NULL, NULL};
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_model_train_steps(self->model, table, &cfg, &plan, every, phase, on_steps, &hook, &res);
    Py_END_ALLOW_THREADS
    if (sc) {
        sc[0] = res.scaler.scale;
        sc[1] = (double)res.scaler.good;
        sc[4] = (double)res.scaler.skipped;
    }
    if (red_steps) *red_steps = lr.hs.step;
    if (lr.error_type) {   /* the reduction's exception is what stopped the steps */
        PyObject *none = ft_py_optim_finish(opt_o, st, &res.info);
        Py_XDECREF(none);
        PyErr_Clear();
        ft_clear_error();
        Py_XDECREF(hook.error_type); Py_XDECREF(hook.error_value); Py_XDECREF(hook.error_tb);
        PyErr_Restore(lr.error_type, lr.error_value, lr.error_tb);
        return NULL;
    }
    if (st != FT_OK && lr.hs.failed) {   /* the sums themselves: the ranks' steps disagree */
        char text[1024];   /* as SharedMemorySum._call says it */
        snprintf(text, sizeof text, "rank %d: %s", lr.rank, ft_last_error());
        PyObject *none = ft_py_optim_finish(opt_o, st, &res.info);
        Py_XDECREF(none);
        PyErr_Clear();
        ft_clear_error();
        Py_XDECREF(hook.error_type); Py_XDECREF(hook.error_value); Py_XDECREF(hook.error_tb);
        PyObject *errors = PyImport_ImportModule("fasttran.errors");
        PyObject *cls = errors ? PyObject_GetAttrString(errors, "CollectiveError") : NULL;
        if (cls) PyErr_SetString(cls, text);
        Py_XDECREF(cls); Py_XDECREF(errors);
        return NULL;
    }
    PyObject *message = NULL;
    if (st == FT_OK && res.stop == FT_TRAIN_REFUSED) {
        /* the optimizer's own exception (naming the tensor), as its step() raises it, as a message */
        PyObject *none = ft_py_optim_finish(opt_o, FT_ERR_INVALID_ARGUMENT, &res.info);
        Py_XDECREF(none);
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        message = v ? PyObject_Str(v) : NULL;
        Py_XDECREF(t); Py_XDECREF(v); Py_XDECREF(tb);
        if (!message) return NULL;
    } else {
        PyObject *first = ft_py_optim_finish(opt_o, st, &res.info);
        if (!first) {
            Py_XDECREF(hook.error_type); Py_XDECREF(hook.error_value); Py_XDECREF(hook.error_tb);
            return NULL;
        }
        Py_DECREF(first);
    }
    if (hook.error_type) {
        Py_XDECREF(message);
        PyErr_Restore(hook.error_type, hook.error_value, hook.error_tb);
        return NULL;
    }
    if (!message) message = Py_NewRef(Py_None);
    return Py_BuildValue("LiN", (long long)res.done, (int)res.stop, message);
}

static PyMethodDef Model_methods[] = {
    {"buckets", (PyCFunction)Model_buckets, METH_NOARGS,
     "(buckets, 2) int64 (offset, floats) of the gradient buckets: the head, then the top layer down to the bottom one."},
    {"write_params", (PyCFunction)Model_write_params, METH_VARARGS, "write_params(offset, float32 array)."},
    {"read_params", (PyCFunction)Model_read_params, METH_VARARGS, "read_params(offset, n) -> float32 array (host)."},
    {"reserve", (PyCFunction)Model_reserve, METH_VARARGS, "reserve(B, N): per-batch buffers for this size now."},
    {"allocated", (PyCFunction)Model_allocated, METH_NOARGS, "bytes held: parameters, gradients, buffers."},
    {"idle", (PyCFunction)(void (*)(void))Model_idle, METH_VARARGS | METH_KEYWORDS,
     "idle(ready=None) -> 0.0: a step without examples; every gradient 0, each bucket still handed to ready."},
    {"step", (PyCFunction)(void (*)(void))Model_step, METH_VARARGS | METH_KEYWORDS,
     "step(x, lengths, targets, valid=None, denominator=0, seed=0, step=0, row_base=0, seq_base=0, sq_base=0, "
     "loss_scale=1.0, logits=None, ready=None) -> loss: forward, loss and every gradient."},
    {"train_steps", (PyCFunction)(void (*)(void))Model_train_steps, METH_VARARGS | METH_KEYWORDS,
     "train_steps(optimizer, groups, grads, max_grad_norm, check_finite, x, lengths, examples, targets, denominators, "
     "lrs, seed, first_step, losses, logits=None, every=0, phase=0, callback=None, cache=None, index=None, valid=None, "
     "scaler=None, place=None, reduction=None) -> (done, stop, message): many training steps (model step + optimizer step each) in one call, the "
     "GIL released; x None: each step's rows read from the CacheStore `cache` (examples `index`) into the model's "
     "memory; valid: every row's mask, for a head that needs one (QA); scaler: float16 loss scaling, float64 (scale, "
     "clean steps, growth steps, max scale, skipped steps), updated in place; place: (steps, 3) int64, each step's rows, "
     "sequences and sum of n^2 before it in its global batch; reduction: the data-parallel gradient reduction between "
     "each backward and optimizer step -- (HostSum, steps, watch) in C, or an object with begin / ready / finish "
     "called back -- with which a step may have no examples."},
    {"forward", (PyCFunction)(void (*)(void))Model_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(x, lengths, logits, valid=None): the logits, no dropout."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Model_getset[] = {
    {"params", (getter)Model_flat, NULL, "the flat parameter table (layers, then head), a float32 Tensor", NULL},
    {"grads", (getter)Model_flat, NULL, "the flat gradient table, a float32 Tensor", (void *)1},
    {"head_offset", (getter)Model_head_offset, NULL, "where the head's parameters start in the table", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot Model_slots[] = {
    {Py_tp_dealloc, Model_dealloc}, {Py_tp_init, Model_init}, {Py_tp_new, PyType_GenericNew},
    {Py_tp_methods, Model_methods}, {Py_tp_getset, Model_getset},
    {Py_tp_doc, "Model(head_config, layers=None, device_index=-1, shared_grads=False): [frozen features] -> "
                "[LayerStack] -> task head (shared_grads: its own gradient table in shared memory; with layers, "
                "theirs is the model's)"},
    {0, NULL}};

static PyType_Spec Model_spec = {"fasttran._C.Model", sizeof(Model), 0, Py_TPFLAGS_DEFAULT, Model_slots};

int ft_py_add_model_type(PyObject *m) {
    PyObject *tp = PyType_FromModuleAndSpec(m, &Model_spec, NULL);
    if (!tp) return -1;
    int r = PyModule_AddObjectRef(m, "Model", tp);
    Py_DECREF(tp);
    return r;
}
