/* The module: interned strings, its functions, its types. (see hotpath.h) */
#include "hotpath.h"

PyObject *s_b, *s___dict__, *s_new_buffer, *s_is_compiling_flag, *s_long_step_ns, *s_report_after_ns,
    *s_intern_descriptor, *s_intern_module, *s_compact,
    *s_training, *s_shape, *s_backward_hooks, *s_paused, *s_model_names, *s_on_long_step, *s_is_library, *s_intern,
    *s_sampler, *s_step_begins, *s_operator_gate;
PyObject *no_error;

static PyMethodDef hotpath_functions[] = {
    {"empty_packed", (PyCFunction)empty_packed, METH_O,
     "empty_packed(size) -> bytearray of size bytes, the first eight zero, the rest not written."},
    {"pack_columns", (PyCFunction)(void (*)(void))pack_columns, METH_FASTCALL,
     "pack_columns(rows, itemsizes) -> tuple of bytes, one per column."},
    {"split_rows", (PyCFunction)(void (*)(void))split_rows, METH_FASTCALL,
     "split_rows(data, itemsizes) -> tuple of bytes, one per column of data's int64 rows."},
    {"decide_quiet_step", (PyCFunction)(void (*)(void))decide_quiet_step, METH_FASTCALL,
     "decide_quiet_step(buffer, now_ns, quiet_ns, none, inference) -> (start_ns, end_ns) of the thread's open "
     "one-call inference step, decided from another thread once it has been quiet that long, or None."},
    {NULL, NULL, 0, NULL},
};

/* the type ----------------------------------------------------------------------------- */


static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_hotpath",
    .m_doc = "The common cases of xsp's module-call wrapper, in C.", .m_size = -1,
    .m_methods = hotpath_functions,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__hotpath(void) {
    INTERN(s_b, "b");
    INTERN(s_new_buffer, "new_buffer");
    INTERN(s___dict__, "__dict__");
    INTERN(s_is_compiling_flag, "_is_compiling_flag");
    INTERN(s_long_step_ns, "long_step_ns");
    INTERN(s_report_after_ns, "report_after_ns");
    INTERN(s_intern_descriptor, "intern_descriptor");
    INTERN(s_intern_module, "intern_module");
    INTERN(s_compact, "compact");
    INTERN(s_training, "training");
    INTERN(s_shape, "shape");
    INTERN(s_backward_hooks, "backward_hooks");
    INTERN(s_paused, "paused");
    INTERN(s_sampler, "sampler");
    INTERN(s_step_begins, "step_begins");
    INTERN(s_operator_gate, "operator_gate");
    INTERN(s_model_names, "model_names");
    INTERN(s_on_long_step, "on_long_step");
    INTERN(s_is_library, "is_library");
    INTERN(s_intern, "intern");
    if ((no_error = PyLong_FromLong(NO_ERROR)) == NULL) return NULL;
    if (PyType_Ready(&FastCallType) < 0 || PyType_Ready(&StepEventsType) < 0 || PyType_Ready(&BackwardCallType) < 0
        || sampler_core_ready() < 0)
        return NULL;
    PyObject *module = PyModule_Create(&hotpath_module);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "FastCall", (PyObject *)&FastCallType) < 0
        || PyModule_AddObjectRef(module, "StepEvents", (PyObject *)&StepEventsType) < 0
        || PyModule_AddObjectRef(module, "BackwardCall", (PyObject *)&BackwardCallType) < 0
        || PyModule_AddObjectRef(module, "SamplerCore", (PyObject *)&SamplerCoreType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
