/* fasttran._C.Tensor: a strided view of memory on the CPU or a CUDA device that speaks DLPack
 * in both directions.
 *
 *  - Export: __dlpack__(stream=None, max_version=None, dl_device=None, copy=None) hands out a
 *    versioned capsule ("dltensor_versioned", DLPack 1.x) when the consumer passes
 *    max_version >= (1, 0), else the legacy "dltensor" capsule. The capsule holds a reference
 *    to the Tensor, so the memory outlives every Python reference to its producer (an Encoder
 *    deleted while torch still holds its output is fine). Data is complete when a Tensor is
 *    handed out (the producer synchronised its stream), so any consumer stream may read it.
 *  - Import: Tensor.from_dlpack(obj, stream=None) consumes a producer's capsule and wraps its
 *    memory in place; the producer's deleter runs when the Tensor dies.
 *
 * Memory is released by an owner-specific callback (encoder device memory, malloc'd copies, a
 * consumed DLPack capsule), always with the GIL held. */
#include "binding.h"
#include "dlpack_abi.h"

#define FT_TENSOR_MAXDIM 8

typedef struct {
    PyObject_HEAD
    void *data;
    int ndim;
    int64_t shape[FT_TENSOR_MAXDIM];
    int64_t strides[FT_TENSOR_MAXDIM];   /* elements */
    ft_dtype dtype;
    ft_device device;
    int readonly;
    PyObject *owner;                     /* kept alive while the memory is in use */
    ft_py_release_fn release;            /* frees data (may be NULL: the owner frees it) */
    void *release_ctx;
} TensorObject;

static PyTypeObject *tensor_type;

/* ---- dtype / device mapping --------------------------------------------------------------- */

static int dl_from_ft(ft_dtype dt, DLDataType *out) {
    static const struct { uint8_t code, bits; } map[FT_DTYPE_COUNT] = {
        [FT_F32] = {kDLFloat, 32}, [FT_F16] = {kDLFloat, 16}, [FT_BF16] = {kDLBfloat, 16},
        [FT_I64] = {kDLInt, 64},   [FT_I32] = {kDLInt, 32},   [FT_I16] = {kDLInt, 16},
        [FT_I8] = {kDLInt, 8},     [FT_U8] = {kDLUInt, 8},    [FT_BOOL] = {kDLBool, 8},
        [FT_F64] = {kDLFloat, 64}};
    if ((int)dt < 0 || dt >= FT_DTYPE_COUNT) return 0;
    out->code = map[dt].code;
    out->bits = map[dt].bits;
    out->lanes = 1;
    return 1;
}

static int ft_from_dl(DLDataType d, ft_dtype *out) {
    for (int k = 0; k < FT_DTYPE_COUNT; k++) {
        DLDataType m;
        dl_from_ft((ft_dtype)k, &m);
        if (m.code == d.code && m.bits == d.bits && d.lanes == 1) { *out = (ft_dtype)k; return 1; }
    }
    return 0;
}

static int npy_from_ft(ft_dtype dt) {
    switch (dt) {
    case FT_F32: return NPY_FLOAT32;
    case FT_F16: return NPY_FLOAT16;
    case FT_F64: return NPY_FLOAT64;
    case FT_I64: return NPY_INT64;
    case FT_I32: return NPY_INT32;
    case FT_I16: return NPY_INT16;
    case FT_I8: return NPY_INT8;
    case FT_U8: return NPY_UINT8;
    case FT_BOOL: return NPY_BOOL;
    default: return -1;
    }
}

static DLDevice dl_device_of(ft_device d) {
    DLDevice o = {d.kind == FT_DEVICE_CPU ? kDLCPU : kDLCUDA, d.kind == FT_DEVICE_CPU ? 0 : d.index};
    return o;
}

static int64_t numel(const TensorObject *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

static int is_c_contiguous(const TensorObject *t) {
    int64_t want = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] != 1 && t->strides[d] != want) return 0;
        want *= t->shape[d];
    }
    return 1;
}

/* ---- construction ------------------------------------------------------------------------- */

