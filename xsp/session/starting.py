"""The start of a session: its tracers started (those that fail are left out, saying why), the
job's rank joined, the OTLP export opened, and the step ends watched that close windows."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from xsp.core import contention, machine_speed
from xsp.core.clock import ClockSync, now_ns
from xsp.core.rank import (
    RankInfo,
    dataset_path,
    rank_info,
    rank_path,
    run_id,
    session_trace_id,
)
from xsp.export.target import probe, span_budget_env_problem
from xsp.record.columns import NEVER
from xsp.record.schedule import StepAction
from xsp.session import exit_guard
from xsp.session.windows import WindowWorker
from xsp.tracers.base import Tracer
from xsp.tracers.registry import tracers_for

if TYPE_CHECKING:
    from xsp.session.session import Session


def start(session: Session, running: list[Tracer] | None = None, start_ns: int | None = None) -> None:
    """Start ``session``. ``running``: tracers already recording into its recording, which it
    keeps (it takes over the recording of a session that ended, see ``Session.keeps``);
    ``start_ns``: when it starts recording, if not now (the moment it took over)."""
    adopted = {tracer.name: tracer for tracer in running or ()}
    session.clock = ClockSync.measure()
    machine_speed.measure()  # before the tracers: the program's machine as the session found it
    session.threads_at_start = contention.thread_times_ns()
    join_job(session, rank_info())
    session.interpreter.host_to_epoch_ns = session.clock.host_to_epoch_ns
    session.interpreter.rank = session.rank
    session.claim_output()
    open_export(session)
    tracers, session.unavailable = tracers_for(session.options.levels)
    tracers = [adopted.pop(tracer.name, tracer) for tracer in tracers]
    for tracer in adopted.values():  # kept for a level no tracer records here now: it stops
        session.stop_quietly(tracer)
    kept = [tracer for tracer in tracers if tracer in (running or ())]
    tracers.sort(key=lambda tracer: not tracer.starts_first)  # stable: the rest keep their order
    by_reason: dict[str, list[str]] = {}
    for level, reason in session.unavailable.items():
        by_reason.setdefault(reason, []).append(level.value)
    for reason, levels in by_reason.items():  # one warning per cause (cuda_api and kernel share CUPTI's)
        plural = "s" if len(levels) > 1 else ""
        verb = "are" if len(levels) > 1 else "is"
        session.warn(f"level{plural} {', '.join(levels)} {verb} not recorded: {reason}")
    session.open_segments(tracers)
    if session.recording is not None:
        session.recording.levels = session.options.levels
    if session.options.schedule is not None and session.recording is not None:
        session.recording.paused = session.options.schedule.action(0) is StepAction.SKIP
    watch_step_ends(session, tracers)
    for tracer in tracers:
        if tracer in kept:  # it never stopped recording
            session.tracers.append(tracer)
            continue
        try:
            tracer.start(session.recording)
            session.tracers.append(tracer)
        except Exception as exc:
            session.warn(f"tracer {tracer.name} failed to start and is disabled: {exc}")
            session.stop_quietly(tracer)
    # signals are handled in the main thread only (a forkserver's child: the thread that forked
    # it is named main, with the forkserver's thread id, until multiprocessing renames it)
    if session.thread_id == threading.get_native_id() and threading.current_thread() is threading.main_thread():
        session.signals.install()
    exit_guard.guard(session.end_by_os_exit)
    session.start_ns = now_ns() if start_ns is None else start_ns
    if session.interpreter.segments is not None:
        try:
            session.interpreter.segments.start(session.start_metadata())
        except OSError as exc:
            folder = session.interpreter.segments.directory.parent
            if folder.is_dir() and os.access(folder, os.W_OK):  # else the file fails too, and says so
                session.warn(f"windows are kept in memory, not streamed to disk: {exc}")
        for note in session.interpreter.segments.take_notes():
            session.warn(note)


def join_job(session: Session, rank: RankInfo | None) -> None:
    """One rank of a distributed job: its own file beside the given name, and trace ids
    that every rank of the job shares."""
    if session.options.dataset is not None:
        session.run_id = run_id(rank)
        session.output = dataset_path(session.options.dataset, session.run_id, 0 if rank is None else rank.rank,
                                      session.options.service_name)
        try:
            session.output.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # the program runs on; the trace stays in memory (session.trace)
            session.warn(f"cannot write into the dataset {session.options.dataset} ({exc.strerror or exc}): the trace "
                         "is not written to a file")
            session.output = None
    if rank is None:
        return
    session.rank = rank
    session.interpreter.state.job_id = rank.job_id
    session.interpreter.state.session_trace_id = session_trace_id(rank.job_id)
    if session.output is not None and session.options.dataset is None:
        session.output = rank_path(session.output, rank.rank)


def open_export(session: Session) -> None:
    """Probe the OTLP endpoint; if it answers, export long steps as they end."""
    if session.target is None or session.recording is None:
        return
    problem = span_budget_env_problem()
    if problem is not None and session.options.span_budget_from_env:
        session.warn(problem)
    unreachable = probe(session.target)
    if unreachable is not None:
        where = f" ({session.output})" if session.output else ""
        session.warn(f"OTLP endpoint {session.target.endpoint} not used: {unreachable}; "
                   f"the spans are in the trace file only{where}")
        session.target = None
        return
    session.windows = WindowWorker(session)


def _step_end_hook(tracer: Tracer) -> Callable[[], None] | None:
    try:
        return tracer.step_end_hook()
    except Exception:  # a tracer that cannot say flushes at no step end
        return None


def watch_step_ends(session: Session, tracers: list[Tracer]) -> None:
    """Tell the recording who hears of step ends: tracers that flush at each step (every
    step), and the window worker (a step of ``long_step_s`` or more, or the first step end
    ``WINDOW_S`` after the last window closed)."""
    assert session.recording is not None
    flushers = [hook for hook in map(_step_end_hook, tracers) if hook is not None]
    windows = session.windows
    at_end = [tracer.name for tracer in tracers if tracer.collects_at_end]
    if at_end:  # their spans of a step come only after the session: never export a step without them
        windows = None
    long_step_ns = int(session.options.long_step_s * 1e9)
    scheduled = session.options.schedule is not None
    if not flushers and windows is None and not scheduled:
        return

    window_ns = int(session.options.window_s * 1e9) if session.interpreter.segments is not None else NEVER
    window_events = session.options.window_events if session.interpreter.segments is not None else NEVER
    recording = session.recording
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
            session.scheduled_step_ended(duration_ns)
        for flush in flushers:
            try:
                flush()
            except Exception:  # a flush is an optimisation; the final one still runs
                pass
        if windows is not None:
            window_if_due(duration_ns >= long_step_ns)

    if scheduled:
        recording.on_ended_thread_step = lambda buffer, duration_ns: session.scheduled_step_ended(
            duration_ns, buffer=buffer)
    recording.long_step_ns = 0 if every_step else long_step_ns
    if windows is not None:
        next_window_due()
        recording.on_new_thread.append(window_if_due)
        session.watching.append(window_if_due)
        recording.on_wait_over = wait_over
    recording.on_long_step = step_ended


def stop_watching(session: Session) -> None:
    """Undo :func:`watch_step_ends`: ``session`` hands its recording, which goes on, to another."""
    recording = session.recording
    assert recording is not None
    recording.on_long_step = None
    recording.on_wait_over = None
    recording.on_ended_thread_step = None
    recording.window_deferred = False
    recording.long_step_ns = recording.report_after_ns = recording.report_at_events = NEVER
    for hello in session.watching:
        if hello in recording.on_new_thread:
            recording.on_new_thread.remove(hello)
    session.watching.clear()
