"""``xsp.trace()``: one profiling session around the user's code."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import os
import queue
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa

from xsp import _exit_guard as exit_guard
from xsp import _state, machine_speed
from xsp import schema as col
from xsp._signals import StopSignals, Terminated, end_by_signal
from xsp.clock import ClockSync, now_ns
from xsp.distributed import (
    RankInfo,
    current_backend,
    dataset_path,
    rank_info,
    rank_path,
    run_id,
    session_trace_id,
)
from xsp.errors import XspWarning
from xsp.export.otlp import ExportReport, OtlpExport, export_table, make_exporter, resource_for, start_export
from xsp.export.target import OtlpTarget, probe, span_budget_env_problem, span_budget_from_env
from xsp.fileio import arrow_table, in_start_order, spans_from_arrow, write_trace_tables
from xsp.forked import ForkFailed, fork_available, run_forked
from xsp.levels import LevelsArg, parse_levels
from xsp.metadata import default_service_name, environment, memory_peaks
from xsp.output_claim import Claim, claim
from xsp.recording import DEFAULT_MAX_EVENTS, NEVER, Recording, ThreadBuffer, Window
from xsp.schedule import Schedule, StepAction, schedule_of
from xsp.schema import DEFAULT_OUTPUT, Level, SpanKind, Status
from xsp.segments import SegmentWriter
from xsp.segments import warm_up as warm_up_writing
from xsp.spans import build_table, conform, new_step_state
from xsp.structure import SESSION_NAME, StepState
from xsp.trace import Trace
from xsp.tracers._module_calls import INTERCEPTOR
from xsp.tracers.base import Tracer
from xsp.tracers.registry import tracers_for
from xsp.user_spans import span

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_LONG_STEP_S = 1.0
"""Steps at least this long are exported to OTLP as soon as they end."""
WINDOW_S = 1.0
"""A window closes at the first step end this long after the last one closed: its spans are
then interpreted and written to disk (and exported) while the program runs on."""
WINDOW_EVENTS = 50_000
"""A window also closes at the first step end after this many records: interpreting a window
takes memory in proportion to its records, so this bounds the session's memory."""
EXIT_WAIT_S = 8.0
"""At interpreter exit, how long to wait for an OTLP export still running."""


_pending_exports: list[OtlpExport] = []
_exit_wait_registered = False
_claim = threading.Lock()
"""Held while a session checks for an active one and takes its place (two threads at once)."""


def _forget_session_in_child() -> None:
    """After ``os.fork()`` in a session: the child records nothing and writes no file (the
    parent's session owns the file; a DataLoader worker is forked this way)."""
    session = _state.session
    if session is None:
        return
    _state.session = _state.recording = None
    session._forked = True
    if session._recording is not None:
        session._recording.max_events = 0
    INTERCEPTOR.forget_after_fork()


os.register_at_fork(after_in_child=_forget_session_in_child)


def _wait_for_exports() -> None:
    """At interpreter exit: give running exports one bounded wait (``EXIT_WAIT_S`` in all)."""
    deadline = now_ns() + int(EXIT_WAIT_S * 1e9)
    for export in list(_pending_exports):
        if not export.abandoned:
            export.wait(max(deadline - now_ns(), 0) / 1e9)


def _take_over() -> None:
    """After a session ended: the first session refused while it ran that is still inside its
    block takes over (its calls from now on are recorded, never lost unsaid)."""
    with _claim:
        if _state.session is not None or not _state.waiting:
            return
        successor = _state.waiting.pop(0)
        try:
            successor._take_over()
        except Exception as exc:  # it stays a block without a trace, and says why
            successor._warn(f"could not take over recording: {type(exc).__name__}: {exc}")


def _wait_for_exports_at_exit() -> None:
    """Have interpreter exit wait for exports *before* ``concurrent.futures`` shuts its pools
    down (an export still sending then fails with "cannot schedule new futures after
    shutdown"). Exit runs threading's exit callbacks latest first, before ``atexit``'s, so this
    is registered (once) after ``concurrent.futures`` has registered its own."""
    global _exit_wait_registered
    if _exit_wait_registered:
        return
    _exit_wait_registered = True
    import concurrent.futures.thread  # noqa: F401  (its exit callback first, so that ours runs before it)

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(_wait_for_exports)
            return
    except RuntimeError:  # the interpreter is already shutting down
        return
    atexit.register(_wait_for_exports)


