/* Call sites: the first user frame of a module call, as the recording's site id. (see hotpath.h)
 *
 * The walk of xsp/record/sites.py's CallSites.of_frame, with its two lookups cached here: is a
 * code object a library's (by its address), and the site id of a user frame's (code object,
 * instruction offset). A miss asks the recording's CallSites (Python), which classifies and
 * interns; the entry then holds the code object, so the address it is keyed by stays that code
 * object's. FastCall has no Python frame of its own: the thread's current frame is the one that
 * called the module (or xsp's `exposed` function, a library frame the walk passes).
 */
#include "hotpath.h"

static inline size_t code_slot(PyObject *code) {
    return ((uintptr_t)code >> 4) & (CODE_CACHE - 1);
}

static inline size_t site_slot(PyObject *code, int offset) {
    return (((uintptr_t)code >> 4) ^ ((uintptr_t)(unsigned int)offset * 0x9E3779B1u)) & (SITE_CACHE - 1);
}

/* frame.f_lasti: the offset in bytes of the instruction the frame runs (a call, here). */
static inline int frame_offset(PyFrameObject *frame) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(frame);
#else
    return frame->f_lasti < 0 ? -1 : frame->f_lasti * (int)sizeof(_Py_CODEUNIT);
#endif
}

/* 1 when `code` is a library's, 0 when the user's, -1 with an exception set. */
static int code_is_library(FastCall *self, PyObject *code) {
    CodeEntry *entry = &self->code_cache[code_slot(code)];
    if (entry->code == code) return entry->library;
    PyObject *answer = PyObject_CallMethodOneArg(self->sites, s_is_library, code);
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

/* The site id of a user frame running `code` at `offset`; -2 with an exception set. */
static long long site_id(FastCall *self, PyObject *code, int offset) {
    SiteEntry *entry = &self->site_cache[site_slot(code, offset)];
    if (entry->code == code && entry->offset == offset) return entry->site;
    PyObject *offset_object = PyLong_FromLong(offset);
    if (offset_object == NULL) return -2;
    PyObject *answer = PyObject_CallMethodObjArgs(self->sites, s_intern, code, offset_object, NULL);
    Py_DECREF(offset_object);
    if (answer == NULL) return -2;
    long long site = PyLong_Check(answer) ? as_ll(answer) : -2;
    Py_DECREF(answer);
    if (site == -2 || (site == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "xsp: CallSites.intern gave no int");
        return -2;
    }
    PyObject *old = entry->code;  /* as in code_is_library */
    entry->code = NULL;
    entry->offset = offset;
    entry->site = site;
    entry->code = Py_NewRef(code);
    Py_XDECREF(old);
    return site;
}

/* The thread's open calls' scopes (ThreadBuffer.site_scopes), or NULL without them. */
static SiteScope *site_scopes(FastCall *self, PyObject *buffer) {
    PyObject *scopes = SLOT(buffer, self->buffer_slots.site_scopes);
    if (scopes == NULL || !PyByteArray_CheckExact(scopes)
        || PyByteArray_GET_SIZE(scopes) < (Py_ssize_t)(SITE_SCOPES * sizeof(SiteScope)))
        return NULL;
    return (SiteScope *)PyByteArray_AS_STRING(scopes);
}

/* As a call at `depth` starts: its calling frame, its site not known yet. */
void open_site_scope(FastCall *self, PyObject *buffer, long long depth) {
    if (self->sites == NULL || depth < 0 || depth >= SITE_SCOPES) return;
    SiteScope *scopes = site_scopes(self, buffer);
    if (scopes == NULL) return;
    PyFrameObject *frame = PyThreadState_GetFrame(PyThreadState_Get());  /* new reference, or NULL */
    scopes[depth].caller = (uintptr_t)frame;  /* the thread's frame keeps it while the call runs */
    scopes[depth].site = SITE_UNKNOWN;
    Py_XDECREF(frame);
}

/* The site id of the calling thread's first user frame, from its current frame outwards, for
 * the call at `depth` that ends now; NO_SITE when there is none, no site table, or anything
 * fails (a call site never fails a call). The walk stops at the calling frame of an open call
 * whose site is known, and leaves its answer to those whose calling frames it passed. */
long long call_site(FastCall *self, PyObject *buffer, long long depth) {
    if (self->sites == NULL) return NO_SITE;
    SiteScope *scopes = depth >= 0 && depth < SITE_SCOPES ? site_scopes(self, buffer) : NULL;
    long long scope = scopes == NULL ? -1 : depth;  /* the next open call whose calling frame the walk may meet */
    long long passed[SITE_SCOPES];
    int passed_count = 0;
    PyFrameObject *frame = PyThreadState_GetFrame(PyThreadState_Get());  /* new reference, or NULL */
    long long site = NO_SITE;
    int known = 0;
    while (frame != NULL) {
        while (scope >= 0 && scopes[scope].caller == (uintptr_t)frame) {
            if (scopes[scope].site != SITE_UNKNOWN) {
                site = scopes[scope].site;
                known = 1;
                break;
            }
            passed[passed_count++] = scope--;
        }
        if (known) break;
        PyObject *code = (PyObject *)PyFrame_GetCode(frame);  /* new reference */
        int library = code_is_library(self, code);
        if (library == 0) {
            site = site_id(self, code, frame_offset(frame));
            if (site == -2) site = NO_SITE;
        }
        Py_DECREF(code);
        if (library != 1) break;  /* the user's frame, or a failure */
        PyFrameObject *back = PyFrame_GetBack(frame);  /* new reference, or NULL */
        Py_DECREF(frame);
        frame = back;
    }
    Py_XDECREF(frame);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return NO_SITE;
    }
    if (passed_count > 0) {  /* read again: a miss of the caches ran Python, which may have replaced them */
        scopes = site_scopes(self, buffer);
        for (int i = 0; scopes != NULL && i < passed_count; i++) scopes[passed[i]].site = site;
    }
    return site;
}
