/* The FastCall object: recording a module call, top-level and nested, its vectorcall. (see hotpath.h) */
#include "hotpath.h"

/* Record a finished call: (start, end, module index, depth, inputs index, outputs index,
 * NO_ERROR, call site id), as ThreadBuffer.record_call does. While buffer.calls is empty (after moving the
 * Python path's rows out of it where they fit) the row goes into buffer.packed_calls as eight
 * int64s (no tuple, no int objects to make and free, nothing to pack later); else it is appended
 * to buffer.calls as a tuple, behind the Python path's rows, so that compaction (packed rows
 * first, then the list) keeps the order. *calls_length: the rows waiting for compaction after. */
int record_call(FastCall *self, PyObject *buffer, const Call *call, long long depth, PyObject *out,
                       PyObject *start, PyObject *end, long long start_ns, long long end_ns,
                       Py_ssize_t *calls_length) {
    PyObject *module = CALL_MODULE(call);
    const BufferSlots *slots = &self->buffer_slots;
    int status = -1;
    PyObject *inputs = NULL, *outputs = NULL, *input_id = NULL, *output_id = NULL, *key = NULL;
    PyObject *module_id = NULL, *row = NULL, *site_object = NULL;
    PyObject *ids = SLOT(buffer, slots->descriptor_ids), *module_ids = SLOT(buffer, slots->module_ids);
    if (ids == NULL || module_ids == NULL || !PyDict_Check(ids) || !PyDict_Check(module_ids)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its interners");
        return -1;
    }
    if ((inputs = inputs_descriptor(self, call)) == NULL) goto done;
    if ((outputs = output_descriptor(self, out)) == NULL) goto done;
    if (depth == 0) {
        hot_entry_for(buffer, slots, module);
        if ((input_id = hot_descriptor_id(buffer, ids, inputs, slots->hot_inputs, slots->hot_inputs_id)) == NULL)
            goto done;
        if ((output_id = hot_descriptor_id(buffer, ids, outputs, slots->hot_outputs, slots->hot_outputs_id)) == NULL)
            goto done;
    } else {
        if ((input_id = descriptor_id(buffer, ids, inputs)) == NULL) goto done;
        if ((output_id = descriptor_id(buffer, ids, outputs)) == NULL) goto done;
    }
    PyObject *hot_module = SLOT(buffer, slots->hot_module), *hot_module_id = SLOT(buffer, slots->hot_module_id);
    if (depth == 0 && hot_module == module && hot_module_id != NULL && PyLong_CheckExact(hot_module_id)) {
        /* the interner holds every module it indexed, so an address seen there is that module */
        module_id = Py_NewRef(hot_module_id);
    } else {
        if ((key = PyLong_FromVoidPtr(module)) == NULL) goto done;
        module_id = PyDict_GetItemWithError(module_ids, key);
        if (module_id != NULL) {
            Py_INCREF(module_id);
        } else {
            if (PyErr_Occurred()) goto done;
            if ((module_id = PyObject_CallMethodOneArg(buffer, s_intern_module, module)) == NULL) goto done;
        }
        if (depth == 0) {
            slot_set(buffer, slots->hot_module, module);
            slot_set(buffer, slots->hot_module_id, module_id);
        }
    }
    /* the caller's frame is still where it made the call (a miss of the site caches runs Python) */
    long long site = call_site(self, buffer, depth);
    /* read now: interning runs Python, during which another thread may have compacted the buffer */
    PyObject *calls = SLOT(buffer, slots->calls), *packed = SLOT(buffer, slots->packed_calls);
    if (calls == NULL || packed == NULL || !PyList_Check(calls) || !PyByteArray_CheckExact(packed)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its record lists");
        goto done;
    }
    int64_t values[CALL_FIELDS] = {start_ns, end_ns, as_ll(module_id), depth, as_ll(input_id), as_ll(output_id), NO_ERROR,
                                   site};
    if (PyErr_Occurred() || (*calls_length = pack_behind_list(calls, packed, values, CALL_FIELDS, self->compact_at)) < 0)
        goto done;
    if (*calls_length > 0) {
        status = 0;
        goto done;
    }  /* the row goes into the list, behind the packed ones */
    int64_t packed_count = packed_count_of(packed);
    if ((row = PyTuple_New(CALL_FIELDS)) == NULL) goto done;
    if ((site_object = PyLong_FromLongLong(site)) == NULL) goto done;
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
    PyTuple_SET_ITEM(row, 7, site_object);
    module_id = input_id = output_id = site_object = NULL;  /* the row holds them now */
    if (PyList_Append(calls, row) < 0) goto done;
    *calls_length = PyList_GET_SIZE(calls) + (Py_ssize_t)packed_count;
    if (packed_count > 0 && !packed_fits(packed, packed_count, PACKED_ROW_BYTES, 1))
        /* full below its full size (a view held it, so it could not grow): compaction at the
         * caller's next chance puts a full-size one in its place, so that few rows become tuples */
        *calls_length = PY_SSIZE_T_MAX;
    status = 0;
done:
    Py_XDECREF(inputs);
    Py_XDECREF(outputs);
    Py_XDECREF(input_id);
    Py_XDECREF(output_id);
    Py_XDECREF(key);
    Py_XDECREF(module_id);
    Py_XDECREF(site_object);
    Py_XDECREF(row);
    return status;
}

