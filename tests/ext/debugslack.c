/* debugslack: a stale address in the slack after a debug-hooked block (CPython's debug hooks,
 * PYTHONMALLOC=malloc_debug or pymalloc_debug; tests/integration/test_debug_hooks_live.py).
 * Under the hooks PyMem_Malloc(n) asks malloc for a 16-byte prefix, n bytes and an 8-byte tail;
 * glibc rounds that up, and the bytes after the tail are never written by the block's owner:
 * they keep what the chunk's earlier user wrote there.
 *   plant(n, where, hooks) -> (address, usable size) of a 200-byte block that is then forgotten
 *                  (its first 32 bytes hold "debugslack.leak"). hooks: how many debug frames
 *                  wrap the block (2 for a block over 512 bytes under pymalloc_debug: the object
 *                  domain's hook, then the raw one's, as pymalloc hands it to PyMem_RawMalloc).
 *                  First a plain malloc of the hooked size (n + 24 per frame) takes the
 *                  chunk, stores the block's address in its last word and frees it; then
 *                  PyMem_Malloc(n) takes the same chunk (this thread's tcache) and is kept.
 *                  where = "slack": nothing else is written; "data": the address is also
 *                  stored in the kept block's first requested word (a real reference)
 *   slack_holds()  -> True when the chunk's last word still holds the block's address
 * The work runs on the calling thread; its stack below is zeroed after it and the addresses
 * are kept complemented: no other copy of the forgotten block's address is left. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <malloc.h>
#include <stdint.h>
#include <string.h>
#include "scrub.h"

static void *kept;                      /* the PyMem_Malloc block: reachable */
static volatile unsigned long leak_hidden, chunk_hidden;
static volatile size_t leak_usable, slack_off;

/* 0, or a negative code: -1 no memory, -2 the hooked size leaves no slack word, -3 the hooked
 * block did not take the freed chunk (its address is not the chunk's + 16). */
static __attribute__((noinline)) int do_plant(Py_ssize_t n, int in_data, int hooks)
{
    size_t raw = (size_t)n + 24 * (size_t)hooks;
    char *l = malloc(200);
    if (!l)
        return -1;
    memset(l, 0, 32);
    strcpy(l, "debugslack.leak");
    char *x = malloc(raw);
    if (!x) {
        free(l);
        return -1;
    }
    size_t usable = malloc_usable_size(x);
    if (usable < raw + 8) {
        free(x);
        free(l);
        return -2;
    }
    memcpy(x + usable - 8, &l, 8);
    free(x);
    char *y = PyMem_Malloc((size_t)n);
    if (!y) {
        free(l);
        return -1;
    }
    kept = y;
    if (in_data)
        memcpy(y, &l, 8);
    leak_hidden = ~(unsigned long)l;
    leak_usable = malloc_usable_size(l);
    chunk_hidden = ~(unsigned long)x;
    slack_off = usable - 8;
    return y - 16 * hooks == x ? 0 : -3;
}

static PyObject *plant(PyObject *self, PyObject *args)
{
    Py_ssize_t n;
    const char *where;
    int hooks;
    if (!PyArg_ParseTuple(args, "nsi", &n, &where, &hooks))
        return NULL;
    if (n < 8 || hooks < 1 || hooks > 2 || kept) {
        PyErr_SetString(PyExc_ValueError, "n < 8, hooks not 1 or 2, or planted already");
        return NULL;
    }
    int rc = do_plant(n, strcmp(where, "data") == 0, hooks);
    scrub();
    if (rc == -1)
        return PyErr_NoMemory();
    if (rc < 0) {
        PyErr_Format(PyExc_RuntimeError, "fixture premise failed (%d): %s", rc,
                     rc == -2 ? "no slack word after the hooks' tail"
                              : "PyMem_Malloc did not take the freed chunk "
                                "(are the debug hooks on?)");
        return NULL;
    }
    return Py_BuildValue("(kn)", ~leak_hidden, (Py_ssize_t)leak_usable);
}

static PyObject *slack_holds(PyObject *self, PyObject *unused)
{
    unsigned long word;
    memcpy(&word, (char *)~chunk_hidden + slack_off, 8);
    return PyBool_FromLong(word == ~leak_hidden);
}

static PyMethodDef methods[] = {
    {"plant", plant, METH_VARARGS, "plant a stale address in a hooked block's slack"},
    {"slack_holds", slack_holds, METH_NOARGS, "the slack word still holds the address"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "debugslack", NULL, -1, methods};

PyMODINIT_FUNC PyInit_debugslack(void)
{
    return PyModule_Create(&module);
}
