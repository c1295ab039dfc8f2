/* The activation cache's binding: fasttran._C.CacheStore (the read side, csrc/cache/store.c)
 * and fasttran._C.CacheReader (the prefetching reader, csrc/cache/reader.c), plus the codec
 * functions the build uses (cache_encode, crc32c, input_fingerprints).
 *
 * Python (fasttran/cache/) decides what goes where (tiers, files) and hands arrays over; every
 * batch is one call here that returns finished NumPy arrays. Arguments are checked once, here;
 * functions with several arguments take keywords only. */
#include "binding.h"
#include "core/profile.h"

#include "cache/codec.h"

static int parse_codec(int code, ft_dtype *out) {
    if (code < 0 || code >= FT_DTYPE_COUNT || !ft_cache_codec_ok((ft_dtype)code)) {
        ft_py_fail(ft_errors.input, "cache codec %d is not one of _C.CACHE_CODECS", code);
        return 0;
    }
    *out = (ft_dtype)code;
    return 1;
}

/* the NumPy type number a codec's values are stored as: its storage string, read by NumPy once
 * (ft_py_add_cache_functions fills the table) */
static int codec_types[FT_DTYPE_COUNT];
static int codec_npy(ft_dtype c) { return codec_types[c]; }
static int codec_scaled(ft_dtype c) { return ft_cache_codec_get(c)->scaled; }

/* example ids from any 1-D integer sequence, as a new C-contiguous int64 array */
static PyArrayObject *int64_ids(PyObject *obj, const char *what) {
    PyArrayObject *a = (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
    if (!a) {
        PyErr_Clear();
        ft_py_fail(ft_errors.input, "%s must be a 1-D sequence of ints", what);
        return NULL;
    }
    const char kind = PyArray_DESCR(a)->kind;
    if (PyArray_NDIM(a) != 1 || (PyArray_SIZE(a) && kind != 'i' && kind != 'u')) {
        PyObject *shape = PyObject_GetAttrString((PyObject *)a, "shape");
        ft_py_fail(ft_errors.input, "%s must be a 1-D sequence of ints, got shape %S dtype %S", what,
                   shape ? shape : Py_None, (PyObject *)PyArray_DESCR(a));
        Py_XDECREF(shape);
        Py_DECREF(a);
        return NULL;
    }
    PyArrayObject *r = (PyArrayObject *)PyArray_FromAny((PyObject *)a, PyArray_DescrFromType(NPY_INT64), 1, 1,
                                                        NPY_ARRAY_CARRAY | NPY_ARRAY_FORCECAST, NULL);
    Py_DECREF(a);
    return r;
}

/* ---- module functions ---------------------------------------------------------------------- */

/* cache_encode(*, src (n, C) float32, codec) -> (values (n, C), scales (n,) float32 | None,
 *   (max_abs_err, sum_sq_err, sum_sq_ref)) */
static PyObject *py_cache_encode(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"src", "codec", NULL};
    PyObject *src_o;
    int code;
    if (!ft_py_keywords_only(args, "cache_encode()") || !PyArg_ParseTupleAndKeywords(args, kw, "Oi", kwlist, &src_o, &code))
        return NULL;
    ft_dtype codec;
    PyArrayObject *src;
    if (!parse_codec(code, &codec) || !(src = ft_py_want_array(src_o, "src", NPY_FLOAT32, 2, 0))) return NULL;
    npy_intp dims[2] = {PyArray_DIM(src, 0), PyArray_DIM(src, 1)};
    PyObject *val = PyArray_SimpleNew(2, dims, codec_npy(codec));
    PyObject *sc = codec_scaled(codec) ? PyArray_SimpleNew(1, dims, NPY_FLOAT32) : Py_NewRef(Py_None);
    if (!val || !sc) { Py_XDECREF(val); Py_XDECREF(sc); return NULL; }
    ft_codec_error err = {0, 0, 0};
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_cache_encode(PyArray_DATA((PyArrayObject *)val), sc == Py_None ? NULL : PyArray_DATA((PyArrayObject *)sc),
                         codec, PyArray_DATA(src), dims[0], dims[1], &err);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) { Py_DECREF(val); Py_DECREF(sc); return ft_py_raise(st); }
    return Py_BuildValue("(NN(ddd))", val, sc, err.max_abs_err, err.sum_sq_err, err.sum_sq_ref);
}

/* crc32c(buffer, crc=0) -> int: any object with the buffer protocol (bytes, ndarray, mmap) */
static PyObject *py_crc32c(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"data", "crc", NULL};
    Py_buffer view;
    unsigned int crc = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|I", kwlist, &view, &crc)) return NULL;
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = ft_crc32c(crc, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

/* input_fingerprints(*, tokens (T,) int32, types (T,) int32, offsets (N+1,) int64) -> (N,) uint64 */
static PyObject *py_input_fingerprints(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"tokens", "types", "offsets", NULL};
    PyObject *t_o, *y_o, *o_o;
    if (!ft_py_keywords_only(args, "input_fingerprints()") ||
        !PyArg_ParseTupleAndKeywords(args, kw, "OOO", kwlist, &t_o, &y_o, &o_o))
        return NULL;
    PyArrayObject *tok = ft_py_want_array(t_o, "tokens", NPY_INT32, 1, 0);
    PyArrayObject *typ = tok ? ft_py_want_array(y_o, "types", NPY_INT32, 1, 0) : NULL;
    PyArrayObject *off = typ ? ft_py_want_array(o_o, "offsets", NPY_INT64, 1, 0) : NULL;
    if (!off) return NULL;
    const npy_intp N = PyArray_DIM(off, 0) - 1, T = PyArray_DIM(tok, 0);
    const int64_t *o = PyArray_DATA(off);
    if (N < 0 || PyArray_DIM(typ, 0) != T || o[0] != 0 || o[N] != T)
        return ft_py_fail(ft_errors.input, "offsets must start at 0 and end at len(tokens) == len(types)");
    for (npy_intp i = 0; i < N; i++)
        if (o[i + 1] < o[i]) return ft_py_fail(ft_errors.input, "offsets decrease at %zd", (Py_ssize_t)i);
    npy_intp dims[1] = {N};
    PyObject *out = PyArray_SimpleNew(1, dims, NPY_UINT64);
    if (!out) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ft_input_fingerprints(PyArray_DATA(tok), PyArray_DATA(typ), o, N, PyArray_DATA((PyArrayObject *)out));
    Py_END_ALLOW_THREADS
    return out;
}

