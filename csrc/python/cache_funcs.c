/* Module functions behind fasttran.cache: encode rows into a codec, gather a batch, CRC-32C.
 * The Python layer owns the storage (host arrays, memory-mapped shards) and passes arrays
 * in; the numerics and the per-row loops happen here with the GIL released. */
#include "binding.h"
#include "core/profile.h"

static int parse_codec(const char *name, ft_dtype *out) {
    if (strcmp(name, "float32") == 0) *out = FT_F32;
    else if (strcmp(name, "float16") == 0) *out = FT_F16;
    else if (strcmp(name, "bfloat16") == 0) *out = FT_BF16;
    else if (strcmp(name, "int8") == 0) *out = FT_I8;
    else {
        ft_py_fail(ft_errors.input, "cache dtype must be 'float32', 'float16', 'bfloat16' or 'int8', got '%s'", name);
        return 0;
    }
    return 1;
}

/* a C-contiguous, aligned, writeable (if asked) ndarray of dtype `npy`, ndim `nd` */
static PyArrayObject *want_array(PyObject *o, const char *what, int npy, int nd, int writeable) {
    if (!PyArray_Check(o)) { ft_py_fail(ft_errors.input_type, "%s must be a NumPy array", what); return NULL; }
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_TYPE(a) != npy || PyArray_NDIM(a) != nd || !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) ||
        (writeable && !PyArray_ISWRITEABLE(a))) {
        PyArray_Descr *d = PyArray_DescrFromType(npy);
        ft_py_fail(ft_errors.input_type, "%s must be a C-contiguous%s %d-D %c array", what, writeable ? " writeable" : "",
                   nd, d ? d->type : '?');
        Py_XDECREF(d);
        return NULL;
    }
    return a;
}

/* The int8 codec's scales: a float32 array of n entries (writeable when encoding); other codecs
 * take none. Returns 1 with *out set (NULL when not int8), or 0 with an exception. */
static int int8_scales(ft_dtype codec, PyObject *o, npy_intp n, int writeable, float **out) {
    *out = NULL;
    if (codec != FT_I8) return 1;
    PyArrayObject *sc = want_array(o, "scales", NPY_FLOAT32, 1, writeable);
    if (!sc) return 0;
    if (PyArray_DIM(sc, 0) != n) { ft_py_fail(ft_errors.input, "scales needs %zd entries", (Py_ssize_t)n); return 0; }
    *out = PyArray_DATA(sc);
    return 1;
}

static int codec_npy(ft_dtype c) { return c == FT_F32 ? NPY_FLOAT32 : c == FT_I8 ? NPY_INT8 : NPY_UINT16; }

/* cache_encode(src (n, C) float32, codec, values (n, C), scales (n,) float32 or None)
 *   -> (max_abs_err, sum_sq_err, sum_sq_ref) */
static PyObject *py_cache_encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *src_o, *val_o, *sc_o;
    const char *name;
    if (!PyArg_ParseTuple(args, "OsOO", &src_o, &name, &val_o, &sc_o)) return NULL;
    ft_dtype codec;
    if (!parse_codec(name, &codec)) return NULL;
    PyArrayObject *src = want_array(src_o, "src", NPY_FLOAT32, 2, 0);
    PyArrayObject *val = src ? want_array(val_o, "values", codec_npy(codec), 2, 1) : NULL;
    if (!val) return NULL;
    const npy_intp n = PyArray_DIM(src, 0), C = PyArray_DIM(src, 1);
    if (PyArray_DIM(val, 0) != n || PyArray_DIM(val, 1) != C)
        return ft_py_fail(ft_errors.input, "values has shape (%zd, %zd), src (%zd, %zd)", (Py_ssize_t)PyArray_DIM(val, 0),
                          (Py_ssize_t)PyArray_DIM(val, 1), (Py_ssize_t)n, (Py_ssize_t)C);
    float *scales;
    if (!int8_scales(codec, sc_o, n, 1, &scales)) return NULL;
    ft_codec_error err = {0, 0, 0};
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_cache_encode(PyArray_DATA(val), scales, codec, PyArray_DATA(src), n, C, &err);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    return Py_BuildValue("(ddd)", err.max_abs_err, err.sum_sq_err, err.sum_sq_ref);
}

/* cache_gather(out (n, C) float32, src_ptrs (n,) uint64 addresses (0 = zero row), scales (n,)
 * float32 or None, codec). The caller keeps every addressed buffer alive during the call. */
static PyObject *py_cache_gather(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *out_o, *ptr_o, *sc_o;
    const char *name;
    if (!PyArg_ParseTuple(args, "OOOs", &out_o, &ptr_o, &sc_o, &name)) return NULL;
    ft_dtype codec;
    if (!parse_codec(name, &codec)) return NULL;
    PyArrayObject *out = want_array(out_o, "out", NPY_FLOAT32, 2, 1);
    PyArrayObject *ptr = out ? want_array(ptr_o, "src_ptrs", NPY_UINT64, 1, 0) : NULL;
    if (!ptr) return NULL;
    const npy_intp n = PyArray_DIM(out, 0), C = PyArray_DIM(out, 1);
    if (PyArray_DIM(ptr, 0) != n) return ft_py_fail(ft_errors.input, "src_ptrs needs %zd entries", (Py_ssize_t)n);
    float *scales;
    if (!int8_scales(codec, sc_o, n, 0, &scales)) return NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    int prof = ft_profile_begin();   /* cache reads in the profiler's breakdown */
    uint64_t t0 = prof ? ft_profile_now() : 0;
    st = ft_cache_gather(PyArray_DATA(out), n, C, codec, (const void *const *)PyArray_DATA(ptr), scales);
    if (prof) ft_profile_end(FT_PE_cache_gather, t0);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

/* crc32c(buffer, crc=0) -> int: any object with the buffer protocol (bytes, ndarray, mmap) */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &crc)) return NULL;
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = ft_crc32c(crc, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

static PyMethodDef cache_methods[] = {
    {"cache_encode", py_cache_encode, METH_VARARGS, "Encode float32 rows into a cache codec; returns error sums."},
    {"cache_gather", py_cache_gather, METH_VARARGS, "Decode addressed rows into a float32 batch."},
    {"crc32c", py_crc32c, METH_VARARGS, "CRC-32C of a buffer."},
    {NULL, NULL, 0, NULL}};

int ft_py_add_cache_functions(PyObject *m) { return PyModule_AddFunctions(m, cache_methods); }
