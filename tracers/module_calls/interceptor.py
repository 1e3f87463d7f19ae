"""Intercepting nn.Module calls: the shared mechanism of the model and layer tracers.

xsp wraps ``torch.nn.Module.__call__`` instead of registering global forward hooks. Global
hooks push *every* module call onto the slow path of ``Module._call_impl`` (about 1.2 µs per
call on a 2-core x86 machine, before any hook body runs) and make ``torch.compile`` warn; the
wrapper keeps ``_call_impl`` on its fast path, sees keyword arguments (Hugging Face models
are called with ``input_ids=...``) and sees exceptions. benchmarks/overhead.py measures both.

Two wrappers exist. In ``ROOTS`` mode (model level only) the wrapper records top-level calls
and only notes that one is running (calls inside it pass straight through). In ``ALL`` mode
(layer level) it records every call with its input and output shapes, and while autograd
records a graph it hooks the graph node that produced each call's output, so that the
module's backward becomes a span too. Node hooks live and die with that one graph: nothing
global is registered, so ``torch.compile`` and ``torch.jit`` see no hooks at all.

xsp steps aside (calls the original and records nothing) while dynamo traces a function (the
compiled graph then runs without any module call, so a compiled call is one span) and while
``torch.jit.trace`` traces one, or checks its trace by running the model again (so no xsp
node enters a TorchScript graph, and tracing is no step of the user's loop). The dynamo check
comes first: dynamo folds it to a constant, so nothing else in the wrapper is ever traced.

Each finished call appends one tuple of ints ``(start, end, module, depth, inputs, outputs,
error, site)`` to its thread's buffer, with the module, the shape descriptors (a ``torch.Size`` for
one tensor, a tuple of them for several) and any error text given as their index in the
thread's interners, and the line of the user's code that made the call as its id in the
recording's call sites (:mod:`xsp.record.sites`): a tuple of scalars, which the garbage
collector stops tracking at its first pass (see :mod:`xsp.record.recording`).
A top-level call also names its model (once per model) and tells the thread's automatic
steps (:mod:`xsp.record.steps`) that it begins and ends.

While the CUDA levels run, each recorded call also pushes its start onto CUPTI's external
correlation stack (and pops it on return), so that every CUDA call made inside it names it.

Where xsp's C extension is built (:mod:`xsp.record.hotpath`), what is installed is a C method
descriptor: ``model(x)`` calls it with no Python frame of xsp's, and it records the common
cases (any call inside a top-level call; a top-level call whose step is decided as one of
:meth:`xsp.record.steps.AutoSteps.call_begins`'s common cases: a model's next call of a one-call
step, :attr:`xsp.record.steps.AutoSteps.lane`, a call that joins the open step such as a loss
module, and the next training iteration's forward after an optimizer step) and hands every
other call to the Python wrapper below. Read as an attribute it gives a short Python function
that does the same after the dynamo test, for dynamo and other tools that read
``nn.Module.__call__``. The C path writes the same records; tests compare the two.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, cast

import torch
from torch import nn

from xsp.core.clock import now_ns
from xsp.record import hotpath
from xsp.record.columns import (
    COMPACT_AT,
    ROOT_GRAD,
    ROOT_MODE_UNKNOWN,
    ROOT_TRAINING,
)
from xsp.record.recording import Recording, ThreadBuffer
from xsp.record.sites import NO_SCOPE, SITE_SCOPE_BYTES, SITE_SCOPES
from xsp.record.steps import AutoSteps, hotpath_constants
from xsp.tracers._post_import import forget, when_imported
from xsp.tracers.module_calls.backward_hooks import backward_hooks
from xsp.tracers.module_calls.call_context import (
    DYNAMO_TRACE_RULES,
    JIT_TRACE_ENTRIES,
    SETUP_LIBRARIES,
    TENSOR_TYPE,
    Correlation,
    Mode,
    dynamo_compiling,
    grad_enabled,
    jit_tracing,
)
from xsp.tracers.module_calls.call_values import (
    GRAPH_TASK_ID,
    backward_running,
    describe,
    describe_inputs,
    error_text,
)
from xsp.tracers.module_calls.jit_dynamo import (
    dynamo_traces,
    let_dynamo_start_past_the_wrapper,
    set_aside_while_jit_traces,
)
from xsp.tracers.module_calls.model_names import model_name
from xsp.tracers.module_calls.native_torch import grad_mode_address, graph_task_id_address
from xsp.tracers.module_calls.ranges import NO_RANGE, ModuleRanges, range_calls, ranges_of


def call_machinery(original: Any) -> tuple[Any, Any] | None:
    """The code objects of the frames between a module call and its ``forward`` (``_call_impl``,
    then ``original``: ``_wrapped_call_impl``), which call sites may take as a known way out
    (xsp/record/_hotpath/hotpath.h); None where this torch has other frames there."""
    call_impl = getattr(getattr(nn.Module, "_call_impl", None), "__code__", None)
    wrapped = getattr(original, "__code__", None)
    if call_impl is None or wrapped is None or call_impl is wrapped:
        return None
    return call_impl, wrapped


def _named_as(original: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``functools.wraps``: the wrapper keeps ``Module.__call__``'s name, docs and signature.

    Dynamo relies on the name too: ``torch.compile(model)`` compiles ``_orig_mod.__call__``
    directly only when it is named ``_wrapped_call_impl``; under another name it would add a
    frame of its own around the wrapper and compile that into an empty graph.
    """
    return functools.wraps(original)


