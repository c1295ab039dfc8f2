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

/* exception classes from fasttran.errors, looked up at module init */
typedef struct {
    PyObject *base, *input, *input_type, *input_range, *checkpoint, *not_found, *io, *unsupported, *backend;
} ft_py_errors;
extern ft_py_errors ft_errors;

/* Raise the exception for `st` with ft_last_error() as its message; returns NULL. */
PyObject *ft_py_raise(ft_status st);
/* Raise `cls` with a formatted message; returns NULL. */
PyObject *ft_py_fail(PyObject *cls, const char *fmt, ...);

int ft_py_add_encoder_type(PyObject *module);
int ft_py_add_tensor_type(PyObject *module);
int ft_py_add_cache_functions(PyObject *module);
int ft_py_add_train_functions(PyObject *module);
int ft_py_add_layer_type(PyObject *module);
/* the ft_encoder of a fasttran._C.EncoderCore (NULL with an exception set otherwise) */
ft_encoder *ft_py_encoder_of(PyObject *obj);
int ft_py_add_profile_functions(PyObject *module);
int ft_py_add_optimizer_type(PyObject *module);

/* fasttran.Tensor (tensor_type.c). `release(owner, ctx, data)` frees the memory when the
 * tensor dies (NULL: nothing to free); `owner` is kept alive until then. On failure the
 * memory is released and NULL returned. strides in elements, NULL for C order. */
typedef void (*ft_py_release_fn)(PyObject *owner, void *ctx, void *data);
PyObject *ft_py_tensor_new(void *data, int ndim, const int64_t *shape, const int64_t *strides, ft_dtype dtype,
                           ft_device device, int readonly, PyObject *owner, ft_py_release_fn release,
                           void *release_ctx);
int ft_py_tensor_check(PyObject *obj);
/* Tensor.from_dlpack(obj, stream): a Tensor over a DLPack producer's memory, in place; for CUDA
 * tensors `stream` (an int, or None) is the stream the producer makes the data ready for. */
PyObject *ft_py_tensor_import(PyObject *obj, PyObject *stream);
int ft_py_tensor_readonly(PyObject *obj);
void *ft_py_tensor_data(PyObject *obj, int *ndim, const int64_t **shape, const int64_t **strides, ft_dtype *dtype,
                        ft_device *device);

#endif