PyObject *ft_py_tensor_new(void *data, int ndim, const int64_t *shape, const int64_t *strides, ft_dtype dtype,
                           ft_device device, int readonly, PyObject *owner, ft_py_release_fn release,
                           void *release_ctx) {
    if (ndim < 0 || ndim > FT_TENSOR_MAXDIM) {
        if (release) release(owner, release_ctx, data);
        return ft_py_fail(ft_errors.input, "tensors have at most %d dimensions, got %d", FT_TENSOR_MAXDIM, ndim);
    }
    TensorObject *t = PyObject_New(TensorObject, tensor_type);
    if (!t) {
        if (release) release(owner, release_ctx, data);
        return NULL;
    }
    t->data = data;
    t->ndim = ndim;
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        t->shape[d] = shape[d];
        t->strides[d] = strides ? strides[d] : s;
        s *= shape[d];
    }
    t->dtype = dtype;
    t->device = device;
    t->readonly = readonly;
    t->owner = Py_XNewRef(owner);
    t->release = release;
    t->release_ctx = release_ctx;
    return (PyObject *)t;
}

PyObject *ft_py_flat_tensor(PyObject *owner, float *data, int64_t n, ft_device device) {
    int64_t shape[1] = {n};
    return ft_py_tensor_new(data, 1, shape, NULL, FT_F32, device, 0, owner, NULL, NULL);
}

int ft_py_tensor_check(PyObject *obj) { return obj && PyObject_TypeCheck(obj, tensor_type); }

void *ft_py_tensor_data(PyObject *obj, int *ndim, const int64_t **shape, const int64_t **strides, ft_dtype *dtype,
                        ft_device *device) {
    TensorObject *t = (TensorObject *)obj;
    *ndim = t->ndim;
    *shape = t->shape;
    *strides = t->strides;
    *dtype = t->dtype;
    *device = t->device;
    return t->data;
}

int ft_py_tensor_readonly(PyObject *obj) { return ((TensorObject *)obj)->readonly; }

static void Tensor_dealloc(TensorObject *t) {
    PyTypeObject *tp = Py_TYPE(t);
    if (t->release) t->release(t->owner, t->release_ctx, t->data);
    Py_XDECREF(t->owner);
    PyObject_Free(t);
    Py_DECREF(tp);
}

static void release_malloc(PyObject *owner, void *ctx, void *data) { (void)owner; (void)data; free(ctx); }

/* ---- export ------------------------------------------------------------------------------- */

typedef struct {
    DLManagedTensor legacy;
    DLManagedTensorVersioned versioned;
    int64_t shape[FT_TENSOR_MAXDIM], strides[FT_TENSOR_MAXDIM];
    PyObject *tensor;        /* the Tensor whose memory this is */
} export_ctx;

static void export_free(export_ctx *x) {
    if (!x) return;
    if (Py_IsInitialized()) {   /* consumers may drop their tensor from any thread */
        PyGILState_STATE g = PyGILState_Ensure();
        Py_XDECREF(x->tensor);
        PyGILState_Release(g);
    }
    free(x);
}
static void deleter_legacy(DLManagedTensor *m) { export_free(m->manager_ctx); }
static void deleter_versioned(DLManagedTensorVersioned *m) { export_free(m->manager_ctx); }

/* A capsule nobody consumed still owns its tensor. */
static void capsule_legacy_dtor(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, "dltensor")) return;   /* "used_dltensor": the consumer owns it */
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m && m->deleter) m->deleter(m);
}
static void capsule_versioned_dtor(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, "dltensor_versioned")) return;
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (m && m->deleter) m->deleter(m);
}

static PyObject *buffer_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (msg) { PyErr_SetObject(PyExc_BufferError, msg); Py_DECREF(msg); }
    return NULL;
}

static PyObject *host_copy(TensorObject *t);