def _root_flags(module: nn.Module, grad: bool) -> int:
    """The ``ROOT_*`` flags of a top-level call of ``module`` (``grad``: autograd records).

    From the instance's dict: a TorchScript module answers ``.training`` in a microsecond."""
    mode = module.__dict__.get("training")
    return (ROOT_MODE_UNKNOWN if mode is None else ROOT_TRAINING if mode else 0) | (ROOT_GRAD if grad else 0)


def _root_call(recording: Recording) -> Callable[[ThreadBuffer, nn.Module], int]:
    """What a top-level call does before it starts: name its model (once), tell the thread's
    automatic steps, note its mode. Returns the call's start. When the step it belongs to is
    not recorded (a profiling schedule), it sets ``buffer.skipping`` and records nothing."""
    names = recording.model_names

    def begin_root(buffer: ThreadBuffer, module: nn.Module) -> int:
        if id(module) not in names:
            model_name(recording, module, sys._getframe(2))
        training = grad_enabled()
        start = now_ns()
        steps = buffer.steps
        if steps.call_begins(id(module), start, training):
            start = now_ns()  # the step before was handed over first: the call starts now
        if recording.paused:
            buffer.skipping = True
            steps.lane = 0
            return start
        buffer.skipping = False
        sampler = recording.sampler
        if sampler is not None and steps.type and not buffer.open_steps and steps.start_ns != buffer.decided_ns:
            sampler.step_begins(buffer, start)  # a step began: how deep it is recorded
        buffer.roots.append((start, _root_flags(module, training)))
        return start

    return begin_root


def _paused_operators(recording: Recording, buffer: ThreadBuffer) -> Callable[[int], int] | None:
    """The operator level's switch, having paused the thread's operator records, when the running
    step of an always-on session records no operators (the caller resumes them with it); else
    None. (xsp's C wrapper does the same.)"""
    pause = recording.operator_pause
    if pause is None or buffer.step_operators or recording.sampler is None:
        return None
    return pause if pause(1) else None


