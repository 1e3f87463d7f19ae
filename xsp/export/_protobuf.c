/* OTLP spans encoded as protobuf straight from the span table's columns (xsp/export/encoding.py):
 * the bytes of ScopeSpans.spans entries (opentelemetry/proto/trace/v1/trace.proto), one per row
 * asked for, with no SDK span or protobuf object in between.
 *
 * What repeats is made once in Python and handed over as bytes: a name's UTF-8, a string
 * attribute's AnyValue, a row's attributes kept as JSON (already KeyValue entries), the session
 * link. Each span is written into a scratch buffer and then copied behind its tag and length. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_wire.h"

enum { TYPE_INT = 1, TYPE_STRING = 2 };

static int reserve(Buffer *buffer, size_t more) {
    if (buffer->length + more <= buffer->capacity) return 0;
    size_t capacity = buffer->capacity ? buffer->capacity : 4096;
    while (capacity < buffer->length + more) capacity *= 2;
    char *grown = PyMem_Realloc(buffer->data, capacity);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    buffer->data = grown;
    buffer->capacity = capacity;
    return 0;
}

static inline void put_bytes(Buffer *b, const char *bytes, size_t size) {
    memcpy(b->data + b->length, bytes, size);
    b->length += size;
}

static inline void put_fixed64(Buffer *b, uint64_t value) {
    for (int i = 0; i < 8; i++) b->data[b->length++] = (char)(value >> (8 * i));
}

static inline void put_fixed32(Buffer *b, uint32_t value) {
    for (int i = 0; i < 4; i++) b->data[b->length++] = (char)(value >> (8 * i));
}

/* field tag + length + bytes */
static int put_field(Buffer *b, uint8_t tag, const char *bytes, size_t size) {
    if (reserve(b, 1 + 10 + size) < 0) return -1;
    b->data[b->length++] = (char)tag;
    put_varint(b, size);
    put_bytes(b, bytes, size);
    return 0;
}

typedef struct {
    const char *key;  /* the KeyValue's key field, whole (0x0a, length, key) */
    Py_ssize_t key_size;
    int type;
    Py_buffer values;  /* int64 (TYPE_INT) or int32 codes into table (TYPE_STRING) */
    Py_buffer present; /* uint8 */
    PyObject *table;   /* TYPE_STRING: list of bytes, each a whole AnyValue */
} Column;

static int bytes_at(PyObject *list, Py_ssize_t index, const char **bytes, Py_ssize_t *size) {
    if (index < 0 || index >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_IndexError, "a code outside its table");
        return -1;
    }
    PyObject *item = PyList_GET_ITEM(list, index);
    if (!PyBytes_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "tables hold bytes");
        return -1;
    }
    *bytes = PyBytes_AS_STRING(item);
    *size = PyBytes_GET_SIZE(item);
    return 0;
}

/* One KeyValue of a column's row, as attributes field 9 of the span. */
static int put_attribute(Buffer *span, const Column *column, Py_ssize_t row) {
    char value[16];
    size_t value_size;
    const char *any = value;
    if (column->type == TYPE_INT) {
        uint64_t number = (uint64_t)((const int64_t *)column->values.buf)[row];
        Buffer scratch = {value, 0, sizeof value};
        scratch.data[scratch.length++] = 0x18; /* AnyValue.int_value, varint */
        put_varint(&scratch, number);
        value_size = scratch.length;
    } else {
        Py_ssize_t size;
        if (bytes_at(column->table, ((const int32_t *)column->values.buf)[row], &any, &size) < 0) return -1;
        value_size = (size_t)size;
    }
    size_t key_value = (size_t)column->key_size + 1 + varint_size(value_size) + value_size;
    if (reserve(span, 1 + 10 + key_value) < 0) return -1;
    span->data[span->length++] = 0x4a; /* Span.attributes */
    put_varint(span, key_value);
    put_bytes(span, column->key, (size_t)column->key_size);
    span->data[span->length++] = 0x12; /* KeyValue.value */
    put_varint(span, value_size);
    put_bytes(span, any, value_size);
    return 0;
}

/* encode_spans(rows, trace_ids, span_ids, parent_ids, has_parent, name_codes, names, start_ns, end_ns,
 *              status_codes, message_codes, messages, linked, link, columns, extra_codes, extras,
 *              flags) -> bytes */