static PyObject *Tensor_dlpack(TensorObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO", kwlist, &stream, &max_version, &dl_device, &copy))
        return NULL;
    int versioned = 0;
    if (max_version != Py_None) {
        long major;
        if (!PyTuple_Check(max_version) || PyTuple_GET_SIZE(max_version) != 2 ||
            ((major = PyLong_AsLong(PyTuple_GET_ITEM(max_version, 0))) == -1 && PyErr_Occurred()))
            return ft_py_fail(ft_errors.input_type, "max_version must be a (major, minor) tuple of ints");
        versioned = major >= 1;
    }
    int want_copy = copy == Py_None ? -1 : PyObject_IsTrue(copy);
    if (want_copy < -1 || (copy != Py_None && want_copy < 0)) return NULL;
    DLDevice here = dl_device_of(self->device);
    TensorObject *src = self;
    PyObject *copied = NULL;
    if (dl_device != Py_None) {
        int dtype_, did;
        if (!PyArg_ParseTuple(dl_device, "ii", &dtype_, &did))
            return ft_py_fail(ft_errors.input_type, "dl_device must be a (device_type, device_id) tuple");
        if (dtype_ != here.device_type || did != here.device_id) {
            if (dtype_ != kDLCPU || want_copy == 0)
                return buffer_error("this tensor lives on DLPack device (%d, %d) and cannot be exported to (%d, %d)%s",
                                    here.device_type, here.device_id, dtype_, did,
                                    want_copy == 0 ? " without a copy (copy=False)" : "");
            if (!(copied = host_copy(self))) return NULL;   /* device -> CPU copy on request */
            src = (TensorObject *)copied;
        }
    }
    if (want_copy == 1 && !copied) {
        if (self->device.kind != FT_DEVICE_CPU)
            return buffer_error("copy=True is supported for CPU tensors or with dl_device=(1, 0); copy on the consumer's side");
        if (!(copied = host_copy(self))) return NULL;
        src = (TensorObject *)copied;
    }
    if (src->device.kind == FT_DEVICE_CPU && stream != Py_None && !copied) {
        return buffer_error("stream must be None for a CPU tensor, got %R", stream);
    }
    if (src->device.kind == FT_DEVICE_CUDA && stream != Py_None && !PyLong_Check(stream))
        return buffer_error("stream must be None or an int for a CUDA tensor, got %R", stream);
    /* CUDA: the producer synchronised before handing the tensor out, so every consumer stream
     * (including -1, "no synchronisation") sees complete data: nothing to record here. */

    export_ctx *x = calloc(1, sizeof *x);
    if (!x) { Py_XDECREF(copied); return PyErr_NoMemory(); }
    DLTensor *dl = versioned ? &x->versioned.dl_tensor : &x->legacy.dl_tensor;
    dl->data = src->data;
    dl->device = dl_device_of(src->device);
    dl->ndim = src->ndim;
    if (!dl_from_ft(src->dtype, &dl->dtype)) { free(x); Py_XDECREF(copied); return ft_py_fail(ft_errors.base, "bad dtype"); }
    for (int d = 0; d < src->ndim; d++) { x->shape[d] = src->shape[d]; x->strides[d] = src->strides[d]; }
    dl->shape = x->shape;
    dl->strides = x->strides;
    dl->byte_offset = 0;
    x->tensor = copied ? copied : Py_NewRef((PyObject *)self);
    PyObject *cap;
    if (versioned) {
        x->versioned.version.major = FT_DLPACK_MAJOR;
        x->versioned.version.minor = FT_DLPACK_MINOR;
        x->versioned.manager_ctx = x;
        x->versioned.deleter = deleter_versioned;
        x->versioned.flags = (src->readonly ? FT_DLPACK_FLAG_READ_ONLY : 0) | (copied ? FT_DLPACK_FLAG_IS_COPIED : 0);
        cap = PyCapsule_New(&x->versioned, "dltensor_versioned", capsule_versioned_dtor);
    } else {
        x->legacy.manager_ctx = x;
        x->legacy.deleter = deleter_legacy;
        cap = PyCapsule_New(&x->legacy, "dltensor", capsule_legacy_dtor);
    }
    if (!cap) export_free(x);
    return cap;
}

static PyObject *Tensor_dlpack_device(TensorObject *self, PyObject *unused) {
    (void)unused;
    DLDevice d = dl_device_of(self->device);
    return Py_BuildValue("(ii)", d.device_type, d.device_id);
}

