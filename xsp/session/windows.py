"""Windows interpreted while the program runs: a worker thread takes each closed window, has a
forked helper process (or itself) turn it into span rows, writes them to the session's
segments and hands them to the exporter, with deadlines that keep a stuck helper from hanging
the program."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, Final

from xsp.core.clock import now_ns
from xsp.core.lazy import SESSION_MODULES, forks_wait, import_modules
from xsp.core.lazy import pandas as pd
from xsp.core.lazy import pyarrow as pa
from xsp.core.metadata import environment
from xsp.core.rank import RankInfo
from xsp.core.threads import start_thread
from xsp.export.delivery import ExportReport, hurry_posts, make_exporter
from xsp.export.target import OtlpTarget, probe
from xsp.io.segments import warm_up as warm_up_writing
from xsp.record.recording import Recording
from xsp.record.window import Window
from xsp.session.forked import ForkFailed, fork_available, run_forked
from xsp.session.interpreting import WindowInterpreter, WindowResult
from xsp.session.options import CAPTURE_WINDOW_S, TraceOptions
from xsp.session.pauses import PAUSE_S, PauseWait

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

    from xsp.export.otlp import OtlpExport, PreparedExport

EXIT_WAIT_S = 8.0
"""At interpreter exit, how long to wait for an OTLP export still running."""
HELPER_ENV: Final = "XSP_HELPER_PROCESS"
"""Set to ``0`` to interpret a streaming session's windows in a thread of the user's process."""
DROPPED_WINDOWS: Final = "spans of windows no folder could take and memory could not hold"
MAX_MERGED: Final = 4
"""Windows waiting that are interpreted as one, at most: fewer forks when the windows fall behind,
and no window so large that interpreting it takes more memory than a few windows' worth."""
ALWAYS_ON_HELPER_NICENESS: Final = 19
"""How much an always-on session's helper processes lower their priority (``os.nice``): a request
thread that becomes runnable takes the CPU from them at once, and their work (a window a minute)
is done in the CPU time the service leaves. Other sessions' helpers keep the program's priority:
a training loop keeps every core busy, and its windows (one a second) must keep pace with it."""


class Wake(Enum):
    """What the worker's queue holds besides windows and the end (None)."""

    WATCHER = "watcher"
    """A capture began watching: the worker, blocked with nothing to do, starts closing windows by
    time (:meth:`WindowWorker.close_by_time_with`)."""


HELPER_DEADLINE_S: Final = 60.0
HELPER_DEADLINE_PER_EVENT_S: Final = 200e-6
"""A helper process taking longer than this (plus this per record) is stopped (a deadlock)."""
HELPER_RETRY_FIRST_S: Final = 60.0
HELPER_RETRY_MAX_S: Final = 3600.0
"""After a helper process fails, windows are interpreted in the program's process, and a helper is
tried again :data:`HELPER_RETRY_FIRST_S` later, then twice as long after each failure in a row, at
most this long apart. A service that runs for days is not left paying for every later window's
interpretation because one helper failed once (a fork refused while memory was short, a helper
killed by the out-of-memory killer)."""


