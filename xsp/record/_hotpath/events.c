/* StepEvents and BackwardCall: the backward and optimizer-step hooks' bodies. (see hotpath.h) */
#include "hotpath.h"

/* loop events ------------------------------------------------------------------------- */


/* The calling thread's buffer (new reference), created on its first record. */
PyObject *events_buffer(StepEvents *self) {
    PyObject *buffer = thread_buffer(self->local, &self->cache, current_thread());
    if (buffer == NULL) {
        if (PyErr_Occurred()) return NULL;
        buffer = PyObject_CallNoArgs(self->new_buffer);  /* this thread's first record */
        if (buffer == NULL) return NULL;
    }
    if (!Py_IS_TYPE(buffer, (PyTypeObject *)self->buffer_type)) {
        Py_DECREF(buffer);
        PyErr_SetString(PyExc_TypeError, "xsp: recording.local.b is no ThreadBuffer");
        return NULL;
    }
    return buffer;
}

/* The site id (new reference) of the first user frame from the calling thread's current frame
 * outwards, through recording.sites.of_frame; NULL, with no exception, where there is no site
 * table or asking it failed (a line is never worth a failed backward pass). */
static PyObject *caller_site(StepEvents *self) {
    if (self->site_of == NULL || self->site_of == Py_None) return NULL;
    PyObject *frame = (PyObject *)PyEval_GetFrame();  /* borrowed */
    PyObject *site = PyObject_CallOneArg(self->site_of, frame == NULL ? Py_None : frame);
    if (site == NULL) PyErr_Clear();
    return site;
}

/* A piece of the open step ended at `end` (AutoSteps.piece_ends with trains, and the common
 * case of optimizer_ends); 1 when no step is open and Python opens one: the caller asks it
 * (an optimizer step; a backward pass outside xsp.step(), generate(), a module call and a
 * closure optimizer's step). */
int piece_ended(StepEvents *self, PyObject *buffer, PyObject *end, long long end_ns, PyObject *optimizer) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *steps = SLOT(buffer, self->buffer_slots.steps);
    if (steps == NULL || !Py_IS_TYPE(steps, (PyTypeObject *)self->steps_type)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its steps");
        return -1;
    }
    PyObject *type = SLOT(steps, ss->type);
    if (type == NULL) {
        PyErr_SetString(PyExc_AttributeError, "xsp: steps without a type");
        return -1;
    }
    if (optimizer != NULL && (type == self->step_none || SLOT(steps, ss->python_decides) != Py_False)) return 1;
    if (slot_set_ll(steps, ss->lane, 0) < 0) return -1;
    int suspended = !slot_is_zero(buffer, self->buffer_slots.open_steps) || !slot_is_zero(steps, ss->nested)
                    || !slot_is_zero(buffer, self->buffer_slots.depth);
    if (optimizer == NULL && type == self->step_none && !suspended) {
        PyObject *optimizer_starts = SLOT(buffer, self->buffer_slots.optimizer_starts);
        if (optimizer_starts != NULL && PyList_Check(optimizer_starts) && PyList_GET_SIZE(optimizer_starts) == 0)
            return 1;
    }
    if (optimizer != NULL) slot_set(steps, ss->optimizer_seen, Py_True);
    if (type == self->step_none || suspended) return 0;
    long long pieces = slot_ll(steps, ss->pieces), last_end_ns = slot_ll(steps, ss->last_end_ns);
    if (PyErr_Occurred()) return -1;
    if (slot_set_ll(steps, ss->pieces, pieces + 1) < 0) return -1;
    slot_set(steps, ss->trained, Py_True);
    if (end_ns > last_end_ns) slot_set(steps, ss->last_end_ns, end);
    if (optimizer != NULL) {
        PyObject *closed_by = PyLong_FromVoidPtr(optimizer);
        if (closed_by == NULL) return -1;
        slot_set(steps, ss->type, self->step_train);  /* an optimizer after a no-grad call: training */
        slot_set(steps, ss->closed_ns, end);
        slot_set(steps, ss->closed_by, closed_by);
        Py_DECREF(closed_by);
    }
    return 0;
}