/* ---- import ------------------------------------------------------------------------------- */

typedef struct {
    DLManagedTensor *legacy;
    DLManagedTensorVersioned *versioned;
} imported;

static void release_imported(PyObject *owner, void *ctx, void *data) {
    (void)owner; (void)data;
    imported *im = ctx;
    if (im->versioned && im->versioned->deleter) im->versioned->deleter(im->versioned);
    if (im->legacy && im->legacy->deleter) im->legacy->deleter(im->legacy);
    free(im);
}

/* Tensor.from_dlpack(obj, stream=None): wrap a DLPack producer's memory in place. `stream` is
 * passed to the producer for CUDA tensors (the stream the caller will read on). */
static PyObject *Tensor_from_dlpack(PyObject *cls, PyObject *args, PyObject *kw) {
    (void)cls;
    static char *kwlist[] = {"obj", "stream", NULL};
    PyObject *obj, *stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", kwlist, &obj, &stream)) return NULL;
    return ft_py_tensor_import(obj, stream);
}

PyObject *ft_py_tensor_import(PyObject *obj, PyObject *stream) {
    if (ft_py_tensor_check(obj)) return Py_NewRef(obj);
    PyObject *fn = PyObject_GetAttrString(obj, "__dlpack__");
    if (!fn) {
        PyErr_Clear();
        return ft_py_fail(ft_errors.input_type, "expected a DLPack tensor (an object with __dlpack__), got %s",
                          Py_TYPE(obj)->tp_name);
    }
    /* the stream argument only means something for device tensors */
    PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    int dev_type = kDLCPU;
    if (dev) {
        if (!PyArg_ParseTuple(dev, "i|i", &dev_type, &(int){0})) { Py_DECREF(dev); Py_DECREF(fn); return NULL; }
        Py_DECREF(dev);
    } else {
        PyErr_Clear();
    }
    PyObject *kwargs = Py_BuildValue("{s:(ii),s:O}", "max_version", FT_DLPACK_MAJOR, FT_DLPACK_MINOR, "stream",
                                     dev_type == kDLCPU ? Py_None : stream);
    PyObject *empty = PyTuple_New(0);
    PyObject *cap = kwargs && empty ? PyObject_Call(fn, empty, kwargs) : NULL;
    if (!cap && kwargs && empty && PyErr_ExceptionMatches(PyExc_TypeError)) {
        /* a producer from before DLPack 1.0 takes no max_version */
        PyErr_Clear();
        Py_DECREF(kwargs);
        kwargs = Py_BuildValue("{s:O}", "stream", dev_type == kDLCPU ? Py_None : stream);
        cap = kwargs ? PyObject_Call(fn, empty, kwargs) : NULL;
    }
    Py_XDECREF(empty);
    Py_XDECREF(kwargs);
    Py_DECREF(fn);
    if (!cap) return NULL;
    imported *im = calloc(1, sizeof *im);
    if (!im) { Py_DECREF(cap); return PyErr_NoMemory(); }
    DLTensor *dl = NULL;
    int readonly = 0;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        im->versioned = PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (im->versioned->version.major != 1) {
            unsigned major = im->versioned->version.major;
            free(im);   /* the capsule still owns the tensor and frees it */
            PyObject *r = ft_py_fail(ft_errors.unsupported, "DLPack major version %u is not supported (expected 1)", major);
            Py_DECREF(cap);
            return r;
        }
        PyCapsule_SetName(cap, "used_dltensor_versioned");
        dl = &im->versioned->dl_tensor;
        readonly = (im->versioned->flags & FT_DLPACK_FLAG_READ_ONLY) != 0;
    } else if (PyCapsule_IsValid(cap, "dltensor")) {
        im->legacy = PyCapsule_GetPointer(cap, "dltensor");
        PyCapsule_SetName(cap, "used_dltensor");
        dl = &im->legacy->dl_tensor;
    } else {
        free(im);
        Py_DECREF(cap);
        return ft_py_fail(ft_errors.input_type, "__dlpack__ of %s did not return a DLPack capsule", Py_TYPE(obj)->tp_name);
    }
    Py_DECREF(cap);   /* renamed: its destructor no longer frees the tensor; we do */
    ft_dtype dt;
    ft_device device = {FT_DEVICE_CPU, 0};
    const char *bad = NULL;
    if (!ft_from_dl(dl->dtype, &dt)) bad = "dtype";
    else if (dl->device.device_type == kDLCUDA) device = (ft_device){FT_DEVICE_CUDA, dl->device.device_id};
    else if (dl->device.device_type != kDLCPU && dl->device.device_type != kDLCUDAHost) bad = "device";
    if (!bad && (dl->ndim < 0 || dl->ndim > FT_TENSOR_MAXDIM)) bad = "ndim";
    if (bad) {
        PyObject *r = ft_py_fail(ft_errors.input_type,
                                 "cannot take this DLPack tensor: unsupported %s (dtype code %d bits %d lanes %d, device type %d, ndim %d)",
                                 bad, dl->dtype.code, dl->dtype.bits, dl->dtype.lanes, dl->device.device_type, dl->ndim);
        release_imported(NULL, im, NULL);
        return r;
    }
    char *data = (char *)dl->data + dl->byte_offset;
    return ft_py_tensor_new(data, dl->ndim, dl->shape, dl->strides, dt, device, readonly, NULL, release_imported, im);
}

