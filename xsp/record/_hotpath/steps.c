/* The step rule's common cases, as xsp/record/steps.py (AutoSteps) states them. (see hotpath.h) */
#include "hotpath.h"

int slot_is_zero(PyObject *obj, Py_ssize_t offset) {
    PyObject *value = SLOT(obj, offset);
    return value != NULL && PyLong_CheckExact(value) && as_ll(value) == 0;
}

/* AutoSteps.call_begins, in C: what a top-level call does to its thread's steps. It is planned
 * first (reads only), so that a case C leaves to Python (inside xsp.step() or generate(), the
 * model's first call, a decided step someone must be told of) leaves everything as it was;
 * then carried out. */
enum { FINISH_NONE = 0, FINISH_AT_LAST_END, FINISH_TRAINING };


/* Whether a step decided as running from start_ns to end_ns is told to nobody (AutoSteps._decided
 * tells recording.on_long_step of a long one, or of one that ends past report_after_ns): 1 when
 * not, 0 when someone is (Python tells), -1 on error. `dict`: the recording's. */
int nobody_to_tell(PyObject *dict, long long start_ns, long long end_ns) {
    PyObject *on_long_step = PyDict_GetItemWithError(dict, s_on_long_step);
    if (on_long_step == NULL) return PyErr_Occurred() ? -1 : 0;
    if (on_long_step == Py_None) return 1;
    long long long_step = dict_ll(dict, s_long_step_ns), report_after = dict_ll(dict, s_report_after_ns);
    if (PyErr_Occurred()) return -1;
    return end_ns - start_ns < long_step && end_ns < report_after;
}

/* The lane (AutoSteps.lane): the open step is this module's one call with autograd as now, so
 * this call only decides that step, told to nobody, and opens the next the same way, which leaves
 * every slot but start_ns as it is (what the Python wrapper does inline). 1 when the call takes
 * it, 0 when not, -1 on error. */
int takes_lane(FastCall *self, PyObject *steps, PyObject *module, int grad, PyObject *recording_dict,
               CallPlan *plan) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *lane = SLOT(steps, ss->lane), *lane_grad = SLOT(steps, ss->lane_grad);
    if (lane == NULL || lane_grad == NULL || !PyLong_CheckExact(lane) || (lane_grad == Py_True) != (grad == 1))
        return 0;
    void *lane_module = PyLong_AsVoidPtr(lane);
    if (lane_module == NULL) return PyErr_Occurred() ? -1 : 0;
    if (lane_module != (void *)module) return 0;
    long long start_ns = slot_ll(steps, ss->start_ns), last_end_ns = slot_ll(steps, ss->last_end_ns);
    if (PyErr_Occurred()) return -1;
    plan->step_start_ns = start_ns;  /* the step this call decides (an always-on session's sampler hears it) */
    plan->step_end_ns = last_end_ns;
    return nobody_to_tell(recording_dict, start_ns, last_end_ns);
}

