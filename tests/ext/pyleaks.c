/* pyleaks: a CPython extension for tests/integration/test_cpython_leaks.py, built at test time
 * for each interpreter version checked.
 *   leak_native(n) -> (~address, usable size) of a malloc(n) block whose pointer is dropped
 *                     (the complement keeps a pointer-sized copy out of the interpreter)
 *   incref(obj)    -> None; takes a reference that is never released (a refcount leak)
 *   leak_list(n, first), leak_str(text) -> ~address of a list of n ints / a str leaked by
 *                     refcount, built in C so that no stale copy of the address exists
 * The block is calloc'ed: no stale words of earlier users (PYTHONMALLOC=malloc reuses freed
 * objects' chunks) can make it reference other blocks, which would fold them under it; a
 * memset over the whole block would leave its end pointer (inside the usable size) in
 * registers and spill slots (docs/limitations.md). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <malloc.h>
#include <string.h>
#include "reserve.h"

static PyObject *leak_native(PyObject *self, PyObject *args)
{
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "n", &n))
        return NULL;
    volatile char *p = calloc(1, n);
    if (!p)
        return PyErr_NoMemory();
    p[0] = 0x5a;
    size_t usable = malloc_usable_size((void *)p);
    volatile unsigned long hidden = ~(unsigned long)p;
    p = NULL;
    return Py_BuildValue("(kn)", (unsigned long)hidden, (Py_ssize_t)usable);
}

/* leak_list(n, first) -> ~address of a list of n ints first, first+1, ... with one reference
 * too many; built here so that no Python frame, argument array or dict ever holds it. */
static PyObject *leak_list(PyObject *self, PyObject *args)
{
    Py_ssize_t n;
    long first;
    if (!PyArg_ParseTuple(args, "nl", &n, &first))
        return NULL;
    /* 3.8/3.9 keep freed lists in an unexported static array whose slots beyond numfree
     * still point at the lists taken from it: a list from there stays reachable through a
     * stale slot (a known limit, cpython-memory.md section 6). So the free list is drained
     * first: ours is a fresh allocation, never in that array. */
    PyObject *drain[100];
    for (int k = 0; k < 100; k++)
        drain[k] = PyList_New(0);
    PyObject *list = PyList_New(n);
    for (int k = 0; k < 100; k++)
        Py_XDECREF(drain[k]);
    if (!list)
        return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *v = PyLong_FromLong(first + k);
        if (!v)
            return NULL;
        PyList_SET_ITEM(list, k, v);
    }
    Py_INCREF(list);            /* the leaked reference */
    unsigned long hidden = ~(unsigned long)list;
    Py_DECREF(list);            /* ours: the list stays alive with refcount 1 */
    return PyLong_FromUnsignedLong(hidden);
}

/* leak_str(text) -> ~address of a new str equal to text, with one reference too many. */
static PyObject *leak_str(PyObject *self, PyObject *args)
{
    const char *text;
    if (!PyArg_ParseTuple(args, "s", &text))
        return NULL;
    PyObject *s = PyUnicode_FromString(text);
    if (!s)
        return NULL;
    unsigned long hidden = ~(unsigned long)s;   /* refcount 1: the leaked reference */
    return PyLong_FromUnsignedLong(hidden);
}

static PyObject *incref(PyObject *self, PyObject *obj)
{
    Py_INCREF(obj);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"reserve", reserve, METH_VARARGS, "map n bytes of PROT_NONE address space; returns its address"},
    {"leak_native", leak_native, METH_VARARGS, "malloc(n), drop the pointer: (~address, usable size)"},
    {"incref", incref, METH_O, "take a reference that is never released"},
    {"leak_list", leak_list, METH_VARARGS, "a list of n ints leaked by refcount: ~address"},
    {"leak_str", leak_str, METH_VARARGS, "a str leaked by refcount: ~address"},
    {NULL, NULL, 0, NULL},
};

/* Multi-phase initialisation, no state: importable in every sub-interpreter, 3.12+'s isolated
 * ones (own GIL, own obmalloc) included (test_cpython_leaks.py::test_subinterpreters). */
static PyModuleDef_Slot slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pyleaks", NULL, 0, methods,
                                    slots, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_pyleaks(void) { return PyModuleDef_Init(&module); }
