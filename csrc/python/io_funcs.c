/* Files, for the Python layer: the one atomic writer (csrc/io/atomic.c) and the one safetensors
 * reader and writer (csrc/io/safetensors.c), so checkpoints of heads and optimizers, cache
 * files and config.json are written, and safetensors files read, by the same C code as the
 * encoder's weights. */
#include "binding.h"

#include "io/safetensors.h"

/* atomic_write(path, chunks) -> (bytes, crc32c): chunks is a sequence of buffers (bytes,
 * contiguous ndarrays, memoryviews) written in order. */
static PyObject *py_atomic_write(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"path", "chunks", NULL};
    PyObject *path_b = NULL, *seq_o;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&O", kwlist, PyUnicode_FSConverter, &path_b, &seq_o)) return NULL;
    PyObject *seq = PySequence_Fast(seq_o, "chunks must be a sequence of buffers");
    if (!seq) { Py_DECREF(path_b); return NULL; }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc((size_t)n + 1, sizeof *views);
    ft_chunk *chunks = PyMem_Calloc((size_t)n + 1, sizeof *chunks);
    PyObject *result = NULL;
    Py_ssize_t got = 0;
    if (!views || !chunks) { PyErr_NoMemory(); goto done; }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            ft_py_fail(ft_errors.input_type, "chunk %zd is not a contiguous buffer", got);
            goto done;
        }
        chunks[got] = (ft_chunk){views[got].buf, (size_t)views[got].len};
    }
    {
        uint64_t bytes = 0;
        uint32_t crc = 0;
        ft_status st;
        const char *path = PyBytes_AS_STRING(path_b);
        Py_BEGIN_ALLOW_THREADS
        st = ft_atomic_write(path, chunks, (size_t)n, &bytes, &crc);
        Py_END_ALLOW_THREADS
        if (st != FT_OK) ft_py_raise(st);
        else result = Py_BuildValue("(KI)", (unsigned long long)bytes, (unsigned int)crc);
    }
done:
    for (Py_ssize_t k = 0; k < got; k++) PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyMem_Free(chunks);
    Py_DECREF(seq);
    Py_DECREF(path_b);
    return result;
}

/* NumPy type of a safetensors dtype name, or -1 when NumPy has none (BF16, F8) */
static int st_npy(const char *name) {
    static const struct { const char *name; int npy; } map[] = {
        {"F64", NPY_FLOAT64}, {"F32", NPY_FLOAT32}, {"F16", NPY_FLOAT16}, {"I64", NPY_INT64}, {"I32", NPY_INT32},
        {"I16", NPY_INT16},   {"I8", NPY_INT8},     {"U64", NPY_UINT64},  {"U32", NPY_UINT32}, {"U16", NPY_UINT16},
        {"U8", NPY_UINT8},    {"BOOL", NPY_BOOL}};
    for (size_t k = 0; k < sizeof map / sizeof *map; k++)
        if (strcmp(map[k].name, name) == 0) return map[k].npy;
    return -1;
}

/* safetensors_read(path, expect_bytes=-1, expect_crc32c=-1) -> {name: ndarray (a copy)}.
 * With the expectations, the file's size and CRC-32C are checked before its header is read. */
static PyObject *py_safetensors_read(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"path", "expect_bytes", "expect_crc32c", NULL};
    PyObject *path_b = NULL;
    long long eb = -1, ec = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|LL", kwlist, PyUnicode_FSConverter, &path_b, &eb, &ec)) return NULL;
    ft_st_file f;
    ft_status st;
    const char *path = PyBytes_AS_STRING(path_b);
    Py_BEGIN_ALLOW_THREADS
    st = ft_st_open_expect(path, eb, ec, &f);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) { Py_DECREF(path_b); return ft_py_raise(st); }
    PyObject *out = PyDict_New();
    for (size_t k = 0; out && k < f.n_entries; k++) {
        const ft_st_entry *e = &f.entries[k];
        const int npy = st_npy(e->dtype_name);
        if (npy < 0) {
            ft_py_fail(ft_errors.checkpoint, "%s: tensor '%s' has dtype %s, which NumPy cannot hold (not a "
                       "checkpoint fasttran wrote)", path, e->name, e->dtype_name);
            Py_CLEAR(out);
            break;
        }
        npy_intp dims[8];
        for (int d = 0; d < e->ndim; d++) dims[d] = (npy_intp)e->shape[d];
        PyObject *a = PyArray_SimpleNew(e->ndim, dims, npy);
        PyObject *name = a ? PyUnicode_DecodeUTF8(e->name, (Py_ssize_t)strlen(e->name), "strict") : NULL;
        if (!name || PyDict_SetItem(out, name, a) < 0) {
            Py_XDECREF(a);
            Py_XDECREF(name);
            Py_CLEAR(out);
            break;
        }
        memcpy(PyArray_DATA((PyArrayObject *)a), f.data + e->begin, (size_t)(e->end - e->begin));
        Py_DECREF(a);
        Py_DECREF(name);
    }
    ft_st_close(&f);
    Py_DECREF(path_b);
    return out;
}