/* 1: C carries the call's step out as planned; 0: Python decides it; -1: error. */
int plan_call(FastCall *self, PyObject *buffer, PyObject *module, CallPlan *plan) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *steps = plan->steps, *dict = plan->recording_dict;
    PyObject *type = SLOT(steps, ss->type), *lane = SLOT(steps, ss->lane), *leader = SLOT(steps, ss->leader);
    PyObject *trained = SLOT(steps, ss->trained), *optimizer_seen = SLOT(steps, ss->optimizer_seen);
    PyObject *name = SLOT(steps, ss->name), *python_decides = SLOT(steps, ss->python_decides);
    PyObject *optimizer_starts = SLOT(buffer, self->buffer_slots.optimizer_starts);
    if (type == NULL || lane == NULL || leader == NULL || trained == NULL || optimizer_seen == NULL || name == NULL)
        return 0;
    if (!slot_is_zero(buffer, self->buffer_slots.open_steps) || !slot_is_zero(steps, ss->nested)) return 0;
    /* tentative ends or models joined (AutoSteps.python_decides), or a closure optimizer's call: Python */
    if (python_decides != Py_False || optimizer_starts == NULL || !PyList_Check(optimizer_starts)
        || PyList_GET_SIZE(optimizer_starts) != 0)
        return 0;
    if (type != self->step_none && type != self->step_inference && type != self->step_train) return 0;
    if (!PyUnicode_Check(name) || PyUnicode_GET_LENGTH(name) != 0) return 0;
    PyObject *paused = PyDict_GetItemWithError(dict, s_paused);
    if (paused != Py_False) return PyErr_Occurred() ? -1 : 0;
    void *lane_module = PyLong_AsVoidPtr(lane);
    void *leader_module = leader == Py_None ? NULL : PyLong_AsVoidPtr(leader);
    if (PyErr_Occurred()) return -1;
    int is_leader = leader_module == (void *)module, grad = plan->grad, other = 0;
    if (!is_leader && lane_module != (void *)module) {
        PyObject *names = PyDict_GetItemWithError(dict, s_model_names);
        if (names == NULL || !PyDict_Check(names)) return PyErr_Occurred() ? -1 : 0;
        PyObject *key = PyLong_FromVoidPtr(module);
        if (key == NULL) return -1;
        int named = PyDict_Contains(names, key);
        Py_DECREF(key);
        if (named <= 0) return named;  /* its first call names the model: Python */
    }
    long long start_ns = slot_ll(steps, ss->start_ns), last_end_ns = slot_ll(steps, ss->last_end_ns);
    long long closed_ns = slot_ll(steps, ss->closed_ns), pieces = slot_ll(steps, ss->pieces);
    if (PyErr_Occurred()) return -1;
    plan->finish = FINISH_NONE;
    if (type == self->step_train) {
        int leads = is_leader || leader == Py_None;
        /* another model's call in an always-on session: under another request's span it begins
         * a step of its own (AutoSteps.call_begins asks the sampler): Python */
        if (!is_leader && plan->sampler != Py_None) return 0;
        /* another model's call without autograd after the optimizer step: it may begin the next
         * iteration (a frozen teacher before the model trained: AutoSteps.frozen): Python */
        if (closed_ns && !grad && !leads) return 0;
        if (closed_ns && (!grad || leads)) {
            plan->finish = FINISH_TRAINING;  /* the next iteration, or an evaluation */
        } else if (grad && leads && optimizer_seen != Py_True) {
            if (trained == Py_True) return 0;  /* a tentative end (AutoSteps._tentative_end): Python */
            plan->finish = FINISH_AT_LAST_END;
        } else if (leads && optimizer_seen != Py_True) {
            plan->finish = FINISH_AT_LAST_END;  /* an evaluation call of a loop with no optimizer */
        }
    } else if (type == self->step_inference && grad && !is_leader && optimizer_seen != Py_True) {
        return 0;  /* perhaps the first iteration's trained model after its frozen one (AutoSteps._frozen_iteration) */
    } else if (type == self->step_inference && (grad || is_leader)) {
        plan->finish = FINISH_AT_LAST_END;
    } else if (type == self->step_inference && plan->sampler != Py_None
               && (!is_sampler_core(plan->sampler)
                   || (other = sampler_other_request(plan->sampler, buffer, &self->buffer_slots)) != 0)) {
        if (other < 0) return -1;
        if (!other) return 0;  /* a sampler C cannot ask: Python decides */
        plan->finish = FINISH_AT_LAST_END;  /* under another request's span: a step of its own (AutoSteps._other_request) */
    } else if (type == self->step_inference) {
        /* another model joins the step (AutoSteps._joins): its first call since the leader's is
         * noted here; a second one in a row (the leader no longer called) is Python's to count */
        PyObject *joiner = SLOT(steps, ss->joiner), *joined = SLOT(steps, ss->joined);
        if (joiner == NULL || joined == NULL || !PyLong_CheckExact(joiner) || !PyList_CheckExact(joined)) return 0;
        void *joining = PyLong_AsVoidPtr(joiner);
        if (joining == NULL && PyErr_Occurred()) return -1;
        if (joining == (void *)module) return 0;
        plan->joins = 1;
    }
    plan->opens = plan->finish != FINISH_NONE || type == self->step_none;
    if (plan->finish != FINISH_NONE) {
        plan->step_start_ns = start_ns;
        plan->step_end_ns = plan->finish == FINISH_TRAINING ? closed_ns : last_end_ns;
        plan->finished_type = trained == Py_True ? self->step_train : self->step_inference;
        plan->marked = plan->finished_type == self->step_train || pieces > 1;
        int untold = nobody_to_tell(dict, plan->step_start_ns, plan->step_end_ns);
        if (untold <= 0) return untold;  /* someone is told of the decided step: Python tells */
    }
    if (plan->opens) {
        long long wait_ns = slot_ll(steps, ss->wait_ns);
        if (PyErr_Occurred()) return -1;
        plan->lane = !wait_ns && (!grad || optimizer_seen != Py_True);  /* the new step's pieces == 1 */
    }
    return 1;
}

/* AutoSteps._open: a step of the call's kind starts at `start` (or at the input wait before it,
 * or, training, where the last training step ended). */
