"""The ``operator`` and ``memory`` levels: every framework (aten) operator, and every allocation
and free of tensor memory, read in process.

With both levels on, one profiler records both (``profile_memory``); with the memory level
alone, :class:`MemoryTracer` runs the profiler for the memory events only. A memory event is
an instant (``alloc`` or ``free``, ``cuda alloc``/``cuda free`` for CUDA's caching
allocator) of the thread that made it, so it nests under the operator and layer that allocated.

Where PyTorch has it, operators are read through xsp's own operator observer
(:mod:`xsp.record.operator_observer`); else, and memory events always, from PyTorch's profiler
(:mod:`xsp.tracers.operator_profiler`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind
from xsp.record.operator_lines import OPERATOR_LINES_VARIABLE, LineChanges, OperatorLines, operator_sites
from xsp.record.operator_observer import (
    BACKWARD_FLAG,
    USER_FLAG,
    ObserverUnavailable,
    OperatorObserver,
    Taken,
    observer,
)
from xsp.record.recording import Recording
from xsp.record.sites import CallSites
from xsp.record.window import Window
from xsp.table.walks import categories_at
from xsp.tracers.base import Tracer
from xsp.tracers.compiled_kernels import CompiledKernels
from xsp.tracers.operator_profiler import (
    SKIPPED_PREFIXES,
    mark_thread,
    measure_profiler_offset,
    operator_rows,
    own_profiler_running,
    profiler_conflict,
    unmarked_thread_names,
    without_kineto_chatter,
)


def observer_rows(taken: Taken, lines: LineChanges | None = None, sites: CallSites | None = None) -> pd.DataFrame:
    """Span rows from the operator observer's records (:mod:`xsp.record.operator_observer`): on
    xsp's host clock and OS thread ids already, so no marker is needed. Each distinct name,
    signature (shapes and dtypes) and attributes text is made once, then spread over the rows.
    With ``lines`` (and the ``sites`` they index), each operator carries the user's line that
    issued it (:func:`operator_sites`)."""
    records = taken.records
    if not len(records):
        return pd.DataFrame()
    skipped = np.array([name.startswith(SKIPPED_PREFIXES) for name in taken.names], dtype=bool)
    records = records[~skipped[records["name"]]]
    if not len(records):
        return pd.DataFrame()
    thread_ids = records["thread"].astype(np.int64)
    starts, ends = records["start_ns"], np.maximum(records["end_ns"], records["start_ns"])
    records = _engine_numbered(records, taken.names, thread_ids, starts, ends)
    sequence = records["sequence_nr"]
    numbered = sequence >= 0
    forward = np.zeros(len(records), dtype=np.int64)
    if taken.threads:  # PyTorch's ids of the forward calls' threads, as OS thread ids
        torch_ids = np.fromiter(taken.threads, dtype=np.uint64, count=len(taken.threads))
        os_ids = np.fromiter(taken.threads.values(), dtype=np.int64, count=len(taken.threads))
        order = np.argsort(torch_ids)
        wanted = records["forward_thread"].astype(np.uint64)
        at = np.clip(np.searchsorted(torch_ids[order], wanted), 0, len(order) - 1)
        found = torch_ids[order][at] == wanted
        forward = np.where(found & numbered & (records["forward_thread"] > 0), os_ids[order][at], 0)
    signature = records["signature"].astype(np.int64)
    shapes = [_shapes_text(text) for text in taken.shapes] + [None]
    dtypes = [_dtypes_value(text) for text in taken.dtypes] + [None]
    signature_at = np.where(signature >= 0, signature, len(taken.shapes))
    # attributes: per distinct (dtypes, forward thread) pair, a JSON text made once
    thread_codes, distinct_threads = pd.factorize(forward)
    combined = signature_at * (len(distinct_threads) + 1) + thread_codes
    distinct, codes = np.unique(combined, return_inverse=True)
    texts: list[str | None] = []
    for pair in distinct.tolist():
        sig, thread = divmod(pair, len(distinct_threads) + 1)
        attributes: dict[str, Any] = {}
        if dtypes[sig] is not None:
            attributes["input_dtypes"] = dtypes[sig]
        if distinct_threads[thread]:
            attributes["forward_thread_id"] = int(distinct_threads[thread])
        texts.append(json.dumps(attributes) if attributes else None)
    kinds = np.where((records["flags"] & USER_FLAG) != 0, 1, 0)
    frame = pd.DataFrame({
        col.LEVEL: categories_at(np.zeros(len(records), dtype=np.int64), [Level.OPERATOR.value]),
        col.KIND: categories_at(kinds, [SpanKind.OPERATOR.value, SpanKind.USER.value]),
        col.NAME: _coded(list(taken.names), records["name"].astype(np.int64)),
        col.START_NS: starts, col.END_NS: ends, col.THREAD_ID: thread_ids,
        col.INPUT_SHAPES: _coded(shapes, signature_at),
        col.SEQUENCE_NUMBER: pd.arrays.IntegerArray(np.where(numbered, sequence, 0), ~numbered),
        # (kept as codes until the table is sorted and conformed: a text column costs far more to sort)
        col.ATTRIBUTES: _coded(texts, codes.reshape(-1)),
    })
    if lines is not None:
        from xsp.tracers.module_calls.rows import site_columns

        ids = operator_sites(lines, thread_ids, starts, ends,
                             np.where(numbered, sequence, np.nan).astype(np.float64), forward)
        frame = frame.assign(**site_columns(sites, ids))
    return frame


ENGINE_PREFIX: Final = "autograd::engine::evaluate_function: "


def _engine_numbered(records: np.ndarray, names: list[str], threads: np.ndarray, starts: np.ndarray,
                     ends: np.ndarray) -> np.ndarray:
    """``records`` with each autograd engine call (``autograd::engine::evaluate_function: X``)
    given the sequence number and forward thread of the node ``X`` it runs (the first backward
    node inside it on its thread), as PyTorch's profiler gives them."""
    engine_names = np.array([name.startswith(ENGINE_PREFIX) for name in names], dtype=bool)
    engine = engine_names[records["name"]]
    node = ((records["flags"] & BACKWARD_FLAG) != 0) & (records["sequence_nr"] >= 0)
    if not engine.any() or not node.any():
        return records
    records = records.copy()
    for thread in np.unique(threads[engine]).tolist():  # a few threads: each one's rows at once
        mine = np.flatnonzero(node & (threads == thread))
        if not len(mine):
            continue
        mine = mine[np.argsort(starts[mine], kind="stable")]
        calls = np.flatnonzero(engine & (threads == thread))
        at = np.searchsorted(starts[mine], starts[calls], side="left")
        inside = at < len(mine)
        calls, found = calls[inside], mine[at[inside]]
        inside = ends[found] <= ends[calls]
        calls, found = calls[inside], found[inside]
        records["sequence_nr"][calls] = records["sequence_nr"][found]
        records["forward_thread"][calls] = records["forward_thread"][found]
    return records