def _called_by_setup_library() -> bool:
    """Whether the module call being begun (by a wrapper in this file) was made by PyTorch's
    setup code (``SETUP_LIBRARIES``) rather than the user's."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame is not None and str(frame.f_globals.get("__name__", "")).startswith(SETUP_LIBRARIES)


def _aside_call(original: Callable[..., Any], buffer: ThreadBuffer, module: nn.Module, args: Any,
                kwargs: Any) -> Any:
    """A call by PyTorch's setup code (an observer run while quantizing): not a model's, nothing
    recorded, and the modules it calls neither."""
    buffer.aside += 1
    try:
        return original(module, *args, **kwargs)
    finally:
        buffer.aside -= 1


def _unrecorded_root(original: Callable[..., Any], buffer: ThreadBuffer, module: nn.Module, args: Any,
                     kwargs: Any) -> Any:
    """A top-level call of a step that is not recorded: only the step bookkeeping runs."""
    buffer.depth = 1
    try:
        return original(module, *args, **kwargs)
    finally:
        buffer.depth = 0
        buffer.steps.call_ends(now_ns())


def _record_failure(buffer: ThreadBuffer, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    start: int, end: int | None, exc: BaseException, depth: int) -> None:
    """What the wrapper records when a call raised (both wrappers, and the C path through them)."""
    end = start if end is None else end
    buffer.record_call(start, end, module, depth, describe_inputs(args, kwargs), None, error_text(exc))
    if not depth:
        buffer.steps.call_ends(end)


def _no_backward_hooks(buffer: ThreadBuffer, out: Any, module: nn.Module, call: int, first_input: Any) -> None:
    """The model level hooks no backward (its wrapper records no call inside a top-level one)."""


def _with_hotpath(slow: Callable[..., Any], mode: Mode, recording: Recording, original: Callable[..., Any],
                  correlation: Correlation | None, on_read: Callable[[], None] | None, tracing_known: bool,
                  hook_backward: Callable[[ThreadBuffer, Any, nn.Module, int, Any], None] = _no_backward_hooks,
                  module_ranges: ModuleRanges | None = None) -> Callable[..., Any]:
    """What to install as ``nn.Module.__call__``: the wrapper ``slow`` (in Python), or, where xsp's
    C extension is built, an ``xsp.record._hotpath.FastCall`` that records the calls it knows how to and
    hands every other one to ``slow``.

    ``model(x)`` runs the C object with no Python frame of xsp's. Read as an attribute
    (``nn.Module.__call__``, ``model.__call__``, ``super().__call__``), it gives a Python function
    doing the same, ``exposed``, after calling ``on_read``: ``inspect`` and ``torch.fx`` see a
    function as before, and dynamo inlines that one and folds its first test to a constant. But
    dynamo also guards on the closure of the class's entry, which must then be a function:
    ``on_read`` installs ``exposed`` in its place when dynamo traces (see
    :meth:`ModuleCallInterceptor.read_while_compiling`). Without ``on_read`` the result is
    ``exposed`` itself. Read on an instance while ``torch.compiler`` says nothing compiles (as
    ``torch.compile``'s ``OptimizedModule`` reads ``super().__call__`` at every call), it gives
    itself, bound, and skips ``on_read``: such a call runs no Python frame of xsp's either. With
    ``tracing_known`` (every jit tracer entry sets ``aside``), the C
    object does not ask the jit tracer itself. CUPTI correlation (a push and a pop around each
    call) runs in C where ``correlation`` carries a capsule, else only the Python wrapper does it;
    so do ``module_ranges``' NVTX ranges.
    """
    capsule = None if correlation is None else correlation.capsule
    if hotpath.HOTPATH is None or (correlation is not None and capsule is None):
        return slow
    try:
        fast = hotpath.HOTPATH.FastCall(int(mode), original, slow, recording.local, recording, now_ns, grad_enabled,
                                        None if tracing_known else jit_tracing, TENSOR_TYPE, describe_inputs, describe,
                                        _record_failure, hook_backward, ThreadBuffer, AutoSteps, hotpath_constants(),
                                        COMPACT_AT, grad_mode_address(), capsule, GRAPH_TASK_ID,
                                        (recording.layer_depth or 0) if mode is Mode.ALL else 0,
                                        recording.sites if recording.sites.enabled else None,
                                        graph_task_id_address())
    except (TypeError, AttributeError) as exc:  # the C part finds each slot by name and type: refused, never guessed
        recording.notes.append(hotpath.mismatch_note(exc))
        return slow
    fast.call_machinery = call_machinery(original)
    if module_ranges is not None:
        fast.use_nvtx(module_ranges.ranges.capsule, module_ranges.ranges.forward, module_ranges.message_of)
    _orig = original

    @_named_as(original)
    def xsp_module_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if dynamo_compiling():
            return _orig(self, *args, **kwargs)
        return fast(self, *args, **kwargs)

    if on_read is None:
        return xsp_module_call
    fast.exposed = xsp_module_call
    fast.on_read = on_read
    if isinstance(getattr(torch.compiler, "_is_compiling_flag", None), bool):
        # read on an instance while nothing compiles (OptimizedModule's super().__call__), the
        # object gives itself, bound: no Python frame, no on_read (see dynamo_traces)
        fast.compiler = torch.compiler
    return cast(Callable[..., Any], fast)


def _make_roots_wrapper(recording: Recording, original: Callable[..., Any], correlation: Correlation | None = None,
                        on_read: Callable[[], None] | None = None, tracing_known: bool = False) -> Callable[..., Any]:
    local, new_buffer, names = recording.local, recording.new_buffer, recording.model_names
    begin_root = _root_call(recording)
    push, pop = (correlation.push, correlation.pop) if correlation is not None else (None, None)
    module_ranges = ranges_of(recording)
    enter_range, leave_range = range_calls(module_ranges)

    # closure constants, not keyword defaults: a keyword argument the model takes could not
    # then be caught by the wrapper instead of reaching the model
    _orig, _now, _id = original, now_ns, id

    @_named_as(original)
    def xsp_module_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if dynamo_compiling():
            return _orig(self, *args, **kwargs)
        try:
            buffer = local.b
        except AttributeError:
            buffer = new_buffer()
        if buffer.depth or backward_running():  # inside a model call, or a checkpoint's recomputation
            return _orig(self, *args, **kwargs)
        steps = buffer.steps
        if steps.lane == _id(self) and grad_enabled() is steps.lane_grad and not buffer.aside and not jit_tracing():
            # the model's next call of a one-call step (see AutoSteps.lane)
            start = _now()
            if steps.lane_call(start):
                buffer.roots.append((start, _root_flags(self, steps.lane_grad)))
            else:
                start = begin_root(buffer, self)
        elif jit_tracing() or buffer.aside:
            return _orig(self, *args, **kwargs)
        elif _id(self) not in names and _called_by_setup_library():
            return _aside_call(_orig, buffer, self, args, kwargs)
        else:
            start = begin_root(buffer, self)
        if buffer.skipping:
            return _unrecorded_root(_orig, buffer, self, args, kwargs)
        buffer.depth = 1
        ranged = enter_range is not None and enter_range(self, True) != NO_RANGE
        if push is not None:
            push(start)
        paused = _paused_operators(recording, buffer)
        try:
            out = _orig(self, *args, **kwargs)
        except BaseException as exc:
            end = _now()
            if paused is not None:
                paused(0)
            if pop is not None:
                pop()
            if ranged:
                leave_range()
            buffer.depth = 0
            _record_failure(buffer, self, args, kwargs, start, end, exc, 0)
            raise
        end = _now()
        if paused is not None:
            paused(0)
        if pop is not None:
            pop()
        if ranged:
            leave_range()
        buffer.depth = 0
        buffer.record_call(start, end, self, 0, describe_inputs(args, kwargs), describe(out), None)
        if len(buffer.calls) >= COMPACT_AT:
            buffer.compact()
        buffer.steps.call_ends(end)
        return out

    return _with_hotpath(xsp_module_call, Mode.ROOTS, recording, original, correlation, on_read, tracing_known,
                         module_ranges=module_ranges)


def _make_all_wrapper(recording: Recording, original: Callable[..., Any], correlation: Correlation | None = None,
                      on_read: Callable[[], None] | None = None, tracing_known: bool = False) -> Callable[..., Any]:
    local, new_buffer, names = recording.local, recording.new_buffer, recording.model_names
    begin_root = _root_call(recording)
    module_ranges = ranges_of(recording)
    enter_range, leave_range = range_calls(module_ranges)
    hook_backward = backward_hooks(recording, module_ranges)
    push, pop = (correlation.push, correlation.pop) if correlation is not None else (None, None)
    # calls deeper than this pass through unrecorded, their own calls seeing the same depth
    deepest = recording.layer_depth or sys.maxsize

    _orig, _now, _tensor, _id = original, now_ns, TENSOR_TYPE, id  # closure constants (see above)

    @_named_as(original)
    def xsp_module_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if dynamo_compiling():
            return _orig(self, *args, **kwargs)
        try:
            buffer = local.b
        except AttributeError:
            buffer = new_buffer()
        depth = buffer.depth
        outer = depth
        if not depth and backward_running():  # a checkpoint's recomputation: its layer's, not a model call
            depth = 1
            start = _now()
        elif not depth:
            if jit_tracing() or buffer.aside:
                return _orig(self, *args, **kwargs)
            if _id(self) not in names and _called_by_setup_library():
                return _aside_call(_orig, buffer, self, args, kwargs)
            start = begin_root(buffer, self)
            if buffer.skipping:
                return _unrecorded_root(_orig, buffer, self, args, kwargs)
        elif depth > deepest or (buffer.step_limit and (buffer.step_limit < 0 or depth > buffer.step_limit)):
            return _orig(self, *args, **kwargs)  # (step_limit: a step an always-on session records less deep)
        elif buffer.skipping:
            buffer.depth = depth + 1
            try:
                return _orig(self, *args, **kwargs)
            finally:
                buffer.depth = depth
        else:
            start = _now()
        if depth < SITE_SCOPES:  # C's calls inside must not take this depth's entry, an earlier call's, for this one's
            buffer.site_scopes[depth * SITE_SCOPE_BYTES:depth * SITE_SCOPE_BYTES + SITE_SCOPE_BYTES] = NO_SCOPE
        buffer.depth = depth + 1
        ranged = enter_range is not None and enter_range(self, depth == 0) != NO_RANGE
        if push is not None:  # CUPTI tracing: the call's start names it to the CUDA calls inside
            push(start)
        paused = None if outer else _paused_operators(recording, buffer)
        try:
            out = _orig(self, *args, **kwargs)
        except BaseException as exc:
            end = _now()
            if paused is not None:
                paused(0)
            if pop is not None:
                pop()
            if ranged:
                leave_range()
            buffer.depth = outer
            _record_failure(buffer, self, args, kwargs, start, end, exc, depth)
            raise
        end = _now()
        if paused is not None:
            paused(0)
        if pop is not None:
            pop()
        if ranged:
            leave_range()
        buffer.depth = outer
        if kwargs or len(args) != 1 or type(args[0]) is not _tensor:
            in_desc = describe_inputs(args, kwargs)
        else:
            in_desc = args[0].shape
        out_desc = out.shape if type(out) is _tensor else describe(out)
        # the one Python record of a call (C's record_call is the fast path; this, its oracle)
        buffer.record_call(start, end, self, depth, in_desc, out_desc, None)
        calls = buffer.calls
        if grad_enabled() and recording.backward_hooks:
            hook_backward(buffer, out, self, start, args[0] if args else None)
        if depth < 2:
            if len(calls) >= COMPACT_AT:
                buffer.compact()
            if not depth:
                buffer.steps.call_ends(end)
        return out

    return _with_hotpath(xsp_module_call, Mode.ALL, recording, original, correlation, on_read, tracing_known,
                         hook_backward, module_ranges)


def _entry() -> Any:
    """``nn.Module.__call__`` as the class holds it (reading the attribute would give what xsp's C
    object gives when read, a Python function, instead of the object)."""
    return nn.Module.__dict__.get("__call__")


class ModuleCallInterceptor:
    """Installs the ``nn.Module.__call__`` wrapper for one recording."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # read_while_compiling may run inside _install, on the same thread
        self._recording: Recording | None = None
        self._users: dict[str, Mode] = {}
        self._original: Callable[..., Any] | None = None
        """``nn.Module.__call__`` as it was, as a function of ``(module, *args, **kwargs)``."""
        self._original_entry: Any = None
        """The entry of ``nn.Module``'s dict that ``_original`` was read from, put back as it was."""
        self._wrapper: Any = None
        """What xsp put in that entry (a function, or a C method descriptor that gives one when read)."""
        self._tracing_patches: list[tuple[Any, str, Any, Any]] = []
        """``(owner, name, original, replacement)`` of each jit tracer entry made to set ``aside``."""
        self._correlation: Correlation | None = None
        self.foreign_patch = False
        """True when something else replaced ``nn.Module.__call__`` while xsp was installed."""
        self.functions_only = False
        """True once dynamo has traced code while xsp's C method descriptor was installed: from
        then on (for the process) xsp installs its Python wrapper, which dynamo's guards can
        read."""

    @property
    def mode(self) -> Mode | None:
        return max(self._users.values()) if self._users else None

    def acquire(self, user: str, recording: Recording, mode: Mode) -> None:
        """Start recording module calls for ``user`` (a tracer name) in at least ``mode``."""
        with self._lock:
            if self._recording is not None and self._recording is not recording:
                raise RuntimeError("module calls are already being recorded by another xsp session")
            self._recording = recording
            self._users[user] = mode
            if self._correlation is not None:  # the CUDA levels started first (they do): layers carry ids
                recording.external_ids = True
            self._install()
        when_imported(DYNAMO_TRACE_RULES, let_dynamo_start_past_the_wrapper)

    def release(self, user: str) -> None:
        """Stop recording for ``user``; uninstall when nobody is left.

        Raises:
            RuntimeError: something else replaced ``nn.Module.__call__`` meanwhile; xsp leaves
                that replacement in place (after cleaning up everything of its own).
        """
        with self._lock:
            self._users.pop(user, None)
            if self._users:
                self._install()
                return
            forget(DYNAMO_TRACE_RULES, let_dynamo_start_past_the_wrapper)
            self._uninstall()
            self._recording = None
            if self.foreign_patch:
                self.foreign_patch = False
                raise RuntimeError("torch.nn.Module.__call__ was replaced by other code while xsp was "
                                   "tracing; xsp left that replacement in place, and module calls that "
                                   "bypassed xsp's wrapper are missing from the trace")

    def correlate(self, correlation: Correlation | None) -> None:
        """Push and pop CUPTI external correlation ids around layer calls (None: stop)."""
        with self._lock:
            self._correlation = correlation
            if self._recording is not None:
                if correlation is not None:
                    self._recording.external_ids = True
                self._install()

    def forget_after_fork(self) -> None:
        """In a child forked while recording: put ``nn.Module.__call__`` back and forget the
        recording (the child records nothing; the parent's session is untouched)."""
        self._lock = threading.RLock()  # another thread of the parent may have held it at the fork
        self._undo_tracing_patches()
        if self._original is not None and self._ours(_entry()):
            nn.Module.__call__ = self._original_entry  # type: ignore[method-assign]
        self._original = self._original_entry = self._wrapper = self._recording = self._correlation = None
        self._users = {}
        self.foreign_patch = False

    def _install(self) -> None:
        assert self._recording is not None
        current = _entry()
        if self._original is None:
            self._original, self._original_entry = nn.Module.__call__, current
        elif not self._ours(current):
            self.foreign_patch = True  # never overwrite another tool's replacement
            return
        if not self._tracing_patches:
            self._tracing_patches = set_aside_while_jit_traces(self._recording)
        make = _make_all_wrapper if self.mode is Mode.ALL else _make_roots_wrapper
        on_read = None if self.functions_only else self.read_while_compiling
        tracing_known = len(self._tracing_patches) == len(JIT_TRACE_ENTRIES)
        self._wrapper = make(self._recording, self._original, self._correlation, on_read, tracing_known)
        nn.Module.__call__ = self._wrapper  # type: ignore[method-assign]

    def _undo_tracing_patches(self) -> None:
        for owner, name, original, replacement in self._tracing_patches:
            if owner.__dict__.get(name) is replacement:
                setattr(owner, name, original)
        self._tracing_patches = []

    def _ours(self, entry: Any) -> bool:
        """Whether ``entry`` is what xsp installed, or the function that gives when read (which a
        tool that patched ``nn.Module.__call__`` for a while, as ``torch.fx`` does, puts back)."""
        return entry is not None and (entry is self._wrapper or entry is getattr(self._wrapper, "exposed", None))

    def read_while_compiling(self) -> None:
        """Called by xsp's C descriptor when ``nn.Module.__call__`` is read: if dynamo traces, put
        the Python function the read gives in the descriptor's place, for good.

        Dynamo reads the attribute whenever it traces a module call; it then guards on the
        closure of the class's entry, which must be that function (a guard on anything else
        fails on the frame it was made for, which dynamo reports as its own bug)."""
        if not dynamo_traces():
            return
        with self._lock:
            self.functions_only = True
            exposed = getattr(self._wrapper, "exposed", None)
            if exposed is not None and self._ours(_entry()):
                self._wrapper = exposed
                nn.Module.__call__ = exposed  # type: ignore[method-assign]

    def _uninstall(self) -> None:
        self._undo_tracing_patches()
        if self._original is not None:
            if self._ours(_entry()):
                nn.Module.__call__ = self._original_entry  # type: ignore[method-assign]
            else:
                self.foreign_patch = True
        self._original = self._original_entry = self._wrapper = None


INTERCEPTOR = ModuleCallInterceptor()
"""The process's one interceptor (there is one ``nn.Module.__call__``)."""
