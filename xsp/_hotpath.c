/* The common cases of xsp's nn.Module.__call__ wrapper, in C.
 *
 * The wrapper (tracers/_module_calls.py) stays a Python function, because dynamo must be able
 * to inline it and fold its first test (is dynamo compiling?) to a constant. After that test it
 * hands the call to a `FastCall` object from here, which handles the cases that run thousands
 * of times per second and hands every other one back to the Python wrapper:
 *
 *  - ROOTS mode (model level): a top-level call of the model whose one-call step is open
 *    (`AutoSteps.lane`), and any call inside a top-level call (passed straight through);
 *  - ALL mode (layer level): a call inside a top-level call, when its step is recorded.
 *
 * It records exactly what the Python wrapper records, into the same ThreadBuffer lists.
 * Anything unusual (no buffer yet, a step to hand over, jit tracing, a paused schedule, an
 * object of another type) takes the Python path, which is the whole wrapper; tests run both.
 *
 * Why C: in Python the wrapper's bookkeeping is most of a top-level call's cost (about 2 µs on
 * a 2-core x86 machine), and getattr through the C API is no cheaper. So the slots of
 * ThreadBuffer and AutoSteps are read and written where their member descriptors would, and
 * the clock is read with clock_gettime where that is what time.perf_counter_ns reads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>
#include <time.h>
#include <stdint.h>
#include <string.h>
#include <limits.h>

#define MODE_ROOTS 1
#define MODE_ALL 2
#define NO_ERROR (-1)
#define ROOT_TRAINING 1
#define ROOT_GRAD 2
#define ROOT_MODE_UNKNOWN 4

static PyObject *s_b, *s_long_step_ns, *s_report_after_ns, *s_intern_descriptor, *s_intern_module, *s_compact,
    *s_training, *s_shape, *s_backward_hooks;
static PyObject *no_error;

typedef struct {
    Py_ssize_t depth, steps, aside, roots, calls, descriptor_ids, module_ids, skipping;
} BufferSlots;
typedef struct {
    Py_ssize_t lane, lane_grad, start_ns, last_end_ns;
} StepsSlots;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int mode;
    Py_ssize_t compact_at;
    PyObject *original;       /* nn.Module.__call__ as it was */
    PyObject *slow;           /* the Python wrapper: (module, *args, **kwargs) */
    PyObject *local;          /* recording.local: .b is the thread's buffer */
    PyObject *recording;
    PyObject *now;            /* time.perf_counter_ns */
    PyObject *grad_enabled;   /* torch.is_grad_enabled */
    PyObject *jit_tracing;    /* torch._C._get_tracing_state */
    PyObject *tensor_type;    /* torch.Tensor */
    PyObject *describe_inputs;
    PyObject *describe;
    PyObject *on_error;       /* (buffer, module, args, kwargs, start, end, exception, depth) */
    PyObject *hook_backward;  /* (buffer, out, module, start), ALL mode */
    PyObject *buffer_type;    /* ThreadBuffer */
    PyObject *steps_type;     /* AutoSteps */
    BufferSlots buffer_slots;
    StepsSlots steps_slots;
} FastCall;

/* An int's value; PyLong_AsLongLong goes through a byte array for any value past 2**30. */
static inline long long as_ll(PyObject *value) {
#if LONG_MAX == LLONG_MAX
    return PyLong_AsLong(value);
#else
    return PyLong_AsLongLong(value);
#endif
}

/* slots -------------------------------------------------------------------------------- */
#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

static void slot_set(PyObject *obj, Py_ssize_t offset, PyObject *value) {
    PyObject *old = SLOT(obj, offset);
    Py_INCREF(value);
    SLOT(obj, offset) = value;
    Py_XDECREF(old);
}

static int slot_set_ll(PyObject *obj, Py_ssize_t offset, long long value) {
    PyObject *boxed = PyLong_FromLongLong(value);
    if (boxed == NULL) return -1;
    slot_set(obj, offset, boxed);
    Py_DECREF(boxed);
    return 0;
}

/* An int slot's value; -1 with an exception set when it is unset or no int. */
static long long slot_ll(PyObject *obj, Py_ssize_t offset) {
    PyObject *value = SLOT(obj, offset);
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "slot not set");
        return -1;
    }
    return as_ll(value);
}

