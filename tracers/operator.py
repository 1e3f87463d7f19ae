"""The ``operator`` and ``memory`` levels: every framework (aten) operator, and every allocation
and free of tensor memory, read from PyTorch's profiler in process.

With both levels on, one profiler records both (``profile_memory``); with the memory level
alone, :class:`MemoryTracer` runs the profiler for the memory events only. A memory event is
an instant (``alloc`` or ``free``, ``cuda alloc``/``cuda free`` for CUDA's caching
allocator) of the thread that made it, so it nests under the operator and layer that allocated.

PyTorch's profiler runs in CPU-only mode (no CUDA activities, so it never holds CUPTI, which
the cuda_api and kernel levels need) with shapes recorded and every thread profiled. When the
session ends, its events are read directly (``kineto_results.events()``: no JSON round trip)
and become spans: the operator's name, input shapes and dtypes, thread and autograd sequence
number (a backward operator carries the sequence number of the forward operator it
differentiates). Nested operators (``aten::linear`` > ``aten::addmm``) nest by time like every
other span; they run inside the model level's own optimizer-step spans, so PyTorch's
``Optimizer.step#...`` annotations are left out.

Two things are matched up with markers the tracer records through the profiler itself:

* **Clock.** The profiler stamps events in epoch nanoseconds from its own approximate clock.
  At start the tracer brackets a marker between readings of xsp's host clock; the tightest
  bracket gives the offset (and its uncertainty, kept in the metadata).
* **Threads.** The profiler numbers threads in the order they first record (1, 2, ...). Each
  thread that records a module call leaves a marker naming its OS thread id, so operators
  land on the same ``thread_id`` as the layers around them. Threads that never record a
  module call (autograd's device threads) keep the profiler's number, negated.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, Final

import numpy as np
import pandas as pd

from xsp.core import schema as col
from xsp.core.clock import now_ns
from xsp.core.schema import Level, SpanKind
from xsp.record.operator_lines import OPERATOR_LINES_VARIABLE, LineChanges, OperatorLines
from xsp.record.operator_observer import (
    BACKWARD_FLAG,
    USER_FLAG,
    ObserverUnavailable,
    OperatorObserver,
    Taken,
    observer,
)
from xsp.record.recording import Recording
from xsp.record.sites import NO_SITE, CallSites
from xsp.record.window import Window
from xsp.table.walks import categories_at
from xsp.tracers.base import Tracer

CLOCK_MARKER = "xsp::clock"
THREAD_MARKER = "xsp::thread#"
SKIPPED_PREFIXES = ("xsp::", "ProfilerStep#", "Optimizer.step#", "Optimizer.zero_grad#")
"""xsp's own markers, and annotations the model level records itself (steps, optimizer steps)."""
MEMORY_EVENT = "[memory]"
MEMORY_NAMES = {False: {True: "alloc", False: "free"}, True: {True: "cuda alloc", False: "cuda free"}}
_THREAD = re.compile(re.escape(THREAD_MARKER) + r"(\d+)$")

KINETO_CHATTER = b"USDT:"
"""What libkineto prints on stderr when the profiler starts and stops (``USDT:... profiler_start``)."""

_active = threading.Event()
"""Set while xsp's own CPU-only profiler runs (so the CUDA levels know it is not a rival)."""


@contextlib.contextmanager
def without_kineto_chatter() -> Iterator[None]:
    """Keep libkineto's start and stop lines off the program's stderr: while the profiler starts
    or stops, file descriptor 2 is a pipe, drained by a thread, and everything else written to it
    meanwhile is passed on to the real stderr afterwards, in order."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
    except (OSError, ValueError, AttributeError):  # no fd 2 to speak of: nothing to keep clean
        yield
        return
    chunks: list[bytes] = []

    def drain() -> None:
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)

    reader = threading.Thread(target=drain, name="xsp-stderr", daemon=True)
    reader.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer is gone: the reader sees its end
        os.close(saved)
        reader.join(5.0)
        if not reader.is_alive():
            os.close(read_end)
        kept = [line for line in b"".join(chunks).splitlines(keepends=True) if not line.startswith(KINETO_CHATTER)]
        if kept:
            with contextlib.suppress(OSError):
                os.write(2, b"".join(kept))


def own_profiler_active() -> bool:
    """True while the operator tracer's CPU-only profiler is the one running."""
    return _active.is_set()