/* ---- host copies and NumPy ---------------------------------------------------------------- */

/* A C-contiguous host copy (a new Tensor owning malloc'd memory). */
static PyObject *host_copy(TensorObject *t) {
    const size_t esz = ft_dtype_size(t->dtype);
    const int64_t n = numel(t);
    void *buf = malloc((size_t)n * esz + 1);
    if (!buf) return PyErr_NoMemory();
    ft_status st = FT_OK;
    if (t->device.kind == FT_DEVICE_CPU || is_c_contiguous(t)) {
        if (t->device.kind != FT_DEVICE_CPU) {
            Py_BEGIN_ALLOW_THREADS
            st = ft_device_read(t->device, buf, t->data, (size_t)n * esz);
            Py_END_ALLOW_THREADS
        } else if (is_c_contiguous(t)) {
            memcpy(buf, t->data, (size_t)n * esz);
        } else {
            /* strided gather, any layout */
            int64_t idx[FT_TENSOR_MAXDIM] = {0};
            char *o = buf;
            for (int64_t k = 0; k < n; k++) {
                int64_t off = 0;
                for (int d = 0; d < t->ndim; d++) off += idx[d] * t->strides[d];
                memcpy(o + (size_t)k * esz, (const char *)t->data + off * (int64_t)esz, esz);
                for (int d = t->ndim - 1; d >= 0; d--) { if (++idx[d] < t->shape[d]) break; idx[d] = 0; }
            }
        }
    } else {
        free(buf);
        return ft_py_fail(ft_errors.unsupported, "copying a non-contiguous CUDA tensor to the host is not supported");
    }
    if (st != FT_OK) { free(buf); return ft_py_raise(st); }
    ft_device cpu = {FT_DEVICE_CPU, 0};
    return ft_py_tensor_new(buf, t->ndim, t->shape, NULL, t->dtype, cpu, 0, NULL, release_malloc, buf);
}

static void release_device_memory(PyObject *owner, void *ctx, void *data) {
    (void)owner;
    ft_device dev = {FT_DEVICE_CUDA, (int)(intptr_t)ctx};
    ft_device_free(dev, data);
}

/* to(device): a contiguous copy on `device` ('cpu', 'cuda', 'cuda:N'); the tensor itself when it
 * is already there */