/* A backward pass from `start` to `end` with no step open: AutoSteps.piece_ends opens a training
 * step at its start (its model ran where no call of it is seen: compiled code, raw tensors). */
static int backward_opens_step(StepEvents *self, PyObject *buffer, PyObject *start, PyObject *end) {
    PyObject *steps = SLOT(buffer, self->buffer_slots.steps);
    if (steps == NULL) return -1;
    PyObject *done = PyObject_CallMethod(steps, "piece_ends", "OOO", end, Py_True, start);
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 0;
}

/* torch.autograd.backward ran from `start` and gave `out` (NULL: it raised): its mark and its
 * effect on the steps recorded; returns `out`, or NULL with the user's exception (recording never
 * replaces it). Consumes `buffer` and `start`. */
PyObject *backward_done(StepEvents *self, PyObject *buffer, PyObject *start, PyObject *out) {
    PyObject *end = NULL, *error = NULL;
    long long end_ns;
    int opens = 0;
    PyObject *type = NULL, *value = NULL, *traceback = NULL;
    if (out == NULL) {
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback != NULL && value != NULL) PyException_SetTraceback(value, traceback);
        error = PyObject_CallOneArg(self->error_text, value ? value : Py_None);
        if (error == NULL) PyErr_Clear();
    }
    PyObject *site = caller_site(self);
    if ((end = read_clock(self->now, &end_ns)) == NULL
        || append_mark_at(&self->buffer_slots, buffer, self->mark_backward, start, end, self->backward_name, Py_None,
                          error ? error : Py_None, site) < 0
        || (opens = piece_ended(self, buffer, end, end_ns, NULL)) < 0) {
        if (out == NULL) PyErr_Clear();
        else Py_CLEAR(out);
    }
    if (opens == 1 && backward_opens_step(self, buffer, start, end) < 0)
        PyErr_Clear();  /* the pass's step then begins at its optimizer step, as before: never the user's error */
    if (type != NULL) PyErr_Restore(type, value, traceback);
    Py_XDECREF(site);
    Py_DECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(error);
    Py_DECREF(buffer);
    return out;
}


PyObject *backward_vectorcall(PyObject *callable, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    BackwardCall *self = (BackwardCall *)callable;
    PyObject *buffer = events_buffer(self->events), *start = NULL;
    long long start_ns;
    if (buffer == NULL || (start = read_clock(self->events->now, &start_ns)) == NULL) {
        PyErr_Clear();  /* nothing can be recorded: the pass runs all the same */
        Py_XDECREF(buffer);
        return PyObject_Vectorcall(self->original, argv, nargsf, kwnames);
    }
    return backward_done(self->events, buffer, start, PyObject_Vectorcall(self->original, argv, nargsf, kwnames));
}

/* Attributes it lacks are the original's (__name__, __qualname__, __dict__...), and so are __doc__
 * and __module__ (its type's otherwise), as functools.wraps would have copied them. */
PyObject *backward_getattro(PyObject *callable, PyObject *name) {
    if (PyUnicode_Check(name) && (PyUnicode_CompareWithASCIIString(name, "__doc__") == 0
                                  || PyUnicode_CompareWithASCIIString(name, "__module__") == 0))
        return PyObject_GetAttr(((BackwardCall *)callable)->original, name);
    return own_or_delegates(callable, name, ((BackwardCall *)callable)->original);
}

PyObject *backward_repr(PyObject *callable) {
    return PyUnicode_FromFormat("<xsp's timing of %R>", ((BackwardCall *)callable)->original);
}

PyObject *backward_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *events, *original;
    static const char *kwlist[] = {"events", "original", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O", (char **)kwlist, &StepEventsType, &events, &original))
        return NULL;
    BackwardCall *self = (BackwardCall *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->events = (StepEvents *)Py_NewRef(events);
    self->original = Py_NewRef(original);
    self->vectorcall = backward_vectorcall;
    return (PyObject *)self;
}

#define EACH_BACKWARD_FIELD(DO) DO(self->events); DO(self->original)

GC_FUNCTIONS(backward_call, BackwardCall, EACH_BACKWARD_FIELD)

static PyMemberDef backward_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(BackwardCall, original), READONLY, "torch.autograd.backward as it was."},
    {NULL},
};

