/* xsp.record._activity: CUPTI activity records read in C (see xsp/record/_activity.pyi for the interface).
 *
 * cupti-python stays the control plane (driver checks, enabling kinds, flushing, the clock);
 * this module binds to the libcupti cupti-python loaded, registers its own buffer callbacks,
 * and at each drain turns the completed buffers into packed columns that numpy reads through
 * the buffer protocol: no Python object per record, and no GIL while the records are read. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../_correlation.h"
#include "binding.h"
#include "buffers.h"
#include "columns.h"

static name_table NAMES;

/* What xsp changed of CUPTI's process-wide settings, to set back when its session ends. */
static struct {
    int zeroed_changed;   /* CUPTI_ACTIVITY_ATTR_ZEROED_OUT_ACTIVITY_BUFFER set to 1 by xsp */
    uint8_t zeroed_before; /* its value before */
    int clock_changed;    /* a timestamp callback registered by xsp */
    int shared_clock;     /* a timestamp callback set for xsp's subscriber while it shares CUPTI */
} SETTINGS;
static pthread_mutex_t DRAIN_LOCK = PTHREAD_MUTEX_INITIALIZER; /* one drain at a time: NAMES is its */

/* Column: one packed array, owned, readable through the buffer protocol -------------------- */
typedef struct {
    PyObject_HEAD
    char *data;
    Py_ssize_t length;
    Py_ssize_t itemsize;
    char format[2];
} Column;

static char EMPTY[8];