static PyObject *Tensor_to(TensorObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"device", NULL};
    const char *spec;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s", kwlist, &spec)) return NULL;
    ft_device dev = {FT_DEVICE_CPU, 0};
    int index = 0, used = 0;
    if (strcmp(spec, "cpu") == 0) {
        dev.kind = FT_DEVICE_CPU;
    } else if (strcmp(spec, "cuda") == 0 || (sscanf(spec, "cuda:%d%n", &index, &used) == 1 && spec[used] == '\0' &&
                                             index >= 0)) {
        dev.kind = FT_DEVICE_CUDA;
        dev.index = index;
    } else {
        return ft_py_fail(ft_errors.input, "device must be 'cpu', 'cuda' or 'cuda:N', got '%s'", spec);
    }
    if (dev.kind == self->device.kind && (dev.kind == FT_DEVICE_CPU || dev.index == self->device.index))
        return Py_NewRef((PyObject *)self);
    PyObject *host = host_copy(self);
    if (!host || dev.kind == FT_DEVICE_CPU) return host;
    TensorObject *h = (TensorObject *)host;
    const size_t bytes = (size_t)numel(h) * ft_dtype_size(h->dtype);
    void *p = NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_device_alloc(dev, bytes ? bytes : 1, &p);
    if (st == FT_OK && bytes) st = ft_device_write(dev, p, h->data, bytes);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) {
        if (p) ft_device_free(dev, p);
        Py_DECREF(host);
        return ft_py_raise(st);
    }
    PyObject *r = ft_py_tensor_new(p, h->ndim, h->shape, NULL, h->dtype, dev, 0, NULL, release_device_memory,
                                   (void *)(intptr_t)dev.index);
    Py_DECREF(host);
    return r;
}

/* view(offset, shape): a C-contiguous view of `shape` starting `offset` elements into a contiguous
 * tensor (its memory stays alive with the view); for the named parameters of a flat buffer */
static PyObject *Tensor_view(TensorObject *self, PyObject *args) {
    long long offset;
    PyObject *shape_o;
    if (!PyArg_ParseTuple(args, "LO", &offset, &shape_o)) return NULL;
    if (!is_c_contiguous(self)) return ft_py_fail(ft_errors.input, "view() needs a contiguous tensor");
    PyObject *seq = PySequence_Fast(shape_o, "view(): shape must be a sequence of sizes");
    if (!seq) return NULL;
    const Py_ssize_t nd = PySequence_Fast_GET_SIZE(seq);
    int64_t shape[FT_TENSOR_MAXDIM], n = 1;
    if (nd < 1 || nd > FT_TENSOR_MAXDIM) {
        Py_DECREF(seq);
        return ft_py_fail(ft_errors.input, "view(): 1 to %d dimensions, got %zd", FT_TENSOR_MAXDIM, nd);
    }
    for (Py_ssize_t d = 0; d < nd; d++) {
        shape[d] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, d));
        if (shape[d] < 0) {
            Py_DECREF(seq);
            if (!PyErr_Occurred()) ft_py_fail(ft_errors.input, "view(): negative size");
            return NULL;
        }
        n *= shape[d];
    }
    Py_DECREF(seq);
    if (offset < 0 || offset + n > numel(self))
        return ft_py_fail(ft_errors.input, "view(): elements [%lld, %lld) are outside this tensor's %lld", offset,
                          (long long)(offset + n), (long long)numel(self));
    char *data = (char *)self->data + offset * (int64_t)ft_dtype_size(self->dtype);
    return ft_py_tensor_new(data, (int)nd, shape, NULL, self->dtype, self->device, self->readonly, (PyObject *)self,
                            NULL, NULL);
}