static int slot_offset(PyObject *type, const char *name, Py_ssize_t *offset) {
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

/* helpers ------------------------------------------------------------------------------ */
/* An int in an instance dict (the Recording's deadlines); -1 with an exception set when absent. */
static long long dict_ll(PyObject *dict, PyObject *name) {
    PyObject *value = PyDict_GetItemWithError(dict, name);  /* borrowed */
    if (value != NULL) return as_ll(value);
    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
    return -1;
}

static PyObject *call_with_module(PyObject *callable, PyObject *module, PyObject *args, PyObject *kwargs) {
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    Py_ssize_t nkw = kwargs == NULL ? 0 : PyDict_GET_SIZE(kwargs);
    if (nkw == 0 && nargs < 8) {
        PyObject *stack[9];
        stack[0] = module;
        for (Py_ssize_t i = 0; i < nargs; i++) stack[i + 1] = PyTuple_GET_ITEM(args, i);
        return PyObject_Vectorcall(callable, stack, (size_t)(nargs + 1), NULL);
    }
    PyObject *full = PyTuple_New(nargs + 1);
    if (full == NULL) return NULL;
    Py_INCREF(module);
    PyTuple_SET_ITEM(full, 0, module);
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *item = PyTuple_GET_ITEM(args, i);
        Py_INCREF(item);
        PyTuple_SET_ITEM(full, i + 1, item);
    }
    PyObject *result = PyObject_Call(callable, full, nkw ? kwargs : NULL);
    Py_DECREF(full);
    return result;
}

/* The clock, as a new reference (also written to *ns): time.perf_counter_ns's own. */
static PyObject *read_clock(FastCall *self, long long *ns) {
#ifdef __linux__
    struct timespec now;  /* CPython's perf_counter is CLOCK_MONOTONIC on Linux */
    if (clock_gettime(CLOCK_MONOTONIC, &now) == 0) {
        *ns = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
        return PyLong_FromLongLong(*ns);
    }
#endif
    PyObject *value = PyObject_CallNoArgs(self->now);
    if (value == NULL) return NULL;
    *ns = as_ll(value);
    if (*ns == -1 && PyErr_Occurred()) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
}

/* 1 when autograd records a graph, 0 when not, -1 on error. */
static int grad_enabled(FastCall *self) {
    PyObject *grad = PyObject_CallNoArgs(self->grad_enabled);
    if (grad == NULL) return -1;
    int enabled = grad == Py_True;
    Py_DECREF(grad);
    return enabled;
}

/* The descriptor's index in the buffer's interner (new reference). */
static PyObject *descriptor_id(PyObject *buffer, PyObject *ids, PyObject *descriptor) {
    PyObject *found = PyDict_GetItemWithError(ids, descriptor);
    if (found != NULL) {
        Py_INCREF(found);
        return found;
    }
    if (PyErr_Occurred()) return NULL;
    return PyObject_CallMethodOneArg(buffer, s_intern_descriptor, descriptor);
}

/* Shape descriptor of the inputs, as describe_inputs gives it (new reference). */
static PyObject *inputs_descriptor(FastCall *self, PyObject *args, PyObject *kwargs) {
    if ((kwargs == NULL || PyDict_GET_SIZE(kwargs) == 0) && PyTuple_GET_SIZE(args) == 1
        && Py_IS_TYPE(PyTuple_GET_ITEM(args, 0), (PyTypeObject *)self->tensor_type))
        return PyObject_GetAttr(PyTuple_GET_ITEM(args, 0), s_shape);
    PyObject *empty = NULL;
    if (kwargs == NULL && (empty = PyDict_New()) == NULL) return NULL;
    PyObject *result = PyObject_CallFunctionObjArgs(self->describe_inputs, args, kwargs ? kwargs : empty, NULL);
    Py_XDECREF(empty);
    return result;
}

static PyObject *output_descriptor(FastCall *self, PyObject *out) {
    if (Py_IS_TYPE(out, (PyTypeObject *)self->tensor_type)) return PyObject_GetAttr(out, s_shape);
    return PyObject_CallOneArg(self->describe, out);
}

/* Append (start, end, module index, depth, inputs index, outputs index, NO_ERROR) to
 * buffer.calls, as ThreadBuffer.record_call does; *calls_length: the list's length after. */