def _mark(name: str) -> None:
    from torch.autograd.profiler import record_function

    with record_function(name):
        pass


def mark_thread() -> None:
    """Leave a marker naming this thread's OS id in the profiler's events."""
    _mark(f"{THREAD_MARKER}{threading.get_native_id()}")


def measure_profiler_offset(tries: int = 9) -> tuple[int, list[tuple[int, int]]]:
    """Bracket markers between host-clock readings; returns the number of markers and the brackets."""
    brackets = []
    for _ in range(tries):
        before = now_ns()
        _mark(CLOCK_MARKER)
        brackets.append((before, now_ns()))
    return tries, brackets


def clock_offset(markers: list[tuple[int, int]], brackets: list[tuple[int, int]]) -> tuple[int, int]:
    """``(offset_ns, uncertainty_ns)`` with host time = profiler time - offset.

    Each marker ``(start, end)`` on the profiler's clock ran inside its bracket ``(before,
    after)`` on the host clock, so the offset lies in ``[end - after, start - before]``; the
    intersection over all markers is far tighter than any one bracket's midpoint.
    """
    low = max(end - after for (_, end), (_, after) in zip(markers, brackets))
    high = min(start - before for (start, _), (before, _) in zip(markers, brackets))
    if low > high:  # the clocks disagree with every bracket: fall back to the tightest midpoint
        (start, end), (before, after) = min(zip(markers, brackets), key=lambda pair: pair[1][1] - pair[1][0])
        return (start + end) // 2 - (before + after) // 2, (after - before) // 2
    return (low + high) // 2, (high - low) // 2


def memory_rows(events: Iterable[Any], offset: int, thread: Any) -> list[dict[str, Any]]:
    """``alloc``/``free`` rows (memory level) from the profiler's ``[memory]`` events: an instant
    each, ``bytes`` its size, ``device_id`` the CUDA device (null for host memory)."""
    rows = []
    for e in events:
        size = int(e.nbytes())
        if size == 0:
            continue
        at = e.start_ns() - offset
        on_gpu = str(e.device_type()).endswith("CUDA")
        rows.append({
            col.LEVEL: Level.MEMORY.value, col.KIND: (SpanKind.ALLOC if size > 0 else SpanKind.FREE).value,
            col.NAME: MEMORY_NAMES[on_gpu][size > 0], col.START_NS: at, col.END_NS: at,
            col.THREAD_ID: thread(e.start_thread_id()), col.BYTES: abs(size),
            col.DEVICE_ID: max(int(e.device_index()), 0) if on_gpu else None,
        })
    return rows