class WindowWorker:
    """Interprets closed windows on a background thread while the session runs: writes each as
    a segment (when the session streams to its file) and exports it (when it exports to OTLP).

    When the session only streams, and every tracer can be interpreted in a forked child
    (``interprets_in_child``), each window is interpreted in a helper process forked at that
    moment (:mod:`xsp.session.forked`): the thread only waits, without the GIL, so the user's loop does
    not. If a helper fails, the window and those after it are interpreted in the thread until a
    helper is tried again (:data:`HELPER_RETRY_FIRST_S`, then longer while they keep failing).

    Args:
        recording: the session's recording, whose windows it takes.
        interpreter: the session's interpreter, which turns them into spans.
        target: the collector to export to (None: windows are only written).
        options: the session's options (its service name and span budget).
        rank: the session's rank in a distributed job, which the export's resource names.
        warn: how a problem is said (the session's warning).
        pause_wait: where a window's work waits for a pause in the program's steps first (an
            always-on session's, :mod:`xsp.session.pauses`); None: it starts at once.
    """

    def __init__(self, recording: Recording, interpreter: WindowInterpreter, target: OtlpTarget | None,
                 options: TraceOptions, rank: RankInfo | None, warn: Callable[[str], None],
                 pause_wait: PauseWait | None = None, collector_down: str | None = None) -> None:
        self.recording = recording
        self.interpreter = interpreter
        self.options = options
        self.rank = rank
        self.warn = warn
        self.target = target
        self.exporter = None if target is None else make_exporter(target)
        self.report = ExportReport(target="" if target is None else f"{target.protocol.value} {target.endpoint}")
        if collector_down is not None:  # nothing is sent until the collector answers (_resume_if_answering)
            self.report.hold(collector_down)
        self.said_failing = collector_down is not None
        """The export's failing was said while the session ran (the start's line says a collector
        that did not answer then): once, a service learns it then, not at its end days later."""
        self.queue: queue.SimpleQueue[Window | Wake | None] = queue.SimpleQueue()
        self.closing = threading.Lock()
        self.closed_ns = now_ns()
        """When the last window closed (on the host clock)."""
        self.closed_events = 0
        """The session's records kept when the last window closed."""
        self.forks = interpreter.segments is not None and fork_available() and os.environ.get(HELPER_ENV, "1") != "0"
        """Windows are interpreted in forked helper processes (in this process for a while after one
        fails); where the session exports, the helper also makes the window's spans ready to send
        (:func:`prepare_export`)."""
        self.helper_failures = 0
        """Helper processes that failed (the file's ``helper_failures``); the first is said."""
        self.failures_in_a_row = 0
        self.helpers_again_ns = 0
        """After a helper failed: when a helper is tried again (host clock)."""
        self.encoded_resource: tuple[bytes, bytes] | None = None
        """The export's resource and scope as xsp's encoder writes them (made once)."""
        self.helper_niceness = ALWAYS_ON_HELPER_NICENESS if options.sampling is not None else 0
        """How much the helpers lower their priority while the windows keep pace (see
        :data:`ALWAYS_ON_HELPER_NICENESS`)."""
        self.merged_last = False
        """The window being interpreted was several waiting, taken as one (:meth:`_next_window`)."""
        self.helpers_behind = 0
        """Helpers run at the program's priority because windows were waiting (the file's
        ``helpers_behind``)."""
        self.closed_windows = 0
        """Windows handed over while the session ran (several waiting are interpreted as one)."""
        self.stopping = False
        """The session's end was met while taking the windows waiting: none comes after them."""
        self.held: list[Window] = []
        """Windows taken during a DataLoader wait, handed over when it ends (:meth:`release_held`)."""
        self.after_window: Callable[[], None] | None = None
        """Called on the worker's thread after each window is written (a session in parts seals one)."""
        self.finished = False
        """No window is taken any more (:meth:`finish_windows`): what is recorded stays in the
        recording, for the session's last window or the session it is handed over to."""
        self.pause_wait = pause_wait
        self.window_if_due: Callable[[], None] | None = None
        """Set by :meth:`close_by_time_with`."""
        self.ending = threading.Event()
        """Set when the session ends and waits for the windows: a helper that stalls is stopped sooner."""
        self.thread = start_thread(self._run, "xsp-windows")

    def close_window(self, hold: bool = False) -> None:
        """Called on a recording thread at a step end: hand the idle threads' records over
        (``hold``: take them now, hand them over at :meth:`release_held`; the thread is waiting
        for its DataLoader, a wait the hand-off and the helper it forks must not lengthen)."""
        recording = self.recording
        if not self.closing.acquire(blocking=False):
            return
        try:
            if self.finished:  # a window taken now would come after the last one interpreted
                return
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

    def close_by_time_with(self, window_if_due: Callable[[], None]) -> None:
        """While a capture waits for its steps, call ``window_if_due`` (what a step end calls: it
        closes a window when one is due) about every :data:`CAPTURE_WINDOW_S`, though no step ends:
        a service's burst of requests that the capture asked for, then quiet, leaves its decided
        steps in the recording, with no step end to take them. With no capture, the worker waits
        for a window without waking: each wake of a thread of xsp's takes the GIL from the
        program's threads (an event loop's) on a core the program may need. :meth:`watcher_came`
        starts the looking."""
        self.window_if_due = window_if_due

    def watcher_came(self) -> None:
        """A capture began watching (:attr:`WindowInterpreter.on_watch`): the worker, perhaps
        waiting for a window with no deadline, starts looking every :data:`CAPTURE_WINDOW_S`."""
        self.queue.put(Wake.WATCHER)

    def release_held(self) -> None:
        """Hand over the windows :meth:`close_window` held."""
        with self.closing:
            held, self.held = self.held, []
            for window in held:
                self.queue.put(window)

    def wait_counts(self) -> dict[str, int] | None:
        """How the work of the windows began (windows waiting together are interpreted, and
        counted, as one): after a pause in the steps, with the steps going on, or at once (a
        capture, the session's end). None: it never waits, as in any session but an always-on one."""
        return None if self.pause_wait is None else self.pause_wait.as_metadata()

    @property
    def session_ids(self) -> tuple[str, int]:
        state = self.interpreter.state
        return state.session_trace_id, state.session_span_id

    def _run(self) -> None:
        # pandas, pyarrow and OpenTelemetry's SDK, imported here beside the program, which they
        # would have kept from its first line; a fork of the program meanwhile waits for them
        with forks_wait():
            with contextlib.suppress(Exception):  # what fails here fails again, said, where it is used
                import_modules(SESSION_MODULES)
            from xsp.export.encoding import resource_and_scope
            from xsp.export.otlp import export_table, resource_for, sends_encoded

            resource = None if self.exporter is None else resource_for(self.options.service_name, {
                **environment(), "distributed": None if self.rank is None else self.rank.as_metadata()})
            if self.exporter is not None and resource is not None and self.forks:
                try:  # a helper sends nothing: it hands back batches this process only posts
                    self.encoded_resource = resource_and_scope(resource) if sends_encoded(self.exporter) else None
                except Exception:
                    self.encoded_resource = None
                self.forks = self.encoded_resource is not None
            if self.forks:
                try:
                    warm_up_writing()  # helpers then find Arrow's and Parquet's statics set up (see warm_up)
                except Exception:  # helpers would risk a hang: windows are interpreted here instead
                    self.forks = False
        while (window := self._next_window()) is not None:
            interpreter = self.interpreter
            interpreter.prepare(window)  # at once: what only this process holds (CUPTI's buffers) is taken in
            if self.pause_wait is not None and window.closed_ns is not None:
                self.pause_wait.wait(window.closed_ns, lambda: self.interpreter.watching,
                                     lambda: not self.queue.empty())
            try:
                in_helper = self._interpreted_in_helper(window, resource)
            except Exception as exc:  # taking over what it learnt failed part-way: the windows after go on
                self.warn(f"what a helper process learnt of a window could not be taken over ({type(exc).__name__}: "
                          f"{exc}): that window's spans may be missing from the trace")
                in_helper = True
            if not in_helper:
                try:
                    spans = interpreter.interpret(window)
                except Exception as exc:  # its records are lost; the file says how many were dropped
                    self.warn(f"the spans of a finished step could not be interpreted: {exc}")
                    continue
                if self.exporter is not None and resource is not None:
                    self._resume_if_answering()
                    export_table(spans, resource, self.exporter, self.report, self.session_ids,
                                 self.options.span_budget)
            self._say_if_failing()
            if self.after_window is not None:
                try:
                    self.after_window()
                except Exception as exc:  # the windows are all still there for the file at the end
                    self.warn(f"the trace could not be sealed as a part: {exc}")

    def _next_window(self) -> Window | None:
        """The next window to interpret: the windows waiting (up to :data:`MAX_MERGED`), as one.
        On a machine too busy for the windows to keep pace, the backlog (what a kill would lose)
        then grows by fewer windows than it would one at a time."""
        if self.stopping:
            return None
        while True:
            window_if_due = self.window_if_due if self.interpreter.watching else None
            quiet_s = self.options.window_s if self.options.sampling is not None else None
            if window_if_due is None and quiet_s is not None and self.window_if_due is not None:
                # always on: a service gone quiet after a burst would keep its last requests'
                # spans, with no step end to take them, until its next request (for hours); one
                # wake a window interval closes them into a window, as a capture's looking does
                try:
                    window = self.queue.get(timeout=quiet_s)
                except queue.Empty:
                    if now_ns() - self.closed_ns >= quiet_s * 1e9:
                        self.recording.decide_quiet_steps(int(PAUSE_S * 1e9))
                        self.window_if_due()
                    continue
            elif window_if_due is None:
                window = self.queue.get()
            else:
                try:
                    window = self.queue.get(timeout=CAPTURE_WINDOW_S)
                except queue.Empty:
                    self.interpreter.forget_given_up()  # a capture whose caller gave up
                    if self.interpreter.watching:
                        # a quiet service's last captured step, which its next request would decide
                        self.recording.decide_quiet_steps(int(PAUSE_S * 1e9))
                        window_if_due()
                    continue
            if window is not Wake.WATCHER:
                break
        if window is None:
            return None
        waiting = [window]
        while len(waiting) < MAX_MERGED and not self.queue.empty():
            later = self.queue.get_nowait()
            if later is Wake.WATCHER:
                continue
            if later is None:
                self.stopping = True
                break
            waiting.append(later)
        self.merged_last = len(waiting) > 1
        return window if len(waiting) == 1 else Window.merged(waiting)

    def niceness_now(self) -> int:
        """How much the next helper lowers its priority: :attr:`helper_niceness` while the windows
        keep pace, none (the program's own) while they fall behind (windows were waiting for this
        one, or are waiting beside it). At niceness 19 on a machine whose cores other work keeps
        busy, a helper gets almost no CPU: the windows waiting for it held the program's memory
        (RSS 276 to 644 MB under two spinning processes, a million requests) and no part was sealed."""
        return 0 if self.merged_last or not self.queue.empty() else self.helper_niceness

    def _interpreted_in_helper(self, window: Window, resource: Resource | None) -> bool:
        """Interpret ``window`` in a forked helper process (and send the spans it made ready, where
        the session exports); False when it must be done here."""
        interpreter = self.interpreter
        if not self.forks or not interpreter.helpers_can_interpret or now_ns() < self.helpers_again_ns:
            return False
        deadline_s = HELPER_DEADLINE_S + HELPER_DEADLINE_PER_EVENT_S * window.records
        then = None  # set only where the session exports (its resource encoded once, in _run)
        if self.encoded_resource is not None:
            then = functools.partial(_ready_to_send, self.encoded_resource, self.session_ids, self.options.span_budget)
        niceness = self.niceness_now()
        if niceness != self.helper_niceness:
            self.helpers_behind += 1
        try:
            result = run_forked(functools.partial(_interpret_in_helper, interpreter, window, niceness,
                                                  then), deadline_s, self.ending)
        except Exception as exc:  # nothing of it taken over: here, its segment is written in place of a helper's
            self._helper_failed(str(exc) if isinstance(exc, ForkFailed) else f"{type(exc).__name__}: {exc}")
            return False
        self.failures_in_a_row = 0
        interpreter.adopt(result)
        from xsp.export.otlp import PreparedExport, send_prepared  # imported by _run already

        if then is not None and isinstance(result.prepared, PreparedExport):
            assert self.exporter is not None and resource is not None
            self._resume_if_answering()
            send_prepared(result.prepared, resource, self.exporter, self.report, self.session_ids)
        return True

    def _helper_failed(self, why: str) -> None:
        """Interpret the windows in this process for a while (for good once the session ends); the
        first failure is said, the others counted in the file."""
        self.helper_failures += 1
        self.failures_in_a_row += 1
        if self.ending.is_set():
            self.forks = False
        wait_s = min(HELPER_RETRY_FIRST_S * 2 ** (self.failures_in_a_row - 1), HELPER_RETRY_MAX_S)
        self.helpers_again_ns = now_ns() + int(wait_s * 1e9)
        if self.helper_failures == 1:
            self.warn(f"a helper process could not interpret a window ({why}); windows are interpreted in this "
                      f"process{'' if not self.forks else f', and a helper is tried again in {wait_s:g} s'}")

    def _say_if_failing(self) -> None:
        """The first time spans went unsent while the session runs, say so (once; its end's line
        says how the whole export went)."""
        report = self.report
        if self.said_failing or self.ending.is_set() or not report.failed:
            return
        self.said_failing = True
        why = report.error or "the collector did not take a batch"
        self.warn(f"OTLP export to {report.target} is failing ({why}): {report.failed:,} spans not sent so far; the "
                  "trace file keeps every span, each later window is sent again, and the session's end says how the "
                  "export went")

    def _resume_if_answering(self) -> None:
        """Before a window's export: where an earlier batch failed for good (or the collector
        did not answer at the start), send again if the collector answers now (a collector that
        restarted gets the windows after it came back); else this window's spans count as
        failed unsent, at the cost of a connection attempt."""
        if (self.report.stopped and self.target is not None and not self.report.out_of_time()
                and probe(self.target) is None):
            self.report.try_again()

    def finish_windows(self) -> None:
        """Wait until every window handed over so far is interpreted, written and exported (their
        exports, and the last one, retry what the collector refuses for :data:`EXIT_WAIT_S` in all)."""
        self.ending.set()
        if self.exporter is not None:
            self.report.hurry(EXIT_WAIT_S)
            hurry_posts(self.exporter, EXIT_WAIT_S)
        if self.pause_wait is not None:
            self.pause_wait.hurry.set()
        with self.closing:
            self.finished = True
            held, self.held = self.held, []
            for window in held:
                self.queue.put(window)
            self.queue.put(None)
        self.thread.join()

    def export_last(self, spans: pd.DataFrame, metadata: dict[str, Any],
                    on_done: Callable[[ExportReport], None]) -> OtlpExport:
        from xsp.export.otlp import start_export

        assert self.target is not None and self.exporter is not None
        self._resume_if_answering()
        return start_export(spans, metadata, self.target, self.options.service_name,
                            exporter=self.exporter, report=self.report, session=self.session_ids, on_done=on_done,
                            span_budget=self.options.span_budget, deadline_s=EXIT_WAIT_S)


