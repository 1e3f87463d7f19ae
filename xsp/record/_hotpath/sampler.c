/* SamplerCore: an always-on session's decision, as each step begins, of how deep it is recorded,
 * and its running median of step durations (xsp.record.sampling.PySamplerCore is its Python twin;
 * tests hold the two equal).
 *
 * Why C: the decision runs once per request of a service, right after the request's model ran,
 * with the processor's caches full of the model's weights. In Python (the OpenTelemetry span read,
 * the draw, the note) it cost 9-13 µs a request there, against 2.5 µs warm, which was about half of
 * what an unsampled request paid for xsp. Here it touches a few objects and runs no frame of Python:
 * the span's context is read from its `_context` where its class's get_span_context is known to
 * give just that (reads_plainly), else by calling it. The rare cases (a step after a slow one or
 * of a capture, a drawn step's depth plan, a slow step's note) call back into the owning
 * StepSampler. */
#include "hotpath.h"

#define REASONS 5        /* len(xsp.record.sampling.REASONS) */
#define REASON_SAMPLED 1
#define REASON_MODEL_ONLY 0
#define REASON_NOT_SAMPLED 4
#define NOTE_DECISION 0  /* NoteKind.DECISION */
#define MEDIAN_CAPACITY 1024
#define SPAN_TYPES 4  /* the span classes a process meets: the SDK's, NonRecordingSpan */

typedef struct {
    PyObject_HEAD
    double rate;
    double slow_factor;
    uint64_t draws;  /* splitmix64's state */
    long long begun, ended, threshold_ns, probe_errors;
    long long last_begun_ns;  /* when the last step decided began (0: none yet) */
    long long counts[REASONS];
    int armed;
    int median_steps, warmup_steps, median_every;
    int recent_next, recent_size;
    long long *recent, *sorted;
    PyObject *context_var, *span_key;  /* OpenTelemetry's current context and its span's key (NULL: no fast read) */
    PyObject *span_judge;  /* (span class) -> whether its get_span_context gives just self._context, or NULL */
    int span_types_seen;
    PyObject *span_types[SPAN_TYPES];  /* span classes met so far, each with */
    unsigned int span_tags[SPAN_TYPES];  /* its version tag when judged (0: none) */
    char span_plain[SPAN_TYPES];  /* whether its get_span_context is a plain reader then */
    PyObject *ambient;   /* () -> (trace id, span id, sampled) | None, or None */
    PyObject *on_armed;  /* (buffer, time_ns, trace_id, span_id) -> step limit */
    PyObject *on_plan;   /* () -> (plan index, step limit) of a drawn step */
    PyObject *on_slow;   /* (duration_ns, buffer) -> None */
} SamplerCore;

static PyObject *s_decided_ns, *s_step_limit, *s_step_operators, *s_step_trace, *s_step_notes, *s_steps, *s_start_ns, *s_get_span_context,
    *s_span_context_field;

static uint64_t next_draw(SamplerCore *self) {  /* splitmix64 */
    uint64_t z = (self->draws += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double draw_unit(SamplerCore *self) { return (double)(next_draw(self) >> 11) * 0x1.0p-53; }

/* Where `type` is among the span classes met so far: its index, or span_types_seen when it is not. */
static int span_type_slot(const SamplerCore *self, PyTypeObject *type) {
    int slot = 0;
    while (slot < self->span_types_seen && self->span_types[slot] != (PyObject *)type) slot++;
    return slot;
}

/* Whether `span`'s context can be read from its `_context` without running its
 * get_span_context (Python, two frames a request): its class was judged plain (span_judge) at
 * the version tag it has now. A class changed since (a method replaced, on it or a base) is
 * judged again. */
static int reads_plainly(SamplerCore *self, PyObject *span) {
    if (self->span_judge == NULL) return 0;
    PyTypeObject *type = Py_TYPE(span);
    if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) return 0;
    int slot = span_type_slot(self, type);
    if (slot < self->span_types_seen && self->span_tags[slot] == type->tp_version_tag) return self->span_plain[slot];
    if (slot == SPAN_TYPES) return 0;  /* more classes than a process has: the method for the rest */
    PyObject *judged = PyObject_CallOneArg(self->span_judge, (PyObject *)type);  /* once a class and change */
    int plain = judged == NULL ? -1 : PyObject_IsTrue(judged);
    Py_XDECREF(judged);
    if (plain < 0) {  /* a judge that fails says no, once: the class's spans are asked */
        PyErr_Clear();
        plain = 0;
    }
    if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) return 0;
    /* found again: the judge ran Python, during which another thread may have judged a class */
    slot = span_type_slot(self, type);
    if (slot == SPAN_TYPES) return plain;
    if (slot == self->span_types_seen) {
        self->span_types[slot] = Py_NewRef((PyObject *)type);
        self->span_types_seen++;
    }
    self->span_tags[slot] = type->tp_version_tag;
    self->span_plain[slot] = (char)plain;
    return plain;
}