int open_step(FastCall *self, PyObject *steps, PyObject *module, CallPlan *plan, PyObject *start,
                     PyObject *resumed) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *waited = SLOT(steps, ss->wait_ns);
    long long wait_ns = as_ll(waited), resume_ns = plan->grad ? as_ll(resumed) : 0;
    if (PyErr_Occurred()) return -1;
    PyObject *opened = start;
    if (wait_ns && resume_ns) opened = wait_ns < resume_ns ? waited : resumed;
    else if (wait_ns) opened = waited;
    else if (resume_ns) opened = resumed;
    PyObject *leader = PyLong_FromVoidPtr(module);
    if (leader == NULL) return -1;
    slot_set(steps, ss->type, plan->grad ? self->step_train : self->step_inference);
    slot_set(steps, ss->start_ns, opened);
    slot_set(steps, ss->leader, leader);
    int failed = slot_set_ll(steps, ss->pieces, wait_ns ? 2 : 1) < 0;
    if (!failed && plan->lane) {
        slot_set(steps, ss->lane, leader);
        slot_set(steps, ss->lane_grad, plan->grad ? Py_True : Py_False);
    }
    Py_DECREF(leader);
    if (failed || slot_set_ll(steps, ss->wait_ns, 0) < 0 || slot_set_ll(steps, ss->resume_ns, 0) < 0) return -1;
    return 0;
}

/* AutoSteps._joins, a model's first call since the leader's: joiner = the model, joined = [(start,
 * the step's last end)]. */
int note_join(const StepsSlots *ss, PyObject *steps, PyObject *module, PyObject *start) {
    PyObject *joiner = PyLong_FromVoidPtr(module);
    if (joiner == NULL) return -1;
    PyObject *call = PyTuple_Pack(2, start, SLOT(steps, ss->last_end_ns));
    PyObject *joined = call == NULL ? NULL : PyList_New(1);
    if (joined == NULL) {
        Py_DECREF(joiner);
        Py_XDECREF(call);
        return -1;
    }
    PyList_SET_ITEM(joined, 0, call);
    slot_set(steps, ss->joiner, joiner);
    slot_set(steps, ss->joined, joined);
    Py_DECREF(joiner);
    Py_DECREF(joined);
    return 0;
}

/* AutoSteps._reset's joiner = 0 and joined = [] (in place: nothing else holds the list). */
int forget_joins(const StepsSlots *ss, PyObject *steps, PyObject *zero) {
    PyObject *joined = SLOT(steps, ss->joined);
    slot_set(steps, ss->joiner, zero);
    if (joined != NULL && PyList_CheckExact(joined) && PyList_GET_SIZE(joined))
        return PyList_SetSlice(joined, 0, PyList_GET_SIZE(joined), NULL);
    return 0;
}

/* AutoSteps._reset of the slots C reads (the step decided: no step open), with joiner = 0 and
 * joined = [] (forget_joins); `none`: the type of no step. The lane is the caller's. */
int reset_step(const StepsSlots *ss, PyObject *steps, PyObject *none, PyObject *zero) {
    slot_set(steps, ss->lane_grad, Py_False);
    slot_set(steps, ss->type, none);
    slot_set(steps, ss->start_ns, zero);
    slot_set(steps, ss->last_end_ns, zero);
    slot_set(steps, ss->closed_ns, zero);
    slot_set(steps, ss->leader, Py_None);
    slot_set(steps, ss->pieces, zero);
    slot_set(steps, ss->trained, Py_False);
    slot_set(steps, ss->closed_by, zero);
    return forget_joins(ss, steps, zero);
}

/* Carry the plan out (call_begins's writes); the call starts at `start`. */
int begin_step(FastCall *self, PyObject *buffer, PyObject *module, CallPlan *plan, PyObject *start) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *steps = plan->steps, *zero = NULL, *resumed = NULL;
    int status = -1;
    if ((zero = PyLong_FromLong(0)) == NULL) return -1;
    slot_set(steps, ss->lane, zero);
    if (plan->finish == FINISH_NONE && !plan->opens) {  /* the call joins the open step */
        long long pieces = slot_ll(steps, ss->pieces);
        status = pieces == -1 && PyErr_Occurred() ? -1 : slot_set_ll(steps, ss->pieces, pieces + 1);
        if (status == 0 && plan->joins) status = note_join(ss, steps, module, start);
        Py_DECREF(zero);
        return status;
    }
    resumed = SLOT(steps, ss->resume_ns);
    Py_INCREF(resumed);
    if (plan->finish != FINISH_NONE) {  /* AutoSteps._finish: the decided step's record, the state reset */
        int training = plan->finished_type == self->step_train;
        if (plan->marked) {
            PyObject *step_start = SLOT(steps, ss->start_ns);
            PyObject *step_end = plan->finish == FINISH_TRAINING ? SLOT(steps, ss->closed_ns)
                                                                 : SLOT(steps, ss->last_end_ns);
            if (plan->step_end_ns < plan->step_start_ns) step_end = step_start;
            if (append_mark(&self->buffer_slots, buffer, self->mark_step, step_start, step_end,
                            training ? self->train_step_name : self->inference_step_name,
                            training ? self->train_attributes : self->inference_attributes, Py_None) < 0)
                goto done;
        }
        Py_SETREF(resumed, plan->finish == FINISH_TRAINING ? Py_NewRef(SLOT(steps, ss->closed_ns)) : Py_NewRef(zero));
        if (reset_step(ss, steps, self->step_none, zero) < 0) goto done;
    }
    status = open_step(self, steps, module, plan, start, resumed);
