/* fasttran._C.HostSum: the gradient sums of the ranks on one machine in shared memory
 * (csrc/dist/host_sum.h), behind fasttran.distributed.DataParallel's shared-memory transport;
 * shared_memory_of; and shared_grads(on), the process's veto on shared gradient tables (whether a
 * table is shared is its model's argument: LayerStack / Model(shared_grads=); this switch only
 * refuses it, for tests and for users who want the process group's transport). */
#include "binding.h"

#include <unistd.h>

#include "dist/host_sum.h"
#include "dist/shared.h"

typedef struct {
    PyObject_HEAD
    ft_host_sum *h;
    int rank, world, table_fd;
    size_t table_offset;
    uint64_t token;
} HostSum;

static void HostSum_dealloc(HostSum *self) {
    PyTypeObject *tp = Py_TYPE(self);
    ft_host_sum_free(self->h);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* HostSum(rank, world, table_address, table_floats, buckets, token) */
static int HostSum_init(HostSum *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"rank", "world", "table_address", "table_floats", "buckets", "token", NULL};
    int rank, world;
    unsigned long long addr, floats, token;
    PyObject *buckets_o;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiKKOK", kwlist, &rank, &world, &addr, &floats, &buckets_o, &token))
        return -1;
    if (self->h) { ft_py_fail(ft_errors.base, "HostSum is already initialised"); return -1; }
    int fd;
    size_t offset, bytes;
    if (!ft_shared_find((const void *)(uintptr_t)addr, &fd, &offset, &bytes) || bytes < floats * sizeof(float)) {
        ft_py_fail(ft_errors.input, "the gradient table is not in shared memory (its model was made without "
                   "shared_grads=True, or after fasttran._C.shared_grads(False))");
        return -1;
    }
    PyObject *seq = PySequence_Fast(buckets_o, "buckets must be a sequence of (offset, floats)");
    if (!seq) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t *off = PyMem_Calloc((size_t)n + 1, sizeof *off), *cnt = PyMem_Calloc((size_t)n + 1, sizeof *cnt);
    int ok = off && cnt;
    for (Py_ssize_t k = 0; ok && k < n; k++) {
        long long o, c;
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "LL", &o, &c);
        if (ok) off[k] = o, cnt[k] = c;
    }
    Py_DECREF(seq);
    ft_status st = FT_OK;
    if (ok) st = ft_host_sum_create(rank, world, fd, offset, (size_t)floats, off, cnt, (int)n, (uint64_t)token, &self->h);
    PyMem_Free(off);
    PyMem_Free(cnt);
    if (!ok) { if (!PyErr_Occurred()) PyErr_NoMemory(); return -1; }
    if (st != FT_OK) { ft_py_raise(st); return -1; }
    self->rank = rank, self->world = world, self->table_fd = fd, self->table_offset = offset, self->token = token;
    return 0;
}

static int int64_list(PyObject *o, int64_t *out, int n, const char *what) {
    PyObject *seq = PySequence_Fast(o, what);
    if (!seq) return 0;
    int ok = PySequence_Fast_GET_SIZE(seq) == n;
    for (int k = 0; ok && k < n; k++) {
        out[k] = (int64_t)PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(seq, k));
        ok = !PyErr_Occurred();
    }
    Py_DECREF(seq);
    if (!ok && !PyErr_Occurred()) ft_py_fail(ft_errors.input, "%s: one entry per rank", what);
    return ok;
}

/* connect(pids, table_fds, table_offsets, ctrl_fds, tokens): one entry per rank */
static PyObject *HostSum_connect(HostSum *self, PyObject *args) {
    PyObject *o[5];
    if (!self->h) return ft_py_fail(ft_errors.base, "HostSum is not initialised");
    if (!PyArg_ParseTuple(args, "OOOOO", &o[0], &o[1], &o[2], &o[3], &o[4])) return NULL;
    const int W = self->world;
    int64_t *v = PyMem_Calloc((size_t)W * 5, sizeof *v);
    if (!v) return PyErr_NoMemory();
    const char *names[5] = {"pids", "table_fds", "table_offsets", "ctrl_fds", "tokens"};
    for (int k = 0; k < 5; k++)
        if (!int64_list(o[k], v + k * W, W, names[k])) { PyMem_Free(v); return NULL; }
    ft_status st;
    FT_PY_NOGIL(st, ft_host_sum_connect(self->h, v, v + W, v + 2 * W, v + 3 * W, (const uint64_t *)(v + 4 * W)));
    PyMem_Free(v);
    return ft_py_none_or_raise(st);
}

static PyObject *HostSum_post(HostSum *self, PyObject *args) {
    int b;
    long long step;
    if (!PyArg_ParseTuple(args, "iL", &b, &step)) return NULL;
    if (!self->h) return ft_py_fail(ft_errors.base, "HostSum is not initialised");
    return ft_py_none_or_raise(ft_host_sum_post(self->h, b, step));
}