/* After the module raised: the clock read and the depth put back, the user's exception kept. */
PyObject *clock_after_failure(FastCall *self, PyObject *buffer, long long depth, long long *end_ns) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *end = read_clock(self->now, end_ns);
    if (end == NULL) PyErr_Clear();
    if (slot_set_ll(buffer, self->buffer_slots.depth, depth) < 0) PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return end;
}

/* The call raised: the Python side records it (with its error text); the exception stays. */
void failed(FastCall *self, PyObject *buffer, const Call *call, PyObject *start, PyObject *end,
                   long long depth) {
    PyObject *type, *value, *traceback, *args = NULL, *kwargs = NULL;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL) PyException_SetTraceback(value, traceback);
    PyObject *depth_object = PyLong_FromLongLong(depth);
    if (depth_object != NULL && unpacked(call, &args, &kwargs) == 0) {
        PyObject *noted = PyObject_CallFunctionObjArgs(self->on_error, buffer, CALL_MODULE(call), args, kwargs,
                                                       start, end ? end : Py_None, value ? value : Py_None,
                                                       depth_object, NULL);
        Py_XDECREF(noted);
    }
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(depth_object);
    PyErr_Clear();  /* recording the error must never replace the user's exception */
    PyErr_Restore(type, value, traceback);
}

int compact_if_full(PyObject *buffer, Py_ssize_t length, Py_ssize_t compact_at) {
    if (length < compact_at) return 0;
    PyObject *compacted = PyObject_CallMethodNoArgs(buffer, s_compact);
    if (compacted == NULL) return -1;
    Py_DECREF(compacted);
    return 0;
}

/* Run the module one level deeper than `depth` and record the call that started at `start`:
 * the depth put back, a failure handed to Python. Returns the output (new reference), with
 * *end and *calls_length set; NULL on failure. */
