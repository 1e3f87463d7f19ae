/* The floor of a model-level timer, for benchmarks/production.py --split: nn.Module.__call__ replaced
 * by a C object that passes every call on and reads the clock around each top-level one (the
 * model's call), keeping the two readings in a ring in memory. It records nothing else: no
 * request's ids, no shapes, no steps, no windows. What it costs a service is what any wrapper
 * of every module call that times the model costs there, the least xsp's model level could.
 * Built by benchmarks/split_server.py with the machine's C compiler. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *original;
    vectorcallfunc original_call;
} Timer;

static __thread long depth;  /* module calls open on this thread */
#define RING 65536
static long long ring[RING][2];
static unsigned long long timed;

static long long now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec * 1000000000LL + now.tv_nsec;
}

static PyObject *call_on(Timer *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    if (self->original_call != NULL) return self->original_call(self->original, argv, nargsf, kwnames);
    return PyObject_Vectorcall(self->original, argv, nargsf, kwnames);
}

static PyObject *timer_vectorcall(PyObject *callable, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Timer *self = (Timer *)callable;
    long long start_ns = depth ? 0 : now_ns();
    depth++;
    PyObject *out = call_on(self, argv, nargsf, kwnames);
    depth--;
    if (!depth) {
        unsigned long long slot = timed++ % RING;
        ring[slot][0] = start_ns;
        ring[slot][1] = now_ns();
    }
    return out;
}

static PyObject *timer_get(PyObject *callable, PyObject *instance, PyObject *owner) {
    if (instance == NULL || instance == Py_None) return Py_NewRef(callable);
    return PyMethod_New(callable, instance);
}

static int timer_init(Timer *self, PyObject *args, PyObject *kwds) {
    PyObject *original;
    if (!PyArg_ParseTuple(args, "O", &original)) return -1;
    Py_XSETREF(self->original, Py_NewRef(original));
    self->original_call = PyVectorcall_Function(original);
    self->vectorcall = timer_vectorcall;
    return 0;
}

static PyObject *timer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Timer *self = (Timer *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) self->vectorcall = timer_vectorcall;
    return (PyObject *)self;
}

static void timer_dealloc(Timer *self) {
    Py_XDECREF(self->original);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject TimerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "timer_floor.Timer",
    .tp_basicsize = sizeof(Timer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = timer_new,
    .tp_init = (initproc)timer_init,
    .tp_dealloc = (destructor)timer_dealloc,
    .tp_descr_get = timer_get,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Timer, vectorcall),
};

static PyObject *timed_calls(PyObject *module, PyObject *unused) { return PyLong_FromUnsignedLongLong(timed); }

static PyMethodDef methods[] = {
    {"timed_calls", timed_calls, METH_NOARGS, "Top-level calls timed so far."},
    {NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "timer_floor", NULL, -1, methods};

PyMODINIT_FUNC PyInit_timer_floor(void) {
    if (PyType_Ready(&TimerType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "Timer", (PyObject *)&TimerType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