/* finish(step, loss, wait_s) -> the ranks' loss sum, or None when wait_s ran out first */
static PyObject *HostSum_finish(HostSum *self, PyObject *args) {
    long long step;
    double loss, wait_s, sum = 0;
    if (!PyArg_ParseTuple(args, "Ldd", &step, &loss, &wait_s)) return NULL;
    if (!self->h) return ft_py_fail(ft_errors.base, "HostSum is not initialised");
    int pending = 0;
    ft_status st;
    FT_PY_NOGIL(st, ft_host_sum_finish(self->h, step, loss, wait_s, &pending, &sum));
    if (st != FT_OK) return ft_py_raise(st);
    if (pending) Py_RETURN_NONE;
    return PyFloat_FromDouble(sum);
}

static PyObject *HostSum_endpoint(HostSum *self, void *unused) {
    (void)unused;
    if (!self->h) return ft_py_fail(ft_errors.base, "HostSum is not initialised");
    return Py_BuildValue("(iiniK)", (int)getpid(), self->table_fd, (Py_ssize_t)self->table_offset,
                         ft_host_sum_ctrl_fd(self->h), (unsigned long long)self->token);
}

static PyObject *HostSum_repr(HostSum *self) {
    return PyUnicode_FromFormat("HostSum(rank %d of %d)", self->rank, self->world);
}

static PyMethodDef HostSum_methods[] = {
    {"connect", (PyCFunction)HostSum_connect, METH_VARARGS,
     "connect(pids, table_fds, table_offsets, ctrl_fds, tokens): map the other ranks' tables (an entry per rank)."},
    {"post", (PyCFunction)HostSum_post, METH_VARARGS, "post(bucket, step): the bucket is final in this rank's table."},
    {"finish", (PyCFunction)HostSum_finish, METH_VARARGS,
     "finish(step, loss, wait_s) -> the ranks' loss sum (every table then holds the summed gradients), or None when "
     "wait_s ran out first: call again."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef HostSum_getset[] = {
    {"endpoint", (getter)HostSum_endpoint, NULL, "(pid, table fd, table offset, control fd, token): for the others",
     NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot HostSum_slots[] = {
    {Py_tp_dealloc, HostSum_dealloc}, {Py_tp_init, HostSum_init}, {Py_tp_new, PyType_GenericNew},
    {Py_tp_methods, HostSum_methods}, {Py_tp_getset, HostSum_getset}, {Py_tp_repr, HostSum_repr},
    {Py_tp_doc, "HostSum(rank, world, table_address, table_floats, buckets, token): gradient sums in shared memory "
                "among the ranks of one machine"},
    {0, NULL}};

static PyType_Spec HostSum_spec = {"fasttran._C.HostSum", sizeof(HostSum), 0, Py_TPFLAGS_DEFAULT, HostSum_slots};

/* 0 after shared_grads(False): models made from then on keep their gradient tables in plain memory
 * whatever they ask. Read and written with the GIL held. */
static int shared_grads_allowed = 1;

int ft_py_shared_grads(int asked) { return asked && shared_grads_allowed; }

/* shared_grads(on) -> the previous setting */
static PyObject *py_shared_grads(PyObject *self, PyObject *arg) {
    (void)self;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    const int was = shared_grads_allowed;
    shared_grads_allowed = on;
    return PyBool_FromLong(was);
}

/* shared_memory_of(address) -> (fd, offset, bytes to its end) or None */
static PyObject *py_shared_memory_of(PyObject *self, PyObject *arg) {
    (void)self;
    const unsigned long long a = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    int fd;
    size_t off, bytes;
    if (!ft_shared_find((const void *)(uintptr_t)a, &fd, &off, &bytes)) Py_RETURN_NONE;
    return Py_BuildValue("(inn)", fd, (Py_ssize_t)off, (Py_ssize_t)bytes);
}

static PyMethodDef functions[] = {
    {"shared_grads", py_shared_grads, METH_O,
     "shared_grads(on) -> previous: False refuses shared memory to the gradient tables of models made from now on, "
     "whatever they ask (LayerStack / Model(shared_grads=True): a data-parallel rank's); True (the default) lets "
     "them have it."},
    {"shared_memory_of", py_shared_memory_of, METH_O,
     "shared_memory_of(address) -> (fd, offset, bytes) of the shared allocation holding it, or None."},
    {NULL, NULL, 0, NULL}};

/* the HostSum type (the module's; one module per process) */
static PyObject *host_sum_type;

struct ft_host_sum *ft_py_host_sum_of(PyObject *obj, int *rank) {
    if (!host_sum_type || !PyObject_TypeCheck(obj, (PyTypeObject *)host_sum_type)) return NULL;
    *rank = ((HostSum *)obj)->rank;
    return ((HostSum *)obj)->h;
}

int ft_py_add_host_sum(PyObject *m) {
    PyObject *tp = PyType_FromModuleAndSpec(m, &HostSum_spec, NULL);
    if (!tp) return -1;
    Py_XSETREF(host_sum_type, Py_NewRef(tp));
    int r = PyModule_AddObjectRef(m, "HostSum", tp);
    Py_DECREF(tp);
    if (r < 0) return -1;
    return PyModule_AddFunctions(m, functions);
}