static void column_dealloc(Column *self) {
    free(self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int column_getbuffer(Column *self, Py_buffer *view, int flags) {
    if (flags & PyBUF_WRITABLE) {
        PyErr_SetString(PyExc_BufferError, "a CUPTI record column is read-only");
        return -1;
    }
    view->obj = Py_NewRef((PyObject *)self);
    view->buf = self->data != NULL ? self->data : EMPTY;
    view->len = self->length * self->itemsize;
    view->readonly = 1;
    view->itemsize = self->itemsize;
    view->format = (flags & PyBUF_FORMAT) ? self->format : NULL;
    view->ndim = 1;
    view->shape = (flags & PyBUF_ND) ? &self->length : NULL;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &self->itemsize : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    return 0;
}

static Py_ssize_t column_length(Column *self) { return self->length; }

static PyObject *column_repr(Column *self) {
    return PyUnicode_FromFormat("<xsp.record._activity.Column of %zd '%s'>", self->length, self->format);
}

static PyBufferProcs column_buffer = {.bf_getbuffer = (getbufferproc)column_getbuffer};
static PySequenceMethods column_sequence = {.sq_length = (lenfunc)column_length};

static PyTypeObject ColumnType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp.record._activity.Column",
    .tp_doc = "One column of CUPTI records: numpy.asarray(column) reads it without a copy.",
    .tp_basicsize = sizeof(Column),
    .tp_dealloc = (destructor)column_dealloc,
    .tp_repr = (reprfunc)column_repr,
    .tp_as_buffer = &column_buffer,
    .tp_as_sequence = &column_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

/* Takes `*data` (set to NULL): the column owns it from here. */
static PyObject *new_column(char **data, size_t rows, uint8_t type) {
    Column *self = PyObject_New(Column, &ColumnType);
    if (self == NULL) return NULL;
    self->data = *data;
    *data = NULL;
    self->length = (Py_ssize_t)rows;
    self->itemsize = field_width(type);
    self->format[0] = field_format(type);
    self->format[1] = '\0';
    return (PyObject *)self;
}

/* external correlation --------------------------------------------------------------------- */
static void push_external_id(uint64_t external_id) {
    if (binding_push(external_id) != CUPTI_OK) add_count(&COUNTS.correlation_failed, 1);
}

static void pop_external_id(void) {
    uint64_t last;
    if (binding_pop(&last) != CUPTI_OK) add_count(&COUNTS.correlation_failed, 1);
}

static const xsp_correlation CORRELATION = {push_external_id, pop_external_id};

static PyObject *push(PyObject *module, PyObject *external_id) {
    unsigned long long value = PyLong_AsUnsignedLongLong(external_id);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    push_external_id(value);
    Py_RETURN_NONE;
}

static PyObject *pop(PyObject *module, PyObject *unused) {
    pop_external_id();
    Py_RETURN_NONE;
}

/* binding and registration ---------------------------------------------------------------- */
static PyObject *bound_description(void) {
    if (BINDING.handle == NULL) Py_RETURN_NONE;
    return Py_BuildValue("{s:s,s:I,s:s}", "path", BINDING.path, "version", BINDING.version, "release",
                         BINDING.release->release);
}

static PyObject *bind(PyObject *module, PyObject *args) {
    const char *path = NULL;
    unsigned int major = 0;
    if (!PyArg_ParseTuple(args, "|zI", &path, &major)) return NULL;
    char why[2600] = "";
    if (bind_cupti(path, major, why, sizeof(why)) < 0) {
        PyErr_SetString(PyExc_OSError, why);
        return NULL;
    }
    return bound_description();
}

static PyObject *bound(PyObject *module, PyObject *unused) { return bound_description(); }

static PyObject *register_callbacks(PyObject *module, PyObject *args) {
    Py_ssize_t buffer_bytes, max_buffers;
    const char *zeroing = "written";
    if (!PyArg_ParseTuple(args, "nn|s", &buffer_bytes, &max_buffers, &zeroing)) return NULL;
    int zero_whole = strcmp(zeroing, "whole") == 0;
    if (!zero_whole && strcmp(zeroing, "written") != 0) {
        PyErr_SetString(PyExc_ValueError, "zeroing: 'written' or 'whole'");
        return NULL;
    }
    if (BINDING.handle == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no libcupti is bound (call bind first)");
        return NULL;
    }
    if (buffer_bytes < 4096 || buffer_bytes % 8 != 0 || max_buffers < 1) {
        PyErr_SetString(PyExc_ValueError, "buffer_bytes: a multiple of 8 of at least 4096; max_buffers: at least 1");
        return NULL;
    }
    if (pool_configure((size_t)buffer_bytes, (size_t)max_buffers, zero_whole ? ZERO_WHOLE : ZERO_WRITTEN) < 0)
        return PyErr_NoMemory();
    /* shared, the zeroed-buffer attribute is left alone: it is not documented per subscriber, and
     * set for the process it would leave the other clients' buffers uninitialised; CUPTI zeroes xsp's */
    if (BINDING.subscriber == NULL && !SETTINGS.zeroed_changed) { /* once: a second register must not take xsp's own value as the user's */
        uint8_t before = 0; /* CUPTI's documented default, where the value cannot be read */
        size_t size = sizeof(before);
        if (BINDING.get_attribute != NULL
            && BINDING.get_attribute(ATTR_ZEROED_OUT_ACTIVITY_BUFFER, &size, &before) != CUPTI_OK)
            before = 0;
        uint8_t zeroed = 1;
        size = sizeof(zeroed);
        if (BINDING.set_attribute(ATTR_ZEROED_OUT_ACTIVITY_BUFFER, &size, &zeroed) == CUPTI_OK) {
            SETTINGS.zeroed_before = before;
            SETTINGS.zeroed_changed = 1;
        }
    }
    cupti_result status = register_pool_callbacks();
    if (status != CUPTI_OK) {
        PyErr_Format(PyExc_RuntimeError, "cuptiActivityRegisterCallbacks%s failed (CUPTI error %d)",
                     BINDING.subscriber != NULL ? "_v2" : "", status);
        return NULL;
    }
    return PyBool_FromLong(BINDING.subscriber == NULL && SETTINGS.zeroed_changed);
}

/* xsp's host clock, what time.perf_counter_ns() reads on Linux: CUPTI calls it from any thread. */
static uint64_t host_clock_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

/* The clock CUPTI stamps records with when no client gave it one: CLOCK_REALTIME on Linux, and
 * from CUPTI 13.0 CLOCK_MONOTONIC_RAW under WSL (cupti_activity.h). */
static int WSL_RAW_CLOCK;

static uint64_t cupti_default_clock_ns(void) {
    struct timespec now;
    clock_gettime(WSL_RAW_CLOCK ? CLOCK_MONOTONIC_RAW : CLOCK_REALTIME, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

static int running_under_wsl(void) {
    FILE *file = fopen("/proc/sys/kernel/osrelease", "r");
    if (file == NULL) return 0;
    char release[256] = "";
    int wsl = fgets(release, sizeof(release), file) != NULL
              && (strstr(release, "microsoft") != NULL || strstr(release, "Microsoft") != NULL
                  || strstr(release, "WSL") != NULL);
    fclose(file);
    return wsl;
}

static PyObject *use_host_clock(PyObject *module, PyObject *unused) {
    WSL_RAW_CLOCK = BINDING.version >= 130000 && running_under_wsl();
    if (BINDING.handle != NULL && BINDING.subscriber != NULL) { /* the subscriber's own clock attribute */
        timestamp_fn clock = host_clock_ns;
        size_t size = sizeof(clock);
        SETTINGS.shared_clock = binding_set_attribute(ATTR_TIMESTAMP_CALLBACK, &size, &clock) == CUPTI_OK;
        return PyBool_FromLong(SETTINGS.shared_clock);
    }
    if (BINDING.handle == NULL || BINDING.register_timestamp == NULL) Py_RETURN_FALSE;
    if (BINDING.register_timestamp(host_clock_ns) != CUPTI_OK) Py_RETURN_FALSE;
    SETTINGS.clock_changed = 1;
    Py_RETURN_TRUE;
}

/* Every process-wide setting register() and use_host_clock() changed, set back. */
static PyObject *restore(PyObject *module, PyObject *unused) {
    char failed[256] = "";
    if (BINDING.subscriber != NULL && SETTINGS.shared_clock) { /* xsp's subscriber's own, before it unsubscribes */
        timestamp_fn none = NULL;
        size_t size = sizeof(none);
        binding_set_attribute(ATTR_TIMESTAMP_CALLBACK, &size, &none);
        SETTINGS.shared_clock = 0; /* refused or not, it goes with the subscription, which xsp ends next */
    }
    if (SETTINGS.zeroed_changed) {
        uint8_t before = SETTINGS.zeroed_before;
        size_t size = sizeof(before);
        cupti_result status = BINDING.set_attribute(ATTR_ZEROED_OUT_ACTIVITY_BUFFER, &size, &before);
        if (status == CUPTI_OK)
            SETTINGS.zeroed_changed = 0;
        else
            snprintf(failed, sizeof(failed), "the zeroed-buffer attribute (CUPTI error %d)", status);
    }
    if (SETTINGS.clock_changed) {
        /* The 13.2+ attribute takes NULL to unregister; the function answers NULL with INVALID_PARAMETER
         * up to 13.0 at least: there, a callback reading the clock CUPTI reads by default takes its place. */
        cupti_result status = BINDING.register_timestamp(NULL);
        if (status != CUPTI_OK) status = BINDING.register_timestamp(cupti_default_clock_ns);
        if (status == CUPTI_OK) {
            SETTINGS.clock_changed = 0;
        } else {
            size_t used = strlen(failed);
            snprintf(failed + used, sizeof(failed) - used, "%sthe timestamp callback (CUPTI error %d)",
                     used ? " and " : "", status);
        }
    }
    if (failed[0]) {
        PyErr_Format(PyExc_OSError, "CUPTI did not take back %s", failed);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* sharing CUPTI (13.5's multi-subscriber mode) ---------------------------------------------- */
static PyObject *can_share(PyObject *module, PyObject *unused) { return PyBool_FromLong(binding_can_share()); }

static PyObject *share(PyObject *module, PyObject *handle) {
    void *subscriber = handle == Py_None ? NULL : PyLong_AsVoidPtr(handle);
    if (subscriber == NULL && PyErr_Occurred()) return NULL;
    if (subscriber != NULL && !binding_can_share()) {
        PyErr_SetString(PyExc_RuntimeError, "this libcupti cannot share CUPTI (13.5's _v2 calls are missing)");
        return NULL;
    }
    BINDING.subscriber = subscriber;
    Py_RETURN_NONE;
}

/* A RuntimeError whose `status` is CUPTI's result code, as cupti-python's errors have. */
static PyObject *shared_failure(const char *call, cupti_result status) {
    PyObject *error = PyObject_CallFunction(PyExc_RuntimeError, "N",
                                            PyUnicode_FromFormat("%s failed (CUPTI error %d)", call, status));
    if (error == NULL) return NULL;
    PyObject *code = PyLong_FromLong(status);
    if (code != NULL && PyObject_SetAttrString(error, "status", code) == 0) PyErr_SetObject(PyExc_RuntimeError, error);
    Py_XDECREF(code);
    Py_DECREF(error);
    return NULL;
}

static int sharing(void) {
    if (BINDING.subscriber != NULL) return 1;
    PyErr_SetString(PyExc_RuntimeError, "xsp does not share CUPTI now (call share first)");
    return 0;
}

static PyObject *enable_kind(PyObject *module, PyObject *args) {
    unsigned int kind;
    int on;
    if (!PyArg_ParseTuple(args, "Ip", &kind, &on) || !sharing()) return NULL;
    cupti_result status = (on ? BINDING.enable_v2 : BINDING.disable_v2)(BINDING.subscriber, kind, NULL);
    if (status != CUPTI_OK) return shared_failure(on ? "cuptiActivityEnable_v2" : "cuptiActivityDisable_v2", status);
    Py_RETURN_NONE;
}

static PyObject *enable_api(PyObject *module, PyObject *args) {
    unsigned int kind, cbid;
    int on;
    if (!PyArg_ParseTuple(args, "IIp", &kind, &cbid, &on) || !sharing()) return NULL;
    int runtime = kind == KIND_RUNTIME;
    cupti_result status = (runtime ? BINDING.enable_runtime_api_v2 : BINDING.enable_driver_api_v2)(
        BINDING.subscriber, cbid, (uint8_t)(on ? 1 : 0));
    if (status != CUPTI_OK)
        return shared_failure(runtime ? "cuptiActivityEnableRuntimeApi_v2" : "cuptiActivityEnableDriverApi_v2", status);
    Py_RETURN_NONE;
}

static PyObject *set_thread_id_type(PyObject *module, PyObject *value) {
    long type = PyLong_AsLong(value);
    if ((type == -1 && PyErr_Occurred()) || !sharing()) return NULL;
    int32_t stored = (int32_t)type;
    size_t size = sizeof(stored);
    cupti_result status = binding_set_attribute(ATTR_THREAD_ID_TYPE, &size, &stored);
    if (status != CUPTI_OK) return shared_failure("cuptiActivitySetAttribute_v2 (thread-id type)", status);
    Py_RETURN_NONE;
}

static PyObject *settings(PyObject *module, PyObject *unused) {
    return Py_BuildValue("{s:O,s:i,s:O,s:O,s:O}", "zeroed_buffers_claimed", SETTINGS.zeroed_changed ? Py_True : Py_False,
                         "zeroed_before", (int)SETTINGS.zeroed_before, "host_clock",
                         SETTINGS.clock_changed ? Py_True : Py_False, "can_read_attributes",
                         BINDING.get_attribute != NULL ? Py_True : Py_False, "has_timestamp_callback",
                         BINDING.register_timestamp != NULL ? Py_True : Py_False);
}

/* draining --------------------------------------------------------------------------------- */
static int set_count(PyObject *dict, const char *key, uint64_t value) {
    PyObject *number = PyLong_FromUnsignedLongLong(value);
    if (number == NULL) return -1;
    int status = PyDict_SetItemString(dict, key, number);
    Py_DECREF(number);
    return status;
}

static PyObject *family_dict(drain_columns *taken, int family) {
    const family_layout *layout = &FAMILY_LAYOUTS[family];
    family_columns *columns = &taken->families[family];
    PyObject *dict = PyDict_New();
    if (dict == NULL) return NULL;
    for (int i = 0; i < layout->field_count; i++) {
        PyObject *column = new_column(&columns->columns[i].data, columns->rows, layout->fields[i].type);
        if (column == NULL || PyDict_SetItemString(dict, layout->fields[i].name, column) < 0) {
            Py_XDECREF(column);
            Py_DECREF(dict);
            return NULL;
        }
        Py_DECREF(column);
    }
    return dict;
}

static PyObject *new_names(void) {
    PyObject *names = PyList_New(0);
    if (names == NULL) return NULL;
    for (uint32_t id = NAMES.reported; id < NAMES.count; id++) {
        PyObject *name = PyUnicode_DecodeUTF8(NAMES.texts[id], (Py_ssize_t)NAMES.lengths[id], "replace");
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    return names;
}

static PyObject *drain_result(drain_columns *taken, size_t buffers, size_t bytes) {
    PyObject *result = PyDict_New();
    if (result == NULL) return NULL;
    for (int family = 0; family < FAMILIES; family++) {
        PyObject *dict = family_dict(taken, family);
        if (dict == NULL || PyDict_SetItemString(result, FAMILY_LAYOUTS[family].name, dict) < 0) {
            Py_XDECREF(dict);
            goto failed;
        }
        Py_DECREF(dict);
    }
    PyObject *names = new_names();
    if (names == NULL || PyDict_SetItemString(result, "names", names) < 0) {
        Py_XDECREF(names);
        goto failed;
    }
    Py_DECREF(names);
    if (set_count(result, "buffers", buffers) < 0 || set_count(result, "bytes", bytes) < 0
        || set_count(result, "records", taken->records) < 0 || set_count(result, "other_kinds", taken->other_kinds) < 0
        || set_count(result, "unreadable", taken->unreadable) < 0 || set_count(result, "cut_short", taken->cut_short) < 0
        || set_count(result, "size_mismatch", taken->size_mismatch) < 0
        || set_count(result, "dropped_by_cupti", take_count(&COUNTS.dropped_by_cupti)) < 0
        || set_count(result, "buffers_with_drops", take_count(&COUNTS.buffers_with_drops)) < 0
        || set_count(result, "most_dropped_in_a_buffer", take_count(&COUNTS.most_dropped_in_a_buffer)) < 0
        || set_count(result, "buffers_refused", take_count(&COUNTS.buffers_refused)) < 0
        || set_count(result, "correlation_failed", take_count(&COUNTS.correlation_failed)) < 0
        || set_count(result, "foreign_buffers", take_count(&COUNTS.foreign_buffers)) < 0)
        goto failed;
    return result;
failed:
    Py_DECREF(result);
    return NULL;
}

static PyObject *drain(PyObject *module, PyObject *unused) {
    if (BINDING.handle == NULL || POOL.queue == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no libcupti is bound and registered");
        return NULL;
    }
    drain_columns *taken = calloc(1, sizeof(drain_columns));
    completed_buffer *buffers = calloc(POOL.max_buffers, sizeof(completed_buffer));
    if (taken == NULL || buffers == NULL) {
        free(taken);
        free(buffers);
        return PyErr_NoMemory();
    }
    int failed = 0;
    size_t count, bytes = 0;
    PyObject *result = NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&DRAIN_LOCK);
    count = pool_take_queue(buffers);
    for (size_t i = 0; i < count; i++) {
        bytes += buffers[i].valid_size;
        if (!failed && read_buffer(taken, BINDING.release, binding_next_record, buffers[i].data,
                                   buffers[i].valid_size, &NAMES) < 0)
            failed = 1;
    }
    pool_give_back(buffers, count);
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
    } else if ((result = drain_result(taken, count, bytes)) != NULL) {
        NAMES.reported = NAMES.count;
    }
    pthread_mutex_unlock(&DRAIN_LOCK);
    free_columns(taken);
    free(taken);
    free(buffers);
    return result;
}

/* introspection ----------------------------------------------------------------------------- */
static PyObject *layouts(PyObject *module, PyObject *unused) {
    PyObject *result = PyDict_New();
    if (result == NULL) return NULL;
    for (int family = 0; family < FAMILIES; family++) {
        const family_layout *layout = &FAMILY_LAYOUTS[family];
        PyObject *fields = PyDict_New();
        if (fields == NULL || PyDict_SetItemString(result, layout->name, fields) < 0) {
            Py_XDECREF(fields);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(fields);
        for (int i = 0; i < layout->field_count; i++) {
            const field_layout *field = &layout->fields[i];
            char format[2] = {field_format(field->type), '\0'};
            PyObject *entry = Py_BuildValue("(Hsi)", field->offset, field->type == NAME ? "P" : format,
                                            field->type == NAME ? (int)sizeof(void *) : field_width(field->type));
            if (entry == NULL || PyDict_SetItemString(fields, field->name, entry) < 0) {
                Py_XDECREF(entry);
                Py_DECREF(result);
                return NULL;
            }
            Py_DECREF(entry);
        }
    }
    return result;
}

static PyObject *known_releases(PyObject *module, PyObject *unused) {
    PyObject *result = PyList_New(0);
    if (result == NULL) return NULL;
    for (size_t i = 0; i < KNOWN_RELEASE_COUNT; i++) {
        const release_sizes *r = &KNOWN_RELEASES[i];
        PyObject *entry = Py_BuildValue("{s:s,s:I,s:I,s:{s:H,s:H,s:H,s:H}}", "release", r->release, "first_version",
                                        r->first_version, "last_version", r->last_version, "sizes", "kernel",
                                        r->kernel, "memcpy", r->memcpy, "memset", r->memset, "sync", r->sync);
        if (entry == NULL || PyList_Append(result, entry) < 0) {
            Py_XDECREF(entry);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(entry);
    }
    return result;
}

static PyObject *pool_stats(PyObject *module, PyObject *unused) {
    pthread_mutex_lock(&POOL.lock);
    size_t allocated = POOL.allocated, free_count = POOL.free_count, queued = POOL.queued;
    pthread_mutex_unlock(&POOL.lock);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n}", "buffer_bytes", (Py_ssize_t)POOL.buffer_bytes, "max_buffers",
                         (Py_ssize_t)POOL.max_buffers, "allocated", (Py_ssize_t)allocated, "free",
                         (Py_ssize_t)free_count, "queued", (Py_ssize_t)queued);
}

static PyObject *count_drops(PyObject *module, PyObject *unused) {
    if (BINDING.handle != NULL) count_cupti_drops(NULL, 0);
    Py_RETURN_NONE;
}

static PyObject *trim(PyObject *module, PyObject *unused) {
    pool_trim();
    Py_RETURN_NONE;
}

static PyMethodDef activity_functions[] = {
    {"bind", bind, METH_VARARGS,
     "bind(path=None, major=0) -> dict: bind to the libcupti loaded in this process (where several are, the one "
     "of CUDA release `major`)."},
    {"bound", bound, METH_NOARGS, "bound() -> dict | None: the libcupti bound, if any."},
    {"register", register_callbacks, METH_VARARGS,
     "register(buffer_bytes, max_buffers, zeroing='written') -> bool: hand CUPTI xsp's buffer callbacks; True "
     "when CUPTI takes xsp's buffers as zeroed. zeroing: how a buffer read is zeroed again ('written': the pages "
     "of its records cleared and the rest given back to the kernel; 'whole': all of it cleared)."},
    {"use_host_clock", use_host_clock, METH_NOARGS,
     "use_host_clock() -> bool: have CUPTI stamp records with xsp's host clock (CLOCK_MONOTONIC); False where "
     "the library cannot."},
    {"restore", restore, METH_NOARGS,
     "restore(): set back every process-wide CUPTI setting xsp changed (OSError naming what CUPTI refused)."},
    {"settings", settings, METH_NOARGS, "settings() -> dict: what xsp has changed of CUPTI's settings."},
    {"drain", drain, METH_NOARGS, "drain() -> dict: the records of every completed buffer, as columns."},
    {"push", push, METH_O, "push(external_id): push a CUSTOM0 external correlation id (failures counted)."},
    {"pop", pop, METH_NOARGS, "pop(): pop the CUSTOM0 external correlation id (failures counted)."},
    {"layouts", layouts, METH_NOARGS, "layouts() -> dict: {family: {field: (offset, format, bytes)}}."},
    {"known_releases", known_releases, METH_NOARGS, "known_releases() -> list: the CUPTI releases xsp reads."},
    {"pool_stats", pool_stats, METH_NOARGS, "pool_stats() -> dict: the buffer pool's sizes and counts."},
    {"trim", trim, METH_NOARGS, "trim(): free the pool's idle buffers."},
    {"count_drops", count_drops, METH_NOARGS,
     "count_drops(): count what CUPTI dropped since the last completed buffer (at the end)."},
    {"can_share", can_share, METH_NOARGS, "can_share() -> bool: the bound libcupti has 13.5's multi-subscriber calls."},
    {"share", share, METH_O, "share(handle | None): make every call for xsp's subscriber `handle` (None: stop)."},
    {"enable_kind", enable_kind, METH_VARARGS, "enable_kind(kind, on): cuptiActivityEnable_v2 / Disable_v2."},
    {"enable_api", enable_api, METH_VARARGS, "enable_api(kind, cbid, on): one API call's records on or off."},
    {"set_thread_id_type", set_thread_id_type, METH_O, "set_thread_id_type(type): the subscriber's thread ids."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef activity_module = {
    PyModuleDef_HEAD_INIT, "xsp.record._activity", "CUPTI activity records read in C, as packed columns.", -1,
    activity_functions,
};

PyMODINIT_FUNC PyInit__activity(void) {
    if (PyType_Ready(&ColumnType) < 0) return NULL;
    PyObject *module = PyModule_Create(&activity_module);
    if (module == NULL) return NULL;
    PyObject *capsule = PyCapsule_New((void *)&CORRELATION, XSP_CORRELATION_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(module, "correlation", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddObject(module, "Column", Py_NewRef((PyObject *)&ColumnType)) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
