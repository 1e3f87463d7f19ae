/* Packed rows: the buffers the wrapper appends int64 rows to, and their columns. (see hotpath.h) */
#include "hotpath.h"

/* The row count a packed buffer starts with (0 for one too short to hold it). */
int64_t packed_count_of(PyObject *packed) {
    int64_t count = 0;
    if (PyByteArray_GET_SIZE(packed) >= PACKED_HEADER) memcpy(&count, PyByteArray_AS_STRING(packed), sizeof(count));
    return count;
}

/* Whether `packed`, holding `count` rows of `row_bytes`, has room for `more` rows as it is. */
int packed_fits(PyObject *packed, int64_t count, Py_ssize_t row_bytes, Py_ssize_t more) {
    return PACKED_HEADER + ((Py_ssize_t)count + more) * row_bytes <= PyByteArray_GET_SIZE(packed);
}

/* Whether `packed`, holding `count` rows of `row_bytes`, has room for `more` rows, after growing
 * it up to `full_rows` rows where it is smaller: a thread's first buffer is one page
 * (FIRST_PACKED_ROWS), and growing it in place (a copy of that page) costs a hundredth of what
 * compacting its rows early would (~90,000 instructions, some 1,400 a row of a thread that makes
 * a hundred calls). A buffer that a view holds cannot grow: then 0, as for a full one. */
int packed_has_room(PyObject *packed, int64_t count, Py_ssize_t row_bytes, Py_ssize_t more,
                           Py_ssize_t full_rows) {
    if (count < 0) return 0;
    if (packed_fits(packed, count, row_bytes, more)) return 1;
    Py_ssize_t full = PACKED_HEADER + full_rows * row_bytes;
    if ((Py_ssize_t)count + more > full_rows) return 0;
    if (PyByteArray_Resize(packed, full) < 0) {
        PyErr_Clear();  /* exported (BufferError) or no memory: the rows go to the list */
        return 0;
    }
    return 1;
}

/* ThreadBuffer.packed_calls or packed_roots: a bytearray, an int64 count of the rows in it, then
 * room for its rows of `fields` int64s (grown up to `full_rows` rows as they come). Appends
 * `values` as the next row and returns the count after, or 0 when it is full (the row was not
 * added). */
Py_ssize_t append_packed_row(PyObject *packed, const int64_t *values, Py_ssize_t fields,
                                    Py_ssize_t full_rows) {
    Py_ssize_t row_bytes = fields * (Py_ssize_t)sizeof(int64_t);
    if (PyByteArray_GET_SIZE(packed) < PACKED_HEADER) return 0;
    int64_t count = packed_count_of(packed);
    if (!packed_has_room(packed, count, row_bytes, 1, full_rows)) return 0;
    char *bytes = PyByteArray_AS_STRING(packed);  /* after growing: it may have moved */
    memcpy(bytes + PACKED_HEADER + count * row_bytes, values, (size_t)row_bytes);
    count++;
    memcpy(bytes, &count, sizeof(count));
    return (Py_ssize_t)count;
}

/* Move the rows of `rows` (tuples of `fields` ints that the Python path appended to buffer.calls
 * or buffer.roots) into the packed buffer behind its `packed_count` rows, when they fit with a row
 * to spare: C packs a row only while the list is empty (the packed rows precede the list's), so
 * without this every record after one the Python path made (a model's first call, a call inside
 * xsp.step(), a decided step someone is told of) would be appended as a tuple until the thread's
 * next compaction. Anything else leaves both as they were. 0, or -1 on error. */
int move_rows_to_packed(PyObject *list, PyObject *packed, int64_t packed_count, Py_ssize_t fields,
                               Py_ssize_t full_rows) {
    Py_ssize_t rows = PyList_GET_SIZE(list), row_bytes = fields * (Py_ssize_t)sizeof(int64_t);
    if (!packed_has_room(packed, packed_count, row_bytes, rows + 1, full_rows)) return 0;
    char *into = PyByteArray_AS_STRING(packed) + PACKED_HEADER + packed_count * row_bytes;
    for (Py_ssize_t r = 0; r < rows; r++) {  /* the count is written last: a row left half-way is no row */
        PyObject *row = PyList_GET_ITEM(list, r);
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != fields) return 0;
        for (Py_ssize_t c = 0; c < fields; c++) {
            PyObject *item = PyTuple_GET_ITEM(row, c);
            int overflow;
            if (!PyLong_CheckExact(item)) return 0;
            int64_t value = (int64_t)PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow) return 0;
            memcpy(into + r * row_bytes + c * (Py_ssize_t)sizeof(int64_t), &value, sizeof(value));
        }
    }
    if (PyList_SetSlice(list, 0, rows, NULL) < 0) return -1;
    packed_count += rows;
    memcpy(PyByteArray_AS_STRING(packed), &packed_count, sizeof(packed_count));
    return 0;
}

/* Pack `values` (one row of `fields`) into `packed` behind the rows the Python path appended to
 * `list`, which move in first where they fit (move_rows_to_packed): the count after, 0 when the
 * row belongs in the list instead (rows are left there, or the buffer is full), -1 on error. */
Py_ssize_t pack_behind_list(PyObject *list, PyObject *packed, const int64_t *values, Py_ssize_t fields,
                                   Py_ssize_t full_rows) {
    if (PyList_GET_SIZE(list) > 0 && move_rows_to_packed(list, packed, packed_count_of(packed), fields, full_rows) < 0)
        return -1;
    return PyList_GET_SIZE(list) > 0 ? 0 : append_packed_row(packed, values, fields, full_rows);
}