static int record_call(FastCall *self, PyObject *buffer, PyObject *module, long long depth, PyObject *args,
                       PyObject *kwargs, PyObject *out, PyObject *start, PyObject *end, Py_ssize_t *calls_length) {
    const BufferSlots *slots = &self->buffer_slots;
    int status = -1;
    PyObject *inputs = NULL, *outputs = NULL, *input_id = NULL, *output_id = NULL, *key = NULL;
    PyObject *module_id = NULL, *row = NULL;
    PyObject *ids = SLOT(buffer, slots->descriptor_ids), *module_ids = SLOT(buffer, slots->module_ids);
    PyObject *calls = SLOT(buffer, slots->calls);
    if (ids == NULL || module_ids == NULL || calls == NULL || !PyDict_Check(ids) || !PyDict_Check(module_ids)
        || !PyList_Check(calls)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its interners");
        return -1;
    }
    Py_INCREF(calls);
    if ((inputs = inputs_descriptor(self, args, kwargs)) == NULL) goto done;
    if ((outputs = output_descriptor(self, out)) == NULL) goto done;
    if ((input_id = descriptor_id(buffer, ids, inputs)) == NULL) goto done;
    if ((output_id = descriptor_id(buffer, ids, outputs)) == NULL) goto done;
    if ((key = PyLong_FromVoidPtr(module)) == NULL) goto done;
    module_id = PyDict_GetItemWithError(module_ids, key);
    if (module_id != NULL) {
        Py_INCREF(module_id);
    } else {
        if (PyErr_Occurred()) goto done;
        if ((module_id = PyObject_CallMethodOneArg(buffer, s_intern_module, module)) == NULL) goto done;
    }
    if ((row = PyTuple_New(7)) == NULL) goto done;
    PyObject *depth_object = PyLong_FromLongLong(depth);
    if (depth_object == NULL) goto done;
    Py_INCREF(start);
    Py_INCREF(end);
    Py_INCREF(no_error);
    PyTuple_SET_ITEM(row, 0, start);
    PyTuple_SET_ITEM(row, 1, end);
    PyTuple_SET_ITEM(row, 2, module_id);
    PyTuple_SET_ITEM(row, 3, depth_object);
    PyTuple_SET_ITEM(row, 4, input_id);
    PyTuple_SET_ITEM(row, 5, output_id);
    PyTuple_SET_ITEM(row, 6, no_error);
    module_id = input_id = output_id = NULL;  /* the row holds them now */
    if (PyList_Append(calls, row) < 0) goto done;
    *calls_length = PyList_GET_SIZE(calls);
    status = 0;
done:
    Py_XDECREF(inputs);
    Py_XDECREF(outputs);
    Py_XDECREF(input_id);
    Py_XDECREF(output_id);
    Py_XDECREF(key);
    Py_XDECREF(module_id);
    Py_XDECREF(row);
    Py_DECREF(calls);
    return status;
}

/* After the module raised: the clock read and the depth put back, the user's exception kept. */
static PyObject *clock_after_failure(FastCall *self, PyObject *buffer, long long depth, long long *end_ns) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *end = read_clock(self, end_ns);
    if (end == NULL) PyErr_Clear();
    if (slot_set_ll(buffer, self->buffer_slots.depth, depth) < 0) PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return end;
}

/* The call raised: the Python side records it (with its error text); the exception stays. */
static void failed(FastCall *self, PyObject *buffer, PyObject *module, PyObject *args, PyObject *kwargs,
                   PyObject *start, PyObject *end, long long depth) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL) PyException_SetTraceback(value, traceback);
    PyObject *empty = kwargs == NULL ? PyDict_New() : NULL;
    PyObject *depth_object = PyLong_FromLongLong(depth);
    if ((kwargs != NULL || empty != NULL) && depth_object != NULL) {
        PyObject *noted = PyObject_CallFunctionObjArgs(self->on_error, buffer, module, args, kwargs ? kwargs : empty,
                                                       start, end ? end : Py_None, value ? value : Py_None,
                                                       depth_object, NULL);
        Py_XDECREF(noted);
    }
    Py_XDECREF(empty);
    Py_XDECREF(depth_object);
    PyErr_Clear();  /* recording the error must never replace the user's exception */
    PyErr_Restore(type, value, traceback);
}

