/* The common cases of xsp's nn.Module.__call__ wrapper, in C.
 *
 * A `FastCall` object is what xsp installs as nn.Module.__call__ (tracers/module_calls/interceptor.py):
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
 * ThreadBuffer and AutoSteps are read and written where their member descriptors would (each
 * offset taken from the slot's descriptor, by name and type, as FastCall and StepEvents are made:
 * a slot renamed or retyped in Python is refused there, and the Python path records instead;
 * find_slots in slots.c lists them, tests/unit/test_hotpath.py checks the refusal), and
 * the clock is read with clock_gettime where that is what time.perf_counter_ns reads. A module
 * call's arguments stay in the vectorcall array they came in, and are passed on in it.
 */
#ifndef XSP_HOTPATH_H
#define XSP_HOTPATH_H

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
#include <frameobject.h>  /* PyFrameObject's fields (f_lasti); Python.h declares its functions from 3.11 on */
#endif

#include "../_correlation.h"
#include "../_nvtx.h"
#include "../_site_cache.h"

#define MODE_ROOTS 1
#define MODE_ALL 2
#define NO_ERROR (-1)
#define NO_SITE (-1)  /* xsp.record.sites.NO_SITE */
#define ROOT_TRAINING 1
#define ROOT_GRAD 2
#define ROOT_MODE_UNKNOWN 4
#define MODEL_ONLY_LIMIT (-1)  /* ThreadBuffer.step_limit of a step recorded at the model level only */
#define CONSTANTS 8  /* len(auto_steps.hotpath_constants()) */

extern PyObject *s_b, *s___dict__, *s_new_buffer, *s_is_compiling_flag, *s_long_step_ns, *s_report_after_ns,
    *s_intern_descriptor, *s_intern_module, *s_compact,
    *s_training, *s_shape, *s_backward_hooks, *s_paused, *s_model_names, *s_on_long_step, *s_is_library, *s_intern,
    *s_sampler, *s_step_begins, *s_operator_gate;
extern PyObject *no_error;
typedef int (*operator_pause_function)(int pause);  /* Recording.gate_operators' switch */

/* ThreadBuffer.packed_calls' layout: an int64 row count, then rows of eight int64s, CALL_FIELDS
 * (packed_roots': rows of two, ROOT_FIELDS). */
#define PACKED_HEADER ((Py_ssize_t)sizeof(int64_t))
#define CALL_FIELDS 8
#define PACKED_ROW_BYTES (CALL_FIELDS * (Py_ssize_t)sizeof(int64_t))
#define ROOT_FIELDS 2
/* ThreadBuffer.packed_notes' rows, behind their count as packed_calls' are: NOTE_FIELDS int64s, the
 * fields of step_notes' tuples with the trace id in two halves, in xsp/record/columns.py's NoteField order. */
#define NOTE_FIELDS 8
/* The buffers in self->cache, for EACH_FIELD lists. */
#define EACH_CACHED(DO) \
    DO(self->cache.buffers[0]); DO(self->cache.buffers[1]); DO(self->cache.buffers[2]); DO(self->cache.buffers[3])
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

