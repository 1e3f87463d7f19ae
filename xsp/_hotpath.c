/* The common cases of xsp's nn.Module.__call__ wrapper, in C.
 *
 * A `FastCall` object is what xsp installs as nn.Module.__call__ (tracers/_module_calls.py):
 * `model(x)` runs its vectorcall directly, with no Python frame of xsp's in between. It is a
 * method descriptor (Py_TPFLAGS_METHOD_DESCRIPTOR), so the interpreter calls it with the module
 * first, as it would a function; read as an attribute (`nn.Module.__call__`, `model.__call__`,
 * `super().__call__`) it gives a Python function that does the same (`exposed`), so that dynamo
 * (which inlines it and folds its first test, is dynamo compiling?, to a constant), inspect,
 * torch.fx and other tools see a function as before. It handles the cases that run thousands
 * of times per second and hands every other one to the Python wrapper (`slow`):
 *
 *  - a top-level call, whose step it decides as AutoSteps.call_begins does (the model's next
 *    call of a one-call step, a loss module or head joining the open step, the next training
 *    iteration after an optimizer step, an evaluation between training steps...), except
 *    inside xsp.step() or generate(), at a model's first call, while a schedule pauses, and
 *    when a decided step must be reported (plan_call);
 *  - ROOTS mode (model level): any call inside a top-level call (passed straight through);
 *  - ALL mode (layer level): a call inside a top-level call, when its step is recorded.
 *
 * `StepEvents` does the same for the bodies of the backward and optimizer-step hooks
 * (tracers/_loop_events.py), and `pack_columns` packs raw records into typed columns.
 *
 * It records exactly what the Python wrapper records, into the same ThreadBuffer lists.
 * Anything unusual (a step to hand over, jit tracing, a paused schedule, an object of another
 * type) takes the Python path, which is the whole wrapper; tests run both.
 *
 * Why C: in Python the wrapper's bookkeeping is most of a top-level call's cost (about 2 µs on
 * a 2-core x86 machine), and getattr through the C API is no cheaper. So the slots of
 * ThreadBuffer and AutoSteps are read and written where their member descriptors would, and
 * the clock is read with clock_gettime where that is what time.perf_counter_ns reads. A module
 * call's arguments stay in the vectorcall array they came in, and are passed on in it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>
#include <time.h>
#include <stdint.h>
#include <string.h>
#include <limits.h>
#include <stdbool.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h>  /* Python.h includes it from 3.11 on */
#endif

#include "_correlation.h"

#define MODE_ROOTS 1
#define MODE_ALL 2
#define NO_ERROR (-1)
#define ROOT_TRAINING 1
#define ROOT_GRAD 2
#define ROOT_MODE_UNKNOWN 4
#define CONSTANTS 8  /* len(auto_steps.hotpath_constants()) */

static PyObject *s_b, *s___dict__, *s_new_buffer, *s_is_compiling_flag, *s_long_step_ns, *s_report_after_ns,
    *s_intern_descriptor, *s_intern_module, *s_compact,
    *s_training, *s_shape, *s_backward_hooks, *s_paused, *s_model_names, *s_on_long_step;
static PyObject *no_error;

typedef struct {
    Py_ssize_t depth, steps, aside, roots, calls, descriptor_ids, module_ids, skipping, open_steps, marks,
        optimizer_starts, packed_calls, packed_roots, hot_module, hot_module_id, hot_inputs, hot_inputs_id, hot_outputs,
        hot_outputs_id, hot2_module, hot2_module_id, hot2_inputs, hot2_inputs_id, hot2_outputs, hot2_outputs_id;
} BufferSlots;
typedef struct {
    Py_ssize_t lane, lane_grad, start_ns, last_end_ns, type, closed_ns, leader, pieces, nested, trained, wait_ns,
        resume_ns, name, optimizer_seen, closed_by, python_decides, joiner, joined;
} StepsSlots;

/* A small cache of threads' buffers (recording.local.b: a thread-local lookup costs hundreds of
 * instructions), keyed by the thread state's id, which is unique for the interpreter's life (a
 * thread state's address may be reused by a later thread; its id is not). A few entries, replaced
 * in turn: a server's worker threads take requests in no fixed order, and with one entry nearly
 * every call would miss. */
#define CACHED_THREADS 4
typedef struct {
    uint64_t threads[CACHED_THREADS];
    PyObject *buffers[CACHED_THREADS];
    unsigned int next;  /* the entry the next miss replaces */
} BufferCache;

/* c10::GradMode::is_enabled(), a C++ function of no arguments returning a bool (the Itanium ABI
 * returns it as C's bool); found by tracers/_native_torch.py. */
typedef bool (*grad_mode_function)(void);

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    BufferCache cache;
    grad_mode_function native_grad_mode;  /* NULL: call grad_enabled */
    int mode;
    Py_ssize_t compact_at;
    PyObject *original;       /* nn.Module.__call__ as it was */
    vectorcallfunc original_call;  /* its vectorcall function, or NULL */
    PyObject *slow;           /* the Python wrapper: (module, *args, **kwargs) */
    PyObject *exposed;        /* what reading the attribute gives: a Python function calling this */
    PyObject *on_read;        /* called (no arguments) before the attribute is read */
    PyObject *compiler;       /* torch.compiler, whose _is_compiling_flag says whether dynamo traces; or NULL */
    PyObject *local;          /* recording.local: .b is the thread's buffer */
    PyObject *recording;
    PyObject *now;            /* time.perf_counter_ns */
    PyObject *grad_enabled;   /* torch.is_grad_enabled */
    PyObject *jit_tracing;    /* torch._C._get_tracing_state, or None: jit tracing sets buffer.aside */
    PyObject *tensor_type;    /* torch.Tensor */
    PyObject *shape_descriptor;  /* torch.Tensor.shape (a getset descriptor), or NULL */
    descrgetfunc shape_get;   /* its getter */
    unsigned int shape_version;  /* torch.Tensor's version tag when it was read */
    PyObject *describe_inputs;
    PyObject *describe;
    PyObject *on_error;       /* (buffer, module, args, kwargs, start, end, exception, depth) */
    PyObject *hook_backward;  /* (buffer, out, module, start), ALL mode */
    PyObject *buffer_type;    /* ThreadBuffer */
    PyObject *steps_type;     /* AutoSteps */
    PyObject *correlation_capsule;  /* xsp._activity.correlation, or NULL */
    PyObject *graph_task_id;  /* torch._C._current_graph_task_id (-1: no backward runs on this thread), or NULL */
    const xsp_correlation *correlation;  /* what it holds: CUPTI external ids pushed around each call */
    /* AutoSteps's constants (auto_steps.hotpath_constants()) */
    PyObject *step_none, *step_inference, *step_train, *mark_step, *train_step_name, *train_attributes,
        *inference_step_name, *inference_attributes;
    BufferSlots buffer_slots;
    StepsSlots steps_slots;
    uint64_t running_thread;
    /* MODE_ROOTS: the thread (current_thread) whose top-level call this wrapper runs right now, 0
     * when none: a module call on that thread while it runs is a pass-through, known without the
     * thread's buffer and its depth (~50 instructions a layer call). Whenever it names a thread,
     * that thread's buffer's depth is 1 or more; when it does not (another thread's top-level call
     * took it, or the Python path runs the call), the buffer says. A field, not a thread-local: a
     * thread-local of a shared library costs a call (__tls_get_addr) at each read. */
} FastCall;

/* The calling thread's id: its thread state's, unique for the interpreter's life and never 0. */
static inline uint64_t current_thread(void) {
    return PyThreadState_GetID(PyThreadState_Get());
}

/* One module call's arguments, as the vectorcall protocol passes them: argv[0] is the module,
 * then `nargs` positional arguments, then the values of the keywords named in `kwnames`. */
typedef struct {
    PyObject *const *argv;
    size_t nargsf;  /* as received (PY_VECTORCALL_ARGUMENTS_OFFSET passes on with argv) */
    Py_ssize_t nargs;
    PyObject *kwnames;  /* NULL or a tuple */
} Call;

#define CALL_MODULE(call) ((call)->argv[0])
#define CALL_NKW(call) ((call)->kwnames == NULL ? 0 : PyTuple_GET_SIZE((call)->kwnames))

/* An int's value; PyLong_AsLongLong goes through a byte array for any value past 2**30. An exact
 * int of one or two digits (every slot, index and clock reading xsp keeps) is read in place: the
 * call into PyLong_AsLong and its checks cost more than the read, some 30 instructions for each
 * of the dozen ints a top-level call reads. */
static inline long long as_ll(PyObject *value) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(value) && PyUnstable_Long_IsCompact((PyLongObject *)value))
        return (long long)PyUnstable_Long_CompactValue((PyLongObject *)value);
#elif PYLONG_BITS_IN_DIGIT == 30
    if (PyLong_CheckExact(value)) {
        const digit *digits = ((PyLongObject *)value)->ob_digit;
        switch (Py_SIZE(value)) {
        case 0: return 0;
        case 1: return (long long)digits[0];
        case -1: return -(long long)digits[0];
        case 2: return (long long)digits[0] | ((long long)digits[1] << PyLong_SHIFT);
        case -2: return -((long long)digits[0] | ((long long)digits[1] << PyLong_SHIFT));
        default: break;
        }
    }
#endif
#if LONG_MAX == LLONG_MAX
    return PyLong_AsLong(value);
#else
    return PyLong_AsLongLong(value);
#endif
}

/* The buffers in self->cache, for EACH_FIELD lists. */
#define EACH_CACHED(DO) \
    DO(self->cache.buffers[0]); DO(self->cache.buffers[1]); DO(self->cache.buffers[2]); DO(self->cache.buffers[3])
_Static_assert(CACHED_THREADS == 4, "EACH_CACHED names every entry of a BufferCache");

/* tp_traverse, tp_clear and tp_dealloc of a type whose object fields EACH(DO) lists. */
#define GC_FUNCTIONS(prefix, Type, EACH)                                        \
    static int prefix##_traverse(Type *self, visitproc visit, void *arg) {     \
        EACH(Py_VISIT);                                                         \
        return 0;                                                               \
    }                                                                           \
    static int prefix##_clear(Type *self) {                                     \
        EACH(Py_CLEAR);                                                         \
        return 0;                                                               \
    }                                                                           \
    static void prefix##_dealloc(Type *self) {                                  \
        PyObject_GC_UnTrack(self);                                              \
        prefix##_clear(self);                                                   \
        Py_TYPE(self)->tp_free((PyObject *)self);                               \
    }

