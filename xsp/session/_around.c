/* Around: a call wrapped by two hooks, with no Python frame of its own.
 *
 * xsp follows child processes by wrapping two calls of the user's program: multiprocessing's
 * Process.start and a DataLoader worker's fetch. A wrapper written in Python is a frame on every
 * traceback that passes through it, so an error of the user's (a dataset that raises, a process
 * started twice) would print with xsp's lines in it. This one is C: the traceback is the one a
 * plain run prints.
 *
 * Around(before, function, after)(x): token = before(x); result = function(x);
 * after(x, token, failed); returns result (or raises what function raised). An error raised in
 * before or after is dropped: the hooks record, they never change what the call does. Bound as a
 * method when set on a class (x is then the instance).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *before;
    PyObject *function;
    PyObject *after;
} Around;

static int around_init(Around *self, PyObject *args, PyObject *kwargs) {
    PyObject *before, *function, *after;
    static char *keywords[] = {"before", "function", "after", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:Around", keywords, &before, &function, &after))
        return -1;
    Py_INCREF(before);
    Py_INCREF(function);
    Py_INCREF(after);
    Py_XSETREF(self->before, before);
    Py_XSETREF(self->function, function);
    Py_XSETREF(self->after, after);
    return 0;
}

static PyObject *around_call(Around *self, PyObject *args, PyObject *kwargs) {
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "Around takes one positional argument");
        return NULL;
    }
    if (PyTuple_GET_SIZE(args) != 1) {
        PyErr_SetString(PyExc_TypeError, "Around takes one positional argument");
        return NULL;
    }
    PyObject *argument = PyTuple_GET_ITEM(args, 0);
    PyObject *token = PyObject_CallOneArg(self->before, argument);
    if (token == NULL) {
        PyErr_Clear();
        token = Py_NewRef(Py_None);
    }
    PyObject *result = PyObject_CallOneArg(self->function, argument);
    PyObject *type = NULL, *value = NULL, *traceback = NULL;
    if (result == NULL)
        PyErr_Fetch(&type, &value, &traceback);
    PyObject *done = PyObject_CallFunctionObjArgs(self->after, argument, token, result == NULL ? Py_True : Py_False,
                                                  NULL);
    if (done == NULL)
        PyErr_Clear();
    Py_XDECREF(done);
    Py_DECREF(token);
    if (result == NULL)
        PyErr_Restore(type, value, traceback);
    return result;
}

static PyObject *around_descr_get(PyObject *self, PyObject *instance, PyObject *owner) {
    if (instance == NULL || instance == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, instance);
}

static int around_traverse(Around *self, visitproc visit, void *arg) {
    Py_VISIT(self->before);
    Py_VISIT(self->function);
    Py_VISIT(self->after);
    return 0;
}

static int around_clear(Around *self) {
    Py_CLEAR(self->before);
    Py_CLEAR(self->function);
    Py_CLEAR(self->after);
    return 0;
}

static void around_dealloc(Around *self) {
    PyObject_GC_UnTrack(self);
    around_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef around_members[] = {
    {"function", T_OBJECT, offsetof(Around, function), READONLY, "The call wrapped."},
    {NULL},
};

static PyTypeObject AroundType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp.session._around.Around",
    .tp_basicsize = sizeof(Around),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Around(before, function, after): function(x) between before(x) -> token and "
              "after(x, token, failed), with no Python frame of its own.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)around_init,
    .tp_call = (ternaryfunc)around_call,
    .tp_descr_get = around_descr_get,
    .tp_traverse = (traverseproc)around_traverse,
    .tp_clear = (inquiry)around_clear,
    .tp_dealloc = (destructor)around_dealloc,
    .tp_members = around_members,
};

static struct PyModuleDef around_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_around",
    .m_doc = "A call wrapped by two hooks, with no Python frame of its own (xsp/session/_around.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__around(void) {
    if (PyType_Ready(&AroundType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&around_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Around", (PyObject *)&AroundType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