PyTypeObject BackwardCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp.record._hotpath.BackwardCall",
    .tp_doc = PyDoc_STR("BackwardCall(events, original): original(*args, **kwargs), timed and recorded as a "
                        "backward pass by events (a StepEvents)."),
    .tp_basicsize = sizeof(BackwardCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = backward_new,
    .tp_getattro = backward_getattro,
    .tp_repr = backward_repr,
    .tp_members = backward_members,
    .tp_dealloc = (destructor)backward_call_dealloc,
    .tp_traverse = (traverseproc)backward_call_traverse,
    .tp_clear = (inquiry)backward_call_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(BackwardCall, vectorcall),
};

/* optimizer_begins(): an optimizer step starts on this thread (the pre-hook). */
/* optimizer_begins(optimizer) -> bool: the pre-hook. True when Python must hear of it
 * (AutoSteps.optimizer_begins): a step an optimizer closed is open, and the same optimizer stepping
 * again begins the next iteration (a closure optimizer's loop). */
PyObject *events_optimizer_begins(StepEvents *self, PyObject *optimizer) {
    PyObject *buffer = events_buffer(self);
    if (buffer == NULL) return NULL;
    PyObject *starts = SLOT(buffer, self->buffer_slots.optimizer_starts), *start = NULL;
    PyObject *steps = SLOT(buffer, self->buffer_slots.steps);
    long long start_ns;
    int status = -1, tell = 0;
    if (starts == NULL || !PyList_Check(starts) || steps == NULL || !Py_IS_TYPE(steps, (PyTypeObject *)self->steps_type))
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its optimizer starts or steps");
    else if ((start = read_clock(self->now, &start_ns)) != NULL && (status = PyList_Append(starts, start)) == 0)
        status = slot_set_ll(steps, self->steps_slots.lane, 0);
    if (status == 0) {
        long long closed_ns = slot_ll(steps, self->steps_slots.closed_ns);
        if (closed_ns == -1 && PyErr_Occurred()) status = -1;
        tell = SLOT(steps, self->steps_slots.type) == self->step_train && closed_ns != 0;
    }
    (void)optimizer;
    Py_XDECREF(start);
    Py_DECREF(buffer);
    if (status < 0) return NULL;
    return PyBool_FromLong(tell);
}

/* optimizer_ends(optimizer) -> None, or (start, end) when Python must tell the steps (no step
 * was open: AutoSteps.optimizer_ends opens one). The post-hook. */
PyObject *events_optimizer_ends(StepEvents *self, PyObject *optimizer) {
    PyObject *buffer = events_buffer(self);
    if (buffer == NULL) return NULL;
    PyObject *start = NULL, *end = NULL, *name = NULL, *result = NULL, *site = NULL;
    long long end_ns;
    if ((end = read_clock(self->now, &end_ns)) == NULL) goto done;
    PyObject *starts = SLOT(buffer, self->buffer_slots.optimizer_starts);
    if (starts == NULL || !PyList_Check(starts)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its optimizer starts");
        goto done;
    }
    Py_ssize_t open = PyList_GET_SIZE(starts);
    if (open) {
        start = PyList_GET_ITEM(starts, open - 1);
        Py_INCREF(start);
        if (PyList_SetSlice(starts, open - 1, open, NULL) < 0) goto done;
    } else {
        start = end;
        Py_INCREF(start);
    }
    PyObject *kind = (PyObject *)Py_TYPE(optimizer);
    name = PyDict_GetItemWithError(self->optimizer_names, kind);
    if (name != NULL) {
        Py_INCREF(name);
    } else {
        if (PyErr_Occurred()) goto done;
        PyObject *class_name = PyObject_GetAttrString(kind, "__name__");
        if (class_name == NULL) goto done;
        name = PyUnicode_FromFormat("%U.step", class_name);
        Py_DECREF(class_name);
        if (name == NULL || PyDict_SetItem(self->optimizer_names, kind, name) < 0) goto done;
    }
    site = caller_site(self);
    if (append_mark_at(&self->buffer_slots, buffer, self->mark_optimizer, start, end, name, Py_None, Py_None, site) < 0)
        goto done;
    int asks = piece_ended(self, buffer, end, end_ns, optimizer);
    if (asks < 0) goto done;
    result = asks ? PyTuple_Pack(2, start, end) : Py_NewRef(Py_None);
done:
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(name);
    Py_XDECREF(site);
    Py_DECREF(buffer);
    return result;
}

