"""The start of a session: its tracers started (those that fail are left out, saying why), the
job's rank joined, the output decided and claimed, the OTLP export opened, and the step ends
watched that close windows; all of it handed over as one :class:`RunningSession`."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from xsp.core import contention
from xsp.core.clock import ClockSync, now_ns
from xsp.core.metadata import environment
from xsp.core.rank import RankInfo, rank_info, run_id
from xsp.export.target import OtlpTarget, probe, span_budget_env_problem
from xsp.io.segments import SegmentWriter
from xsp.record.columns import NEVER
from xsp.record.recording import Recording
from xsp.record.sampling import StepSampler, otel_context_location, otel_context_probe
from xsp.session import exit_guard
from xsp.session.interpreting import WindowInterpreter
from xsp.session.leveled_plans import depth_plans
from xsp.session.options import CAPTURE_WINDOW_S, TraceOptions
from xsp.session.output_name import OutputName
from xsp.session.pauses import WAIT_FRACTION, PauseWait
from xsp.session.running import RunningSession, claim_dataset_place, output_for, stop_quietly
from xsp.session.scheduled import ScheduledSteps
from xsp.session.signals import StopSignals
from xsp.session.windows import WindowWorker
from xsp.table.build import new_step_state
from xsp.tracers.base import Tracer
from xsp.tracers.registry import tracers_for

if TYPE_CHECKING:
    from xsp.export.metrics import LatencyMetrics

LONGEST_WINDOW_NS: Final = 1 << 62
"""The longest window interval kept (about 146 years): longer ones are as good as never."""


def start(options: TraceOptions, thread_id: int, recording: Recording, warn: Callable[[str], None],
          signals: StopSignals, on_os_exit: Callable[[int], None], running: list[Tracer] | None = None,
          start_ns: int | None = None, listens: bool = True, below: tuple[str, int] | None = None) -> RunningSession:
    """Start a session of ``options`` opened on thread ``thread_id`` (native id), recording into
    ``recording``; ``warn`` says what goes wrong, ``signals`` are installed (where this is that
    thread, and the main one), and ``on_os_exit`` is called if the program calls ``os._exit``.
    ``running``: tracers already recording into ``recording``, which it keeps (it takes over the
    recording of a session that ended, on that session's thread, see ``Session.keeps``);
    ``start_ns``: when it starts recording, if not now (the moment it took over); ``listens``: it
    opens a control socket for ``xsp capture``; ``below``: the (trace id, span id) its session span
    is exported below (a followed child process's, below its parent's session span)."""
    adopted = {tracer.name: tracer for tracer in running or ()}
    clock = ClockSync.measure()
    threads_at_start = contention.thread_times_ns()
    rank = rank_info()
    this_run = None if options.dataset is None else run_id(rank)
    output_name = OutputName()
    if this_run is not None:
        output, this_run = claim_dataset_place(options, rank, this_run, output_name, warn)
    else:
        output = output_for(options, rank, this_run, warn)
    try:
        if output is not None and this_run is None:
            output = output_name.take(output, warn)
        target, collector_down = open_export(options, output, warn)
        tracers, unavailable = tracers_for(options.levels)
        tracers = [adopted.pop(tracer.name, tracer) for tracer in tracers]
        for tracer in adopted.values():  # kept for a level no tracer records here now: it stops
            stop_quietly(tracer, warn)
        kept = [tracer for tracer in tracers if tracer in (running or ())]
        tracers.sort(key=lambda tracer: not tracer.starts_first)  # stable: the rest keep their order
        by_reason: dict[str, list[str]] = {}
        for level, reason in unavailable.items():
            by_reason.setdefault(reason, []).append(level.value)
        for reason, levels in by_reason.items():  # one warning per cause (cuda_api and kernel share CUPTI's)
            plural = "s" if len(levels) > 1 else ""
            verb = "are" if len(levels) > 1 else "is"
            warn(f"level{plural} {', '.join(levels)} {verb} not recorded: {reason}")
        # stream closed windows to segments beside the output, unless a tracer's spans of a step
        # only come at the session's end (then windows stay open and spans in memory)
        segments = None
        if output is not None and not any(tracer.collects_at_end for tracer in tracers):
            segments = SegmentWriter(output)
        started: list[Tracer] = []
        for problem in (options.sampling_env_problem, options.window_env_problem):
            if problem is not None:
                warn(problem)
        sampler = None if options.sampling is None else always_on_sampler(options)
        interpreter = WindowInterpreter(started, new_step_state(job_id=None if rank is None else rank.job_id,
                                                                  below=below), warn,
                                        clock.host_to_epoch_ns, rank, segments, latency=sampler is not None,
                                        depth_plans=None if sampler is None else sampler.plans)
        if sampler is not None:  # the drawn steps rotate through the layer depths the windows show
            interpreter.on_deeper_layers = lambda deepest: sampler.rotate(depth_plans(options.levels, deepest))
        windows = None
        if target is not None or segments is not None:
            windows = WindowWorker(recording, interpreter, target, options, rank, warn,
                                   None if sampler is None else pause_wait_of(sampler, recording, options),
                                   collector_down)
        metrics = None
        if options.sampling is not None and target is not None:
            metrics = latency_metrics(options, target, rank, warn)
            interpreter.on_latencies = None if metrics is None else metrics.record
        recording.levels = options.levels
        steps = None if options.schedule is None else ScheduledSteps(options.schedule, recording)
        if steps is not None:
            steps.pause_first()
        if sampler is not None:
            recording.sample_steps(sampler)
        watching = watch_step_ends(options, recording, tracers, windows, segments is not None, steps, sampler)
        for tracer in tracers:
            if tracer in kept:  # it never stopped recording
                started.append(tracer)
                continue
            try:
                tracer.start(recording)
                started.append(tracer)
            except Exception as exc:
                warn(f"tracer {tracer.name} failed to start and is disabled: {exc}")
                stop_quietly(tracer, warn)
        # signals are handled in the main thread only (a forkserver's child: the thread that forked
        # it is named main, with the forkserver's thread id, until multiprocessing renames it)
        if thread_id == threading.get_native_id() and threading.current_thread() is threading.main_thread():
            signals.install(recover=output if segments is not None else None)
        exit_guard.guard(on_os_exit)
    except BaseException:
        output_name.release()
        raise
    run = RunningSession(
        options=options, thread_id=thread_id, warn=warn, recording=recording, clock=clock,
        threads_at_start=threads_at_start, rank=rank, run_id=this_run, output_name=output_name, output=output,
        target=target, collector_down=collector_down, interpreter=interpreter, tracers=started,
        unavailable=unavailable, windows=windows,
        steps=steps, start_ns=now_ns() if start_ns is None else start_ns, watching=watching, sampler=sampler,
        metrics=metrics)
    if listens:
        run.open_control()
    if windows is not None and options.rotates:
        windows.after_window = run.rotate_if_due
    if segments is not None:
        try:
            segments.start(run.start_metadata())
        except OSError as exc:
            folder = segments.directory.parent
            if folder.is_dir() and os.access(folder, os.W_OK):  # else the file fails too, and says so
                warn(f"windows are kept in memory, not streamed to disk: {exc}")
        for note in segments.take_notes():
            warn(note)
    return run


def pause_wait_of(sampler: StepSampler, recording: Recording, options: TraceOptions) -> PauseWait:
    """Where an always-on session's windows wait for a pause in its steps (told by when
    ``sampler`` saw the last step begin and by ``recording``'s calls under way) before their
    work starts."""
    return PauseWait(lambda: sampler.last_begun_ns, recording.calls_running, options.window_s * WAIT_FRACTION)


def always_on_sampler(options: TraceOptions) -> StepSampler:
    """The step sampler of an always-on session: its drawn steps rotate through the leveled runs
    of its levels (learnt deeper as windows show deeper layers)."""
    assert options.sampling is not None
    sampler = StepSampler(options.sampling, otel_context_probe(), context=otel_context_location())
    sampler.rotate(depth_plans(options.levels, 1))
    return sampler


def latency_metrics(options: TraceOptions, target: OtlpTarget, rank: RankInfo | None,
                    warn: Callable[[str], None]) -> LatencyMetrics | None:
    """The step and layer latency histograms sent to ``target``'s collector (None, said, when
    the SDK's exporter cannot be made)."""
    from xsp.export.metrics import LatencyMetrics, metric_exporter
    from xsp.export.otlp import resource_for

    try:
        resource = resource_for(options.service_name, {
            **environment(), "distributed": None if rank is None else rank.as_metadata()})
        return LatencyMetrics(metric_exporter(target), resource)
    except Exception as exc:
        warn(f"latency metrics are not exported ({type(exc).__name__}: {exc}); the trace file keeps them")
        return None


def open_export(options: TraceOptions, output: Path | None,
                warn: Callable[[str], None]) -> tuple[OtlpTarget | None, str | None]:
    """The collector to export to, probed, and why it does not answer now (None: it does).
    The collector is None where none was asked for, or where it does not answer and the session
    is not always on (said, with where the spans are instead, and the reason returned: the
    trace's ``export`` records it). An always-on session (a service,
    whose collector may start after it) keeps it and tries it again at each window."""
    if options.target is None:
        return None, None
    problem = span_budget_env_problem()
    if problem is not None and options.span_budget_from_env:
        warn(problem)
    unreachable = probe(options.target)
    if unreachable is None:
        return options.target, None
    where = f" ({output})" if output else ""
    if options.sampling is not None:
        kept = f"the spans of the windows until then are in the trace file only{where}" if output else (
            "the spans of the windows until then are not sent (the session's trace keeps them)")
        warn(f"OTLP endpoint {options.target.endpoint} does not answer now: {unreachable}; the session tries it "
             f"again at each window, and {kept}")
        return options.target, unreachable
    warn(f"OTLP endpoint {options.target.endpoint} not used: {unreachable}; the spans are in the trace file "
         f"only{where}")
    return None, unreachable


def _step_end_hook(tracer: Tracer) -> Callable[[], None] | None:
    try:
        return tracer.step_end_hook()
    except Exception:  # a tracer that cannot say flushes at no step end
        return None


def watch_step_ends(options: TraceOptions, recording: Recording, tracers: list[Tracer], windows: WindowWorker | None,
                    streaming: bool, steps: ScheduledSteps | None,
                    sampler: StepSampler | None = None) -> list[Callable[[], None]]:
    """Tell ``recording`` who hears of step ends: tracers that flush at each step (every step),
    ``steps`` (every step), ``sampler`` (every step: it learns what a slow step is), and the
    window worker (a step of ``long_step_s`` or more, or the first step end ``window_s`` after
    the last window closed; ``streaming``: windows are written to segments). Returns what it
    added to the recording's ``on_new_thread``."""
    flushers = [hook for hook in map(_step_end_hook, tracers) if hook is not None]
    at_end = [tracer.name for tracer in tracers if tracer.collects_at_end]
    if at_end:  # their spans of a step come only after the session: never export a step without them
        windows = None
    long_step_ns = int(options.long_step_s * 1e9)
    if not flushers and windows is None and steps is None and sampler is None:
        return []

    # capped, so that the next window's due time stays an int64 (xsp's C wrapper reads it; one past
    # it would send every step to the Python path)
    window_ns = min(int(options.window_s * 1e9), LONGEST_WINDOW_NS) if streaming else NEVER
    capture_window_ns = min(window_ns, int(CAPTURE_WINDOW_S * 1e9))
    window_events = options.window_events if streaming else NEVER
    every_step = bool(flushers) or steps is not None  # (a sampler hears the others from xsp's C wrapper)

    def window_ns_now() -> int:
        assert windows is not None
        return capture_window_ns if windows.interpreter.watching else window_ns

    def next_window_due() -> None:  # WINDOW_S (CAPTURE_WINDOW_S while capturing) or WINDOW_EVENTS past the last window
        assert windows is not None
        recording.report_after_ns = windows.closed_ns + window_ns_now()
        recording.report_at_events = windows.closed_events + window_events

    def window_if_due(long_step: bool = False) -> None:
        # at a step end, and at a thread's first record: a server that starts a thread per
        # request decides no step on any thread (each one's only step is decided when the
        # thread has ended), so windows come due there too; and on the window thread about
        # once a second while a capture waits (its steps may be the last for a while)
        assert windows is not None
        if (long_step or now_ns() - windows.closed_ns >= window_ns_now()
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
        if sampler is not None:  # before a window is taken: its note of a slow step goes with the step
            sampler.step_ended(duration_ns, getattr(recording.local, "b", None))
        if steps is not None:
            steps.step_ended(duration_ns)
        for flush in flushers:
            try:
                flush()
            except Exception:  # a flush is an optimisation; the final one still runs
                pass
        if windows is not None:
            window_if_due(duration_ns >= long_step_ns)

    if steps is not None:
        recording.on_ended_thread_step = lambda buffer, duration_ns: steps.step_ended(duration_ns, buffer=buffer)
    recording.long_step_ns = 0 if every_step else long_step_ns
    watching: list[Callable[[], None]] = []
    if windows is not None:
        next_window_due()
        def watcher_came() -> None:
            next_window_due()
            windows.watcher_came()

        windows.interpreter.on_watch = watcher_came
        windows.close_by_time_with(window_if_due)
        recording.on_new_thread.append(window_if_due)
        watching.append(window_if_due)
        recording.on_wait_over = wait_over
    recording.on_long_step = step_ended
    return watching


def stop_watching(run: RunningSession) -> None:
    """Undo :func:`watch_step_ends`: ``run`` hands its recording, which goes on, to another."""
    recording = run.recording
    recording.sample_steps(None)
    recording.on_long_step = None
    recording.on_wait_over = None
    recording.on_ended_thread_step = None
    recording.window_deferred = False
    recording.long_step_ns = recording.report_after_ns = recording.report_at_events = NEVER
    run.interpreter.on_watch = None  # a capture would move the next session's windows
    for hello in run.watching:
        if hello in recording.on_new_thread:
            recording.on_new_thread.remove(hello)
