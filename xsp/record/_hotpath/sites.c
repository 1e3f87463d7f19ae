/* Call sites: the first user frame of a module call, as the recording's site id. (see hotpath.h)
 *
 * The walk of xsp/record/sites.py's CallSites.of_frame, with its two lookups cached in FastCall's
 * tables (xsp/record/_site_cache.h): is a code object a library's, and the site id of a user
 * frame's (code object, instruction offset). FastCall has no Python frame of its own: the
 * thread's current frame is the one that called the module (or xsp's `exposed` function, a
 * library frame the walk passes).
 */
#include "hotpath.h"

/* The thread's frames, walked outwards. On CPython 3.11 they are read where the interpreter
 * keeps them (its _PyInterpreterFrame, whose first fields are mirrored here as 3.11's
 * internal/pycore_frame.h lays them out): asking for a frame object instead makes one for each
 * frame passed (and frees it when the frame ends), which was most of what a call site cost a
 * layer inside nn.Sequential. Elsewhere, the public API (frame objects, counted references).
 * A Frame is compared by address only: a frame on the thread's stack is the only one there at
 * its address while it runs. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
typedef struct RawFrame {
    PyObject *f_func, *f_globals, *f_builtins, *f_locals;
    PyCodeObject *f_code;
    PyObject *frame_obj;
    struct RawFrame *previous;
    _Py_CODEUNIT *prev_instr;
    int stacktop;
    bool is_entry;
    char owner;
} RawFrame;
typedef RawFrame *Frame;
#define RAW_OWNED_BY_GENERATOR 1

/* A frame not started yet (its first instruction still ahead), which Python's own walks skip. */
static inline Frame complete(Frame frame) {
    while (frame != NULL && frame->owner != RAW_OWNED_BY_GENERATOR
           && frame->prev_instr < (_Py_CODEUNIT *)frame->f_code->co_code_adaptive + frame->f_code->_co_firsttraceable)
        frame = frame->previous;
    return frame;
}
static inline Frame frame_current(void) { return complete((Frame)PyThreadState_Get()->cframe->current_frame); }
static inline Frame frame_back(Frame frame) { return complete(frame->previous); }  /* lets `frame` go */
static inline PyObject *frame_code(Frame frame) { return (PyObject *)frame->f_code; }  /* borrowed */
static inline int frame_offset(Frame frame) {  /* frame.f_lasti: bytes, as PyFrame_GetLasti */
    int units = (int)(frame->prev_instr - (_Py_CODEUNIT *)frame->f_code->co_code_adaptive);
    return units < 0 ? -1 : units * (int)sizeof(_Py_CODEUNIT);
}
static inline void frame_release(Frame frame) { (void)frame; }
#else
typedef PyFrameObject *Frame;  /* a counted reference */
static inline Frame frame_current(void) { return PyThreadState_GetFrame(PyThreadState_Get()); }
static inline Frame frame_back(Frame frame) {  /* lets `frame` go */
    PyFrameObject *back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    return back;
}
static inline PyObject *frame_code(Frame frame) {  /* borrowed: the frame holds it */
    PyObject *code = (PyObject *)PyFrame_GetCode(frame);
    Py_DECREF(code);
    return code;
}
static inline int frame_offset(Frame frame) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(frame);
#else
    return frame->f_lasti < 0 ? -1 : frame->f_lasti * (int)sizeof(_Py_CODEUNIT);
#endif
}
static inline void frame_release(Frame frame) { Py_XDECREF(frame); }
#endif

/* 1 when `code` is a library's, 0 when the user's, -1 with an exception set. */
static inline int code_is_library(FastCall *self, PyObject *code) {
    return cached_is_library(self->code_cache, CODE_CACHE, self->sites, s_is_library, code);
}

/* The site id of a user frame running `code` at `offset`; -2 with an exception set. */
static inline long long site_id(FastCall *self, PyObject *code, int offset) {
    return cached_site(self->site_cache, SITE_CACHE, self->sites, s_intern, code, offset);
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
    Frame frame = frame_current();
    scopes[depth].caller = (uintptr_t)frame;  /* on the thread's stack while the call runs */
    scopes[depth].site = SITE_UNKNOWN;
    scopes[depth].machinery = 0;
    frame_release(frame);
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
    Frame frame = frame_current();
    if (frame != NULL && scope >= 1 && scopes[scope - 1].machinery != 0) {
        /* made by a library frame that the enclosing call's _call_impl called (its forward): the
         * same way out as the walk that found the site */
        int library = code_is_library(self, frame_code(frame));
        if (library == 1) {
            Frame back = frame_back(frame);
            int same_way = back != NULL && (uintptr_t)back == scopes[scope - 1].machinery;
            frame_release(back);
            if (same_way) return scopes[scope - 1].forward_site;
            frame = frame_current();
        }
        if (library < 0) PyErr_Clear();
    }
    /* whether the walk is passing the enclosing call's forward and call machinery: the frames
     * from the first must be a library's (its forward), _call_impl, _wrapped_call_impl, then
     * the enclosing call's calling frame */
    PyObject *machinery = self->call_machinery;
    int through_machinery = scope >= 1 && machinery != NULL && PyTuple_CheckExact(machinery)
                            && PyTuple_GET_SIZE(machinery) == 2;
    int hop = 0, forward_found = 0;
    uintptr_t call_impl_frame = 0;
    long long site = NO_SITE;
    int known = 0;
    while (frame != NULL) {
        if (through_machinery && hop == 3 && (uintptr_t)frame == scopes[depth - 1].caller) forward_found = 1;
        while (scope >= 0 && scopes[scope].caller == (uintptr_t)frame) {
            if (scopes[scope].site != SITE_UNKNOWN) {
                site = scopes[scope].site;
                known = 1;
                break;
            }
            passed[passed_count++] = scope--;
        }
        if (known) break;
        PyObject *code = frame_code(frame);
        if (through_machinery && hop >= 1 && hop < 3 && code != PyTuple_GET_ITEM(machinery, hop - 1))
            through_machinery = 0;
        if (hop == 1) call_impl_frame = (uintptr_t)frame;
        int library = code_is_library(self, code);
        if (library == 0) {
            site = site_id(self, code, frame_offset(frame));
            if (site == -2) site = NO_SITE;
        }
        if (library != 1) break;  /* the user's frame, or a failure */
        frame = frame_back(frame);
        hop++;
    }
    frame_release(frame);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return NO_SITE;
    }
    if (passed_count > 0 || forward_found) {  /* read again: a miss of the caches ran Python, which may have replaced them */
        scopes = site_scopes(self, buffer);
        for (int i = 0; scopes != NULL && i < passed_count; i++) scopes[passed[i]].site = site;
        if (scopes != NULL && forward_found) {
            scopes[depth - 1].machinery = call_impl_frame;
            scopes[depth - 1].forward_site = site;
        }
    }
    return site;
}
