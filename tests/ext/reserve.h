/* reserve.h: reserve(n[, at]) for the test extensions (leaky.c, pyleaks.c): map n bytes
 * PROT_NONE (never read, so never scanned), at address `at` exactly when given
 * (MAP_FIXED_NOREPLACE), else where the kernel puts it: under the existing mappings.
 * Returns the address. Include after <Python.h>. */
#ifndef MU_TEST_RESERVE_H
#define MU_TEST_RESERVE_H
#include <sys/mman.h>

static PyObject *reserve(PyObject *self, PyObject *args)
{
    Py_ssize_t n;
    unsigned long at = 0;
    if (!PyArg_ParseTuple(args, "n|k", &n, &at))
        return NULL;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (at ? MAP_FIXED_NOREPLACE : 0);
    void *r = mmap((void *)at, n, PROT_NONE, flags, -1, 0);
    if (r == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (at && (unsigned long)r != at) {
        munmap(r, n);
        PyErr_SetString(PyExc_OSError, "reserve: the kernel ignored the requested address");
        return NULL;
    }
    return PyLong_FromUnsignedLong((unsigned long)r);
}

#endif
