/* fasttran._C: module init (every type and function file adds its part), build and runtime info.
 * The helpers every binding file shares are in common.c. */
#define FT_BINDING_MAIN
#include "binding.h"

#include "backend.h"

static PyObject *py_blas_name(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyUnicode_FromString(ft_blas_name());
}

static PyObject *py_cpu_isa(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyUnicode_FromString(ft_cpu_isa());
}

/* cpu_features() -> {name: bool}: what the kernels may use in this process (FASTTRAN_CPU_ISA applied) */
static PyObject *py_cpu_features(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    const unsigned f = ft_cpu_features(), present = ft_cpu_features_present();
    PyObject *d = PyDict_New(), *have = PyDict_New();
    for (int k = 0; d && have && k < FT_CPU_FEATURE_COUNT; k++)
        if (PyDict_SetItemString(d, ft_cpu_feature_name(k), (f >> k & 1) ? Py_True : Py_False) < 0 ||
            PyDict_SetItemString(have, ft_cpu_feature_name(k), (present >> k & 1) ? Py_True : Py_False) < 0)
            Py_CLEAR(d);
    if (!d || !have) { Py_XDECREF(d); Py_XDECREF(have); return NULL; }
    PyObject *r = Py_BuildValue("(OO)", d, have);
    Py_DECREF(d);
    Py_DECREF(have);
    return r;
}

/* cpu_lowp_kernels() -> (int8 kernel, int8 used by encoders, bf16 kernel or None) */
static PyObject *py_cpu_lowp_kernels(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    int used = 0;
    const char *i8 = ft_cpu_int8_kernel(&used), *bf16 = ft_cpu_bf16_kernel();
    return Py_BuildValue("(sOz)", i8, used ? Py_True : Py_False, bf16);
}

static PyObject *py_default_threads(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyLong_FromLong(ft_default_threads());
}

static PyObject *py_cpu_count(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyLong_FromLong(ft_cpu_count());
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
    {"cpu_isa", py_cpu_isa, METH_NOARGS, "The CPU kernels in use: amx, avx512, avx2 or generic."},
    {"cpu_features", py_cpu_features, METH_NOARGS,
     "(features the kernels may use, features the CPU has): {avx2, avx512, avx512_vnni, avx_vnni, avx512_bf16, "
     "amx_bf16, amx_int8: bool} each; FASTTRAN_CPU_ISA restricts the first."},
    {"cpu_lowp_kernels", py_cpu_lowp_kernels, METH_NOARGS,
     "(int8 kernel, whether int8 encoders use it, bf16 kernel or None)."},
    {"default_threads", py_default_threads, METH_NOARGS, "The thread count the environment and this process's CPUs give."},
    {"cpu_count", py_cpu_count, METH_NOARGS, "CPUs this process may use (affinity mask, capped by a cgroup CPU quota)."},
    {"num_threads", py_num_threads, METH_NOARGS, "Threads used by OpenMP and BLAS."},
    {"set_num_threads", py_set_num_threads, METH_O, "Set the threads used by OpenMP and BLAS."},
    {"cuda_probe", py_cuda_probe, METH_NOARGS, "(device_count, description, error) of the CUDA backend."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "fasttran._C",
                                        "fasttran's C core (see csrc/include/fasttran.h).", -1,
                                        module_methods};

/* The C enums, for the Python layer (never copied there by hand):
 *   DTYPES {name: ft_dtype}, CACHE_CODECS {name: (ft_dtype, NumPy storage dtype)},
 *   POOLINGS {name: ft_pooling}, ACTIVATIONS {name: ft_activation}, DEVICE_KINDS {name: kind},
 *   CACHE_LAYOUTS {name: ft_cache_layout} */
static int add_dict(PyObject *m, const char *name, PyObject *d) {
    if (!d) return -1;
    int r = PyModule_AddObjectRef(m, name, d);
    Py_DECREF(d);
    return r;
}

static int add_enums(PyObject *m) {
    PyObject *dt = PyDict_New();
    for (int k = 0; dt && k < FT_DTYPE_COUNT; k++) {
        PyObject *v = PyLong_FromLong(k);
        if (!v || PyDict_SetItemString(dt, ft_dtype_name((ft_dtype)k), v) < 0) Py_CLEAR(dt);
        Py_XDECREF(v);
    }
    if (add_dict(m, "DTYPES", dt) < 0) return -1;
    if (add_dict(m, "CACHE_CODECS", Py_BuildValue("{s(is)s(is)s(is)s(is)}", "float32", FT_F32, "<f4", "float16", FT_F16,
                                                  "<u2", "bfloat16", FT_BF16, "<u2", "int8", FT_I8, "|i1")) < 0)
        return -1;
    if (add_dict(m, "POOLINGS", Py_BuildValue("{sisisi}", "none", FT_POOL_NONE, "cls", FT_POOL_CLS, "mean",
                                              FT_POOL_MEAN)) < 0)
        return -1;
    if (add_dict(m, "ACTIVATIONS", Py_BuildValue("{sisisisi}", "gelu", FT_ACT_GELU_ERF, "gelu_tanh", FT_ACT_GELU_TANH,
                                                 "relu", FT_ACT_RELU, "tanh", FT_ACT_TANH)) < 0)
        return -1;
    if (add_dict(m, "DEVICE_KINDS", Py_BuildValue("{sisi}", "cpu", FT_DEVICE_CPU, "cuda", FT_DEVICE_CUDA)) < 0) return -1;
    return add_dict(m, "CACHE_LAYOUTS", Py_BuildValue("{sisi}", "padded", FT_CACHE_PADDED, "ragged", FT_CACHE_RAGGED));
}

PyMODINIT_FUNC PyInit__C(void) {
    import_array();
    if (ft_py_load_errors() < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (PyModule_AddStringConstant(m, "version", FT_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "cuda_compiled", ft_cuda_compiled()) < 0 ||
        PyModule_AddIntConstant(m, "cuda_emulated", ft_cuda_emulated()) < 0 ||
        ft_py_add_encoder_type(m) < 0 || ft_py_add_tensor_type(m) < 0 ||
        add_enums(m) < 0 || ft_py_add_cache_functions(m) < 0 || ft_py_add_io_functions(m) < 0 ||
        ft_py_add_train_functions(m) < 0 || ft_py_add_layer_type(m) < 0 || ft_py_add_model_type(m) < 0 || ft_py_add_host_sum(m) < 0 || ft_py_add_profile_functions(m) < 0 ||
        ft_py_add_optimizer_type(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* the per-device CUDA backends go with the interpreter (after every object that could use
     * them), so their streams, handles and workspaces are freed, not left to the process exit */
    Py_AtExit(ft_backend_release_shared);
    return m;
}