PyObject *run_and_record(FastCall *self, PyObject *buffer, const Call *call, long long depth,
                                PyObject *start, long long start_ns, PyObject **end, long long *end_ns,
                                Py_ssize_t *calls_length) {
    Py_ssize_t depth_slot = self->buffer_slots.depth;
    if (slot_set_ll(buffer, depth_slot, depth + 1) < 0) return NULL;
    const xsp_correlation *correlation = self->correlation;
    open_site_scope(self, buffer, depth);
    int64_t nvtx_message = self->nvtx == NULL ? -1 : nvtx_push(self, CALL_MODULE(call), depth);
    if (correlation != NULL) correlation->push((uint64_t)start_ns);  /* the call's start names it to CUPTI */
    PyObject *out = call_original(self, call);
    if (correlation != NULL) correlation->pop();
    if (nvtx_message >= 0) self->nvtx->pop();
    if (out == NULL) {
        *end = clock_after_failure(self, buffer, depth, end_ns);
        failed(self, buffer, call, start, *end, depth);
        return NULL;
    }
    if ((*end = read_clock(self->now, end_ns)) == NULL || slot_set_ll(buffer, depth_slot, depth) < 0
        || record_call(self, buffer, call, depth, out, start, *end, start_ns, *end_ns, calls_length) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* Push the module call's NVTX range: its message from nvtx_messages, or from nvtx_message_of the
 * first time (a top-level call names its model's layers there). Returns the message, or -1 when
 * none was pushed (the failure is dropped: a range is never worth the user's call). */
int64_t nvtx_push(FastCall *self, PyObject *module, long long depth) {
    PyObject *found = PyDict_GetItemWithError(self->nvtx_messages, module);  /* borrowed */
    long long message = -1;
    if (found != NULL) {
        message = PyLong_AsLongLong(found);
    } else if (!PyErr_Occurred()) {
        PyObject *made = PyObject_CallFunctionObjArgs(self->nvtx_message_of, module, depth == 0 ? Py_True : Py_False,
                                                      NULL);
        if (made != NULL) message = PyLong_AsLongLong(made);
        Py_XDECREF(made);
    }
    if (message < 0 || PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    self->nvtx->push(message);
    return message;
}

/* paths -------------------------------------------------------------------------------- */

/* After the module ran with autograd on, at the layer level: hook the graph nodes of its output
 * for its backward span (a Python function, as the Python wrapper does), given its first
 * positional argument (where the module's own part of the graph ends). */
int hook_backward_if_grad(FastCall *self, PyObject *buffer, const Call *call, PyObject *out,
                                 PyObject *start) {
    int grad = grad_enabled(self);
    if (grad <= 0) return grad;
    PyObject *hooks = PyObject_GetAttr(self->recording, s_backward_hooks);
    if (hooks == NULL) return -1;
    int hooked = PyObject_IsTrue(hooks);
    Py_DECREF(hooks);
    if (hooked <= 0) return hooked;
    PyObject *first = call->nargs > 0 ? call->argv[1] : Py_None;
    PyObject *done_hooking = PyObject_CallFunctionObjArgs(self->hook_backward, buffer, out, CALL_MODULE(call), start,
                                                          first, NULL);
    if (done_hooking == NULL) return -1;
    Py_DECREF(done_hooking);
    return 0;
}

/* Record a top-level call's (start, flags), as the Python path's buffer.roots.append does: into
 * buffer.packed_roots as two int64s while buffer.roots is empty, after moving the Python path's
 * rows there where they fit (compaction takes the packed rows first), else as a tuple onto
 * buffer.roots. */
int record_root(const BufferSlots *slots, PyObject *buffer, PyObject *start, long long start_ns, long flags,
                       Py_ssize_t full_rows) {
    /* read now: a step's listeners (Python) ran since the call began, and another thread may have
     * compacted the buffer meanwhile */
    PyObject *roots = SLOT(buffer, slots->roots), *packed = SLOT(buffer, slots->packed_roots);
    if (roots == NULL || !PyList_Check(roots)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its roots");
        return -1;
    }
    if (packed != NULL && PyByteArray_CheckExact(packed)) {
        int64_t values[ROOT_FIELDS] = {start_ns, flags};
        Py_ssize_t packed_rows = pack_behind_list(roots, packed, values, ROOT_FIELDS, full_rows);
        if (packed_rows != 0) return packed_rows < 0 ? -1 : 0;
    }
    PyObject *flags_object = PyLong_FromLong(flags);
    if (flags_object == NULL) return -1;
    PyObject *row = PyTuple_Pack(2, start, flags_object);
    Py_DECREF(flags_object);
    if (row == NULL) return -1;
    int appended = PyList_Append(roots, row);
    Py_DECREF(row);
    return appended;
}

/* A top-level call whose step C can decide (plan_call). *declined: it cannot (then nothing
 * was done, and the caller takes the Python path). */
PyObject *top_call(FastCall *self, PyObject *buffer, const Call *call, uint64_t thread, int *declined) {
    const BufferSlots *slots = &self->buffer_slots;
    PyObject *module = CALL_MODULE(call);
    PyObject *steps = SLOT(buffer, slots->steps);
    *declined = 1;
    if (steps == NULL || !Py_IS_TYPE(steps, (PyTypeObject *)self->steps_type)) return NULL;
    PyObject *aside = SLOT(buffer, slots->aside), *roots = SLOT(buffer, slots->roots);
    if (aside == NULL || roots == NULL || !PyList_Check(roots) || !slot_is_zero(buffer, slots->aside)) return NULL;
    CallPlan plan = {.steps = steps};
    if ((plan.grad = grad_enabled(self)) < 0) return NULL;
    if (self->jit_tracing != Py_None) {  /* None: every jit tracer entry sets buffer.aside */
        PyObject *tracing = PyObject_CallNoArgs(self->jit_tracing);
        if (tracing == NULL) return NULL;
        int traced = tracing != Py_None && PyObject_IsTrue(tracing) != 0;
        Py_DECREF(tracing);
        if (traced) return NULL;
    }
    if (self->native_graph_task_id != NULL) {  /* a backward runs on this thread: as below, without the binding */
        if (self->native_graph_task_id() != -1) return NULL;
    } else if (self->graph_task_id != NULL) {  /* a backward runs on this thread: a checkpoint's recomputation, Python's */
        PyObject *task = PyObject_CallNoArgs(self->graph_task_id);
        if (task == NULL) return NULL;
        long long id = PyLong_Check(task) ? as_ll(task) : -1;
        Py_DECREF(task);
        if (id != -1) return NULL;
    }
    if ((plan.recording_dict = PyObject_GenericGetDict(self->recording, NULL)) == NULL) return NULL;
    PyObject *sampler = PyDict_GetItemWithError(plan.recording_dict, s_sampler);
    if (sampler == NULL) {  /* no sampler slot (or an error): Python decides */
        Py_DECREF(plan.recording_dict);
        return NULL;
    }
    Py_INCREF(sampler);  /* an always-on session's: told of each step that begins (step_begins) */
    operator_pause_function pause_operators = NULL;  /* the operator level's switch, while one is set */
    if (sampler != Py_None) {
        PyObject *gate = PyDict_GetItemWithError(plan.recording_dict, s_operator_gate);
        if (gate != NULL && PyLong_CheckExact(gate)) pause_operators = (operator_pause_function)PyLong_AsVoidPtr(gate);
        PyErr_Clear();
    }
    plan.sampler = sampler;
    int laned = takes_lane(self, steps, module, plan.grad, plan.recording_dict, &plan);
    if (!laned) plan.step_start_ns = plan.step_end_ns = 0;
    int planned = laned ? laned : plan_call(self, buffer, module, &plan);
    Py_DECREF(plan.recording_dict);
    if (planned <= 0) {
        Py_DECREF(sampler);
        return NULL;
    }
    PyObject *dict = PyObject_GenericGetDict(module, NULL);
    if (dict == NULL) {
        Py_DECREF(sampler);
        return NULL;
    }
    long flags = plan.grad ? ROOT_GRAD : 0;
    PyObject *mode = PyDict_GetItemWithError(dict, s_training);  /* borrowed */
    int training = mode == NULL ? -2 : PyObject_IsTrue(mode);
    Py_DECREF(dict);
    if (PyErr_Occurred()) {
        Py_DECREF(sampler);
        return NULL;
    }
    flags |= training == -2 ? ROOT_MODE_UNKNOWN : training ? ROOT_TRAINING : 0;
    /* from here the call is C's */
    *declined = 0;
    PyObject *start = NULL, *end = NULL, *out = NULL, *result = NULL;
    long long start_ns, end_ns;
    Py_INCREF(steps);
    if ((start = read_clock(self->now, &start_ns)) == NULL) goto done;
    if (laned) slot_set(steps, self->steps_slots.start_ns, start);
    else if (begin_step(self, buffer, module, &plan, start) < 0) goto done;
    if (sampler != Py_None && (laned || plan.opens)) {  /* a step begins: how deep it is recorded */
        long long before_ns = laned || plan.finish != 0 ? plan.step_end_ns - plan.step_start_ns : 0;
        if (before_ns < 0) before_ns = 0;
        if (is_sampler_core(sampler)) {
            if (sampler_step_begins(sampler, buffer, start, before_ns, slots, steps, &self->steps_slots) < 0)
                PyErr_Clear();
        } else {
            PyObject *before = PyLong_FromLongLong(before_ns);
            PyObject *told = before == NULL ? NULL : PyObject_CallMethodObjArgs(sampler, s_step_begins, buffer, start,
                                                                                 before, NULL);
            Py_XDECREF(before);
            if (told == NULL) PyErr_Clear();  /* the sampler's trouble never fails the user's call */
            Py_XDECREF(told);
        }
    }
    slot_set(buffer, slots->skipping, Py_False);
    if (record_root(slots, buffer, start, start_ns, flags, self->compact_at) < 0) goto done;
    Py_ssize_t length = 0;
    /* the calls inside pass straight through: the model level's, and a step an always-on session
     * records at the model level only, as the depth test in fastcall_vectorcall would */
    int running = self->mode == MODE_ROOTS || step_limit_of(buffer, slots) == MODEL_ONLY_LIMIT
                      ? enter_running(self, thread) : -1;
    /* a step recorded without operators: its call runs with the thread's operator records paused */
    int paused = pause_operators != NULL && SLOT(buffer, slots->step_operators) == Py_False && pause_operators(1) == 1;
    out = run_and_record(self, buffer, call, 0, start, start_ns, &end, &end_ns, &length);
    if (paused) pause_operators(0);  /* after a failure too */
    if (running >= 0) self->running_threads[running] = 0;  /* after a failure too */
    if (out == NULL) goto done;
    if (self->mode == MODE_ALL && hook_backward_if_grad(self, buffer, call, out, start) < 0) goto done;
    if (compact_if_full(buffer, length, self->compact_at) < 0) goto done;
    if (end_step_piece(self, buffer, steps, end, end_ns) < 0) goto done;
    result = out;
    out = NULL;
done:
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(out);
    Py_DECREF(steps);
    Py_DECREF(sampler);
    return result;
}

/* A call inside a top-level call, ALL mode: recorded at its depth. */
PyObject *nested_call(FastCall *self, PyObject *buffer, const Call *call, long long depth) {
    PyObject *start = NULL, *end = NULL, *out = NULL, *result = NULL;
    long long start_ns, end_ns;
    Py_ssize_t length = 0;
    if ((start = read_clock(self->now, &start_ns)) == NULL) goto done;
    if ((out = run_and_record(self, buffer, call, depth, start, start_ns, &end, &end_ns, &length)) == NULL)
        goto done;
    if (hook_backward_if_grad(self, buffer, call, out, start) < 0) goto done;
    if (depth < 2 && compact_if_full(buffer, length, self->compact_at) < 0) goto done;
    result = out;
    out = NULL;
done:
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(out);
    return result;
}

/* nn.Module.__call__(module, *args, **kwargs) */
PyObject *fastcall_vectorcall(PyObject *callable, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    FastCall *self = (FastCall *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "nn.Module.__call__ needs the module as its first argument");
        return NULL;
    }
    const Call call = {.argv = argv, .nargsf = nargsf, .nargs = nargs - 1, .kwnames = kwnames};
    uint64_t thread = current_thread();
    if (passes_through(self, thread)) return call_original(self, &call);  /* inside a call passing them through */
    PyObject *buffer = thread_buffer(self->local, &self->cache, thread);
    if (buffer == NULL && !PyErr_Occurred())  /* this thread's first record */
        buffer = PyObject_CallMethodNoArgs(self->recording, s_new_buffer);
    if (buffer == NULL || !Py_IS_TYPE(buffer, (PyTypeObject *)self->buffer_type)) {
        PyErr_Clear();  /* no ThreadBuffer: the Python path says what is wrong */
        Py_XDECREF(buffer);
        return call_with_module(self->slow, &call);
    }
    PyObject *result = NULL;
    long long depth = slot_ll(buffer, self->buffer_slots.depth);
    if (depth == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        result = call_with_module(self->slow, &call);
        goto done;
    }
    if (self->mode == MODE_ROOTS) {
        if (depth) {  /* inside a top-level call: the model level needs no exact depth */
            result = call_original(self, &call);
            goto done;
        }
    } else if (depth) {
        if (self->max_depth > 0 && depth > self->max_depth) {  /* below the depth traced: passed through,
                                                                  its own calls see the same depth */
            result = call_original(self, &call);
            goto done;
        }
        long long deepest = step_limit_of(buffer, &self->buffer_slots);
        if (deepest != 0 && (deepest < 0 || depth > deepest)) {
            /* a step an always-on session records to a depth only (-1: the model level only) */
            result = call_original(self, &call);
            goto done;
        }
        PyObject *skipping = SLOT(buffer, self->buffer_slots.skipping);
        result = skipping == Py_False ? nested_call(self, buffer, &call, depth) : call_with_module(self->slow, &call);
        goto done;
    }
    int declined = 0;
    result = top_call(self, buffer, &call, thread, &declined);
    if (result == NULL && declined) {
        PyErr_Clear();
        result = call_with_module(self->slow, &call);
    }
done:
    Py_DECREF(buffer);
    return result;
}

/* 1 when torch.compiler says nothing is being compiled (dynamo or export, on any thread), 0 when
 * it says something is or cannot say (no `compiler`, no flag, an error). */
int surely_eager(FastCall *self) {
    if (self->compiler == NULL || self->compiler == Py_None) return 0;
    PyObject *flag = PyObject_GetAttr(self->compiler, s_is_compiling_flag);
    if (flag == NULL) {
        PyErr_Clear();
        return 0;
    }
    int eager = flag == Py_False;
    Py_DECREF(flag);
    return eager;
}

/* Read as an attribute, the object gives its `exposed` Python function (bound to the instance
 * it is read from), which is what tools that look at nn.Module.__call__ can work with. Read on an
 * instance while nothing is compiled (`super().__call__(x)`, as torch.compile's OptimizedModule
 * calls its module, or `model.__call__`), it gives itself, bound: a call of that runs no Python
 * frame of xsp's, and no on_read. */
PyObject *fastcall_descr_get(PyObject *callable, PyObject *instance, PyObject *owner) {
    FastCall *self = (FastCall *)callable;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    int eager = surely_eager(self);
    if (!eager && self->on_read != NULL && self->on_read != Py_None) {
        PyObject *done = PyObject_CallNoArgs(self->on_read);
        Py_XDECREF(done);
    }
    PyErr_Clear();  /* reading an attribute must not fail because of xsp */
    PyErr_Restore(type, value, traceback);
    PyObject *function = self->exposed != NULL && self->exposed != Py_None ? self->exposed : callable;
    if (instance == NULL || instance == Py_None) return Py_NewRef(function);
    return PyMethod_New(eager ? callable : function, instance);
}

/* `obj`'s attribute `name`, or, when it has none, `delegate`'s (none when `delegate` is NULL):
 * what a C object standing in for a Python function answers for the function's attributes. */
PyObject *own_or_delegates(PyObject *obj, PyObject *name, PyObject *delegate) {
    PyObject *value = PyObject_GenericGetAttr(obj, name);
    if (value != NULL || delegate == NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return value;
    PyErr_Clear();
    return PyObject_GetAttr(delegate, name);
}

/* Attributes it lacks are `exposed`'s (__code__, __closure__, __wrapped__, __name__...): dynamo
 * reads the class dict's entry for nn.Module.__call__ and guards on its closure, as it would on
 * the function it inlined. */
PyObject *fastcall_getattro(PyObject *callable, PyObject *name) {
    return own_or_delegates(callable, name, ((FastCall *)callable)->exposed);
}

static PyMemberDef fastcall_members[] = {
    {"exposed", T_OBJECT, offsetof(FastCall, exposed), 0,
     "What reading the attribute gives (a Python function doing the same); None: the object itself."},
    {"on_read", T_OBJECT, offsetof(FastCall, on_read), 0, "Called with no arguments before each read."},
    {"compiler", T_OBJECT, offsetof(FastCall, compiler), 0,
     "torch.compiler, when its _is_compiling_flag is False exactly while nothing is compiled: reading the "
     "attribute on an instance then gives the object itself, bound, and on_read is not called."},
    {"original", T_OBJECT, offsetof(FastCall, original), READONLY, "nn.Module.__call__ as it was."},
    {"nvtx_messages", T_OBJECT, offsetof(FastCall, nvtx_messages), READONLY,
     "{module: NVTX message index} of the module calls' ranges (use_nvtx), or None."},
    {"call_machinery", T_OBJECT, offsetof(FastCall, call_machinery), 0,
     "(nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__): the frames between a module's "
     "call and its forward, which call sites of the calls that forward makes may look up; None: walk each."},
    {NULL},
};

/* FastCall.use_nvtx(capsule, messages, message_of): push and pop an NVTX range around each module
 * call it records (None: none). */
static PyObject *fastcall_use_nvtx(FastCall *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "use_nvtx(capsule, messages, message_of)");
        return NULL;
    }
    if (argv[0] == Py_None) {
        self->nvtx = NULL;
        Py_CLEAR(self->nvtx_capsule);
        Py_CLEAR(self->nvtx_messages);
        Py_CLEAR(self->nvtx_message_of);
        Py_RETURN_NONE;
    }
    const xsp_nvtx *ranges = PyCapsule_GetPointer(argv[0], XSP_NVTX_CAPSULE);
    if (ranges == NULL) return NULL;
    if (!PyDict_CheckExact(argv[1]) || !PyCallable_Check(argv[2])) {
        PyErr_SetString(PyExc_TypeError, "use_nvtx: messages must be a dict, message_of callable");
        return NULL;
    }
    Py_XSETREF(self->nvtx_capsule, Py_NewRef(argv[0]));
    Py_XSETREF(self->nvtx_messages, Py_NewRef(argv[1]));
    Py_XSETREF(self->nvtx_message_of, Py_NewRef(argv[2]));
    self->nvtx = ranges;
    Py_RETURN_NONE;
}

static PyMethodDef fastcall_methods[] = {
    {"use_nvtx", (PyCFunction)(void (*)(void))fastcall_use_nvtx, METH_FASTCALL,
     "use_nvtx(capsule, messages, message_of): push and pop an NVTX range (xsp.record._nvtx.ranges) around "
     "each module call recorded here, its message from the dict messages {module: index}, or from "
     "message_of(module, is_root) the first time; use_nvtx(None, None, None): no ranges."},
    {NULL},
};

/* torch.Tensor.shape's descriptor and getter, for tensor_shape; none (NULL) where it is no
 * getset descriptor of the class (then tensor_shape looks the attribute up). */
void find_shape_descriptor(FastCall *self) {
    PyTypeObject *type = (PyTypeObject *)self->tensor_type;
    Py_CLEAR(self->shape_descriptor);
    self->shape_get = NULL;
    PyObject *descriptor = PyObject_GetAttr((PyObject *)type, s_shape);  /* the descriptor itself, on a class */
    if (descriptor == NULL) {
        PyErr_Clear();
        return;
    }
    if (!Py_IS_TYPE(descriptor, &PyGetSetDescr_Type) || Py_TYPE(descriptor)->tp_descr_get == NULL
        || !PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) {
        Py_DECREF(descriptor);
        return;
    }
    self->shape_descriptor = descriptor;
    self->shape_get = Py_TYPE(descriptor)->tp_descr_get;
    self->shape_version = type->tp_version_tag;
}

#define FIELDS 14  /* the keywords below, before the constants */
static const char *kwlist[] = {"mode", "original", "slow", "local", "recording", "now", "grad_enabled",
                               "jit_tracing", "tensor_type", "describe_inputs", "describe", "on_error",
                               "hook_backward", "buffer_type", "steps_type", "step_constants", "compact_at",
                               "native_grad_mode", "correlation", "graph_task_id", "max_depth", "sites",
                               "native_graph_task_id", NULL};

int fastcall_init(FastCall *self, PyObject *args, PyObject *kwds) {
    PyObject *items[FIELDS] = {NULL}, *constants = NULL;
    Py_ssize_t compact_at = 512;
    int mode = 0;
    PyObject *native_grad_mode = NULL, *correlation = NULL, *graph_task_id = NULL, *sites = NULL;
    PyObject *native_graph_task_id = NULL;
    long long max_depth = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOOOOOOOOOOOOO!|nO!OOLOO!", (char **)kwlist, &mode, &items[0],
                                     &items[1], &items[2], &items[3], &items[4], &items[5], &items[6], &items[7],
                                     &items[8], &items[9], &items[10], &items[11], &items[12], &items[13],
                                     &PyTuple_Type, &constants, &compact_at, &PyLong_Type, &native_grad_mode,
                                     &correlation, &graph_task_id, &max_depth, &sites, &PyLong_Type,
                                     &native_graph_task_id))
        return -1;
    const xsp_correlation *hooks = NULL;
    if (correlation != NULL && correlation != Py_None) {
        hooks = PyCapsule_GetPointer(correlation, XSP_CORRELATION_CAPSULE);
        if (hooks == NULL) return -1;  /* not xsp.record._activity's capsule: TypeError or ValueError set */
    }
    void *grad_mode_address = native_grad_mode == NULL ? NULL : PyLong_AsVoidPtr(native_grad_mode);
    if (grad_mode_address == NULL && PyErr_Occurred()) return -1;
    void *graph_task_address = native_graph_task_id == NULL ? NULL : PyLong_AsVoidPtr(native_graph_task_id);
    if (graph_task_address == NULL && PyErr_Occurred()) return -1;
    if (mode != MODE_ROOTS && mode != MODE_ALL) {
        PyErr_SetString(PyExc_ValueError, "mode must be 1 (roots) or 2 (all)");
        return -1;
    }
    if (!PyType_Check(items[7]) || !PyType_Check(items[12]) || !PyType_Check(items[13])) {
        PyErr_SetString(PyExc_TypeError, "tensor_type, buffer_type and steps_type must be types");
        return -1;
    }
    if (PyTuple_GET_SIZE(constants) != CONSTANTS) {
        PyErr_SetString(PyExc_TypeError, "step_constants: as auto_steps.hotpath_constants() gives them");
        return -1;
    }
    if (find_slots(items[12], items[13], &self->buffer_slots, &self->steps_slots) < 0) return -1;
    PyObject **fields[FIELDS] = {&self->original, &self->slow, &self->local, &self->recording, &self->now,
                                 &self->grad_enabled, &self->jit_tracing, &self->tensor_type, &self->describe_inputs,
                                 &self->describe, &self->on_error, &self->hook_backward, &self->buffer_type,
                                 &self->steps_type};
    for (int i = 0; i < FIELDS; i++) {
        Py_INCREF(items[i]);
        Py_XSETREF(*fields[i], items[i]);
    }
    PyObject **constant_fields[CONSTANTS] = {&self->step_none, &self->step_inference, &self->step_train,
                                             &self->mark_step, &self->train_step_name, &self->train_attributes,
                                             &self->inference_step_name, &self->inference_attributes};
    for (int i = 0; i < CONSTANTS; i++) {
        PyObject *item = PyTuple_GET_ITEM(constants, i);
        Py_INCREF(item);
        Py_XSETREF(*constant_fields[i], item);
    }
    self->mode = mode;
    self->max_depth = max_depth;
    self->compact_at = compact_at;
    Py_XSETREF(self->correlation_capsule, hooks == NULL ? NULL : Py_NewRef(correlation));
    self->correlation = hooks;
    Py_XSETREF(self->graph_task_id, graph_task_id == NULL || graph_task_id == Py_None ? NULL : Py_NewRef(graph_task_id));
    Py_XSETREF(self->sites, sites == NULL || sites == Py_None ? NULL : Py_NewRef(sites));
    EACH_SITE_CACHED(Py_CLEAR);  /* entries of another table's ids */
    self->native_grad_mode = (grad_mode_function)grad_mode_address;
    self->native_graph_task_id = (graph_task_function)graph_task_address;
    self->original_call = PyVectorcall_Function(self->original);
    find_shape_descriptor(self);
    self->vectorcall = fastcall_vectorcall;
    return 0;
}

#define EACH_FIELD(DO) \
    DO(self->original); DO(self->slow); DO(self->local); DO(self->recording); DO(self->now); \
    DO(self->grad_enabled); DO(self->jit_tracing); DO(self->tensor_type); DO(self->shape_descriptor); \
    DO(self->describe_inputs); DO(self->describe); DO(self->on_error); DO(self->hook_backward); \
    DO(self->buffer_type); DO(self->steps_type); DO(self->correlation_capsule); DO(self->graph_task_id); \
    DO(self->step_none); DO(self->step_inference); DO(self->step_train); DO(self->mark_step); \
    DO(self->train_step_name); DO(self->train_attributes); DO(self->inference_step_name); \
    DO(self->inference_attributes); EACH_CACHED(DO); DO(self->exposed); DO(self->on_read); DO(self->compiler); \
    DO(self->sites); DO(self->call_machinery); EACH_SITE_CACHED(DO); DO(self->nvtx_capsule); \
    DO(self->nvtx_messages); DO(self->nvtx_message_of)

GC_FUNCTIONS(fastcall, FastCall, EACH_FIELD)

PyObject *fastcall_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    FastCall *self = (FastCall *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) self->vectorcall = fastcall_vectorcall;
    return (PyObject *)self;
}