static PyMethodDef events_methods[] = {
    {"optimizer_begins", (PyCFunction)events_optimizer_begins, METH_O,
     "optimizer_begins(optimizer) -> bool: an optimizer step starts; True when AutoSteps.optimizer_begins must hear."},
    {"optimizer_ends", (PyCFunction)events_optimizer_ends, METH_O,
     "optimizer_ends(optimizer) -> None, or (start, end) for AutoSteps.optimizer_ends when no step is open."},
    {NULL, NULL, 0, NULL},
};

static const char *events_kwlist[] = {"local", "new_buffer", "now", "error_text", "optimizer_names", "buffer_type",
                                      "steps_type", "step_constants", "mark_backward", "mark_optimizer",
                                      "backward_name", "site_of", NULL};

int events_init(StepEvents *self, PyObject *args, PyObject *kwds) {
    PyObject *local, *new_buffer, *now, *error_text, *names, *buffer_type, *steps_type, *constants, *backward,
        *optimizer, *backward_name, *site_of = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO!O!O!O!OOU|O", (char **)events_kwlist, &local, &new_buffer,
                                     &now, &error_text, &PyDict_Type, &names, &PyType_Type, &buffer_type, &PyType_Type,
                                     &steps_type, &PyTuple_Type, &constants, &backward, &optimizer, &backward_name,
                                     &site_of))
        return -1;
    if (PyTuple_GET_SIZE(constants) != CONSTANTS) {
        PyErr_SetString(PyExc_TypeError, "step_constants: as auto_steps.hotpath_constants() gives them");
        return -1;
    }
    if (find_slots(buffer_type, steps_type, &self->buffer_slots, &self->steps_slots) < 0) return -1;
    PyObject *values[] = {local, new_buffer, now, error_text, names, buffer_type, steps_type,
                          PyTuple_GET_ITEM(constants, 0), PyTuple_GET_ITEM(constants, 2), backward, optimizer,
                          backward_name, site_of};
    PyObject **fields[] = {&self->local, &self->new_buffer, &self->now, &self->error_text, &self->optimizer_names,
                           &self->buffer_type, &self->steps_type, &self->step_none, &self->step_train,
                           &self->mark_backward, &self->mark_optimizer, &self->backward_name, &self->site_of};
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        Py_INCREF(values[i]);
        Py_XSETREF(*fields[i], values[i]);
    }
    return 0;
}

#define EACH_EVENTS_FIELD(DO) \
    DO(self->local); DO(self->new_buffer); DO(self->now); DO(self->error_text); DO(self->optimizer_names); \
    DO(self->buffer_type); DO(self->steps_type); DO(self->step_none); DO(self->step_train); \
    DO(self->mark_backward); DO(self->mark_optimizer); DO(self->backward_name); DO(self->site_of); EACH_CACHED(DO)

GC_FUNCTIONS(events, StepEvents, EACH_EVENTS_FIELD)

PyTypeObject StepEventsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp.record._hotpath.StepEvents",
    .tp_doc = PyDoc_STR("StepEvents(local, new_buffer, now, error_text, optimizer_names, buffer_type, steps_type, "
                        "step_constants, mark_backward, mark_optimizer, backward_name, site_of=None): backward passes and "
                        "optimizer steps, recorded."),
    .tp_basicsize = sizeof(StepEvents),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)events_init,
    .tp_dealloc = (destructor)events_dealloc,
    .tp_traverse = (traverseproc)events_traverse,
    .tp_clear = (inquiry)events_clear,
    .tp_methods = events_methods,
};