typedef struct {
    Py_ssize_t depth, steps, aside, roots, calls, descriptor_ids, module_ids, skipping, open_steps, marks,
        optimizer_starts, packed_calls, packed_roots, hot_module, hot_module_id, hot_inputs, hot_inputs_id, hot_outputs,
        hot_outputs_id, hot2_module, hot2_module_id, hot2_inputs, hot2_inputs_id, hot2_outputs, hot2_outputs_id, site_scopes, step_limit,
        step_operators, decided_ns, step_trace, step_notes, packed_notes;
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
/* Threads whose model-level calls pass through at once (FastCall.running_threads): one cache line. */
#define RUNNING_THREADS 8
typedef struct {
    uint64_t threads[CACHED_THREADS];
    PyObject *buffers[CACHED_THREADS];
    unsigned int next;  /* the entry the next miss replaces */
} BufferCache;

/* Call sites (sites.c, xsp/record/sites.py): the sizes of FastCall's direct-mapped caches of the
 * two lookups of the walk to the first user frame (xsp/record/_site_cache.h). */
#define CODE_CACHE 256  /* powers of two */
#define SITE_CACHE 512
/* ThreadBuffer.site_scopes: for each depth of the thread's open recorded calls (up to
 * SITE_SCOPES), the frame that made the call (compared by address only: it is on the thread's
 * stack while the call is open) and the call's site once a walk found it (SITE_UNKNOWN before).
 * A walk that meets an open call's calling frame goes on exactly as that call's own walk would:
 * the walk of a layer inside nn.Sequential stops at the frame that called the Sequential, and
 * the Sequential's own walk is then a lookup. A call made by a library module's own forward (an
 * nn.Sequential calling its layers) has the site the first such call's walk found, when that walk
 * passed a library frame, then exactly nn.Module's call machinery (_call_impl, then
 * _wrapped_call_impl: FastCall.call_machinery), to the enclosing call's calling frame: the entry
 * keeps that _call_impl frame's address (it runs until the enclosing call ends, so the address is
 * its own while the entry holds it), and any later call whose calling frame is a library's
 * called by that very frame walks the same way out. */
#define SITE_SCOPES 64
#define SITE_UNKNOWN (-3)
typedef struct {
    uintptr_t caller;
    long long site;
    uintptr_t machinery;  /* this call's _call_impl frame, once a call its forward made walked out through it (0: not yet) */
    long long forward_site;  /* the site of every call a library frame that _call_impl frame called makes */
} SiteScope;
#define EACH_SITE_CACHED(DO)                                                               \
    for (int i_ = 0; i_ < CODE_CACHE; i_++) DO(self->code_cache[i_].code);                \
    for (int i_ = 0; i_ < SITE_CACHE; i_++) DO(self->site_cache[i_].code)

/* c10::GradMode::is_enabled(), a C++ function of no arguments returning a bool (the Itanium ABI
 * returns it as C's bool); found by tracers/module_calls/native_torch.py. */
typedef bool (*grad_mode_function)(void);
/* torch::autograd::get_current_graph_task_id(), which torch declares returning an int (-1: no
 * backward runs on the thread); found by tracers/module_calls/native_torch.py. */
typedef int (*graph_task_function)(void);

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    BufferCache cache;
    grad_mode_function native_grad_mode;  /* NULL: call grad_enabled */
    int mode;
    long long max_depth;  /* ALL mode: calls deeper than this pass through unrecorded; 0: every depth */
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
    PyObject *hook_backward;  /* (buffer, out, module, start, first argument), ALL mode */
    PyObject *buffer_type;    /* ThreadBuffer */
    PyObject *steps_type;     /* AutoSteps */
    PyObject *correlation_capsule;  /* xsp.record._activity.correlation, or NULL */
    PyObject *graph_task_id;  /* torch._C._current_graph_task_id (-1: no backward runs on this thread), or NULL */
    graph_task_function native_graph_task_id;  /* what that binding returns, called directly; NULL: the binding */
    const xsp_correlation *correlation;  /* what it holds: CUPTI external ids pushed around each call */
    PyObject *nvtx_capsule;   /* xsp.record._nvtx.ranges, or NULL: no NVTX ranges */
    const xsp_nvtx *nvtx;     /* what it holds: an NVTX range pushed and popped around each call */
    PyObject *nvtx_messages;  /* {module: message index} (NvtxRanges.forward) */
    PyObject *nvtx_message_of;  /* (module, is_root) -> message index, on a miss (it fills nvtx_messages) */
    PyObject *sites;          /* recording.sites (xsp.record.sites.CallSites), or NULL: no call sites */
    PyObject *call_machinery; /* (nn.Module._call_impl's code, _wrapped_call_impl's code), or NULL */
    CodeEntry code_cache[CODE_CACHE];
    SiteEntry site_cache[SITE_CACHE];
    /* AutoSteps's constants (auto_steps.hotpath_constants()) */
    PyObject *step_none, *step_inference, *step_train, *mark_step, *train_step_name, *train_attributes,
        *inference_step_name, *inference_attributes;
    BufferSlots buffer_slots;
    StepsSlots steps_slots;
    uint64_t running_threads[RUNNING_THREADS];
    /* The threads (current_thread) whose top-level calls this wrapper runs right now, in MODE_ROOTS
     * or (MODE_ALL) in a step an always-on session records at the model level only (its buffer's
     * step_limit MODEL_ONLY_LIMIT), 0 in a free entry: a module call on such a thread is a
     * pass-through, known without the thread's buffer and its depth (~50 instructions a layer
     * call). One entry a thread, so that the concurrent requests of a threaded server all pass
     * through (with one entry, each step that began took it from the others, whose layer calls
     * then looked up their buffers and depths). Whenever an
     * entry names a thread, that thread's buffer's depth is 1 or more; a thread in no entry (all
     * taken, or the Python path runs the call) is told by its buffer. Fields, not a thread-local:
     * a thread-local of a shared library costs a call (__tls_get_addr) at each read. */
} FastCall;

/* The calling thread's id: its thread state's, unique for the interpreter's life and never 0. */
static inline uint64_t current_thread(void) {
    return PyThreadState_GetID(PyThreadState_Get());
}

/* Whether `thread` runs a call whose module calls pass through (FastCall.running_threads). */
static inline int passes_through(const FastCall *self, uint64_t thread) {
    for (int i = 0; i < RUNNING_THREADS; i++)
        if (self->running_threads[i] == thread) return 1;
    return 0;
}

