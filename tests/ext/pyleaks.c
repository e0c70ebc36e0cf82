/* pyleaks: a CPython extension for tests/integration/test_cpython_leaks.py, built at test time
 * for each interpreter version checked.
 *   leak_native(n) -> (~address, usable size) of a malloc(n) block whose pointer is dropped
 *                     (the complement keeps a pointer-sized copy out of the interpreter)
 *   incref(obj)    -> None; takes a reference that is never released (a refcount leak)
 *   leak_list(n, first), leak_str(text) -> ~address of a list of n ints / a str leaked by
 *                     refcount, built in C so that no stale copy of the address exists
 *   text_over_link(c) -> (~L, A): a leaked pymalloc block L and a kept one A whose first word
 *                     is a one-character string over a link into L (see the function)
 *   leak_into(addr)  -> (~address, usable size) of a calloc(1, 64) block whose address is
 *                     stored at addr (8-aligned) and nowhere else: its only pointer
 *   scrub()          -> None; zeroes 16 KiB of the stack below the caller (scrub.h): what
 *                     deeper calls left there
 * The block is calloc'ed: no stale words of earlier users (PYTHONMALLOC=malloc reuses freed
 * objects' chunks) can make it reference other blocks, which would fold them under it; a
 * memset over the whole block would leave its end pointer (inside the usable size) in
 * registers and spill slots (docs/limitations.md); the stack calloc used is zeroed after. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <malloc.h>
#include <string.h>
#include "reserve.h"
#include "scrub.h"

/* calloc(1, n), its address stored at *into (when into is not NULL) and nowhere else:
 * (~address, usable size). */
static PyObject *leaked_block(Py_ssize_t n, volatile uint64_t *into)
{
    volatile char *p = calloc(1, n);
    if (!p)
        return PyErr_NoMemory();
    p[0] = 0x5a;
    size_t usable = malloc_usable_size((void *)p);
    if (into)
        *into = (uint64_t)(uintptr_t)p;
    volatile unsigned long hidden = ~(unsigned long)p;
    p = NULL;
    scrub();                    /* calloc's frames below this one kept the address */
    return Py_BuildValue("(kn)", (unsigned long)hidden, (Py_ssize_t)usable);
}

static PyObject *leak_native(PyObject *self, PyObject *args)
{
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "n", &n))
        return NULL;
    return leaked_block(n, NULL);
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

/* text_over_link(c) -> (~L, A): two 32-byte pymalloc blocks (PyMem_Calloc) of one pool that
 * starts at a 64 KiB boundary W: L, its first block (W + 48), leaked; A, the next (W + 80),
 * kept (in `heads`), whose first word is c, a NUL, then A's own bytes from 2 on: what a
 * one-character string written over a free block's link leaves (the link's high bytes are
 * the pool's). For c = '1' that word reads as W + 0x31, inside L; for '0' it is W + 0x30, L's
 * address. None when pymalloc is not the allocator or no such pool turned up. */
static void *heads[16];
static int nheads;

static PyObject *text_over_link(PyObject *self, PyObject *args)
{
    int c;
    if (!PyArg_ParseTuple(args, "C", &c) || nheads == 16)
        return NULL;
    enum { N = 1 << 17 };
    void **all = calloc(N, sizeof(void *));
    if (!all)
        return PyErr_NoMemory();
    uintptr_t leak = 0, keep = 0;
    int n = 0;
    for (; n < N && !keep; n++) {
        all[n] = PyMem_Calloc(1, 32);
        uintptr_t p = (uintptr_t)all[n];
        if (n && (p & 0xffff) == 80 && (uintptr_t)all[n - 1] == p - 32) {
            leak = p - 32;
            keep = p;
        }
    }
    for (int k = 0; k < n; k++)
        if ((uintptr_t)all[k] != leak && (uintptr_t)all[k] != keep)
            PyMem_Free(all[k]);
    memset(all, 0, N * sizeof(void *));
    free(all);
    if (!keep)
        Py_RETURN_NONE;
    volatile uint64_t *w = (volatile uint64_t *)keep;
    w[0] = (keep & ~(uint64_t)0xffff) | (uint64_t)(unsigned char)c;
    heads[nheads++] = (void *)keep;
    volatile unsigned long hidden = ~(unsigned long)leak;
    leak = 0;
    return Py_BuildValue("(kk)", (unsigned long)hidden, (unsigned long)keep);
}

static PyObject *leak_into(PyObject *self, PyObject *args)
{
    unsigned long addr;
    if (!PyArg_ParseTuple(args, "k", &addr) || (addr & 7))
        return addr & 7 ? (PyErr_SetString(PyExc_ValueError, "unaligned"), NULL) : NULL;
    return leaked_block(64, (volatile uint64_t *)addr);
}

static PyObject *scrub_stack(PyObject *self, PyObject *unused)
{
    scrub();
    Py_RETURN_NONE;
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
    {"scrub", scrub_stack, METH_NOARGS, "zero 16 KiB of the stack below the caller"},
    {"leak_list", leak_list, METH_VARARGS, "a list of n ints leaked by refcount: ~address"},
    {"leak_str", leak_str, METH_VARARGS, "a str leaked by refcount: ~address"},
    {"leak_into", leak_into, METH_VARARGS, "calloc(1, 64), its address stored at addr only"},
    {"text_over_link", text_over_link, METH_VARARGS,
     "a leaked pymalloc block and a kept one whose first word is a string over a link into it"},
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