def _coded(texts: list[str | None], at: np.ndarray) -> pd.Categorical:
    """``texts[at]`` as a categorical (null for a null text), each distinct text made once."""
    distinct = list(dict.fromkeys(text for text in texts if text is not None))
    number = {text: position for position, text in enumerate(distinct)}
    codes = np.array([-1 if text is None else number[text] for text in texts], dtype=np.int64)
    return categories_at(codes[at], distinct)


def _shapes_text(text: str) -> str | None:
    """The signature's shapes as the profiler's were kept (``[[2, 8], [8, 8]]``), None where every
    input is shapeless."""
    try:
        shapes = json.loads(text)
    except ValueError:
        return None
    return json.dumps(shapes) if isinstance(shapes, list) and any(shapes) else None


def _dtypes_value(text: str) -> list[str] | None:
    try:
        dtypes = json.loads(text)
    except ValueError:
        return None
    return dtypes if isinstance(dtypes, list) and any(dtypes) else None


def operator_observer() -> OperatorObserver | None:
    """The operator observer where it can run here (built on first use), else None: the operator
    level then records through PyTorch's profiler (:func:`observer_unavailable` says why)."""
    try:
        return observer()
    except ObserverUnavailable:
        return None


def observer_unavailable() -> str | None:
    """Why the operator observer cannot run here, or None."""
    try:
        observer()
    except ObserverUnavailable as exc:
        return str(exc)
    return None