def operator_rows(events: Iterable[Any], brackets: list[tuple[int, int]], operators: bool = True,
                  memory: bool = False, lines: LineChanges | None = None,
                  sites: CallSites | None = None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Span rows from PyTorch profiler events (``_KinetoEvent``-like objects), and the clock
    and thread facts used: the operators, and the memory events when ``memory``. With
    ``lines`` (and the ``sites`` they index), each operator carries the user's line that issued
    it (:func:`operator_sites`)."""
    events = list(events)
    allocations = [e for e in events if e.name() == MEMORY_EVENT] if memory else []
    events = [e for e in events if str(e.device_type()).endswith("CPU") and e.name() != MEMORY_EVENT]
    markers = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == CLOCK_MARKER]
    offset, uncertainty = clock_offset(markers, brackets) if markers and brackets else (0, -1)
    native_of: dict[int, int] = {}
    for e in events:
        found = _THREAD.match(e.name())
        if found:
            native_of[e.start_thread_id()] = int(found.group(1))

    def thread(profiler_thread: int) -> int:
        return native_of.get(profiler_thread, -profiler_thread)

    rows = memory_rows(allocations, offset, thread)
    first_operator = len(rows)
    forward_threads: list[int] = []
    for e in events if operators else ():
        name = e.name()
        if name.startswith(SKIPPED_PREFIXES):
            continue
        level, kind = Level.OPERATOR, SpanKind.USER if e.is_user_annotation() else SpanKind.OPERATOR
        start = e.start_ns() - offset
        shapes = e.shapes()
        sequence = e.sequence_nr()
        attributes: dict[str, Any] = {}
        dtypes = e.dtypes()
        if any(dtypes):
            attributes["input_dtypes"] = list(dtypes)
        forward_thread = thread(e.fwd_thread_id()) if sequence >= 0 and e.fwd_thread_id() > 0 else 0
        if forward_thread:
            attributes["forward_thread_id"] = forward_thread
        forward_threads.append(forward_thread)
        rows.append({
            col.LEVEL: level.value, col.KIND: kind.value, col.NAME: name,
            col.START_NS: start, col.END_NS: start + max(e.duration_ns(), 0),
            col.THREAD_ID: thread(e.start_thread_id()),
            col.INPUT_SHAPES: json.dumps(shapes) if any(shapes) else None,
            col.SEQUENCE_NUMBER: sequence if sequence >= 0 else None,
            col.ATTRIBUTES: json.dumps(attributes) if attributes else None,
        })
    facts = {"profiler_to_host_offset_ns": offset, "uncertainty_ns": uncertainty,
             "threads": {str(k): v for k, v in sorted(native_of.items())}}
    frame = pd.DataFrame(rows) if rows else pd.DataFrame()
    if lines is not None and len(rows) > first_operator:
        from xsp.tracers.module_calls.rows import site_columns

        ops = frame.iloc[first_operator:]
        ids = np.full(len(frame), NO_SITE, dtype=np.int64)
        ids[first_operator:] = operator_sites(
            lines, ops[col.THREAD_ID].to_numpy(dtype=np.int64), ops[col.START_NS].to_numpy(dtype=np.int64),
            ops[col.END_NS].to_numpy(dtype=np.int64),
            ops[col.SEQUENCE_NUMBER].to_numpy(dtype=np.float64, na_value=np.nan),
            np.asarray(forward_threads, dtype=np.int64))
        frame = frame.assign(**site_columns(sites, ids))
    return frame, facts


def operator_sites(lines: LineChanges, threads: np.ndarray, starts_ns: np.ndarray, ends_ns: np.ndarray,
                   sequence_numbers: np.ndarray, forward_threads: np.ndarray) -> np.ndarray:
    """The site of the user's line that issued each operator: the line current on its thread at
    the middle of its interval (the middle, so that a clock offset smaller than half the
    operator never moves it to a neighbouring line).

    The backward pass is the forward's, line by line: an operator of autograd's that runs a
    node (``forward_threads`` > 0: ``AddmmBackward0`` and its ``evaluate_function``) takes the
    site of the last forward operator on that thread with its sequence number (the one that made
    the node), and the operators it runs inside take its site, on whichever thread the backward
    runs (the caller's of ``backward()`` for the CPU, autograd's own for a GPU)."""
    sites = lines.sites_at(threads, starts_ns + (ends_ns - starts_ns) // 2)
    backward = forward_threads > 0
    if not backward.any():
        return sites
    numbered = ~np.isnan(sequence_numbers)
    forward = numbered & ~backward & (sites != NO_SITE)
    made: dict[tuple[int, int], int] = {}
    for position in np.flatnonzero(forward)[np.argsort(starts_ns[forward], kind="stable")].tolist():
        made[(int(threads[position]), int(sequence_numbers[position]))] = int(sites[position])
    nodes = np.flatnonzero(backward & numbered)
    for position in nodes.tolist():
        key = (int(forward_threads[position]), int(sequence_numbers[position]))
        sites[position] = made.get(key, int(sites[position]))
    # inside a node's operator: its site (the outermost of nested node operators, which agree)
    for thread in np.unique(threads[nodes]).tolist():
        mine = nodes[threads[nodes] == thread]
        mine = mine[np.argsort(starts_ns[mine], kind="stable")]
        outer_end = np.maximum.accumulate(ends_ns[mine])
        keep = np.concatenate([[True], starts_ns[mine][1:] >= outer_end[:-1]])  # not inside an earlier one
        outer = mine[keep]
        rows = np.flatnonzero((threads == thread) & ~(backward & numbered))
        at = np.searchsorted(starts_ns[outer], starts_ns[rows], side="right") - 1
        inside = (at >= 0) & (ends_ns[rows] <= ends_ns[outer[np.maximum(at, 0)]])
        sites[rows[inside]] = sites[outer[at[inside]]]
    return sites


THREAD_ROLES: Final = (("gloo:", "gloo worker"), ("nccl:", "NCCL"), ("autograd::engine", "autograd engine"),
                       ("c10d::", "c10d"))
"""What a thread that recorded no module call is named after: the prefix most of its operators have."""


def unmarked_thread_names(rows: pd.DataFrame) -> dict[int, str]:
    """Names for the threads known only by the profiler's number (negated ids): after what most
    of their operators are (``gloo worker (profiler thread 2)``), else the number alone."""
    threads = rows[col.THREAD_ID].to_numpy()
    names = rows[col.NAME].astype(str).to_numpy()
    found: dict[int, str] = {}
    for thread in sorted({int(t) for t in threads.tolist() if t is not None and t == t and int(t) < 0}):
        mine = names[threads == thread]
        counts = {role: sum(1 for name in mine.tolist() if name.startswith(prefix)) for prefix, role in THREAD_ROLES}
        role, count = max(counts.items(), key=lambda item: item[1])
        label = f"profiler thread {-thread}"
        found[thread] = f"{role} ({label})" if count and count * 4 >= len(mine) else label
    return found


def profiler_conflict() -> str | None:
    """Why PyTorch's profiler cannot be started here, or None."""
    try:
        import torch

        if not torch.autograd.profiler.kineto_available():
            return "this PyTorch build has no Kineto profiler"
        if torch.autograd.profiler._is_profiler_enabled:
            return "PyTorch's profiler is already running in this process (one profiler at a time)"
    except Exception as exc:
        return f"PyTorch's profiler cannot be queried: {exc}"
    return None


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
        if self._observer is not None:
            self._observer.start(shapes=True, max_records=recording.max_events)
            self._counted = 0
            self._facts = {"record_path": "xsp's RecordFunction observer (C++)", "uncertainty_ns": 0}
            self._follow_lines(recording, on_thread=None)
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
        _active.set()
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
        if self._observer is not None:
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
            _active.clear()

    def metadata(self) -> dict[str, Any]:
        return self._facts

    def prepare(self, window: Window) -> None:
        """In the session's process: the observer's finished records of the window, and the
        user's lines up to its end, taken into it (a forked helper may then make the rows)."""
        if self._observer is None:
            return
        if window.closed_ns is None:  # the last window: everything, the lines followed to the end
            taken = self._observer.take()
            lines = self._lines.take() if self._lines is not None else None
            self._lines = None
        else:
            taken = self._observer.take(window.closed_ns, window.closed_ns, window.held_thread_ids)
            lines = self._lines.take_before(window.closed_ns) if self._lines is not None else None
        dropped = self._observer.dropped()
        if dropped:
            window.dropped["operator calls past max_events"] += dropped
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