/* epoch_order(seed, n) -> (n,) int64: the shuffled epoch order of reader(seed=...) */
static PyObject *py_epoch_order(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seed_o;
    long long n;
    if (!PyArg_ParseTuple(args, "OL:epoch_order", &seed_o, &n)) return NULL;
    if (!PyLong_Check(seed_o)) return ft_py_fail(ft_errors.input_type, "seed must be an int in [0, 2**64)");
    const unsigned long long seed = PyLong_AsUnsignedLongLong(seed_o);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return ft_py_fail(ft_errors.input, "seed must be an int in [0, 2**64)");
    }
    if (n < 0) return ft_py_fail(ft_errors.input, "n must be >= 0, got %lld", n);
    npy_intp dims[1] = {(npy_intp)n};
    PyObject *out = PyArray_SimpleNew(1, dims, NPY_INT64);
    if (!out) return NULL;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_epoch_order(seed, n, PyArray_DATA((PyArrayObject *)out));
    Py_END_ALLOW_THREADS
    if (st != FT_OK) { Py_DECREF(out); return ft_py_raise(st); }
    return out;
}

/* ---- CacheStore ---------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    ft_cache *c;
    PyObject *keep;          /* list: the arrays shards point into */
    PyArrayObject *ids;      /* (N) int64 example ids */
    int64_t N, C;
    int all_tokens;
} CacheStore;

static PyTypeObject *store_type, *reader_type;

static void CacheStore_dealloc(CacheStore *self) {
    PyTypeObject *tp = Py_TYPE(self);
    ft_cache_free(self->c);   /* no reader is alive: each holds a reference to the store */
    Py_XDECREF(self->keep);
    Py_XDECREF(self->ids);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* CacheStore(*, example_ids (N,) int64, tokens (T,) int32, types (T,) int32, offsets (N+1,) int64,
 *            hidden, codec, all_tokens, layer, pooling, recompute_batch) */
static int CacheStore_init(CacheStore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"example_ids", "tokens", "types", "offsets", "hidden", "codec", "all_tokens", "layer",
                             "pooling", "recompute_batch", NULL};
    PyObject *ids_o, *tok_o, *typ_o, *off_o;
    long long hidden, layer, rb;
    int code, all_tokens, pooling;
    if (self->c) { ft_py_fail(ft_errors.base, "CacheStore is already initialised"); return -1; }
    if (!ft_py_keywords_only(args, "CacheStore()") ||
        !PyArg_ParseTupleAndKeywords(args, kw, "OOOOLipLiL", kwlist, &ids_o, &tok_o, &typ_o, &off_o, &hidden, &code,
                                     &all_tokens, &layer, &pooling, &rb))
        return -1;
    ft_dtype codec;
    if (!parse_codec(code, &codec)) return -1;
    PyArrayObject *ids = ft_py_want_array(ids_o, "example_ids", NPY_INT64, 1, 0);
    PyArrayObject *tok = ids ? ft_py_want_array(tok_o, "tokens", NPY_INT32, 1, 0) : NULL;
    PyArrayObject *typ = tok ? ft_py_want_array(typ_o, "types", NPY_INT32, 1, 0) : NULL;
    PyArrayObject *off = typ ? ft_py_want_array(off_o, "offsets", NPY_INT64, 1, 0) : NULL;
    if (!off) return -1;
    const npy_intp N = PyArray_DIM(ids, 0), T = PyArray_DIM(tok, 0);
    if (PyArray_DIM(off, 0) != N + 1 || PyArray_DIM(typ, 0) != T || ((int64_t *)PyArray_DATA(off))[N] != T) {
        ft_py_fail(ft_errors.input, "offsets must have N + 1 = %zd entries ending at len(tokens) == len(types)",
                   (Py_ssize_t)N + 1);
        return -1;
    }
    if (pooling < FT_POOL_NONE || pooling > FT_POOL_MEAN) {
        ft_py_fail(ft_errors.input, "pooling code %d is not one of _C.POOLINGS", pooling);
        return -1;
    }
    const ft_cache_config cfg = {N, hidden, codec, all_tokens, PyArray_DATA(ids), PyArray_DATA(tok), PyArray_DATA(typ),
                                 PyArray_DATA(off), layer, (ft_pooling)pooling, rb};
    ft_status st;
    ft_cache *c = NULL;
    Py_BEGIN_ALLOW_THREADS
    st = ft_cache_create(&cfg, &c);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) { ft_py_raise(st); return -1; }
    self->keep = PyList_New(0);
    self->ids = (PyArrayObject *)PyArray_NewCopy(ids, NPY_CORDER);
    if (!self->keep || !self->ids) { ft_cache_free(c); return -1; }
    self->c = c;
    self->N = N;
    self->C = hidden;
    self->all_tokens = all_tokens;
    return 0;
}