class Session:
    """A profiling session: a context manager, or a decorator that profiles each call.

    After the block, :attr:`trace` holds the :class:`xsp.Trace`, the trace file has been
    written (unless ``output=None``), and an OTLP export, if one was asked for, is running in
    the background (:attr:`export`; ``wait_for_export()`` waits for it). While the block runs,
    each step that lasts ``long_step_s`` or more is exported as soon as it ends.
    """

    def __init__(self, levels: LevelsArg = ("model", "layer"), output: str | os.PathLike[str] | None =
                 DEFAULT_OUTPUT, otlp_endpoint: str | None = None, service_name: str | None = None,
                 otlp_protocol: str | None = None, max_events: int = DEFAULT_MAX_EVENTS,
                 long_step_s: float = DEFAULT_LONG_STEP_S,
                 schedule: Schedule | str | dict[str, int] | None = None, calibrate: bool = False,
                 span_budget: int | None = None, dataset: str | os.PathLike[str] | None = None,
                 backward: bool = True) -> None:
        self.levels = parse_levels(levels)
        self.backward = backward
        # absolute now: the program may change directory before the file is written
        self.dataset = None if dataset is None else Path(dataset).absolute()
        self.run_id: str | None = None
        """With ``dataset``: this run's id, its ``run=`` partition."""
        self.span_budget = span_budget_from_env() if span_budget is None else span_budget
        self.calibrate = calibrate
        self._costs: dict[str, Any] | None = None
        self.schedule = schedule_of(schedule)
        self.output = None if output is None else Path(output).absolute()
        self.target = OtlpTarget.resolve(otlp_endpoint, otlp_protocol)
        self.service_name = service_name or default_service_name()
        self.max_events = max_events
        self.long_step_s = long_step_s
        self.trace: Trace | None = None
        self.export: OtlpExport | None = None
        self.warnings: list[str] = []
        self.write_error: str | None = None
        self.on_finishing: list[Callable[[bool], None]] = []
        """Called with True when the block has ended and the trace is being written, with False
        once it is (the CLI shows a progress line meanwhile; a long run's write takes seconds)."""
        """Why the trace file could not be written (None when it was, or none was asked for)."""
        self._arguments: dict[str, Any] = dict(
            levels=levels, output=output, otlp_endpoint=otlp_endpoint, service_name=service_name,
            otlp_protocol=otlp_protocol, max_events=max_events, long_step_s=long_step_s, schedule=schedule,
            calibrate=calibrate, span_budget=span_budget, dataset=dataset, backward=backward)
        self._tracers: list[Tracer] = []
        self._unavailable: dict[Level, str] = {}
        self._recording: Recording | None = None
        self._nested: span | None = None
        self._start_ns = 0
        self._clock: ClockSync | None = None
        self._thread_id = 0
        self._state = new_step_state()
        self._tables: list[pd.DataFrame] = []
        """Interpreted windows kept in memory (those not written as segments)."""
        self._segments: SegmentWriter | None = None
        self._output_claim: Claim | None = None
        self._window_count = 0
        self._helper_windows = 0
        """Windows interpreted by helper processes (see :class:`_WindowWorker`)."""
        self._diagnostics: list[dict[str, int]] = []
        self._interpreted_dropped: Counter[str] = Counter()
        self._windows: _WindowWorker | None = None
        self._signals = StopSignals()
        self._forked = False
        """True in a child process forked while this session ran: it leaves the file to the parent."""
        self._step_actions: Counter[StepAction] = Counter()
        self._recorded_steps: list[list[int]] = []
        """Runs ``[first, last]`` of the steps (counted from the session's start) the schedule kept."""
        self.rank: RankInfo | None = None
        """This process's rank when it is one of a distributed job (see :mod:`xsp.distributed`)."""
        self._ended_by: str | None = None
        """How the program ended the session, when not by leaving its block (``os._exit(0)``)."""
        self.on_os_exit: list[Callable[[int], None]] = []
        """Called with the status after the session ended because the program called ``os._exit``
        (the process then exits; the CLI says what was written)."""

    # context manager -----------------------------------------------------------------
    def __enter__(self) -> Session:
        if self.calibrate and _state.session is None:  # before this session claims the process: it traces
            import torch

            from xsp.calibration import calibrate

            try:
                self._costs = {level.value: cost.as_dict() for level, cost in calibrate(
                    self.levels, grad=torch.is_grad_enabled() and self.backward).items()}
            except Exception as exc:  # a failed calibration costs the figures, never the program
                self._warn(f"calibration failed, the trace has none: {type(exc).__name__}: {exc}")
        with _claim:
            active = _state.session
            if active is None:  # claimed before any tracer starts: a second session sees it
                self._recording = Recording(self.max_events)
                self._recording.backward_hooks = self.backward
                _state.session, _state.recording = self, self._recording
                self._thread_id = threading.get_native_id()
        if active is not None:
            where = ("" if active._thread_id == threading.get_native_id() else
                     f" (started in thread {active._thread_id})")
            self._warn(f"xsp.trace() is already active{where}; this block is recorded as a span of that "
                       "session, which keeps running undisturbed, and writes no file of its own unless it "
                       "outlives that session")
            self._thread_id = threading.get_native_id()
            self._nested = span("xsp.trace")
            self._nested.__enter__()
            with _claim:
                _state.waiting.append(self)
            return self
        try:
            self._start()
        except BaseException:
            _state.session = _state.recording = None
            exit_guard.unguard()
            self._release_output()
            raise
        return self

    def _start(self) -> None:
        self._clock = ClockSync.measure()
        self._join_job(rank_info())
        self._claim_output()
        self._open_export()
        tracers, self._unavailable = tracers_for(self.levels)
        by_reason: dict[str, list[str]] = {}
        for level, reason in self._unavailable.items():
            by_reason.setdefault(reason, []).append(level.value)
        for reason, levels in by_reason.items():  # one warning per cause (cuda_api and kernel share CUPTI's)
            plural = "s" if len(levels) > 1 else ""
            verb = "are" if len(levels) > 1 else "is"
            self._warn(f"level{plural} {', '.join(levels)} {verb} not recorded: {reason}")
        self._open_segments(tracers)
        if self._recording is not None:
            self._recording.levels = self.levels
        if self.schedule is not None and self._recording is not None:
            self._recording.paused = self.schedule.action(0) is StepAction.SKIP
        self._watch_step_ends(tracers)
        for tracer in tracers:
            try:
                tracer.start(self._recording)
                self._tracers.append(tracer)
            except Exception as exc:
                self._warn(f"tracer {tracer.name} failed to start and is disabled: {exc}")
                self._stop_quietly(tracer)
        self._signals.install()
        exit_guard.guard(self._end_by_os_exit)
        self._start_ns = now_ns()
        if self._segments is not None:
            try:
                self._segments.start(self._start_metadata())
            except OSError as exc:
                folder = self._segments.directory.parent
                if folder.is_dir() and os.access(folder, os.W_OK):  # else the file fails too, and says so
                    self._warn(f"windows are kept in memory, not streamed to disk: {exc}")
            for note in self._segments.take_notes():
                self._warn(note)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        end_ns = now_ns()
        if self._nested is not None:
            with _claim:
                if self in _state.waiting:
                    _state.waiting.remove(self)
            self._nested.__exit__(exc_type, exc, traceback)
            return
        if self._forked:  # a forked child: the parent's session writes the file
            for tracer in self._tracers:
                with contextlib.suppress(Exception):
                    tracer.stop()
            return
        succeeded = exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0))
        if isinstance(exc, (Terminated, KeyboardInterrupt)):
            self._warn(f"interrupted by {'SIGINT' if isinstance(exc, KeyboardInterrupt) else exc}: the trace "
                       "holds what was recorded until then")
        self._end(end_ns, None if succeeded else f"{type(exc).__name__}: {exc}", exc)
        if isinstance(exc, Terminated):  # end as the signal's default action would have ended the program
            if self.export is not None:
                self.export.wait(EXIT_WAIT_S)
            end_by_signal(exc.signum)

    def _end(self, end_ns: int, error: str | None, exc: BaseException | None) -> None:
        """Stop the tracers and write the trace (``error``: why the block failed, None if it did not)."""
        exit_guard.unguard()
        self._signals.hold()  # a second Ctrl-C or a SIGTERM now would leave no file: held until written
        try:
            _state.session = _state.recording = None
            for tracer in self._tracers:
                self._stop_quietly(tracer)
            self._tell_finishing(True)
            try:
                self._finish(end_ns, error)
            except Exception as failure:  # xsp must never turn the user's success into a failure
                self._warn(f"the trace could not be built: {type(failure).__name__}: {failure}")
            finally:
                self._tell_finishing(False)
        finally:
            self._release_output()
            self._signals.release(exc)
            _take_over()

    def _tell_finishing(self, writing: bool) -> None:
        for listener in self.on_finishing:
            with contextlib.suppress(Exception):  # a listener's failure is no reason to lose the trace
                listener(writing)

    def _end_by_os_exit(self, status: int) -> None:
        """``os._exit(status)`` was called while the session ran: end it now, as its block would
        have (no exit hook runs after ``os._exit``), then let the process exit."""
        if _state.session is not self:
            return
        self._ended_by = f"os._exit({status})"
        self._end(now_ns(), None if status == 0 else f"os._exit({status})", None)
        if self.export is not None:
            self.export.wait(EXIT_WAIT_S)
        for callback in self.on_os_exit:
            callback(status)

    def __call__(self, function: F) -> F:
        """Use as a decorator: each call of ``function`` is one session."""

        @functools.wraps(function)
        def traced(*args: Any, **kwargs: Any) -> Any:
            session = Session(**self._arguments)
            try:
                with session:
                    return function(*args, **kwargs)
            finally:
                self.trace, self.export = session.trace, session.export

        return traced  # type: ignore[return-value]

    def wait_for_export(self, timeout_s: float | None = None) -> ExportReport | None:
        """Wait for the background OTLP export; returns its report, or None if none ran."""
        return None if self.export is None else self.export.wait(timeout_s)

    def _take_over(self) -> None:
        """A session refused while another ran, still inside its block when that one ended:
        from now on it records, and writes its own file."""
        self._nested = None  # its span ended with the session it was part of
        self._recording = Recording(self.max_events)
        self._recording.backward_hooks = self.backward
        _state.session, _state.recording = self, self._recording
        self._warn("the xsp session this block was refused for has ended: this one records from now on, and its "
                   "trace holds what ran after that")
        try:
            self._start()
        except BaseException:
            _state.session = _state.recording = None
            exit_guard.unguard()
            self._release_output()
            raise

    def _claim_output(self) -> None:
        """Claim the output's name for this run: a second run writing the same name at once gets
        a numbered name of its own, and says so (at the end, one file would replace the other)."""
        if self.output is None:
            return
        self._output_claim = claim(self.output)
        if self._output_claim.path != self.output:
            self._warn(f"another xsp session (process {self._output_claim.other_pid}) is writing {self.output}; "
                       f"this one writes {self._output_claim.path} instead")
            self.output = self._output_claim.path

    def _release_output(self) -> None:
        if self._output_claim is not None:
            self._output_claim.release()
            self._output_claim = None

    # windows: what is interpreted (and exported) together --------------------------------
    def _join_job(self, rank: RankInfo | None) -> None:
        """One rank of a distributed job: its own file beside the given name, and trace ids
        that every rank of the job shares."""
        if self.dataset is not None:
            self.run_id = run_id(rank)
            self.output = dataset_path(self.dataset, self.run_id, 0 if rank is None else rank.rank, self.service_name)
            try:
                self.output.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # the program runs on; the trace stays in memory (session.trace)
                self._warn(f"cannot write into the dataset {self.dataset} ({exc.strerror or exc}): the trace is not "
                           "written to a file")
                self.output = None
        if rank is None:
            return
        self.rank = rank
        self._state.job_id = rank.job_id
        self._state.session_trace_id = session_trace_id(rank.job_id)
        if self.output is not None and self.dataset is None:
            self.output = rank_path(self.output, rank.rank)

    def _open_export(self) -> None:
        """Probe the OTLP endpoint; if it answers, export long steps as they end."""
        if self.target is None or self._recording is None:
            return
        problem = span_budget_env_problem()
        if problem is not None and self._arguments.get("span_budget") is None:
            self._warn(problem)
        unreachable = probe(self.target)
        if unreachable is not None:
            where = f" ({self.output})" if self.output else ""
            self._warn(f"OTLP endpoint {self.target.endpoint} not used: {unreachable}; "
                       f"the spans are in the trace file only{where}")
            self.target = None
            return
        self._windows = _WindowWorker(self)

    def _open_segments(self, tracers: list[Tracer]) -> None:
        """Stream closed windows to segments beside the output, unless a tracer's spans of a
        step only come at the session's end (then windows stay open and spans in memory)."""
        if self.output is None or any(getattr(tracer, "collects_at_end", False) for tracer in tracers):
            return
        self._segments = SegmentWriter(self.output)
        if self._windows is None:
            self._windows = _WindowWorker(self)

    def _described(self, clock: ClockSync) -> dict[str, Any]:
        """The metadata known from the session's start: host, versions, levels, tracers, clock."""
        return {
            **environment(),
            "service_name": self.service_name,
            "levels": [level.value for level in self.levels],
            "tracers": [tracer.name for tracer in self._tracers],
            "unavailable": {level.value: reason for level, reason in self._unavailable.items()},
            "clock": {"host_to_epoch_ns": clock.host_to_epoch_ns, "uncertainty_ns": clock.uncertainty_ns,
                      "drift_ns": clock.drift_ns},
            "distributed": None if self.rank is None else self.rank.as_metadata(),
            "run_id": self.run_id,
            "machine_speed": machine_speed.measure(),
        }

    def _start_metadata(self) -> dict[str, Any]:
        """What a recovery of this session needs to know, and what is known at its start."""
        assert self._clock is not None
        return {
            **self._described(self._clock),
            "session_ids": {"trace_id": self._state.session_trace_id, "span_id": self._state.session_span_id},
            "session_start_ns": self._start_ns + self._clock.host_to_epoch_ns,
            "session_thread_id": self._thread_id,
        }

    def _watch_step_ends(self, tracers: list[Tracer]) -> None:
        """Tell the recording who hears of step ends: tracers that flush at each step (every
        step), and the window worker (a step of ``long_step_s`` or more, or the first step end
        ``WINDOW_S`` after the last window closed)."""
        assert self._recording is not None
        flushers = [tracer.on_step_end for tracer in tracers if callable(getattr(tracer, "on_step_end", None))]
        windows = self._windows
        at_end = [tracer.name for tracer in tracers if getattr(tracer, "collects_at_end", False)]
        if at_end:  # their spans of a step come only after the session: never export a step without them
            windows = None
        long_step_ns = int(self.long_step_s * 1e9)
        scheduled = self.schedule is not None
        if not flushers and windows is None and not scheduled:
            return
        window_ns = int(WINDOW_S * 1e9) if self._segments is not None else NEVER
        window_events = WINDOW_EVENTS if self._segments is not None else NEVER
        recording = self._recording
        every_step = bool(flushers) or scheduled

        def next_window_due() -> None:  # WINDOW_S or WINDOW_EVENTS past the last window
            assert windows is not None
            recording.report_after_ns = windows.closed_ns + window_ns
            recording.report_at_events = windows.closed_events + window_events

        def window_if_due(long_step: bool = False) -> None:
            # at a step end, and at a thread's first record: a server that starts a thread per
            # request decides no step on any thread (each one's only step is decided when the
            # thread has ended), so windows come due there too
            assert windows is not None
            if (long_step or now_ns() - windows.closed_ns >= window_ns
                    or recording.kept_events - windows.closed_events >= window_events):
                buffer = getattr(recording.local, "b", None)
                waiting = buffer is not None and buffer.input_waits > 0
                windows.close_window(hold=waiting)  # taken now, handed over when the wait ends
                recording.window_deferred |= waiting
                next_window_due()

        def wait_over() -> None:
            assert windows is not None
            recording.window_deferred = False
            windows.release_held()

        def step_ended(duration_ns: int) -> None:
            if scheduled:
                self._scheduled_step_ended(duration_ns)
            for flush in flushers:
                try:
                    flush()
                except Exception:  # a flush is an optimisation; the final one still runs
                    pass
            if windows is not None:
                window_if_due(duration_ns >= long_step_ns)

        if scheduled:
            recording.on_ended_thread_step = lambda buffer, duration_ns: self._scheduled_step_ended(
                duration_ns, buffer=buffer)
        recording.long_step_ns = 0 if every_step else long_step_ns
        if windows is not None:
            next_window_due()
            recording.on_new_thread.append(window_if_due)
            recording.on_wait_over = wait_over
        recording.on_long_step = step_ended

    def _scheduled_step_ended(self, duration_ns: int = 0, buffer: ThreadBuffer | None = None) -> None:
        """On the thread whose step was just decided: keep or forget its records as the schedule
        says, and pause or resume recording for the step that begins."""
        assert self.schedule is not None and self._recording is not None
        step = self._step_actions.total()  # the steps decided so far
        action = self.schedule.action(step)
        self._step_actions[action] += 1
        buffer = buffer or self._recording.buffer()
        if action is StepAction.RECORD:
            runs = self._recorded_steps
            if runs and runs[-1][1] == step - 1:
                runs[-1][1] = step
            else:
                runs.append([step, step])
            buffer.keep(step)
        else:
            buffer.discard()
        self._recording.paused = self.schedule.action(step + 1) is StepAction.SKIP

    def _prepare(self, window: Window) -> None:
        """Before ``window`` is interpreted, perhaps in a forked helper: each tracer takes into it
        what only this process holds."""
        for tracer in self._tracers:
            prepare = getattr(tracer, "prepare", None)
            if callable(prepare):
                try:
                    prepare(window)
                except Exception as exc:
                    self._warn(f"tracer {tracer.name} failed while collecting its spans, which are lost: {exc}")

    def _interpret(self, window: Window, session_row: dict[str, Any] | None = None) -> pd.DataFrame:
        """The spans of one window: written as a segment when the session streams, else kept."""
        assert self._clock is not None
        frames = []
        for tracer in self._tracers:
            try:
                frames.append(tracer.collect(window))
            except Exception as exc:
                self._warn(f"tracer {tracer.name} failed while collecting its spans, which are lost: {exc}")
        result = build_table(frames, self._clock.host_to_epoch_ns, self._state, session_row, sort=False,
                             step_numbers=window.step_numbers)
        for thread_id in window.ended_thread_ids:  # no later window has spans of theirs
            self._state.latest_step.pop(thread_id, None)
        if self.rank is not None:
            result.spans[col.RANK] = pd.array(np.full(len(result.spans), self.rank.rank), dtype="Int64")
        self._keep(result.spans)
        self._count_window(result.diagnostics, window.dropped)
        return result.spans

    def _count_window(self, diagnostics: dict[str, int], dropped: Counter[str]) -> None:
        self._window_count += 1
        self._diagnostics.append(diagnostics)
        self._interpreted_dropped.update(dropped)

    def _interpret_in_helper(self, window: Window) -> _WindowResult:
        """In a forked helper process: interpret ``window`` as :meth:`_interpret` does, and say
        what the session must know of it (its warnings are said by the parent)."""
        said: list[str] = []
        self._warn = said.append  # type: ignore[method-assign,assignment]
        self._tables = []
        spans = self._interpret(window)
        return _WindowResult(state=self._state, diagnostics=self._diagnostics[-1], dropped=window.dropped,
                             segments=self._segments.count if self._segments is not None else 0,
                             spans_in_memory=spans if self._tables else None,
                             pending=self._segments.pending if self._segments is not None else [], warnings=said)

    def _adopt(self, result: _WindowResult) -> None:
        """Take over what a helper process learnt from interpreting one window."""
        self._state = result.state
        self._count_window(result.diagnostics, result.dropped)
        self._helper_windows += 1
        assert self._segments is not None  # helpers only interpret windows of a streaming session
        self._segments.count = result.segments
        if result.spans_in_memory is not None:
            self._tables.append(result.spans_in_memory)
        if result.pending:  # the helper's folder took no writes: the session's writer keeps them
            self._segments.keep(result.pending)
            for note in self._segments.take_notes():
                self._warn(note)
        for message in result.warnings:
            self._warn(message)

    def _keep(self, spans: pd.DataFrame) -> None:
        segments = self._segments
        if segments is not None and segments.started:
            segments.write(spans)  # to its folder, else memory, else the spool: never lost unsaid
            for note in segments.take_notes():
                self._warn(note)
            return
        self._tables.append(spans)

    # after the block ------------------------------------------------------------------
    def _stop_quietly(self, tracer: Tracer) -> None:
        try:
            tracer.stop()
        except Exception as exc:
            self._warn(f"tracer {tracer.name} failed to stop: {exc}")

    def _finish(self, end_ns: int, error: str | None) -> None:
        recording = self._recording
        assert recording is not None and self._clock is not None
        recording.on_long_step = None
        if self._windows is not None:
            self._windows.finish_windows()
        open_calls = recording.open_module_calls()
        if open_calls:
            recording.dropped["open_at_stop"] += open_calls
        if self.schedule is not None:  # each thread's last step too is kept or forgotten as scheduled
            recording.long_step_ns = 0
            for buffer in list(recording.buffers):
                recording.on_long_step = functools.partial(self._scheduled_step_ended, buffer=buffer)
                buffer.steps.finish()
            recording.on_long_step = None
        else:
            recording.finish_steps()
        session_row = {
            col.LEVEL: Level.MODEL.value, col.KIND: SpanKind.SESSION.value, col.NAME: SESSION_NAME,
            col.START_NS: self._start_ns, col.END_NS: end_ns, col.THREAD_ID: self._thread_id,
            col.STATUS: Status.OK.value if error is None else Status.ERROR.value,
            col.STATUS_MESSAGE: error,
        }
        last = self._interpret(recording.take_window(final=True), session_row)
        for note in dict.fromkeys(recording.notes):
            self._warn(note)
        dropped = recording.dropped + self._interpreted_dropped
        if self._segments is not None and self._segments.dropped_spans:
            dropped[DROPPED_WINDOWS] += self._segments.dropped_spans
        if dropped:
            self._warn("some records were dropped: " + ", ".join(
                f"{count} {what}" for what, count in sorted(dropped.items())))
        metadata = self._final_metadata(dropped)
        segments = self._segments
        if segments is not None and segments.count:
            self._write_from_segments(segments, metadata)
        else:
            spans = conform(pd.concat(self._tables, ignore_index=True).sort_values(
                [col.START_NS, col.CALL_DEPTH], kind="stable", na_position="first"))
            self._tables = []
            self.trace = Trace(spans=spans, metadata=metadata)
            if self.output is not None:
                try:
                    self.trace.save(self.output)
                except OSError as exc:  # OutputError names the path and the cause
                    self.write_error = str(exc)
                    self._warn(f"the trace file was not written: {exc}")
            if segments is not None:
                segments.discard()
        if self._windows is not None and self._windows.exporter is not None:
            self.export = self._windows.export_last(last, metadata, self._export_done)
            _pending_exports[:] = [e for e in _pending_exports if not e.report.done] + [self.export]
            _wait_for_exports_at_exit()

    def _final_metadata(self, dropped: Counter[str]) -> dict[str, Any]:
        assert self._clock is not None
        if self.rank is not None:
            recorded = None if self._recording is None else self._recording.backend
            self.rank = self.rank.with_backend(current_backend() or recorded)
        elif self.output is not None and self.dataset is None and (found := rank_info(
                seen=None if self._recording is None else self._recording.process_group)) is not None:
            # the process group was set up inside the block, without a launcher's variables: the file
            # is still this rank's own (its spans take their rank from the metadata when loaded)
            self.rank = found
            requested = self._output_claim.requested if self._output_claim is not None else self.output
            self._release_output()  # the name asked for was taken as a whole: this rank's own is claimed now
            self.output = rank_path(requested, found.rank)
            self._claim_output()
        return {
            **self._described(self._clock.remeasured()),
            "tracer_details": self._tracer_details(),
            "calibration": self._costs,
            "threads": {} if self._recording is None else {
                str(thread_id): name for thread_id, name in itertools.chain(
                    self._recording.ended_threads.items(),
                    ((buffer.thread_id, buffer.thread_name) for buffer in list(self._recording.buffers)))},
            "memory": memory_peaks(),
            "dropped": dict(dropped),
            "hierarchy": {key: sum(d.get(key, 0) for d in self._diagnostics) for key in self._diagnostics[-1]},
            "windows": self._window_count,
            "schedule": None if self.schedule is None else {
                **self.schedule.as_metadata(), "steps_seen": self._step_actions.total(),
                "recorded_steps": self._recorded_steps,
                "warmup_steps": self._step_actions[StepAction.WARMUP],
                "skipped_steps": self._step_actions[StepAction.SKIP]},
            "streamed_windows": 0 if self._segments is None else self._segments.count,
            "closed_windows": 0 if self._windows is None else self._windows.closed_windows,
            "helper_windows": self._helper_windows,
            "signals": list(self._signals.received),
            "ended_by": self._ended_by,
            "warnings": list(self.warnings),
            "otlp": None if self.target is None else {"endpoint": self.target.endpoint,
                                                      "protocol": self.target.protocol.value},
            "export": (None if self._windows is None or self._windows.exporter is None
                       else self._windows.report.as_metadata()),
        }

    def _write_from_segments(self, segments: SegmentWriter, metadata: dict[str, Any]) -> None:
        """The trace file from the segments (and any window kept in memory), a window at a time;
        the spans are read back from it only when asked for. Where it cannot be written, every
        window and the final metadata are left for ``xsp recover``."""
        assert self.output is not None
        kept = [in_start_order(arrow_table(table)) for table in self._tables]
        self._tables = []
        try:
            written = write_trace_tables(self.output, itertools.chain(segments.tables(), kept), metadata)
        except OSError as exc:
            self.write_error = str(exc)
            segments.keep([(segments.count + 1 + i, table) for i, table in enumerate(kept)])
            folders = segments.keep_finished(metadata)
            where = " and ".join(str(folder) for folder in folders) or "no folder (none could be written)"
            self._warn(f"the trace file was not written: {exc}; its windows and metadata are kept in {where} "
                       f"(`xsp recover {self.output}` writes it once the cause is fixed)")
            for note in segments.take_notes():
                self._warn(note)
            tables = list(segments.tables())
            self.trace = Trace(spans=spans_from_arrow(self.output, pa.concat_tables(tables)) if tables
                               else conform(pd.DataFrame()), metadata=metadata)
            return
        segments.discard()
        self.trace = Trace(source=written, metadata=metadata)

    def _export_done(self, report: ExportReport) -> None:
        """On the export's thread: record its outcome in the trace and its file."""
        if self.trace is None:
            return
        self.trace.metadata["export"] = report.as_metadata()
        if self.output is not None and self.write_error is None:
            try:
                self.trace.save(self.output)
            except OSError as exc:
                self.write_error = str(exc)
        if report.error is not None:
            self._warn(report.summary())

    def _tracer_details(self) -> dict[str, Any]:
        """What tracers report about themselves (a CUPTI clock offset, say), by tracer name."""
        details = {}
        for tracer in self._tracers:
            report = getattr(tracer, "metadata", None)
            if callable(report):
                try:
                    details[tracer.name] = report()
                except Exception as exc:
                    self._warn(f"tracer {tracer.name} could not describe itself: {exc}")
        return details

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        warnings.warn(f"xsp: {message}", XspWarning, stacklevel=3)


