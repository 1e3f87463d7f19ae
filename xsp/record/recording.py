"""Recording buffers: what tracers append to while the user's code runs.

The hot path appends one plain tuple per finished span to a list owned by the calling
thread (no locks, no OpenTelemetry objects, no strings built). Module calls and backward
events hold only scalars: the module and the shape descriptors are interned as they are
recorded (a dictionary lookup), so the tuple references no container and the garbage collector
untracks it at its first pass instead of carrying it, and everything it points to, into older
generations, where each full collection would walk it again (over a long run that made a module
call 2-3x dearer). Every few hundred records, and at collection, a thread's tuples are
compacted into typed arrays, so a recorded span costs tens of bytes.
Spans are interpreted (names, paths, parents) only after the session, in
:mod:`xsp.table.build`.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xsp.core.clock import now_ns
from xsp.core.lazy import background_imports_done
from xsp.record import hotpath
from xsp.record.columns import (
    COMPACT_AT,
    DEFAULT_MAX_EVENTS,
    FIRST_PACKED_ROWS,
    MAX_ENDED_THREAD_NAMES,
    NEVER,
    NO_ERROR,
    ROOT_FIELDS,
    BackwardColumns,
    CallColumns,
    Interner,
    MadeOnFirstUse,
    MarkColumns,
    RootColumns,
    count_packed_rows,
    extend_columns,
    extend_from_packed_rows,
    notes_buffer,
    packed_rows,
    split_packed_notes,
)
from xsp.record.model_naming import ModelNames
from xsp.record.nvtx import NvtxRanges
from xsp.record.samples import GcPause
from xsp.record.sampling import StepCore, StepSampler
from xsp.record.sites import NO_SITE, SITE_SCOPES_BYTES, CallSites
from xsp.record.steps import AutoSteps, hotpath_constants
from xsp.record.window import Window, WindowBuffer, split_columns

_getframe = sys._getframe


class ThreadBuffer:
    """Everything one thread recorded. Only its own thread appends to the raw lists."""

    __slots__ = (
        "recording", "thread", "thread_id", "thread_name", "depth", "open_steps", "aside", "skipping", "steps",
        "last_hooked", "optimizer_starts", "input_waits",
        "calls", "packed_calls", "packed_roots", "marks", "kept_lengths", "kept_steps", "backward", "roots",
        "_call_columns", "_mark_columns", "_backward_columns", "_root_columns",
        "hot_module", "hot_module_id", "hot_inputs", "hot_inputs_id", "hot_outputs", "hot_outputs_id",
        "hot2_module", "hot2_module_id", "hot2_inputs", "hot2_inputs_id", "hot2_outputs", "hot2_outputs_id",
        "modules", "descriptors", "strings", "module_ids", "descriptor_ids", "intern_module", "intern_descriptor",
        "site_of", "site_scopes", "step_limit", "step_operators", "decided_ns", "step_trace", "step_notes",
        "packed_notes", "_lock",
    )

    call_columns = MadeOnFirstUse(CallColumns)
    mark_columns = MadeOnFirstUse(MarkColumns)
    backward_columns = MadeOnFirstUse(BackwardColumns)
    root_columns = MadeOnFirstUse(RootColumns)

    def __init__(self, recording: Recording) -> None:
        current = threading.current_thread()
        self.recording = recording
        self.thread = weakref.ref(current)
        """The thread that records here (weakly: a thread object outlives its thread)."""
        self.thread_id = threading.get_native_id()
        self.thread_name = current.name
        self.depth = 0
        """Module calls open on this thread right now (0 outside any module)."""
        self.open_steps = 0
        """``xsp.step()`` blocks open on this thread right now."""
        self.aside = 0
        """``torch.jit.trace`` calls running on this thread: xsp records nothing inside them."""
        self.skipping = False
        """The running top-level call belongs to a step the schedule does not record."""
        self.step_limit = 0
        """How deep the running step is recorded (an always-on session's decision): 0, every
        depth; -1, the model level only (calls inside its top-level calls pass through
        unrecorded); ``k``, layers down to module call depth ``k``."""
        self.step_operators = True
        """Whether the running step records the operator level (an always-on session's decision):
        its top-level calls run with the thread's operator callbacks paused when not
        (:meth:`Recording.gate_operators`)."""
        self.decided_ns = 0
        """Start of the automatic step whose depth was last decided on this thread."""
        self.step_trace: int | None = None
        """The trace id of the application's span (a request's) current where that step began
        (None: none was): another model's call under another request's span begins a step of its
        own instead of joining it (an always-on session's; :meth:`StepCore.other_request`)."""
        self.step_notes: list[tuple[int, ...]] = []
        """What an always-on session decided of this thread's steps (:mod:`xsp.record.sampling`)."""
        self.packed_notes = notes_buffer()
        """The decisions xsp's C sampler noted, packed as ``packed_calls`` is, in rows of
        ``NOTE_FIELDS`` (a step a row, no object made); ``step_notes`` holds the rest (slow
        steps, the Python path's)."""
        self.kept_lengths = (0, 0, 0, 0)
        """Lengths of the call, mark, backward and root columns when a step was last kept (a schedule)."""
        self.kept_steps: list[int] = []
        """Numbers of the steps kept in the columns (a schedule), in order."""
        self.last_hooked: tuple[Any, int] | None = None
        """The autograd node last hooked for a module call on this thread, and that call's start."""
        self.optimizer_starts: list[int] = []
        """Starts of the optimizer steps running on this thread (a stack: one step may run another)."""
        self.input_waits = 0
        """DataLoader waits running on this thread right now: a window due meanwhile is handed over
        when they end, so that its hand-off never lengthens the wait (:attr:`Recording.window_deferred`)."""
        self.steps = AutoSteps(self)
        """This thread's automatic steps (see :mod:`xsp.record.steps`)."""
        # raw records, appended on the hot path:
        # (start, end, module index, depth, inputs index, outputs index, error index or NO_ERROR, site id):
        self.calls: list[tuple[Any, ...]] = []
        self.packed_calls = packed_rows(FIRST_PACKED_ROWS)
        """Module calls recorded by xsp's C wrapper while ``calls`` was empty: a native int64
        count, then that many rows of eight native int64s (the fields of ``calls``' tuples).
        They all precede ``calls``' rows."""
        # the C wrapper's last top-level call: its module, shapes and their indexes (None: empty);
        # hot2_*: the same of the last top-level call of another module (a loss, a head)
        self.hot_module: Any = None
        self.hot_module_id: int | None = None
        self.hot_inputs: Any = None
        self.hot_inputs_id: int | None = None
        self.hot_outputs: Any = None
        self.hot_outputs_id: int | None = None
        self.hot2_module: Any = None
        self.hot2_module_id: int | None = None
        self.hot2_inputs: Any = None
        self.hot2_inputs_id: int | None = None
        self.hot2_outputs: Any = None
        self.hot2_outputs_id: int | None = None
        self.marks: list[tuple[Any, ...]] = []  # (kind, start, end, name, attributes, error[, site id])
        self.backward: list[tuple[int, int, int, int]] = []  # (module index, time, phase, call start)
        self.roots: list[tuple[int, int]] = []  # (start, flags) of each top-level call
        self.packed_roots = packed_rows(FIRST_PACKED_ROWS, ROOT_FIELDS)
        """Top-level calls recorded by xsp's C wrapper while ``roots`` was empty, packed as
        ``packed_calls`` is (rows of two int64s: start, flags). They all precede ``roots``' rows."""
        self._call_columns: CallColumns | None = None
        self._mark_columns: MarkColumns | None = None
        self._backward_columns: BackwardColumns | None = None
        self._root_columns: RootColumns | None = None
        self.modules = Interner(by_identity=True)
        self.descriptors = Interner()
        self.strings = Interner()
        self.module_ids = self.modules.ids
        """``id(module) -> index``: looked up on the hot path (``intern_module`` on a miss)."""
        self.descriptor_ids = self.descriptors.ids
        """``descriptor -> index``: looked up on the hot path (``intern_descriptor`` on a miss)."""
        self.intern_module = self.modules.intern
        self.intern_descriptor = self.descriptors.intern
        self.site_scopes = bytearray(SITE_SCOPES_BYTES)
        """Scratch of xsp's C wrapper: the calling frame and site of each depth of the thread's open
        calls, so that a walk to the user's frame stops where an enclosing call's walk began."""
        self.site_of = recording.sites.of_frame
        """``site_of(frame)``: the recording's site id of the first user frame from ``frame`` out."""
        self._lock = threading.Lock()

    def thread_ended(self) -> bool:
        """True once the thread that recorded here has ended: nothing more will be recorded."""
        thread = self.thread()
        if thread is None:
            return True
        try:
            return not thread.is_alive()
        except Exception:  # a thread threading did not start (a _DummyThread) may refuse to say
            return False

    def record_call(self, start: int, end: int, module: Any, depth: int, inputs: Any, outputs: Any,
                    error: str | None) -> None:
        """Append one finished module call: the one Python home of a call's record. The C wrapper
        (``xsp/record/_hotpath``) writes the same row on its fast path; tests hold the two equal.

        The call site is the first user frame outwards from the caller (xsp's wrapper, which
        is library code: the walk goes on to the frame that called the module)."""
        ids = self.descriptor_ids
        input_id = ids.get(inputs)
        if input_id is None:
            input_id = self.intern_descriptor(inputs)
        output_id = ids.get(outputs)
        if output_id is None:
            output_id = self.intern_descriptor(outputs)
        module_id = self.module_ids.get(id(module))
        if module_id is None:
            module_id = self.intern_module(module)
        self.calls.append((start, end, module_id, depth, input_id, output_id,
                           NO_ERROR if error is None else self.strings.intern(error), self.site_of(_getframe(1))))

    def record_backward(self, module: Any, time_ns: int, phase: int, call: int) -> None:
        """Append one backward event of ``module``'s call that started at ``call``."""
        module_id = self.module_ids.get(id(module))
        if module_id is None:
            module_id = self.intern_module(module)
        self.backward.append((module_id, time_ns, phase, call))

    def compact(self) -> None:
        """Move raw records into the typed columns. Safe to call from any thread."""
        with self._lock:
            self._compact_locked()

    def keep(self, step: int) -> None:
        """Keep what was recorded so far: the step ``step`` just ended and the schedule keeps it."""
        with self._lock:
            self._compact_locked()
            self.kept_lengths = self._lengths()
            self.kept_steps.append(step)

    def discard(self) -> None:
        """Forget what was recorded since the last kept step (a step the schedule does not keep)."""
        with self._lock:
            self.calls, self.marks, self.backward, self.roots = [], [], [], []
            self.packed_calls = packed_rows()
            self.packed_roots = packed_rows(COMPACT_AT, ROOT_FIELDS)
            calls, marks, backward, roots = self.kept_lengths
            for columns, length in ((self.call_columns, calls), (self.mark_columns, marks),
                                    (self.backward_columns, backward), (self.root_columns, roots)):
                for name in columns.__slots__:
                    del getattr(columns, name)[length:]
            self.last_hooked = None

    def _lengths(self) -> tuple[int, int, int, int]:
        return (len(self.call_columns), len(self.mark_columns), len(self.backward_columns), len(self.root_columns))

    def drain(self) -> WindowBuffer:
        """Everything recorded so far, as a :class:`WindowBuffer`; the thread starts afresh."""
        with self._lock:
            self._compact_locked()
            notes, self.step_notes = self.step_notes, []
            packed, self.packed_notes = self.packed_notes, notes_buffer()
            drained = WindowBuffer(self.thread_id, self.thread_name, self.call_columns, self.mark_columns,
                                   self.backward_columns, self.root_columns, self.modules, self.descriptors,
                                   self.strings, self.kept_steps, notes, packed)
            self._call_columns = self._mark_columns = self._backward_columns = self._root_columns = None
            self.kept_lengths, self.kept_steps = (0, 0, 0, 0), []
        return drained

    def drain_before(self, cut_ns: int) -> WindowBuffer:
        """What was recorded before ``cut_ns``, the start of the thread's open step (module calls,
        marks and top-level calls that started before it, backward events of calls that did), as
        :meth:`drain` gives it; the open step's records stay, whole, for a later window."""
        with self._lock:
            self._compact_locked()
            calls, self._call_columns = split_columns(self.call_columns, self.call_columns.start, cut_ns)
            marks, self._mark_columns = split_columns(self.mark_columns, self.mark_columns.start, cut_ns)
            backward, self._backward_columns = split_columns(self.backward_columns, self.backward_columns.call,
                                                              cut_ns)
            roots, self._root_columns = split_columns(self.root_columns, self.root_columns.start, cut_ns)
            notes = [note for note in self.step_notes if note[0] < cut_ns]
            self.step_notes = self.step_notes[len(notes):]
            packed, self.packed_notes = split_packed_notes(self.packed_notes, cut_ns)
            drained = WindowBuffer(self.thread_id, self.thread_name, calls, marks, backward, roots, self.modules,
                                   self.descriptors, self.strings, self.kept_steps, notes, packed)
            self.kept_lengths, self.kept_steps = (0, 0, 0, 0), []  # the open step is not decided yet
        return drained

    def _compact_locked(self) -> None:
        packed, self.packed_calls = self.packed_calls, packed_rows()
        self._compact_packed_calls(packed)
        calls, self.calls = self.calls, []
        marks, self.marks = self.marks, []
        backward, self.backward = self.backward, []
        if calls:
            self._compact_calls(self._admitted("module_calls", calls))
        if marks:
            self._compact_marks(self._admitted("spans", marks))
        if backward:
            self._compact_backward(self._admitted("backward_events", backward))
        root_columns = (self.root_columns.start, self.root_columns.flags)
        packed_roots = self.packed_roots
        packed_count = count_packed_rows(packed_roots)
        if packed_count:
            self.packed_roots = packed_rows(COMPACT_AT, ROOT_FIELDS)
            extend_from_packed_rows(root_columns, packed_roots, packed_count)
        roots, self.roots = self.roots, []
        if roots:
            extend_columns(root_columns, roots)

    def _admitted(self, what: str, records: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        kept = self.recording.admit(what, len(records))
        return records if kept == len(records) else records[:kept]

    def _compact_packed_calls(self, packed: bytearray) -> None:
        rows = count_packed_rows(packed)
        if not rows:
            return
        kept = self.recording.admit("module_calls", rows)
        cols = self.call_columns
        columns = (cols.start, cols.end, cols.module, cols.depth, cols.inputs, cols.outputs, cols.error, cols.site)
        extend_from_packed_rows(columns, packed, kept)

    def _compact_calls(self, calls: list[tuple[int, ...]]) -> None:
        cols = self.call_columns
        extend_columns((cols.start, cols.end, cols.module, cols.depth, cols.inputs, cols.outputs, cols.error,
                        cols.site), calls)

    def _compact_marks(self, marks: list[tuple[Any, ...]]) -> None:
        cols = self.mark_columns
        extend_columns((cols.kind, cols.start, cols.end), marks)  # (kind, start, end, name, attributes, error[, site])
        # a loop's marks have a handful of names (its steps, backward passes, optimizer steps) and
        # mostly no error: each distinct text is interned once, then looked up by a C call a mark
        names = [mark[3] for mark in marks]
        errors = [mark[5] for mark in marks]
        intern, index_of = self.strings.intern, self.strings.ids.__getitem__
        for text in dict.fromkeys(names):
            intern(text)
        cols.name.fromlist(list(map(index_of, names)))
        cols.attributes.extend([mark[4] for mark in marks])
        # only user spans and explicit steps carry their call site, as a seventh field
        cols.site.fromlist([mark[6] if len(mark) > 6 else NO_SITE for mark in marks])
        if errors.count(None) == len(errors):
            cols.error.fromlist([NO_ERROR] * len(errors))
        else:
            cols.error.fromlist([NO_ERROR if error is None else intern(error) for error in errors])

    def _compact_backward(self, events: list[tuple[int, ...]]) -> None:
        cols = self.backward_columns
        extend_columns((cols.module, cols.time, cols.phase, cols.call), events)

    def string(self, index: int) -> str | None:
        return None if index < 0 else self.strings.values[index]


@dataclass
class ThreadCopy:
    """What a block that joined the session (``xsp.trace()`` while another is active) gets of its
    thread's records: each window's share of that thread, as the window drains it. The drained
    columns are never changed after, so the window and the copy share them."""

    recording: Recording
    thread_id: int
    start_ns: int
    """When the block began: the copy is of what started from then on (:meth:`WindowBuffer.since`)."""
    dropped_before: Counter[str]
    """The recording's drops counted when the block began."""
    buffers: list[WindowBuffer] = field(default_factory=list)

    def dropped(self) -> Counter[str]:
        """Records the recording dropped since the block began (of any thread: an upper bound)."""
        dropped = Counter(self.recording.dropped)
        dropped.subtract(self.dropped_before)
        return +dropped


class Recording:
    """The per-thread buffers of one session, with counts of anything dropped."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.local = threading.local()
        """Holds attribute ``b``, the calling thread's :class:`ThreadBuffer`."""
        self.buffers: list[ThreadBuffer] = []
        self.max_events = max_events
        self.kept_events = 0
        self.dropped: Counter[str] = Counter()
        self.imports_wait_ns = 0
        """How long the program's threads waited, at their first recorded call, for the imports xsp
        makes beside the program (:meth:`new_buffer`): xsp's own start, before the first step."""
        self.long_step_ns = NEVER
        """Steps at least this long are reported to ``on_long_step``."""
        self.report_after_ns = NEVER
        """A step that ends at or after this time is reported to ``on_long_step`` too (the next
        streaming window is due): one comparison per step instead of a call."""
        self.report_at_events = NEVER
        """Once this many events are kept, the next step is reported (``report_after_ns`` drops to 0)."""
        self.backward_hooks = True
        """Layer calls hook their graph nodes for backward spans while autograd records."""
        self.layer_depth: int | None = None
        """The layer level records module calls down to this depth (1: the model's children);
        deeper ones pass through unrecorded. None: every depth."""
        self.external_ids = False
        """Set once module calls push their start as CUPTI external correlation ids."""
        self.nvtx: NvtxRanges | None = None
        """With NVTX on (``xsp.trace(nvtx=True)``): the ranges that spans push and pop as they run."""
        self.sampler: StepCore | None = None
        self.operator_pause: Callable[[int], int] | None = None
        """The operator level's per-thread switch (:meth:`gate_operators`)."""
        self.operator_gate = 0
        """Its address, for xsp's C wrapper (0: none)."""
        """The per-step part of an always-on session's step sampler (:meth:`sample_steps`), which xsp's C
        wrapper and the Python paths tell of each step that begins and ends: it decides at each
        step's start whether the step is recorded below the model level."""
        self.paused = False
        """True while the steps that begin are not recorded (a profiling schedule): top-level
        calls then only keep the step bookkeeping going, and nothing below them is recorded."""
        self.on_long_step: Callable[[int], None] | None = None
        """Called on the recording thread, with the step's duration, when a step of
        ``long_step_ns`` or more has ended there (outside every other step and module call)."""
        self.window_deferred = False
        """A window was taken while its thread waited for a DataLoader: ``on_wait_over`` hands it
        over when the wait ends."""
        self.on_wait_over: Callable[[], None] | None = None
        self.on_new_thread: list[Callable[[], None]] = []
        """Called on a thread when it records for the first time (once per thread)."""
        self.on_ended_thread_step: Callable[[ThreadBuffer, int], None] | None = None
        """Called with a thread's buffer and the duration of its last step when a window decides
        that step because the thread has ended (a profiling schedule keeps or forgets it)."""
        self.ended_threads: dict[int, str] = {}
        """Name of each thread whose buffer was retired (it ended, and a window took its records),
        for the first ``MAX_ENDED_THREAD_NAMES`` of them."""
        self.models = ModelNames()
        """The session's top-level models and their names."""
        self.model_names = self.models.names
        """Name of each top-level model by ``id``: :attr:`models`' dict, which the C module-call
        wrapper reads (it is updated in place, never replaced)."""
        self.levels: tuple[Any, ...] = ()
        """The session's levels (:class:`xsp.core.schema.Level`): a tracer may record more when
        another level needs what it has (the operator level's profiler records memory events
        when the memory level is on too)."""
        self.samples: list[Any] = []
        """System samples and garbage collections since the last window (appended by the system level)."""
        self.samplers: list[Callable[[], None]] = []
        """Called when a window is taken, to sample up to that moment (so a step that just
        ended is covered by the samples of its own window)."""
        self.backend: str | None = None
        """The process group backend a recorded collective ran on (``gloo``, ``nccl``): the
        session's metadata keeps it even when the group is destroyed before the session ends."""
        self.process_group: tuple[int, int, str | None] | None = None
        """``(rank, world size, backend)`` of the default process group, as a recorded
        collective saw it (a group set up inside the session and destroyed before its end)."""
        self.notes: list[str] = []
        """What a tracer noticed that the user should hear once (the session warns with each)."""
        self.input_worker_pids: set[int] = set()
        """The processes of the DataLoader workers the recorded loops waited for."""
        self.sites = CallSites()
        """The call sites of the recorded module calls and user spans (:mod:`xsp.record.sites`),
        shared by every thread: a site id means the same line in every thread's records."""
        self.copies: list[ThreadCopy] = []
        """One per block that joined the session and is still open: its thread's share of each window."""
        self.returned: list[WindowBuffer] = []
        """Records drained between windows (a joined block's end): the next window takes them."""
        self._lock = threading.Lock()
        self._copy_lock = threading.Lock()
        """Held while windows drain threads and while a copy starts or ends: no drained record
        misses a copy (never held with ``_lock``, which draining takes)."""

    def buffer(self) -> ThreadBuffer:
        """The calling thread's buffer, created on its first record."""
        try:
            return self.local.b  # type: ignore[no-any-return]
        except AttributeError:
            return self.new_buffer()

    def new_buffer(self) -> ThreadBuffer:
        """A buffer for the calling thread, which has none yet (the recording wrappers call this
        after their own lookup missed: a second miss would make a second AttributeError).

        It first waits for the imports a session makes on its window thread (pandas, pyarrow,
        OpenTelemetry's SDK), which start as the session does: while they run, each torch operator
        that hands the GIL back waits for an import's next step to give it up (a module's loading or
        a garbage collection it sets off, up to 100 ms), and a small model's calls took 16 ms instead
        of 35 µs. No call is timed until they are done: the thread's first call waits for them
        before its clock is read, and the program's code between the session's start and its first
        model call (building the model, loading data) runs beside them. The wait is counted
        (:attr:`imports_wait_ns`): the report says it is xsp's, not the program's start-up."""
        began_ns = now_ns()
        background_imports_done()
        self.imports_wait_ns += now_ns() - began_ns
        buffer = ThreadBuffer(self)
        with self._lock:
            self.buffers.append(buffer)
        self.local.b = buffer
        for hello in list(self.on_new_thread):
            try:
                hello()
            except Exception:  # a tracer's bookkeeping must not break the user's thread
                pass
        return buffer

    def admit(self, what: str, count: int) -> int:
        """How many of ``count`` new records fit under ``max_events``; the rest are counted dropped."""
        with self._lock:
            room = max(self.max_events - self.kept_events, 0)
            kept = min(room, count)
            self.kept_events += kept
            if self.kept_events >= self.report_at_events:
                self.report_after_ns = 0
            if count > kept:
                self.dropped[what] += count - kept
        return kept

    def count_kept(self, count: int) -> None:
        """``count`` records kept elsewhere (the operator level's, in its own buffers): they count
        toward the next window as this recording's own do, so that windows stay of a size."""
        with self._lock:
            self.kept_events += count
            if self.kept_events >= self.report_at_events:
                self.report_after_ns = 0

    def take_dropped(self) -> Counter[str]:
        """The drops counted so far, handed over (a session that hands its recording over to
        another keeps its own; the next one counts afresh)."""
        with self._lock:
            dropped, self.dropped = self.dropped, Counter()
        return dropped

    def restart_counts(self, max_events: int) -> None:
        """A session takes this recording over: records are kept under its ``max_events``, from 0."""
        with self._lock:
            self.max_events, self.kept_events = max_events, 0
            self.report_after_ns = self.report_at_events = NEVER

    def gate_operators(self, pause: Callable[[int], int] | None, address: int = 0) -> None:
        """While the operator level records through a per-thread switch: ``pause(1)`` pauses the
        calling thread's operator records and ``pause(0)`` resumes them (``address``: the same
        function's, ``int f(int)``, for xsp's C wrapper). A top-level call of a step recorded
        without operators runs paused. None: no switch (operators are recorded in every step and
        those of steps without them are dropped when their window is interpreted)."""
        self.operator_pause = pause
        self.operator_gate = address if pause is not None else 0

    def sample_steps(self, sampler: StepSampler | None) -> None:
        """Have ``sampler`` decide the depth of each step that begins from now on (None: every
        step is recorded at every level again)."""
        self.sampler = None if sampler is None else sampler.core
        if sampler is None:
            for buffer in list(self.buffers):
                buffer.step_limit = 0
                buffer.step_operators = True
                buffer.decided_ns = 0

    def compact(self) -> None:
        for buffer in list(self.buffers):
            buffer.compact()

    def _hold_thread_pauses(self, samples: list[Any], held_since_ns: dict[int, int]) -> list[Any]:
        """``samples`` less the garbage collections that belong to held threads' records left for
        later (``Window.held_since_ns``), which go back to the recording, ahead of what came since,
        for the window that takes those records."""
        taken: list[Any] = []
        waiting: list[Any] = []
        for sample in samples:
            since_ns = held_since_ns.get(sample.thread_id) if isinstance(sample, GcPause) else None
            (waiting if since_ns is not None and sample.start_ns >= since_ns else taken).append(sample)
        if waiting:
            self.samples[:0] = waiting  # one slice assignment: a collection recorded meanwhile stays after them
        return taken

    def calls_running(self) -> bool:
        """Whether a thread is inside a module call now (a step under way)."""
        return any(buffer.depth for buffer in list(self.buffers))

    def take_window(self, final: bool = False, handing_over: bool = False) -> Window:
        """Drain every thread; unless ``final``, threads inside a module call or a step (explicit,
        or automatic and not yet decided) are left for a later window, so that no span is
        separated from the spans inside it or from its step. A thread inside an automatic step
        gives what it recorded before that step began, its decided steps
        (:meth:`ThreadBuffer.drain_before`), and keeps the open step whole for later: a server's
        threads are almost always inside one (a step is decided when the thread's next one
        begins), and their spans would otherwise wait for a window that happens to close on
        them. ``handing_over``: the session that takes it ends and another takes the recording
        over (the garbage collections of threads left for later go with it all the same)."""
        for sample_now in list(self.samplers):
            try:
                sample_now()
            except Exception:  # a failing sampler loses a sample, never the window
                self.dropped["system_samples"] += 1
        closed_ns = None if final else now_ns()
        ended = [] if final else self._ended_threads()
        buffers = list(self.buffers)
        taking = [final or (buffer.depth == 0 and buffer.open_steps == 0 and not buffer.steps.holding)
                  for buffer in buffers]
        with self._copy_lock:
            taken = [buffer.drain() for buffer, take in zip(buffers, taking) if take]
            cuts: dict[int, int] = {}
            if not final:
                for buffer, take in zip(buffers, taking):
                    cut = 0 if take or buffer.open_steps else _open_step_start(buffer)
                    if cut:
                        taken.append(buffer.drain_before(cut))
                        cuts[buffer.thread_id] = cut
            for copy in self.copies:
                copy.buffers.extend(drained for drained in taken if drained.thread_id == copy.thread_id)
            returned, self.returned = self.returned, []
        taken.extend(returned)
        held = frozenset(buffer.thread_id for buffer, take in zip(buffers, taking) if not take)
        if ended:
            with self._lock:
                retired = set(map(id, ended))
                self.buffers = [buffer for buffer in self.buffers if id(buffer) not in retired]
                room = MAX_ENDED_THREAD_NAMES - len(self.ended_threads)
                self.ended_threads.update((buffer.thread_id, buffer.thread_name) for buffer in ended[:max(room, 0)])
        kept_steps = sorted(step for buffer in taken for step in buffer.kept_steps)
        samples, self.samples = self.samples, []
        window = Window(taken, final=final, external_ids=self.external_ids, model_names=dict(self.model_names),
                        step_numbers=kept_steps or None, samples=samples,
                        ended_thread_ids=[buffer.thread_id for buffer in ended], closed_ns=closed_ns,
                        held_thread_ids=held, held_from_ns=cuts, sites=self.sites)
        if held and not handing_over:  # a held thread's collections wait with the spans they interrupted
            window.samples = self._hold_thread_pauses(samples, window.held_since_ns())
        return window

    def start_copy(self, thread_id: int) -> ThreadCopy:
        """A block that joined the session begins on thread ``thread_id``: from now on, each
        window's records of that thread are copied for it too (:meth:`end_copy` hands them over)."""
        copy = ThreadCopy(self, thread_id, now_ns(), Counter(self.dropped))
        with self._copy_lock:
            self.copies.append(copy)
        return copy

    def end_copy(self, copy: ThreadCopy, drain: bool = True) -> list[WindowBuffer]:
        """The records ``copy`` collected, of what started since its block began. ``drain``:
        called on the copied thread as its block ends: what the thread recorded since the last
        window is drained too, into the copy and for the next window (which the session that
        recorded it still takes)."""
        with self._copy_lock:
            if copy in self.copies:
                self.copies.remove(copy)
            buffer = getattr(self.local, "b", None) if drain else None
            if buffer is not None and buffer.thread_id == copy.thread_id:
                drained = buffer.drain()
                self.returned.append(drained)
                copy.buffers.append(drained)
                for outer in self.copies:  # a block this one was nested in copies the same thread
                    if outer.thread_id == copy.thread_id:
                        outer.buffers.append(drained)
        return [drained.since(copy.start_ns) for drained in copy.buffers]

    def take_back(self, buffers: list[WindowBuffer]) -> None:
        """Have the next window take ``buffers`` (records a window already took, for a session
        that takes the recording over and whose trace holds them too)."""
        with self._copy_lock:
            self.returned.extend(buffers)

    def _ended_threads(self) -> list[ThreadBuffer]:
        """Buffers of the threads that have ended, their last step decided: this window takes
        their records, and then they are retired (a server that starts a thread per request
        would otherwise keep a buffer per request, and every window would visit them all)."""
        ended = [buffer for buffer in list(self.buffers) if buffer.thread_ended()]
        for buffer in ended:
            if buffer.depth:  # calls left open by a thread that ended (killed inside a module) never end
                self.dropped["open_at_thread_end"] += buffer.depth
            buffer.depth = buffer.open_steps = 0
            buffer.steps.finish(thread_ended=True)
        return ended

    def decide_quiet_steps(self, quiet_ns: int) -> int:
        """Decide each thread's open step that is one inference call of one model, ended at least
        ``quiet_ns`` ago, with no call under way on its thread: a step is decided when its thread's
        next one begins, and a quiet service's last step would wait for the next request (a
        capture of it, with it). Done by xsp's C part alone, where no other thread can run between
        its reads and writes of the step (its Python twin leaves the steps as they are). The number
        decided."""
        hot = hotpath.HOTPATH
        if hot is None:
            return 0
        none, inference = hotpath_constants()[:2]
        decided = 0
        for buffer in list(self.buffers):
            ended = hot.decide_quiet_step(buffer, now_ns(), quiet_ns, none, inference)
            if ended is not None:
                buffer.steps.decided_elsewhere(*ended)
                decided += 1
        return decided

    def finish_steps(self) -> None:
        """Decide every thread's open automatic step (the session is ending)."""
        for buffer in list(self.buffers):
            buffer.steps.finish()

    def open_module_calls(self) -> int:
        """Module calls still running on some thread (they end after the session and are lost)."""
        return sum(buffer.depth for buffer in self.buffers)



def _open_step_start(buffer: ThreadBuffer) -> int:
    """Where the thread's open automatic step began (its input wait, if one came first, or where
    the training step before it ended), or 0 when that is not known. Read from another thread: if
    the step is decided meanwhile, the cut falls before the next one, which then goes on whole too."""
    steps = buffer.steps
    starts = [start for start in (steps.start_ns if steps.holding else 0, steps.wait_ns, steps.resume_ns) if start]
    return min(starts) if starts else 0
