/* leaky: a tiny CPython extension for the in-process tests.
 *   leak(n)     -> (~address, usable size) of a malloc(n) block whose pointer is dropped
 *   no_leak(n)  -> (~address, usable size) of a malloc(n) block that is freed again
 * tests/inprocess_helpers.py wraps it as leaky_leak()/leaky_no_leak() -> (address, size).
 * The address goes back as its complement (Python undoes it): passing the raw pointer to
 * Py_BuildValue would leave a copy in its varargs register-save area on the stack, which a
 * conservative scan rightly counts as a reference (the C fixtures use hide() likewise).
 * CPython stores the int in 30-bit digits, so no pointer-sized copy exists afterwards.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <malloc.h>
#include <string.h>
#include "reserve.h"

static PyObject *leak(PyObject *self, PyObject *args)
{
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "n", &n))
        return NULL;
    volatile char *p = malloc(n);
    if (!p)
        return PyErr_NoMemory();
    /* only the head is filled: memset(p, c, n) leaves the end pointer p + n in registers
     * and spill slots, and p + n lies inside the block's usable size (docs/limitations.md) */
    memset((char *)p, 0x5a, n < 64 ? n : 64);
    size_t usable = malloc_usable_size((void *)p);
    volatile unsigned long hidden = ~(unsigned long)p;
    p = NULL;
    return Py_BuildValue("(kn)", (unsigned long)hidden, (Py_ssize_t)usable);
}

static PyObject *no_leak(PyObject *self, PyObject *args)
{
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "n", &n))
        return NULL;
    char *p = malloc(n);
    if (!p)
        return PyErr_NoMemory();
    memset(p, 0x5a, n < 64 ? n : 64);
    size_t usable = malloc_usable_size(p);
    unsigned long hidden = ~(unsigned long)p;
    free(p);
    return Py_BuildValue("(kn)", hidden, (Py_ssize_t)usable);
}

static PyMethodDef methods[] = {
    {"reserve", reserve, METH_VARARGS, "map n bytes of PROT_NONE address space; returns its address"},
    {"leak", leak, METH_VARARGS, "malloc(n) and drop the pointer; returns (~address, usable size)"},
    {"no_leak", no_leak, METH_VARARGS, "malloc(n) and free it; returns (~address, usable size)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "leaky", NULL, -1, methods};

PyMODINIT_FUNC PyInit_leaky(void) { return PyModule_Create(&module); }
