"""Windows made span rows: each tracer prepares and collects its part of a closed window, the
rows become one canonical table, and the table is written as a segment (a streaming session)
or kept in memory until the end. One :class:`WindowInterpreter` per session owns what that
takes and leaves: the step state carried from window to window, the segments, the tables
kept, and the counts of windows, diagnostics and records dropped that the end of the run
writes into the trace's metadata."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.lazy import pyarrow as pa
from xsp.core.rank import RankInfo
from xsp.io.segments import SegmentWriter
from xsp.record.sampling import DepthPlan
from xsp.record.window import Window
from xsp.table.build import build_table
from xsp.table.latency import Latencies, LatencyHistograms, window_latencies
from xsp.table.sampling import StepNotes
from xsp.table.steps import StepState
from xsp.tracers.base import Tracer


@dataclasses.dataclass
class WindowResult:
    """What a helper process that interpreted one window hands back to the session."""

    state: StepState
    diagnostics: dict[str, int]
    dropped: Counter[str]
    segments: int
    spans_in_memory: pd.DataFrame | None
    """The window's spans when the session streams no more (else None: they are in a segment)."""
    pending: list[tuple[int, pa.Table]]
    """Windows the helper could not write (its folder full): the session's writer keeps them."""
    warnings: list[str]
    latencies: Latencies | None = None
    """The window's step and layer durations (an always-on session's), for the session to count."""
    prepared: Any = None
    """What the helper's ``then`` made of the window's spans (the export, made ready to send)."""


