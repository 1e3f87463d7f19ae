"""One profiling session around the user's code: the `with` block or decorated function of
:func:`xsp.trace` (:mod:`xsp.session.tracing`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing.util
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from xsp.core import contention
from xsp.core.clock import ClockSync, now_ns
from xsp.core.errors import XspWarning, warn
from xsp.core.lazy import background_imports_done
from xsp.core.levels import LevelsArg
from xsp.core.schema import DEFAULT_OUTPUT
from xsp.io.trace import Trace
from xsp.record import nvtx as nvtx_ranges
from xsp.record.columns import DEFAULT_MAX_EVENTS
from xsp.record.recording import Recording, ThreadCopy
from xsp.record.schedule import Schedule
from xsp.record.user_spans import span
from xsp.session import child_session, children, ending, exit_guard, starting
from xsp.session.children import ChildExport, ChildPlan, ChildState, Following
from xsp.session.ending import Finished, JoinedStart
from xsp.session.joining import ProcessClaim
from xsp.session.options import DEFAULT_LEVELS, DEFAULT_LONG_STEP_S, TraceOptions, without_environment_sampling
from xsp.session.running import RunningSession
from xsp.session.signals import StopSignals, Terminated, drop_handler_frames, end_by_signal
from xsp.session.windows import EXIT_WAIT_S
from xsp.tracers.base import Tracer
from xsp.tracers.module_calls.interceptor import INTERCEPTOR

if TYPE_CHECKING:
    from xsp.export.delivery import ExportReport
    from xsp.export.otlp import OtlpExport

F = TypeVar("F", bound=Callable[..., Any])


_process: ProcessClaim[Session] = ProcessClaim()
"""The session that holds the process, and the blocks that joined it (:mod:`xsp.session.joining`)."""


def active_session() -> Session | None:
    """The process's active session, if any."""
    return _process.active


def forget_active_session() -> None:
    """No session is active in this process any more (after a test that left one behind)."""
    _process.forget()


def _forget_session_in_child() -> None:
    """After ``os.fork()`` in a session: the child records nothing of the parent's session and
    writes no file of it (the parent's session owns the file; a process ``multiprocessing``
    starts follows it with a session of its own: :mod:`xsp.session.children`)."""
    session = _process.after_fork()
    if session is None:
        return
    session.forget_after_fork()
    INTERCEPTOR.forget_after_fork()


os.register_at_fork(after_in_child=_forget_session_in_child)


def _child_plan(folder: str, levels: tuple[str, ...], max_events: int, backward: bool, layer_depth: int | None,
                parent_pid: int, dataloader_worker: bool, sample: float | None = None,
                slow_factor: float | None = None, window_s: float | None = None, export: ChildExport | None = None,
                below: tuple[str, int] | None = None) -> ChildPlan:
    """In a child process started by spawn or forkserver, as ``multiprocessing`` unpickles its
    process: the plan it carries, begun (before the process's function runs)."""
    plan = ChildPlan(folder, levels, max_events, backward, layer_depth, parent_pid, dataloader_worker, sample,
                     slow_factor, window_s, export, below, starter=_start_child_session, arrival=_child_plan)
    children.begin(plan)
    return plan