/* slots -------------------------------------------------------------------------------- */
#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

static void slot_set(PyObject *obj, Py_ssize_t offset, PyObject *value) {
    PyObject *old = SLOT(obj, offset);
    Py_INCREF(value);
    SLOT(obj, offset) = value;
    Py_XDECREF(old);
}

static int slot_set_ll(PyObject *obj, Py_ssize_t offset, long long value) {
    PyObject *boxed = PyLong_FromLongLong(value);
    if (boxed == NULL) return -1;
    slot_set(obj, offset, boxed);
    Py_DECREF(boxed);
    return 0;
}

/* An int slot's value; -1 with an exception set when it is unset or no int. */
static long long slot_ll(PyObject *obj, Py_ssize_t offset) {
    PyObject *value = SLOT(obj, offset);
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "slot not set");
        return -1;
    }
    return as_ll(value);
}

static int slot_offset(PyObject *type, const char *name, Py_ssize_t *offset) {
    PyObject *descriptor = PyObject_GetAttrString(type, name);
    if (descriptor == NULL) return -1;
    int ok = Py_IS_TYPE(descriptor, &PyMemberDescr_Type)
             && ((PyMemberDescrObject *)descriptor)->d_member->type == T_OBJECT_EX;
    if (ok) *offset = ((PyMemberDescrObject *)descriptor)->d_member->offset;
    Py_DECREF(descriptor);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%R.%s is not a slot", type, name);
        return -1;
    }
    return 0;
}

/* The offsets of every ThreadBuffer and AutoSteps slot C reads or writes. */
static int find_slots(PyObject *buffer_type, PyObject *steps_type, BufferSlots *b, StepsSlots *s) {
    struct { PyObject *type; const char *name; Py_ssize_t *offset; } slots[] = {
        {buffer_type, "depth", &b->depth}, {buffer_type, "steps", &b->steps}, {buffer_type, "aside", &b->aside},
        {buffer_type, "roots", &b->roots}, {buffer_type, "calls", &b->calls},
        {buffer_type, "descriptor_ids", &b->descriptor_ids}, {buffer_type, "module_ids", &b->module_ids},
        {buffer_type, "skipping", &b->skipping}, {buffer_type, "open_steps", &b->open_steps},
        {buffer_type, "marks", &b->marks}, {buffer_type, "optimizer_starts", &b->optimizer_starts},
        {buffer_type, "packed_calls", &b->packed_calls},
        {buffer_type, "packed_roots", &b->packed_roots}, {buffer_type, "hot_module", &b->hot_module},
        {buffer_type, "hot_module_id", &b->hot_module_id}, {buffer_type, "hot_inputs", &b->hot_inputs},
        {buffer_type, "hot_inputs_id", &b->hot_inputs_id}, {buffer_type, "hot_outputs", &b->hot_outputs},
        {buffer_type, "hot_outputs_id", &b->hot_outputs_id}, {buffer_type, "hot2_module", &b->hot2_module},
        {buffer_type, "hot2_module_id", &b->hot2_module_id}, {buffer_type, "hot2_inputs", &b->hot2_inputs},
        {buffer_type, "hot2_inputs_id", &b->hot2_inputs_id}, {buffer_type, "hot2_outputs", &b->hot2_outputs},
        {buffer_type, "hot2_outputs_id", &b->hot2_outputs_id},
        {steps_type, "lane", &s->lane}, {steps_type, "lane_grad", &s->lane_grad},
        {steps_type, "start_ns", &s->start_ns}, {steps_type, "last_end_ns", &s->last_end_ns},
        {steps_type, "type", &s->type}, {steps_type, "closed_ns", &s->closed_ns}, {steps_type, "leader", &s->leader},
        {steps_type, "pieces", &s->pieces}, {steps_type, "nested", &s->nested}, {steps_type, "trained", &s->trained},
        {steps_type, "wait_ns", &s->wait_ns}, {steps_type, "resume_ns", &s->resume_ns}, {steps_type, "name", &s->name},
        {steps_type, "optimizer_seen", &s->optimizer_seen}, {steps_type, "closed_by", &s->closed_by},
        {steps_type, "python_decides", &s->python_decides}, {steps_type, "joiner", &s->joiner},
        {steps_type, "joined", &s->joined},
    };
    for (size_t i = 0; i < sizeof(slots) / sizeof(slots[0]); i++)
        if (slot_offset(slots[i].type, slots[i].name, slots[i].offset) < 0) return -1;
    return 0;
}

/* helpers ------------------------------------------------------------------------------ */
/* recording.local.b of the calling thread, `thread` (its current_thread()) (new reference),
 * through `cache`; NULL and no exception when the thread has no buffer yet (read from the
 * thread's dict of the local: no AttributeError is made for a new thread's first call), NULL
 * with an exception on an error. */
static PyObject *thread_buffer(PyObject *local, BufferCache *cache, uint64_t thread) {
    for (int i = 0; i < CACHED_THREADS; i++)
        if (cache->buffers[i] != NULL && cache->threads[i] == thread) return Py_NewRef(cache->buffers[i]);
    PyObject *dict = PyObject_GetAttr(local, s___dict__);
    if (dict == NULL) return NULL;
    if (!PyDict_Check(dict)) {
        Py_DECREF(dict);
        PyErr_SetString(PyExc_TypeError, "xsp: recording.local has no dict");
        return NULL;
    }
    PyObject *buffer = Py_XNewRef(PyDict_GetItemWithError(dict, s_b));
    Py_DECREF(dict);
    if (buffer != NULL) {
        unsigned int entry = cache->next++ % CACHED_THREADS;
        Py_XSETREF(cache->buffers[entry], Py_NewRef(buffer));
        cache->threads[entry] = thread;
    }
    return buffer;
}

/* Append (kind, start, end, name, attributes, error) to buffer.marks, as the Python side does. */
static int append_mark(const BufferSlots *slots, PyObject *buffer, PyObject *kind, PyObject *start, PyObject *end,
                       PyObject *name, PyObject *attributes, PyObject *error) {
    PyObject *marks = SLOT(buffer, slots->marks);
    if (marks == NULL || !PyList_Check(marks)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its marks");
        return -1;
    }
    PyObject *row = PyTuple_Pack(6, kind, start, end, name, attributes, error);
    if (row == NULL) return -1;
    int appended = PyList_Append(marks, row);
    Py_DECREF(row);
    return appended;
}

/* An int in an instance dict (the Recording's deadlines); -1 with an exception set when absent. */
static long long dict_ll(PyObject *dict, PyObject *name) {
    PyObject *value = PyDict_GetItemWithError(dict, name);  /* borrowed */
    if (value != NULL) return as_ll(value);
    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
    return -1;
}

/* callable(module, *args, **kwargs), from the arguments as they came. */
static inline PyObject *call_with_module(PyObject *callable, const Call *call) {
    return PyObject_Vectorcall(callable, call->argv, call->nargsf, call->kwnames);
}

/* original(module, *args, **kwargs): through its vectorcall function where it has one (a Python
 * function's), which PyObject_Vectorcall would look up at each call (one call a layer). */
static inline PyObject *call_original(FastCall *self, const Call *call) {
    if (self->original_call != NULL)
        return self->original_call(self->original, call->argv, call->nargsf, call->kwnames);
    return call_with_module(self->original, call);
}

/* The call's (args, kwargs) as a tuple and a dict, for Python (a failure's record); 0 or -1. */
static int unpacked(const Call *call, PyObject **args, PyObject **kwargs) {
    Py_ssize_t nkw = CALL_NKW(call);
    *kwargs = NULL;
    if ((*args = PyTuple_New(call->nargs)) == NULL) return -1;
    for (Py_ssize_t i = 0; i < call->nargs; i++) PyTuple_SET_ITEM(*args, i, Py_NewRef(call->argv[i + 1]));
    if ((*kwargs = PyDict_New()) == NULL) goto failed;
    for (Py_ssize_t i = 0; i < nkw; i++)
        if (PyDict_SetItem(*kwargs, PyTuple_GET_ITEM(call->kwnames, i), call->argv[1 + call->nargs + i]) < 0)
            goto failed;
    return 0;
failed:
    Py_CLEAR(*args);
    Py_CLEAR(*kwargs);
    return -1;
}

/* The clock, as a new reference (also written to *ns): time.perf_counter_ns's own. */
static PyObject *read_clock(PyObject *now_function, long long *ns) {
#ifdef __linux__
    struct timespec now;  /* CPython's perf_counter is CLOCK_MONOTONIC on Linux */
    if (clock_gettime(CLOCK_MONOTONIC, &now) == 0) {
        *ns = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
        return PyLong_FromLongLong(*ns);
    }
#endif
    PyObject *value = PyObject_CallNoArgs(now_function);
    if (value == NULL) return NULL;
    *ns = as_ll(value);
    if (*ns == -1 && PyErr_Occurred()) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
}

/* 1 when autograd records a graph, 0 when not, -1 on error. */
static int grad_enabled(FastCall *self) {
    if (self->native_grad_mode != NULL) return self->native_grad_mode() ? 1 : 0;
    PyObject *grad = PyObject_CallNoArgs(self->grad_enabled);
    if (grad == NULL) return -1;
    int enabled = grad == Py_True;
    Py_DECREF(grad);
    return enabled;
}

/* The descriptor's index in the buffer's interner (new reference). */
static PyObject *descriptor_id(PyObject *buffer, PyObject *ids, PyObject *descriptor) {
    PyObject *found = PyDict_GetItemWithError(ids, descriptor);
    if (found != NULL) {
        Py_INCREF(found);
        return found;
    }
    if (PyErr_Occurred()) return NULL;
    return PyObject_CallMethodOneArg(buffer, s_intern_descriptor, descriptor);
}

/* tensor.shape (new reference). A torch.Tensor's is read through the descriptor found when the
 * wrapper was made, while the class is unchanged (its version tag): what attribute lookup would
 * find, without the lookup (the type cache is shared, and a miss there costs ~300 instructions). */