class WindowInterpreter:
    """Turns a session's closed windows into span tables, and keeps what they leave behind.

    Args:
        tracers: the session's started tracers (the list itself: it grows as they start).
        state: the step state carried across windows (trace ids, latest steps, recent owners).
        warn: how a problem is said (the session's warning; a helper process collects them).
        host_to_epoch_ns: added to host-clock readings to make epoch nanoseconds.
        rank: this process's rank in a distributed job: every span carries it.
        segments: where a streaming session writes each window (None: windows are kept in
            :attr:`tables`).
        latency: count each window's step and layer durations (:attr:`latency`; an always-on session).
        depth_plans: the always-on session's sampler's depth plans, which its step notes name.
    """

    def __init__(self, tracers: list[Tracer], state: StepState, warn: Callable[[str], None], host_to_epoch_ns: int = 0,
                 rank: RankInfo | None = None, segments: SegmentWriter | None = None, latency: bool = False,
                 depth_plans: list[DepthPlan] | None = None) -> None:
        self.tracers = tracers
        self.state = state
        self.warn = warn
        self.host_to_epoch_ns = host_to_epoch_ns
        self.rank = rank
        self.segments = segments
        self.tables: list[pd.DataFrame] = []
        """Interpreted windows kept in memory (those not written as segments)."""
        self.window_count = 0
        self.helper_windows = 0
        """Windows interpreted by helper processes (see :mod:`xsp.session.forked`)."""
        self.diagnostics: dict[str, int] = {}
        """The windows' hierarchy diagnostics so far, summed (a session of days has millions of windows)."""
        self.last_diagnostics: dict[str, int] = {}
        """The last window's."""
        self.dropped: Counter[str] = Counter()
        """What the tracers dropped while interpreting windows."""
        self.latency = LatencyHistograms() if latency else None
        """The step and layer histograms of the windows so far (None: not counted)."""
        self.on_latencies: Callable[[LatencyHistograms], None] | None = None
        """Told the histograms so far each time a window is counted into them (the OTLP metrics)."""
        self.on_deeper_layers: Callable[[int], None] | None = None
        """Told the deepest module call depth of layers each time a window shows a deeper one
        (an always-on session's rotation learns it)."""
        self.on_watch: Callable[[], None] | None = None
        """Told when a watcher comes (a capture: the session then closes windows sooner)."""
        self.deepest_layer = 0
        self.depth_plans: list[DepthPlan] = [] if depth_plans is None else depth_plans
        """The depth plans step notes name (the always-on session's sampler's list, which only grows)."""
        self._in_helper = False
        self._latencies: Latencies | None = None
        self._watchers: list[tuple[Callable[[pd.DataFrame], bool], Callable[[], bool] | None]] = []
        """Each watcher, with what says that nobody waits for it any more (None: nothing does)."""
        self._watch_lock = threading.Lock()

    def watch_spans(self, watcher: Callable[[pd.DataFrame], bool], given_up: Callable[[], bool] | None = None) -> None:
        """Show ``watcher`` each window's spans from the next one on, until it returns True (a
        capture), or until ``given_up()`` says nobody waits for it any more (its caller hung up;
        asked at each window, and about once a second between windows: :meth:`forget_given_up`);
        windows are interpreted in this process meanwhile."""
        with self._watch_lock:
            self._watchers.append((watcher, given_up))
        if self.on_watch is not None:
            self.on_watch()

    def forget_given_up(self) -> None:
        """Stop showing windows to the watchers nobody waits for any more."""
        with self._watch_lock:
            asked = list(self._watchers)
        gone = []
        for watcher, given_up in asked:
            try:
                if given_up is not None and given_up():
                    gone.append(watcher)
            except Exception:  # (it is asked again at the next window, with its spans)
                continue
        if gone:
            self._forget(gone)

    def _forget(self, watchers: list[Callable[[pd.DataFrame], bool]]) -> None:
        with self._watch_lock:
            self._watchers = [pair for pair in self._watchers if pair[0] not in watchers]

    @property
    def watching(self) -> bool:
        """A watcher waits for spans (a capture is under way)."""
        return bool(self._watchers)

    @property
    def helpers_can_interpret(self) -> bool:
        """Every tracer's rows can be made in a forked child, and no window waits to be written
        by this process (a helper would write it twice)."""
        return (all(tracer.interprets_in_child for tracer in self.tracers)
                and not (self.segments is not None and self.segments.pending) and not self._watchers)

    def prepare(self, window: Window) -> None:
        """Before ``window`` is interpreted, perhaps in a forked helper: each tracer takes into it
        what only this process holds."""
        for tracer in self.tracers:
            try:
                tracer.prepare(window)
            except Exception as exc:
                self.warn(f"tracer {tracer.name} failed while collecting its spans, which are lost: {exc}")

    def interpret(self, window: Window, session_row: dict[str, Any] | None = None) -> pd.DataFrame:
        """The spans of one window: written as a segment when the session streams, else kept."""
        frames = []
        for tracer in self.tracers:
            try:
                frames.append(tracer.collect(window))
            except Exception as exc:
                self.warn(f"tracer {tracer.name} failed while collecting its spans, which are lost: {exc}")
        result = build_table(frames, self.host_to_epoch_ns, self.state, session_row, sort=True,
                             step_numbers=window.step_numbers,
                             step_notes=StepNotes.of(window.buffers, self.host_to_epoch_ns, self.depth_plans))
        for thread_id in window.ended_thread_ids:  # no later window has spans of theirs
            self.state.forget_thread(thread_id)
        if self.rank is not None:
            result.spans[col.RANK] = pd.array(np.full(len(result.spans), self.rank.rank), dtype="Int64")
        if self.latency is not None:
            self._latencies = window_latencies(result.spans)
            if not self._in_helper:  # a helper's are counted by the session, which adopts them
                self._count_latencies(self._latencies)
        self._keep(result.spans)
        self._count_window(result.diagnostics, window.dropped)
        if self._watchers and not self._in_helper:
            self._show_watchers(result.spans)
        return result.spans

    def _show_watchers(self, spans: pd.DataFrame) -> None:
        with self._watch_lock:
            watchers = [watcher for watcher, _ in self._watchers]
        finished = []
        for watcher in watchers:
            try:
                done = watcher(spans)
            except Exception as exc:
                done = True
                self.warn(f"a capture failed and was stopped: {type(exc).__name__}: {exc}")
            if done:
                finished.append(watcher)
        self._forget(finished)

    def _count_latencies(self, latencies: Latencies) -> None:
        assert self.latency is not None
        self.latency.add(latencies)
        if latencies.deepest_layer > self.deepest_layer:
            self.deepest_layer = latencies.deepest_layer
            if self.on_deeper_layers is not None:
                self.on_deeper_layers(latencies.deepest_layer)
        if self.on_latencies is not None:
            try:
                self.on_latencies(self.latency)
            except Exception as exc:  # metrics are a view: the spans and the file go on
                self.on_latencies = None
                self.warn(f"latency metrics are not exported any more: {type(exc).__name__}: {exc}")

    def add_spans(self, spans: pd.DataFrame) -> None:
        """Spans made elsewhere (a followed child process's, :mod:`xsp.session.children`): kept
        as a window's are (written as a segment when the session streams)."""
        if self.rank is not None:
            spans[col.RANK] = pd.array(np.full(len(spans), self.rank.rank), dtype="Int64")
        self._keep(spans)

    def interpret_in_helper(self, window: Window, then: Callable[[pd.DataFrame], Any] | None = None) -> WindowResult:
        """In a forked helper process: interpret ``window`` as :meth:`interpret` does, and say
        what the session must know of it (its warnings are said by the parent). ``then``: given
        the window's spans, what it returns is handed back too (:attr:`WindowResult.prepared`)."""
        said: list[str] = []
        self.warn = said.append
        self.tables = []
        self._in_helper = True
        spans = self.interpret(window)
        prepared = None if then is None else then(spans)
        return WindowResult(state=self.state, diagnostics=self.last_diagnostics, dropped=window.dropped,
                            segments=self.segments.count if self.segments is not None else 0,
                            spans_in_memory=spans if self.tables else None,
                            pending=self.segments.pending if self.segments is not None else [], warnings=said,
                            latencies=self._latencies, prepared=prepared)

    def adopt(self, result: WindowResult) -> None:
        """Take over what a helper process learnt from interpreting one window."""
        self.state = result.state
        self._count_window(result.diagnostics, result.dropped)
        if result.latencies is not None and self.latency is not None:
            self._count_latencies(result.latencies)
        self.helper_windows += 1
        assert self.segments is not None  # helpers only interpret windows of a streaming session
        self.segments.count = result.segments
        if result.spans_in_memory is not None:
            self.tables.append(result.spans_in_memory)
        if result.pending:  # the helper's folder took no writes: the session's writer keeps them
            self.segments.keep(result.pending)
            for note in self.segments.take_notes():
                self.warn(note)
        for message in result.warnings:
            self.warn(message)

    def take_tables(self) -> list[pd.DataFrame]:
        """The windows kept in memory, handed over (the interpreter keeps none after)."""
        tables, self.tables = self.tables, []
        return tables

    def hierarchy(self) -> dict[str, int]:
        """The windows' hierarchy diagnostics, summed."""
        return dict(self.diagnostics)

    def _count_window(self, diagnostics: dict[str, int], dropped: Counter[str]) -> None:
        self.window_count += 1
        self.last_diagnostics = diagnostics
        for key, value in diagnostics.items():
            self.diagnostics[key] = self.diagnostics.get(key, 0) + value
        self.dropped.update(dropped)

    def _keep(self, spans: pd.DataFrame) -> None:
        segments = self.segments
        if segments is not None and segments.started:
            segments.write(spans)  # to its folder, else memory, else the spool: never lost unsaid
            for note in segments.take_notes():
                self.warn(note)
            return
        self.tables.append(spans)