/* The current OpenTelemetry span's (trace id, span id, sampled), read where get_current_span
 * reads it: 1 with *trace and *span set (new references; 0 and 0 when no valid span is current),
 * 0 when the context is not as expected (the Python probe reads it), -1 on error. */
static int read_span(SamplerCore *self, PyObject **trace, PyObject **span_id, int *sampled) {
    PyObject *context = NULL;
    *trace = *span_id = NULL;
    *sampled = 1;
    if (PyContextVar_Get(self->context_var, NULL, &context) < 0) return -1;
    if (context == NULL) return 1;
    if (!PyDict_Check(context)) {
        Py_DECREF(context);
        return 0;
    }
    PyObject *span = PyDict_GetItemWithError(context, self->span_key);
    Py_XINCREF(span);
    Py_DECREF(context);
    if (span == NULL) return PyErr_Occurred() ? -1 : 1;
    PyObject *span_context = reads_plainly(self, span) ? PyObject_GenericGetAttr(span, s_span_context_field)
                                                       : PyObject_CallMethodNoArgs(span, s_get_span_context);
    Py_DECREF(span);
    if (span_context == NULL) return -1;
    int status = 1;
    if (!PyTuple_Check(span_context) || PyTuple_GET_SIZE(span_context) < 6) {
        status = 0;  /* (trace_id, span_id, is_remote, trace_flags, trace_state, is_valid): not this */
    } else if (PyTuple_GET_ITEM(span_context, 5) == Py_True) {
        long flags = PyLong_AsLong(PyTuple_GET_ITEM(span_context, 3));
        if (flags == -1 && PyErr_Occurred()) {
            status = -1;
        } else {
            *trace = Py_NewRef(PyTuple_GET_ITEM(span_context, 0));
            *span_id = Py_NewRef(PyTuple_GET_ITEM(span_context, 1));
            *sampled = (int)(flags & 1);
        }
    }
    Py_DECREF(span_context);
    return status;
}

/* The same through the Python probe: 1, or -1 on error. */
static int probe_span(SamplerCore *self, PyObject **trace, PyObject **span_id, int *sampled) {
    *trace = *span_id = NULL;
    *sampled = 1;
    PyObject *found = PyObject_CallNoArgs(self->ambient);
    if (found == NULL) return -1;
    if (found == Py_None) {
        Py_DECREF(found);
        return 1;
    }
    if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 3) {
        Py_DECREF(found);
        PyErr_SetString(PyExc_TypeError, "the ambient probe gives (trace id, span id, sampled) or None");
        return -1;
    }
    int truth = PyObject_IsTrue(PyTuple_GET_ITEM(found, 2));
    if (truth < 0) {
        Py_DECREF(found);
        return -1;
    }
    *trace = Py_NewRef(PyTuple_GET_ITEM(found, 0));
    *span_id = Py_NewRef(PyTuple_GET_ITEM(found, 1));
    *sampled = truth;
    Py_DECREF(found);
    return 1;
}

/* The ambient span, as PySamplerCore.ambient_span gives it; a probe that fails is counted and
 * the step joins no request (the application's context must never break its own call). */
static void ambient_span(SamplerCore *self, PyObject **trace, PyObject **span_id, int *sampled) {
    int status = 0;
    *trace = *span_id = NULL;
    *sampled = 1;
    if (self->context_var != NULL) status = read_span(self, trace, span_id, sampled);
    if (status == 0 && self->ambient != Py_None) status = probe_span(self, trace, span_id, sampled);
    if (status < 0) {
        PyErr_Clear();
        self->probe_errors++;
        Py_CLEAR(*trace);
        Py_CLEAR(*span_id);
        *sampled = 1;
    }
}