done:
    Py_XDECREF(resumed);
    Py_DECREF(zero);
    return status;
}

/* AutoSteps.call_ends */
int end_step_piece(FastCall *self, PyObject *buffer, PyObject *steps, PyObject *end, long long end_ns) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *type = SLOT(steps, ss->type);
    if (type == NULL || type == self->step_none || !slot_is_zero(steps, ss->nested)
        || !slot_is_zero(buffer, self->buffer_slots.open_steps))
        return 0;
    long long last_end_ns = slot_ll(steps, ss->last_end_ns);
    if (last_end_ns == -1 && PyErr_Occurred()) return -1;
    if (end_ns > last_end_ns) slot_set(steps, ss->last_end_ns, end);
    return 0;
}

/* decide_quiet_step(buffer, now_ns, quiet_ns, none, inference): the thread's open step decided
 * from another thread, as its next call would decide it, where that step is one inference call
 * of one model (the lane), no call is under way on the thread, and the call ended quiet_ns or
 * more before now_ns: (start_ns, end_ns) of the step decided, else None. No Python runs between
 * its reads and writes, nor between top_call's plan and begin_step: a call that begins after it
 * opens a new step. (A call that C hands to Python, AutoSteps.call_begins, could be interrupted
 * by it between two of its reads, once its thread has been quiet for quiet_ns: its step then
 * begins as a new one all the same, with stale join notes that its step's end clears.) `none`
 * and `inference`: the step types of hotpath_constants(). */
PyObject *decide_quiet_step(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "decide_quiet_step(buffer, now_ns, quiet_ns, none, inference)");
        return NULL;
    }
    PyObject *buffer = argv[0], *none = argv[3], *inference = argv[4];
    long long now_ns = PyLong_AsLongLong(argv[1]), quiet_ns = PyLong_AsLongLong(argv[2]);
    if (PyErr_Occurred()) return NULL;
    BufferSlots bs;
    StepsSlots ss;
    PyObject *steps = PyObject_GetAttrString(buffer, "steps");
    if (steps == NULL) return NULL;
    PyObject *result = NULL;
    if (find_slots((PyObject *)Py_TYPE(buffer), (PyObject *)Py_TYPE(steps), &bs, &ss) < 0) goto done;
    PyObject *type = SLOT(steps, ss.type), *lane = SLOT(steps, ss.lane), *leader = SLOT(steps, ss.leader);
    PyObject *lane_grad = SLOT(steps, ss.lane_grad), *python_decides = SLOT(steps, ss.python_decides);
    PyObject *name = SLOT(steps, ss.name);
    if (type != inference || lane == NULL || leader == NULL || !PyLong_CheckExact(lane) || !PyLong_CheckExact(leader)
        || lane_grad != Py_False || python_decides != Py_False || name == NULL || !PyUnicode_Check(name)
        || PyUnicode_GET_LENGTH(name) != 0 || !slot_is_zero(buffer, bs.depth) || !slot_is_zero(buffer, bs.open_steps)
        || !slot_is_zero(steps, ss.nested) || !slot_is_zero(steps, ss.wait_ns) || !slot_is_zero(steps, ss.joiner)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    int same = PyObject_RichCompareBool(lane, leader, Py_EQ);  /* ints: no Python runs */
    long long pieces = slot_ll(steps, ss.pieces), start_ns = slot_ll(steps, ss.start_ns);
    long long end_ns = slot_ll(steps, ss.last_end_ns);
    if (same < 0 || PyErr_Occurred()) goto done;
    /* the call's end not written yet (its thread is between its depth and its step's end): its next look */
    if (!same || as_ll(lane) == 0 || pieces != 1 || end_ns <= start_ns || now_ns - end_ns < quiet_ns) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) goto done;
    slot_set(steps, ss.lane, zero);  /* AutoSteps.finish of a one-call inference step: no mark, then _reset */
    slot_set(steps, ss.resume_ns, zero);
    int forgot = reset_step(&ss, steps, none, zero);
    Py_DECREF(zero);
    if (forgot < 0) goto done;
    result = Py_BuildValue("(LL)", start_ns, end_ns);
done:
    Py_DECREF(steps);
    return result;
}
