/* Kineto (Chrome trace) JSON read straight into columns, in pieces, without a Python object
 * per event.
 *
 * A `Scanner` is fed the inflated file piece by piece (`scan(data, final)`), and returns how
 * many bytes it consumed: it stops before an event (or top-level value) the piece cuts, which
 * the caller hands over again at the start of the next piece. Every complete event ("X") of a
 * known category becomes one row of typed columns (the time, the ids, the name, the arguments
 * as compact JSON and the typed fields xsp reads from them); thread names, top-level fields and the
 * counts of events left out are kept aside. The columns are handed over as `Block`s, buffers
 * numpy and Arrow read without a copy.
 *
 * What it does not read the way xsp.io.kineto's msgspec path does (a string where a number
 * belongs, escapes in keys, a kernel without a correlation id...) makes it go on checking only
 * the JSON grammar to the end of the file, and then raise `Unsupported`: the caller reads the
 * whole file with that path instead (this one is an accelerator, never a second opinion), but
 * only once the file is known to be JSON. Bytes that cannot be JSON, or a file that ends inside
 * its document, raise `Invalid` at once, wherever they are, holding no more of the file than
 * the piece that has them. An event's `args` nested more than J_MAX_DEPTH levels are dropped
 * (the event is read without them) and their place in the file kept (`dropped_args`), so that
 * the msgspec path, which could not read them, drops them too. The scan runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "columns.h"
#include "json.h"

#define MISSING INT64_MIN
#define MAX_CATEGORIES 64
#define MAX_ARGUMENTS 64 /* an event's args with more members are left to msgspec's reader */

/* ---- columns ------------------------------------------------------------------------------- */

enum {
    C_CATEGORY, C_TS, C_DUR, C_PID, C_TID, C_CORRELATION, C_CORRELATION_ABSENT, C_DEVICE, C_STREAM,
    C_REGISTERS, C_SHARED_MEMORY, C_BYTES, C_SEQUENCE, C_EXTERNAL, C_FIXED
};
static const char *fixed_names[C_FIXED] = {
    "category", "ts", "dur", "pid", "tid", "correlation", "correlation_absent", "device", "stream",
    "registers", "shared_memory", "bytes", "sequence", "external",
};
enum { T_NAME, T_ATTRIBUTES, T_INPUT_DIMS, T_GRID, T_BLOCK, T_TEXTS };
static const char *text_names[T_TEXTS] = {"name", "attributes", "input_dims", "grid", "block"};

/* ---- the scanner --------------------------------------------------------------------------- */

enum { S_START, S_TOP, S_EVENTS, S_DONE };
enum { E_FIRST, E_COMMA, E_ITEM };

typedef struct {
    PyObject_HEAD
    int state, expect, seen_events;
    int checking;          /* the grammar only, to the end: the file is msgspec's to read */
    int in_trace_events;   /* the array being read is traceEvents */
    Py_ssize_t base;       /* the offset in the file of the bytes scan() was given */
    const char *buffer;    /* those bytes, while scan() runs */
    Growable dropped;      /* (start, stop) int64 offsets of each `"args": ...` member dropped */
    int64_t last_dropped;  /* the start of the last one (an event read twice is counted once) */
    Growable fixed[C_FIXED];
    TextColumn texts[T_TEXTS];
    Py_ssize_t rows, missing_times, events;
    PyObject *top_fields, *thread_names, *ignored;
    int category_count;
    char *categories[MAX_CATEGORIES];
    size_t category_lengths[MAX_CATEGORIES];
    int linked[MAX_CATEGORIES];
    int on_device[MAX_CATEGORIES]; /* the category's events run on a device (kernels, copies...) */
    PyThreadState *released; /* set while the scan runs without the GIL */
} Scanner;

static PyObject *UnsupportedError, *InvalidError;

static int scanner_init(Scanner *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"categories", "linked", "device", NULL};
    PyObject *categories, *linked, *device;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO", keywords, &categories, &linked, &device)) return -1;
    PyObject *items = PySequence_Fast(categories, "categories must be a sequence of str");
    if (!items) return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    if (count > MAX_CATEGORIES) {
        Py_DECREF(items);
        PyErr_SetString(PyExc_ValueError, "too many categories");
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t length;
        const char *text = PyUnicode_AsUTF8AndSize(PySequence_Fast_GET_ITEM(items, i), &length);
        if (!text) {
            Py_DECREF(items);
            return -1;
        }
        self->categories[i] = malloc((size_t)length + 1);
        memcpy(self->categories[i], text, (size_t)length + 1);
        self->category_lengths[i] = (size_t)length;
        int contains = PySequence_Contains(linked, PySequence_Fast_GET_ITEM(items, i));
        if (contains < 0) {
            Py_DECREF(items);
            return -1;
        }
        self->linked[i] = contains;
        contains = PySequence_Contains(device, PySequence_Fast_GET_ITEM(items, i));
        if (contains < 0) {
            Py_DECREF(items);
            return -1;
        }
        self->on_device[i] = contains;
        self->category_count = (int)i + 1;
    }
    Py_DECREF(items);
    self->top_fields = PyList_New(0);
    self->thread_names = PyList_New(0);
    self->ignored = PyDict_New();
    self->last_dropped = -1;
    if (!self->top_fields || !self->thread_names || !self->ignored) return -1;
    for (int t = 0; t < T_TEXTS; t++) {
        self->texts[t].interned = t != T_ATTRIBUTES;
        self->texts[t].empty_is_null = t != T_NAME;
        if (text_start(&self->texts[t])) return PyErr_NoMemory(), -1;
    }
    return 0;
}