static int compact_if_full(PyObject *buffer, Py_ssize_t length, Py_ssize_t compact_at) {
    if (length < compact_at) return 0;
    PyObject *compacted = PyObject_CallMethodNoArgs(buffer, s_compact);
    if (compacted == NULL) return -1;
    Py_DECREF(compacted);
    return 0;
}

/* Run the module one level deeper than `depth` and record the call that started at `start`:
 * the depth put back, a failure handed to Python. Returns the output (new reference), with
 * *end and *calls_length set; NULL on failure. */
static PyObject *run_and_record(FastCall *self, PyObject *buffer, PyObject *module, PyObject *args,
                                PyObject *kwargs, long long depth, PyObject *start, PyObject **end,
                                long long *end_ns, Py_ssize_t *calls_length) {
    Py_ssize_t depth_slot = self->buffer_slots.depth;
    if (slot_set_ll(buffer, depth_slot, depth + 1) < 0) return NULL;
    PyObject *out = call_with_module(self->original, module, args, kwargs);
    if (out == NULL) {
        *end = clock_after_failure(self, buffer, depth, end_ns);
        failed(self, buffer, module, args, kwargs, start, *end, depth);
        return NULL;
    }
    if ((*end = read_clock(self, end_ns)) == NULL || slot_set_ll(buffer, depth_slot, depth) < 0
        || record_call(self, buffer, module, depth, args, kwargs, out, start, *end, calls_length) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* paths -------------------------------------------------------------------------------- */

/* A top-level call in the lane (ROOTS mode). *declined: the call is not the lane's (then
 * nothing was done, and the caller takes the Python path). */
static PyObject *lane_call(FastCall *self, PyObject *buffer, PyObject *module, PyObject *args, PyObject *kwargs,
                           int *declined) {
    const BufferSlots *slots = &self->buffer_slots;
    const StepsSlots *step_slots = &self->steps_slots;
    PyObject *steps = SLOT(buffer, slots->steps);
    *declined = 1;
    if (steps == NULL || !Py_IS_TYPE(steps, (PyTypeObject *)self->steps_type)) return NULL;
    PyObject *lane = SLOT(steps, step_slots->lane), *lane_grad = SLOT(steps, step_slots->lane_grad);
    PyObject *aside = SLOT(buffer, slots->aside), *roots = SLOT(buffer, slots->roots);
    if (lane == NULL || lane_grad == NULL || aside == NULL || roots == NULL || !PyList_Check(roots)) return NULL;
    if (PyLong_AsVoidPtr(lane) != (void *)module) {
        PyErr_Clear();
        return NULL;
    }
    int grad = grad_enabled(self);
    if (grad < 0) return NULL;
    if ((grad ? Py_True : Py_False) != lane_grad || PyObject_IsTrue(aside) != 0) return NULL;
    PyObject *tracing = PyObject_CallNoArgs(self->jit_tracing);
    if (tracing == NULL) return NULL;
    int traced = tracing != Py_None && PyObject_IsTrue(tracing) != 0;
    Py_DECREF(tracing);
    if (traced) return NULL;
    long long before = slot_ll(steps, step_slots->last_end_ns);
    long long step_start = slot_ll(steps, step_slots->start_ns);
    PyObject *deadlines = PyObject_GenericGetDict(self->recording, NULL);
    if (deadlines == NULL) return NULL;
    long long long_step = dict_ll(deadlines, s_long_step_ns);
    long long report_after = dict_ll(deadlines, s_report_after_ns);
    Py_DECREF(deadlines);
    if (PyErr_Occurred()) return NULL;
    if (!(before - step_start < long_step && before < report_after)) return NULL;  /* the step before is worth telling */
    PyObject *dict = PyObject_GenericGetDict(module, NULL);
    if (dict == NULL) return NULL;
    long flags = grad ? ROOT_GRAD : 0;
    PyObject *mode = PyDict_GetItemWithError(dict, s_training);  /* borrowed */
    int training = mode == NULL ? -2 : PyObject_IsTrue(mode);
    Py_DECREF(dict);
    if (PyErr_Occurred()) return NULL;
    flags |= training == -2 ? ROOT_MODE_UNKNOWN : training ? ROOT_TRAINING : 0;
    /* from here the call is the lane's */
    *declined = 0;
    PyObject *start = NULL, *end = NULL, *out = NULL, *row = NULL, *result = NULL;
    long long start_ns, end_ns;
    Py_INCREF(roots);
    Py_INCREF(steps);
    if ((start = read_clock(self, &start_ns)) == NULL) goto done;
    slot_set(steps, step_slots->start_ns, start);
    if ((row = Py_BuildValue("(Ol)", start, flags)) == NULL || PyList_Append(roots, row) < 0) goto done;
    Py_ssize_t length = 0;
    if ((out = run_and_record(self, buffer, module, args, kwargs, 0, start, &end, &end_ns, &length)) == NULL)
        goto done;
    if (compact_if_full(buffer, length, self->compact_at) < 0) goto done;
    if (end_ns > before) slot_set(steps, step_slots->last_end_ns, end);
    result = out;
    out = NULL;
done:
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(out);
    Py_XDECREF(row);
    Py_DECREF(roots);
    Py_DECREF(steps);
    return result;
}

/* A call inside a top-level call, ALL mode: recorded at its depth. */
static PyObject *nested_call(FastCall *self, PyObject *buffer, PyObject *module, PyObject *args, PyObject *kwargs,
                             long long depth) {
    PyObject *start = NULL, *end = NULL, *out = NULL, *result = NULL;
    long long start_ns, end_ns;
    Py_ssize_t length = 0;
    if ((start = read_clock(self, &start_ns)) == NULL) goto done;
    if ((out = run_and_record(self, buffer, module, args, kwargs, depth, start, &end, &end_ns, &length)) == NULL)
        goto done;
    int grad = grad_enabled(self);
    if (grad < 0) goto done;
    if (grad) {
        PyObject *hooks = PyObject_GetAttr(self->recording, s_backward_hooks);
        if (hooks == NULL) goto done;
        int hooked = PyObject_IsTrue(hooks);
        Py_DECREF(hooks);
        if (hooked < 0) goto done;
        if (hooked) {
            PyObject *done_hooking = PyObject_CallFunctionObjArgs(self->hook_backward, buffer, out, module, start, NULL);
            if (done_hooking == NULL) goto done;
            Py_DECREF(done_hooking);
        }
    }
    if (depth < 2 && compact_if_full(buffer, length, self->compact_at) < 0) goto done;
    result = out;
    out = NULL;
done:
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(out);
    return result;
}

/* fast(module, args, kwargs) */
static PyObject *fastcall_vectorcall(PyObject *callable, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    FastCall *self = (FastCall *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 3 || kwnames != NULL || !PyTuple_Check(argv[1]) || (argv[2] != Py_None && !PyDict_Check(argv[2]))) {
        PyErr_SetString(PyExc_TypeError, "FastCall(module, args: tuple, kwargs: dict | None)");
        return NULL;
    }
    PyObject *module = argv[0], *args = argv[1], *kwargs = argv[2] == Py_None ? NULL : argv[2];
    PyObject *buffer = PyObject_GetAttr(self->local, s_b);
    if (buffer == NULL || !Py_IS_TYPE(buffer, (PyTypeObject *)self->buffer_type)) {
        /* this thread's first record (the Python path creates its buffer), or no ThreadBuffer */
        PyErr_Clear();
        Py_XDECREF(buffer);
        return call_with_module(self->slow, module, args, kwargs);
    }
    PyObject *result = NULL;
    long long depth = slot_ll(buffer, self->buffer_slots.depth);
    if (depth == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        result = call_with_module(self->slow, module, args, kwargs);
        goto done;
    }
    if (self->mode == MODE_ROOTS) {
        if (depth) {  /* inside a top-level call: the model level needs no exact depth */
            result = call_with_module(self->original, module, args, kwargs);
            goto done;
        }
        int declined = 0;
        result = lane_call(self, buffer, module, args, kwargs, &declined);
        if (result == NULL && declined) {
            PyErr_Clear();
            result = call_with_module(self->slow, module, args, kwargs);
        }
        goto done;
    }
    PyObject *skipping = SLOT(buffer, self->buffer_slots.skipping);
    if (depth > 0 && skipping == Py_False) {
        result = nested_call(self, buffer, module, args, kwargs, depth);
        goto done;
    }
    result = call_with_module(self->slow, module, args, kwargs);
done:
    Py_DECREF(buffer);
    return result;
}

/* pack_columns(rows, itemsizes) -> tuple of bytes: column i of the rows (tuples of ints), each
 * value in itemsizes[i] bytes (1, 2, 4 or 8), native order, for array.frombytes. What
 * extend_columns does with struct.pack and strided copies, at a tenth of the cost. */
static PyObject *pack_columns(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(argv[0]) || !PyTuple_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "pack_columns(rows: list[tuple[int, ...]], itemsizes: tuple[int, ...])");
        return NULL;
    }
    PyObject *rows = argv[0];
    Py_ssize_t count = PyList_GET_SIZE(rows), width = PyTuple_GET_SIZE(argv[1]);
    if (width == 0 || width > 16) {
        PyErr_SetString(PyExc_ValueError, "1 to 16 columns");
        return NULL;
    }
    int sizes[16];
    char *out[16];
    PyObject *columns = PyTuple_New(width);
    if (columns == NULL) return NULL;
    for (Py_ssize_t c = 0; c < width; c++) {
        long size = PyLong_AsLong(PyTuple_GET_ITEM(argv[1], c));
        if (size != 1 && size != 2 && size != 4 && size != 8) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "item sizes are 1, 2, 4 or 8");
            Py_DECREF(columns);
            return NULL;
        }
        sizes[c] = (int)size;
        PyObject *bytes = PyBytes_FromStringAndSize(NULL, count * size);
        if (bytes == NULL) {
            Py_DECREF(columns);
            return NULL;
        }
        PyTuple_SET_ITEM(columns, c, bytes);
        out[c] = PyBytes_AS_STRING(bytes);
    }
    for (Py_ssize_t r = 0; r < count; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != width) {
            PyErr_Format(PyExc_ValueError, "row %zd is not a tuple of %zd values", r, width);
            Py_DECREF(columns);
            return NULL;
        }
        for (Py_ssize_t c = 0; c < width; c++) {
            long long value = as_ll(PyTuple_GET_ITEM(row, c));
            if (value == -1 && PyErr_Occurred()) {
                Py_DECREF(columns);
                return NULL;
            }
            switch (sizes[c]) {
            case 8: { int64_t v = (int64_t)value; memcpy(out[c] + r * 8, &v, 8); break; }
            case 4: { int32_t v = (int32_t)value; if (v != value) goto overflow; memcpy(out[c] + r * 4, &v, 4); break; }
            case 2: { int16_t v = (int16_t)value; if (v != value) goto overflow; memcpy(out[c] + r * 2, &v, 2); break; }
            default: { int8_t v = (int8_t)value; if (v != value) goto overflow; out[c][r] = (char)v; break; }
            }
        }
    }
    return columns;