/* safetensors_write(path, tensors, metadata=None) -> (bytes, crc32c): tensors a sequence of
 * (name, ndarray) pairs written in that order; metadata a dict of strings. */
static PyObject *py_safetensors_write(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"path", "tensors", "metadata", NULL};
    PyObject *path_b = NULL, *ts_o, *meta_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&O|O", kwlist, PyUnicode_FSConverter, &path_b, &ts_o, &meta_o))
        return NULL;
    PyObject *seq = PySequence_Fast(ts_o, "tensors must be a sequence of (name, array) pairs");
    PyObject *keep = PyList_New(0), *result = NULL;
    const Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(seq) : 0;
    const Py_ssize_t nm = meta_o == Py_None ? 0 : PyDict_Check(meta_o) ? PyDict_Size(meta_o) : -1;
    ft_st_tensor *ts = PyMem_Calloc((size_t)n + 1, sizeof *ts);
    ft_st_meta *meta = PyMem_Calloc((size_t)(nm > 0 ? nm : 1), sizeof *meta);
    if (!seq || !keep || !ts || !meta) { if (!PyErr_Occurred()) PyErr_NoMemory(); goto done; }
    if (nm < 0) { ft_py_fail(ft_errors.input_type, "metadata must be a dict of strings"); goto done; }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, k), *name, *arr;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 || !PyUnicode_Check(name = PyTuple_GET_ITEM(item, 0))) {
            ft_py_fail(ft_errors.input_type, "tensors[%zd] is not a (name, array) pair", k);
            goto done;
        }
        arr = PyArray_FromAny(PyTuple_GET_ITEM(item, 1), NULL, 0, 8, NPY_ARRAY_CARRAY_RO, NULL);
        if (!arr || PyList_Append(keep, arr) < 0) { Py_XDECREF(arr); goto done; }
        Py_DECREF(arr);
        PyArrayObject *a = (PyArrayObject *)arr;
        if (!ft_py_npy_dtype(PyArray_TYPE(a), &ts[k].dtype) || !PyArray_ISNOTSWAPPED(a)) {
            ft_py_fail(ft_errors.input_type, "cannot store tensor %R of dtype %S", name, (PyObject *)PyArray_DESCR(a));
            goto done;
        }
        if (!(ts[k].name = PyUnicode_AsUTF8(name))) goto done;
        ts[k].ndim = PyArray_NDIM(a);
        for (int d = 0; d < ts[k].ndim; d++) ts[k].shape[d] = PyArray_DIM(a, d);
        ts[k].data = PyArray_DATA(a);
    }
    {
        Py_ssize_t pos = 0, k = 0;
        PyObject *key, *value;
        while (nm > 0 && PyDict_Next(meta_o, &pos, &key, &value)) {
            if (!PyUnicode_Check(key) || !PyUnicode_Check(value)) {
                ft_py_fail(ft_errors.input_type, "metadata must be a dict of strings");
                goto done;
            }
            if (!(meta[k].key = PyUnicode_AsUTF8(key)) || !(meta[k].value = PyUnicode_AsUTF8(value))) goto done;
            k++;
        }
    }
    {
        uint64_t bytes = 0;
        uint32_t crc = 0;
        ft_status st;
        const char *path = PyBytes_AS_STRING(path_b);
        Py_BEGIN_ALLOW_THREADS
        st = ft_safetensors_write(path, ts, (size_t)n, meta, (size_t)(nm > 0 ? nm : 0), &bytes, &crc);
        Py_END_ALLOW_THREADS
        if (st != FT_OK) ft_py_raise(st);
        else result = Py_BuildValue("(KI)", (unsigned long long)bytes, (unsigned int)crc);
    }
done:
    PyMem_Free(ts);
    PyMem_Free(meta);
    Py_XDECREF(keep);
    Py_XDECREF(seq);
    Py_DECREF(path_b);
    return result;
}

static PyMethodDef io_methods[] = {
    {"atomic_write", (PyCFunction)(void (*)(void))py_atomic_write, METH_VARARGS | METH_KEYWORDS,
     "atomic_write(path, chunks) -> (bytes, crc32c): temp file, fsync, rename, fsync of the directory."},
    {"safetensors_read", (PyCFunction)(void (*)(void))py_safetensors_read, METH_VARARGS | METH_KEYWORDS,
     "safetensors_read(path, expect_bytes=-1, expect_crc32c=-1) -> {name: ndarray}."},
    {"safetensors_write", (PyCFunction)(void (*)(void))py_safetensors_write, METH_VARARGS | METH_KEYWORDS,
     "safetensors_write(path, tensors, metadata=None) -> (bytes, crc32c), atomically."},
    {NULL, NULL, 0, NULL}};

int ft_py_add_io_functions(PyObject *m) { return PyModule_AddFunctions(m, io_methods); }