PyTypeObject FastCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp.record._hotpath.FastCall",
    .tp_doc = PyDoc_STR("FastCall(mode, original, slow, local, recording, now, grad_enabled, jit_tracing, "
                        "tensor_type, describe_inputs, describe, on_error, hook_backward, buffer_type, "
                        "steps_type, step_constants, compact_at=512, native_grad_mode=0): nn.Module.__call__, "
                        "called as fast(module, *args, **kwargs). native_grad_mode: the address of "
                        "c10::GradMode::is_enabled, called instead of grad_enabled (0: not). native_graph_task_id: the "
                        "address of torch::autograd::get_current_graph_task_id, called instead of graph_task_id "
                        "(0: not). max_depth: in ALL mode, "
                        "calls deeper than this pass through unrecorded (0: every depth). sites: the recording's "
                        "xsp.record.sites.CallSites, whose ids each record's call site is (None: no call sites)."),
    .tp_basicsize = sizeof(FastCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = fastcall_new,
    .tp_descr_get = fastcall_descr_get,
    .tp_getattro = fastcall_getattro,
    .tp_members = fastcall_members,
    .tp_methods = fastcall_methods,
    .tp_init = (initproc)fastcall_init,
    .tp_dealloc = (destructor)fastcall_dealloc,
    .tp_traverse = (traverseproc)fastcall_traverse,
    .tp_clear = (inquiry)fastcall_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FastCall, vectorcall),
};