static void scanner_dealloc(Scanner *self) {
    for (int c = 0; c < C_FIXED; c++) free(self->fixed[c].data);
    free(self->dropped.data);
    for (int t = 0; t < T_TEXTS; t++) {
        free(self->texts[t].data.data);
        free(self->texts[t].offsets.data);
        free(self->texts[t].codes.data);
        free(self->texts[t].slots);
    }
    for (int i = 0; i < self->category_count; i++) free(self->categories[i]);
    Py_XDECREF(self->top_fields);
    Py_XDECREF(self->thread_names);
    Py_XDECREF(self->ignored);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The few things that need Python objects (a thread's name, a count of events left out) run
 * with the GIL taken back for a moment. */
static void hold_gil(Scanner *s) {
    if (s->released) PyEval_RestoreThread(s->released);
}
static void release_gil(Scanner *s) {
    if (s->released) s->released = PyEval_SaveThread();
}

/* A JSON string as a Python str (NULL with an error set). */
static PyObject *string_object(const JsonString *s) {
    Growable text = {0};
    if (unescape(s, &text)) {
        free(text.data);
        PyErr_SetString(UnsupportedError, "a string that is not UTF-16");
        return NULL;
    }
    PyObject *result = PyUnicode_DecodeUTF8(text.data ? text.data : "", text.length, NULL);
    free(text.data);
    return result;
}

/* Counts an event left out, under the first of `what`, `instead` (may be NULL) that is not
 * empty, else `otherwise`: its category, else its phase, else "unphased" (or "uncategorised"). */
static int count_ignored(Scanner *s, const JsonString *what, const JsonString *instead, const char *otherwise) {
    if (!what->length && instead) what = instead;
    hold_gil(s);
    PyObject *key = what->length ? string_object(what) : PyUnicode_FromString(otherwise);
    int status = -1;
    if (key) {
        PyObject *count = PyDict_GetItemWithError(s->ignored, key);
        long before = count ? PyLong_AsLong(count) : 0;
        PyObject *after = PyLong_FromLong(before + 1);
        if (after && !PyErr_Occurred()) status = PyDict_SetItem(s->ignored, key, after);
        Py_XDECREF(after);
        Py_DECREF(key);
    }
    release_gil(s);
    return status;
}

typedef struct {
    int has_ph, has_cat, has_name;
    JsonString ph, cat, name;
    JsonValue pid, tid, ts, dur, args;
} Event;

typedef struct {
    int64_t correlation, device, stream, registers, shared_memory, bytes, sequence, external;
    int correlation_absent;
    JsonValue grid, block, input_dims;
} Arguments;

static int category_of(Scanner *s, const JsonString *cat) {
    for (int i = 0; i < s->category_count; i++)
        if ((size_t)cat->length == s->category_lengths[i] && memcmp(cat->text, s->categories[i], (size_t)cat->length) == 0)
            return i;
    for (int i = 0; i < s->category_count; i++) { /* old traces write Kernel, Runtime... */
        if ((size_t)cat->length != s->category_lengths[i]) continue;
        int same = 1;
        for (Py_ssize_t k = 0; k < cat->length && same; k++) {
            unsigned char c = (unsigned char)cat->text[k];
            same = (c >= 'A' && c <= 'Z' ? c + 32 : c) == (unsigned char)s->categories[i][k];
        }
        if (same) return i;
    }
    return -1;
}

static int is_phase(const JsonString *ph, const char *code) {
    return !ph->escaped && ph->length == (Py_ssize_t)strlen(code) && memcmp(ph->text, code, (size_t)ph->length) == 0;
}

/* An integer argument as xsp.io.kineto's _int_column reads it; -1: leave the file to msgspec. */
static int int_argument(const JsonValue *v, int64_t *out) {
    switch (v->kind) {
    case V_INT:
        if (v->overflow) return -1;
        *out = v->integer;
        return 0;
    case V_NULL: *out = MISSING; return 0;
    case V_TRUE: *out = 1; return 0;
    case V_FALSE: *out = 0; return 0;
    case V_FLOAT:
        if (!isfinite(v->number) || fabs(v->number) >= 9.2e18) return -1;
        *out = v->number == floor(v->number) ? (int64_t)v->number : MISSING;
        return 0;
    default: return -1;
    }
}

/* Arguments a typed column holds exactly, left out of `attributes` (xsp.io.kineto_events.MOVED_ARGUMENTS
 * says the same): integers, and shapes, grids and blocks (arrays of no text, not empty), the latter
 * kinds only on a device's rows where their columns are only kept there. */
enum { MOVED_ANYWHERE, MOVED_ON_DEVICE };
enum { MOVED_INTEGER, MOVED_ARRAY };
typedef struct {
    const char *key;
    int where, kind;
} Moved;
static const Moved moved_arguments[] = {
    {"correlation", MOVED_ANYWHERE, MOVED_INTEGER},      {"External id", MOVED_ANYWHERE, MOVED_INTEGER},
    {"Sequence number", MOVED_ANYWHERE, MOVED_INTEGER},  {"Input Dims", MOVED_ANYWHERE, MOVED_ARRAY},
    {"registers per thread", MOVED_ON_DEVICE, MOVED_INTEGER}, {"shared memory", MOVED_ON_DEVICE, MOVED_INTEGER},
    {"bytes", MOVED_ON_DEVICE, MOVED_INTEGER},            {"grid", MOVED_ON_DEVICE, MOVED_ARRAY},
    {"block", MOVED_ON_DEVICE, MOVED_ARRAY},
};
enum { MOVED_COUNT = sizeof moved_arguments / sizeof moved_arguments[0] };

static int is_moved(const JsonString *key, const JsonValue *v, int on_device) {
    int i = 0;
    while (i < MOVED_COUNT && !j_key_is(key, moved_arguments[i].key, strlen(moved_arguments[i].key))) i++;
    if (i == MOVED_COUNT || (moved_arguments[i].where == MOVED_ON_DEVICE && !on_device)) return 0;
    if (moved_arguments[i].kind == MOVED_INTEGER) return v->kind == V_INT && !v->overflow && v->integer != MISSING;
    if (v->kind != V_ARRAY) return 0;
    int items = 0;
    for (const char *p = v->start + 1; p < v->stop - 1; p++) {
        if (*p == '"') return 0;
        items |= *p != ' ' && *p != '\n' && *p != '\r' && *p != '\t';
    }
    return items;
}

static int read_arguments(const JsonValue *args, Arguments *a) {
    a->correlation = a->device = a->stream = MISSING;
    a->registers = a->shared_memory = a->bytes = a->sequence = a->external = MISSING;
    a->correlation_absent = 1;
    a->grid.kind = a->block.kind = a->input_dims.kind = V_ABSENT;
    if (args->kind != V_OBJECT) return 0;
    JsonRange r = {.end = args->stop, .final = 1};
    const char *p = j_space(&r, args->start + 1);
    if (*p == '}') return 0;
    JsonString seen[MAX_ARGUMENTS];
    int members = 0;
    for (;;) {
        JsonString key;
        JsonValue v;
        if (!(p = j_member(&r, p, &key, &v, 2))) return -1;
        if (key.escaped || members == MAX_ARGUMENTS) return -1;
        /* a key twice: msgspec's reader says which one counts, and what is left of them */
        for (int k = 0; k < members; k++)
            if (seen[k].length == key.length && memcmp(seen[k].text, key.text, (size_t)key.length) == 0) return -1;
        seen[members++] = key;
        if (J_KEY_IS(&key, "correlation")) {
            if (v.kind == V_NULL) {
                a->correlation = MISSING;
                a->correlation_absent = 1;
            } else {
                if (int_argument(&v, &a->correlation)) return -1;
                a->correlation_absent = 0;
            }
        } else if (J_KEY_IS(&key, "device") || J_KEY_IS(&key, "stream")) {
            int64_t *target = key.text[0] == 'd' ? &a->device : &a->stream;
            if (v.kind == V_INT && !v.overflow) *target = v.integer;
            else if (v.kind == V_NULL) *target = MISSING;
            else return -1;
        } else if (J_KEY_IS(&key, "grid")) {
            a->grid = v;
        } else if (J_KEY_IS(&key, "block")) {
            a->block = v;
        } else if (J_KEY_IS(&key, "Input Dims")) {
            a->input_dims = v;
        } else if (J_KEY_IS(&key, "registers per thread")) {
            if (int_argument(&v, &a->registers)) return -1;
        } else if (J_KEY_IS(&key, "shared memory")) {
            if (int_argument(&v, &a->shared_memory)) return -1;
        } else if (J_KEY_IS(&key, "bytes")) {
            if (int_argument(&v, &a->bytes)) return -1;
        } else if (J_KEY_IS(&key, "Sequence number")) {
            if (int_argument(&v, &a->sequence)) return -1;
        } else if (J_KEY_IS(&key, "External id")) {
            if (int_argument(&v, &a->external)) return -1;
        }
        p = j_space(&r, p);
        if (*p == '}') return 0;
        p = j_space(&r, p + 1);
    }
}

/* Shapes, grids and blocks as compact text: JSON's white space dropped, "[]" as no value. */
static int put_dims(TextColumn *t, const JsonValue *v) {
    if (v->kind != V_ABSENT) {
        Py_ssize_t start = t->data.length;
        if (growable_grow(&t->data, v->stop - v->start)) return -1;
        for (const char *p = v->start; p < v->stop; p++)
            if (*p != ' ' && *p != '\n' && *p != '\r' && *p != '\t') t->data.data[t->data.length++] = *p;
        if (t->data.length - start == 2 && memcmp(t->data.data + start, "[]", 2) == 0) t->data.length = start;
    }
    return text_end_row(t);
}

/* A JSON value (already checked) without the white space between its tokens. */
static int put_compact(Growable *g, const JsonValue *v) {
    if (growable_grow(g, v->stop - v->start)) return -1;
    char *w = g->data + g->length;
    int in_string = 0;
    for (const char *p = v->start; p < v->stop; p++) {
        char c = *p;
        if (in_string) {
            *w++ = c;
            if (c == '\\') *w++ = *++p;
            else if (c == '"') in_string = 0;
        } else if (c != ' ' && c != '\n' && c != '\r' && c != '\t') {
            *w++ = c;
            in_string = c == '"';
        }
    }
    g->length = w - g->data;
    return 0;
}

/* The arguments no typed column holds, as compact JSON (see put_compact); nothing when none is left. */
static int put_arguments(Growable *g, const JsonValue *args, int on_device) {
    JsonRange r = {.end = args->stop, .final = 1};
    const char *p = j_space(&r, args->start + 1);
    if (*p == '}') return put(g, "{}", 2);
    Py_ssize_t start = g->length;
    int kept = 0;
    for (;;) {
        JsonString key;
        JsonValue v;
        const char *member = p;
        if (!(p = j_member(&r, p, &key, &v, 2))) return -1;
        if (!is_moved(&key, &v, on_device)) {
            if (put(g, kept ? "," : "{", 1)) return -1;
            JsonValue whole = {.start = member, .stop = p};
            if (put_compact(g, &whole)) return -1;
            kept = 1;
        }
        p = j_space(&r, p);
        if (*p == '}') break;
        p = j_space(&r, p + 1);
    }
    if (kept) return put(g, "}", 1);
    g->length = start;
    return 0;
}

static int add_row(Scanner *s, int category, const Event *e, const Arguments *a) {
    int failed = 0;
    int64_t pid = e->pid.integer, tid = e->tid.integer;
    int8_t code = (int8_t)category;
    failed |= put(&s->fixed[C_CATEGORY], &code, 1);
    failed |= put_f64(&s->fixed[C_TS], e->ts.number);
    failed |= put_f64(&s->fixed[C_DUR], e->dur.number);
    failed |= put_i64(&s->fixed[C_PID], pid);
    failed |= put_i64(&s->fixed[C_TID], tid);
    failed |= put_i64(&s->fixed[C_CORRELATION], a->correlation);
    int8_t absent = (int8_t)a->correlation_absent;
    failed |= put(&s->fixed[C_CORRELATION_ABSENT], &absent, 1);
    failed |= put_i64(&s->fixed[C_DEVICE], a->device == MISSING ? pid : a->device);
    failed |= put_i64(&s->fixed[C_STREAM], a->stream == MISSING ? tid : a->stream);
    failed |= put_i64(&s->fixed[C_REGISTERS], a->registers);
    failed |= put_i64(&s->fixed[C_SHARED_MEMORY], a->shared_memory);
    failed |= put_i64(&s->fixed[C_BYTES], a->bytes);
    failed |= put_i64(&s->fixed[C_SEQUENCE], a->sequence);
    failed |= put_i64(&s->fixed[C_EXTERNAL], a->external);
    if (failed) return -1;
    TextColumn *name = &s->texts[T_NAME];
    if (e->has_name) {
        Py_ssize_t before = name->data.length;
        if (unescape(&e->name, &name->data)) {
            name->data.length = before;
            return -2;
        }
    }
    if (text_end_row(name)) return -1;
    TextColumn *attributes = &s->texts[T_ATTRIBUTES];
    if (e->args.kind == V_OBJECT && put_arguments(&attributes->data, &e->args, s->on_device[category])) return -1;
    if (text_end_row(attributes)) return -1;
    if (put_dims(&s->texts[T_INPUT_DIMS], &a->input_dims) || put_dims(&s->texts[T_GRID], &a->grid) ||
        put_dims(&s->texts[T_BLOCK], &a->block))
        return -1;
    s->rows++;
    return 0;
}

/* The rows written so far are kept; a row cut short by a failure is taken back. */
static void take_back_row(Scanner *s) {
    Py_ssize_t rows = s->rows;
    for (int c = 0; c < C_FIXED; c++) {
        Py_ssize_t width = c == C_CATEGORY || c == C_CORRELATION_ABSENT ? 1 : 8;
        if (s->fixed[c].length > rows * width) s->fixed[c].length = rows * width;
    }
    for (int t = 0; t < T_TEXTS; t++) {
        TextColumn *text = &s->texts[t];
        if (text->interned) { /* the distinct texts it added are kept, unused */
            if (text->codes.length > rows * 4) text->codes.length = rows * 4;
            text->data.length = ((int64_t *)text->offsets.data)[text->distinct];
            continue;
        }
        if (text->offsets.length > (rows + 1) * 8) text->offsets.length = (rows + 1) * 8;
        text->data.length = ((int64_t *)text->offsets.data)[rows];
    }
}

static int thread_name(Scanner *s, const Event *e) {
    if (e->args.kind == V_ABSENT) return 0;
    if (e->args.kind != V_OBJECT) return -1;
    JsonRange r = {.end = e->args.stop, .final = 1};
    const char *p = j_space(&r, e->args.start + 1);
    JsonString name = {0};
    int found = 0;
    while (*p != '}') {
        JsonString key;
        JsonValue v;
        if (!(p = j_member(&r, p, &key, &v, 2))) return -1;
        if (key.escaped) return -1;
        if (J_KEY_IS(&key, "name")) {
            if (v.kind != V_STRING) return -1;
            name = v.string;
            found = 1;
        }
        p = j_space(&r, p);
        if (*p == ',') p = j_space(&r, p + 1);
    }
    if (!found || !name.length || e->tid.kind == V_ABSENT || e->tid.kind == V_NULL) return 0;
    if (e->tid.kind != V_INT || e->tid.overflow) return -1;
    hold_gil(s);
    int status = -1;
    PyObject *text = string_object(&name);
    if (text) {
        PyObject *pair = Py_BuildValue("(LN)", (long long)e->tid.integer, text);
        if (pair) {
            status = PyList_Append(s->thread_names, pair);
            Py_DECREF(pair);
        }
    }
    release_gil(s);
    return status;
}

/* Keeps where an event's `"args": ...` member nested too deeply lies (from its key to the end of
 * its value), once: an event is read again after a piece that cut it. */
static int drop_args(Scanner *s, const char *start, const char *stop) {
    int64_t range[2] = {(int64_t)(s->base + (start - s->buffer)), (int64_t)(s->base + (stop - s->buffer))};
    if (range[0] <= s->last_dropped) return 0;
    s->last_dropped = range[0];
    return put(&s->dropped, range, sizeof range);
}

/* A member (p at its key) of an event, its grammar checked; returns the position after it, with
 * *deep_args set to its start where it is `args` nested past J_MAX_DEPTH (left to the caller to
 * drop), NULL (r->status) where it cannot be read: a value nested that deep elsewhere is
 * msgspec's to read or refuse. */
static const char *event_member(Scanner *s, JsonRange *r, const char *p, JsonString *key, JsonValue *v,
                                const char **deep_args) {
    const char *start = p;
    r->deep = 0;
    if (!(p = j_member(r, p, key, v, 1))) return NULL;
    if (!r->deep) return p;
    r->deep = 0;
    if (!s->in_trace_events || !J_KEY_IS(key, "args")) return s->checking ? p : j_fail(r, J_UNSUPPORTED);
    *deep_args = start;
    v->kind = V_ABSENT;
    return p;
}

/* Checks the grammar of one item of a top-level array (p at its first byte), as read_event reads
 * an event, noting arguments nested too deeply; returns the position after it, or NULL. */
static const char *check_item(Scanner *s, JsonRange *r, const char *p) {
    JsonValue v;
    if (*p != '{') return j_value(r, p, &v, 1);
    const char *deep_args = NULL, *deep_stop = NULL;
    p = j_space(r, p + 1);
    if (p >= r->end) return j_need(r);
    if (*p == '}') return p + 1;
    for (;;) {
        JsonString key;
        const char *member = deep_args;
        if (!(p = event_member(s, r, p, &key, &v, &deep_args))) return NULL;
        if (deep_args != member) deep_stop = p;
        p = j_space(r, p);
        if (p >= r->end) return j_need(r);
        if (*p == '}') break;
        if (*p != ',') return j_invalid(r, p);
        p = j_space(r, p + 1);
        if (p >= r->end) return j_need(r);
    }
    if (deep_args && drop_args(s, deep_args, deep_stop)) return j_fail(r, J_UNSUPPORTED);
    return p + 1;
}

/* Reads one event (p at its '{'); returns the position after it, or NULL (r->status). */
static const char *read_event(Scanner *s, JsonRange *r, const char *p) {
    Event e;
    memset(&e, 0, sizeof e);
    const char *deep_args = NULL, *deep_stop = NULL;
    p = j_space(r, p + 1);
    if (p >= r->end) return j_need(r);
    if (*p == '}') return j_fail(r, J_UNSUPPORTED); /* no phase */
    for (;;) {
        JsonString key;
        JsonValue v;
        const char *member = deep_args;
        if (!(p = event_member(s, r, p, &key, &v, &deep_args))) return NULL;
        if (deep_args != member) deep_stop = p;
        if (key.escaped) return j_fail(r, J_UNSUPPORTED);
        if (J_KEY_IS(&key, "ph") || J_KEY_IS(&key, "cat") || J_KEY_IS(&key, "name")) {
            if (v.kind != V_STRING) return j_fail(r, J_UNSUPPORTED);
            if (key.text[0] == 'p') e.ph = v.string, e.has_ph = 1;
            else if (key.text[0] == 'c') e.cat = v.string, e.has_cat = 1;
            else e.name = v.string, e.has_name = 1;
        } else if (J_KEY_IS(&key, "pid")) {
            e.pid = v;
        } else if (J_KEY_IS(&key, "tid")) {
            e.tid = v;
        } else if (J_KEY_IS(&key, "ts")) {
            e.ts = v;
        } else if (J_KEY_IS(&key, "dur")) {
            e.dur = v;
        } else if (J_KEY_IS(&key, "args")) {
            e.args = v;
        }
        p = j_space(r, p);
        if (p >= r->end) return j_need(r);
        if (*p == '}') {
            p++;
            break;
        }
        if (*p != ',') return j_invalid(r, p);
        p = j_space(r, p + 1);
        if (p >= r->end) return j_need(r);
    }
    /* the event is whole: from here on nothing needs more bytes */
    if (deep_args && drop_args(s, deep_args, deep_stop)) return j_fail(r, J_UNSUPPORTED);
    const JsonValue *times[2] = {&e.ts, &e.dur};
    for (int i = 0; i < 2; i++) {
        int kind = times[i]->kind;
        if (kind != V_ABSENT && kind != V_NULL && kind != V_INT && kind != V_FLOAT) return j_fail(r, J_UNSUPPORTED);
        if (kind == V_INT && times[i]->overflow) return j_fail(r, J_UNSUPPORTED);
    }
    if (!e.has_ph || e.ph.escaped || e.cat.escaped) return j_fail(r, J_UNSUPPORTED);
    s->events++;
    if (is_phase(&e.ph, "X")) {
        int category = category_of(s, &e.cat);
        if (category < 0) {
            for (Py_ssize_t k = 0; k < e.cat.length; k++)
                if ((unsigned char)e.cat.text[k] >= 0x80) return j_fail(r, J_UNSUPPORTED); /* str.lower() of Unicode */
            return count_ignored(s, &e.cat, NULL, "uncategorised") ? j_fail(r, J_UNSUPPORTED) : p;
        }
        if (e.pid.kind != V_INT || e.pid.overflow || e.tid.kind != V_INT || e.tid.overflow)
            return j_fail(r, J_UNSUPPORTED);
        if (e.args.kind != V_ABSENT && e.args.kind != V_OBJECT) return j_fail(r, J_UNSUPPORTED);
        if (e.ts.kind == V_ABSENT || e.ts.kind == V_NULL || e.dur.kind == V_ABSENT || e.dur.kind == V_NULL) {
            s->missing_times++;
            return p;
        }
        Arguments a;
        if (read_arguments(&e.args, &a)) return j_fail(r, J_UNSUPPORTED);
        if (s->linked[category] && a.correlation_absent) return j_fail(r, J_UNSUPPORTED); /* flows, in msgspec's path */
        int added = add_row(s, category, &e, &a);
        if (added) {
            take_back_row(s);
            return j_fail(r, J_UNSUPPORTED);
        }
        return p;
    }
    if (is_phase(&e.ph, "M")) {
        if (e.name.escaped) return j_fail(r, J_UNSUPPORTED);
        if (e.name.length == 11 && memcmp(e.name.text, "thread_name", 11) == 0) {
            if (thread_name(s, &e)) return j_fail(r, J_UNSUPPORTED);
        } else if (e.args.kind != V_ABSENT && e.args.kind != V_OBJECT) {
            return j_fail(r, J_UNSUPPORTED);
        }
        return p;
    }
    if (is_phase(&e.ph, "s") || is_phase(&e.ph, "f") || is_phase(&e.ph, "t")) return p;
    return count_ignored(s, &e.cat, &e.ph, "unphased") ? j_fail(r, J_UNSUPPORTED) : p;
}

static int top_field(Scanner *s, const JsonString *key, const JsonValue *v) {
    hold_gil(s);
    PyObject *pair = Py_BuildValue("(y#y#)", key->text, key->length, v->start, (Py_ssize_t)(v->stop - v->start));
    int status = pair ? PyList_Append(s->top_fields, pair) : -1;
    Py_XDECREF(pair);
    release_gil(s);
    return status;
}

/* A top-level member (p at its key). traceEvents is read event by event (the state says so, and
 * the position after its '[' is returned); when checking, so is any other array. */
static const char *top_member(Scanner *s, JsonRange *r, const char *p) {
    JsonString key;
    JsonValue v;
    const char *q = j_member_key(r, p, &key);
    if (!q) return NULL;
    int events = J_KEY_IS(&key, "traceEvents");
    if (s->checking) {
        if (*q == '[') { /* an array of any length is read item by item: no more than an item is held */
            s->state = S_EVENTS;
            s->expect = E_FIRST;
            s->in_trace_events = events;
            return q + 1;
        }
        return j_value(r, q, &v, 1);
    }
    if (key.escaped) return j_fail(r, J_UNSUPPORTED);
    if (events) {
        if (*q != '[' || s->seen_events) return j_fail(r, J_UNSUPPORTED);
        s->seen_events = 1;
        s->state = S_EVENTS;
        s->expect = E_FIRST;
        s->in_trace_events = 1;
        return q + 1;
    }
    r->deep = 0;
    if (!(q = j_value(r, q, &v, 1))) return NULL;
    if (r->deep || top_field(s, &key, &v)) return j_fail(r, J_UNSUPPORTED);
    return q;
}

/* One step of the document (p at a byte that is not white space): a brace or bracket, a comma,
 * an event or a top-level member. Returns the position after it, or NULL (r->status). */
static const char *step(Scanner *s, JsonRange *r, const char *p) {
    if (s->state == S_START) {
        if (*p == '\xef') return j_invalid(r, p); /* a byte-order mark, which msgspec refuses too */
        if (*p != '{') return j_fail(r, J_UNSUPPORTED); /* not a trace: the caller says so */
        s->state = S_TOP;
        s->expect = E_FIRST;
        return p + 1;
    }
    if (s->state == S_DONE) return j_invalid(r, p); /* after the document */
    int events = s->state == S_EVENTS;
    if (s->expect != E_ITEM && *p == (events ? ']' : '}')) {
        s->state = events ? S_TOP : S_DONE;
        s->expect = E_COMMA;
        s->in_trace_events = 0;
        return p + 1;
    }
    if (s->expect == E_COMMA) {
        if (*p != ',') return j_invalid(r, p);
        s->expect = E_ITEM;
        return p + 1;
    }
    const char *q;
    if (!events) {
        q = top_member(s, r, p);
        if (q && s->state == S_EVENTS) return q; /* into an array */
    } else if (s->checking) {
        q = check_item(s, r, p);
    } else {
        q = *p == '{' ? read_event(s, r, p) : j_fail(r, J_UNSUPPORTED);
    }
    if (q) s->expect = E_COMMA;
    return q;
}

/* The scan proper; returns the offset consumed, or -1 (r->status says why). What this scanner
 * does not read it goes on checking, from the start of the event or member it could not read. */
static Py_ssize_t run(Scanner *s, JsonRange *r, const char *start) {
    const char *p = start, *done = start;
    s->buffer = start;
    r->lenient = s->checking;
    for (;;) {
        p = j_space(r, p);
        if (p >= r->end) break;
        const char *q = step(s, r, p);
        if (q) {
            done = p = q;
            continue;
        }
        if (r->status == J_NEED) return done - start;
        if (r->status != J_UNSUPPORTED || s->checking || s->state == S_START) return -1;
        s->checking = r->lenient = 1;
        r->status = J_OK;
        p = done;
    }
    if (r->final) {
        if (s->state != S_DONE) {
            r->at = r->end;
            return r->status = s->state == S_START ? J_UNSUPPORTED : J_TRUNCATED, -1;
        }
        if (s->checking || !s->seen_events) return r->status = J_UNSUPPORTED, -1;
    }
    return done - start;
}

static PyObject *scanner_scan(Scanner *self, PyObject *args) {
    Py_buffer view;
    int final;
    if (!PyArg_ParseTuple(args, "y*p", &view, &final)) return NULL;
    JsonRange r = {.end = (const char *)view.buf + view.len, .final = final};
    self->released = PyEval_SaveThread();
    Py_ssize_t consumed = run(self, &r, (const char *)view.buf);
    PyEval_RestoreThread(self->released);
    self->released = NULL;
    self->buffer = NULL;
    Py_ssize_t at = self->base + (r.at ? r.at - (const char *)view.buf : 0);
    PyBuffer_Release(&view);
    if (consumed >= 0 && !PyErr_Occurred()) {
        self->base += consumed;
        return PyLong_FromSsize_t(consumed);
    }
    if (!PyErr_Occurred() && r.status == J_INVALID) {
        PyErr_Format(InvalidError, "is not valid Kineto JSON: invalid character (byte %zd)", at);
    } else if (!PyErr_Occurred() && r.status == J_TRUNCATED) {
        PyErr_Format(InvalidError, "is truncated Kineto JSON: its text ends (byte %zd) inside the document", at);
    } else if (!PyErr_Occurred() && r.status == J_TOO_DEEP) {
        PyErr_Format(InvalidError, "is not a plausible Kineto trace: its JSON is nested too deeply to read "
                     "(byte %zd)", at);
    } else {
        if (!PyErr_Occurred()) PyErr_SetString(UnsupportedError, "left to the msgspec reader");
        else {
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            PyErr_SetObject(UnsupportedError, value ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
        }
    }
    return NULL;
}

static PyObject *scanner_columns(Scanner *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *result = PyDict_New();
    if (!result) return NULL;
    for (int c = 0; c < C_FIXED; c++) {
        PyObject *block = block_from(&self->fixed[c]);
        if (!block || PyDict_SetItemString(result, fixed_names[c], block)) goto error;
        Py_DECREF(block);
    }
    for (int t = 0; t < T_TEXTS; t++) {
        char key[64];
        snprintf(key, sizeof key, "%s.data", text_names[t]);
        PyObject *block = block_from(&self->texts[t].data);
        if (!block || PyDict_SetItemString(result, key, block)) goto error;
        Py_DECREF(block);
        snprintf(key, sizeof key, "%s.offsets", text_names[t]);
        block = block_from(&self->texts[t].offsets);
        if (!block || PyDict_SetItemString(result, key, block)) goto error;
        Py_DECREF(block);
        if (self->texts[t].interned) {
            snprintf(key, sizeof key, "%s.codes", text_names[t]);
            block = block_from(&self->texts[t].codes);
            if (!block || PyDict_SetItemString(result, key, block)) goto error;
            Py_DECREF(block);
        }
        if (text_start(&self->texts[t])) goto error; /* the scanner stays usable, with no rows */
    }
    self->rows = 0;
    return result;
error:
    Py_DECREF(result);
    return NULL;
}

static PyObject *scanner_get(Scanner *self, void *which) {
    switch ((intptr_t)which) {
    case 0: return PyLong_FromSsize_t(self->rows);
    case 1: return PyLong_FromSsize_t(self->missing_times);
    case 2: return Py_NewRef(self->top_fields);
    case 3: return Py_NewRef(self->thread_names);
    case 4: return Py_NewRef(self->ignored);
    case 5: return PyLong_FromSsize_t(self->events);
    case 7: {
        Py_ssize_t count = self->dropped.length / 16;
        PyObject *list = PyList_New(count);
        for (Py_ssize_t i = 0; list && i < count; i++) {
            const int64_t *range = (const int64_t *)self->dropped.data + 2 * i;
            PyObject *pair = Py_BuildValue("(LL)", (long long)range[0], (long long)range[1]);
            if (!pair) {
                Py_CLEAR(list);
                break;
            }
            PyList_SET_ITEM(list, i, pair);
        }
        return list;
    }
    default: return PyBool_FromLong(self->state == S_DONE);
    }
}

static PyGetSetDef scanner_getset[] = {
    {"rows", (getter)scanner_get, NULL, "Rows (complete events of a known category) read so far.", (void *)0},
    {"missing_times", (getter)scanner_get, NULL, "Complete events without a start or a duration.", (void *)1},
    {"top_fields", (getter)scanner_get, NULL, "(key, raw JSON value) of the file's other top-level fields.", (void *)2},
    {"thread_names", (getter)scanner_get, NULL, "(tid, name) of thread_name metadata events.", (void *)3},
    {"ignored", (getter)scanner_get, NULL, "Events left out by design: category (or phase) -> count.", (void *)4},
    {"events", (getter)scanner_get, NULL, "Events read, of any phase.", (void *)5},
    {"finished", (getter)scanner_get, NULL, "Whether the whole JSON document was read.", (void *)6},
    {"dropped_args", (getter)scanner_get, NULL,
     "(start, stop) offsets of each `\"args\": ...` member of an event nested too deeply, dropped.", (void *)7},
    {NULL},
};

static PyMethodDef scanner_methods[] = {
    {"scan", (PyCFunction)scanner_scan, METH_VARARGS,
     "scan(data, final) -> bytes consumed: the events whole in data become rows."},
    {"columns", (PyCFunction)scanner_columns, METH_NOARGS,
     "The columns read so far, name -> Block; the scanner keeps none of them."},
    {NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "xsp.io._kineto.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_dealloc = (destructor)scanner_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reads Kineto JSON, piece by piece, into columns.",
    .tp_methods = scanner_methods,
    .tp_getset = scanner_getset,
    .tp_init = (initproc)scanner_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef kineto_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kineto",
    .m_doc = "Kineto JSON read into columns, in C.", .m_size = -1,
};

PyMODINIT_FUNC PyInit__kineto(void) {
    if (PyType_Ready(&BlockType) < 0 || PyType_Ready(&ScannerType) < 0) return NULL;
    PyObject *module = PyModule_Create(&kineto_module);
    if (!module) return NULL;
    UnsupportedError = PyErr_NewException("xsp.io._kineto.Unsupported", PyExc_ValueError, NULL);
    InvalidError = PyErr_NewException("xsp.io._kineto.Invalid", PyExc_ValueError, NULL);
    if (!UnsupportedError || !InvalidError || PyModule_AddObjectRef(module, "Unsupported", UnsupportedError) < 0 ||
        PyModule_AddObjectRef(module, "Invalid", InvalidError) < 0 ||
        PyModule_AddIntConstant(module, "MAX_DEPTH", J_MAX_DEPTH) < 0 ||
        PyModule_AddObjectRef(module, "Scanner", (PyObject *)&ScannerType) < 0 ||
        PyModule_AddObjectRef(module, "Block", (PyObject *)&BlockType) < 0) {
        Py_XDECREF(module);
        return NULL;
    }
    return module;
}
