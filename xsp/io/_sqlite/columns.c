/* Numeric columns of an SQLite query read straight into one float64 array, for the Nsight Systems
 * import (xsp/io/nsys.py): Python's sqlite3 makes a tuple and a number object for every value
 * (about 2 µs a row of six columns), this reads each value where SQLite keeps it.
 *
 * libsqlite3 is the one Python's own sqlite3 module loaded (libsqlite3.so.0): bound with dlopen
 * and the few calls of its stable C API declared here, so no SQLite headers are needed to build. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SQLITE_OK 0
#define SQLITE_ROW 100
#define SQLITE_DONE 101
#define SQLITE_NULL 5
#define SQLITE_OPEN_READONLY 0x00000001
#define SQLITE_OPEN_URI 0x00000040

typedef struct sqlite3 sqlite3;
typedef struct sqlite3_stmt sqlite3_stmt;

static struct {
    void *library;
    int (*open_v2)(const char *, sqlite3 **, int, const char *);
    int (*close)(sqlite3 *);
    int (*prepare_v2)(sqlite3 *, const char *, int, sqlite3_stmt **, const char **);
    int (*step)(sqlite3_stmt *);
    int (*column_count)(sqlite3_stmt *);
    int (*column_type)(sqlite3_stmt *, int);
    double (*column_double)(sqlite3_stmt *, int);
    int (*finalize)(sqlite3_stmt *);
    const char *(*errmsg)(sqlite3 *);
} sqlite;

static int bind_sqlite(void) {
    if (sqlite.library != NULL) return 0;
    const char *names[] = {"libsqlite3.so.0", "libsqlite3.so", "libsqlite3.dylib", NULL};
    void *library = NULL;
    for (int i = 0; names[i] != NULL && library == NULL; i++) library = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        PyErr_SetString(PyExc_OSError, "libsqlite3 could not be loaded");
        return -1;
    }
#define BIND(field, name)                                                        \
    if ((*(void **)&sqlite.field = dlsym(library, name)) == NULL) {             \
        PyErr_Format(PyExc_OSError, "libsqlite3 has no %s", name);               \
        dlclose(library);                                                        \
        return -1;                                                               \
    }
    BIND(open_v2, "sqlite3_open_v2")
    BIND(close, "sqlite3_close")
    BIND(prepare_v2, "sqlite3_prepare_v2")
    BIND(step, "sqlite3_step")
    BIND(column_count, "sqlite3_column_count")
    BIND(column_type, "sqlite3_column_type")
    BIND(column_double, "sqlite3_column_double")
    BIND(finalize, "sqlite3_finalize")
    BIND(errmsg, "sqlite3_errmsg")
#undef BIND
    sqlite.library = library;
    return 0;
}

/* read_floats(uri, sql) -> (bytearray, columns): every row of the query, each value a float64
 * (NaN where null), row after row. uri: a file: URI, opened read-only. */
static PyObject *read_floats(PyObject *module, PyObject *args) {
    const char *uri, *sql;
    if (!PyArg_ParseTuple(args, "ss", &uri, &sql)) return NULL;
    if (bind_sqlite() < 0) return NULL;
    sqlite3 *db = NULL;
    sqlite3_stmt *statement = NULL;
    double *values = NULL;
    size_t count = 0, capacity = 0;
    int columns = 0, status, failed = 0;
    char why[512] = "";
    Py_BEGIN_ALLOW_THREADS
    status = sqlite.open_v2(uri, &db, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI, NULL);
    if (status == SQLITE_OK) status = sqlite.prepare_v2(db, sql, -1, &statement, NULL);
    if (status != SQLITE_OK) {
        snprintf(why, sizeof why, "%s", db ? sqlite.errmsg(db) : "cannot open");
        failed = 1;
    } else {
        columns = sqlite.column_count(statement);
        while ((status = sqlite.step(statement)) == SQLITE_ROW) {
            if (count + (size_t)columns > capacity) {
                size_t grown_capacity = capacity ? 2 * capacity : 1 << 16;
                while (grown_capacity < count + (size_t)columns) grown_capacity *= 2;
                double *grown = realloc(values, grown_capacity * sizeof(double));
                if (grown == NULL) {
                    snprintf(why, sizeof why, "out of memory");
                    failed = 2;
                    break;
                }
                values = grown;
                capacity = grown_capacity;
            }
            for (int i = 0; i < columns; i++)
                values[count++] = sqlite.column_type(statement, i) == SQLITE_NULL ? NAN
                                                                                   : sqlite.column_double(statement, i);
        }
        if (!failed && status != SQLITE_DONE) {
            snprintf(why, sizeof why, "%s", sqlite.errmsg(db));
            failed = 1;
        }
    }
    if (statement != NULL) sqlite.finalize(statement);
    if (db != NULL) sqlite.close(db);
    Py_END_ALLOW_THREADS
    if (failed) {
        free(values);
        if (failed == 2) return PyErr_NoMemory();
        PyErr_Format(PyExc_OSError, "SQLite: %s", why);
        return NULL;
    }
    PyObject *buffer = PyByteArray_FromStringAndSize((const char *)values, (Py_ssize_t)(count * sizeof(double)));
    free(values);
    if (buffer == NULL) return NULL;
    return Py_BuildValue("(Ni)", buffer, columns);
}

static PyMethodDef methods[] = {
    {"read_floats", read_floats, METH_VARARGS,
     "read_floats(uri, sql) -> (bytearray, columns): every row of the query, each value a float64 (NaN where "
     "null), row after row; the database opened read-only from the file: URI."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "_sqlite",
    "Numeric columns of an SQLite query read into one float64 array (the Nsight Systems import).", -1, methods,
};

PyMODINIT_FUNC PyInit__sqlite(void) { return PyModule_Create(&definition); }