ft_cache *ft_py_cache_from(PyObject *obj) {
    if (!store_type || !PyObject_TypeCheck(obj, store_type) || !((CacheStore *)obj)->c) {
        ft_py_fail(ft_errors.input_type, "expected an initialised fasttran._C.CacheStore, got %s",
                   Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return ((CacheStore *)obj)->c;
}

static int store_ready(CacheStore *self) {
    if (self->c) return 1;
    ft_py_fail(ft_errors.base, "CacheStore is not initialised");
    return 0;
}

/* add_shard(*, name, examples (n,) int64, values (rows, C), scales (rows,) float32 | None,
 *           file (bytes,) uint8 | None, crc32c=0): the arrays are kept alive by the store. A
 *           shard with `file` is checked against crc32c before its first read. values may be a
 *           fasttran.Tensor in CUDA memory (the device tier: (rows, C) elements of the codec's
 *           size, C-contiguous; scales stay a host array). */
static PyObject *CacheStore_add_shard(CacheStore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"name", "examples", "values", "scales", "file", "crc32c", NULL};
    const char *name;
    PyObject *ex_o, *val_o, *sc_o = Py_None, *file_o = Py_None;
    unsigned int crc = 0;
    if (!store_ready(self) || !ft_py_keywords_only(args, "add_shard()") ||
        !PyArg_ParseTupleAndKeywords(args, kw, "sOO|OOI", kwlist, &name, &ex_o, &val_o, &sc_o, &file_o, &crc))
        return NULL;
    const ft_dtype codec = ft_cache_codec_of(self->c);
    PyArrayObject *ex = ft_py_want_array(ex_o, "examples", NPY_INT64, 1, 0);
    if (!ex) return NULL;
    PyArrayObject *val = NULL;
    void *val_data;
    npy_intp rows, width;
    ft_device where = {FT_DEVICE_CPU, 0};
    int nd = 0;
    const int64_t *shape = NULL, *strides = NULL;
    ft_dtype dt = FT_F32;
    if (ft_py_tensor_check(val_o)) ft_py_tensor_data(val_o, &nd, &shape, &strides, &dt, &where);
    if (where.kind == FT_DEVICE_CUDA) {   /* the device tier */
        val_data = ft_py_tensor_data(val_o, &nd, &shape, &strides, &dt, &where);
        if (nd != 2 || ft_dtype_size(dt) != ft_dtype_size(codec) ||
            (strides && !(strides[1] == 1 && (shape[0] < 2 || strides[0] == shape[1]))))
            return ft_py_fail(ft_errors.input_type, "%s: device values must be a C-contiguous 2-D CUDA Tensor of "
                              "%zu-byte elements", name, ft_dtype_size(codec));
        rows = (npy_intp)shape[0];
        width = (npy_intp)shape[1];
    } else {
        if (!(val = ft_py_want_array(val_o, "values", codec_npy(codec), 2, 0))) return NULL;
        val_data = PyArray_DATA(val);
        rows = PyArray_DIM(val, 0);
        width = PyArray_DIM(val, 1);
    }
    if (width != self->C)
        return ft_py_fail(ft_errors.input, "%s: values are %zd wide, the cache %lld", name, (Py_ssize_t)width,
                          (long long)self->C);
    PyArrayObject *sc = NULL, *file = NULL;
    if (codec_scaled(codec)) {
        if (!(sc = ft_py_want_array(sc_o, "scales", NPY_FLOAT32, 1, 0))) return NULL;
        if (PyArray_DIM(sc, 0) != rows) return ft_py_fail(ft_errors.input, "%s: scales needs %zd entries", name, (Py_ssize_t)rows);
    } else if (sc_o != Py_None) {
        return ft_py_fail(ft_errors.input, "%s: only int8 caches have scales", name);
    }
    if (file_o != Py_None && !(file = ft_py_want_array(file_o, "file", NPY_UINT8, 1, 0))) return NULL;
    const ft_cache_shard s = {name, PyArray_DATA(ex), PyArray_DIM(ex, 0), val_data,
                              sc ? PyArray_DATA(sc) : NULL, rows, file ? PyArray_DATA(file) : NULL,
                              file ? (size_t)PyArray_DIM(file, 0) : 0, crc, where};
    ft_status st;
    Py_BEGIN_ALLOW_THREADS   /* waits for reads in flight */
    st = ft_cache_add_shard(self->c, &s);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    if (PyList_Append(self->keep, val ? (PyObject *)val : val_o) < 0 || (sc && PyList_Append(self->keep, (PyObject *)sc) < 0) ||
        (file && PyList_Append(self->keep, (PyObject *)file) < 0))
        return NULL;
    Py_RETURN_NONE;
}

/* index_of(example_ids) -> (n,) int64 positions */
static PyObject *CacheStore_index_of(CacheStore *self, PyObject *arg) {
    if (!store_ready(self)) return NULL;
    PyArrayObject *ids = int64_ids(arg, "example_ids");
    if (!ids) return NULL;
    PyObject *out = PyArray_SimpleNew(1, PyArray_DIMS(ids), NPY_INT64);
    if (out) {
        ft_status st = ft_cache_lookup(self->c, PyArray_DATA(ids), PyArray_DIM(ids, 0), PyArray_DATA((PyArrayObject *)out));
        if (st != FT_OK) {
            Py_CLEAR(out);
            ft_py_raise(st);
        }
    }
    Py_DECREF(ids);
    return out;
}

/* slices(order, batch_size, part, parts) -> (batches, 2) int64: [lo, hi) of slice `part` in each
 * global batch of `batch_size` consecutive positions of `order` (cache indices): ft_cache_slice */
static PyObject *CacheStore_slices(CacheStore *self, PyObject *args) {
    PyObject *oo;
    long long bs, part, parts;
    if (!store_ready(self) || !PyArg_ParseTuple(args, "OLLL", &oo, &bs, &part, &parts)) return NULL;
    if (bs < 1 || parts < 1 || part < 0 || part >= parts)
        return ft_py_fail(ft_errors.input, "slices: need batch_size >= 1 and 0 <= part < parts (got %lld, %lld, %lld)",
                          bs, part, parts);
    PyArrayObject *order = int64_ids(oo, "order");
    if (!order) return NULL;
    const int64_t n = PyArray_DIM(order, 0), *idx = PyArray_DATA(order);
    for (int64_t i = 0; i < n; i++)
        if (ft_cache_rows_of(self->c, idx[i]) < 0) {
            Py_DECREF(order);
            return ft_py_fail(ft_errors.input, "order[%lld] = %lld is not an example of the cache (0..%lld)",
                              (long long)i, (long long)idx[i], (long long)ft_cache_examples(self->c) - 1);
        }
    npy_intp dims[2] = {(npy_intp)((n + bs - 1) / bs), 2};
    PyObject *out = PyArray_SimpleNew(2, dims, NPY_INT64);
    ft_status st = FT_OK;
    for (npy_intp k = 0; out && st == FT_OK && k < dims[0]; k++) {
        int64_t *lh = (int64_t *)PyArray_DATA((PyArrayObject *)out) + 2 * k;
        const int64_t a = (int64_t)k * bs;
        st = ft_cache_slice(self->c, idx + a, n - a < bs ? n - a : bs, part, parts, lh, lh + 1);
    }
    Py_DECREF(order);
    if (st != FT_OK) {
        Py_XDECREF(out);
        return ft_py_raise(st);
    }
    return out;
}

static PyObject *CacheStore_counters(CacheStore *self, PyObject *unused) {
    (void)unused;
    if (!store_ready(self)) return NULL;
    int64_t hits, misses;
    ft_cache_counters(self->c, &hits, &misses);
    return Py_BuildValue("(LL)", (long long)hits, (long long)misses);
}

/* The batch as the cache API returns it, around `values` (a new reference, stolen):
 *   pooled -> values (n, C); padded -> (values (n, T, C), mask (n, T) int64);
 *   ragged -> (values (rows, C), offsets (n + 1) int64). With device, values become a
 *   fasttran.Tensor viewing the same memory. */
static PyObject *finish_batch(CacheStore *st, PyObject *values, const int64_t *index, int64_t n, int64_t T, int ragged,
                              int device) {
    if (device && PyArray_Check(values)) {   /* host memory as a Tensor (CUDA batches are Tensors already) */
        PyArrayObject *a = (PyArrayObject *)values;
        int64_t shape[3];
        for (int d = 0; d < PyArray_NDIM(a); d++) shape[d] = PyArray_DIM(a, d);
        PyObject *t = ft_py_tensor_new(PyArray_DATA(a), PyArray_NDIM(a), shape, NULL, FT_F32,
                                       (ft_device){FT_DEVICE_CPU, 0}, 0, values, NULL, NULL);
        Py_DECREF(values);
        if (!t) return NULL;
        values = t;
    }
    if (!st->all_tokens) return values;
    PyObject *aux;
    if (ragged) {
        npy_intp d[1] = {n + 1};
        aux = PyArray_SimpleNew(1, d, NPY_INT64);
        if (aux) {
            int64_t *o = PyArray_DATA((PyArrayObject *)aux);
            o[0] = 0;
            for (int64_t p = 0; p < n; p++) o[p + 1] = o[p] + ft_cache_example_rows(st->c, index[p]);
        }
    } else {
        npy_intp d[2] = {n, T};
        aux = PyArray_SimpleNew(2, d, NPY_INT64);
        if (aux) {
            int64_t *m = PyArray_DATA((PyArrayObject *)aux);
            for (int64_t p = 0; p < n; p++) {
                const int64_t l = ft_cache_example_rows(st->c, index[p]);
                for (int64_t t = 0; t < T; t++) m[p * T + t] = t < l;
            }
        }
    }
    if (!aux) { Py_DECREF(values); return NULL; }
    return Py_BuildValue("(NN)", values, aux);
}

/* the values array's shape for a batch */
static int batch_dims(CacheStore *st, const ft_cache_batch_info *info, int64_t n, int ragged, npy_intp *dims) {
    if (!st->all_tokens || ragged) {
        dims[0] = st->all_tokens ? info->rows : n;
        dims[1] = st->C;
        return 2;
    }
    dims[0] = n;
    dims[1] = info->T;
    dims[2] = st->C;
    return 3;
}

static void release_cuda(PyObject *owner, void *ctx, void *data) {
    (void)owner;
    ft_device_free((ft_device){FT_DEVICE_CUDA, (int)(intptr_t)ctx}, data);
}

/* read(*, example_ids, ragged=False, out=None, encoder=None, device=False, threads=0, device_index=-1)
 * -> batch. out: a writeable C-contiguous float32 array with room for the batch; the values are
 * written at its start and returned as a view of it. encoder: the EncoderCore that computes
 * uncached examples. threads: 0 = all of fasttran's threads. device with device_index >= 0: the
 * batch in that CUDA device's memory (a fasttran.Tensor; out, if given, a float32 CUDA Tensor with
 * room for it), gathered there from the device tier. */
static PyObject *CacheStore_read(CacheStore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"example_ids", "ragged", "out", "encoder", "device", "threads", "device_index", NULL};
    PyObject *ids_o, *out_o = Py_None, *enc_o = Py_None;
    int ragged = 0, device = 0, threads = 0, device_index = -1;
    if (!store_ready(self) || !ft_py_keywords_only(args, "read()") ||
        !PyArg_ParseTupleAndKeywords(args, kw, "O|pOOpii", kwlist, &ids_o, &ragged, &out_o, &enc_o, &device, &threads,
                                     &device_index))
        return NULL;
    const int cuda = device && device_index >= 0;
    ft_encoder *enc = NULL;
    if (enc_o != Py_None && !(enc = ft_py_encoder_from(enc_o))) return NULL;
    PyArrayObject *ids = int64_ids(ids_o, "example_ids");
    if (!ids) return NULL;
    const int64_t n = PyArray_DIM(ids, 0);
    const ft_cache_layout layout = ragged ? FT_CACHE_RAGGED : FT_CACHE_PADDED;
    PyObject *idx_o = PyArray_SimpleNew(1, PyArray_DIMS(ids), NPY_INT64), *values = NULL, *result = NULL;
    if (!idx_o) goto done;
    const int64_t *idx = PyArray_DATA((PyArrayObject *)idx_o);
    ft_cache_batch_info info;
    ft_status st = ft_cache_lookup(self->c, PyArray_DATA(ids), n, (int64_t *)idx);
    if (st == FT_OK) st = ft_cache_batch_info_get(self->c, idx, n, layout, enc, &info);
    if (st != FT_OK) { ft_py_raise(st); goto done; }
    npy_intp dims[3];
    const int nd = batch_dims(self, &info, n, ragged, dims);
    void *data = NULL;
    ft_device dst_dev = {FT_DEVICE_CPU, 0};
    if (cuda) {
        dst_dev = (ft_device){FT_DEVICE_CUDA, device_index};
        int64_t shape[3] = {dims[0], dims[1], nd == 3 ? dims[2] : 0};
        if (out_o == Py_None) {
            st = ft_device_alloc(dst_dev, (size_t)(info.rows * self->C) * sizeof(float), &data);
            if (st != FT_OK) { ft_py_raise(st); goto done; }
            values = ft_py_tensor_new(data, nd, shape, NULL, FT_F32, dst_dev, 0, NULL, release_cuda,
                                      (void *)(intptr_t)device_index);
        } else {
            int ond;
            const int64_t *oshape, *ostrides;
            ft_dtype odt;
            ft_device odev = {FT_DEVICE_CPU, 0};
            void *od = ft_py_tensor_check(out_o) ? ft_py_tensor_data(out_o, &ond, &oshape, &ostrides, &odt, &odev) : NULL;
            int64_t have = 1, contiguous = 1;
            for (int d = ond - 1; od && d >= 0; d--) {
                if (ostrides && oshape[d] > 1 && ostrides[d] != have) contiguous = 0;
                have *= oshape[d];
            }
            if (!od || odev.kind != FT_DEVICE_CUDA || odev.index != device_index || odt != FT_F32 ||
                ft_py_tensor_readonly(out_o) || !contiguous) {
                ft_py_fail(ft_errors.input_type, "out must be a writeable float32 fasttran.Tensor on cuda:%d "
                           "(contiguous)", device_index);
                goto done;
            }
            if (have < info.rows * self->C) {
                ft_py_fail(ft_errors.input, "out has room for %lld floats, the batch needs %lld", (long long)have,
                           (long long)(info.rows * self->C));
                goto done;
            }
            data = od;
            values = ft_py_tensor_new(od, nd, shape, NULL, FT_F32, dst_dev, 0, out_o, NULL, NULL);
        }
    } else if (out_o == Py_None) {
        values = PyArray_SimpleNew(nd, dims, NPY_FLOAT32);
    } else {
        PyArrayObject *out = (PyArrayObject *)out_o;
        if (!PyArray_Check(out_o) || PyArray_TYPE(out) != NPY_FLOAT32 || !PyArray_IS_C_CONTIGUOUS(out) ||
            !PyArray_ISALIGNED(out) || !PyArray_ISWRITEABLE(out)) {
            ft_py_fail(ft_errors.input_type, "out must be a writeable C-contiguous float32 NumPy array");
            goto done;
        }
        if (PyArray_SIZE(out) < info.rows * self->C) {
            ft_py_fail(ft_errors.input, "out has room for %zd floats, the batch needs %lld", (Py_ssize_t)PyArray_SIZE(out),
                       (long long)(info.rows * self->C));
            goto done;
        }
        Py_INCREF(PyArray_DESCR(out));
        values = PyArray_NewFromDescr(&PyArray_Type, PyArray_DESCR(out), nd, dims, NULL, PyArray_DATA(out),
                                      NPY_ARRAY_CARRAY, NULL);
        if (values && PyArray_SetBaseObject((PyArrayObject *)values, Py_NewRef(out_o)) < 0) Py_CLEAR(values);
    }
    if (!values) goto done;
    if (!cuda) data = PyArray_DATA((PyArrayObject *)values);
    {
        ft_py_cancel cs;
        ft_py_cancel_begin(&cs);
        const int prof = ft_profile_begin();   /* a synchronous cache read in the profiler's breakdown */
        const uint64_t t0 = prof ? ft_profile_now() : 0;
        st = ft_cache_read(self->c, idx, n, layout, data, dst_dev, (size_t)(info.rows * self->C), enc, threads,
                           ft_py_cancel_check, &cs);
        if (prof) ft_profile_end(FT_PE_cache_gather, t0);
        ft_py_cancel_end(&cs);
        if (st != FT_OK) { ft_py_raise_cache(st); goto done; }
    }
    result = finish_batch(self, values, idx, n, info.T, ragged, device);
    values = NULL;
done:
    Py_XDECREF(values);
    Py_XDECREF(idx_o);
    Py_DECREF(ids);
    return result;
}

