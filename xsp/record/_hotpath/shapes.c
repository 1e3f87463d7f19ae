/* Shape descriptors of a call's inputs and outputs, and the hot descriptor cache. (see hotpath.h) */
#include "hotpath.h"

/* The descriptor's index in the buffer's interner (new reference). */
PyObject *descriptor_id(PyObject *buffer, PyObject *ids, PyObject *descriptor) {
    PyObject *found = PyDict_GetItemWithError(ids, descriptor);
    if (found != NULL) {
        Py_INCREF(found);
        return found;
    }
    if (PyErr_Occurred()) return NULL;
    return PyObject_CallMethodOneArg(buffer, s_intern_descriptor, descriptor);
}


/* Append the shapes of `value`'s tensors to `shapes`: itself, or those one level into a tuple or
 * list (describe_inputs's rule for one argument). */
int add_shapes(FastCall *self, PyObject *shapes, PyObject *value) {
    PyTypeObject *tensor = (PyTypeObject *)self->tensor_type;
    if (PyObject_TypeCheck(value, tensor)) {
        PyObject *shape = tensor_shape(self, value);
        if (shape == NULL) return -1;
        int added = PyList_Append(shapes, shape);
        Py_DECREF(shape);
        return added;
    }
    if (!PyTuple_Check(value) && !PyList_Check(value)) return 0;
    PyObject *items = PySequence_Fast(value, "");
    if (items == NULL) return -1;
    int status = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items) && status == 0; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        if (PyObject_TypeCheck(item, tensor)) status = add_shapes(self, shapes, item);
    }
    Py_DECREF(items);
    return status;
}

/* The descriptor of the shapes gathered in `shapes` (consumed): None when there are none, else
 * their tuple (new reference). */
PyObject *shapes_descriptor(PyObject *shapes) {
    PyObject *descriptor = PyList_GET_SIZE(shapes) ? PyList_AsTuple(shapes) : Py_NewRef(Py_None);
    Py_DECREF(shapes);
    return descriptor;
}

/* Shape descriptor of the inputs, as describe_inputs gives it (new reference): positional
 * arguments first, then keyword arguments in the order they were given. */
PyObject *inputs_descriptor(FastCall *self, const Call *call) {
    Py_ssize_t count = call->nargs + CALL_NKW(call);
    PyObject *const *values = call->argv + 1;
    if (count == 1 && call->nargs == 1 && Py_IS_TYPE(values[0], (PyTypeObject *)self->tensor_type))
        return tensor_shape(self, values[0]);
    PyObject *shapes = PyList_New(0);
    if (shapes == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++)
        if (add_shapes(self, shapes, values[i]) < 0) {
            Py_DECREF(shapes);
            return NULL;
        }
    return shapes_descriptor(shapes);
}

/* Shape descriptor of the output, as describe gives it (new reference); mappings in Python. */
PyObject *output_descriptor(FastCall *self, PyObject *out) {
    if (Py_IS_TYPE(out, (PyTypeObject *)self->tensor_type)) return tensor_shape(self, out);
    if (!PyTuple_CheckExact(out) && !PyList_CheckExact(out)) return PyObject_CallOneArg(self->describe, out);
    PyObject *shapes = PyList_New(0);
    if (shapes == NULL) return NULL;
    if (add_shapes(self, shapes, out) < 0) {  /* a tuple or list: its tensors' shapes */
        Py_DECREF(shapes);
        return NULL;
    }
    return shapes_descriptor(shapes);
}

/* Whether two shape descriptors of one type are equal, as == says: 1, 0 or -1. A torch.Size (a
 * tuple of ints) or a tuple of them is compared item by item here, with no rich comparison for
 * the ints (those of a shape below 257 are one object each); anything else by ==. */
int same_descriptor(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (!PyTuple_Check(a) || Py_TYPE(a) != Py_TYPE(b)) return PyObject_RichCompareBool(a, b, Py_EQ);
    Py_ssize_t size = PyTuple_GET_SIZE(a);
    if (size != PyTuple_GET_SIZE(b)) return 0;
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *x = PyTuple_GET_ITEM(a, i), *y = PyTuple_GET_ITEM(b, i);
        if (x == y) continue;
        int same;
        if (PyLong_CheckExact(x) && PyLong_CheckExact(y)) {
            int overflow_x, overflow_y;
            long long value_x = PyLong_AsLongLongAndOverflow(x, &overflow_x);
            long long value_y = PyLong_AsLongLongAndOverflow(y, &overflow_y);
            same = overflow_x || overflow_y ? PyObject_RichCompareBool(x, y, Py_EQ)
                                            : value_x == value_y;
        } else {
            same = same_descriptor(x, y);
        }
        if (same != 1) return same;
    }
    return 1;
}

/* A top-level call's descriptor index: from the buffer's cache of its model's last top-level call
 * (`hot`, `hot_id` slots) when the shapes equal that call's, as in a loop over one batch size;
 * else from the interner (new reference). An empty entry (None, None) matches nothing. */
PyObject *hot_descriptor_id(PyObject *buffer, PyObject *ids, PyObject *descriptor, Py_ssize_t hot,
                                   Py_ssize_t hot_id) {
    PyObject *last = SLOT(buffer, hot), *last_id = SLOT(buffer, hot_id);
    if (last != NULL && last_id != NULL && PyLong_CheckExact(last_id) && Py_TYPE(last) == Py_TYPE(descriptor)
        && same_descriptor(last, descriptor) == 1)
        return Py_NewRef(last_id);
    PyErr_Clear();  /* a comparison that failed is a miss */
    PyObject *found = descriptor_id(buffer, ids, descriptor);
    if (found != NULL) {
        slot_set(buffer, hot, descriptor);
        slot_set(buffer, hot_id, found);
    }
    return found;
}

/* Make the first of the buffer's two cache entries (hot_*, hot2_*: a top-level call's model, its
 * index, and its last shapes and their indexes) the one of `module`: the second when it holds
 * `module` (the entries swap), else an empty one (the first moves to the second). A loop that
 * calls two models by turns (a forward and its loss, an encoder and a head) then hits the cache
 * of each. The slots change places only: no reference is taken or dropped but the one cleared. */
void hot_entry_for(PyObject *buffer, const BufferSlots *s, PyObject *module) {
    if (SLOT(buffer, s->hot_module) == module) return;
    const Py_ssize_t first[] = {s->hot_module, s->hot_module_id, s->hot_inputs, s->hot_inputs_id, s->hot_outputs,
                                s->hot_outputs_id};
    const Py_ssize_t second[] = {s->hot2_module, s->hot2_module_id, s->hot2_inputs, s->hot2_inputs_id,
                                 s->hot2_outputs, s->hot2_outputs_id};
    int held = SLOT(buffer, s->hot2_module) == module;
    for (size_t i = 0; i < sizeof(first) / sizeof(first[0]); i++) {
        PyObject *moved = SLOT(buffer, first[i]);
        SLOT(buffer, first[i]) = SLOT(buffer, second[i]);
        SLOT(buffer, second[i]) = moved;
        if (!held) slot_set(buffer, first[i], Py_None);
    }
}

