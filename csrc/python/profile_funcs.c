/* Module functions behind fasttran.profile: switch the backend profiler on and off, read its
 * per-entry accumulators (core/profile.c). */
#include "binding.h"
#include "core/profile.h"

static PyObject *py_profile_start(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    ft_status st = ft_profile_start();
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

/* stop waits for recorded CUDA work (event resolution): GIL released */
static PyObject *py_profile_stop(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    ft_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ft_profile_stop();
    Py_END_ALLOW_THREADS
    if (st != FT_OK) return ft_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_profile_enabled(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyBool_FromLong(ft_profile_enabled());
}

/* profile_stats() -> [(name, kind, calls, host_seconds, device_seconds, args)] for every entry */
static PyObject *py_profile_stats(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    PyObject *list = PyList_New(FT_PE_COUNT);
    for (int i = 0; list && i < FT_PE_COUNT; i++) {
        ft_prof_stat s;
        ft_profile_stat(i, &s);
        PyObject *t = Py_BuildValue("(ssKdds)", s.name, ft_prof_kind_names[s.kind], (unsigned long long)s.calls,
                                    s.host_seconds, s.device_seconds, s.args);
        if (!t) { Py_CLEAR(list); break; }
        PyList_SET_ITEM(list, i, t);
    }
    return list;
}

static PyObject *py_profile_kinds(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    PyObject *t = PyTuple_New(FT_PROF_KINDS);
    for (int k = 0; t && k < FT_PROF_KINDS; k++) {
        PyObject *s = PyUnicode_FromString(ft_prof_kind_names[k]);
        if (!s) { Py_CLEAR(t); break; }
        PyTuple_SET_ITEM(t, k, s);
    }
    return t;
}

static PyMethodDef profile_methods[] = {
    {"profile_start", py_profile_start, METH_NOARGS, "Zero the backend profiler's counters and start it."},
    {"profile_stop", py_profile_stop, METH_NOARGS, "Stop the backend profiler (resolves CUDA events)."},
    {"profile_enabled", py_profile_enabled, METH_NOARGS, "Whether the backend profiler is counting."},
    {"profile_stats", py_profile_stats, METH_NOARGS,
     "[(name, kind, calls, host_seconds, device_seconds, args)] per op, copy service and cache gather."},
    {"profile_kinds", py_profile_kinds, METH_NOARGS, "The op kinds of the breakdown, in order."},
    {NULL, NULL, 0, NULL}};

int ft_py_add_profile_functions(PyObject *m) {
    ft_profile_install();   /* wrappers in place before any encoder or CUDA backend exists */
    return PyModule_AddFunctions(m, profile_methods);
}