/* The columns pack_columns and split_rows fill: a tuple of `count`-value bytes objects, column i
 * of itemsizes[i] bytes a value (1, 2, 4 or 8), with their sizes and data in `sizes` and `out`
 * (room for 16); NULL with an exception set for any other width or item size. */
PyObject *new_columns(PyObject *itemsizes, Py_ssize_t count, int *sizes, char **out) {
    Py_ssize_t width = PyTuple_GET_SIZE(itemsizes);
    if (width == 0 || width > 16) {
        PyErr_SetString(PyExc_ValueError, "1 to 16 columns");
        return NULL;
    }
    PyObject *columns = PyTuple_New(width);
    if (columns == NULL) return NULL;
    for (Py_ssize_t c = 0; c < width; c++) {
        long size = PyLong_AsLong(PyTuple_GET_ITEM(itemsizes, c));
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
    return columns;
}

/* Write `value` as value number `row` of a column of `size`-byte values; -1 with an
 * OverflowError set when it does not fit. */
int store_value(char *column, int size, Py_ssize_t row, long long value) {
    switch (size) {
    case 8: { int64_t v = (int64_t)value; memcpy(column + row * 8, &v, 8); return 0; }
    case 4: { int32_t v = (int32_t)value; if (v != value) break; memcpy(column + row * 4, &v, 4); return 0; }
    case 2: { int16_t v = (int16_t)value; if (v != value) break; memcpy(column + row * 2, &v, 2); return 0; }
    default: { int8_t v = (int8_t)value; if (v != value) break; column[row] = (char)v; return 0; }
    }
    PyErr_SetString(PyExc_OverflowError, "a value does not fit its column");
    return -1;
}

/* pack_columns(rows, itemsizes) -> tuple of bytes: column i of the rows (tuples that start with
 * len(itemsizes) ints; values after them are left alone), each value in itemsizes[i] bytes (1, 2, 4 or 8), native order, for array.frombytes. What
 * extend_columns does with struct.pack and strided copies, at a tenth of the cost. */
PyObject *pack_columns(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(argv[0]) || !PyTuple_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "pack_columns(rows: list[tuple[int, ...]], itemsizes: tuple[int, ...])");
        return NULL;
    }
    PyObject *rows = argv[0];
    Py_ssize_t count = PyList_GET_SIZE(rows), width = PyTuple_GET_SIZE(argv[1]);
    int sizes[16];
    char *out[16];
    PyObject *columns = new_columns(argv[1], count, sizes, out);
    if (columns == NULL) return NULL;
    for (Py_ssize_t r = 0; r < count; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < width) {
            PyErr_Format(PyExc_ValueError, "row %zd is not a tuple of at least %zd values", r, width);
            Py_DECREF(columns);
            return NULL;
        }
        for (Py_ssize_t c = 0; c < width; c++) {
            long long value = as_ll(PyTuple_GET_ITEM(row, c));
            if ((value == -1 && PyErr_Occurred()) || store_value(out[c], sizes[c], r, value) < 0) {
                Py_DECREF(columns);
                return NULL;
            }
        }
    }
    return columns;
}

/* split_rows(data, itemsizes) -> tuple of bytes: `data` (any buffer) holds rows of
 * len(itemsizes) native int64s, as the C wrapper packs module calls; column i of them, each value
 * in itemsizes[i] bytes (1, 2, 4 or 8), native order, for array.frombytes. A strided memoryview's
 * tobytes copies a value at a time through memcpy, some ten times dearer. */
PyObject *split_rows(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "split_rows(data: buffer, itemsizes: tuple[int, ...])");
        return NULL;
    }
    Py_ssize_t width = PyTuple_GET_SIZE(argv[1]);
    Py_buffer view;
    if (PyObject_GetBuffer(argv[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *columns = NULL;
    Py_ssize_t row_bytes = width * (Py_ssize_t)sizeof(int64_t);
    if (row_bytes == 0 || view.len % row_bytes != 0) {
        if (row_bytes == 0) PyErr_SetString(PyExc_ValueError, "1 to 16 columns");
        else PyErr_SetString(PyExc_ValueError, "the data is not a whole number of rows");
        goto done;
    }
    int sizes[16];
    char *out[16];
    Py_ssize_t count = view.len / row_bytes;
    if ((columns = new_columns(argv[1], count, sizes, out)) == NULL) goto done;
    const char *in = (const char *)view.buf;
    for (Py_ssize_t r = 0; r < count; r++) {
        for (Py_ssize_t c = 0; c < width; c++) {
            int64_t value;
            memcpy(&value, in + r * row_bytes + c * (Py_ssize_t)sizeof(int64_t), sizeof(value));
            if (store_value(out[c], sizes[c], r, value) < 0) {
                Py_CLEAR(columns);
                goto done;
            }
        }
    }
done:
    PyBuffer_Release(&view);
    return columns;
}

/* empty_packed(size) -> bytearray of `size` bytes whose first eight (a ThreadBuffer.packed_calls'
 * row count) are zero and the rest left as allocated: rows past the count are never read, and
 * zeroing them (bytearray(size)) cost a write of every byte, 28 KiB at each compaction. */
PyObject *empty_packed(PyObject *module, PyObject *size_object) {
    Py_ssize_t size = PyLong_AsSsize_t(size_object);
    if (size == -1 && PyErr_Occurred()) return NULL;
    if (size < PACKED_HEADER) {
        PyErr_SetString(PyExc_ValueError, "empty_packed: room for the row count at least");
        return NULL;
    }
    PyObject *packed = PyByteArray_FromStringAndSize(NULL, size);
    if (packed != NULL) memset(PyByteArray_AS_STRING(packed), 0, PACKED_HEADER);
    return packed;
}
