/* The columns the Kineto scanner (scanner.c) fills: growable buffers, the Block that hands one
 * over to Python (numpy and Arrow read it without a copy), and text columns, plain or interned. */
#ifndef XSP_KINETO_COLUMNS_H
#define XSP_KINETO_COLUMNS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---- growable buffers and the Block that hands one over ---------------------------------- */

typedef struct {
    char *data;
    Py_ssize_t length, capacity;
} Growable;

/* Room for `extra` more bytes. Returns 0, -1 when out of memory. */
int growable_grow(Growable *g, Py_ssize_t extra);

static inline int put(Growable *g, const void *value, Py_ssize_t size) {
    if (growable_grow(g, size)) return -1;
    memcpy(g->data + g->length, value, (size_t)size);
    g->length += size;
    return 0;
}

static inline int put_i64(Growable *g, int64_t value) { return put(g, &value, 8); }
static inline int put_f64(Growable *g, double value) { return put(g, &value, 8); }

typedef struct {
    PyObject_HEAD
    char *data;
    Py_ssize_t length;
} Block;

extern PyTypeObject BlockType;

/* Hands the buffer over (g is left empty). */
PyObject *block_from(Growable *g);

/* ---- text columns -------------------------------------------------------------------------- */

/* A text column. Plain (attributes): every row's text, one after another, and offsets. Interned
 * (names, shapes, grids, blocks, which repeat from row to row): each distinct text once, and a
 * code a row (int32; -1 for null), found in a hash table; a 2M-event trace has a few thousand
 * names, which as a text a row took a hundred bytes a row. A row's text is written after the
 * distinct ones, then kept as a new one or taken back where it is known. */
typedef struct {
    Growable data, offsets;
    int interned, empty_is_null;
    Growable codes;
    int32_t *slots; /* code + 1 of the distinct text that hashed there; 0: free */
    Py_ssize_t capacity, distinct;
} TextColumn;

/* The row's text, written after the column's data, ends: kept (plain) or made a code (interned). */
int text_end_row(TextColumn *t);

/* Empties the column (its first offset written) for the next rows. */
int text_start(TextColumn *t);

#endif