static inline PyObject *tensor_shape(FastCall *self, PyObject *tensor) {
    PyTypeObject *type = Py_TYPE(tensor);
    if (self->shape_get != NULL && type == (PyTypeObject *)self->tensor_type
        && PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG) && type->tp_version_tag == self->shape_version)
        return self->shape_get(self->shape_descriptor, tensor, (PyObject *)type);
    return PyObject_GetAttr(tensor, s_shape);
}

/* Append the shapes of `value`'s tensors to `shapes`: itself, or those one level into a tuple or
 * list (describe_inputs's rule for one argument). */
static int add_shapes(FastCall *self, PyObject *shapes, PyObject *value) {
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
static PyObject *shapes_descriptor(PyObject *shapes) {
    PyObject *descriptor = PyList_GET_SIZE(shapes) ? PyList_AsTuple(shapes) : Py_NewRef(Py_None);
    Py_DECREF(shapes);
    return descriptor;
}

/* Shape descriptor of the inputs, as describe_inputs gives it (new reference): positional
 * arguments first, then keyword arguments in the order they were given. */
static PyObject *inputs_descriptor(FastCall *self, const Call *call) {
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
static PyObject *output_descriptor(FastCall *self, PyObject *out) {
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
static int same_descriptor(PyObject *a, PyObject *b) {
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
static PyObject *hot_descriptor_id(PyObject *buffer, PyObject *ids, PyObject *descriptor, Py_ssize_t hot,
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
static void hot_entry_for(PyObject *buffer, const BufferSlots *s, PyObject *module) {
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

/* ThreadBuffer.packed_calls' layout: an int64 row count, then rows of seven int64s
 * (packed_roots': rows of two, ROOT_FIELDS). */
#define PACKED_HEADER ((Py_ssize_t)sizeof(int64_t))
#define CALL_FIELDS 7
#define PACKED_ROW_BYTES (CALL_FIELDS * (Py_ssize_t)sizeof(int64_t))
#define ROOT_FIELDS 2

/* The row count a packed buffer starts with (0 for one too short to hold it). */
static int64_t packed_count_of(PyObject *packed) {
    int64_t count = 0;
    if (PyByteArray_GET_SIZE(packed) >= PACKED_HEADER) memcpy(&count, PyByteArray_AS_STRING(packed), sizeof(count));
    return count;
}

/* Whether `packed`, holding `count` rows of `row_bytes`, has room for `more` rows as it is. */
static int packed_fits(PyObject *packed, int64_t count, Py_ssize_t row_bytes, Py_ssize_t more) {
    return PACKED_HEADER + ((Py_ssize_t)count + more) * row_bytes <= PyByteArray_GET_SIZE(packed);
}

/* Whether `packed`, holding `count` rows of `row_bytes`, has room for `more` rows, after growing
 * it up to `full_rows` rows where it is smaller: a thread's first buffer is one page
 * (FIRST_PACKED_ROWS), and growing it in place (a copy of that page) costs a hundredth of what
 * compacting its rows early would (~90,000 instructions, some 1,400 a row of a thread that makes
 * a hundred calls). A buffer that a view holds cannot grow: then 0, as for a full one. */
static int packed_has_room(PyObject *packed, int64_t count, Py_ssize_t row_bytes, Py_ssize_t more,
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
static Py_ssize_t append_packed_row(PyObject *packed, const int64_t *values, Py_ssize_t fields,
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
static int move_rows_to_packed(PyObject *list, PyObject *packed, int64_t packed_count, Py_ssize_t fields,
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
static Py_ssize_t pack_behind_list(PyObject *list, PyObject *packed, const int64_t *values, Py_ssize_t fields,
                                   Py_ssize_t full_rows) {
    if (PyList_GET_SIZE(list) > 0 && move_rows_to_packed(list, packed, packed_count_of(packed), fields, full_rows) < 0)
        return -1;
    return PyList_GET_SIZE(list) > 0 ? 0 : append_packed_row(packed, values, fields, full_rows);
}

/* Record a finished call: (start, end, module index, depth, inputs index, outputs index,
 * NO_ERROR), as ThreadBuffer.record_call does. While buffer.calls is empty (after moving the
 * Python path's rows out of it where they fit) the row goes into buffer.packed_calls as seven
 * int64s (no tuple, no int objects to make and free, nothing to pack later); else it is appended
 * to buffer.calls as a tuple, behind the Python path's rows, so that compaction (packed rows
 * first, then the list) keeps the order. *calls_length: the rows waiting for compaction after. */
static int record_call(FastCall *self, PyObject *buffer, const Call *call, long long depth, PyObject *out,
                       PyObject *start, PyObject *end, long long start_ns, long long end_ns,
                       Py_ssize_t *calls_length) {
    PyObject *module = CALL_MODULE(call);
    const BufferSlots *slots = &self->buffer_slots;
    int status = -1;
    PyObject *inputs = NULL, *outputs = NULL, *input_id = NULL, *output_id = NULL, *key = NULL;
    PyObject *module_id = NULL, *row = NULL;
    PyObject *ids = SLOT(buffer, slots->descriptor_ids), *module_ids = SLOT(buffer, slots->module_ids);
    if (ids == NULL || module_ids == NULL || !PyDict_Check(ids) || !PyDict_Check(module_ids)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its interners");
        return -1;
    }
    if ((inputs = inputs_descriptor(self, call)) == NULL) goto done;
    if ((outputs = output_descriptor(self, out)) == NULL) goto done;
    if (depth == 0) {
        hot_entry_for(buffer, slots, module);
        if ((input_id = hot_descriptor_id(buffer, ids, inputs, slots->hot_inputs, slots->hot_inputs_id)) == NULL)
            goto done;
        if ((output_id = hot_descriptor_id(buffer, ids, outputs, slots->hot_outputs, slots->hot_outputs_id)) == NULL)
            goto done;
    } else {
        if ((input_id = descriptor_id(buffer, ids, inputs)) == NULL) goto done;
        if ((output_id = descriptor_id(buffer, ids, outputs)) == NULL) goto done;
    }
    PyObject *hot_module = SLOT(buffer, slots->hot_module), *hot_module_id = SLOT(buffer, slots->hot_module_id);
    if (depth == 0 && hot_module == module && hot_module_id != NULL && PyLong_CheckExact(hot_module_id)) {
        /* the interner holds every module it indexed, so an address seen there is that module */
        module_id = Py_NewRef(hot_module_id);
    } else {
        if ((key = PyLong_FromVoidPtr(module)) == NULL) goto done;
        module_id = PyDict_GetItemWithError(module_ids, key);
        if (module_id != NULL) {
            Py_INCREF(module_id);
        } else {
            if (PyErr_Occurred()) goto done;
            if ((module_id = PyObject_CallMethodOneArg(buffer, s_intern_module, module)) == NULL) goto done;
        }
        if (depth == 0) {
            slot_set(buffer, slots->hot_module, module);
            slot_set(buffer, slots->hot_module_id, module_id);
        }
    }
    /* read now: interning runs Python, during which another thread may have compacted the buffer */
    PyObject *calls = SLOT(buffer, slots->calls), *packed = SLOT(buffer, slots->packed_calls);
    if (calls == NULL || packed == NULL || !PyList_Check(calls) || !PyByteArray_CheckExact(packed)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its record lists");
        goto done;
    }
    int64_t values[CALL_FIELDS] = {start_ns, end_ns, as_ll(module_id), depth, as_ll(input_id), as_ll(output_id), NO_ERROR};
    if (PyErr_Occurred() || (*calls_length = pack_behind_list(calls, packed, values, CALL_FIELDS, self->compact_at)) < 0)
        goto done;
    if (*calls_length > 0) {
        status = 0;
        goto done;
    }  /* the row goes into the list, behind the packed ones */
    int64_t packed_count = packed_count_of(packed);
    if ((row = PyTuple_New(CALL_FIELDS)) == NULL) goto done;
    PyObject *depth_object = PyLong_FromLongLong(depth);
    if (depth_object == NULL) goto done;
    Py_INCREF(start);
    Py_INCREF(end);
    Py_INCREF(no_error);
    PyTuple_SET_ITEM(row, 0, start);
    PyTuple_SET_ITEM(row, 1, end);
    PyTuple_SET_ITEM(row, 2, module_id);
    PyTuple_SET_ITEM(row, 3, depth_object);
    PyTuple_SET_ITEM(row, 4, input_id);
    PyTuple_SET_ITEM(row, 5, output_id);
    PyTuple_SET_ITEM(row, 6, no_error);
    module_id = input_id = output_id = NULL;  /* the row holds them now */
    if (PyList_Append(calls, row) < 0) goto done;
    *calls_length = PyList_GET_SIZE(calls) + (Py_ssize_t)packed_count;
    if (packed_count > 0 && !packed_fits(packed, packed_count, PACKED_ROW_BYTES, 1))
        /* full below its full size (a view held it, so it could not grow): compaction at the
         * caller's next chance puts a full-size one in its place, so that few rows become tuples */
        *calls_length = PY_SSIZE_T_MAX;
    status = 0;
done:
    Py_XDECREF(inputs);
    Py_XDECREF(outputs);
    Py_XDECREF(input_id);
    Py_XDECREF(output_id);
    Py_XDECREF(key);
    Py_XDECREF(module_id);
    Py_XDECREF(row);
    return status;
}

/* After the module raised: the clock read and the depth put back, the user's exception kept. */
static PyObject *clock_after_failure(FastCall *self, PyObject *buffer, long long depth, long long *end_ns) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *end = read_clock(self->now, end_ns);
    if (end == NULL) PyErr_Clear();
    if (slot_set_ll(buffer, self->buffer_slots.depth, depth) < 0) PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return end;
}

/* The call raised: the Python side records it (with its error text); the exception stays. */
static void failed(FastCall *self, PyObject *buffer, const Call *call, PyObject *start, PyObject *end,
                   long long depth) {
    PyObject *type, *value, *traceback, *args = NULL, *kwargs = NULL;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL) PyException_SetTraceback(value, traceback);
    PyObject *depth_object = PyLong_FromLongLong(depth);
    if (depth_object != NULL && unpacked(call, &args, &kwargs) == 0) {
        PyObject *noted = PyObject_CallFunctionObjArgs(self->on_error, buffer, CALL_MODULE(call), args, kwargs,
                                                       start, end ? end : Py_None, value ? value : Py_None,
                                                       depth_object, NULL);
        Py_XDECREF(noted);
    }
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(depth_object);
    PyErr_Clear();  /* recording the error must never replace the user's exception */
    PyErr_Restore(type, value, traceback);
}

static int compact_if_full(PyObject *buffer, Py_ssize_t length, Py_ssize_t compact_at) {
    if (length < compact_at) return 0;
    PyObject *compacted = PyObject_CallMethodNoArgs(buffer, s_compact);
    if (compacted == NULL) return -1;
    Py_DECREF(compacted);
    return 0;
}

/* Run the module one level deeper than `depth` and record the call that started at `start`:
 * the depth put back, a failure handed to Python. Returns the output (new reference), with
 * *end and *calls_length set; NULL on failure. */
static PyObject *run_and_record(FastCall *self, PyObject *buffer, const Call *call, long long depth,
                                PyObject *start, long long start_ns, PyObject **end, long long *end_ns,
                                Py_ssize_t *calls_length) {
    Py_ssize_t depth_slot = self->buffer_slots.depth;
    if (slot_set_ll(buffer, depth_slot, depth + 1) < 0) return NULL;
    const xsp_correlation *correlation = self->correlation;
    if (correlation != NULL) correlation->push((uint64_t)start_ns);  /* the call's start names it to CUPTI */
    PyObject *out = call_original(self, call);
    if (correlation != NULL) correlation->pop();
    if (out == NULL) {
        *end = clock_after_failure(self, buffer, depth, end_ns);
        failed(self, buffer, call, start, *end, depth);
        return NULL;
    }
    if ((*end = read_clock(self->now, end_ns)) == NULL || slot_set_ll(buffer, depth_slot, depth) < 0
        || record_call(self, buffer, call, depth, out, start, *end, start_ns, *end_ns, calls_length) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* paths -------------------------------------------------------------------------------- */

/* After the module ran with autograd on, at the layer level: hook the graph nodes of its output
 * for its backward span (a Python function, as the Python wrapper does). */
static int hook_backward_if_grad(FastCall *self, PyObject *buffer, PyObject *module, PyObject *out,
                                 PyObject *start) {
    int grad = grad_enabled(self);
    if (grad <= 0) return grad;
    PyObject *hooks = PyObject_GetAttr(self->recording, s_backward_hooks);
    if (hooks == NULL) return -1;
    int hooked = PyObject_IsTrue(hooks);
    Py_DECREF(hooks);
    if (hooked <= 0) return hooked;
    PyObject *done_hooking = PyObject_CallFunctionObjArgs(self->hook_backward, buffer, out, module, start, NULL);
    if (done_hooking == NULL) return -1;
    Py_DECREF(done_hooking);
    return 0;
}

static int slot_is_zero(PyObject *obj, Py_ssize_t offset) {
    PyObject *value = SLOT(obj, offset);
    return value != NULL && PyLong_CheckExact(value) && as_ll(value) == 0;
}

/* AutoSteps.call_begins, in C: what a top-level call does to its thread's steps. It is planned
 * first (reads only), so that a case C leaves to Python (inside xsp.step() or generate(), the
 * model's first call, a decided step someone must be told of) leaves everything as it was;
 * then carried out. */
enum { FINISH_NONE = 0, FINISH_AT_LAST_END, FINISH_TRAINING };

typedef struct {
    PyObject *steps, *recording_dict;
    int grad;
    /* the plan */
    int finish, marked, opens, lane, joins;
    PyObject *finished_type;  /* TRAIN or INFERENCE: the decided step's kind */
    long long step_start_ns, step_end_ns;
} CallPlan;

/* Whether a step decided as running from start_ns to end_ns is told to nobody (AutoSteps._decided
 * tells recording.on_long_step of a long one, or of one that ends past report_after_ns): 1 when
 * not, 0 when someone is (Python tells), -1 on error. `dict`: the recording's. */
static int nobody_to_tell(PyObject *dict, long long start_ns, long long end_ns) {
    PyObject *on_long_step = PyDict_GetItemWithError(dict, s_on_long_step);
    if (on_long_step == NULL) return PyErr_Occurred() ? -1 : 0;
    if (on_long_step == Py_None) return 1;
    long long long_step = dict_ll(dict, s_long_step_ns), report_after = dict_ll(dict, s_report_after_ns);
    if (PyErr_Occurred()) return -1;
    return end_ns - start_ns < long_step && end_ns < report_after;
}

/* The lane (AutoSteps.lane): the open step is this module's one call with autograd as now, so
 * this call only decides that step, told to nobody, and opens the next the same way, which leaves
 * every slot but start_ns as it is (what the Python wrapper does inline). 1 when the call takes
 * it, 0 when not, -1 on error. */
static int takes_lane(FastCall *self, PyObject *steps, PyObject *module, int grad, PyObject *recording_dict) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *lane = SLOT(steps, ss->lane), *lane_grad = SLOT(steps, ss->lane_grad);
    if (lane == NULL || lane_grad == NULL || !PyLong_CheckExact(lane) || (lane_grad == Py_True) != (grad == 1))
        return 0;
    void *lane_module = PyLong_AsVoidPtr(lane);
    if (lane_module == NULL) return PyErr_Occurred() ? -1 : 0;
    if (lane_module != (void *)module) return 0;
    long long start_ns = slot_ll(steps, ss->start_ns), last_end_ns = slot_ll(steps, ss->last_end_ns);
    if (PyErr_Occurred()) return -1;
    return nobody_to_tell(recording_dict, start_ns, last_end_ns);
}

/* 1: C carries the call's step out as planned; 0: Python decides it; -1: error. */
static int plan_call(FastCall *self, PyObject *buffer, PyObject *module, CallPlan *plan) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *steps = plan->steps, *dict = plan->recording_dict;
    PyObject *type = SLOT(steps, ss->type), *lane = SLOT(steps, ss->lane), *leader = SLOT(steps, ss->leader);
    PyObject *trained = SLOT(steps, ss->trained), *optimizer_seen = SLOT(steps, ss->optimizer_seen);
    PyObject *name = SLOT(steps, ss->name), *python_decides = SLOT(steps, ss->python_decides);
    PyObject *optimizer_starts = SLOT(buffer, self->buffer_slots.optimizer_starts);
    if (type == NULL || lane == NULL || leader == NULL || trained == NULL || optimizer_seen == NULL || name == NULL)
        return 0;
    if (!slot_is_zero(buffer, self->buffer_slots.open_steps) || !slot_is_zero(steps, ss->nested)) return 0;
    /* tentative ends or models joined (AutoSteps.python_decides), or a closure optimizer's call: Python */
    if (python_decides != Py_False || optimizer_starts == NULL || !PyList_Check(optimizer_starts)
        || PyList_GET_SIZE(optimizer_starts) != 0)
        return 0;
    if (type != self->step_none && type != self->step_inference && type != self->step_train) return 0;
    if (!PyUnicode_Check(name) || PyUnicode_GET_LENGTH(name) != 0) return 0;
    PyObject *paused = PyDict_GetItemWithError(dict, s_paused);
    if (paused != Py_False) return PyErr_Occurred() ? -1 : 0;
    void *lane_module = PyLong_AsVoidPtr(lane);
    void *leader_module = leader == Py_None ? NULL : PyLong_AsVoidPtr(leader);
    if (PyErr_Occurred()) return -1;
    int is_leader = leader_module == (void *)module, grad = plan->grad;
    if (!is_leader && lane_module != (void *)module) {
        PyObject *names = PyDict_GetItemWithError(dict, s_model_names);
        if (names == NULL || !PyDict_Check(names)) return PyErr_Occurred() ? -1 : 0;
        PyObject *key = PyLong_FromVoidPtr(module);
        if (key == NULL) return -1;
        int named = PyDict_Contains(names, key);
        Py_DECREF(key);
        if (named <= 0) return named;  /* its first call names the model: Python */
    }
    long long start_ns = slot_ll(steps, ss->start_ns), last_end_ns = slot_ll(steps, ss->last_end_ns);
    long long closed_ns = slot_ll(steps, ss->closed_ns), pieces = slot_ll(steps, ss->pieces);
    if (PyErr_Occurred()) return -1;
    plan->finish = FINISH_NONE;
    if (type == self->step_train) {
        int leads = is_leader || leader == Py_None;
        if (closed_ns && (!grad || leads)) {
            plan->finish = FINISH_TRAINING;  /* the next iteration, or an evaluation */
        } else if (grad && leads && optimizer_seen != Py_True) {
            if (trained == Py_True) return 0;  /* a tentative end (AutoSteps._tentative_end): Python */
            plan->finish = FINISH_AT_LAST_END;
        }
    } else if (type == self->step_inference && (grad || is_leader)) {
        plan->finish = FINISH_AT_LAST_END;
    } else if (type == self->step_inference) {
        /* another model joins the step (AutoSteps._joins): its first call since the leader's is
         * noted here; a second one in a row (the leader no longer called) is Python's to count */
        PyObject *joiner = SLOT(steps, ss->joiner), *joined = SLOT(steps, ss->joined);
        if (joiner == NULL || joined == NULL || !PyLong_CheckExact(joiner) || !PyList_CheckExact(joined)) return 0;
        void *joining = PyLong_AsVoidPtr(joiner);
        if (joining == NULL && PyErr_Occurred()) return -1;
        if (joining == (void *)module) return 0;
        plan->joins = 1;
    }
    plan->opens = plan->finish != FINISH_NONE || type == self->step_none;
    if (plan->finish != FINISH_NONE) {
        plan->step_start_ns = start_ns;
        plan->step_end_ns = plan->finish == FINISH_TRAINING ? closed_ns : last_end_ns;
        plan->finished_type = trained == Py_True ? self->step_train : self->step_inference;
        plan->marked = plan->finished_type == self->step_train || pieces > 1;
        int untold = nobody_to_tell(dict, plan->step_start_ns, plan->step_end_ns);
        if (untold <= 0) return untold;  /* someone is told of the decided step: Python tells */
    }
    if (plan->opens) {
        long long wait_ns = slot_ll(steps, ss->wait_ns);
        if (PyErr_Occurred()) return -1;
        plan->lane = !wait_ns && (!grad || optimizer_seen != Py_True);  /* the new step's pieces == 1 */
    }
    return 1;
}

/* AutoSteps._open: a step of the call's kind starts at `start` (or at the input wait before it,
 * or, training, where the last training step ended). */
static int open_step(FastCall *self, PyObject *steps, PyObject *module, CallPlan *plan, PyObject *start,
                     PyObject *resumed) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *waited = SLOT(steps, ss->wait_ns);
    long long wait_ns = as_ll(waited), resume_ns = plan->grad ? as_ll(resumed) : 0;
    if (PyErr_Occurred()) return -1;
    PyObject *opened = start;
    if (wait_ns && resume_ns) opened = wait_ns < resume_ns ? waited : resumed;
    else if (wait_ns) opened = waited;
    else if (resume_ns) opened = resumed;
    PyObject *leader = PyLong_FromVoidPtr(module);
    if (leader == NULL) return -1;
    slot_set(steps, ss->type, plan->grad ? self->step_train : self->step_inference);
    slot_set(steps, ss->start_ns, opened);
    slot_set(steps, ss->leader, leader);
    int failed = slot_set_ll(steps, ss->pieces, wait_ns ? 2 : 1) < 0;
    if (!failed && plan->lane) {
        slot_set(steps, ss->lane, leader);
        slot_set(steps, ss->lane_grad, plan->grad ? Py_True : Py_False);
    }
    Py_DECREF(leader);
    if (failed || slot_set_ll(steps, ss->wait_ns, 0) < 0 || slot_set_ll(steps, ss->resume_ns, 0) < 0) return -1;
    return 0;
}

/* AutoSteps._joins, a model's first call since the leader's: joiner = the model, joined = [(start,
 * the step's last end)]. */
static int note_join(const StepsSlots *ss, PyObject *steps, PyObject *module, PyObject *start) {
    PyObject *joiner = PyLong_FromVoidPtr(module);
    if (joiner == NULL) return -1;
    PyObject *call = PyTuple_Pack(2, start, SLOT(steps, ss->last_end_ns));
    PyObject *joined = call == NULL ? NULL : PyList_New(1);
    if (joined == NULL) {
        Py_DECREF(joiner);
        Py_XDECREF(call);
        return -1;
    }
    PyList_SET_ITEM(joined, 0, call);
    slot_set(steps, ss->joiner, joiner);
    slot_set(steps, ss->joined, joined);
    Py_DECREF(joiner);
    Py_DECREF(joined);
    return 0;
}

/* AutoSteps._reset's joiner = 0 and joined = [] (in place: nothing else holds the list). */
static int forget_joins(const StepsSlots *ss, PyObject *steps, PyObject *zero) {
    PyObject *joined = SLOT(steps, ss->joined);
    slot_set(steps, ss->joiner, zero);
    if (joined != NULL && PyList_CheckExact(joined) && PyList_GET_SIZE(joined))
        return PyList_SetSlice(joined, 0, PyList_GET_SIZE(joined), NULL);
    return 0;
}

/* Carry the plan out (call_begins's writes); the call starts at `start`. */
static int begin_step(FastCall *self, PyObject *buffer, PyObject *module, CallPlan *plan, PyObject *start) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *steps = plan->steps, *zero = NULL, *resumed = NULL;
    int status = -1;
    if ((zero = PyLong_FromLong(0)) == NULL) return -1;
    slot_set(steps, ss->lane, zero);
    if (plan->finish == FINISH_NONE && !plan->opens) {  /* the call joins the open step */
        long long pieces = slot_ll(steps, ss->pieces);
        status = pieces == -1 && PyErr_Occurred() ? -1 : slot_set_ll(steps, ss->pieces, pieces + 1);
        if (status == 0 && plan->joins) status = note_join(ss, steps, module, start);
        Py_DECREF(zero);
        return status;
    }
    resumed = SLOT(steps, ss->resume_ns);
    Py_INCREF(resumed);
    if (plan->finish != FINISH_NONE) {  /* AutoSteps._finish: the decided step's record, the state reset */
        int training = plan->finished_type == self->step_train;
        if (plan->marked) {
            PyObject *step_start = SLOT(steps, ss->start_ns);
            PyObject *step_end = plan->finish == FINISH_TRAINING ? SLOT(steps, ss->closed_ns)
                                                                 : SLOT(steps, ss->last_end_ns);
            if (plan->step_end_ns < plan->step_start_ns) step_end = step_start;
            if (append_mark(&self->buffer_slots, buffer, self->mark_step, step_start, step_end,
                            training ? self->train_step_name : self->inference_step_name,
                            training ? self->train_attributes : self->inference_attributes, Py_None) < 0)
                goto done;
        }
        Py_SETREF(resumed, plan->finish == FINISH_TRAINING ? Py_NewRef(SLOT(steps, ss->closed_ns)) : Py_NewRef(zero));
        slot_set(steps, ss->lane_grad, Py_False);
        slot_set(steps, ss->type, self->step_none);
        slot_set(steps, ss->start_ns, zero);
        slot_set(steps, ss->last_end_ns, zero);
        slot_set(steps, ss->closed_ns, zero);
        slot_set(steps, ss->leader, Py_None);
        slot_set(steps, ss->pieces, zero);
        slot_set(steps, ss->trained, Py_False);
        slot_set(steps, ss->closed_by, zero);
        if (forget_joins(ss, steps, zero) < 0) goto done;
    }
    status = open_step(self, steps, module, plan, start, resumed);
done:
    Py_XDECREF(resumed);
    Py_DECREF(zero);
    return status;
}

/* AutoSteps.call_ends */
static int end_step_piece(FastCall *self, PyObject *buffer, PyObject *steps, PyObject *end, long long end_ns) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *type = SLOT(steps, ss->type);
    if (type == NULL || type == self->step_none || !slot_is_zero(steps, ss->nested)
        || !slot_is_zero(buffer, self->buffer_slots.open_steps))
        return 0;
    long long last_end_ns = slot_ll(steps, ss->last_end_ns);
    if (last_end_ns == -1 && PyErr_Occurred()) return -1;
    if (end_ns > last_end_ns) slot_set(steps, ss->last_end_ns, end);
    return 0;
}

/* Record a top-level call's (start, flags), as the Python path's buffer.roots.append does: into
 * buffer.packed_roots as two int64s while buffer.roots is empty, after moving the Python path's
 * rows there where they fit (compaction takes the packed rows first), else as a tuple onto
 * buffer.roots. */
static int record_root(const BufferSlots *slots, PyObject *buffer, PyObject *start, long long start_ns, long flags,
                       Py_ssize_t full_rows) {
    /* read now: a step's listeners (Python) ran since the call began, and another thread may have
     * compacted the buffer meanwhile */
    PyObject *roots = SLOT(buffer, slots->roots), *packed = SLOT(buffer, slots->packed_roots);
    if (roots == NULL || !PyList_Check(roots)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its roots");
        return -1;
    }
    if (packed != NULL && PyByteArray_CheckExact(packed)) {
        int64_t values[ROOT_FIELDS] = {start_ns, flags};
        Py_ssize_t packed_rows = pack_behind_list(roots, packed, values, ROOT_FIELDS, full_rows);
        if (packed_rows != 0) return packed_rows < 0 ? -1 : 0;
    }
    PyObject *flags_object = PyLong_FromLong(flags);
    if (flags_object == NULL) return -1;
    PyObject *row = PyTuple_Pack(2, start, flags_object);
    Py_DECREF(flags_object);
    if (row == NULL) return -1;
    int appended = PyList_Append(roots, row);
    Py_DECREF(row);
    return appended;
}

/* A top-level call whose step C can decide (plan_call). *declined: it cannot (then nothing
 * was done, and the caller takes the Python path). */
static PyObject *top_call(FastCall *self, PyObject *buffer, const Call *call, uint64_t thread, int *declined) {
    const BufferSlots *slots = &self->buffer_slots;
    PyObject *module = CALL_MODULE(call);
    PyObject *steps = SLOT(buffer, slots->steps);
    *declined = 1;
    if (steps == NULL || !Py_IS_TYPE(steps, (PyTypeObject *)self->steps_type)) return NULL;
    PyObject *aside = SLOT(buffer, slots->aside), *roots = SLOT(buffer, slots->roots);
    if (aside == NULL || roots == NULL || !PyList_Check(roots) || !slot_is_zero(buffer, slots->aside)) return NULL;
    CallPlan plan = {.steps = steps};
    if ((plan.grad = grad_enabled(self)) < 0) return NULL;
    if (self->jit_tracing != Py_None) {  /* None: every jit tracer entry sets buffer.aside */
        PyObject *tracing = PyObject_CallNoArgs(self->jit_tracing);
        if (tracing == NULL) return NULL;
        int traced = tracing != Py_None && PyObject_IsTrue(tracing) != 0;
        Py_DECREF(tracing);
        if (traced) return NULL;
    }
    if (self->graph_task_id != NULL) {  /* a backward runs on this thread: a checkpoint's recomputation, Python's */
        PyObject *task = PyObject_CallNoArgs(self->graph_task_id);
        if (task == NULL) return NULL;
        long long id = PyLong_Check(task) ? as_ll(task) : -1;
        Py_DECREF(task);
        if (id != -1) return NULL;
    }
    if ((plan.recording_dict = PyObject_GenericGetDict(self->recording, NULL)) == NULL) return NULL;
    int laned = takes_lane(self, steps, module, plan.grad, plan.recording_dict);
    int planned = laned ? laned : plan_call(self, buffer, module, &plan);
    Py_DECREF(plan.recording_dict);
    if (planned <= 0) return NULL;
    PyObject *dict = PyObject_GenericGetDict(module, NULL);
    if (dict == NULL) return NULL;
    long flags = plan.grad ? ROOT_GRAD : 0;
    PyObject *mode = PyDict_GetItemWithError(dict, s_training);  /* borrowed */
    int training = mode == NULL ? -2 : PyObject_IsTrue(mode);
    Py_DECREF(dict);
    if (PyErr_Occurred()) return NULL;
    flags |= training == -2 ? ROOT_MODE_UNKNOWN : training ? ROOT_TRAINING : 0;
    /* from here the call is C's */
    *declined = 0;
    PyObject *start = NULL, *end = NULL, *out = NULL, *result = NULL;
    long long start_ns, end_ns;
    Py_INCREF(steps);
    if ((start = read_clock(self->now, &start_ns)) == NULL) goto done;
    if (laned) slot_set(steps, self->steps_slots.start_ns, start);
    else if (begin_step(self, buffer, module, &plan, start) < 0) goto done;
    slot_set(buffer, slots->skipping, Py_False);
    if (record_root(slots, buffer, start, start_ns, flags, self->compact_at) < 0) goto done;
    Py_ssize_t length = 0;
    if (self->mode == MODE_ROOTS) self->running_thread = thread;
    out = run_and_record(self, buffer, call, 0, start, start_ns, &end, &end_ns, &length);
    if (self->running_thread == thread) self->running_thread = 0;  /* after a failure too */
    if (out == NULL) goto done;
    if (self->mode == MODE_ALL && hook_backward_if_grad(self, buffer, module, out, start) < 0) goto done;
    if (compact_if_full(buffer, length, self->compact_at) < 0) goto done;
    if (end_step_piece(self, buffer, steps, end, end_ns) < 0) goto done;
    result = out;
    out = NULL;
done:
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(out);
    Py_DECREF(steps);
    return result;
}

/* A call inside a top-level call, ALL mode: recorded at its depth. */
static PyObject *nested_call(FastCall *self, PyObject *buffer, const Call *call, long long depth) {
    PyObject *start = NULL, *end = NULL, *out = NULL, *result = NULL;
    long long start_ns, end_ns;
    Py_ssize_t length = 0;
    if ((start = read_clock(self->now, &start_ns)) == NULL) goto done;
    if ((out = run_and_record(self, buffer, call, depth, start, start_ns, &end, &end_ns, &length)) == NULL)
        goto done;
    if (hook_backward_if_grad(self, buffer, CALL_MODULE(call), out, start) < 0) goto done;
    if (depth < 2 && compact_if_full(buffer, length, self->compact_at) < 0) goto done;
    result = out;
    out = NULL;
done:
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(out);
    return result;
}

/* nn.Module.__call__(module, *args, **kwargs) */
static PyObject *fastcall_vectorcall(PyObject *callable, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    FastCall *self = (FastCall *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "nn.Module.__call__ needs the module as its first argument");
        return NULL;
    }
    const Call call = {.argv = argv, .nargsf = nargsf, .nargs = nargs - 1, .kwnames = kwnames};
    uint64_t thread = current_thread();
    if (self->running_thread == thread) return call_original(self, &call);  /* MODE_ROOTS */
    PyObject *buffer = thread_buffer(self->local, &self->cache, thread);
    if (buffer == NULL && !PyErr_Occurred())  /* this thread's first record */
        buffer = PyObject_CallMethodNoArgs(self->recording, s_new_buffer);
    if (buffer == NULL || !Py_IS_TYPE(buffer, (PyTypeObject *)self->buffer_type)) {
        PyErr_Clear();  /* no ThreadBuffer: the Python path says what is wrong */
        Py_XDECREF(buffer);
        return call_with_module(self->slow, &call);
    }
    PyObject *result = NULL;
    long long depth = slot_ll(buffer, self->buffer_slots.depth);
    if (depth == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        result = call_with_module(self->slow, &call);
        goto done;
    }
    if (self->mode == MODE_ROOTS) {
        if (depth) {  /* inside a top-level call: the model level needs no exact depth */
            result = call_original(self, &call);
            goto done;
        }
    } else if (depth) {
        PyObject *skipping = SLOT(buffer, self->buffer_slots.skipping);
        result = skipping == Py_False ? nested_call(self, buffer, &call, depth) : call_with_module(self->slow, &call);
        goto done;
    }
    int declined = 0;
    result = top_call(self, buffer, &call, thread, &declined);
    if (result == NULL && declined) {
        PyErr_Clear();
        result = call_with_module(self->slow, &call);
    }
done:
    Py_DECREF(buffer);
    return result;
}

/* 1 when torch.compiler says nothing is being compiled (dynamo or export, on any thread), 0 when
 * it says something is or cannot say (no `compiler`, no flag, an error). */
static int surely_eager(FastCall *self) {
    if (self->compiler == NULL || self->compiler == Py_None) return 0;
    PyObject *flag = PyObject_GetAttr(self->compiler, s_is_compiling_flag);
    if (flag == NULL) {
        PyErr_Clear();
        return 0;
    }
    int eager = flag == Py_False;
    Py_DECREF(flag);
    return eager;
}

/* Read as an attribute, the object gives its `exposed` Python function (bound to the instance
 * it is read from), which is what tools that look at nn.Module.__call__ can work with. Read on an
 * instance while nothing is compiled (`super().__call__(x)`, as torch.compile's OptimizedModule
 * calls its module, or `model.__call__`), it gives itself, bound: a call of that runs no Python
 * frame of xsp's, and no on_read. */
static PyObject *fastcall_descr_get(PyObject *callable, PyObject *instance, PyObject *owner) {
    FastCall *self = (FastCall *)callable;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    int eager = surely_eager(self);
    if (!eager && self->on_read != NULL && self->on_read != Py_None) {
        PyObject *done = PyObject_CallNoArgs(self->on_read);
        Py_XDECREF(done);
    }
    PyErr_Clear();  /* reading an attribute must not fail because of xsp */
    PyErr_Restore(type, value, traceback);
    PyObject *function = self->exposed != NULL && self->exposed != Py_None ? self->exposed : callable;
    if (instance == NULL || instance == Py_None) return Py_NewRef(function);
    return PyMethod_New(eager ? callable : function, instance);
}

/* `obj`'s attribute `name`, or, when it has none, `delegate`'s (none when `delegate` is NULL):
 * what a C object standing in for a Python function answers for the function's attributes. */
static PyObject *own_or_delegates(PyObject *obj, PyObject *name, PyObject *delegate) {
    PyObject *value = PyObject_GenericGetAttr(obj, name);
    if (value != NULL || delegate == NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return value;
    PyErr_Clear();
    return PyObject_GetAttr(delegate, name);
}

/* Attributes it lacks are `exposed`'s (__code__, __closure__, __wrapped__, __name__...): dynamo
 * reads the class dict's entry for nn.Module.__call__ and guards on its closure, as it would on
 * the function it inlined. */
static PyObject *fastcall_getattro(PyObject *callable, PyObject *name) {
    return own_or_delegates(callable, name, ((FastCall *)callable)->exposed);
}

static PyMemberDef fastcall_members[] = {
    {"exposed", T_OBJECT, offsetof(FastCall, exposed), 0,
     "What reading the attribute gives (a Python function doing the same); None: the object itself."},
    {"on_read", T_OBJECT, offsetof(FastCall, on_read), 0, "Called with no arguments before each read."},
    {"compiler", T_OBJECT, offsetof(FastCall, compiler), 0,
     "torch.compiler, when its _is_compiling_flag is False exactly while nothing is compiled: reading the "
     "attribute on an instance then gives the object itself, bound, and on_read is not called."},
    {"original", T_OBJECT, offsetof(FastCall, original), READONLY, "nn.Module.__call__ as it was."},
    {NULL},
};

/* loop events ------------------------------------------------------------------------- */
/* The model-level events of a training loop besides module calls (tracers/_loop_events.py):
 * a backward pass and an optimizer step, recorded as marks with their effect on the thread's
 * automatic steps (AutoSteps.piece_ends and optimizer_ends), as the Python hooks do. */
typedef struct {
    PyObject_HEAD
    BufferCache cache;
    PyObject *local;            /* recording.local */
    PyObject *new_buffer;       /* recording.new_buffer: makes the buffer of a thread that has none */
    PyObject *now;
    PyObject *error_text;       /* (exception) -> str */
    PyObject *optimizer_names;  /* type -> "<class name>.step" */
    PyObject *buffer_type, *steps_type;
    PyObject *step_none, *step_train, *mark_backward, *mark_optimizer, *backward_name;
    BufferSlots buffer_slots;
    StepsSlots steps_slots;
} StepEvents;

static PyTypeObject StepEventsType;

/* The calling thread's buffer (new reference), created on its first record. */
static PyObject *events_buffer(StepEvents *self) {
    PyObject *buffer = thread_buffer(self->local, &self->cache, current_thread());
    if (buffer == NULL) {
        if (PyErr_Occurred()) return NULL;
        buffer = PyObject_CallNoArgs(self->new_buffer);  /* this thread's first record */
        if (buffer == NULL) return NULL;
    }
    if (!Py_IS_TYPE(buffer, (PyTypeObject *)self->buffer_type)) {
        Py_DECREF(buffer);
        PyErr_SetString(PyExc_TypeError, "xsp: recording.local.b is no ThreadBuffer");
        return NULL;
    }
    return buffer;
}

/* A piece of the open step ended at `end` (AutoSteps.piece_ends with trains, and the common
 * case of optimizer_ends); 1 when `optimizer` and no step is open: the caller asks Python. */
static int piece_ended(StepEvents *self, PyObject *buffer, PyObject *end, long long end_ns, PyObject *optimizer) {
    const StepsSlots *ss = &self->steps_slots;
    PyObject *steps = SLOT(buffer, self->buffer_slots.steps);
    if (steps == NULL || !Py_IS_TYPE(steps, (PyTypeObject *)self->steps_type)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its steps");
        return -1;
    }
    PyObject *type = SLOT(steps, ss->type);
    if (type == NULL) {
        PyErr_SetString(PyExc_AttributeError, "xsp: steps without a type");
        return -1;
    }
    if (optimizer != NULL && (type == self->step_none || SLOT(steps, ss->python_decides) != Py_False)) return 1;
    if (slot_set_ll(steps, ss->lane, 0) < 0) return -1;
    if (optimizer != NULL) slot_set(steps, ss->optimizer_seen, Py_True);
    if (type == self->step_none || !slot_is_zero(buffer, self->buffer_slots.open_steps)
        || !slot_is_zero(steps, ss->nested) || !slot_is_zero(buffer, self->buffer_slots.depth))
        return 0;
    long long pieces = slot_ll(steps, ss->pieces), last_end_ns = slot_ll(steps, ss->last_end_ns);
    if (PyErr_Occurred()) return -1;
    if (slot_set_ll(steps, ss->pieces, pieces + 1) < 0) return -1;
    slot_set(steps, ss->trained, Py_True);
    if (end_ns > last_end_ns) slot_set(steps, ss->last_end_ns, end);
    if (optimizer != NULL) {
        PyObject *closed_by = PyLong_FromVoidPtr(optimizer);
        if (closed_by == NULL) return -1;
        slot_set(steps, ss->type, self->step_train);  /* an optimizer after a no-grad call: training */
        slot_set(steps, ss->closed_ns, end);
        slot_set(steps, ss->closed_by, closed_by);
        Py_DECREF(closed_by);
    }
    return 0;
}

/* torch.autograd.backward ran from `start` and gave `out` (NULL: it raised): its mark and its
 * effect on the steps recorded; returns `out`, or NULL with the user's exception (recording never
 * replaces it). Consumes `buffer` and `start`. */
static PyObject *backward_done(StepEvents *self, PyObject *buffer, PyObject *start, PyObject *out) {
    PyObject *end = NULL, *error = NULL;
    long long end_ns;
    PyObject *type = NULL, *value = NULL, *traceback = NULL;
    if (out == NULL) {
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback != NULL && value != NULL) PyException_SetTraceback(value, traceback);
        error = PyObject_CallOneArg(self->error_text, value ? value : Py_None);
        if (error == NULL) PyErr_Clear();
    }
    if ((end = read_clock(self->now, &end_ns)) == NULL
        || append_mark(&self->buffer_slots, buffer, self->mark_backward, start, end, self->backward_name, Py_None,
                       error ? error : Py_None) < 0
        || piece_ended(self, buffer, end, end_ns, NULL) < 0) {
        if (out == NULL) PyErr_Clear();
        else Py_CLEAR(out);
    }
    if (type != NULL) PyErr_Restore(type, value, traceback);
    Py_DECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(error);
    Py_DECREF(buffer);
    return out;
}

/* torch.autograd.backward, timed and recorded: what tracers/_loop_events.py puts in its place
 * (BackwardCall below), an object of C so that a backward pass runs no Python frame of xsp's.
 * Dynamo never runs it while tracing: it rewrites Tensor.backward itself, and skips
 * torch.autograd.backward (a graph break, with or without xsp). */
typedef struct {
    PyObject_HEAD
    StepEvents *events;
    PyObject *original;
    vectorcallfunc vectorcall;
} BackwardCall;

static PyObject *backward_vectorcall(PyObject *callable, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    BackwardCall *self = (BackwardCall *)callable;
    PyObject *buffer = events_buffer(self->events), *start = NULL;
    long long start_ns;
    if (buffer == NULL || (start = read_clock(self->events->now, &start_ns)) == NULL) {
        PyErr_Clear();  /* nothing can be recorded: the pass runs all the same */
        Py_XDECREF(buffer);
        return PyObject_Vectorcall(self->original, argv, nargsf, kwnames);
    }
    return backward_done(self->events, buffer, start, PyObject_Vectorcall(self->original, argv, nargsf, kwnames));
}

/* Attributes it lacks are the original's (__name__, __qualname__, __dict__...), and so are __doc__
 * and __module__ (its type's otherwise), as functools.wraps would have copied them. */
static PyObject *backward_getattro(PyObject *callable, PyObject *name) {
    if (PyUnicode_Check(name) && (PyUnicode_CompareWithASCIIString(name, "__doc__") == 0
                                  || PyUnicode_CompareWithASCIIString(name, "__module__") == 0))
        return PyObject_GetAttr(((BackwardCall *)callable)->original, name);
    return own_or_delegates(callable, name, ((BackwardCall *)callable)->original);
}

static PyObject *backward_repr(PyObject *callable) {
    return PyUnicode_FromFormat("<xsp's timing of %R>", ((BackwardCall *)callable)->original);
}

static PyObject *backward_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *events, *original;
    static const char *kwlist[] = {"events", "original", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O", (char **)kwlist, &StepEventsType, &events, &original))
        return NULL;
    BackwardCall *self = (BackwardCall *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->events = (StepEvents *)Py_NewRef(events);
    self->original = Py_NewRef(original);
    self->vectorcall = backward_vectorcall;
    return (PyObject *)self;
}

#define EACH_BACKWARD_FIELD(DO) DO(self->events); DO(self->original)

GC_FUNCTIONS(backward_call, BackwardCall, EACH_BACKWARD_FIELD)

static PyMemberDef backward_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(BackwardCall, original), READONLY, "torch.autograd.backward as it was."},
    {NULL},
};

static PyTypeObject BackwardCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp._hotpath.BackwardCall",
    .tp_doc = PyDoc_STR("BackwardCall(events, original): original(*args, **kwargs), timed and recorded as a "
                        "backward pass by events (a StepEvents)."),
    .tp_basicsize = sizeof(BackwardCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = backward_new,
    .tp_getattro = backward_getattro,
    .tp_repr = backward_repr,
    .tp_members = backward_members,
    .tp_dealloc = (destructor)backward_call_dealloc,
    .tp_traverse = (traverseproc)backward_call_traverse,
    .tp_clear = (inquiry)backward_call_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(BackwardCall, vectorcall),
};

/* optimizer_begins(): an optimizer step starts on this thread (the pre-hook). */
/* optimizer_begins(optimizer) -> bool: the pre-hook. True when Python must hear of it
 * (AutoSteps.optimizer_begins): a step an optimizer closed is open, and the same optimizer stepping
 * again begins the next iteration (a closure optimizer's loop). */
static PyObject *events_optimizer_begins(StepEvents *self, PyObject *optimizer) {
    PyObject *buffer = events_buffer(self);
    if (buffer == NULL) return NULL;
    PyObject *starts = SLOT(buffer, self->buffer_slots.optimizer_starts), *start = NULL;
    PyObject *steps = SLOT(buffer, self->buffer_slots.steps);
    long long start_ns;
    int status = -1, tell = 0;
    if (starts == NULL || !PyList_Check(starts) || steps == NULL || !Py_IS_TYPE(steps, (PyTypeObject *)self->steps_type))
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its optimizer starts or steps");
    else if ((start = read_clock(self->now, &start_ns)) != NULL && (status = PyList_Append(starts, start)) == 0)
        status = slot_set_ll(steps, self->steps_slots.lane, 0);
    if (status == 0) {
        long long closed_ns = slot_ll(steps, self->steps_slots.closed_ns);
        if (closed_ns == -1 && PyErr_Occurred()) status = -1;
        tell = SLOT(steps, self->steps_slots.type) == self->step_train && closed_ns != 0;
    }
    (void)optimizer;
    Py_XDECREF(start);
    Py_DECREF(buffer);
    if (status < 0) return NULL;
    return PyBool_FromLong(tell);
}

/* optimizer_ends(optimizer) -> None, or (start, end) when Python must tell the steps (no step
 * was open: AutoSteps.optimizer_ends opens one). The post-hook. */
static PyObject *events_optimizer_ends(StepEvents *self, PyObject *optimizer) {
    PyObject *buffer = events_buffer(self);
    if (buffer == NULL) return NULL;
    PyObject *start = NULL, *end = NULL, *name = NULL, *result = NULL;
    long long end_ns;
    if ((end = read_clock(self->now, &end_ns)) == NULL) goto done;
    PyObject *starts = SLOT(buffer, self->buffer_slots.optimizer_starts);
    if (starts == NULL || !PyList_Check(starts)) {
        PyErr_SetString(PyExc_TypeError, "xsp: a thread buffer without its optimizer starts");
        goto done;
    }
    Py_ssize_t open = PyList_GET_SIZE(starts);
    if (open) {
        start = PyList_GET_ITEM(starts, open - 1);
        Py_INCREF(start);
        if (PyList_SetSlice(starts, open - 1, open, NULL) < 0) goto done;
    } else {
        start = end;
        Py_INCREF(start);
    }
    PyObject *kind = (PyObject *)Py_TYPE(optimizer);
    name = PyDict_GetItemWithError(self->optimizer_names, kind);
    if (name != NULL) {
        Py_INCREF(name);
    } else {
        if (PyErr_Occurred()) goto done;
        PyObject *class_name = PyObject_GetAttrString(kind, "__name__");
        if (class_name == NULL) goto done;
        name = PyUnicode_FromFormat("%U.step", class_name);
        Py_DECREF(class_name);
        if (name == NULL || PyDict_SetItem(self->optimizer_names, kind, name) < 0) goto done;
    }
    if (append_mark(&self->buffer_slots, buffer, self->mark_optimizer, start, end, name, Py_None, Py_None) < 0) goto done;
    int asks = piece_ended(self, buffer, end, end_ns, optimizer);
    if (asks < 0) goto done;
    result = asks ? PyTuple_Pack(2, start, end) : Py_NewRef(Py_None);
done:
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(name);
    Py_DECREF(buffer);
    return result;
}

static PyMethodDef events_methods[] = {
    {"optimizer_begins", (PyCFunction)events_optimizer_begins, METH_O,
     "optimizer_begins(optimizer) -> bool: an optimizer step starts; True when AutoSteps.optimizer_begins must hear."},
    {"optimizer_ends", (PyCFunction)events_optimizer_ends, METH_O,
     "optimizer_ends(optimizer) -> None, or (start, end) for AutoSteps.optimizer_ends when no step is open."},
    {NULL, NULL, 0, NULL},
};

static const char *events_kwlist[] = {"local", "new_buffer", "now", "error_text", "optimizer_names", "buffer_type",
                                      "steps_type", "step_constants", "mark_backward", "mark_optimizer",
                                      "backward_name", NULL};

static int events_init(StepEvents *self, PyObject *args, PyObject *kwds) {
    PyObject *local, *new_buffer, *now, *error_text, *names, *buffer_type, *steps_type, *constants, *backward,
        *optimizer, *backward_name;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO!O!O!O!OOU", (char **)events_kwlist, &local, &new_buffer, &now,
                                     &error_text, &PyDict_Type, &names, &PyType_Type, &buffer_type, &PyType_Type,
                                     &steps_type, &PyTuple_Type, &constants, &backward, &optimizer, &backward_name))
        return -1;
    if (PyTuple_GET_SIZE(constants) != CONSTANTS) {
        PyErr_SetString(PyExc_TypeError, "step_constants: as auto_steps.hotpath_constants() gives them");
        return -1;
    }
    if (find_slots(buffer_type, steps_type, &self->buffer_slots, &self->steps_slots) < 0) return -1;
    PyObject *values[] = {local, new_buffer, now, error_text, names, buffer_type, steps_type,
                          PyTuple_GET_ITEM(constants, 0), PyTuple_GET_ITEM(constants, 2), backward, optimizer,
                          backward_name};
    PyObject **fields[] = {&self->local, &self->new_buffer, &self->now, &self->error_text, &self->optimizer_names,
                           &self->buffer_type, &self->steps_type, &self->step_none, &self->step_train,
                           &self->mark_backward, &self->mark_optimizer, &self->backward_name};
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        Py_INCREF(values[i]);
        Py_XSETREF(*fields[i], values[i]);
    }
    return 0;
}