/* numpy(): a view for CPU tensors (shares memory), a host copy for CUDA tensors */
static PyObject *Tensor_numpy(TensorObject *self, PyObject *unused) {
    (void)unused;
    int npy = npy_from_ft(self->dtype);
    if (npy < 0)
        return ft_py_fail(ft_errors.input_type,
                          "%s has no NumPy dtype; read it with torch.from_dlpack or ml_dtypes", ft_dtype_name(self->dtype));
    TensorObject *src = self;
    PyObject *copy = NULL;
    if (self->device.kind != FT_DEVICE_CPU) {
        if (!(copy = host_copy(self))) return NULL;
        src = (TensorObject *)copy;
    }
    npy_intp dims[FT_TENSOR_MAXDIM], strides[FT_TENSOR_MAXDIM];
    const npy_intp esz = (npy_intp)ft_dtype_size(src->dtype);
    for (int d = 0; d < src->ndim; d++) { dims[d] = (npy_intp)src->shape[d]; strides[d] = (npy_intp)src->strides[d] * esz; }
    PyArray_Descr *descr = PyArray_DescrFromType(npy);
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, src->ndim, dims, strides, src->data,
                                         src->readonly ? 0 : NPY_ARRAY_WRITEABLE, NULL);
    if (!arr) { Py_XDECREF(copy); return NULL; }
    if (PyArray_SetBaseObject((PyArrayObject *)arr, copy ? copy : Py_NewRef((PyObject *)self)) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

static PyObject *Tensor_array(TensorObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dtype", "copy", NULL};
    PyObject *dtype = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OO", kwlist, &dtype, &copy)) return NULL;
    /* NumPy 2's protocol: copy=True must give memory of its own (np.array(t) snapshots), copy=False
     * only a view (refused where there is none: a device tensor, a dtype change), None either */
    const int want_copy = copy != Py_None && PyObject_IsTrue(copy), no_copy = copy != Py_None && !want_copy;
    if (no_copy && self->device.kind != FT_DEVICE_CPU) {
        PyErr_SetString(PyExc_ValueError, "a CUDA tensor cannot be a NumPy array without a copy: use copy=True or .numpy()");
        return NULL;
    }
    PyObject *a = Tensor_numpy(self, NULL);
    if (!a) return NULL;
    if (dtype == Py_None) {
        if (!want_copy || self->device.kind != FT_DEVICE_CPU) return a;   /* a device tensor's array is a copy already */
        PyObject *r = PyObject_CallMethod(a, "copy", NULL);
        Py_DECREF(a);
        return r;
    }
    /* astype copies unless asked not to and the dtype is the same */
    PyObject *r = NULL, *astype = PyObject_GetAttrString(a, "astype"), *pos = PyTuple_Pack(1, dtype), *kws = PyDict_New();
    if (astype && pos && kws && PyDict_SetItemString(kws, "copy", no_copy ? Py_False : Py_True) == 0)
        r = PyObject_Call(astype, pos, kws);
    Py_XDECREF(astype);
    Py_XDECREF(pos);
    Py_XDECREF(kws);
    Py_DECREF(a);
    if (r && no_copy && PyArray_Check(r) && !PyArray_BASE((PyArrayObject *)r)) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_ValueError, "this dtype needs a copy of the tensor: use copy=True");
        return NULL;
    }
    return r;
}

/* ---- attributes and repr ------------------------------------------------------------------ */

static PyObject *Tensor_get_shape(TensorObject *self, void *c) {
    (void)c;
    PyObject *t = PyTuple_New(self->ndim);
    for (int d = 0; t && d < self->ndim; d++) PyTuple_SET_ITEM(t, d, PyLong_FromLongLong(self->shape[d]));
    return t;
}
static PyObject *Tensor_get_strides(TensorObject *self, void *c) {
    (void)c;
    PyObject *t = PyTuple_New(self->ndim);
    for (int d = 0; t && d < self->ndim; d++) PyTuple_SET_ITEM(t, d, PyLong_FromLongLong(self->strides[d]));
    return t;
}
static PyObject *Tensor_get_dtype(TensorObject *self, void *c) {
    (void)c;
    return PyUnicode_FromString(ft_dtype_name(self->dtype));
}
static PyObject *Tensor_get_device(TensorObject *self, void *c) {
    (void)c;
    if (self->device.kind == FT_DEVICE_CPU) return PyUnicode_FromString("cpu");
    return PyUnicode_FromFormat("cuda:%d", self->device.index);
}
static PyObject *Tensor_get_ndim(TensorObject *self, void *c) { (void)c; return PyLong_FromLong(self->ndim); }
static PyObject *Tensor_get_nbytes(TensorObject *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(numel(self) * (int64_t)ft_dtype_size(self->dtype));
}
static PyObject *Tensor_get_data_ptr(TensorObject *self, void *c) { (void)c; return PyLong_FromVoidPtr(self->data); }

