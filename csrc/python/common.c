/* The helpers every file of the CPython binding shares (binding.h): the status -> exception
 * mapping, argument checks, Ctrl-C inside C work. They call nothing else of the binding, so the
 * type and function files depend on this file and module.c on them, never the other way. */
#include "binding.h"

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

/* Raise `cls` with the C message: decoded leniently (a file's bytes quoted in a message need not
 * be UTF-8), and as (errno, message) for OS errors so that .errno is set. */
static PyObject *raise_message(PyObject *cls, ft_status st) {
    const char *msg = ft_last_error();
    if (!msg[0]) msg = ft_status_name(st);
    const int err = ft_last_errno();
    PyObject *text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "backslashreplace");
    ft_clear_error();
    if (!text) return NULL;
    if (err && (st == FT_ERR_IO || st == FT_ERR_NOT_FOUND)) {
        PyObject *args = Py_BuildValue("(iO)", err, text);
        if (args) PyErr_SetObject(cls, args);
        Py_XDECREF(args);
    } else {
        PyErr_SetObject(cls, text);
    }
    Py_DECREF(text);
    return NULL;
}

PyObject *ft_py_raise_cache(ft_status st) {
    if (st == FT_ERR_FORMAT) return raise_message(ft_errors.cache_corrupt, st);
    return ft_py_raise(st);
}

int ft_py_npy_dtype(int npy, ft_dtype *out) {
    switch (npy) {
    case NPY_FLOAT32: *out = FT_F32; return 1;
    case NPY_FLOAT16: *out = FT_F16; return 1;
    case NPY_FLOAT64: *out = FT_F64; return 1;
    case NPY_INT64: *out = FT_I64; return 1;
    case NPY_INT32: *out = FT_I32; return 1;
    case NPY_INT16: *out = FT_I16; return 1;
    case NPY_INT8: *out = FT_I8; return 1;
    case NPY_UINT8: *out = FT_U8; return 1;
    case NPY_BOOL: *out = FT_BOOL; return 1;
    default: return 0;
    }
}

int ft_py_keywords_only(PyObject *args, const char *fn) {
    if (PyTuple_GET_SIZE(args) == 0) return 1;
    ft_py_fail(ft_errors.input_type, "%s takes keyword arguments only", fn);
    return 0;
}

void ft_py_cancel_begin(ft_py_cancel *cs) {
    cs->type = cs->value = cs->tb = NULL;
    cs->ts = PyEval_SaveThread();
}

int ft_py_cancel_check(void *arg) {
    ft_py_cancel *cs = arg;
    PyEval_RestoreThread(cs->ts);
    int stop = PyErr_CheckSignals() < 0;
    if (stop) PyErr_Fetch(&cs->type, &cs->value, &cs->tb);
    cs->ts = PyEval_SaveThread();
    return stop;
}

void ft_py_cancel_end(ft_py_cancel *cs) {
    PyEval_RestoreThread(cs->ts);
    if (cs->type) PyErr_Restore(cs->type, cs->value, cs->tb);
}

PyArrayObject *ft_py_want_array(PyObject *o, const char *what, int npy, int nd, int writeable) {
    if (!PyArray_Check(o)) {
        ft_py_fail(ft_errors.input_type, "%s must be a NumPy array, got %s", what, Py_TYPE(o)->tp_name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_TYPE(a) != npy || (nd >= 0 && PyArray_NDIM(a) != nd) || !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) ||
        !PyArray_ISNOTSWAPPED(a) || (writeable && !PyArray_ISWRITEABLE(a))) {
        PyArray_Descr *d = PyArray_DescrFromType(npy);
        PyObject *want = d ? PyObject_Str((PyObject *)d) : NULL;
        PyObject *got = PyObject_Str((PyObject *)PyArray_DESCR(a));
        if (nd >= 0)
            ft_py_fail(ft_errors.input_type, "%s must be a C-contiguous%s %d-D %S array, got a %d-D %S array", what,
                       writeable ? " writeable" : "", nd, want ? want : Py_None, PyArray_NDIM(a), got ? got : Py_None);
        else
            ft_py_fail(ft_errors.input_type, "%s must be a C-contiguous%s %S array, got %S", what,
                       writeable ? " writeable" : "", want ? want : Py_None, got ? got : Py_None);
        Py_XDECREF(d);
        Py_XDECREF(want);
        Py_XDECREF(got);
        return NULL;
    }
    return a;
}

PyObject *ft_py_none_or_raise(ft_status st) {
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

PyObject *ft_py_raise(ft_status st) {
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
        if (PyErr_Occurred()) { ft_clear_error(); return NULL; }   /* the KeyboardInterrupt is already set */
        cls = PyExc_KeyboardInterrupt;
        break;
    default: cls = ft_errors.base; break;
    }
    return raise_message(cls, st);
}

int ft_py_load_errors(void) {
    PyObject *m = PyImport_ImportModule("fasttran.errors");
    if (!m) return -1;
    struct { PyObject **slot; const char *name; } names[] = {
        {&ft_errors.base, "FastTranError"}, {&ft_errors.input, "InputError"},
        {&ft_errors.input_type, "InputTypeError"}, {&ft_errors.input_range, "InputRangeError"},
        {&ft_errors.checkpoint, "CheckpointError"}, {&ft_errors.not_found, "CheckpointNotFoundError"},
        {&ft_errors.io, "FastTranIOError"}, {&ft_errors.unsupported, "UnsupportedError"},
        {&ft_errors.backend, "BackendError"}, {&ft_errors.cache_corrupt, "CacheCorruptError"}};
    for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
        *names[k].slot = PyObject_GetAttrString(m, names[k].name);
        if (!*names[k].slot) { Py_DECREF(m); return -1; }
    }
    Py_DECREF(m);
    return 0;
}