/* ---- CacheReader ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    ft_cache_reader *r;
    CacheStore *store;
    PyObject *encoder;
    Py_ssize_t steps;
    int ragged, device;
    int device_index;    /* >= 0: batches in that CUDA device's memory (fasttran.Tensor) */
    int busy;            /* a thread is inside next() with the GIL released (the ring has one consumer) */
    int close_asked;     /* close() came meanwhile: that thread closes when it returns */
    int sliced;          /* read with parts: next() adds the GlobalBatch of each slice */
    long long first_step; /* the epoch's step of the reader's first batch (GlobalBatch.step) */
} CacheReader;

/* GlobalBatch: where a slice of a data-parallel reader sits in its global batch */
static PyTypeObject *global_batch_type;
static PyStructSequence_Field global_batch_fields[] = {
    {"step", "the global batch's number in the epoch (from 0; a resumed epoch's `start` included)"},
    {"size", "examples in the global batch (what a gradient sum is divided by)"},
    {"offset", "position of this slice's first example in the global batch"},
    {"rows", "real rows of the global batch (tokens when every token is kept, else examples)"},
    {"row_offset", "real rows of the global batch before this slice"},
    {"longest", "rows of the global batch's longest example"},
    {NULL, NULL}};
static PyStructSequence_Desc global_batch_desc = {
    "fasttran.GlobalBatch", "Where a data-parallel slice sits in its global batch (ActivationCache.batches(rank=...)).",
    global_batch_fields, 6};

