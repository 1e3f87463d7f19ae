/* The user's line, moment by moment, on every thread: what an operator takes as the line that
 * issued it. (interface: xsp/record/_lines.pyi; use: xsp/record/operator_lines.py)
 *
 * A C trace function (PyEval_SetTrace, as debuggers and coverage use) follows the frames of the
 * user's code only: a library frame has its line events switched off as it starts (its
 * f_trace_lines), so it costs a call and a return event, never one per line. Each thread keeps a
 * stack of its user frames with the site (xsp.record.sites: a code object and instruction
 * offset, interned) of the line each runs now; the innermost one's site is the thread's "current
 * line", and every change of it is written down with the clock (CLOCK_MONOTONIC, what
 * time.perf_counter_ns reads). An operator that started at time t on that thread was issued by
 * the line current at t: torch operators, tensor arithmetic (`x * 2`, which no call event sees)
 * and module calls alike, since all run while their line is the innermost user line.
 *
 * Nothing here reads or writes Python-visible trace state: the trace function is installed with
 * no object (sys.gettrace() still says None), never over another tool's, and taken out only where
 * it is still the one installed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "../_site_cache.h"

#define NO_SITE (-1)        /* xsp.record.sites.NO_SITE */
#define STACK_DEPTH 256     /* user frames a thread's stack holds; deeper ones are counted only */
#define CODE_CACHE 1024     /* powers of two */
#define SITE_CACHE 4096

typedef struct {
    int64_t time_ns;
    int64_t site;
} Change;

typedef struct ThreadLines {
    struct ThreadLines *next;
    unsigned long native_id;
    Change *changes;
    Py_ssize_t count, capacity;
    int64_t dropped;        /* changes past the recording's limit, not written */
    int64_t current;        /* the site of the last change written (or counted) */
    int depth, hidden;      /* user frames on the stack, and those beyond STACK_DEPTH */
    int64_t stack[STACK_DEPTH];
} ThreadLines;


typedef struct {
    PyObject_HEAD
    PyObject *sites;        /* xsp.record.sites.CallSites: is_library(code), intern(code, offset) */
    PyObject *on_thread;    /* called with no arguments at each thread's first event, or NULL */
    Py_ssize_t max_changes; /* per thread */
    uint64_t generation;    /* which installation a thread's local pointer belongs to */
    int installed;
    Py_ssize_t refused;     /* threads that had another tool's trace function */
    ThreadLines *threads;
    CodeEntry codes[CODE_CACHE];
    SiteEntry site_cache[SITE_CACHE];
} LineTracer;

static LineTracer *active = NULL;  /* one at a time: PyTorch runs one profiler at a time too */
static uint64_t generations = 0;
static _Thread_local ThreadLines *local_lines = NULL;
static _Thread_local uint64_t local_generation = 0;
static PyObject *s_is_library, *s_intern, *s_f_trace_lines;

/* Whether `self` is still the tracer installed, in its installation `generation` (the one the
 * thread's lines belong to). Read again wherever Python may have run (a cache miss asks `sites`;
 * a thread's first event calls on_thread): another thread may meanwhile have taken the tracer
 * out (its threads' lines are then freed at the next install, or when the tracer goes) or put it
 * in again. The generation is the caller's copy, not the thread-local: each read of a shared
 * library's thread-local is a call. */
