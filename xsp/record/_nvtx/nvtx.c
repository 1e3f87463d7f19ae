/* NVTX ranges for xsp's spans, through the NVTX library the process can load.
 *
 * NVTX's calls reach a tool (Nsight Systems, or a test library) through the library that
 * implements them: NVIDIA's `libnvtx3interop.so.1` (the `nvidia-nvtx` wheels, CUDA's lib64)
 * or the older `libnvToolsExt.so.1`. Its first call loads the tool named by
 * NVTX_INJECTION64_PATH; without one, every call returns at once. xsp binds the handful of
 * calls it needs with dlopen/dlsym (no NVTX headers are needed to build it) and
 *
 *  - registers each span name once (nvtxDomainRegisterStringA) in one domain, "xsp", keeping an
 *    index per name: a range then costs the tool a handle, not a string;
 *  - pushes and pops ranges (nvtxDomainRangePushEx / RangePop) around module calls, from C through
 *    the capsule `ranges` (xsp/record/_nvtx.h), and from Python (push, pop);
 *  - starts and ends ranges that need not nest on one thread, by id.
 *
 * Each range carries its span's kind as its NVTX category (xsp.record.nvtx.RangeKind), which
 * Nsight exports with it: xsp's import of an Nsight export gives model and layer spans back.
 *
 * The event attribute structure is NVTX's ABI (nvtxEventAttributes_v2, version 3, 48 bytes);
 * the test library built in tests/ includes NVIDIA's own header and checks what arrives. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include "../_nvtx.h"

#define NVTX_VERSION 3
#define NVTX_COLOR_ARGB 1
#define NVTX_MESSAGE_TYPE_ASCII 1
#define NVTX_MESSAGE_TYPE_REGISTERED 3

typedef struct {
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t color_type;
    uint32_t color;
    int32_t payload_type;
    int32_t reserved0;
    uint64_t payload;
    int32_t message_type;
    const void *message;  /* const char * (ASCII) or a registered string's handle */
} EventAttributes;

_Static_assert(sizeof(EventAttributes) == 48, "nvtxEventAttributes_v2 is 48 bytes");

typedef void *(*domain_create_f)(const char *name);
typedef void *(*register_string_f)(void *domain, const char *text);
typedef int (*range_push_f)(void *domain, const EventAttributes *attributes);
typedef int (*range_pop_f)(void *domain);
typedef uint64_t (*range_start_f)(void *domain, const EventAttributes *attributes);
typedef void (*range_end_f)(void *domain, uint64_t id);

static struct {
    void *library;
    domain_create_f domain_create;
    register_string_f register_string;
    range_push_f push;
    range_pop_f pop;
    range_start_f start;
    range_end_f end;
    void *domain;
} nvtx;

/* One entry per message(): the registered handle (NULL when the tool registers none: the
 * text is sent instead), the text, its colour. Grown under the GIL. */
typedef struct {
    const void *handle;
    const char *text;
    uint32_t color;
    uint32_t category;
} Message;

static Message *messages;
static Py_ssize_t message_count, message_capacity;
static PyObject *texts;  /* a list keeping every message's bytes alive */

static inline int ready(void) { return nvtx.push != NULL; }

static inline void fill(EventAttributes *attributes, int64_t index) {
    const Message *message = &messages[index];
    memset(attributes, 0, sizeof *attributes);
    attributes->version = NVTX_VERSION;
    attributes->size = (uint16_t)sizeof *attributes;
    attributes->color_type = NVTX_COLOR_ARGB;
    attributes->color = message->color;
    attributes->category = message->category;
    if (message->handle != NULL) {
        attributes->message_type = NVTX_MESSAGE_TYPE_REGISTERED;
        attributes->message = message->handle;
    } else {
        attributes->message_type = NVTX_MESSAGE_TYPE_ASCII;
        attributes->message = message->text;
    }
}

static void push_range(int64_t index) {
    if (!ready() || index < 0 || index >= message_count) return;
    EventAttributes attributes;
    fill(&attributes, index);
    nvtx.push(nvtx.domain, &attributes);
}

static void pop_range(void) {
    if (ready()) nvtx.pop(nvtx.domain);
}

static const xsp_nvtx hooks = {push_range, pop_range};

static void *symbol(const char *name) {
    void *found = dlsym(nvtx.library, name);
    if (found == NULL) PyErr_Format(PyExc_OSError, "the NVTX library has no %s", name);
    return found;
}

