/* The columns the Kineto scanner fills (see columns.h). */
#include "columns.h"

int growable_grow(Growable *g, Py_ssize_t extra) {
    if (g->length + extra <= g->capacity) return 0;
    Py_ssize_t capacity = g->capacity ? g->capacity : 1 << 16;
    while (capacity < g->length + extra) capacity += capacity / 2;
    char *data = realloc(g->data, (size_t)capacity);
    if (!data) return -1;
    g->data = data;
    g->capacity = capacity;
    return 0;
}

static void block_dealloc(Block *self) {
    free(self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int block_getbuffer(Block *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->data, self->length, 0, flags);
}

static PyBufferProcs block_as_buffer = {.bf_getbuffer = (getbufferproc)block_getbuffer};

static Py_ssize_t block_length(Block *self) { return self->length; }
static PySequenceMethods block_as_sequence = {.sq_length = (lenfunc)block_length};

PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "xsp.io._kineto.Block",
    .tp_basicsize = sizeof(Block),
    .tp_dealloc = (destructor)block_dealloc,
    .tp_as_buffer = &block_as_buffer,
    .tp_as_sequence = &block_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A column's bytes, owned here and read through the buffer protocol.",
};

PyObject *block_from(Growable *g) {
    Block *block = PyObject_New(Block, &BlockType);
    if (!block) return NULL;
    block->data = g->data ? g->data : malloc(1);
    block->length = g->length;
    g->data = NULL;
    g->length = g->capacity = 0;
    if (!block->data) {
        Py_DECREF(block);
        return PyErr_NoMemory();
    }
    return (PyObject *)block;
}

/* Eight bytes a step (kernel names run to hundreds of bytes; byte by byte, the hashing of every
 * row's name was a quarter of the scan). */
static uint64_t text_hash(const char *text, Py_ssize_t length) {
    uint64_t hash = 1469598103934665603ULL ^ (uint64_t)length;
    Py_ssize_t i = 0;
    for (; i + 8 <= length; i += 8) {
        uint64_t word;
        memcpy(&word, text + i, 8);
        hash = (hash ^ word) * 0x9E3779B97F4A7C15ULL;
        hash ^= hash >> 29;
    }
    for (; i < length; i++) hash = (hash ^ (unsigned char)text[i]) * 1099511628211ULL;
    return hash ^ (hash >> 32);
}

static const char *distinct_text(const TextColumn *t, Py_ssize_t code, Py_ssize_t *length) {
    const int64_t *offsets = (const int64_t *)t->offsets.data;
    *length = (Py_ssize_t)(offsets[code + 1] - offsets[code]);
    return t->data.data + offsets[code];
}

static int rehash(TextColumn *t) {
    Py_ssize_t capacity = t->capacity ? t->capacity * 2 : 1024;
    int32_t *slots = calloc((size_t)capacity, sizeof(int32_t));
    if (!slots) return -1;
    for (Py_ssize_t code = 0; code < t->distinct; code++) {
        Py_ssize_t length;
        const char *text = distinct_text(t, code, &length);
        Py_ssize_t at = (Py_ssize_t)(text_hash(text, length) & (uint64_t)(capacity - 1));
        while (slots[at]) at = (at + 1) & (capacity - 1);
        slots[at] = (int32_t)(code + 1);
    }
    free(t->slots);
    t->slots = slots;
    t->capacity = capacity;
    return 0;
}

/* The row's text (written after the distinct ones) as a code. */
static int intern_row(TextColumn *t) {
    Py_ssize_t start = (Py_ssize_t)((const int64_t *)t->offsets.data)[t->distinct];
    const char *text = t->data.data + start;
    Py_ssize_t length = t->data.length - start;
    int32_t code = -1;
    if (length || !t->empty_is_null) {
        if (2 * (t->distinct + 1) > t->capacity && (t->distinct >= INT32_MAX - 1 || rehash(t))) return -1;
        Py_ssize_t at = (Py_ssize_t)(text_hash(text, length) & (uint64_t)(t->capacity - 1));
        for (;; at = (at + 1) & (t->capacity - 1)) {
            if (!t->slots[at]) {
                code = (int32_t)t->distinct++;
                t->slots[at] = code + 1;
                if (put_i64(&t->offsets, (int64_t)t->data.length)) return -1;
                break;
            }
            Py_ssize_t known_length;
            const char *known = distinct_text(t, t->slots[at] - 1, &known_length);
            if (known_length == length && memcmp(known, text, (size_t)length) == 0) {
                code = t->slots[at] - 1;
                t->data.length = start;
                break;
            }
        }
    } else {
        t->data.length = start;
    }
    return put(&t->codes, &code, sizeof code);
}

int text_end_row(TextColumn *t) {
    return t->interned ? intern_row(t) : put_i64(&t->offsets, (int64_t)t->data.length);
}

int text_start(TextColumn *t) {
    free(t->slots);
    t->slots = NULL;
    t->capacity = t->distinct = 0;
    t->data.length = t->offsets.length = t->codes.length = 0;
    return put_i64(&t->offsets, 0);
}

