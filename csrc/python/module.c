/* fasttran._C: module init (every type and function file adds its part), build and runtime info.
 * The helpers every binding file shares are in common.c. */
#define FT_BINDING_MAIN
#include "binding.h"

#include "backend.h"
#include "core/activation.h"
#include "core/profile.h"

#include <math.h>
#include <string.h>

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

/* cuda_attention_info(device) -> the CUDA backend's attention state (attention_cudnn.cu:
 * ft_cuda_attention_info; fields separated by 0x1f), or None when the CUDA library does not load.
 * device >= 0 also makes that device's cuDNN handle, so the state says whether cuDNN runs there. */
static PyObject *py_cuda_attention_info(PyObject *self, PyObject *arg) {
    (void)self;
    int device = (int)PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred()) return NULL;
    typedef int (*info_fn)(int, char *, size_t);
    info_fn fn = (info_fn)ft_cuda_symbol("ft_cuda_attention_info");
    ft_clear_error();
    if (!fn) Py_RETURN_NONE;
    char buf[2048] = "";
    Py_BEGIN_ALLOW_THREADS
    fn(device, buf, sizeof buf);
    Py_END_ALLOW_THREADS
    return PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "replace");
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

/* ---- test-only: the float32 inverse of GELU (core/activation.h) against float64 ---------------- */

/* GELU and GELU' in double, in forms that keep their relative accuracy far left (erfc; logistic) */
static double gelu_f64(double x, int act, double *grad) {
    if (act == FT_ACT_GELU_TANH) {
        const double u2 = 1.5957691216057308 * (x + 0.044715 * x * x * x);
        const double p = 1.0 / (1.0 + exp(-u2)), q = 1.0 / (1.0 + exp(u2));
        *grad = p + x * p * q * 1.5957691216057308 * (1.0 + 0.134145 * x * x);
        return x * p;
    }
    const double p = 0.5 * erfc(-x * 0.70710678118654752440);
    *grad = p + x * exp(-0.5 * x * x) * 0.39894228040143267794;
    return x * p;
}

/* the root of GELU(x) = y on the branch, in double: Newton from `start` until its step is below
 * 1e-14 x (float32's ulp is 6e-8 x) on the branch, else bisection of the branch's bracket */
static double gelu_invert_f64(float yf, int left, int act, double start) {
    const double y = yf, xmin = act == FT_ACT_GELU_TANH ? FT_GELU_TANH_XMIN : FT_GELU_ERF_XMIN;
    double x = start, g;
    for (int it = 0; it < 8; it++) {
        const double r = gelu_f64(x, act, &g) - y;
        if (g == 0.0 || !isfinite(g)) break;
        const double step = r / g;
        x -= step;
        if (!(left ? x < xmin : x > xmin) || !isfinite(x)) break;
        if (fabs(step) <= 1e-14 * fabs(x) || r == 0.0) return x;
    }
    double lo = left ? -60.0 : xmin, hi = left ? xmin : (y > 0.0 ? y + 1.0 : 0.0);
    for (int it = 0; it < 400 && hi - lo > 0.0; it++) {
        const double mid = 0.5 * (lo + hi);
        if (mid == lo || mid == hi) break;
        if ((gelu_f64(mid, act, &g) > y) != (left != 0)) hi = mid;
        else lo = mid;
    }
    return 0.5 * (lo + hi);
}

/* _gelu_inverse_scan(act, left, first, last, stride) -> (max ulps, y, float32 x, float64 x, count):
 * every stride-th float32 bit pattern from first to last (inclusive, same sign) as y -- those in the
 * flat band (ft_gelu_flat: the backward recomputes their input), NaN and infinity skipped, count
 * says how many were not -- inverted on the branch by ft_gelu_invertf and compared with the float64
 * root; the error in units in the last place of the float32 root (subnormal: 2^-149). For
 * tests/test_gelu_inverse.py. */