static void reader_close(CacheReader *self) {
    if (!self->r) return;
    if (self->busy) {    /* another thread waits in next(): stop the producer, let it close */
        self->close_asked = 1;
        ft_cache_reader_stop(self->r);
        return;
    }
    ft_cache_reader *r = self->r;
    self->r = NULL;
    Py_BEGIN_ALLOW_THREADS   /* joins the thread: a recompute in flight stops between layers */
    ft_cache_reader_close(r);
    Py_END_ALLOW_THREADS
}

static void CacheReader_dealloc(CacheReader *self) {
    PyTypeObject *tp = Py_TYPE(self);
    reader_close(self);
    Py_XDECREF(self->store);
    Py_XDECREF(self->encoder);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static void release_batch_capsule(PyObject *cap) {
    ft_cache_batch_release(PyCapsule_GetPointer(cap, "fasttran.cache_batch"));
}

/* next() -> (example_ids (n,) int64, batch as read() returns it) */
static PyObject *CacheReader_next(CacheReader *self) {
    ft_cache_batch *b = NULL;
    if (self->busy) return ft_py_fail(ft_errors.input, "this cache reader is being iterated by another thread");
    for (;;) {
        if (!self->r) return NULL;
        int timed_out;
        ft_status st;
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        st = ft_cache_reader_next(self->r, 100, &b, &timed_out);
        Py_END_ALLOW_THREADS
        self->busy = 0;
        if (self->close_asked) {   /* closed meanwhile by another thread: the iteration just ends */
            if (b) ft_cache_batch_release(b);
            ft_clear_error();
            reader_close(self);
            return NULL;
        }
        if (st != FT_OK) return ft_py_raise_cache(st);
        if (!timed_out) break;
        if (PyErr_CheckSignals() < 0) return NULL;   /* Ctrl-C while waiting */
    }
    if (!b) return NULL;   /* end of the epoch: StopIteration */
    PyObject *cap = PyCapsule_New(b, "fasttran.cache_batch", release_batch_capsule);
    if (!cap) { ft_cache_batch_release(b); return NULL; }
    CacheStore *st = self->store;
    const ft_cache_batch_info info = {b->rows, b->T, 0};
    npy_intp dims[3];
    const int nd = batch_dims(st, &info, b->n, self->ragged, dims);
    PyObject *values;
    if (self->device_index >= 0) {   /* device memory: the Tensor holds the capsule (the buffer's release) */
        int64_t shape[3] = {dims[0], dims[1], nd == 3 ? dims[2] : 0};
        values = ft_py_tensor_new(b->values, nd, shape, NULL, FT_F32, (ft_device){FT_DEVICE_CUDA, self->device_index},
                                  0, cap, NULL, NULL);
        Py_DECREF(cap);
        if (!values) return NULL;
    } else if (!(values = PyArray_SimpleNewFromData(nd, dims, NPY_FLOAT32, b->values)) ||
               PyArray_SetBaseObject((PyArrayObject *)values, cap) < 0) {   /* steals cap */
        if (!values) Py_DECREF(cap);
        Py_XDECREF(values);
        return NULL;
    }
    npy_intp nd1[1] = {b->n};
    PyObject *ids = PyArray_SimpleNew(1, nd1, NPY_INT64);
    if (!ids) { Py_DECREF(values); return NULL; }
    memcpy(PyArray_DATA((PyArrayObject *)ids), b->ids, (size_t)b->n * sizeof *b->ids);
    const int64_t where[6] = {self->first_step + b->step, b->global_n, b->offset, b->global_rows, b->row_offset,
                              b->global_T};
    PyObject *batch = finish_batch(st, values, b->index, b->n, b->T, self->ragged, self->device);
    if (!batch) { Py_DECREF(ids); return NULL; }
    if (!self->sliced) return Py_BuildValue("(NN)", ids, batch);
    PyObject *g = PyStructSequence_New(global_batch_type);
    for (int k = 0; g && k < 6; k++) {
        PyObject *v = PyLong_FromLongLong(where[k]);
        if (!v) Py_CLEAR(g);
        else PyStructSequence_SetItem(g, k, v);
    }
    if (!g) { Py_DECREF(ids); Py_DECREF(batch); return NULL; }
    return Py_BuildValue("(NNN)", ids, batch, g);
}

static PyObject *CacheReader_close(CacheReader *self, PyObject *unused) {
    (void)unused;
    reader_close(self);
    Py_RETURN_NONE;
}

static Py_ssize_t CacheReader_len(CacheReader *self) { return self->steps; }

static PyObject *CacheReader_enter(PyObject *self, PyObject *unused) {
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *CacheReader_exit(CacheReader *self, PyObject *args) {
    (void)args;
    reader_close(self);
    Py_RETURN_NONE;
}

/* reader(*, order (n,) int64 example positions, batch_size, ragged=False, depth=2, encoder=None,
 *        device=False, threads=1, device_index=-1, seed=None, keep=-1, skip=0, part=0, parts=0,
 *        first_step=0) -> CacheReader: one epoch, read on a C thread; device with device_index >= 0:
 *        batches in that CUDA device's memory. order=None with a seed (an int in [0, 2**64)): the
 *        shuffled epoch of that seed, its first `keep` positions (-1: all), from position `skip`
 *        (drawn on the reader's thread). parts >= 1: each batch of batch_size is a global batch, of
 *        which slice `part` is read; next() yields (ids, batch, GlobalBatch), step counted from
 *        first_step */
static PyObject *CacheStore_reader(CacheStore *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"order", "batch_size", "ragged", "depth", "encoder", "device", "threads", "device_index",
                             "seed", "keep", "skip", "part", "parts", "first_step", NULL};
    PyObject *order_o, *enc_o = Py_None, *seed_o = Py_None;
    long long bs, keep = -1, skip = 0, part = 0, parts = 0, first_step = 0;
    int ragged = 0, depth = 2, device = 0, threads = 1, device_index = -1;
    if (!store_ready(self) || !ft_py_keywords_only(args, "reader()") ||
        !PyArg_ParseTupleAndKeywords(args, kw, "OL|piOpiiOLLLLL", kwlist, &order_o, &bs, &ragged, &depth, &enc_o,
                                     &device, &threads, &device_index, &seed_o, &keep, &skip, &part, &parts,
                                     &first_step))
        return NULL;
    if (parts < 0 || (parts && (part < 0 || part >= parts)) || first_step < 0)
        return ft_py_fail(ft_errors.input, "need 0 <= part < parts and first_step >= 0, got part %lld, parts %lld, "
                          "first_step %lld", part, parts, first_step);
    if (!device) device_index = -1;
    const int shuffled = order_o == Py_None;
    if (shuffled == (seed_o == Py_None))
        return ft_py_fail(ft_errors.input, "reader() takes an order or a seed (for a shuffled epoch), exactly one");
    unsigned long long seed = 0;
    if (shuffled) {
        if (!PyLong_Check(seed_o)) return ft_py_fail(ft_errors.input_type, "seed must be an int in [0, 2**64)");
        seed = PyLong_AsUnsignedLongLong(seed_o);
        if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return ft_py_fail(ft_errors.input, "seed must be an int in [0, 2**64)");
        }
        if (keep < 0) keep = self->N;
        if (keep > self->N || skip < 0)
            return ft_py_fail(ft_errors.input, "keep must be -1 or 0..%lld and skip >= 0, got %lld and %lld",
                              (long long)self->N, keep, skip);
        if (skip > keep) skip = keep;
    }
    ft_encoder *enc = NULL;
    if (enc_o != Py_None && !(enc = ft_py_encoder_from(enc_o))) return NULL;
    PyArrayObject *order = shuffled ? NULL : ft_py_want_array(order_o, "order", NPY_INT64, 1, 0);
    if (!shuffled && !order) return NULL;
    if (bs < 1 || depth < 1) return ft_py_fail(ft_errors.input, "batch_size and depth must be >= 1, got %lld and %d", bs, depth);
    const int64_t n = shuffled ? keep - skip : (int64_t)PyArray_DIM(order, 0);
    CacheReader *rd = PyObject_New(CacheReader, reader_type);
    if (!rd) return NULL;
    rd->r = NULL;
    rd->store = (CacheStore *)Py_NewRef(self);
    rd->encoder = enc ? Py_NewRef(enc_o) : NULL;
    rd->steps = (Py_ssize_t)((n + bs - 1) / bs);
    rd->ragged = ragged;
    rd->device = device;
    rd->device_index = device_index;
    rd->busy = rd->close_asked = 0;
    rd->sliced = parts > 0;
    rd->first_step = first_step;
    if (!parts) parts = 1;
    const ft_cache_layout layout = ragged ? FT_CACHE_RAGGED : FT_CACHE_PADDED;
    const ft_device dev = device_index >= 0 ? (ft_device){FT_DEVICE_CUDA, device_index} : (ft_device){FT_DEVICE_CPU, 0};
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = shuffled ? ft_cache_reader_start_shuffled(self->c, seed, keep, skip, bs, part, parts, layout, depth, enc,
                                                   threads, dev, &rd->r)
                  : ft_cache_reader_start(self->c, PyArray_DATA(order), n, bs, part, parts, layout, depth, enc, threads,
                                          dev, &rd->r);
    Py_END_ALLOW_THREADS
    if (st != FT_OK) { Py_DECREF(rd); return ft_py_raise(st); }
    return (PyObject *)rd;
}

