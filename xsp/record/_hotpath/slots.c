/* Reading and writing the slots of ThreadBuffer and AutoSteps, thread buffers, clocks. (see hotpath.h) */
#include "hotpath.h"

_Static_assert(CACHED_THREADS == 4, "EACH_CACHED names every entry of a BufferCache");



void slot_set(PyObject *obj, Py_ssize_t offset, PyObject *value) {
    PyObject *old = SLOT(obj, offset);
    Py_INCREF(value);
    SLOT(obj, offset) = value;
    Py_XDECREF(old);
}

int slot_set_ll(PyObject *obj, Py_ssize_t offset, long long value) {
    PyObject *boxed = PyLong_FromLongLong(value);
    if (boxed == NULL) return -1;
    slot_set(obj, offset, boxed);
    Py_DECREF(boxed);
    return 0;
}

/* An int slot's value; -1 with an exception set when it is unset or no int. */
long long slot_ll(PyObject *obj, Py_ssize_t offset) {
    PyObject *value = SLOT(obj, offset);
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "slot not set");
        return -1;
    }
    return as_ll(value);
}

int slot_offset(PyObject *type, const char *name, Py_ssize_t *offset) {
    PyObject *descriptor = PyObject_GetAttrString(type, name);
    if (descriptor == NULL) return -1;
    int ok = Py_IS_TYPE(descriptor, &PyMemberDescr_Type)
             && ((PyMemberDescrObject *)descriptor)->d_member->type == T_OBJECT_EX;
    if (ok) *offset = ((PyMemberDescrObject *)descriptor)->d_member->offset;
    Py_DECREF(descriptor);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%R.%s is not a slot", type, name);
        return -1;
    }
    return 0;
}

/* The offsets of every ThreadBuffer and AutoSteps slot C reads or writes. */
int find_slots(PyObject *buffer_type, PyObject *steps_type, BufferSlots *b, StepsSlots *s) {
    struct { PyObject *type; const char *name; Py_ssize_t *offset; } slots[] = {
        {buffer_type, "depth", &b->depth}, {buffer_type, "steps", &b->steps}, {buffer_type, "aside", &b->aside},
        {buffer_type, "roots", &b->roots}, {buffer_type, "calls", &b->calls},
        {buffer_type, "descriptor_ids", &b->descriptor_ids}, {buffer_type, "module_ids", &b->module_ids},
        {buffer_type, "skipping", &b->skipping}, {buffer_type, "open_steps", &b->open_steps},
        {buffer_type, "marks", &b->marks}, {buffer_type, "optimizer_starts", &b->optimizer_starts},
        {buffer_type, "packed_calls", &b->packed_calls},
        {buffer_type, "packed_roots", &b->packed_roots}, {buffer_type, "hot_module", &b->hot_module},
        {buffer_type, "hot_module_id", &b->hot_module_id}, {buffer_type, "hot_inputs", &b->hot_inputs},
        {buffer_type, "hot_inputs_id", &b->hot_inputs_id}, {buffer_type, "hot_outputs", &b->hot_outputs},
        {buffer_type, "hot_outputs_id", &b->hot_outputs_id}, {buffer_type, "hot2_module", &b->hot2_module},
        {buffer_type, "hot2_module_id", &b->hot2_module_id}, {buffer_type, "hot2_inputs", &b->hot2_inputs},
        {buffer_type, "hot2_inputs_id", &b->hot2_inputs_id}, {buffer_type, "hot2_outputs", &b->hot2_outputs},
        {buffer_type, "hot2_outputs_id", &b->hot2_outputs_id}, {buffer_type, "site_scopes", &b->site_scopes},
        {buffer_type, "step_limit", &b->step_limit}, {buffer_type, "step_operators", &b->step_operators},
        {buffer_type, "decided_ns", &b->decided_ns}, {buffer_type, "step_trace", &b->step_trace},
        {buffer_type, "step_notes", &b->step_notes},
        {buffer_type, "packed_notes", &b->packed_notes},
        {steps_type, "lane", &s->lane}, {steps_type, "lane_grad", &s->lane_grad},
        {steps_type, "start_ns", &s->start_ns}, {steps_type, "last_end_ns", &s->last_end_ns},
        {steps_type, "type", &s->type}, {steps_type, "closed_ns", &s->closed_ns}, {steps_type, "leader", &s->leader},
        {steps_type, "pieces", &s->pieces}, {steps_type, "nested", &s->nested}, {steps_type, "trained", &s->trained},
        {steps_type, "wait_ns", &s->wait_ns}, {steps_type, "resume_ns", &s->resume_ns}, {steps_type, "name", &s->name},
        {steps_type, "optimizer_seen", &s->optimizer_seen}, {steps_type, "closed_by", &s->closed_by},
        {steps_type, "python_decides", &s->python_decides}, {steps_type, "joiner", &s->joiner},
        {steps_type, "joined", &s->joined},
    };
    for (size_t i = 0; i < sizeof(slots) / sizeof(slots[0]); i++)
        if (slot_offset(slots[i].type, slots[i].name, slots[i].offset) < 0) return -1;
    return 0;
}