static PyObject *py_gelu_inverse_scan(PyObject *self, PyObject *args) {
    (void)self;
    int act, left;
    unsigned long long first, last, stride;
    if (!PyArg_ParseTuple(args, "iiKKK", &act, &left, &first, &last, &stride)) return NULL;
    if ((act != FT_ACT_GELU_ERF && act != FT_ACT_GELU_TANH) || first > last || last > 0xffffffffULL || stride < 1 ||
        (first >> 31) != (last >> 31)) {
        PyErr_SetString(PyExc_ValueError, "_gelu_inverse_scan: act must be a GELU, first <= last two bit patterns of one sign, stride >= 1");
        return NULL;
    }
    double best = 0.0, by = 0.0, bx = 0.0, br = 0.0;
    long long done = 0;
    const long long n = (long long)((last - first) / stride) + 1;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(ft_num_threads())
    {
        double tb = 0.0, ty = 0.0, tx = 0.0, tr = 0.0;
        long long nd = 0;
#pragma omp for schedule(dynamic, 65536)
        for (long long i = 0; i < n; i++) {
            const uint32_t bits = (uint32_t)(first + (unsigned long long)i * stride);
            float y;
            memcpy(&y, &bits, 4);
            if (ft_gelu_flat(y, act) || y != y || y == INFINITY) continue;   /* the GEMM's; not an output */
            nd++;
            const float x = ft_gelu_invertf(y, left, act);
            const double ref = gelu_invert_f64(y, left, act, x), a = fabs(ref);
            int e;
            frexp(a, &e);
            const double ulp = a < 0x1p-126 ? 0x1p-149 : ldexp(1.0, e - 24);
            const double err = x == x ? fabs((double)x - ref) / ulp : INFINITY;
            if (err > tb) { tb = err; ty = y; tx = x; tr = ref; }
        }
#pragma omp critical
        {
            if (tb > best) { best = tb; by = ty; bx = tx; br = tr; }
            done += nd;
        }
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ddddL)", best, by, bx, br, done);
}

static PyMethodDef module_methods[] = {
    {"_last_error", py_last_error, METH_NOARGS, "Message of the last failure on this thread (cleared)."},
    {"_backend_registry", py_backend_registry, METH_NOARGS, "The backend op list: (name, kind, ret, params, offset)."},
    {"_backend_address", py_backend_address, METH_O, "Address of the backend table of CUDA device N (N < 0: CPU)."},
    {"_abi_sizes", py_abi_sizes, METH_NOARGS, "sizeof of the backend structs."},
    {"_gelu_inverse_scan", py_gelu_inverse_scan, METH_VARARGS,
     "(act, left, first, last, stride) -> the float32 GELU inverse's largest error in ulps against float64."},
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
    {"cuda_attention_info", py_cuda_attention_info, METH_O, "The CUDA backend's attention state (cuDNN or ours, and why)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "fasttran._C",
                                        "fasttran's C core (see csrc/include/fasttran.h).", -1,
                                        module_methods};

/* The C enums, for the Python layer (never copied there by hand):
 *   DTYPES {name: ft_dtype}, POOLINGS {name: ft_pooling}, POSITION_IDS {name: ft_position_ids}, NORMS
 *   {name: ft_norm_placement}, ACTIVATIONS {name: ft_activation},
 *   DEVICE_KINDS {name: kind}, CACHE_LAYOUTS {name: ft_cache_layout} (the cache's codecs:
 *   cache_type.c's CACHE_CODECS, from FT_CACHE_CODECS; the head kinds: train_funcs.c's HEAD_KINDS) */
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
    if (add_dict(m, "POOLINGS", Py_BuildValue("{sisisi}", "none", FT_POOL_NONE, "cls", FT_POOL_CLS, "mean",
                                              FT_POOL_MEAN)) < 0)
        return -1;
    if (add_dict(m, "POSITION_IDS", Py_BuildValue("{sisi}", "index", FT_POS_INDEX, "after_padding", FT_POS_AFTER_PADDING)) < 0)
        return -1;
    if (add_dict(m, "NORMS", Py_BuildValue("{sisi}", "post", FT_NORM_POST, "pre", FT_NORM_PRE)) < 0) return -1;
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