static PyMethodDef CacheStore_methods[] = {
    {"add_shard", (PyCFunction)(void (*)(void))CacheStore_add_shard, METH_VARARGS | METH_KEYWORDS,
     "add_shard(*, name, examples, values, scales=None, file=None, crc32c=0): register a shard's rows."},
    {"index_of", (PyCFunction)CacheStore_index_of, METH_O, "index_of(example_ids) -> positions (int64)."},
    {"read", (PyCFunction)(void (*)(void))CacheStore_read, METH_VARARGS | METH_KEYWORDS,
     "read(*, example_ids, ragged=False, out=None, encoder=None, device=False, threads=0, device_index=-1) -> one batch."},
    {"reader", (PyCFunction)(void (*)(void))CacheStore_reader, METH_VARARGS | METH_KEYWORDS,
     "reader(*, order, batch_size, ragged=False, depth=2, encoder=None, device=False, threads=1, device_index=-1, "
     "seed=None, keep=-1, skip=0, part=0, parts=0, first_step=0) -> CacheReader."},
    {"counters", (PyCFunction)CacheStore_counters, METH_NOARGS, "(hits, misses) so far."},
    {"slices", (PyCFunction)CacheStore_slices, METH_VARARGS,
     "slices(order, batch_size, part, parts) -> (batches, 2) int64: [lo, hi) of slice `part` of `parts` in each global "
     "batch of order (cache indices): the reader's slices, balanced by cost."},
    {NULL, NULL, 0, NULL}};