overflow:
    PyErr_SetString(PyExc_OverflowError, "a value does not fit its column");
    Py_DECREF(columns);
    return NULL;
}

static PyMethodDef hotpath_functions[] = {
    {"pack_columns", (PyCFunction)(void (*)(void))pack_columns, METH_FASTCALL,
     "pack_columns(rows, itemsizes) -> tuple of bytes, one per column."},
    {NULL, NULL, 0, NULL},
};

/* the type ----------------------------------------------------------------------------- */
static const char *kwlist[] = {"mode", "original", "slow", "local", "recording", "now", "grad_enabled",
                               "jit_tracing", "tensor_type", "describe_inputs", "describe", "on_error",
                               "hook_backward", "buffer_type", "steps_type", "compact_at", NULL};

static int fastcall_init(FastCall *self, PyObject *args, PyObject *kwds) {
    PyObject *items[14] = {NULL};
    Py_ssize_t compact_at = 512;
    int mode = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOOOOOOOOOOOO|n", (char **)kwlist, &mode, &items[0], &items[1],
                                     &items[2], &items[3], &items[4], &items[5], &items[6], &items[7], &items[8],
                                     &items[9], &items[10], &items[11], &items[12], &items[13], &compact_at))
        return -1;
    if (mode != MODE_ROOTS && mode != MODE_ALL) {
        PyErr_SetString(PyExc_ValueError, "mode must be 1 (roots) or 2 (all)");
        return -1;
    }
    if (!PyType_Check(items[7]) || !PyType_Check(items[12]) || !PyType_Check(items[13])) {
        PyErr_SetString(PyExc_TypeError, "tensor_type, buffer_type and steps_type must be types");
        return -1;
    }
    BufferSlots *b = &self->buffer_slots;
    StepsSlots *s = &self->steps_slots;
    PyObject *buffer_type = items[12], *steps_type = items[13];
    if (slot_offset(buffer_type, "depth", &b->depth) < 0 || slot_offset(buffer_type, "steps", &b->steps) < 0
        || slot_offset(buffer_type, "aside", &b->aside) < 0 || slot_offset(buffer_type, "roots", &b->roots) < 0
        || slot_offset(buffer_type, "calls", &b->calls) < 0
        || slot_offset(buffer_type, "descriptor_ids", &b->descriptor_ids) < 0
        || slot_offset(buffer_type, "module_ids", &b->module_ids) < 0
        || slot_offset(buffer_type, "skipping", &b->skipping) < 0 || slot_offset(steps_type, "lane", &s->lane) < 0
        || slot_offset(steps_type, "lane_grad", &s->lane_grad) < 0
        || slot_offset(steps_type, "start_ns", &s->start_ns) < 0
        || slot_offset(steps_type, "last_end_ns", &s->last_end_ns) < 0)
        return -1;
    PyObject **fields[14] = {&self->original, &self->slow, &self->local, &self->recording, &self->now,
                             &self->grad_enabled, &self->jit_tracing, &self->tensor_type, &self->describe_inputs,
                             &self->describe, &self->on_error, &self->hook_backward, &self->buffer_type,
                             &self->steps_type};
    for (int i = 0; i < 14; i++) {
        Py_INCREF(items[i]);
        Py_XSETREF(*fields[i], items[i]);
    }
    self->mode = mode;
    self->compact_at = compact_at;
    self->vectorcall = fastcall_vectorcall;
    return 0;
}