#define EACH_EVENTS_FIELD(DO) \
    DO(self->local); DO(self->new_buffer); DO(self->now); DO(self->error_text); DO(self->optimizer_names); \
    DO(self->buffer_type); DO(self->steps_type); DO(self->step_none); DO(self->step_train); \
    DO(self->mark_backward); DO(self->mark_optimizer); DO(self->backward_name); EACH_CACHED(DO)

GC_FUNCTIONS(events, StepEvents, EACH_EVENTS_FIELD)

static PyTypeObject StepEventsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp._hotpath.StepEvents",
    .tp_doc = PyDoc_STR("StepEvents(local, new_buffer, now, error_text, optimizer_names, buffer_type, steps_type, "
                        "step_constants, mark_backward, mark_optimizer, backward_name): backward passes and "
                        "optimizer steps, recorded."),
    .tp_basicsize = sizeof(StepEvents),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)events_init,
    .tp_dealloc = (destructor)events_dealloc,
    .tp_traverse = (traverseproc)events_traverse,
    .tp_clear = (inquiry)events_clear,
    .tp_methods = events_methods,
};

/* The columns pack_columns and split_rows fill: a tuple of `count`-value bytes objects, column i
 * of itemsizes[i] bytes a value (1, 2, 4 or 8), with their sizes and data in `sizes` and `out`
 * (room for 16); NULL with an exception set for any other width or item size. */