static PyType_Slot CacheStore_slots[] = {
    {Py_tp_dealloc, CacheStore_dealloc},
    {Py_tp_init, CacheStore_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_methods, CacheStore_methods},
    {Py_tp_doc, "The read side of an ActivationCache (csrc/cache/store.c)."},
    {0, NULL}};

static PyType_Spec CacheStore_spec = {"fasttran._C.CacheStore", sizeof(CacheStore), 0, Py_TPFLAGS_DEFAULT,
                                      CacheStore_slots};

static PyMethodDef CacheReader_methods[] = {
    {"close", (PyCFunction)CacheReader_close, METH_NOARGS, "Stop the reader thread and wait for it."},
    {"__enter__", CacheReader_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)CacheReader_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PyType_Slot CacheReader_slots[] = {
    {Py_tp_dealloc, CacheReader_dealloc},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, CacheReader_next},
    {Py_tp_methods, CacheReader_methods},
    {Py_sq_length, CacheReader_len},
    {Py_tp_doc, "One epoch of cache batches, read ahead on a C thread: yields (example_ids, batch)."},
    {0, NULL}};

static PyType_Spec CacheReader_spec = {"fasttran._C.CacheReader", sizeof(CacheReader), 0,
                                       Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, CacheReader_slots};

static PyMethodDef cache_methods[] = {
    {"cache_encode", (PyCFunction)(void (*)(void))py_cache_encode, METH_VARARGS | METH_KEYWORDS,
     "cache_encode(*, src, codec) -> (values, scales | None, (max_abs_err, sum_sq_err, sum_sq_ref))."},
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS, "crc32c(data, crc=0): CRC-32C of a buffer."},
    {"epoch_order", py_epoch_order, METH_VARARGS,
     "epoch_order(seed, n) -> (n,) int64: the order of a shuffled epoch (a permutation of 0..n-1, a pure function of seed and n)."},
    {"input_fingerprints", (PyCFunction)(void (*)(void))py_input_fingerprints, METH_VARARGS | METH_KEYWORDS,
     "input_fingerprints(*, tokens, types, offsets) -> (N,) uint64 per-example input fingerprints."},
    {NULL, NULL, 0, NULL}};