#define EACH_FIELD(DO) \
    DO(self->original); DO(self->slow); DO(self->local); DO(self->recording); DO(self->now); \
    DO(self->grad_enabled); DO(self->jit_tracing); DO(self->tensor_type); DO(self->describe_inputs); \
    DO(self->describe); DO(self->on_error); DO(self->hook_backward); DO(self->buffer_type); DO(self->steps_type)

static int fastcall_traverse(FastCall *self, visitproc visit, void *arg) {
    EACH_FIELD(Py_VISIT);
    return 0;
}

static int fastcall_clear(FastCall *self) {
    EACH_FIELD(Py_CLEAR);
    return 0;
}

static void fastcall_dealloc(FastCall *self) {
    PyObject_GC_UnTrack(self);
    fastcall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *fastcall_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    FastCall *self = (FastCall *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) self->vectorcall = fastcall_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject FastCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp._hotpath.FastCall",
    .tp_doc = PyDoc_STR("FastCall(mode, original, slow, local, recording, now, grad_enabled, jit_tracing, "
                        "tensor_type, describe_inputs, describe, on_error, hook_backward, buffer_type, "
                        "steps_type, compact_at=512), called as fast(module, args, kwargs)."),
    .tp_basicsize = sizeof(FastCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = fastcall_new,
    .tp_init = (initproc)fastcall_init,
    .tp_dealloc = (destructor)fastcall_dealloc,
    .tp_traverse = (traverseproc)fastcall_traverse,
    .tp_clear = (inquiry)fastcall_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FastCall, vectorcall),
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_hotpath",
    .m_doc = "The common cases of xsp's module-call wrapper, in C.", .m_size = -1,
    .m_methods = hotpath_functions,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__hotpath(void) {
    INTERN(s_b, "b");
    INTERN(s_long_step_ns, "long_step_ns");
    INTERN(s_report_after_ns, "report_after_ns");
    INTERN(s_intern_descriptor, "intern_descriptor");
    INTERN(s_intern_module, "intern_module");
    INTERN(s_compact, "compact");
    INTERN(s_training, "training");
    INTERN(s_shape, "shape");
    INTERN(s_backward_hooks, "backward_hooks");
    if ((no_error = PyLong_FromLong(NO_ERROR)) == NULL) return NULL;
    if (PyType_Ready(&FastCallType) < 0) return NULL;
    PyObject *module = PyModule_Create(&hotpath_module);
    if (module == NULL) return NULL;
    Py_INCREF(&FastCallType);
    if (PyModule_AddObject(module, "FastCall", (PyObject *)&FastCallType) < 0) {
        Py_DECREF(&FastCallType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