static PyObject *encode_spans(PyObject *module, PyObject *args) {
    Py_buffer rows, trace_ids, span_ids, parent_ids, has_parent, name_codes, start_ns, end_ns, status_codes,
        message_codes, linked, link, extra_codes;
    PyObject *names, *messages, *columns_list, *extras;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*O!y*y*y*y*O!y*y*O!y*O!I", &rows, &trace_ids, &span_ids, &parent_ids,
                          &has_parent, &name_codes, &PyList_Type, &names, &start_ns, &end_ns, &status_codes,
                          &message_codes, &PyList_Type, &messages, &linked, &link, &PyList_Type, &columns_list,
                          &extra_codes, &PyList_Type, &extras, &flags))
        return NULL;
    Py_buffer *views[] = {&rows, &trace_ids, &span_ids, &parent_ids, &has_parent, &name_codes, &start_ns, &end_ns,
                          &status_codes, &message_codes, &linked, &link, &extra_codes};
    const size_t view_count = sizeof views / sizeof views[0];
    Py_ssize_t column_count = PyList_GET_SIZE(columns_list);
    Column *columns = PyMem_Calloc((size_t)column_count + 1, sizeof(Column));
    Buffer out = {NULL, 0, 0}, span = {NULL, 0, 0};
    PyObject *result = NULL;
    Py_ssize_t opened = 0;
    if (columns == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t table_rows = start_ns.len / 8;
    if (check(&trace_ids, 16, table_rows, "trace_ids") < 0 || check(&span_ids, 8, table_rows, "span_ids") < 0
        || check(&parent_ids, 8, table_rows, "parent_ids") < 0 || check(&has_parent, 1, table_rows, "has_parent") < 0
        || check(&name_codes, 4, table_rows, "name_codes") < 0 || check(&end_ns, 8, table_rows, "end_ns") < 0
        || check(&status_codes, 1, table_rows, "status_codes") < 0
        || check(&message_codes, 4, table_rows, "message_codes") < 0 || check(&linked, 1, table_rows, "linked") < 0
        || check(&extra_codes, 4, table_rows, "extra_codes") < 0)
        goto done;
    while (opened < column_count) {
        Column *column = &columns[opened];
        PyObject *item = PyList_GET_ITEM(columns_list, opened);
        PyObject *key;
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "O!iy*y*O", &PyBytes_Type, &key, &column->type,
                                                      &column->values, &column->present, &column->table))
            goto done;
        opened++; /* its buffers are released at the end from here on */
        column->key = PyBytes_AS_STRING(key);
        column->key_size = PyBytes_GET_SIZE(key);
        Py_ssize_t item_size = column->type == TYPE_INT ? 8 : 4;
        if (check(&column->values, item_size, table_rows, "column values") < 0
            || check(&column->present, 1, table_rows, "column present") < 0)
            goto done;
        if (column->type == TYPE_STRING && !PyList_Check(column->table)) {
            PyErr_SetString(PyExc_TypeError, "a string column needs its table (a list of bytes)");
            goto done;
        }
        if (column->type != TYPE_INT && column->type != TYPE_STRING) {
            PyErr_SetString(PyExc_ValueError, "column type: 1 (int) or 2 (string)");
            goto done;
        }
    }
    const int64_t *row_list = rows.buf;
    Py_ssize_t count = rows.len / 8;
    const char *trace = trace_ids.buf, *span_id = span_ids.buf, *parent = parent_ids.buf;
    const uint8_t *parented = has_parent.buf, *status = status_codes.buf, *links = linked.buf;
    const int32_t *name_code = name_codes.buf, *message_code = message_codes.buf, *extra_code = extra_codes.buf;
    const int64_t *starts = start_ns.buf, *ends = end_ns.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t row = row_list[i];
        if (row < 0 || row >= table_rows) {
            PyErr_SetString(PyExc_IndexError, "a row outside the table");
            goto done;
        }
        span.length = 0;
        const char *name;
        Py_ssize_t name_size;
        if (bytes_at(names, name_code[row], &name, &name_size) < 0) goto done;
        if (reserve(&span, 2 + 16 + 2 + 8 + 2 + 8 + 1 + 10 + (size_t)name_size + 2 + 9 + 9) < 0) goto done;
        span.data[span.length++] = 0x0a; /* trace_id */
        span.data[span.length++] = 16;
        put_bytes(&span, trace + 16 * row, 16);
        span.data[span.length++] = 0x12; /* span_id */
        span.data[span.length++] = 8;
        put_bytes(&span, span_id + 8 * row, 8);
        if (parented[row]) {
            span.data[span.length++] = 0x22; /* parent_span_id */
            span.data[span.length++] = 8;
            put_bytes(&span, parent + 8 * row, 8);
        }
        if (name_size) {
            span.data[span.length++] = 0x2a; /* name */
            put_varint(&span, (uint64_t)name_size);
            put_bytes(&span, name, (size_t)name_size);
        }
        span.data[span.length++] = 0x30; /* kind: SPAN_KIND_INTERNAL */
        span.data[span.length++] = 1;
        span.data[span.length++] = 0x39; /* start_time_unix_nano, fixed64 */
        put_fixed64(&span, (uint64_t)starts[row]);
        span.data[span.length++] = 0x41; /* end_time_unix_nano, fixed64 */
        put_fixed64(&span, (uint64_t)ends[row]);
        for (Py_ssize_t c = 0; c < column_count; c++) {
            if (((const uint8_t *)columns[c].present.buf)[row] && put_attribute(&span, &columns[c], row) < 0) goto done;
        }
        if (extra_code[row] >= 0) {
            const char *extra;
            Py_ssize_t extra_size;
            if (bytes_at(extras, extra_code[row], &extra, &extra_size) < 0) goto done;
            if (reserve(&span, (size_t)extra_size) < 0) goto done;
            put_bytes(&span, extra, (size_t)extra_size);
        }
        if (links[row]) {
            if (reserve(&span, (size_t)link.len) < 0) goto done;
            put_bytes(&span, link.buf, (size_t)link.len);
        }
        /* status (15): always there, as the SDK sends it: empty when unset, else its code and message */
        const char *message = NULL;
        Py_ssize_t message_size = 0;
        if (message_code[row] >= 0 && bytes_at(messages, message_code[row], &message, &message_size) < 0) goto done;
        size_t status_size = (message_size ? 1 + varint_size((uint64_t)message_size) + (size_t)message_size : 0)
                             + (status[row] ? 2 : 0);
        if (reserve(&span, 2 + 10 + status_size + 2 + 4) < 0) goto done;
        span.data[span.length++] = 0x7a;
        put_varint(&span, status_size);
        if (message_size) {
            span.data[span.length++] = 0x12; /* Status.message */
            put_varint(&span, (uint64_t)message_size);
            put_bytes(&span, message, (size_t)message_size);
        }
        if (status[row]) {
            span.data[span.length++] = 0x18; /* Status.code */
            span.data[span.length++] = (char)status[row];
        }
        span.data[span.length++] = (char)0x85; /* flags (16), fixed32: tag 0x85 0x01 */
        span.data[span.length++] = 0x01;
        put_fixed32(&span, flags);
        if (put_field(&out, 0x12, span.data, span.length) < 0) goto done; /* ScopeSpans.spans */
    }
    result = PyBytes_FromStringAndSize(out.data ? out.data : "", (Py_ssize_t)out.length);
done:
    for (size_t v = 0; v < view_count; v++) PyBuffer_Release(views[v]);
    for (Py_ssize_t c = 0; c < opened; c++) {
        PyBuffer_Release(&columns[c].values);
        PyBuffer_Release(&columns[c].present);
    }
    PyMem_Free(columns);
    PyMem_Free(out.data);
    PyMem_Free(span.data);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_spans", encode_spans, METH_VARARGS,
     "encode_spans(rows, trace_ids, span_ids, parent_ids, has_parent, name_codes, names, start_ns, end_ns, "
     "status_codes, message_codes, messages, linked, link, columns, extra_codes, extras, flags) -> bytes: the "
     "ScopeSpans.spans entries (tag, length, Span) of the table rows `rows`, in that order. See "
     "xsp/export/encoding.py for what each argument holds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "_protobuf", "OTLP spans encoded as protobuf from the span table's columns.", -1, methods,
};

PyMODINIT_FUNC PyInit__protobuf(void) { return PyModule_Create(&definition); }