/* helpers ------------------------------------------------------------------------------ */
/* recording.local.b of the calling thread, `thread` (its current_thread()) (new reference),
 * through `cache`; NULL and no exception when the thread has no buffer yet (read from the
 * thread's dict of the local: no AttributeError is made for a new thread's first call), NULL
 * with an exception on an error. */
PyObject *thread_buffer(PyObject *local, BufferCache *cache, uint64_t thread) {
    for (int i = 0; i < CACHED_THREADS; i++)
        if (cache->buffers[i] != NULL && cache->threads[i] == thread) return Py_NewRef(cache->buffers[i]);
    PyObject *dict = PyObject_GetAttr(local, s___dict__);
    if (dict == NULL) return NULL;
    if (!PyDict_Check(dict)) {
        Py_DECREF(dict);
        PyErr_SetString(PyExc_TypeError, "xsp: recording.local has no dict");
        return NULL;
    }
    PyObject *buffer = Py_XNewRef(PyDict_GetItemWithError(dict, s_b));
    Py_DECREF(dict);
    if (buffer != NULL) {
        unsigned int entry = cache->next++ % CACHED_THREADS;
        Py_XSETREF(cache->buffers[entry], Py_NewRef(buffer));
        cache->threads[entry] = thread;
    }
    return buffer;
}

/* Append (kind, start, end, name, attributes, error) to buffer.marks, as the Python side does. */
int append_mark(const BufferSlots *slots, PyObject *buffer, PyObject *kind, PyObject *start, PyObject *end,
                       PyObject *name, PyObject *attributes, PyObject *error) {
    return append_mark_at(slots, buffer, kind, start, end, name, attributes, error, NULL);
}

/* As append_mark, with the site id of the user's line that made it (NULL: none, a row of six). */
int append_mark_at(const BufferSlots *slots, PyObject *buffer, PyObject *kind, PyObject *start, PyObject *end,
                   PyObject *name, PyObject *attributes, PyObject *error, PyObject *site) {
    PyObject *marks = SLOT(buffer, slots->marks);
    if (marks == NULL || !PyList_Check(marks)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its marks");
        return -1;
    }
    PyObject *row = site == NULL ? PyTuple_Pack(6, kind, start, end, name, attributes, error)
                                 : PyTuple_Pack(7, kind, start, end, name, attributes, error, site);
    if (row == NULL) return -1;
    int appended = PyList_Append(marks, row);
    Py_DECREF(row);
    return appended;
}

/* An int in an instance dict (the Recording's deadlines); -1 with an exception set when absent. */
long long dict_ll(PyObject *dict, PyObject *name) {
    PyObject *value = PyDict_GetItemWithError(dict, name);  /* borrowed */
    if (value != NULL) return as_ll(value);
    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
    return -1;
}



/* The call's (args, kwargs) as a tuple and a dict, for Python (a failure's record); 0 or -1. */
int unpacked(const Call *call, PyObject **args, PyObject **kwargs) {
    Py_ssize_t nkw = CALL_NKW(call);
    *kwargs = NULL;
    if ((*args = PyTuple_New(call->nargs)) == NULL) return -1;
    for (Py_ssize_t i = 0; i < call->nargs; i++) PyTuple_SET_ITEM(*args, i, Py_NewRef(call->argv[i + 1]));
    if ((*kwargs = PyDict_New()) == NULL) goto failed;
    for (Py_ssize_t i = 0; i < nkw; i++)
        if (PyDict_SetItem(*kwargs, PyTuple_GET_ITEM(call->kwnames, i), call->argv[1 + call->nargs + i]) < 0)
            goto failed;
    return 0;
failed:
    Py_CLEAR(*args);
    Py_CLEAR(*kwargs);
    return -1;
}

/* The clock, as a new reference (also written to *ns): time.perf_counter_ns's own. */
PyObject *read_clock(PyObject *now_function, long long *ns) {
#ifdef __linux__
    struct timespec now;  /* CPython's perf_counter is CLOCK_MONOTONIC on Linux */
    if (clock_gettime(CLOCK_MONOTONIC, &now) == 0) {
        *ns = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
        return PyLong_FromLongLong(*ns);
    }
#endif
    PyObject *value = PyObject_CallNoArgs(now_function);
    if (value == NULL) return NULL;
    *ns = as_ll(value);
    if (*ns == -1 && PyErr_Occurred()) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
}

/* 1 when autograd records a graph, 0 when not, -1 on error. */
int grad_enabled(FastCall *self) {
    if (self->native_grad_mode != NULL) return self->native_grad_mode() ? 1 : 0;
    PyObject *grad = PyObject_CallNoArgs(self->grad_enabled);
    if (grad == NULL) return -1;
    int enabled = grad == Py_True;
    Py_DECREF(grad);
    return enabled;
}
