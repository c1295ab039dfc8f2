/* Shared pieces of the CPython binding. Errors from C arrive as ft_status and become a Python
 * exception here, exactly once (ft_py_raise). */
#ifndef FT_PYTHON_BINDING_H
#define FT_PYTHON_BINDING_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL fasttran_ARRAY_API
#ifndef FT_BINDING_MAIN
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include "fasttran.h"

/* exception classes from fasttran.errors, looked up at module init (ft_py_load_errors) */
typedef struct {
    PyObject *base, *input, *input_type, *input_range, *checkpoint, *not_found, *io, *unsupported, *backend,
        *cache_corrupt;
} ft_py_errors;
extern ft_py_errors ft_errors;
/* Fill ft_errors from fasttran.errors; -1 with an exception set when it cannot. */
int ft_py_load_errors(void);

/* Raise the exception for `st` with ft_last_error() as its message; returns NULL. */
PyObject *ft_py_raise(ft_status st);
/* Raise `cls` with a formatted message; returns NULL. */
PyObject *ft_py_fail(PyObject *cls, const char *fmt, ...);

/* Same, for the cache: a file that lies (FT_ERR_FORMAT) is a CacheCorruptError there. */
PyObject *ft_py_raise_cache(ft_status st);

/* Ctrl-C inside long C work: ft_py_cancel_begin releases the GIL; ft_py_cancel_check (an
 * ft_cancel_fn, called between steps without the GIL) takes it back briefly to run Python's
 * signal handlers and asks to stop when one raised; ft_py_cancel_end takes the GIL back and
 * restores that exception. */
typedef struct {
    PyThreadState *ts;
    PyObject *type, *value, *tb;
} ft_py_cancel;
void ft_py_cancel_begin(ft_py_cancel *cs);
int ft_py_cancel_check(void *cs);
void ft_py_cancel_end(ft_py_cancel *cs);

/* The ft_dtype of a NumPy type number (1), or 0 when there is none. */
int ft_py_npy_dtype(int npy, ft_dtype *out);

/* Functions with several arguments take them by keyword only: 1 if `args` is empty, else 0
 * with an InputTypeError naming `fn`. */
int ft_py_keywords_only(PyObject *args, const char *fn);

/* A C-contiguous, aligned (writeable if asked) ndarray of type `npy` and `nd` dimensions (nd < 0: any), or
 * NULL with an InputTypeError naming `what`. Borrowed: no new reference. */
PyArrayObject *ft_py_want_array(PyObject *o, const char *what, int npy, int nd, int writeable);

int ft_py_add_encoder_type(PyObject *module);
int ft_py_add_tensor_type(PyObject *module);
int ft_py_add_cache_functions(PyObject *module);
int ft_py_add_io_functions(PyObject *module);
int ft_py_add_train_functions(PyObject *module);
int ft_py_add_layer_type(PyObject *module);
int ft_py_add_model_type(PyObject *module);
int ft_py_add_host_sum(PyObject *module);
/* Whether a gradient table whose model asks for shared memory (`asked`) gets it: not after
 * fasttran._C.shared_grads(False) (host_sum_type.c). GIL held. */
int ft_py_shared_grads(int asked);
/* the ft_host_sum of a fasttran._C.HostSum (connected or not) and its rank, or NULL (no exception) for
 * any other object */
struct ft_host_sum *ft_py_host_sum_of(PyObject *obj, int *rank);
/* st = expr with the GIL released (expr must not touch Python objects) */
#define FT_PY_NOGIL(st, expr) \
    do {                      \
        Py_BEGIN_ALLOW_THREADS \
        (st) = (expr);         \
        Py_END_ALLOW_THREADS   \
    } while (0)
/* None, or the exception of a failed status */
PyObject *ft_py_none_or_raise(ft_status st);
/* the ft_layer_stack of an initialised fasttran._C.LayerStack and its device (NULL with an
 * exception otherwise) */
ft_layer_stack *ft_py_layer_stack_of(PyObject *obj, ft_device *dev);
/* a head configuration tuple (kind, hidden, num_labels, dropout[, loss, pooling]), checked */
int ft_py_parse_head(PyObject *config, ft_head_config *cfg);

/* A contiguous buffer of `dtype` from an ndarray (host) or a fasttran.Tensor (any device), named
 * `what` (what[index] when index >= 0) in errors; None allowed when `optional`. Returns 1
 * (data NULL for None) or 0 with an exception set. */
typedef struct {
    void *data;
    int64_t numel;
    ft_device device;
} ft_py_buf;
int ft_py_get_buf(PyObject *o, const char *what, Py_ssize_t index, ft_dtype dtype, int writeable, int optional,
                  ft_py_buf *buf);
/* the ft_encoder of a fasttran._C.EncoderCore (NULL with an exception set otherwise) */
ft_encoder *ft_py_encoder_of(PyObject *obj);
int ft_py_add_profile_functions(PyObject *module);
int ft_py_add_optimizer_type(PyObject *module);
/* An OptimizerTable (optim_type.c) made ready for steps outside its step(): the groups'
 * hyper-parameters read, each gradient of `grads` pointed to and held. 1: ready (*table, *cfg
 * filled; call ft_py_optim_finish after the steps); 0: an exception; -1: the groups no longer hold
 * the table's parameters (the caller rebuilds it). GIL held. */
int ft_py_optim_prepare(PyObject *obj, PyObject *groups, PyObject *grads, double max_norm, int check_finite,
                        ft_optim_table **table, ft_optim_config *cfg);
/* after the steps: the gradients let go; st's exception (NULL), else the number of tensors that
 * made their first update (as step() returns) */
PyObject *ft_py_optim_finish(PyObject *obj, ft_status st, const ft_optim_info *info);

/* The ft_encoder of an initialised fasttran._C.EncoderCore, or NULL with an exception. */
ft_encoder *ft_py_encoder_from(PyObject *obj);
/* the ft_cache of an initialised fasttran._C.CacheStore (borrowed: the object keeps it), or NULL
 * with InputTypeError set */
ft_cache *ft_py_cache_from(PyObject *obj);

/* fasttran.Tensor (tensor_type.c). `release(owner, ctx, data)` frees the memory when the
 * tensor dies (NULL: nothing to free); `owner` is kept alive until then. On failure the
 * memory is released and NULL returned. strides in elements, NULL for C order. */
typedef void (*ft_py_release_fn)(PyObject *owner, void *ctx, void *data);
PyObject *ft_py_tensor_new(void *data, int ndim, const int64_t *shape, const int64_t *strides, ft_dtype dtype,
                           ft_device device, int readonly, PyObject *owner, ft_py_release_fn release,
                           void *release_ctx);
int ft_py_tensor_check(PyObject *obj);
/* a 1-d float32 Tensor of n elements over memory `owner` holds (kept alive by the Tensor) */
PyObject *ft_py_flat_tensor(PyObject *owner, float *data, int64_t n, ft_device device);
/* Tensor.from_dlpack(obj, stream): a Tensor over a DLPack producer's memory, in place; for CUDA
 * tensors `stream` (an int, or None) is the stream the producer makes the data ready for. */
PyObject *ft_py_tensor_import(PyObject *obj, PyObject *stream);
int ft_py_tensor_readonly(PyObject *obj);
void *ft_py_tensor_data(PyObject *obj, int *ndim, const int64_t **shape, const int64_t **strides, ft_dtype *dtype,
                        ft_device *device);

#endif
