/* Span paths written in place, in C.
 *
 * xsp.table.paths.assign_paths computes where each path goes (its offsets, from the lengths of
 * the tree's layers) and hands over one buffer of exactly the paths' size; `fill_paths` writes
 * every path into it, parents first: a path is its anchor's path (already written, so copied
 * from the buffer itself), '/', and the span's own part, `name[k]`. Joining the layers in Arrow
 * instead holds every layer's paths, the own parts and a reordered copy at once: at millions of
 * spans, hundreds of megabytes more than the column itself.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef struct {
    const int64_t *name_codes; /* per row, its name among the distinct names (-1: none) */
    const int64_t *name_offsets;
    const char *names;
    const char *session_name;
    Py_ssize_t session_length;
    const int64_t *occurrence;
    Py_ssize_t rows; /* row `rows` is the session outside the window: no output of its own */
} Own;

/* `value` in decimal into digits (at least 21 bytes); its length. snprintf took most of the
 * time of writing millions of paths. */
static int decimal(long long value, char *digits) {
    char reversed[24];
    int n = 0;
    unsigned long long magnitude = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    do {
        reversed[n++] = (char)('0' + magnitude % 10);
        magnitude /= 10;
    } while (magnitude);
    int length = 0;
    if (value < 0) digits[length++] = '-';
    while (n) digits[length++] = reversed[--n];
    return length;
}

/* The row's own part, `name[k]`: its length, and its text when dest is not NULL. */
static Py_ssize_t own_part(const Own *own, int64_t row, char *dest) {
    const char *name;
    Py_ssize_t length;
    if (row == own->rows) {
        name = own->session_name;
        length = own->session_length;
    } else if (own->name_codes[row] < 0) {
        name = "";
        length = 0;
    } else {
        int64_t code = own->name_codes[row];
        name = own->names + own->name_offsets[code];
        length = (Py_ssize_t)(own->name_offsets[code + 1] - own->name_offsets[code]);
    }
    char digits[24];
    int n = decimal((long long)own->occurrence[row], digits);
    if (dest) {
        memcpy(dest, name, (size_t)length);
        dest[length] = '[';
        memcpy(dest + length + 1, digits, (size_t)n);
        dest[length + 1 + n] = ']';
    }
    return length + n + 2;
}

static PyObject *fill_paths(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer order, anchor, offsets, data, name_codes, name_offsets, names, occurrence, session;
    Py_ssize_t rows;
    if (!PyArg_ParseTuple(args, "y*y*y*w*y*y*y*y*y*n", &order, &anchor, &offsets, &data, &name_codes, &name_offsets,
                          &names, &occurrence, &session, &rows))
        return NULL;
    const int64_t *in_order = order.buf, *anchors = anchor.buf, *at = offsets.buf;
    Py_ssize_t placed = order.len / 8;
    Own own = {name_codes.buf, name_offsets.buf, names.buf, session.buf, session.len, occurrence.buf, rows};
    const int64_t *codes = name_codes.buf;
    Py_ssize_t distinct = name_offsets.len / 8 - 1;
    char *out = data.buf;
    const char *error = NULL;
    if (anchor.len / 8 < rows + 1 || offsets.len / 8 < rows + 1 || occurrence.len / 8 < rows + 1 ||
        name_codes.len / 8 < rows || distinct < 0 || (rows && at[rows] > data.len))
        error = "columns shorter than the rows";
    for (Py_ssize_t row = 0; row < rows && !error; row++)
        if (codes[row] >= distinct) error = "a name code out of range";
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < placed && !error; i++) {
        int64_t row = in_order[i];
        if (row < 0 || row > rows) {
            error = "a row out of range";
            break;
        }
        if (row == rows) continue;
        int64_t above = anchors[row];
        if (above > rows) {
            error = "an anchor out of range";
            break;
        }
        Py_ssize_t head = above < 0 ? 0 : 1 + (above == rows ? own_part(&own, above, NULL) : at[above + 1] - at[above]);
        if (at[row] < 0 || at[row + 1] - at[row] != head + own_part(&own, row, NULL)) {
            error = "a path of another length than its offsets say";
            break;
        }
        char *dest = out + at[row];
        if (above == rows) {
            dest += own_part(&own, above, dest);
            *dest++ = '/';
        } else if (above >= 0) {
            memcpy(dest, out + at[above], (size_t)(head - 1)); /* written before: parents come first */
            dest += head - 1;
            *dest++ = '/';
        }
        own_part(&own, row, dest);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&order);
    PyBuffer_Release(&anchor);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    PyBuffer_Release(&name_codes);
    PyBuffer_Release(&name_offsets);
    PyBuffer_Release(&names);
    PyBuffer_Release(&occurrence);
    PyBuffer_Release(&session);
    if (error) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Whether two texts next to each other in `order` (positions into offsets) are equal: sorted
 * texts repeat only there. Compared in place: a copy of millions of paths is hundreds of MB. */
static PyObject *equal_neighbours(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer order, offsets, data;
    if (!PyArg_ParseTuple(args, "y*y*y*", &order, &offsets, &data)) return NULL;
    const int64_t *in_order = order.buf, *at = offsets.buf;
    Py_ssize_t count = order.len / 8, texts = offsets.len / 8 - 1;
    const char *bytes = data.buf;
    int found = 0;
    const char *error = NULL;
    for (Py_ssize_t i = 0; i < count && !error; i++)
        if (in_order[i] < 0 || in_order[i] >= texts || at[in_order[i]] < 0 || at[in_order[i] + 1] > data.len)
            error = "a position out of range";
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 1; i < count && !found && !error; i++) {
        int64_t a = in_order[i - 1], b = in_order[i];
        int64_t length = at[a + 1] - at[a];
        found = length == at[b + 1] - at[b] && memcmp(bytes + at[a], bytes + at[b], (size_t)length) == 0;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&order);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    if (error) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    return PyBool_FromLong(found);
}

static PyMethodDef paths_functions[] = {
    {"fill_paths", fill_paths, METH_VARARGS,
     "fill_paths(order, anchor, offsets, data, name_codes, name_offsets, names, occurrence, session_name, rows): "
     "write every placed row's path into data at its offsets, parents first."},
    {"equal_neighbours", equal_neighbours, METH_VARARGS,
     "equal_neighbours(order, offsets, data): whether two texts next to each other in order are equal."},
    {NULL},
};

static struct PyModuleDef paths_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_paths", .m_doc = "Span paths written in place, in C.", .m_size = -1,
    .m_methods = paths_functions,
};

PyMODINIT_FUNC PyInit__paths(void) { return PyModule_Create(&paths_module); }