def _start_child_session(plan: ChildPlan) -> None:
    """In a child process of a session (see :mod:`xsp.session.children`): a session of its own,
    silent (its warnings go into its trace, which the parent's session reads), that ends as the
    process does: its function returned or raised (``multiprocessing``'s exit hooks), or a
    stopping signal with its default action came (``Pool.terminate``), which then ends it."""
    warnings.filterwarnings("ignore", category=XspWarning)
    export = plan.export
    options = TraceOptions.parse(
        levels=plan.levels, output=plan.trace_path(os.getpid()), max_events=plan.max_events, backward=plan.backward,
        layer_depth=plan.layer_depth, nvtx=False, sample=plan.sample,
        slow_factor=None if plan.sample is None else plan.slow_factor, window_s=plan.window_s,
        otlp_endpoint=None if export is None else export.endpoint,
        otlp_protocol=None if export is None else export.protocol,
        service_name=None if export is None else export.service_name,
        span_budget=None if export is None else export.span_budget)
    if export is None:  # the parent sends its spans (OTEL_EXPORTER_OTLP_ENDPOINT would name a collector here too)
        options = dataclasses.replace(options, target=None)
    session = Session(options=options, below=plan.below,
                      # a server's worker, always on: `xsp capture PID` reaches it (a DataLoader's takes no steps)
                      listens=plan.sample is not None and not plan.dataloader_worker)
    session.signals = StopSignals(on_default=functools.partial(child_session.end, session, plan))
    session.__enter__()
    child_session.end_with_process(session, plan)
    plan.mark(os.getpid(), ChildState.RUNNING)
    # a forkserver's child is unpickled before multiprocessing clears the exit hooks: again after
    multiprocessing.util.register_after_fork(session, functools.partial(child_session.end_with_process, plan=plan))


def calibration_session(levels: tuple[str, ...]) -> Session:
    """A session that calibration measures in (:data:`xsp.session.calibration.SessionOpener`)."""
    with without_environment_sampling():
        return Session(levels=levels, output=None, schedule=None)


