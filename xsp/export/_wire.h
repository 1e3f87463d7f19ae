/* Protobuf's wire format, the little of it xsp's encoders write by hand (_protobuf.c: OTLP spans;
 * _perfetto.c: Perfetto's TrackEvents): a growing byte buffer and varints; and the check that a
 * column handed over holds its rows. Included after Python.h. */
#ifndef XSP_EXPORT_WIRE_H
#define XSP_EXPORT_WIRE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    char *data;
    size_t length, capacity;
} Buffer;

static inline size_t varint_size(uint64_t value) {
    size_t size = 1;
    while (value >= 0x80) {
        value >>= 7;
        size++;
    }
    return size;
}

/* the caller reserved room */
static inline void put_varint(Buffer *b, uint64_t value) {
    while (value >= 0x80) {
        b->data[b->length++] = (char)((value & 0x7F) | 0x80);
        value >>= 7;
    }
    b->data[b->length++] = (char)value;
}

/* that `view` holds `count` items of `item` bytes; else a ValueError, -1 */
static int check(Py_buffer *view, Py_ssize_t item, Py_ssize_t count, const char *what) {
    if (view->len < item * count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, %zd wanted", what, view->len, item * count);
        return -1;
    }
    return 0;
}

#endif