static PyObject *Tensor_repr(TensorObject *self) {
    char shape[256];
    size_t n = 0;
    shape[n++] = '(';
    for (int d = 0; d < self->ndim && n < 200; d++)
        n += (size_t)snprintf(shape + n, sizeof shape - n, "%s%lld", d ? ", " : "", (long long)self->shape[d]);
    snprintf(shape + n, sizeof shape - n, self->ndim == 1 ? ",)" : ")");
    char dev[32];
    if (self->device.kind == FT_DEVICE_CPU) snprintf(dev, sizeof dev, "cpu");
    else snprintf(dev, sizeof dev, "cuda:%d", self->device.index);
    return PyUnicode_FromFormat("fasttran.Tensor(shape=%s, dtype=%s, device='%s')", shape, ft_dtype_name(self->dtype), dev);
}

static Py_ssize_t Tensor_len(TensorObject *self) {
    if (self->ndim == 0) { PyErr_SetString(PyExc_TypeError, "len() of a 0-d tensor"); return -1; }
    return (Py_ssize_t)self->shape[0];
}

static PyMethodDef Tensor_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))Tensor_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None): a DLPack capsule."},
    {"__dlpack_device__", (PyCFunction)Tensor_dlpack_device, METH_NOARGS, "(device_type, device_id)"},
    {"numpy", (PyCFunction)Tensor_numpy, METH_NOARGS, "A NumPy view (CPU) or host copy (CUDA)."},
    {"view", (PyCFunction)Tensor_view, METH_VARARGS, "view(offset, shape): a contiguous view into this tensor."},
    {"to", (PyCFunction)(void (*)(void))Tensor_to, METH_VARARGS | METH_KEYWORDS,
     "to(device): a contiguous copy on 'cpu', 'cuda' or 'cuda:N' (the tensor itself if already there)."},
    {"__array__", (PyCFunction)(void (*)(void))Tensor_array, METH_VARARGS | METH_KEYWORDS, "NumPy protocol."},
    {"from_dlpack", (PyCFunction)(void (*)(void))Tensor_from_dlpack, METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "from_dlpack(obj, stream=None): wrap a DLPack producer's memory in place."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Tensor_getset[] = {
    {"shape", (getter)Tensor_get_shape, NULL, "shape (tuple)", NULL},
    {"strides", (getter)Tensor_get_strides, NULL, "strides in elements (tuple)", NULL},
    {"dtype", (getter)Tensor_get_dtype, NULL, "element type name: 'float32', 'bfloat16', ...", NULL},
    {"device", (getter)Tensor_get_device, NULL, "'cpu' or 'cuda:N'", NULL},
    {"ndim", (getter)Tensor_get_ndim, NULL, "number of dimensions", NULL},
    {"nbytes", (getter)Tensor_get_nbytes, NULL, "bytes of the elements", NULL},
    {"data_ptr", (getter)Tensor_get_data_ptr, NULL, "address of the first element", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot Tensor_slots[] = {
    {Py_tp_dealloc, Tensor_dealloc},
    {Py_tp_methods, Tensor_methods},
    {Py_tp_getset, Tensor_getset},
    {Py_tp_repr, Tensor_repr},
    {Py_mp_length, Tensor_len},
    {Py_tp_doc, "A fasttran tensor on the CPU or a CUDA device; exchange it with torch.from_dlpack / "
                "cupy.from_dlpack / numpy.from_dlpack (zero-copy), or .numpy()."},
    {0, NULL}};

static PyType_Spec Tensor_spec = {"fasttran.Tensor", sizeof(TensorObject), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, Tensor_slots};

int ft_py_add_tensor_type(PyObject *m) {
    PyObject *tp = PyType_FromModuleAndSpec(m, &Tensor_spec, NULL);
    if (!tp) return -1;
    tensor_type = (PyTypeObject *)tp;   /* the module keeps it alive */
    int r = PyModule_AddObjectRef(m, "Tensor", tp);
    Py_DECREF(tp);
    return r;
}