static PyObject *bind(PyObject *module, PyObject *args) {
    const char *path, *domain;
    if (!PyArg_ParseTuple(args, "ss", &path, &domain)) return NULL;
    if (ready()) {
        PyErr_SetString(PyExc_RuntimeError, "the NVTX library is bound already");
        return NULL;
    }
    void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        const char *why = dlerror();
        PyErr_Format(PyExc_OSError, "%s", why ? why : path);
        return NULL;
    }
    nvtx.library = library;
    domain_create_f domain_create = (domain_create_f)symbol("nvtxDomainCreateA");
    register_string_f register_string = (register_string_f)symbol("nvtxDomainRegisterStringA");
    range_push_f push = (range_push_f)symbol("nvtxDomainRangePushEx");
    range_pop_f pop = (range_pop_f)symbol("nvtxDomainRangePop");
    range_start_f start = (range_start_f)symbol("nvtxDomainRangeStartEx");
    range_end_f end = (range_end_f)symbol("nvtxDomainRangeEnd");
    if (!domain_create || !register_string || !push || !pop || !start || !end) {
        dlclose(library);
        nvtx.library = NULL;
        return NULL;
    }
    nvtx.domain_create = domain_create;
    nvtx.register_string = register_string;
    nvtx.start = start;
    nvtx.end = end;
    nvtx.pop = pop;
    /* the first NVTX call loads the tool, which may be slow: done here, not inside a span */
    Py_BEGIN_ALLOW_THREADS
    nvtx.domain = domain_create(domain);
    Py_END_ALLOW_THREADS
    nvtx.push = push;  /* last: ready() from here on */
    Py_RETURN_NONE;
}

static PyObject *message(PyObject *module, PyObject *args) {
    PyObject *name;
    unsigned int color = 0xFF76B900, category = 0;
    if (!PyArg_ParseTuple(args, "U|II", &name, &color, &category)) return NULL;
    if (!ready()) {
        PyErr_SetString(PyExc_RuntimeError, "no NVTX library is bound");
        return NULL;
    }
    PyObject *text = PyUnicode_AsUTF8String(name);
    if (text == NULL) return NULL;
    if (PyList_Append(texts, text) < 0) {
        Py_DECREF(text);
        return NULL;
    }
    Py_DECREF(text);  /* the list keeps it */
    if (message_count == message_capacity) {
        Py_ssize_t capacity = message_capacity ? 2 * message_capacity : 256;
        Message *grown = PyMem_Realloc(messages, (size_t)capacity * sizeof(Message));
        if (grown == NULL) return PyErr_NoMemory();
        messages = grown;
        message_capacity = capacity;
    }
    const char *bytes = PyBytes_AS_STRING(text);
    messages[message_count] = (Message){nvtx.register_string(nvtx.domain, bytes), bytes, color, category};
    return PyLong_FromSsize_t(message_count++);
}

static int64_t index_of(PyObject *value) {
    long long index = PyLong_AsLongLong(value);
    if (index == -1 && PyErr_Occurred()) return -1;
    if (index < 0 || index >= message_count) {
        PyErr_SetString(PyExc_ValueError, "not a message of xsp.record._nvtx.message()");
        return -1;
    }
    return index;
}

static PyObject *push(PyObject *module, PyObject *value) {
    int64_t index = index_of(value);
    if (index < 0) return NULL;
    push_range(index);
    Py_RETURN_NONE;
}

static PyObject *pop(PyObject *module, PyObject *unused) {
    pop_range();
    Py_RETURN_NONE;
}

static PyObject *start(PyObject *module, PyObject *value) {
    int64_t index = index_of(value);
    if (index < 0) return NULL;
    if (!ready()) return PyLong_FromLong(0);
    EventAttributes attributes;
    fill(&attributes, index);
    return PyLong_FromUnsignedLongLong(nvtx.start(nvtx.domain, &attributes));
}

static PyObject *end(PyObject *module, PyObject *value) {
    unsigned long long id = PyLong_AsUnsignedLongLong(value);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (ready()) nvtx.end(nvtx.domain, id);
    Py_RETURN_NONE;
}

static PyObject *is_bound(PyObject *module, PyObject *unused) { return PyBool_FromLong(ready()); }

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(path, domain): load the NVTX library at path (dlopen), and create the domain. The first "
     "NVTX call loads the tool named by NVTX_INJECTION64_PATH. OSError when it cannot be loaded."},
    {"message", message, METH_VARARGS,
     "message(name, color=0xFF76B900, category=0) -> int: register name in the domain once; the index pushes "
     "it, with that ARGB colour and NVTX category."},
    {"push", push, METH_O, "push(message): push a range named by a message() index on this thread."},
    {"pop", pop, METH_NOARGS, "pop(): pop this thread's innermost range."},
    {"start", start, METH_O, "start(message) -> int: start a range that need not nest; its id ends it."},
    {"end", end, METH_O, "end(id): end a range that start() began."},
    {"is_bound", is_bound, METH_NOARGS, "is_bound() -> bool: whether a library is bound."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "_nvtx",
    "NVTX ranges for xsp's spans, through the NVTX library the process can load (see xsp.record.nvtx).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__nvtx(void) {
    PyObject *module = PyModule_Create(&definition);
    if (module == NULL) return NULL;
    if (texts == NULL && (texts = PyList_New(0)) == NULL) goto failed;
    PyObject *capsule = PyCapsule_New((void *)&hooks, XSP_NVTX_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(module, "ranges", capsule) < 0) {
        Py_XDECREF(capsule);
        goto failed;
    }
    return module;
failed:
    Py_DECREF(module);
    return NULL;
}
