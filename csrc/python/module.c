/* fasttran._C: module init, the status -> exception mapping, build and runtime info. */
#define FT_BINDING_MAIN
#include "binding.h"

#include "backend.h"

ft_py_errors ft_errors;

PyObject *ft_py_fail(PyObject *cls, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (msg) {
        PyErr_SetObject(cls, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

PyObject *ft_py_raise(ft_status st) {
    const char *msg = ft_last_error();
    if (!msg[0]) msg = ft_status_name(st);
    PyObject *cls;
    switch (st) {
    case FT_ERR_INVALID_ARGUMENT: cls = ft_errors.input; break;
    case FT_ERR_DTYPE: cls = ft_errors.input_type; break;
    case FT_ERR_OUT_OF_RANGE: cls = ft_errors.input_range; break;
    case FT_ERR_NOMEM: cls = PyExc_MemoryError; break;
    case FT_ERR_IO: cls = ft_errors.io; break;
    case FT_ERR_NOT_FOUND: cls = ft_errors.not_found; break;
    case FT_ERR_FORMAT: cls = ft_errors.checkpoint; break;
    case FT_ERR_UNSUPPORTED: cls = ft_errors.unsupported; break;
    case FT_ERR_DEVICE: cls = ft_errors.backend; break;
    case FT_ERR_INTERRUPTED:
        if (PyErr_Occurred()) return NULL;   /* the KeyboardInterrupt is already set */
        cls = PyExc_KeyboardInterrupt;
        break;
    default: cls = ft_errors.base; break;
    }
    PyErr_SetString(cls, msg);
    ft_clear_error();
    return NULL;
}

static PyObject *py_blas_name(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyUnicode_FromString(ft_blas_name());
}

static PyObject *py_cpu_isa(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyUnicode_FromString(ft_cpu_isa());
}

static PyObject *py_default_threads(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyLong_FromLong(ft_default_threads());
}

static PyObject *py_num_threads(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyLong_FromLong(ft_num_threads());
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) return ft_py_fail(ft_errors.input, "number of threads must be >= 1, got %ld", n);
    ft_set_num_threads((int)n);
    Py_RETURN_NONE;
}

/* cuda_probe() -> (device_count, description, error or None) */
static PyObject *py_cuda_probe(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    int count = 0;
    char desc[1024];
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_cuda_probe(&count, desc, sizeof desc);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) {
        PyObject *r = Py_BuildValue("(iss)", 0, "", ft_last_error());
        ft_clear_error();
        return r;
    }
    return Py_BuildValue("(isO)", count, desc, Py_None);
}

/* device_stream(index) -> the cudaStream_t (as int) that host reads of CUDA tensors use */
static PyObject *py_device_stream(PyObject *self, PyObject *arg) {
    (void)self;
    int index = (int)PyLong_AsLong(arg);
    if (index == -1 && PyErr_Occurred()) return NULL;
    ft_device dev = {index < 0 ? FT_DEVICE_CPU : FT_DEVICE_CUDA, index < 0 ? 0 : index};
    uintptr_t stream = 0;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_device_stream(dev, &stream);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    return PyLong_FromSize_t((size_t)stream);
}

/* _backend_registry() -> [(name, kind, return type, parameters, offset)]: the op list of
 * backend.h, for tests that call every op of both backends (tests/test_backend_ops.py) */
static PyObject *py_backend_registry(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    PyObject *list = PyList_New((Py_ssize_t)ft_backend_registry_count);
    for (size_t k = 0; list && k < ft_backend_registry_count; k++) {
        const ft_backend_entry *e = &ft_backend_registry[k];
        PyObject *t = Py_BuildValue("(ssssn)", e->name, e->kind, e->ret, e->params, (Py_ssize_t)e->offset);
        if (!t) { Py_CLEAR(list); break; }
        PyList_SET_ITEM(list, (Py_ssize_t)k, t);
    }
    return list;
}

/* _backend_address(index) -> address of the process-wide backend table of CUDA device `index`
 * (index < 0: the CPU), opened on first use; for the op-by-op tests */
static PyObject *py_backend_address(PyObject *self, PyObject *arg) {
    (void)self;
    int index = (int)PyLong_AsLong(arg);
    if (index == -1 && PyErr_Occurred()) return NULL;
    ft_device dev = {index < 0 ? FT_DEVICE_CPU : FT_DEVICE_CUDA, index < 0 ? 0 : index};
    ft_backend *be = NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_backend_for(dev, &be);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    return PyLong_FromVoidPtr(be);
}

/* _abi_sizes() -> sizes of the structs the op-by-op tests build with ctypes */
static PyObject *py_abi_sizes(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return Py_BuildValue("{snsnsnsn}", "ft_backend", (Py_ssize_t)sizeof(ft_backend), "ft_optim_config",
                         (Py_ssize_t)sizeof(ft_optim_config), "ft_optim_tensor", (Py_ssize_t)sizeof(ft_optim_tensor),
                         "ft_optim_info", (Py_ssize_t)sizeof(ft_optim_info));
}

/* _last_error() -> the message of the last failure on this thread (cleared); for tests that call
 * backend ops directly */
static PyObject *py_last_error(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    PyObject *r = PyUnicode_FromString(ft_last_error());
    ft_clear_error();
    return r;
}

static PyMethodDef module_methods[] = {
    {"_last_error", py_last_error, METH_NOARGS, "Message of the last failure on this thread (cleared)."},
    {"_backend_registry", py_backend_registry, METH_NOARGS, "The backend op list: (name, kind, ret, params, offset)."},
    {"_backend_address", py_backend_address, METH_O, "Address of the backend table of CUDA device N (N < 0: CPU)."},
    {"_abi_sizes", py_abi_sizes, METH_NOARGS, "sizeof of the backend structs."},
    {"device_stream", py_device_stream, METH_O, "Stream used to read CUDA tensors on device N to the host."},
    {"blas_name", py_blas_name, METH_NOARGS, "The BLAS library and CPU core it selected."},
    {"cpu_isa", py_cpu_isa, METH_NOARGS, "The CPU kernels in use: avx512, avx2 or generic."},
    {"default_threads", py_default_threads, METH_NOARGS, "The thread count the environment and this process's CPUs give."},
    {"num_threads", py_num_threads, METH_NOARGS, "Threads used by OpenMP and BLAS."},
    {"set_num_threads", py_set_num_threads, METH_O, "Set the threads used by OpenMP and BLAS."},
    {"cuda_probe", py_cuda_probe, METH_NOARGS, "(device_count, description, error) of the CUDA backend."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "fasttran._C",
                                        "fasttran's C core (see csrc/include/fasttran.h).", -1,
                                        module_methods};

static int load_errors(void) {
    PyObject *m = PyImport_ImportModule("fasttran.errors");
    if (!m) return -1;
    struct { PyObject **slot; const char *name; } names[] = {
        {&ft_errors.base, "FastTranError"}, {&ft_errors.input, "InputError"},
        {&ft_errors.input_type, "InputTypeError"}, {&ft_errors.input_range, "InputRangeError"},
        {&ft_errors.checkpoint, "CheckpointError"}, {&ft_errors.not_found, "CheckpointNotFoundError"},
        {&ft_errors.io, "FastTranIOError"}, {&ft_errors.unsupported, "UnsupportedError"},
        {&ft_errors.backend, "BackendError"}};
    for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
        *names[k].slot = PyObject_GetAttrString(m, names[k].name);
        if (!*names[k].slot) { Py_DECREF(m); return -1; }
    }
    Py_DECREF(m);
    return 0;
}

PyMODINIT_FUNC PyInit__C(void) {
    import_array();
    if (load_errors() < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (PyModule_AddStringConstant(m, "version", FT_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "cuda_compiled", ft_cuda_compiled()) < 0 ||
        PyModule_AddIntConstant(m, "cuda_emulated", ft_cuda_emulated()) < 0 ||
        ft_py_add_encoder_type(m) < 0 || ft_py_add_tensor_type(m) < 0 ||
        ft_py_add_cache_functions(m) < 0 || ft_py_add_train_functions(m) < 0 || ft_py_add_layer_type(m) < 0 ||
        ft_py_add_profile_functions(m) < 0 || ft_py_add_optimizer_type(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