/* obj.name, read from its slot at *offset where given (a generic attribute lookup passes
 * CPython's type-attribute cache, which a step's lookups share with the program's: what xsp does
 * a step it does without one); new reference, NULL with AttributeError when unset. */
static PyObject *field(PyObject *obj, const Py_ssize_t *offset, PyObject *name) {
    if (offset == NULL) return PyObject_GetAttr(obj, name);
    PyObject *value = SLOT(obj, *offset);
    if (value == NULL) PyErr_SetObject(PyExc_AttributeError, name);
    return Py_XNewRef(value);
}

/* obj.name = value, into its slot at *offset where given. */
static int set_field(PyObject *obj, const Py_ssize_t *offset, PyObject *name, PyObject *value) {
    if (offset == NULL) return PyObject_SetAttr(obj, name, value);
    slot_set(obj, *offset, value);
    return 0;
}

/* `value`, a non-negative int below 2**128, as its low and high 64 bits: 0, or -1 with an
 * exception (OverflowError past 128 bits or below 0). Before 3.12, from its digits (a few
 * shifts, where the generic conversion costs some 800 instructions a note). */
static int split_128(PyObject *value, uint64_t *low, uint64_t *high) {
#if PY_VERSION_HEX < 0x030C0000 && defined(__SIZEOF_INT128__)
    const PyLongObject *number = (const PyLongObject *)value;
    Py_ssize_t digits = Py_SIZE(number);
    int top_bits = 128 - (int)(digits - 1) * PyLong_SHIFT;  /* room in the result for the top digit */
    if (digits >= 0 && (digits <= 128 / PyLong_SHIFT || (top_bits > 0 && number->ob_digit[digits - 1] >> top_bits == 0))) {
        unsigned __int128 whole = 0;
        for (Py_ssize_t i = digits - 1; i >= 0; i--) whole = whole << PyLong_SHIFT | number->ob_digit[i];
        *low = (uint64_t)whole;
        *high = (uint64_t)(whole >> 64);
        return 0;
    }
#endif
    unsigned char bytes[16];
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t needed = PyLong_AsNativeBytes(value, bytes, 16, Py_ASNATIVEBYTES_LITTLE_ENDIAN
                                             | Py_ASNATIVEBYTES_UNSIGNED_BUFFER | Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (needed < 0) return -1;
    if (needed > 16) {
        PyErr_SetString(PyExc_OverflowError, "an id past 128 bits");
        return -1;
    }
#else
    if (_PyLong_AsByteArray((PyLongObject *)value, bytes, 16, 1, 0) < 0) return -1;
#endif
    *low = *high = 0;
    for (int i = 7; i >= 0; i--) {
        *low = *low << 8 | bytes[i];
        *high = *high << 8 | bytes[i + 8];
    }
    return 0;
}

/* A decision's note as one row of buffer.packed_notes (an int64 count, then rows of NOTE_FIELDS
 * int64s: the time, DECISION, the reason, the trace id's high and low halves, the span id, plan +
 * 1, 0) where a tuple of seven would be made and kept until its window, then read back one object
 * at a time: an always-on session notes every step. A full buffer doubles (a window's notes fill
 * it a dozen times at most). 1 when packed; 0 when not and the note belongs in step_notes (ids
 * that are no ints of 128 and 64 bits, a buffer a view holds). */
static int pack_note(PyObject *packed, long long time_ns, int reason, PyObject *trace, PyObject *span_id,
                     long long plan) {
    uint64_t high = 0, low = 0, span = 0, unused;
    if (trace != NULL && (!PyLong_CheckExact(trace) || split_128(trace, &low, &high) < 0)) goto declined;
    if (span_id != NULL && (!PyLong_CheckExact(span_id) || split_128(span_id, &span, &unused) < 0 || unused != 0))
        goto declined;
    const int64_t row[NOTE_FIELDS] = {time_ns, NOTE_DECISION, reason, (int64_t)high, (int64_t)low, (int64_t)span,
                                      plan + 1, 0};
    /* full: grown to twice its rows (0 where a view holds it, or no memory) */
    return append_packed_row(packed, row, NOTE_FIELDS, 2 * ((Py_ssize_t)packed_count_of(packed) + 1)) > 0;
declined:
    PyErr_Clear();
    return 0;
}

/* Note a decided step in the buffer and count it (PySamplerCore.note): packed where the buffer
 * has packed_notes (pack_note), else a tuple in step_notes. */
static int note_decision(SamplerCore *self, PyObject *buffer, PyObject *time, int reason, PyObject *trace,
                         PyObject *span_id, long long plan, const BufferSlots *slots) {
    long long began_ns = PyLong_AsLongLong(time);
    int timed = !(began_ns == -1 && PyErr_Occurred());
    if (!timed) PyErr_Clear();  /* a pause is then seen later, never wrongly */
    PyObject *packed = slots != NULL ? SLOT(buffer, slots->packed_notes) : NULL;
    if (!timed || packed == NULL || !PyByteArray_CheckExact(packed)
        || !pack_note(packed, began_ns, reason, trace, span_id, plan)) {
        PyObject *notes = field(buffer, slots ? &slots->step_notes : NULL, s_step_notes);
        if (notes == NULL) return -1;
        PyObject *kind = PyLong_FromLong(NOTE_DECISION), *why = PyLong_FromLong(reason);
        PyObject *zero = PyLong_FromLong(0), *planned = PyLong_FromLongLong(plan + 1);
        PyObject *note = NULL;
        if (kind != NULL && why != NULL && zero != NULL && planned != NULL)
            note = PyTuple_Pack(7, time, kind, why, trace != NULL ? trace : zero, span_id != NULL ? span_id : zero,
                                planned, zero);
        Py_XDECREF(kind);
        Py_XDECREF(why);
        Py_XDECREF(zero);
        Py_XDECREF(planned);
        int status = note == NULL || !PyList_Check(notes) ? -1 : PyList_Append(notes, note);
        if (note != NULL && !PyList_Check(notes)) PyErr_SetString(PyExc_TypeError, "step_notes must be a list");
        Py_XDECREF(note);
        Py_DECREF(notes);
        if (status < 0) return -1;
    }
    self->counts[reason]++;
    self->begun++;
    if (timed) self->last_begun_ns = began_ns;
    return 0;
}

/* PySamplerCore.depth: the step's limit, and in *operators whether it records operators. */
static long long decide(SamplerCore *self, PyObject *buffer, PyObject *time, int *operators, int *failed,
                        const BufferSlots *slots) {
    PyObject *trace, *span_id;
    int sampled;
    long long limit = MODEL_ONLY_LIMIT, plan = -1;
    *failed = 0;
    *operators = 0;
    ambient_span(self, &trace, &span_id, &sampled);
    /* the step's request, which another model's call must share to join the step (other_request) */
    if (set_field(buffer, slots ? &slots->step_trace : NULL, s_step_trace, trace ? trace : Py_None) < 0) {
        Py_XDECREF(trace);
        Py_XDECREF(span_id);
        *failed = 1;
        return MODEL_ONLY_LIMIT;
    }
    int reason = REASON_MODEL_ONLY;
    if (!sampled) {
        reason = REASON_NOT_SAMPLED;
    } else if (self->armed) {
        PyObject *decided = PyObject_CallFunctionObjArgs(self->on_armed, buffer, time, trace ? trace : Py_None,
                                                         span_id ? span_id : Py_None, NULL);
        Py_XDECREF(trace);
        Py_XDECREF(span_id);
        if (decided == NULL || !PyTuple_Check(decided) || PyTuple_GET_SIZE(decided) != 2) {
            if (decided != NULL) PyErr_SetString(PyExc_TypeError, "on_armed gives (limit, operators)");
            Py_XDECREF(decided);
            *failed = 1;
            return MODEL_ONLY_LIMIT;
        }
        limit = PyLong_AsLongLong(PyTuple_GET_ITEM(decided, 0));
        *operators = PyObject_IsTrue(PyTuple_GET_ITEM(decided, 1));
        Py_DECREF(decided);
        if (PyErr_Occurred() || *operators < 0) *failed = 1;
        return limit;
    } else if (draw_unit(self) < self->rate) {
        reason = REASON_SAMPLED;
        PyObject *chosen = PyObject_CallNoArgs(self->on_plan);
        if (chosen == NULL || !PyTuple_Check(chosen) || PyTuple_GET_SIZE(chosen) != 3) {
            if (chosen != NULL) PyErr_SetString(PyExc_TypeError, "on_plan gives (plan, limit, operators)");
            Py_XDECREF(chosen);
            goto failure;
        }
        plan = PyLong_AsLongLong(PyTuple_GET_ITEM(chosen, 0));
        limit = PyLong_AsLongLong(PyTuple_GET_ITEM(chosen, 1));
        *operators = PyObject_IsTrue(PyTuple_GET_ITEM(chosen, 2));
        Py_DECREF(chosen);
        if (PyErr_Occurred() || *operators < 0) goto failure;
    }
    if (note_decision(self, buffer, time, reason, trace, span_id, plan, slots) < 0) goto failure;
    Py_XDECREF(trace);
    Py_XDECREF(span_id);
    return limit;
failure:
    Py_XDECREF(trace);
    Py_XDECREF(span_id);
    *failed = 1;
    return MODEL_ONLY_LIMIT;
}

/* PySamplerCore.learn: the running median over the last median_steps durations taken. */
static void learn(SamplerCore *self, long long duration_ns) {
    int size = self->recent_size;
    if (size == self->median_steps) {  /* the oldest leaves the sorted copy */
        long long oldest = self->recent[self->recent_next];
        int at = 0;
        while (at < size && self->sorted[at] < oldest) at++;
        memmove(self->sorted + at, self->sorted + at + 1, (size_t)(size - at - 1) * sizeof(long long));
        size--;
    } else {
        self->recent_size++;
    }
    self->recent[self->recent_next] = duration_ns;
    self->recent_next = (self->recent_next + 1) % self->median_steps;
    int at = 0;
    while (at < size && self->sorted[at] <= duration_ns) at++;
    memmove(self->sorted + at + 1, self->sorted + at, (size_t)(size - at) * sizeof(long long));
    self->sorted[at] = duration_ns;
    size++;
    if (size >= self->warmup_steps && self->slow_factor)
        self->threshold_ns = (long long)(self->slow_factor * (double)self->sorted[size / 2]);
}

/* PySamplerCore.step_ended: 0, or -1 when the slow step's callback failed. */
static int step_ended(SamplerCore *self, long long duration_ns, PyObject *buffer) {
    int status = 0;
    if (self->threshold_ns && duration_ns > self->threshold_ns && buffer != Py_None) {
        PyObject *duration = PyLong_FromLongLong(duration_ns);
        PyObject *done = duration == NULL ? NULL : PyObject_CallFunctionObjArgs(self->on_slow, duration, buffer, NULL);
        Py_XDECREF(duration);
        if (done == NULL) status = -1;
        Py_XDECREF(done);
    }
    self->ended++;
    if (self->ended <= self->warmup_steps || self->ended % self->median_every == 0) learn(self, duration_ns);
    return status;
}

/* What the step's thread records of it: buffer.decided_ns = buffer.steps.start_ns;
 * buffer.step_limit, buffer.step_operators = depth(...). */
int sampler_step_begins(PyObject *core, PyObject *buffer, PyObject *time, long long before_ns, const BufferSlots *slots,
                        PyObject *steps, const StepsSlots *steps_slots) {
    SamplerCore *self = (SamplerCore *)core;
    if (before_ns > 0 && step_ended(self, before_ns, buffer) < 0) return -1;
    steps = steps != NULL ? Py_NewRef(steps) : PyObject_GetAttr(buffer, s_steps);
    PyObject *start = steps == NULL ? NULL : field(steps, steps_slots ? &steps_slots->start_ns : NULL, s_start_ns);
    Py_XDECREF(steps);
    if (start == NULL || set_field(buffer, slots ? &slots->decided_ns : NULL, s_decided_ns, start) < 0) {
        Py_XDECREF(start);
        return -1;
    }
    Py_DECREF(start);
    int failed, operators;
    long long limit = decide(self, buffer, time, &operators, &failed, slots);
    if (failed) return -1;
    PyObject *limit_object = PyLong_FromLongLong(limit);
    if (limit_object == NULL) return -1;
    int status = set_field(buffer, slots ? &slots->step_limit : NULL, s_step_limit, limit_object);
    Py_DECREF(limit_object);
    if (status == 0)
        status = set_field(buffer, slots ? &slots->step_operators : NULL, s_step_operators, operators ? Py_True : Py_False);
    return status;
}

int is_sampler_core(PyObject *obj) { return Py_IS_TYPE(obj, &SamplerCoreType); }

/* PySamplerCore.other_request: 1 when the request span current now is of another trace than
 * buffer.step_trace (a probe that fails reads as no request), 0 when not, -1 on error. */
int sampler_other_request(PyObject *core, PyObject *buffer, const BufferSlots *slots) {
    PyObject *trace, *span_id;
    int sampled;
    ambient_span((SamplerCore *)core, &trace, &span_id, &sampled);
    Py_XDECREF(span_id);
    PyObject *stored = field(buffer, slots ? &slots->step_trace : NULL, s_step_trace);
    if (stored == NULL) {
        Py_XDECREF(trace);
        return -1;
    }
    int other;
    if (trace == NULL || stored == Py_None) other = (trace == NULL) != (stored == Py_None);
    else other = PyObject_RichCompareBool(trace, stored, Py_NE);
    Py_XDECREF(trace);
    Py_DECREF(stored);
    return other;
}

/* Python methods ------------------------------------------------------------------------ */

static PyObject *core_step_begins(SamplerCore *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "step_begins(buffer, time_ns, before_ns=0)");
        return NULL;
    }
    long long before_ns = nargs == 3 ? PyLong_AsLongLong(argv[2]) : 0;
    if (before_ns == -1 && PyErr_Occurred()) return NULL;
    if (sampler_step_begins((PyObject *)self, argv[0], argv[1], before_ns, NULL, NULL, NULL) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *core_decide(SamplerCore *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "decide(buffer, time_ns)");
        return NULL;
    }
    int failed, operators;
    long long limit = decide(self, argv[0], argv[1], &operators, &failed, NULL);
    return failed ? NULL : PyLong_FromLongLong(limit);
}

