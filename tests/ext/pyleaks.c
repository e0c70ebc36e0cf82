/* pyleaks: a CPython extension for tests/integration/test_cpython_leaks.py, built at test time
 * for each interpreter version checked.
 *   leak_native(n) -> (~address, usable size) of a malloc(n) block whose pointer is dropped
 *                     (the complement keeps a pointer-sized copy out of the interpreter)
 *   incref(obj)    -> None; takes a reference that is never released (a refcount leak)
 * The block is calloc'ed: no stale words of earlier users (PYTHONMALLOC=malloc reuses freed
 * objects' chunks) can make it reference other blocks, which would fold them under it; a
 * memset over the whole block would leave its end pointer (inside the usable size) in
 * registers and spill slots (docs/limitations.md). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <malloc.h>
#include <string.h>

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

static PyObject *incref(PyObject *self, PyObject *obj)
{
    Py_INCREF(obj);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"leak_native", leak_native, METH_VARARGS, "malloc(n), drop the pointer: (~address, usable size)"},
    {"incref", incref, METH_O, "take a reference that is never released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pyleaks", NULL, -1, methods};

PyMODINIT_FUNC PyInit_pyleaks(void) { return PyModule_Create(&module); }