HELPER_ENV: Final = "XSP_HELPER_PROCESS"
"""Set to ``0`` to interpret a streaming session's windows in a thread of the user's process."""
DROPPED_WINDOWS: Final = "spans of windows no folder could take and memory could not hold"
HELPER_DEADLINE_S: Final = 60.0
HELPER_DEADLINE_PER_EVENT_S: Final = 200e-6
"""A helper process taking longer than this (plus this per record) is stopped (a deadlock)."""


@dataclasses.dataclass
class _WindowResult:
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


class _WindowWorker:
    """Interprets closed windows on a background thread while the session runs: writes each as
    a segment (when the session streams to its file) and exports it (when it exports to OTLP).

    When the session only streams, and every tracer can be interpreted in a forked child
    (``interprets_in_child``), each window is interpreted in a helper process forked at that
    moment (:mod:`xsp.forked`): the thread only waits, without the GIL, so the user's loop does
    not. If a helper fails, the window and those after it are interpreted in the thread.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self.target = session.target
        self.exporter = None if session.target is None else make_exporter(session.target)
        self.report = ExportReport(target="" if session.target is None else
                                   f"{session.target.protocol.value} {session.target.endpoint}")
        self.queue: queue.SimpleQueue[Window | None] = queue.SimpleQueue()
        self.closing = threading.Lock()
        self.closed_ns = now_ns()
        """When the last window closed (on the host clock)."""
        self.closed_events = 0
        """The session's records kept when the last window closed."""
        self.forks = self.exporter is None and fork_available() and os.environ.get(HELPER_ENV, "1") != "0"
        """Windows are interpreted in forked helper processes (until one fails)."""
        self.closed_windows = 0
        """Windows handed over while the session ran (several waiting are interpreted as one)."""
        self.stopping = False
        """The session's end was met while taking the windows waiting: none comes after them."""
        self.held: list[Window] = []
        """Windows taken during a DataLoader wait, handed over when it ends (:meth:`release_held`)."""
        self.thread = threading.Thread(target=self._run, name="xsp-windows", daemon=True)
        self.thread.start()

    def close_window(self, hold: bool = False) -> None:
        """Called on a recording thread at a step end: hand the idle threads' records over
        (``hold``: take them now, hand them over at :meth:`release_held`; the thread is waiting
        for its DataLoader, a wait the hand-off and the helper it forks must not lengthen)."""
        recording = self.session._recording
        if recording is None or not self.closing.acquire(blocking=False):
            return
        try:
            self.closed_ns, self.closed_events = now_ns(), recording.kept_events
            window = recording.take_window()
            if not window.empty:
                self.closed_windows += 1
                if hold:
                    self.held.append(window)
                else:
                    self.queue.put(window)
        finally:
            self.closing.release()

    def release_held(self) -> None:
        """Hand over the windows :meth:`close_window` held."""
        with self.closing:
            held, self.held = self.held, []
            for window in held:
                self.queue.put(window)

    @property
    def session_ids(self) -> tuple[str, int]:
        state = self.session._state
        return state.session_trace_id, state.session_span_id

    def _run(self) -> None:
        resource = None if self.exporter is None else resource_for(self.session.service_name, {
            **environment(), "distributed": None if self.session.rank is None else self.session.rank.as_metadata()})
        if self.forks:
            try:
                warm_up_writing()  # helpers then find Arrow's and Parquet's statics set up (see warm_up)
            except Exception:  # helpers would risk a hang: windows are interpreted here instead
                self.forks = False
        while (window := self._next_window()) is not None:
            self.session._prepare(window)
            if self._interpreted_in_helper(window):
                continue
            try:
                spans = self.session._interpret(window)
            except Exception as exc:  # its records are lost; the file says how many were dropped
                self.session._warn(f"the spans of a finished step could not be interpreted: {exc}")
                continue
            if self.exporter is not None and resource is not None:
                export_table(spans, resource, self.exporter, self.report, self.session_ids, self.session.span_budget)

    def _next_window(self) -> Window | None:
        """The next window to interpret: every window waiting, as one. On a machine too busy
        for the windows to keep pace, the backlog (what a kill would lose) then stays one window
        deep, instead of growing with the run."""
        if self.stopping:
            return None
        window = self.queue.get()
        if window is None:
            return None
        waiting = [window]
        while True:
            try:
                later = self.queue.get_nowait()
            except queue.Empty:
                break
            if later is None:
                self.stopping = True
                break
            waiting.append(later)
        return window if len(waiting) == 1 else Window.merged(waiting)

    def _interpreted_in_helper(self, window: Window) -> bool:
        """Interpret ``window`` in a forked helper process; False when it must be done here."""
        session = self.session
        if not self.forks or not all(getattr(tracer, "interprets_in_child", False) for tracer in session._tracers):
            return False
        if session._segments is not None and session._segments.pending:  # a helper would write them twice
            return False
        deadline_s = HELPER_DEADLINE_S + HELPER_DEADLINE_PER_EVENT_S * window.records
        try:
            result = run_forked(functools.partial(session._interpret_in_helper, window), deadline_s)
        except ForkFailed as exc:
            self.forks = False
            session._warn(f"a helper process could not interpret a window ({exc}); windows are interpreted "
                          "in this process from now on")
            return False
        session._adopt(result)
        return True

    def finish_windows(self) -> None:
        """Wait until every window handed over so far is interpreted, written and exported."""
        with self.closing:
            held, self.held = self.held, []
            for window in held:
                self.queue.put(window)
            self.queue.put(None)
        self.thread.join()

    def export_last(self, spans: pd.DataFrame, metadata: dict[str, Any],
                    on_done: Callable[[ExportReport], None]) -> OtlpExport:
        assert self.target is not None and self.exporter is not None
        return start_export(spans, metadata, self.target, self.session.service_name,
                            exporter=self.exporter, report=self.report, session=self.session_ids, on_done=on_done,
                            span_budget=self.session.span_budget, deadline_s=EXIT_WAIT_S)


