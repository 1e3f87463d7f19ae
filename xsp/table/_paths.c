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
    int n = snprintf(digits, sizeof digits, "%lld", (long long)own->occurrence[row]);
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

static PyMethodDef paths_functions[] = {
    {"fill_paths", fill_paths, METH_VARARGS,
     "fill_paths(order, anchor, offsets, data, name_codes, name_offsets, names, occurrence, session_name, rows): "
     "write every placed row's path into data at its offsets, parents first."},
    {NULL},
};

static struct PyModuleDef paths_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_paths", .m_doc = "Span paths written in place, in C.", .m_size = -1,
    .m_methods = paths_functions,
};

PyMODINIT_FUNC PyInit__paths(void) { return PyModule_Create(&paths_module); }