static PyObject *core_depth(SamplerCore *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "depth(buffer, time_ns)");
        return NULL;
    }
    int failed, operators;
    long long limit = decide(self, argv[0], argv[1], &operators, &failed, NULL);
    return failed ? NULL : Py_BuildValue("(LO)", limit, operators ? Py_True : Py_False);
}

static PyObject *core_step_ended(SamplerCore *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "step_ended(duration_ns, buffer)");
        return NULL;
    }
    long long duration_ns = PyLong_AsLongLong(argv[0]);
    if (duration_ns == -1 && PyErr_Occurred()) return NULL;
    if (step_ended(self, duration_ns, argv[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *core_note(SamplerCore *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "note(buffer, time_ns, reason, trace_id, span_id, plan)");
        return NULL;
    }
    long reason = PyLong_AsLong(argv[2]);
    long long plan = PyLong_AsLongLong(argv[5]);
    if (PyErr_Occurred()) return NULL;
    if (reason < 0 || reason >= REASONS) {
        PyErr_SetString(PyExc_ValueError, "no such reason");
        return NULL;
    }
    if (note_decision(self, argv[0], argv[1], (int)reason, argv[3] == Py_None ? NULL : argv[3],
                      argv[4] == Py_None ? NULL : argv[4], plan, NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *core_draw(SamplerCore *self, PyObject *unused) { return PyFloat_FromDouble(draw_unit(self)); }

static PyObject *core_other_request(SamplerCore *self, PyObject *buffer) {
    int other = sampler_other_request((PyObject *)self, buffer, NULL);
    return other < 0 ? NULL : PyBool_FromLong(other);
}

static PyObject *core_ambient_span(SamplerCore *self, PyObject *unused) {
    PyObject *trace, *span_id;
    int sampled;
    ambient_span(self, &trace, &span_id, &sampled);
    PyObject *found = Py_BuildValue("(OOO)", trace ? trace : Py_None, span_id ? span_id : Py_None,
                                    sampled ? Py_True : Py_False);
    Py_XDECREF(trace);
    Py_XDECREF(span_id);
    return found;
}

static PyObject *core_counts(SamplerCore *self, PyObject *unused) {
    PyObject *counts = PyList_New(REASONS);
    for (int i = 0; counts != NULL && i < REASONS; i++) {
        PyObject *count = PyLong_FromLongLong(self->counts[i]);
        if (count == NULL) {
            Py_CLEAR(counts);
            break;
        }
        PyList_SET_ITEM(counts, i, count);
    }
    return counts;
}

static PyObject *core_median_ns(SamplerCore *self, void *unused) {
    return PyLong_FromLongLong(self->recent_size ? self->sorted[self->recent_size / 2] : 0);
}

static PyMethodDef core_methods[] = {
    {"step_begins", (PyCFunction)(void (*)(void))core_step_begins, METH_FASTCALL,
     "step_begins(buffer, time_ns, before_ns=0): decide the step beginning on buffer's thread."},
    {"decide", (PyCFunction)(void (*)(void))core_decide, METH_FASTCALL,
     "decide(buffer, time_ns) -> step limit, the decision noted in buffer.step_notes."},
    {"depth", (PyCFunction)(void (*)(void))core_depth, METH_FASTCALL,
     "depth(buffer, time_ns) -> (step limit, whether it records operators), the decision noted."},
    {"step_ended", (PyCFunction)(void (*)(void))core_step_ended, METH_FASTCALL,
     "step_ended(duration_ns, buffer): learn a step's duration; a slow one calls on_slow."},
    {"note", (PyCFunction)(void (*)(void))core_note, METH_FASTCALL,
     "note(buffer, time_ns, reason, trace_id, span_id, plan): note and count a decision made elsewhere."},
    {"draw", (PyCFunction)core_draw, METH_NOARGS, "draw() -> the next uniform draw in [0, 1)."},
    {"other_request", (PyCFunction)core_other_request, METH_O,
     "other_request(buffer) -> whether the current OpenTelemetry span is of another trace than buffer.step_trace."},
    {"ambient_span", (PyCFunction)core_ambient_span, METH_NOARGS,
     "ambient_span() -> (trace id or None, span id or None, sampled) of the current OpenTelemetry span."},
    {"counts", (PyCFunction)core_counts, METH_NOARGS, "counts() -> steps decided so far, by reason code."},
    {NULL},
};

static PyGetSetDef core_getset[] = {
    {"median_ns", (getter)core_median_ns, NULL, "The running median step duration (0 before any step ended).", NULL},
    {NULL},
};

static PyMemberDef core_members[] = {
    {"armed", T_INT, offsetof(SamplerCore, armed), 0, "Nonzero while steps after a slow one or of a capture are due."},
    {"begun", T_LONGLONG, offsetof(SamplerCore, begun), READONLY, "Steps decided so far."},
    {"last_begun_ns", T_LONGLONG, offsetof(SamplerCore, last_begun_ns), READONLY,
     "When the last step decided began (host clock, ns; 0: none yet)."},
    {"ended", T_LONGLONG, offsetof(SamplerCore, ended), READONLY, "Step durations heard so far."},
    {"probe_errors", T_LONGLONG, offsetof(SamplerCore, probe_errors), READONLY,
     "Steps whose current OpenTelemetry span could not be read."},
    {"threshold_ns", T_LONGLONG, offsetof(SamplerCore, threshold_ns), READONLY, "Steps longer are slow (0: none yet)."},
    {NULL},
};

#define EACH_CORE_FIELD(DO) \
    DO(self->context_var); DO(self->span_key); DO(self->span_judge); DO(self->ambient); DO(self->on_armed); \
    DO(self->on_plan); DO(self->on_slow)

static int core_traverse(SamplerCore *self, visitproc visit, void *arg) {
    EACH_CORE_FIELD(Py_VISIT);
    for (int slot = 0; slot < self->span_types_seen; slot++) Py_VISIT(self->span_types[slot]);
    return 0;
}

static int core_clear(SamplerCore *self) {
    EACH_CORE_FIELD(Py_CLEAR);
    for (int slot = 0; slot < self->span_types_seen; slot++) Py_CLEAR(self->span_types[slot]);
    self->span_types_seen = 0;
    return 0;
}

static void core_dealloc(SamplerCore *self) {
    PyObject_GC_UnTrack(self);
    core_clear(self);
    PyMem_Free(self->recent);
    PyMem_Free(self->sorted);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static const char *core_kwlist[] = {"rate", "slow_factor", "seed", "ambient", "on_armed", "on_plan", "on_slow",
                                    "median_steps", "warmup_steps", "median_every", "context", NULL};

static int core_init(SamplerCore *self, PyObject *args, PyObject *kwds) {
    double rate, slow_factor;
    unsigned long long seed;
    int median_steps, warmup_steps, median_every;
    PyObject *ambient, *on_armed, *on_plan, *on_slow, *context = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ddKOOOOiii|O", (char **)core_kwlist, &rate, &slow_factor, &seed,
                                     &ambient, &on_armed, &on_plan, &on_slow, &median_steps, &warmup_steps,
                                     &median_every, &context))
        return -1;
    if (median_steps < 1 || median_steps > MEDIAN_CAPACITY || median_every < 1 || warmup_steps < 0) {
        PyErr_SetString(PyExc_ValueError, "median_steps from 1 to 1024, median_every from 1, warmup_steps from 0");
        return -1;
    }
    PyObject *context_var = NULL, *span_key = NULL, *span_judge = NULL;
    if (context != Py_None) {
        Py_ssize_t size = PyTuple_Check(context) ? PyTuple_GET_SIZE(context) : 0;
        if ((size != 2 && size != 3) || !PyContextVar_CheckExact(PyTuple_GET_ITEM(context, 0))
            || (size == 3 && !PyCallable_Check(PyTuple_GET_ITEM(context, 2)))) {
            PyErr_SetString(PyExc_TypeError, "context: (the ContextVar of OpenTelemetry's context, the span's key[, "
                                             "(span class) -> whether its get_span_context gives just _context])");
            return -1;
        }
        context_var = PyTuple_GET_ITEM(context, 0);
        span_key = PyTuple_GET_ITEM(context, 1);
        if (size == 3) span_judge = PyTuple_GET_ITEM(context, 2);
    }
    long long *recent = PyMem_Calloc((size_t)median_steps, sizeof(long long));
    long long *sorted = PyMem_Calloc((size_t)median_steps, sizeof(long long));
    if (recent == NULL || sorted == NULL) {
        PyMem_Free(recent);
        PyMem_Free(sorted);
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(self->recent);
    PyMem_Free(self->sorted);
    self->recent = recent;
    self->sorted = sorted;
    self->recent_next = self->recent_size = 0;
    self->rate = rate;
    self->slow_factor = slow_factor;
    self->draws = seed;
    self->median_steps = median_steps;
    self->warmup_steps = warmup_steps;
    self->median_every = median_every;
    Py_XSETREF(self->context_var, Py_XNewRef(context_var));
    Py_XSETREF(self->span_key, Py_XNewRef(span_key));
    Py_XSETREF(self->span_judge, Py_XNewRef(span_judge));
    for (int slot = 0; slot < self->span_types_seen; slot++) Py_CLEAR(self->span_types[slot]);
    self->span_types_seen = 0;
    Py_XSETREF(self->ambient, Py_NewRef(ambient));
    Py_XSETREF(self->on_armed, Py_NewRef(on_armed));
    Py_XSETREF(self->on_plan, Py_NewRef(on_plan));
    Py_XSETREF(self->on_slow, Py_NewRef(on_slow));
    return 0;
}

int sampler_core_ready(void) {
#define INTERN_OR_FAIL(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1
    INTERN_OR_FAIL(s_decided_ns, "decided_ns");
    INTERN_OR_FAIL(s_step_limit, "step_limit");
    INTERN_OR_FAIL(s_step_operators, "step_operators");
    INTERN_OR_FAIL(s_step_trace, "step_trace");
    INTERN_OR_FAIL(s_step_notes, "step_notes");
    INTERN_OR_FAIL(s_steps, "steps");
    INTERN_OR_FAIL(s_start_ns, "start_ns");
    INTERN_OR_FAIL(s_get_span_context, "get_span_context");
    INTERN_OR_FAIL(s_span_context_field, "_context");
    return PyType_Ready(&SamplerCoreType);
}

PyTypeObject SamplerCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp.record._hotpath.SamplerCore",
    .tp_doc = PyDoc_STR("SamplerCore(rate, slow_factor, seed, ambient, on_armed, on_plan, on_slow, median_steps, "
                        "warmup_steps, median_every, context=None): the per-step part of StepSampler, in C "
                        "(xsp.record.sampling.PySamplerCore is its Python twin)."),
    .tp_basicsize = sizeof(SamplerCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
    .tp_members = core_members,
    .tp_getset = core_getset,
};