def trace(levels: LevelsArg = ("model", "layer"), output: str | os.PathLike[str] | None = DEFAULT_OUTPUT,
          otlp_endpoint: str | None = None, service_name: str | None = None,
          otlp_protocol: str | None = None, max_events: int = DEFAULT_MAX_EVENTS,
          long_step_s: float = DEFAULT_LONG_STEP_S,
          schedule: Schedule | str | dict[str, int] | None = None, calibrate: bool = False,
          span_budget: int | None = None, dataset: str | os.PathLike[str] | None = None,
          backward: bool = True) -> Session:
    """Profile the code in a ``with`` block (or each call of a decorated function).

    Args:
        levels: levels to record, as ``("model", "layer")`` or ``"model,layer"``. The model
            level is always recorded. Levels no tracer can record here are warned about once.
        output: the ``.xsp.parquet`` file to write after the block; None to write none.
        otlp_endpoint: OTLP collector URL (``http://localhost:4317``); default from
            ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, else none.
        service_name: OTel ``service.name``; default ``OTEL_SERVICE_NAME``, else the script name.
        otlp_protocol: ``grpc`` or ``http/protobuf``; default ``OTEL_EXPORTER_OTLP_PROTOCOL``, else grpc.
        max_events: records kept before further ones are dropped (and counted).
        long_step_s: when exporting to OTLP, a step that lasts at least this long is exported
            as soon as it ends (once its thread is outside every module call and step),
            instead of after the block.
        schedule: record only some steps, as torch.profiler's schedule: an
            :class:`xsp.Schedule`, a dict of its fields, or ``"skip_first=10,wait=1,warmup=1,active=3,repeat=2"``.
            Steps are counted from the block's start; steps not recorded cost almost nothing.
        calibrate: before the block, measure what one span of each host level costs here
            (about a second; :mod:`xsp.calibration`) and keep it in ``metadata["calibration"]``,
            so that :func:`xsp.analysis.compensated` can take xsp's own cost out of the figures.
        span_budget: when exporting to OTLP, the most spans one trace (a step) is sent with;
            a step over it has its deepest levels folded into aggregate spans, so that Jaeger
            can open it (the file keeps every span). Default ``XSP_SPAN_BUDGET``, else 2000; 0: no limit.
        dataset: instead of ``output``, write the trace into this folder of runs, as
            ``<dataset>/run=<run id>/rank=<rank>/<service>.xsp.parquet``: every run's traces then
            form one Parquet dataset that DuckDB, Spark or Trino query with ``run`` and ``rank``
            as partition columns. The run id is ``XSP_RUN_ID``, else the distributed job's id,
            else the start time with a random suffix.
        backward: while autograd records a graph, hook each layer call's graph node so that
            its backward becomes a span (several microseconds per layer call). False for a
            block that never runs backward, such as inference without ``torch.no_grad``: its
            layers then cost what they cost under ``no_grad``.

    Raises:
        xsp.UnknownLevelError: a level name that does not exist.
        xsp.ScheduleError: a schedule that cannot be followed.

    Example:
        >>> import torch, xsp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> with xsp.trace(levels="model,layer", output=None) as session:
        ...     _ = model(torch.randn(2, 4))
        >>> session.trace.spans["name"].tolist()[:3]
        ['session', 'model', 'model.0']
    """
    return Session(levels=levels, output=output, otlp_endpoint=otlp_endpoint, service_name=service_name,
                   otlp_protocol=otlp_protocol, max_events=max_events, long_step_s=long_step_s, schedule=schedule,
                   calibrate=calibrate, span_budget=span_budget, dataset=dataset, backward=backward)