/* Enter `thread` in a free entry of running_threads: its index, or -1 when all are taken. */
static inline int enter_running(FastCall *self, uint64_t thread) {
    for (int i = 0; i < RUNNING_THREADS; i++)
        if (self->running_threads[i] == 0) {
            self->running_threads[i] = thread;
            return i;
        }
    return -1;
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
    PyObject *site_of;          /* recording.sites.of_frame, or NULL: the user's line of each mark */
    BufferSlots buffer_slots;
    StepsSlots steps_slots;
} StepEvents;

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

typedef struct {
    PyObject *steps, *recording_dict;
    PyObject *sampler;  /* the recording's (borrowed): None outside an always-on session */
    int grad;
    /* the plan */
    int finish, marked, opens, lane, joins;
    PyObject *finished_type;  /* TRAIN or INFERENCE: the decided step's kind */
    long long step_start_ns, step_end_ns;
} CallPlan;

/* Small functions every file inlines. */
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

/* How deep the thread's running step is recorded (ThreadBuffer.step_limit): 0 (every depth) where
 * the slot holds no int. */
static inline long long step_limit_of(PyObject *buffer, const BufferSlots *slots) {
    PyObject *limit = SLOT(buffer, slots->step_limit);
    return limit != NULL && PyLong_CheckExact(limit) ? as_ll(limit) : 0;
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

/* Defined once, in the file of their job. */
void slot_set(PyObject *obj, Py_ssize_t offset, PyObject *value);
int slot_set_ll(PyObject *obj, Py_ssize_t offset, long long value);
long long slot_ll(PyObject *obj, Py_ssize_t offset);
int slot_offset(PyObject *type, const char *name, Py_ssize_t *offset);
int find_slots(PyObject *buffer_type, PyObject *steps_type, BufferSlots *b, StepsSlots *s);
PyObject *thread_buffer(PyObject *local, BufferCache *cache, uint64_t thread);
int append_mark(const BufferSlots *slots, PyObject *buffer, PyObject *kind, PyObject *start, PyObject *end,
                       PyObject *name, PyObject *attributes, PyObject *error);
int append_mark_at(const BufferSlots *slots, PyObject *buffer, PyObject *kind, PyObject *start, PyObject *end,
                   PyObject *name, PyObject *attributes, PyObject *error, PyObject *site);
long long dict_ll(PyObject *dict, PyObject *name);
int unpacked(const Call *call, PyObject **args, PyObject **kwargs);
PyObject *read_clock(PyObject *now_function, long long *ns);
int grad_enabled(FastCall *self);
PyObject *descriptor_id(PyObject *buffer, PyObject *ids, PyObject *descriptor);
int add_shapes(FastCall *self, PyObject *shapes, PyObject *value);
PyObject *shapes_descriptor(PyObject *shapes);
PyObject *inputs_descriptor(FastCall *self, const Call *call);
PyObject *output_descriptor(FastCall *self, PyObject *out);
int same_descriptor(PyObject *a, PyObject *b);
PyObject *hot_descriptor_id(PyObject *buffer, PyObject *ids, PyObject *descriptor, Py_ssize_t hot,
                                   Py_ssize_t hot_id);
void hot_entry_for(PyObject *buffer, const BufferSlots *s, PyObject *module);
int64_t packed_count_of(PyObject *packed);
int packed_fits(PyObject *packed, int64_t count, Py_ssize_t row_bytes, Py_ssize_t more);
int packed_has_room(PyObject *packed, int64_t count, Py_ssize_t row_bytes, Py_ssize_t more,
                           Py_ssize_t full_rows);
Py_ssize_t append_packed_row(PyObject *packed, const int64_t *values, Py_ssize_t fields,
                                    Py_ssize_t full_rows);
int move_rows_to_packed(PyObject *list, PyObject *packed, int64_t packed_count, Py_ssize_t fields,
                               Py_ssize_t full_rows);
Py_ssize_t pack_behind_list(PyObject *list, PyObject *packed, const int64_t *values, Py_ssize_t fields,
                                   Py_ssize_t full_rows);
PyObject *new_columns(PyObject *itemsizes, Py_ssize_t count, int *sizes, char **out);
int store_value(char *column, int size, Py_ssize_t row, long long value);
PyObject *pack_columns(PyObject *module, PyObject *const *argv, Py_ssize_t nargs);
PyObject *split_rows(PyObject *module, PyObject *const *argv, Py_ssize_t nargs);
PyObject *empty_packed(PyObject *module, PyObject *size_object);
PyObject *decide_quiet_step(PyObject *module, PyObject *const *argv, Py_ssize_t nargs);
long long call_site(FastCall *self, PyObject *buffer, long long depth);
void open_site_scope(FastCall *self, PyObject *buffer, long long depth);
int record_call(FastCall *self, PyObject *buffer, const Call *call, long long depth, PyObject *out,
                       PyObject *start, PyObject *end, long long start_ns, long long end_ns,
                       Py_ssize_t *calls_length);
PyObject *clock_after_failure(FastCall *self, PyObject *buffer, long long depth, long long *end_ns);
void failed(FastCall *self, PyObject *buffer, const Call *call, PyObject *start, PyObject *end,
                   long long depth);
int compact_if_full(PyObject *buffer, Py_ssize_t length, Py_ssize_t compact_at);
PyObject *run_and_record(FastCall *self, PyObject *buffer, const Call *call, long long depth,
                                PyObject *start, long long start_ns, PyObject **end, long long *end_ns,
                                Py_ssize_t *calls_length);
int64_t nvtx_push(FastCall *self, PyObject *module, long long depth);
int hook_backward_if_grad(FastCall *self, PyObject *buffer, const Call *call, PyObject *out,
                                 PyObject *start);
int record_root(const BufferSlots *slots, PyObject *buffer, PyObject *start, long long start_ns, long flags,
                       Py_ssize_t full_rows);
PyObject *top_call(FastCall *self, PyObject *buffer, const Call *call, uint64_t thread, int *declined);
PyObject *nested_call(FastCall *self, PyObject *buffer, const Call *call, long long depth);
PyObject *fastcall_vectorcall(PyObject *callable, PyObject *const *argv, size_t nargsf, PyObject *kwnames);
int surely_eager(FastCall *self);
PyObject *fastcall_descr_get(PyObject *callable, PyObject *instance, PyObject *owner);
PyObject *own_or_delegates(PyObject *obj, PyObject *name, PyObject *delegate);
PyObject *fastcall_getattro(PyObject *callable, PyObject *name);
void find_shape_descriptor(FastCall *self);
int fastcall_init(FastCall *self, PyObject *args, PyObject *kwds);
PyObject *fastcall_new(PyTypeObject *type, PyObject *args, PyObject *kwds);
extern PyTypeObject FastCallType;
int slot_is_zero(PyObject *obj, Py_ssize_t offset);
int nobody_to_tell(PyObject *dict, long long start_ns, long long end_ns);
int takes_lane(FastCall *self, PyObject *steps, PyObject *module, int grad, PyObject *recording_dict,
               CallPlan *plan);
int plan_call(FastCall *self, PyObject *buffer, PyObject *module, CallPlan *plan);
int open_step(FastCall *self, PyObject *steps, PyObject *module, CallPlan *plan, PyObject *start,
                     PyObject *resumed);
int note_join(const StepsSlots *ss, PyObject *steps, PyObject *module, PyObject *start);
int forget_joins(const StepsSlots *ss, PyObject *steps, PyObject *zero);
int reset_step(const StepsSlots *ss, PyObject *steps, PyObject *none, PyObject *zero);
int begin_step(FastCall *self, PyObject *buffer, PyObject *module, CallPlan *plan, PyObject *start);
int end_step_piece(FastCall *self, PyObject *buffer, PyObject *steps, PyObject *end, long long end_ns);
PyObject *events_buffer(StepEvents *self);
int piece_ended(StepEvents *self, PyObject *buffer, PyObject *end, long long end_ns, PyObject *optimizer);
PyObject *backward_done(StepEvents *self, PyObject *buffer, PyObject *start, PyObject *out);
PyObject *backward_vectorcall(PyObject *callable, PyObject *const *argv, size_t nargsf, PyObject *kwnames);
PyObject *backward_getattro(PyObject *callable, PyObject *name);
PyObject *backward_repr(PyObject *callable);
PyObject *backward_new(PyTypeObject *type, PyObject *args, PyObject *kwds);
PyObject *events_optimizer_begins(StepEvents *self, PyObject *optimizer);
PyObject *events_optimizer_ends(StepEvents *self, PyObject *optimizer);
int events_init(StepEvents *self, PyObject *args, PyObject *kwds);
extern PyTypeObject BackwardCallType;
extern PyTypeObject StepEventsType;
extern PyTypeObject SamplerCoreType;
int sampler_core_ready(void);
int is_sampler_core(PyObject *obj);
int sampler_other_request(PyObject *core, PyObject *buffer, const BufferSlots *slots);
/* slots: where `buffer`, a ThreadBuffer, keeps what the sampler reads and writes; steps: the
 * buffer's steps, an AutoSteps whose slots are steps_slots. NULL, NULL, NULL: any object with
 * those attributes. */
int sampler_step_begins(PyObject *core, PyObject *buffer, PyObject *time, long long before_ns, const BufferSlots *slots,
                        PyObject *steps, const StepsSlots *steps_slots);

#endif