static inline int following(LineTracer *self, uint64_t generation) {
    return self->installed && active == self && self->generation == generation;
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* 1 when `code` is a library's, 0 when the user's, -1 with an exception set. */
static inline int code_is_library(LineTracer *self, PyObject *code) {
    return cached_is_library(self->codes, CODE_CACHE, self->sites, s_is_library, code);
}

/* The site of a user frame running `code` at byte `offset`; NO_SITE on failure (cleared). */
static int64_t site_of(LineTracer *self, PyObject *code, int offset) {
    long long site = cached_site(self->site_cache, SITE_CACHE, self->sites, s_intern, code, offset);
    if (site == -2) {
        PyErr_Clear();
        return NO_SITE;
    }
    return site;
}

static inline void change_to(LineTracer *self, ThreadLines *lines, int64_t site) {
    if (site == lines->current) return;
    lines->current = site;
    if (lines->count == lines->capacity) {
        if (lines->capacity >= self->max_changes) {
            lines->dropped++;
            return;
        }
        Py_ssize_t capacity = lines->capacity ? lines->capacity * 2 : 4096;
        if (capacity > self->max_changes) capacity = self->max_changes;
        Change *grown = PyMem_RawRealloc(lines->changes, (size_t)capacity * sizeof(Change));
        if (grown == NULL) {
            lines->dropped++;
            return;
        }
        lines->changes = grown;
        lines->capacity = capacity;
    }
    lines->changes[lines->count].time_ns = now_ns();
    lines->changes[lines->count].site = site;
    lines->count++;
}

static inline int64_t top_site(ThreadLines *lines) {
    return lines->depth > 0 && lines->hidden == 0 ? lines->stack[lines->depth - 1] : NO_SITE;
}

static inline void push(ThreadLines *lines, int64_t site) {
    if (lines->depth < STACK_DEPTH && lines->hidden == 0) lines->stack[lines->depth++] = site;
    else lines->hidden++;
}

/* A library frame: no line events for it (it still reports its call and return). */
static inline void quiet(PyFrameObject *frame) {
    if (PyObject_SetAttr((PyObject *)frame, s_f_trace_lines, Py_False) < 0) PyErr_Clear();
}

static inline int frame_offset(PyFrameObject *frame) { return PyFrame_GetLasti(frame); }

/* The user frames on the stack from `frame` outwards, as the thread's first event finds them:
 * pushed outermost first, each at the line it runs; the library frames among them quietened. */
static void take_stack(LineTracer *self, ThreadLines *lines, PyFrameObject *frame) {
    uint64_t generation = self->generation;
    PyFrameObject *users[STACK_DEPTH];
    int found = 0;
    Py_XINCREF(frame);
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        int library = code_is_library(self, (PyObject *)code);
        Py_DECREF(code);
        if (library < 0) PyErr_Clear();
        if (library == 1) quiet(frame);
        else if (library == 0 && found < STACK_DEPTH) users[found++] = (PyFrameObject *)Py_NewRef(frame);
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    int64_t sites[STACK_DEPTH];
    for (int i = found - 1; i >= 0; i--) {
        PyCodeObject *code = PyFrame_GetCode(users[i]);
        sites[found - 1 - i] = site_of(self, (PyObject *)code, frame_offset(users[i]));
        Py_DECREF(code);
        Py_DECREF(users[i]);
    }
    if (!following(self, generation)) return;  /* Python ran above: `lines` may be gone */
    for (int k = 0; k < found; k++) push(lines, sites[k]);
    change_to(self, lines, top_site(lines));
}

/* This thread's lines for the installation `self`, made (with the stack as it is) at its first event. */
static ThreadLines *thread_lines(LineTracer *self, PyFrameObject *frame, int what) {
    if (local_lines != NULL && local_generation == self->generation) return local_lines;
    ThreadLines *lines = PyMem_RawCalloc(1, sizeof(ThreadLines));
    if (lines == NULL) return NULL;
    lines->native_id = PyThread_get_thread_native_id();
    lines->current = INT64_MIN;  /* the first change is always written */
    lines->next = self->threads;
    self->threads = lines;
    uint64_t generation = self->generation;
    local_lines = lines;
    local_generation = generation;
    PyFrameObject *outer = what == PyTrace_CALL ? PyFrame_GetBack(frame) : (PyFrameObject *)Py_NewRef(frame);
    take_stack(self, lines, outer);
    Py_XDECREF(outer);
    if (self->on_thread != NULL && following(self, generation)) {  /* no trace events while it runs: this is one */
        PyObject *result = PyObject_CallNoArgs(self->on_thread);
        if (result == NULL) PyErr_Clear();
        Py_XDECREF(result);
    }
    return following(self, generation) ? lines : NULL;
}

/* Code PyTorch made with exec while it compiles (a "<string>" file, in a torch module's
 * namespace): its lines are no line of the user's, though no library folder holds them. */
static int generated_by_torch(PyFrameObject *frame, PyCodeObject *code) {
    const char *file = PyUnicode_Check(code->co_filename) ? PyUnicode_AsUTF8(code->co_filename) : NULL;
    if (file == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (file[0] != '<') return 0;
    PyObject *globals = PyFrame_GetGlobals(frame);  /* new reference */
    PyObject *name = globals != NULL && PyDict_Check(globals) ? PyDict_GetItemString(globals, "__name__") : NULL;
    const char *module = name != NULL && PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    int torch = module != NULL && strncmp(module, "torch", 5) == 0 && (module[5] == '\0' || module[5] == '.');
    if (module == NULL) PyErr_Clear();
    Py_XDECREF(globals);
    return torch;
}

static void follow(LineTracer *self, PyFrameObject *frame, int what);

static int trace(PyObject *unused, PyFrameObject *frame, int what, PyObject *arg) {
    LineTracer *self = active;
    if (self == NULL || (what != PyTrace_CALL && what != PyTrace_LINE && what != PyTrace_RETURN)) return 0;
    /* held while the event is followed: Python may run there, and another thread take the tracer
     * out and drop it (a session ending as a thread of the program starts) */
    Py_INCREF(self);
    follow(self, frame, what);
    Py_DECREF(self);
    return 0;
}

static void follow(LineTracer *self, PyFrameObject *frame, int what) {
    uint64_t generation = self->generation;  /* the lines thread_lines gives are of this installation */
    ThreadLines *lines = thread_lines(self, frame, what);
    if (lines == NULL) return;
    PyCodeObject *code = PyFrame_GetCode(frame);
    CodeEntry *entry = &self->codes[code_slot((PyObject *)code, CODE_CACHE)];
    int known = entry->code == (PyObject *)code;
    int library = code_is_library(self, (PyObject *)code);
    if (library < 0) {
        PyErr_Clear();
        library = 1;
    }
    if (!known && library == 0 && generated_by_torch(frame, code)) {
        library = 1;  /* decided once, at the code object's first event: its entry keeps it */
        entry->library = 1;
    }
    if (!following(self, generation)) {  /* a miss ran Python: `lines` may be gone */
        Py_DECREF(code);
        return;
    }
    if (library) {
        if (what != PyTrace_RETURN) quiet(frame);
    } else if (what == PyTrace_CALL) {
        push(lines, NO_SITE);  /* its first line event follows at once */
    } else if (what == PyTrace_LINE) {
        int64_t site = site_of(self, (PyObject *)code, frame_offset(frame));
        if (!following(self, generation)) {  /* a miss ran Python */
            Py_DECREF(code);
            return;
        }
        if (lines->depth == 0 && lines->hidden == 0) push(lines, site);
        else if (lines->hidden == 0) lines->stack[lines->depth - 1] = site;
        if (lines->hidden == 0) change_to(self, lines, site);
    } else {  /* a user frame returns (or unwinds): its caller's line is current again */
        if (lines->hidden > 0) lines->hidden--;
        else if (lines->depth > 0) lines->depth--;
        change_to(self, lines, top_site(lines));
    }
    Py_DECREF(code);
}

static void free_threads(LineTracer *self) {
    ThreadLines *lines = self->threads;
    self->threads = NULL;
    while (lines != NULL) {
        ThreadLines *next = lines->next;
        PyMem_RawFree(lines->changes);
        PyMem_RawFree(lines);
        lines = next;
    }
}

/* Take the trace function out of every thread where it is still the one installed. */
static void uninstall(LineTracer *self) {
    if (!self->installed) return;
    self->installed = 0;
    if (active == self) active = NULL;
    PyInterpreterState *interpreter = PyThreadState_Get()->interp;
    for (PyThreadState *state = PyInterpreterState_ThreadHead(interpreter); state != NULL;
         state = PyThreadState_Next(state)) {
        if (state->c_tracefunc == trace && _PyEval_SetTrace(state, NULL, NULL) < 0) PyErr_Clear();
    }
}

static int LineTracer_init(LineTracer *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"sites", "max_changes", "on_thread", NULL};
    PyObject *sites, *on_thread = Py_None;
    Py_ssize_t max_changes = 4 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|nO", keywords, &sites, &max_changes, &on_thread)) return -1;
    if (max_changes < 1) {
        PyErr_SetString(PyExc_ValueError, "max_changes must be positive");
        return -1;
    }
    Py_XSETREF(self->sites, Py_NewRef(sites));
    Py_XSETREF(self->on_thread, on_thread == Py_None ? NULL : Py_NewRef(on_thread));
    self->max_changes = max_changes;
    return 0;
}

static void LineTracer_dealloc(LineTracer *self) {
    uninstall(self);
    free_threads(self);
    for (int i = 0; i < CODE_CACHE; i++) Py_CLEAR(self->codes[i].code);
    for (int i = 0; i < SITE_CACHE; i++) Py_CLEAR(self->site_cache[i].code);
    Py_CLEAR(self->sites);
    Py_CLEAR(self->on_thread);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *LineTracer_install(LineTracer *self, PyObject *unused) {
    if (active != NULL && active != self) {
        PyErr_SetString(PyExc_RuntimeError, "another recording follows the user's lines already");
        return NULL;
    }
    if (!self->installed) {
        free_threads(self);
        self->generation = ++generations;
        self->refused = 0;
        self->installed = 1;
        active = self;
    }
    PyInterpreterState *interpreter = PyThreadState_Get()->interp;
    for (PyThreadState *state = PyInterpreterState_ThreadHead(interpreter); state != NULL;
         state = PyThreadState_Next(state)) {
        if (state->c_tracefunc == trace) continue;
        if (state->c_tracefunc != NULL) {
            self->refused++;
            continue;
        }
        if (_PyEval_SetTrace(state, trace, NULL) < 0) {
            PyErr_Clear();
            self->refused++;
        }
    }
    Py_RETURN_NONE;
}

/* threading.settrace's hook for the threads started while installed: put the C trace function
 * in place of this hook (sys.settrace's) on the new thread, then let its events through. */
static PyObject *LineTracer_on_new_thread(LineTracer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (self->installed && active == self) {
        PyThreadState *state = PyThreadState_Get();
        if (state->c_tracefunc != trace && _PyEval_SetTrace(state, trace, NULL) < 0) PyErr_Clear();
    }
    Py_RETURN_NONE;
}

static PyObject *LineTracer_uninstall(LineTracer *self, PyObject *unused) {
    uninstall(self);
    Py_RETURN_NONE;
}

/* [(native thread id, bytes of (time_ns, site) int64 pairs, dropped)], each thread's once. */
static PyObject *LineTracer_take(LineTracer *self, PyObject *unused) {
    PyObject *taken = PyList_New(0);
    if (taken == NULL) return NULL;
    for (ThreadLines *lines = self->threads; lines != NULL; lines = lines->next) {
        PyObject *item = Py_BuildValue("(ky#L)", lines->native_id, (const char *)lines->changes,
                                       (Py_ssize_t)(lines->count * (Py_ssize_t)sizeof(Change)),
                                       (long long)lines->dropped);
        if (item == NULL || PyList_Append(taken, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(taken);
            return NULL;
        }
        Py_DECREF(item);
    }
    if (!self->installed) free_threads(self);
    return taken;
}

/* Like take, while the lines are still followed: each thread's changes up to `cut_ns`, and its
 * dropped count (reset). The last of those stays with the thread, first of what is left: the
 * line current at the cut, which the next window's first operators take. (Called with the GIL,
 * which every writer of the changes holds: no change is written meanwhile.) */
static PyObject *LineTracer_take_before(LineTracer *self, PyObject *arg) {
    long long cut_ns = PyLong_AsLongLong(arg);
    if (cut_ns == -1 && PyErr_Occurred()) return NULL;
    PyObject *taken = PyList_New(0);
    if (taken == NULL) return NULL;
    for (ThreadLines *lines = self->threads; lines != NULL; lines = lines->next) {
        Py_ssize_t count = 0;
        while (count < lines->count && lines->changes[count].time_ns <= cut_ns) count++;
        PyObject *item = Py_BuildValue("(ky#L)", lines->native_id, (const char *)lines->changes,
                                       (Py_ssize_t)(count * (Py_ssize_t)sizeof(Change)), (long long)lines->dropped);
        if (item == NULL || PyList_Append(taken, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(taken);
            return NULL;
        }
        Py_DECREF(item);
        lines->dropped = 0;
        if (count > 1) {
            memmove(lines->changes, lines->changes + (count - 1),
                    (size_t)(lines->count - (count - 1)) * sizeof(Change));
            lines->count -= count - 1;
        }
    }
    return taken;
}

static PyObject *LineTracer_get_refused(LineTracer *self, void *unused) { return PyLong_FromSsize_t(self->refused); }

static PyObject *LineTracer_get_installed(LineTracer *self, void *unused) { return PyBool_FromLong(self->installed); }

static PyObject *traced_here(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(PyThreadState_Get()->c_tracefunc == trace);
}

static PyMethodDef LineTracer_methods[] = {
    {"install", (PyCFunction)LineTracer_install, METH_NOARGS,
     "Follow the lines on every thread that has no other trace function (again: the threads started since)."},
    {"on_new_thread", (PyCFunction)(void (*)(void))LineTracer_on_new_thread, METH_FASTCALL,
     "threading.settrace's hook: follow the lines of a thread started while installed."},
    {"uninstall", (PyCFunction)LineTracer_uninstall, METH_NOARGS, "Stop following lines, on every thread."},
    {"take", (PyCFunction)LineTracer_take, METH_NOARGS,
     "[(native_thread_id, changes, dropped)]: changes are int64 pairs (time_ns, site id)."},
    {"take_before", (PyCFunction)LineTracer_take_before, METH_O,
     "take_before(cut_ns): as take, while following: each thread's changes up to cut_ns (the last stays)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef LineTracer_getset[] = {
    {"refused", (getter)LineTracer_get_refused, NULL, "Threads left alone: another tool's trace function was there.", NULL},
    {"installed", (getter)LineTracer_get_installed, NULL, "Whether it follows lines now.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LineTracerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp.record._lines.LineTracer",
    .tp_basicsize = sizeof(LineTracer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "LineTracer(sites, max_changes=4194304, on_thread=None): the user's current line on every thread, as it changes.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)LineTracer_init,
    .tp_dealloc = (destructor)LineTracer_dealloc,
    .tp_methods = LineTracer_methods,
    .tp_getset = LineTracer_getset,
};

static PyMethodDef module_functions[] = {
    {"traced_here", traced_here, METH_NOARGS, "Whether this thread's trace function is a LineTracer's."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lines_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_lines",
    .m_doc = "The user's current line on every thread, for the operators each line issues.", .m_size = -1,
    .m_methods = module_functions,
};

PyMODINIT_FUNC PyInit__lines(void) {
    if ((s_is_library = PyUnicode_InternFromString("is_library")) == NULL
        || (s_intern = PyUnicode_InternFromString("intern")) == NULL
        || (s_f_trace_lines = PyUnicode_InternFromString("f_trace_lines")) == NULL)
        return NULL;
    if (PyType_Ready(&LineTracerType) < 0) return NULL;
    PyObject *module = PyModule_Create(&lines_module);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "LineTracer", (PyObject *)&LineTracerType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