class OperatorTracer(Tracer):
    """aten operators, from xsp's RecordFunction observer (streamed a window at a time), or where
    it cannot be built, from PyTorch's profiler in CPU-only mode (read when the session ends)."""

    name: ClassVar[str] = "operator"
    level: ClassVar[Level] = Level.OPERATOR
    records_operators: ClassVar[bool] = True

    def __init__(self) -> None:
        self._memory = False
        self._profiler: Any = None
        self._recording: Recording | None = None
        self._brackets: list[tuple[int, int]] = []
        self._events: list[Any] = []
        self._facts: dict[str, Any] = {}
        self._lines: OperatorLines | None = None
        self._line_changes: LineChanges | None = None
        self._observer = operator_observer() if self.records_operators else None
        self._compiled = CompiledKernels() if self.records_operators else None
        """Where the kernels compiled during the session come from (inductor's provenance)."""
        self.collects_at_end = self._observer is None
        """Through PyTorch's profiler, its records are read when it stops: steps are not
        exported before the session ends. The observer's stream like the layer level's."""
        self.interprets_in_child = self._observer is not None
        """The observer's records of a window are taken into it (:meth:`prepare`) first."""
        self._counted = 0

    def available(self) -> str | None:
        return None if self._observer is not None else profiler_conflict()

    def start(self, recording: Recording) -> None:
        self._recording = recording
        if self._compiled is not None:
            self._compiled.install()
        if self._observer is not None:
            self._observer.start(shapes=True, max_records=recording.max_events)
            self._counted = 0
            self._facts = {"record_path": "xsp's RecordFunction observer (C++)", "uncertainty_ns": 0}
            self._follow_lines(recording, on_thread=None)
            # an always-on session's steps recorded without operators run with them paused
            recording.gate_operators(self._observer.pause_thread, self._observer.pause_address)
            return
        self._start_profiler(recording)

    def step_end_hook(self) -> Callable[[], None] | None:
        """At each step's end: the operators recorded since count toward the next window."""
        return self._count_records if self._observer is not None else None

    def _count_records(self) -> None:
        if self._observer is None or self._recording is None:
            return
        recorded = self._observer.recorded()
        if recorded > self._counted:
            self._recording.count_kept(recorded - self._counted)
            self._counted = recorded

    def _start_profiler(self, recording: Recording) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._memory = Level.MEMORY in recording.levels  # one profiler records both
        options: dict[str, Any] = {"activities": [ProfilerActivity.CPU], "record_shapes": self.records_operators,
                                   "profile_memory": self._memory}
        try:
            from torch._C._profiler import _ExperimentalConfig

            # all threads: every thread's operators; but then the profiler reports no memory
            # events (torch 2.13), so with the memory level it follows the session's thread
            # and the threads it starts (autograd's included)
            if not self._memory:
                options["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
        except (ImportError, TypeError):  # older torch: the session's threads only
            pass
        profiler = profile(**options)
        with without_kineto_chatter():
            profiler.start()
        own_profiler_running(True)
        self._profiler = profiler
        mark_thread()
        _, self._brackets = measure_profiler_offset()
        recording.on_new_thread.append(mark_thread)
        if self.records_operators:
            why = observer_unavailable()
            if why is not None:
                recording.notes.append(f"the operator level records through PyTorch's profiler, which holds every "
                                       f"event until the session ends (xsp's operator observer: {why})")
            self._follow_lines(recording, on_thread=mark_thread)

    def _follow_lines(self, recording: Recording, on_thread: Any) -> None:
        """Follow the user's lines for the operators (what it costs: docs/overhead.md); where it
        cannot, say why once, and operators take the line of the call they ran under."""
        lines = OperatorLines(recording.sites, on_thread=on_thread)
        why = lines.start()
        if why is None:
            self._lines = lines
        elif recording.sites.enabled and not why.startswith(OPERATOR_LINES_VARIABLE):
            recording.notes.append(f"operators carry no line of their own: {why}; each takes the line of "
                                   "the model or layer call it ran under")

    def stop(self) -> None:
        if self._compiled is not None:  # (what it read is taken into the metadata: details())
            self._compiled.uninstall()
        if self._observer is not None:
            if self._recording is not None:
                self._recording.gate_operators(None)
            self._observer.stop()
            if self._lines is not None:
                self._lines.stop()
            return
        profiler, self._profiler = self._profiler, None
        if self._recording is not None and mark_thread in self._recording.on_new_thread:
            self._recording.on_new_thread.remove(mark_thread)
        if self._lines is not None:
            self._lines.stop()
            self._line_changes, self._lines = self._lines.take(), None
        if profiler is None:
            return
        try:
            with without_kineto_chatter():
                profiler.stop()
            self._events = list(profiler.profiler.kineto_results.events())
        finally:
            own_profiler_running(False)

    def metadata(self) -> dict[str, Any]:
        return {**self._facts, **(self._compiled.details() if self._compiled is not None else {})}

    def prepare(self, window: Window) -> None:
        """In the session's process: the observer's finished records of the window, and the
        user's lines up to its end, taken into it (a forked helper may then make the rows)."""
        if self._compiled is not None:
            self._compiled.read()
        if self._observer is None:
            return
        if window.closed_ns is None:  # the last window: everything, the lines followed to the end
            taken = self._observer.take()
            lines = self._lines.take() if self._lines is not None else None
            self._lines = None
        else:
            taken = self._observer.take(window.closed_ns, window.closed_ns, window.held_since_ns())
            lines = self._lines.take_before(window.closed_ns) if self._lines is not None else None
        dropped = self._observer.dropped()
        if dropped:
            window.dropped["operator calls past max_events"] += dropped
        failed = self._observer.failed()
        if failed:
            window.dropped["operator calls the observer failed to record"] += failed
        window.derived["operator_records"] = (taken, lines)

    def collect(self, window: Window) -> pd.DataFrame:
        if self._observer is not None:
            if "operator_records" not in window.derived:
                self.prepare(window)
            taken, lines = window.derived.pop("operator_records")
            rows = observer_rows(taken, lines, None if self._recording is None else self._recording.sites)
            self._note_lines(lines)
            return rows
        if not window.final:  # the profiler's events are read when it stops
            return pd.DataFrame()
        events, self._events = self._events, []
        changes, self._line_changes = self._line_changes, None
        rows, self._facts = operator_rows(events, self._brackets, operators=self.records_operators,
                                          memory=self._memory, lines=changes,
                                          sites=None if self._recording is None else self._recording.sites)
        self._note_lines(changes)
        if self._recording is not None and len(rows):
            for thread, name in unmarked_thread_names(rows).items():
                self._recording.ended_threads.setdefault(thread, name)
        return rows

    def _note_lines(self, changes: LineChanges | None) -> None:
        if changes is None or self._recording is None:
            return
        if changes.dropped:
            self._recording.dropped["operator line changes"] += changes.dropped
        if changes.refused:
            self._recording.notes.append(
                f"{changes.refused} thread(s) had a trace function of another tool (a debugger or coverage): "
                "their operators take the line of the call they ran under")


class MemoryTracer(OperatorTracer):
    """Tensor allocations and frees from PyTorch's profiler (``profile_memory``), CPU and CUDA.

    When the operator level records through PyTorch's profiler too (xsp's observer cannot run
    here), that profiler records them, and this tracer stands aside.
    """

    name: ClassVar[str] = "memory"
    level: ClassVar[Level] = Level.MEMORY
    records_operators: ClassVar[bool] = False

    def available(self) -> str | None:
        return profiler_conflict()

    def start(self, recording: Recording) -> None:
        self._recording = recording
        if Level.OPERATOR in recording.levels and operator_observer() is None:
            return
        self._start_profiler(recording)