class Session:
    """A profiling session: a context manager, or a decorator that profiles each call.

    After the block, :attr:`trace` holds the :class:`xsp.Trace`, the trace file has been
    written (unless ``output=None``), and an OTLP export, if one was asked for, is running in
    the background (:attr:`export`; ``wait_for_export()`` waits for it). While the block runs,
    each step that lasts ``long_step_s`` or more is exported as soon as it ends.
    """

    def __init__(self, levels: LevelsArg = DEFAULT_LEVELS, output: str | os.PathLike[str] | None =
                 DEFAULT_OUTPUT, otlp_endpoint: str | None = None, service_name: str | None = None,
                 otlp_protocol: str | None = None, max_events: int = DEFAULT_MAX_EVENTS,
                 long_step_s: float = DEFAULT_LONG_STEP_S,
                 schedule: Schedule | str | dict[str, int] | None = None, calibrate: bool = False,
                 span_budget: int | None = None, dataset: str | os.PathLike[str] | None = None,
                 backward: bool = True, layer_depth: int | None = None, nvtx: bool | None = None,
                 sample: float | None = None, slow_factor: float | None = None,
                 rotate: str | float | None = None, window_s: float | None = None, *,
                 options: TraceOptions | None = None, listens: bool = True,
                 below: tuple[str, int] | None = None) -> None:
        self.options = options if options is not None else TraceOptions.parse(
            levels, output, otlp_endpoint, service_name, otlp_protocol, max_events, long_step_s, schedule, calibrate,
            span_budget, dataset, backward, layer_depth, nvtx, sample, slow_factor, rotate, window_s)
        """What the session was asked to do, checked (``options``, where given, is used as it is,
        and the other arguments are not read)."""
        self.listens = listens
        """It listens for ``xsp capture`` (a followed child process's own session only where always on,
        a server's worker: otherwise the parent's is what a user captures)."""
        self.below = below
        """The (trace id, span id) of the span the session's own is exported below, in its trace (a
        followed child process's session, below its parent's session span; None: a trace of its own)."""
        self.run: RunningSession | None = None
        """What the session records with while it runs, and ran with once it has ended (None
        before it starts, and in a block that joined another session until it ends)."""
        self.costs: dict[str, Any] | None = None
        """With ``calibrate``: what one span of each host level costs here (the trace's ``calibration``)."""
        self.trace: Trace | None = None
        self.export: OtlpExport | None = None
        self.finished: Finished | None = None
        """What the end of the run handed back (the trace, its writer, the export)."""
        self.warnings: list[str] = []
        self.on_finishing: list[Callable[[bool], None]] = []
        """Called with True when the block has ended and the trace is being written, with False
        once it is (the CLI shows a progress line meanwhile; a long run's write takes seconds)."""
        self._nested: span | None = None
        """While this block is part of another thread's session (it joined it): its span there."""
        self.copy: ThreadCopy | None = None
        """While this block is part of another session: the copy of its thread's records there,
        which its own trace is made of when it ends (:func:`ending.finish_joined`)."""
        self.joined: JoinedStart | None = None
        """While this block is part of another session: what it measured as it joined."""
        self.running = threading.Event()
        """Set once this session records, or could not start: a block that joins it waits for
        it, so that its calls are recorded from its first line on."""
        self.recording: Recording | None = None
        """The per-thread buffers the tracers record into (:mod:`xsp.record.recording`): the
        session's own, or the one it took over from the session it joined."""
        self.thread_id = 0
        """The native id of the thread that opened the session."""
        self.signals = StopSignals()
        """SIGTERM and SIGINT turned into an orderly end of the session."""
        self.following: Following | None = None
        """The child processes this session follows (:mod:`xsp.session.children`)."""
        self.forked = False
        """True in a child process forked while this session ran: it leaves the file to the parent."""
        self.ended_by: str | None = None
        """How the program ended the session, when not by leaving its block (``os._exit(0)``)."""
        self.on_exit_now: list[Callable[[int], None]] = []
        """Called with the exit status after the session ended the process's way out itself: the
        program called ``os._exit``, or a stopping signal (SIGTERM, SIGHUP) came whose default
        action ends it (the process then exits; the CLI says what was written)."""

    def left_open(self, on_stop: Callable[[int], None]) -> None:
        """The main thread has left this session's block while the program's threads still run
        (``xsp run`` ends the session at exit, after them): a stopping signal from now on calls
        ``on_stop(signum)``, which ends the session and then the process by the signal, instead of
        unwinding a block that no longer runs."""
        self.signals.end_by(on_stop)

    @property
    def output(self) -> Path | None:
        """The trace file: the one asked for until the session starts, which decides this
        process's own (its rank's, the dataset's), and None when none is written."""
        return self.options.output if self.run is None else self.run.output

    @property
    def tracers(self) -> list[Tracer]:
        """The tracers started, in the order they started (and stop)."""
        return [] if self.run is None else self.run.tracers

    # context manager -----------------------------------------------------------------
    def __enter__(self) -> Session:
        if self.options.calibrate and _process.active is None:  # before this session claims the process: it traces
            import torch

            from xsp.session.calibration import calibrate

            try:
                self.costs = {level.value: cost.as_dict() for level, cost in calibrate(
                    self.options.levels, calibration_session,
                    grad=torch.is_grad_enabled() and self.options.backward).items()}
            except Exception as exc:  # a failed calibration costs the figures, never the program
                self.warn(f"calibration failed, the trace has none: {type(exc).__name__}: {exc}")
        with _process.lock:
            active = _process.active
            self.thread_id = threading.get_native_id()
            if active is None:  # claimed before any tracer starts: a second session sees it
                self.recording = Recording(self.options.max_events)
                self.recording.models.own(self.thread_id)
                self.recording.backward_hooks = self.options.backward
                self.recording.layer_depth = self.options.layer_depth
                self._open_nvtx(self.recording)
                _process.take(self, self.recording)
            else:  # joins it, in the same claim: the active session's end then hands over to it
                if active.recording is not None:
                    self.copy = active.recording.start_copy(self.thread_id)
                self._nested = span("xsp.trace")
                self._nested.__enter__()
                _process.join(self)
        if active is not None:
            where = "" if active.thread_id == self.thread_id else f" (started in thread {active.thread_id})"
            sampling = ""
            if self.options.sampling != active.options.sampling:  # a recording samples its steps one way
                theirs = active.options.sampling
                sampling = (f"; its sample= is not used: that session decides how deep each step is recorded "
                            f"({'every step at every level' if theirs is None else f'sample {theirs.rate:g}'})")
            self.warn(f"xsp.trace() is already active{where}; this block joins that session: its calls are "
                      "recorded in that session's trace, and in a trace of its own, written when the block ends "
                      "(its model and layer calls); if it outlives that session it takes the recording over "
                      f"without a gap{sampling}")
            if active.thread_id != self.thread_id and not active.running.is_set():
                active.running.wait()  # that session is still starting: record this block's calls from its first
            self.joined = JoinedStart(ClockSync.measure(), contention.thread_times_ns(),
                                      None if active.run is None else active.run.rank)
            return self
        try:
            self._start()
        except BaseException:
            with _process.lock:
                _process.release(self)
            exit_guard.unguard()
            raise
        finally:
            self.running.set()
        return self

    def _open_nvtx(self, recording: Recording) -> None:
        """With NVTX on, the ranges the recording's spans push (or a warning saying why none)."""
        if not self.options.nvtx:
            return
        try:
            recording.nvtx, why = nvtx_ranges.open_ranges()
        except Exception as exc:  # NVTX costs the ranges, never the program
            recording.nvtx, why = None, f"{type(exc).__name__}: {exc}"
        if recording.nvtx is None:
            self.warn(f"nvtx: {why}")

    def _start(self, running: list[Tracer] | None = None, start_ns: int | None = None) -> None:
        assert self.recording is not None
        self.run = starting.start(self.options, self.thread_id, self.recording, self.warn, self.signals,
                                  self.end_by_os_exit, running, start_ns, listens=self.listens,
                                  below=self.below)
        if self.following is None:
            try:
                options = self.options
                sampling = options.sampling
                target = self.run.target if sampling is not None else None
                state = self.run.interpreter.state
                self.following = Following.open(
                    options.levels, options.max_events, options.backward, options.layer_depth,
                    starter=_start_child_session, arrival=_child_plan,
                    sampling=None if sampling is None else (sampling.rate, sampling.slow_factor),
                    window_s=options.window_s,
                    export=None if target is None else ChildExport(target.endpoint, target.protocol.value,
                                                                   options.service_name, options.span_budget),
                    below=(state.session_trace_id, state.session_span_id))
            except Exception as exc:  # the session runs on; child processes are then not followed
                self.warn(f"child processes are not followed: {type(exc).__name__}: {exc}")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        end_ns = now_ns()
        if exc is not None:
            drop_handler_frames(exc)
        with _process.lock:
            nested = self._nested
            if nested is not None:
                self._nested = None
                _process.leave(self)
        succeeded = exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0))
        error = None if succeeded else f"{type(exc).__name__}: {exc}"
        if nested is not None:
            self._end_joined(end_ns, error)
            nested.__exit__(exc_type, exc, traceback)
            return
        if self.forked:  # a forked child: the parent's session writes the file
            for tracer in self.tracers:
                with contextlib.suppress(Exception):
                    tracer.stop()
            return
        if not self.running.is_set():  # handed the recording over: the thread that ended the session
            self.running.wait()        # it joined is still starting this one
        if self.recording is None:  # it could not take the recording over (and said why)
            return
        interrupted = "SIGINT" if isinstance(exc, KeyboardInterrupt) else str(exc) if isinstance(exc, Terminated) \
            else None
        self._end(end_ns, error, exc, interrupted=interrupted)
        if isinstance(exc, Terminated):  # end as the signal's default action would have ended the program
            if self.export is not None:
                self.export.wait(EXIT_WAIT_S)
            self._tell_exit_now(128 + exc.signum)
            end_by_signal(exc.signum)

    def abandon(self) -> None:
        """End without a trace: nothing is written, and the windows streamed so far are removed
        (a child process whose parent's session has ended: what it recorded is no one's)."""
        exit_guard.unguard()
        with _process.lock:
            _process.release(self)
        run = self.run
        if run is not None:
            for tracer in run.tracers:
                run.stop_quietly(tracer)
            with contextlib.suppress(Exception):
                if run.windows is not None:
                    run.windows.finish_windows()
            if run.interpreter.segments is not None:
                run.interpreter.segments.discard()
            run.release_output()
        self.signals.release(None)

    def _end(self, end_ns: int, error: str | None, exc: BaseException | None, hand_over: bool = True,
             interrupted: str | None = None) -> None:
        """Stop the tracers and write the trace (``error``: why the block failed, None if it did not;
        ``interrupted``: the signal that stopped the program, which the end says).

        When a block that joined this session is still running (in another thread), the recording
        goes on without a gap: this session's trace holds what was recorded until ``end_ns`` (a
        thread's step or module call still running then goes on into the next trace, whole), and
        that block takes over the recording, with the tracers its levels keep, for what follows."""
        exit_guard.unguard()
        self.signals.hold()  # a second Ctrl-C or a SIGTERM now would leave no file: held until written
        background_imports_done()  # what the end imports, the window thread may be importing still
        successor: Session | None = None
        kept: list[Tracer] = []
        run = self.run
        assert run is not None
        try:
            with _process.lock:  # a signal ends the process: no one follows
                successor = _process.hand_over(self.recording, hand_over and not isinstance(exc, Terminated))
            if successor is not None:
                kept = successor.keeps(run.tracers)
            for tracer in run.tracers:
                if tracer not in kept:
                    run.stop_quietly(tracer)
            self._tell_finishing(True)
            try:
                self._took(ending.finish(run, end_ns, error, self.metadata, self.following, successor is not None,
                                         interrupted))
            except Exception as failure:  # xsp must never turn the user's success into a failure
                self.warn(f"the trace could not be built: {type(failure).__name__}: {failure}")
            finally:
                self._tell_finishing(False)
        finally:
            run.release_output()
            self.signals.release(exc, functools.partial(self._say_held, run.output))
            if successor is not None:
                successor._continue(self, kept, end_ns)

    def _say_held(self, output: Path | None, names: list[str]) -> None:
        """Stopping signals came while the trace was written, were held, and are delivered now
        (the process may end by them before the program or the CLI says anything more)."""
        written = output is not None and output.exists()
        self.warn(f"{' and '.join(names)} came while the trace was being written: held until "
                  f"{f'it was complete ({output})' if written else 'the session ended'}, and delivered now")

    def _end_joined(self, end_ns: int, error: str | None) -> None:
        """This block joined another session and ends before it: its own trace and file."""
        copy, self.copy = self.copy, None
        if copy is None or self.joined is None:
            return
        background_imports_done()
        self._tell_finishing(True)
        try:
            self._took(ending.finish_joined(self.options, self.thread_id, self.joined, copy, end_ns, error, self.warn,
                                            self.metadata))
        except Exception as failure:  # xsp must never turn the user's success into a failure
            self.warn(f"this block's own trace could not be built: {type(failure).__name__}: {failure}; its calls "
                      "are in the trace of the session it joined")
        finally:
            self._tell_finishing(False)

    def _took(self, finished: Finished) -> None:
        self.finished, self.trace, self.export = finished, finished.trace, finished.export

    def metadata(self) -> dict[str, Any]:
        """What the session itself puts in its trace's metadata (:data:`ending.SessionMetadata`)."""
        return {"calibration": self.costs, "signals": list(self.signals.received), "ended_by": self.ended_by,
                "warnings": list(self.warnings)}

    def _tell_finishing(self, writing: bool) -> None:
        for listener in self.on_finishing:
            with contextlib.suppress(Exception):  # a listener's failure is no reason to lose the trace
                listener(writing)

    def _tell_exit_now(self, status: int) -> None:
        for callback in self.on_exit_now:
            with contextlib.suppress(Exception):  # the process exits all the same
                callback(status)

    def end_by_os_exit(self, status: int) -> None:
        """``os._exit(status)`` was called while the session ran: end it now, as its block would
        have (no exit hook runs after ``os._exit``), then let the process exit."""
        if _process.active is not self:
            return
        self.ended_by = f"os._exit({status})"
        self._end(now_ns(), None if status == 0 else f"os._exit({status})", None, hand_over=False)
        if self.export is not None:
            self.export.wait(EXIT_WAIT_S)
        self._tell_exit_now(status)

    def __call__(self, function: F) -> F:
        """Use as a decorator: each call of ``function`` is one session."""

        @functools.wraps(function)
        def traced(*args: Any, **kwargs: Any) -> Any:
            session = Session(options=self.options)
            try:
                with session:
                    return function(*args, **kwargs)
            finally:
                self.trace, self.export, self.finished = session.trace, session.export, session.finished

        return traced  # type: ignore[return-value]

    def wait_for_export(self, timeout_s: float | None = None) -> ExportReport | None:
        """Wait for the background OTLP export; returns its report. Where the collector did not
        answer at the start, nothing was sent: the report the file recorded (``state`` failed,
        ``error`` "not used: ..."). None where no export was asked for."""
        if self.export is not None:
            return self.export.wait(timeout_s)
        recorded = None if self.trace is None else self.trace.metadata.get("export")
        if not isinstance(recorded, dict):
            return None
        from xsp.export.delivery import ExportReport  # (imported where a collector was asked for)

        return ExportReport.from_metadata(recorded)

    def adopt(self, recording: Recording | None) -> None:
        """This block, which joined another session, takes that session's ``recording`` over (its
        span there ends with that session)."""
        self._nested = None
        self.joined = None
        self.recording = recording

    def keeps(self, tracers: list[Tracer]) -> list[Tracer]:
        """Of the running ``tracers`` of the session this block joined, those it keeps running when
        it takes the recording over: those of its levels that hand their spans over window by
        window (one that collects only at its end, the operator level, is stopped and started again)."""
        return [tracer for tracer in tracers
                if tracer.level in self.options.levels and not tracer.collects_at_end]

    def _continue(self, ended: Session, running: list[Tracer], since_ns: int) -> None:
        """This block joined ``ended``, which has just ended (on its own thread, which runs this):
        from ``since_ns`` on, this session owns the recording, which never stopped, keeps the
        ``running`` tracers, starts those its levels need besides, and writes its own file."""
        recording = self.recording
        assert recording is not None
        copy, self.copy = self.copy, None
        self.following = ended.following  # the child processes started so far hand their spans over to it
        try:
            if copy is not None:  # its own calls from its start: its trace holds them too
                recording.take_back(recording.end_copy(copy, drain=False))
                since_ns = copy.start_ns
            recording.restart_counts(self.options.max_events)
            recording.models.own(self.thread_id)
            recording.backward_hooks = self.options.backward
            recording.layer_depth = self.options.layer_depth
            recording.paused = False
            where = "" if ended.output is None else f" ({ended.output})"
            self.warn("the xsp session this block joined has ended: this block records from now on, taking its "
                      "recording over without a gap; its trace holds its own calls from its start and every "
                      f"thread's from then on (with any step still open then, whole), that session's{where} what "
                      "ran before")
            self._start(running, since_ns)
        except BaseException as exc:  # the calls from now on are not recorded: said, never lost unsaid
            for tracer in [*running, *self.tracers]:
                with contextlib.suppress(Exception):
                    tracer.stop()
            with _process.lock:
                _process.release(self)
            exit_guard.unguard()
            if self.run is not None:
                self.run.release_output()
            self.recording = None
            if self.following is not None:
                self.following.discard()
                self.following = None
            self.warn(f"could not take the recording over: {type(exc).__name__}: {exc}; nothing after the end of "
                      "the session this block joined is recorded")
        finally:
            self.running.set()

    def forget_after_fork(self) -> None:
        """In a child forked while this session ran: it records nothing more, writes no file (the
        parent's session owns it) and leaves the child's signals to the child."""
        self.forked = True
        self.signals.forget()
        if self.recording is not None:
            self.recording.max_events = 0

    @property
    def active(self) -> bool:
        """This is the process's active session (not one that joined it, ended or not started)."""
        return _process.active is self

    @property
    def write_error(self) -> str | None:
        """Why the trace file could not be written (None when it was, or none was asked for)."""
        return None if self.finished is None else self.finished.writer.error

    def warn(self, message: str) -> None:
        """Say ``message`` once, as an :class:`XspWarning`, and keep it for the trace's metadata."""
        self.warnings.append(message)
        warn(XspWarning(f"xsp: {message}"))