static PyObject *new_columns(PyObject *itemsizes, Py_ssize_t count, int *sizes, char **out) {
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
static int store_value(char *column, int size, Py_ssize_t row, long long value) {
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
static PyObject *pack_columns(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
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
static PyObject *split_rows(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
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
static PyObject *empty_packed(PyObject *module, PyObject *size_object) {
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

static PyMethodDef hotpath_functions[] = {
    {"empty_packed", (PyCFunction)empty_packed, METH_O,
     "empty_packed(size) -> bytearray of size bytes, the first eight zero, the rest not written."},
    {"pack_columns", (PyCFunction)(void (*)(void))pack_columns, METH_FASTCALL,
     "pack_columns(rows, itemsizes) -> tuple of bytes, one per column."},
    {"split_rows", (PyCFunction)(void (*)(void))split_rows, METH_FASTCALL,
     "split_rows(data, itemsizes) -> tuple of bytes, one per column of data's int64 rows."},
    {NULL, NULL, 0, NULL},
};

/* the type ----------------------------------------------------------------------------- */
static const char *kwlist[] = {"mode", "original", "slow", "local", "recording", "now", "grad_enabled",
                               "jit_tracing", "tensor_type", "describe_inputs", "describe", "on_error",
                               "hook_backward", "buffer_type", "steps_type", "step_constants", "compact_at",
                               "native_grad_mode", "correlation", "graph_task_id", NULL};

#define FIELDS 14

/* torch.Tensor.shape's descriptor and getter, for tensor_shape; none (NULL) where it is no
 * getset descriptor of the class (then tensor_shape looks the attribute up). */
static void find_shape_descriptor(FastCall *self) {
    PyTypeObject *type = (PyTypeObject *)self->tensor_type;
    Py_CLEAR(self->shape_descriptor);
    self->shape_get = NULL;
    PyObject *descriptor = PyObject_GetAttr((PyObject *)type, s_shape);  /* the descriptor itself, on a class */
    if (descriptor == NULL) {
        PyErr_Clear();
        return;
    }
    if (!Py_IS_TYPE(descriptor, &PyGetSetDescr_Type) || Py_TYPE(descriptor)->tp_descr_get == NULL
        || !PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) {
        Py_DECREF(descriptor);
        return;
    }
    self->shape_descriptor = descriptor;
    self->shape_get = Py_TYPE(descriptor)->tp_descr_get;
    self->shape_version = type->tp_version_tag;
}

static int fastcall_init(FastCall *self, PyObject *args, PyObject *kwds) {
    PyObject *items[FIELDS] = {NULL}, *constants = NULL;
    Py_ssize_t compact_at = 512;
    int mode = 0;
    PyObject *native_grad_mode = NULL, *correlation = NULL, *graph_task_id = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOOOOOOOOOOOOO!|nO!OO", (char **)kwlist, &mode, &items[0],
                                     &items[1], &items[2], &items[3], &items[4], &items[5], &items[6], &items[7],
                                     &items[8], &items[9], &items[10], &items[11], &items[12], &items[13],
                                     &PyTuple_Type, &constants, &compact_at, &PyLong_Type, &native_grad_mode,
                                     &correlation, &graph_task_id))
        return -1;
    const xsp_correlation *hooks = NULL;
    if (correlation != NULL && correlation != Py_None) {
        hooks = PyCapsule_GetPointer(correlation, XSP_CORRELATION_CAPSULE);
        if (hooks == NULL) return -1;  /* not xsp._activity's capsule: TypeError or ValueError set */
    }
    void *grad_mode_address = native_grad_mode == NULL ? NULL : PyLong_AsVoidPtr(native_grad_mode);
    if (grad_mode_address == NULL && PyErr_Occurred()) return -1;
    if (mode != MODE_ROOTS && mode != MODE_ALL) {
        PyErr_SetString(PyExc_ValueError, "mode must be 1 (roots) or 2 (all)");
        return -1;
    }
    if (!PyType_Check(items[7]) || !PyType_Check(items[12]) || !PyType_Check(items[13])) {
        PyErr_SetString(PyExc_TypeError, "tensor_type, buffer_type and steps_type must be types");
        return -1;
    }
    if (PyTuple_GET_SIZE(constants) != CONSTANTS) {
        PyErr_SetString(PyExc_TypeError, "step_constants: as auto_steps.hotpath_constants() gives them");
        return -1;
    }
    if (find_slots(items[12], items[13], &self->buffer_slots, &self->steps_slots) < 0) return -1;
    PyObject **fields[FIELDS] = {&self->original, &self->slow, &self->local, &self->recording, &self->now,
                                 &self->grad_enabled, &self->jit_tracing, &self->tensor_type, &self->describe_inputs,
                                 &self->describe, &self->on_error, &self->hook_backward, &self->buffer_type,
                                 &self->steps_type};
    for (int i = 0; i < FIELDS; i++) {
        Py_INCREF(items[i]);
        Py_XSETREF(*fields[i], items[i]);
    }
    PyObject **constant_fields[CONSTANTS] = {&self->step_none, &self->step_inference, &self->step_train,
                                             &self->mark_step, &self->train_step_name, &self->train_attributes,
                                             &self->inference_step_name, &self->inference_attributes};
    for (int i = 0; i < CONSTANTS; i++) {
        PyObject *item = PyTuple_GET_ITEM(constants, i);
        Py_INCREF(item);
        Py_XSETREF(*constant_fields[i], item);
    }
    self->mode = mode;
    self->compact_at = compact_at;
    Py_XSETREF(self->correlation_capsule, hooks == NULL ? NULL : Py_NewRef(correlation));
    self->correlation = hooks;
    Py_XSETREF(self->graph_task_id, graph_task_id == NULL || graph_task_id == Py_None ? NULL : Py_NewRef(graph_task_id));
    self->native_grad_mode = (grad_mode_function)grad_mode_address;
    self->original_call = PyVectorcall_Function(self->original);
    find_shape_descriptor(self);
    self->vectorcall = fastcall_vectorcall;
    return 0;
}

#define EACH_FIELD(DO) \
    DO(self->original); DO(self->slow); DO(self->local); DO(self->recording); DO(self->now); \
    DO(self->grad_enabled); DO(self->jit_tracing); DO(self->tensor_type); DO(self->shape_descriptor); \
    DO(self->describe_inputs); DO(self->describe); DO(self->on_error); DO(self->hook_backward); \
    DO(self->buffer_type); DO(self->steps_type); DO(self->correlation_capsule); DO(self->graph_task_id); \
    DO(self->step_none); DO(self->step_inference); DO(self->step_train); DO(self->mark_step); \
    DO(self->train_step_name); DO(self->train_attributes); DO(self->inference_step_name); \
    DO(self->inference_attributes); EACH_CACHED(DO); DO(self->exposed); DO(self->on_read); DO(self->compiler)

GC_FUNCTIONS(fastcall, FastCall, EACH_FIELD)

static PyObject *fastcall_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    FastCall *self = (FastCall *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) self->vectorcall = fastcall_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject FastCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xsp._hotpath.FastCall",
    .tp_doc = PyDoc_STR("FastCall(mode, original, slow, local, recording, now, grad_enabled, jit_tracing, "
                        "tensor_type, describe_inputs, describe, on_error, hook_backward, buffer_type, "
                        "steps_type, step_constants, compact_at=512, native_grad_mode=0): nn.Module.__call__, "
                        "called as fast(module, *args, **kwargs). native_grad_mode: the address of "
                        "c10::GradMode::is_enabled, called instead of grad_enabled (0: not)."),
    .tp_basicsize = sizeof(FastCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = fastcall_new,
    .tp_descr_get = fastcall_descr_get,
    .tp_getattro = fastcall_getattro,
    .tp_members = fastcall_members,
    .tp_init = (initproc)fastcall_init,
    .tp_dealloc = (destructor)fastcall_dealloc,
    .tp_traverse = (traverseproc)fastcall_traverse,
    .tp_clear = (inquiry)fastcall_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FastCall, vectorcall),
};

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
    INTERN(s_model_names, "model_names");
    INTERN(s_on_long_step, "on_long_step");
    if ((no_error = PyLong_FromLong(NO_ERROR)) == NULL) return NULL;
    if (PyType_Ready(&FastCallType) < 0 || PyType_Ready(&StepEventsType) < 0 || PyType_Ready(&BackwardCallType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&hotpath_module);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "FastCall", (PyObject *)&FastCallType) < 0
        || PyModule_AddObjectRef(module, "StepEvents", (PyObject *)&StepEventsType) < 0
        || PyModule_AddObjectRef(module, "BackwardCall", (PyObject *)&BackwardCallType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
