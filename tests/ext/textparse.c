/* textparse: a small CPython extension written the way real ones are, with two bugs a user
 * expects a leak checker to catch (tests/integration/test_plugin.py). No address is hidden,
 * no address space is reserved: the leaks sit wherever the allocators put them.
 *   parse(text)     -> str: copies text into a 4 KiB scratch buffer and returns it; on text
 *                      starting with '!' it raises ValueError and forgets the buffer (the bug)
 *   remember(obj)   -> None: meant to store obj in a cache, but the cache was removed and the
 *                      Py_INCREF stayed (a refcount leak)
 *   remember_ok(obj)-> None: the same with the reference kept in a module-level list
 *   _last_scratch() -> (~address, usable size) of the last scratch buffer (complemented: no
 *                      pointer to it is kept): what a test asserts, and a lead for diagnosis
 *   _last_remembered() -> ~address of the last object remember() took (for diagnosis) */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>

#define SCRATCH 4096

static PyObject *cache;
static unsigned long last_scratch_hidden;
static size_t last_scratch_usable;
static unsigned long last_remembered_hidden;

static PyObject *parse(PyObject *self, PyObject *args)
{
    const char *text;
    if (!PyArg_ParseTuple(args, "s", &text))
        return NULL;
    char *buf = malloc(SCRATCH);
    if (!buf)
        return PyErr_NoMemory();
    last_scratch_hidden = ~(unsigned long)buf;
    last_scratch_usable = malloc_usable_size(buf);
    strncpy(buf, text, SCRATCH - 1);
    buf[SCRATCH - 1] = 0;
    if (buf[0] == '!') {
        PyErr_Format(PyExc_ValueError, "cannot parse %.20s", text);
        return NULL;                        /* bug: buf is not freed */
    }
    PyObject *out = PyUnicode_FromString(buf);
    free(buf);
    return out;
}

static PyObject *remember(PyObject *self, PyObject *obj)
{
    Py_INCREF(obj);                         /* bug: nothing owns this reference */
    last_remembered_hidden = ~(unsigned long)obj;
    Py_RETURN_NONE;
}

static PyObject *remember_ok(PyObject *self, PyObject *obj)
{
    if (PyList_Append(cache, obj) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *last_scratch(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("(kn)", last_scratch_hidden, (Py_ssize_t)last_scratch_usable);
}

static PyObject *last_remembered(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLong(last_remembered_hidden);
}

static PyMethodDef methods[] = {
    {"_last_remembered", last_remembered, METH_NOARGS,
     "~address of the last object remember() took"},
    {"_last_scratch", last_scratch, METH_NOARGS, "(~address, usable size) of the last scratch buffer"},
    {"parse", parse, METH_VARARGS, "parse text (leaks its scratch buffer on error)"},
    {"remember", remember, METH_O, "take a reference that is never released"},
    {"remember_ok", remember_ok, METH_O, "keep obj in the module's cache"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "textparse", NULL, -1, methods};

PyMODINIT_FUNC PyInit_textparse(void)
{
    cache = PyList_New(0);
    if (!cache)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObject(m, "cache", cache) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(cache);
    return m;
}