_pending_exports: list[OtlpExport] = []
_exit_wait_registered = False


def _ready_to_send(encoded_resource: tuple[bytes, bytes], session: tuple[str, int], span_budget: int,
                   spans: pd.DataFrame) -> PreparedExport:
    """In a helper: the window's spans made ready to send (the parent only posts the batches)."""
    from xsp.export.otlp import PreparedExport, prepare_export  # imported by the parent's window thread

    try:
        return prepare_export(spans, encoded_resource, session, span_budget)
    except Exception as exc:  # the parent counts them all as failed, and says why
        return PreparedExport(to_send=len(spans), not_sampled_by_request=0, rows=len(spans),
                              error=f"{type(exc).__name__}: {exc}")


def _interpret_in_helper(interpreter: WindowInterpreter, window: Window, niceness: int = 0,
                         then: Callable[[pd.DataFrame], PreparedExport] | None = None) -> WindowResult:
    """In a forked helper process, its priority lowered by ``niceness``: ``window`` interpreted, with
    Arrow's default memory pool made the system allocator's (the user's process keeps its own).
    Arrow's default, mimalloc, maps fresh pages and hands them back with system calls: in a
    helper, which lives for one window, that was most of its kernel time (a window of 50,000
    requests: 235-300 ms of the helper's CPU with the system allocator, 370-410 ms with mimalloc,
    200-250 ms of it in the kernel)."""
    if niceness:
        with contextlib.suppress(OSError):  # a system that refuses it: the helper runs as the program does
            os.nice(niceness)
    pa.set_memory_pool(pa.system_memory_pool())
    return interpreter.interpret_in_helper(window, then)


def wait_at_exit(export: OtlpExport) -> None:
    """Have interpreter exit give ``export``, and every other export still running, one bounded
    wait (``EXIT_WAIT_S`` in all)."""
    _pending_exports[:] = [pending for pending in _pending_exports if not pending.report.done] + [export]
    _register_exit_wait()


def _wait_for_exports() -> None:
    deadline = now_ns() + int(EXIT_WAIT_S * 1e9)
    for export in list(_pending_exports):
        if not export.abandoned:
            export.wait(max(deadline - now_ns(), 0) / 1e9)
    for export in list(_pending_exports):  # what the wait did not see end is recorded as cut off
        export.cut_off()


def _register_exit_wait() -> None:
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