static int add_type(PyObject *m, PyType_Spec *spec, const char *name, PyTypeObject **slot) {
    PyObject *tp = PyType_FromModuleAndSpec(m, spec, NULL);
    if (!tp) return -1;
    int r = PyModule_AddObjectRef(m, name, tp);
    if (r == 0) *slot = (PyTypeObject *)tp;   /* the module holds the reference */
    Py_DECREF(tp);
    return r;
}

/* CACHE_CODECS {name: (ft_dtype, NumPy storage dtype, scaled)}, from FT_CACHE_CODECS; the storage
 * types' NumPy numbers for codec_npy */
static int add_codecs(PyObject *m) {
    PyObject *d = PyDict_New();
    if (!d) return -1;
    for (int k = 0; k < FT_DTYPE_COUNT; k++) {
        const ft_cache_codec *kd = ft_cache_codec_get((ft_dtype)k);
        if (!kd) continue;
        PyArray_Descr *descr = NULL;
        PyObject *storage = PyUnicode_FromString(kd->storage);
        const int ok = storage && PyArray_DescrConverter(storage, &descr) == NPY_SUCCEED;
        Py_XDECREF(storage);
        PyObject *v = ok ? Py_BuildValue("(isO)", k, kd->storage, kd->scaled ? Py_True : Py_False) : NULL;
        if (ok) {
            codec_types[k] = descr->type_num;
            Py_DECREF(descr);
        }
        if (!v || PyDict_SetItemString(d, kd->name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    const int r = PyModule_AddObjectRef(m, "CACHE_CODECS", d);
    Py_DECREF(d);
    return r;
}

int ft_py_add_cache_functions(PyObject *m) {
    if (add_codecs(m) < 0) return -1;
    if (add_type(m, &CacheStore_spec, "CacheStore", &store_type) < 0 ||
        add_type(m, &CacheReader_spec, "CacheReader", &reader_type) < 0)
        return -1;
    if (!(global_batch_type = PyStructSequence_NewType(&global_batch_desc)) ||
        PyModule_AddObjectRef(m, "GlobalBatch", (PyObject *)global_batch_type) < 0)
        return -1;
    return PyModule_AddFunctions(m, cache_methods);
}
