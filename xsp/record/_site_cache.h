/* The two lookups of a call site in front of a recording's CallSites (xsp/record/sites.py), kept
 * by address in small tables of the caller's: is a code object a library's, and the site id of
 * a user frame's (code object, instruction offset). A miss asks CallSites, which classifies and
 * interns. Each entry holds its code object (a strong reference), so that no other code object
 * can take its address meanwhile. Shared by the module-call wrapper (xsp/record/_hotpath/sites.c)
 * and the line tracer of operators (xsp/record/_lines/lines.c). */
#ifndef XSP_SITE_CACHE_H
#define XSP_SITE_CACHE_H

#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject *code;
    int library;  /* 1: a library's code, 0: the user's */
} CodeEntry;

typedef struct {
    PyObject *code;
    int offset;  /* the frame's instruction offset (frame.f_lasti) */
    long long site;  /* its id in the recording's CallSites, or NO_SITE */
} SiteEntry;

/* `size`: a table's entries, a power of two */
static inline size_t code_slot(PyObject *code, size_t size) { return ((uintptr_t)code >> 4) & (size - 1); }

static inline size_t site_slot(PyObject *code, int offset, size_t size) {
    return (((uintptr_t)code >> 4) ^ ((uintptr_t)(unsigned int)offset * 0x9E3779B1u)) & (size - 1);
}

/* 1 when `code` is a library's, 0 when the user's, -1 with an exception set; a miss calls
 * `sites.<is_library>(code)`. */
static inline int cached_is_library(CodeEntry *table, size_t size, PyObject *sites, PyObject *is_library,
                                    PyObject *code) {
    CodeEntry *entry = &table[code_slot(code, size)];
    if (entry->code == code) return entry->library;
    PyObject *answer = PyObject_CallMethodOneArg(sites, is_library, code);
    if (answer == NULL) return -1;
    int library = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    if (library < 0) return -1;
    /* Python ran: the entry is read again, and written whole before the code object it held is
     * freed (which may run Python: a weakref's callback) */
    PyObject *old = entry->code;
    entry->code = NULL;
    entry->library = library;
    entry->code = Py_NewRef(code);
    Py_XDECREF(old);
    return library;
}

/* The site id of a user frame running `code` at byte `offset`; -2 with an exception set. A miss
 * calls `sites.<intern>(code, offset)`. */
static inline long long cached_site(SiteEntry *table, size_t size, PyObject *sites, PyObject *intern,
                                    PyObject *code, int offset) {
    SiteEntry *entry = &table[site_slot(code, offset, size)];
    if (entry->code == code && entry->offset == offset) return entry->site;
    PyObject *offset_object = PyLong_FromLong(offset);
    if (offset_object == NULL) return -2;
    PyObject *answer = PyObject_CallMethodObjArgs(sites, intern, code, offset_object, NULL);
    Py_DECREF(offset_object);
    if (answer == NULL) return -2;
    long long site = PyLong_Check(answer) ? PyLong_AsLongLong(answer) : -2;
    Py_DECREF(answer);
    if (site == -2 || (site == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "xsp: CallSites.intern gave no int");
        return -2;
    }
    PyObject *old = entry->code;  /* as in cached_is_library */
    entry->code = NULL;
    entry->offset = offset;
    entry->site = site;
    entry->code = Py_NewRef(code);
    Py_XDECREF(old);
    return site;
}

#endif
