"""The end of a session: its last window interpreted, what was dropped said, the final metadata,
the trace file written from the streamed segments (or everything left for xsp recover) by a
:class:`TraceWriter`, which records the export's outcome too."""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from xsp.core import machine_speed
from xsp.core import schema as col
from xsp.core.clock import ClockSync
from xsp.core.figures import counted
from xsp.core.lazy import pandas as pd
from xsp.core.lazy import pyarrow as pa
from xsp.core.metadata import memory_peaks
from xsp.core.rank import PART_FILE, RankInfo
from xsp.core.schema import Level, SpanKind, Status
from xsp.core.threads import start_thread
from xsp.io.parquet import arrow_table, spans_from_arrow, write_trace_tables
from xsp.io.segments import SegmentWriter
from xsp.io.trace import Trace
from xsp.record.columns import NEVER
from xsp.record.recording import ThreadCopy
from xsp.record.window import Window
from xsp.session import starting
from xsp.session.children import ChildSpans, Following, unsent_ids_path
from xsp.session.interpreting import WindowInterpreter
from xsp.session.options import TraceOptions
from xsp.session.output_name import OutputName
from xsp.session.running import RunningSession
from xsp.session.windows import DROPPED_WINDOWS, wait_at_exit
from xsp.table.build import conform, new_step_state
from xsp.table.steps import SESSION_NAME
from xsp.tracers.registry import tracers_for

if TYPE_CHECKING:
    from xsp.export.delivery import ExportReport
    from xsp.export.otlp import OtlpExport

OWN_LEVELS: Final = (Level.MODEL, Level.LAYER)
"""The levels made from the threads' own records alone: a joined block's own trace has these."""
NOT_OWN: Final = ("recorded only in the trace of the session this block joined (a block that joins another "
                  "session has its model and layer calls in a trace of its own)")
CUT_BY_INTERRUPTION: Final = ("open_at_stop", "unpaired_backward_events")
"""What a program stopped by a signal leaves unfinished (a module call, a backward pass): counted
in the metadata's ``dropped`` as ever, and said in the one line that says it was interrupted."""

SessionMetadata = Callable[[], dict[str, Any]]
"""What the session itself, not its run, puts in the trace's metadata (its calibration, the
signals it heard, how it ended, its warnings), read as the metadata is made."""


@dataclass(frozen=True)
class Finished:
    """What the end of a run hands back to its session."""

    trace: Trace
    writer: TraceWriter
    """The trace file's writer (its ``error`` says why the file could not be written)."""
    export: OtlpExport | None
    """The OTLP export of the last window, running in the background (None: none asked for)."""


@dataclass(frozen=True)
class JoinedStart:
    """What a block that joined another session measured as it joined: its own trace's clock,
    threads' times and rank (it starts no run of its own unless it takes the recording over)."""

    clock: ClockSync
    threads_at_start: tuple[int, int] | None
    rank: RankInfo | None


def finish(run: RunningSession, end_ns: int, error: str | None, session_metadata: SessionMetadata,
           following: Following | None, handing_over: bool = False, interrupted: str | None = None) -> Finished:
    """The run's last window interpreted and its file written. ``handing_over``: the recording
    goes on for a block that joined this session (``Session._continue``): the threads still inside a
    module call or a step keep their records for it, and its tracers keep running. ``interrupted``:
    the signal that stopped the program, said once the file is written, with what it cut short.
    ``following``: the child processes whose spans are added (None: none)."""
    run.close_control()
    if handing_over:
        starting.stop_watching(run)
    elif run.sampler is not None:  # every thread's last step is decided at the model level's depth
        run.recording.sample_steps(None)
    run.recording.on_long_step = None
    run.settle_rank()
    writer = TraceWriter(run.output, run.warn)
    if not handing_over:
        writer.follow(run.interpreter)
    try:
        return _finish(run, writer, end_ns, error, session_metadata, following, handing_over, interrupted)
    except BaseException:
        writer.cancel()
        raise


def _finish(run: RunningSession, writer: TraceWriter, end_ns: int, error: str | None,
            session_metadata: SessionMetadata, following: Following | None, handing_over: bool,
            interrupted: str | None) -> Finished:
    recording = run.recording
    if run.windows is not None:
        run.windows.finish_windows()
    if handing_over:
        decide_own_step(run)
        window = recording.take_window(handing_over=True)  # no step or module call is cut in two
        recorded_dropped = recording.take_dropped()
    else:
        open_calls = recording.open_module_calls()
        if open_calls:
            recording.dropped["open_at_stop"] += open_calls
        if run.steps is not None:  # each thread's last step too is kept or forgotten as scheduled
            recording.long_step_ns = 0
            for buffer in list(recording.buffers):
                recording.on_long_step = functools.partial(run.steps.step_ended, buffer=buffer)
                buffer.steps.finish()
            recording.on_long_step = None
        else:
            recording.finish_steps()
        window = recording.take_window(final=True)
        recorded_dropped = recording.dropped
    last = run.interpreter.interpret(window, session_row(run, end_ns, error))
    run.end_captures("the session ended")
    metrics_problem = beside_spans = None
    if run.metrics is not None:
        run.metrics.close()
        metrics_problem, beside_spans = run.metrics.problem(), run.metrics.problem_beside_spans()
    children = None if handing_over else collect_children(run, following)
    for note in dict.fromkeys(recording.notes):
        run.warn(note)
    dropped = recorded_dropped + run.interpreter.dropped
    if children is not None:
        dropped.update(children.dropped)
    if run.interpreter.segments is not None and run.interpreter.segments.dropped_spans:
        dropped[DROPPED_WINDOWS] += run.interpreter.segments.dropped_spans
    cut = {what: count for what, count in dropped.items() if interrupted is not None and what in CUT_BY_INTERRUPTION}
    unexpected = {what: count for what, count in dropped.items() if what not in cut}
    if unexpected:
        run.warn("some records were dropped: " + ", ".join(
            f"{count} {what}" for what, count in sorted(unexpected.items())))
    exports = run.windows is not None and run.windows.exporter is not None
    if exports and children is not None:
        assert run.windows is not None
        count_children_exports(run.windows.report, children)
        if children.to_send:
            last = pd.concat([last, *children.to_send], ignore_index=True)
    leaves_last = exports and run.interpreter.state.session_parent_id is not None  # a followed child's
    if leaves_last:
        assert run.windows is not None
        run.windows.report.leave_to_another(len(last))  # (in its file's metadata, which its parent reads)
    metadata = final_metadata(run, dropped, session_metadata, children)
    trace = writer.write(run.interpreter, metadata)
    if interrupted is not None:
        written = run.output is not None and writer.error is None
        run.warn(f"interrupted by {interrupted}: the trace{f' ({run.output})' if written else ''} holds what "
                 "was recorded until then" + ("; cut short there, and counted in its dropped records: "
                                              + ", ".join(f"{count} {what}" for what, count in sorted(cut.items()))
                                              if cut else ""))
    export = None
    if metrics_problem is not None and (leaves_last or not exports):  # no export of this process's to say it
        run.warn(metrics_problem)
    if leaves_last:
        leave_last_window(run, last)
    elif exports:
        assert run.windows is not None
        # one warning for one collector: where the spans' export fails too, it says both
        writer.metrics_problems = (metrics_problem, beside_spans) if metrics_problem is not None else None
        export = run.windows.export_last(last, metadata, writer.record_export)
        wait_at_exit(export)
    return Finished(trace, writer, export)


def leave_last_window(run: RunningSession, last: pd.DataFrame) -> None:
    """In a followed child that exports its windows: its last window is left to the session, which
    sends it with its own last export (the child's parent may end it as it sends: uvicorn's master
    terminates its workers on Ctrl-C, and their last windows were lost). Its span ids go beside
    the child's trace (:func:`xsp.session.children.unsent_ids_path`)."""
    if run.output is None:
        return
    try:
        last[col.SPAN_ID].to_numpy(dtype=np.int64).tofile(unsent_ids_path(run.output))
    except OSError as exc:
        run.warn(f"the last window's {len(last):,} spans could not be left to the session to send: {exc}")


def finish_joined(options: TraceOptions, thread_id: int, joined: JoinedStart, copy: ThreadCopy, end_ns: int,
                  error: str | None, warn: Callable[[str], None], session_metadata: SessionMetadata) -> Finished:
    """On the thread of a block that joined another session (``xsp.trace()`` entered while one
    was active), as it ends: its own trace, made from the copy of what its thread recorded while
    it ran, and written to its output. The session it joined keeps these calls too, and records
    on. The copy has the threads' own records: the block's model and layer calls, steps and
    spans; operator and GPU spans are not recorded per thread, and stay in that session's trace."""
    recording = copy.recording
    buffer = getattr(recording.local, "b", None)
    if buffer is not None and buffer.thread_id == copy.thread_id:
        buffer.steps.finish()  # the block's open step ends with it, as at a step boundary
    own = recording.end_copy(copy)
    recorded = set(recording.levels)
    levels = tuple(level for level in options.levels if level in OWN_LEVELS and level in recorded)
    tracers, _ = tracers_for(levels)
    unavailable = {level: NOT_OWN if level in recorded else "not recorded by the session this block joined"
                   for level in options.levels if level not in levels}
    window = Window(own, final=True, external_ids=recording.external_ids,
                    model_names=recording.models.names_for(thread_id), sites=recording.sites)
    interpreter = WindowInterpreter(tracers, new_step_state(), warn, joined.clock.host_to_epoch_ns, joined.rank)
    output_name = OutputName()
    output = None if options.output is None else output_name.take(options.output, warn)
    run = RunningSession(
        options=options, thread_id=thread_id, warn=warn, recording=recording, clock=joined.clock,
        threads_at_start=joined.threads_at_start, rank=joined.rank, run_id=None, output_name=output_name,
        output=output, target=None, collector_down=None, interpreter=interpreter, tracers=tracers,
        unavailable=unavailable, windows=None, steps=None, start_ns=copy.start_ns)
    try:
        interpreter.prepare(window)
        interpreter.interpret(window, session_row(run, end_ns, error))
        run.settle_rank()
        metadata = final_metadata(run, copy.dropped(), session_metadata)
        metadata["threads"] = {str(copy.thread_id): threading.current_thread().name}
        writer = TraceWriter(run.output, warn)
        return Finished(writer.write(interpreter, metadata), writer, None)
    finally:
        run.release_output()


def session_row(run: RunningSession, end_ns: int, error: str | None) -> dict[str, Any]:
    """The session's own span, from its start to ``end_ns`` (``error``: why its block failed)."""
    return {
        col.LEVEL: Level.MODEL.value, col.KIND: SpanKind.SESSION.value, col.NAME: SESSION_NAME,
        col.START_NS: run.start_ns, col.END_NS: end_ns, col.THREAD_ID: run.thread_id,
        col.STATUS: Status.OK.value if error is None else Status.ERROR.value,
        col.STATUS_MESSAGE: error,
    }


def decide_own_step(run: RunningSession) -> None:
    """The open step of the thread that ends ``run`` (this one) is decided, kept or forgotten
    as its schedule says, so that its trace has it; other threads' open steps go on."""
    recording = run.recording
    buffer = getattr(recording.local, "b", None)
    if buffer is None:
        return
    if run.steps is not None:
        recording.long_step_ns = 0
        recording.on_long_step = functools.partial(run.steps.step_ended, buffer=buffer)
    try:
        buffer.steps.finish()
    finally:
        recording.on_long_step = None
        recording.long_step_ns = NEVER


def collect_children(run: RunningSession, following: Following | None) -> ChildSpans | None:
    """The spans of the child processes ``following`` followed, added to the run's own, with
    what they said; those that handed nothing over are said, with why (:mod:`xsp.session.children`)."""
    if following is None or following.collected:
        return None
    state = run.interpreter.state
    try:
        found = following.collect(run.interpreter.host_to_epoch_ns, state.session_trace_id,
                                  state.session_span_id, state.steps, run.recording.input_worker_pids)
    except Exception as exc:  # the session's own spans are still written
        following.discard()
        run.warn(f"the spans of the child processes could not be added: {type(exc).__name__}: {exc}")
        return None
    for table in found.tables:
        run.interpreter.add_spans(table)
    said: dict[str, list[str]] = {}
    for pid, facts in found.processes.items():
        if "parent" in facts:  # a child's own child: the child said its warnings, naming it
            continue
        for message in facts.get("warnings", ()):
            said.setdefault(message, []).append(pid)
    for message, pids in said.items():
        run.warn(f"child process{'es' if len(pids) > 1 else ''} {', '.join(pids[:5])}"
                 f"{' ...' if len(pids) > 5 else ''}: {message}")
    if found.workers_before:
        run.warn(f"the loop waited for {counted(len(found.workers_before), 'DataLoader worker')} started before "
                 "the session (persistent_workers=True keeps an epoch's workers for the next): their fetches are "
                 "not in the trace; start the session before the loader's first epoch to record them")
    if found.untraced:  # of the session's own children (a child's own are said by that child)
        total = len(found.untraced) + sum("parent" not in facts for facts in found.processes.values())
        reasons = [f"process {pid} ({why})" for pid, why in list(found.untraced.items())[:3]]
        more = f"; and {len(found.untraced) - 3} more" if len(found.untraced) > 3 else ""
        run.warn(f"{len(found.untraced)} of {total} child processes started in the session handed no spans "
                 f"over: what they did is not in the trace: {'; '.join(reasons)}{more}")
    return found


def count_children_exports(report: ExportReport, children: ChildSpans) -> None:
    """The session's export counts in what its followed children exported themselves (an always-on
    session's workers send their own windows)."""
    from xsp.export.delivery import ExportReport  # (imported where a collector was asked for)

    for pid, facts in children.processes.items():
        if facts.get("export") and "parent" not in facts:  # a child's own children are in its counts
            report.add_process(ExportReport.from_metadata(facts["export"]), pid)


def final_metadata(run: RunningSession, dropped: Counter[str], session_metadata: SessionMetadata,
                   children: ChildSpans | None = None) -> dict[str, Any]:
    recording = run.recording
    asked = run.options.target  # (run.target is None where the collector did not answer at the start)
    not_used = None
    if asked is not None and run.target is None and run.collector_down is not None:
        from xsp.export.delivery import ExportReport  # (imported where a collector was asked for)

        not_used = ExportReport(target=asked.endpoint, error=f"not used: {run.collector_down}", done=True).as_metadata()
    described = run.described(run.clock.remeasured(), machine_speed.confirmed())
    if described.get("sampling") and children is not None and children.samplings:
        described["sampling"] = with_children_sampling(described["sampling"], children.samplings)
    return {
        **described,
        "tracer_details": tracer_details(run),
        "threads": {
            str(thread_id): name for thread_id, name in itertools.chain(
                recording.ended_threads.items(),
                ((buffer.thread_id, buffer.thread_name) for buffer in list(recording.buffers)))},
        "memory": memory_peaks(),
        "imports_wait_ms": round(recording.imports_wait_ns / 1e6, 3),
        "dropped": dict(dropped),
        "hierarchy": run.interpreter.hierarchy(),
        "latency": None if run.interpreter.latency is None else {
            **run.interpreter.latency.as_metadata(),
            "metrics_export": None if run.metrics is None else run.metrics.as_metadata()},
        "windows": run.interpreter.window_count,
        "part": ({"index": run.part, "last": True} if run.options.rotates else None),
        "schedule": None if run.steps is None else run.steps.as_metadata(),
        "streamed_windows": 0 if run.interpreter.segments is None else run.interpreter.segments.count,
        "closed_windows": 0 if run.windows is None else run.windows.closed_windows,
        "helper_windows": run.interpreter.helper_windows,
        "helper_failures": 0 if run.windows is None else run.windows.helper_failures,
        "helpers_behind": 0 if run.windows is None else run.windows.helpers_behind,
        "window_waits": None if run.windows is None else run.windows.wait_counts(),
        "process_id": os.getpid(),
        "child_processes": None if children is None else {
            "followed": children.processes, "untraced": children.untraced, "steps": children.steps,
            "ranks_not_followed": children.ranks, "dataloader_workers_started_before": children.workers_before,
            "forked_not_followed": children.forked_alone},
        "otlp": None if asked is None else {"endpoint": asked.endpoint, "protocol": asked.protocol.value},
        "export": (run.windows.report.as_metadata() if run.windows is not None and run.windows.exporter is not None
                   else not_used),
        **session_metadata(),
    }


def with_children_sampling(own: dict[str, Any], children: list[dict[str, Any]]) -> dict[str, Any]:
    """An always-on session's ``sampling`` metadata with its followed children's (a server's
    workers'): their steps and slow steps count as its own; its running median, where it took no
    step, is that of the child that took the most."""
    steps = Counter(own.get("steps") or {})
    slow_steps_found = int(own.get("slow_steps_found") or 0)
    for child in children:
        steps.update(child.get("steps") or {})
        slow_steps_found += int(child.get("slow_steps_found") or 0)
    busiest = max(children, key=lambda child: sum((child.get("steps") or {}).values()))
    return {**own, "steps": dict(steps), "slow_steps_found": slow_steps_found,
            "median_step_ns": int(own.get("median_step_ns") or 0) or int(busiest.get("median_step_ns") or 0)}


class TraceWriter:
    """The end-of-run write: the trace file made from a session's streamed segments or the
    windows it kept in memory, and, later, the outcome of its export added to the file.

    Where the session streams, the file can be started (:meth:`follow`) before the windows still
    queued are interpreted: it is written from each window as it lands, beside the helper
    process interpreting the next, and gets its metadata at :meth:`write`.

    Args:
        output: the file to write (None: the trace stays in memory).
        warn: how a problem is said (the session's warning).
    """

    def __init__(self, output: Path | None, warn: Callable[[str], None]) -> None:
        self.output = output
        self.warn = warn
        self.trace: Trace | None = None
        self.error: str | None = None
        """Why the trace file could not be written (None when it was, or none was asked for)."""
        self._following: threading.Thread | None = None
        self._windows_done = threading.Event()
        self._cancelled = threading.Event()
        self._late: tuple[dict[str, Any], list[pa.Table]] | None = None
        """The metadata and the windows kept in memory, for the file being written as windows land."""
        self._followed: Path | BaseException | None = None
        """What writing as windows land gave: the file, or why it did not."""
        self.metrics_problems: tuple[str, str | None] | None = None
        """The latency metrics' failed sends to the collector the spans go to, said with the
        export's outcome (alone, and beside the spans' failure): one warning for one collector."""

    def follow(self, interpreter: WindowInterpreter) -> None:
        """Start writing the file from the session's windows as they land (on a thread of its
        own), where the session streams to a folder that takes its windows."""
        segments = interpreter.segments
        if self.output is None or segments is None or not segments.started or segments.degraded:
            return
        self._following = start_thread(self._write_as_windows_land, "xsp-trace-file", (segments,))

    def cancel(self) -> None:
        """The session's end failed before :meth:`write`: the file started by :meth:`follow` is
        given up (its temporary removed), the windows left where they are."""
        if self._following is not None:
            self._cancelled.set()
            self._windows_done.set()  # wakes the thread at once, which then sees it cancelled
            self._following.join()
            self._following = None

    def _write_as_windows_land(self, segments: SegmentWriter) -> None:
        assert self.output is not None
        def kept_in_memory() -> Iterator[pa.Table]:
            assert self._late is not None  # set before the windows are done
            yield from self._late[1]

        def metadata() -> dict[str, Any]:
            assert self._late is not None
            return self._late[0]

        try:
            self._followed = write_trace_tables(
                self.output, itertools.chain(segments.follow(self._windows_done, self._cancelled), kept_in_memory()),
                metadata)
        except BaseException as exc:  # said (or written the usual way) by write(), on the session's thread
            self._followed = exc

    def write(self, interpreter: WindowInterpreter, metadata: dict[str, Any]) -> Trace:
        """The session's trace, written to :attr:`output` where there is one."""
        segments = interpreter.segments
        if segments is not None and segments.count:
            kept = [arrow_table(table, in_order=True) for table in interpreter.take_tables()]
            written = self._followed_file(metadata, kept)
            if written is not None:
                segments.discard()
                self.trace = Trace(source=written, metadata=metadata)
            else:
                self.trace = self._from_segments(segments, kept, metadata)
            return self.trace
        self.cancel()
        spans = conform(pd.concat(interpreter.take_tables(), ignore_index=True).sort_values(
            [col.START_NS, col.CALL_DEPTH], kind="stable", na_position="first"))
        self.trace = Trace(spans=spans, metadata=metadata)
        if self.output is not None:
            try:
                self.trace.save(self.output)
            except OSError as exc:  # OutputError names the path and the cause
                self.error = str(exc)
                self.warn(f"the trace file was not written: {exc}")
        if segments is not None:
            segments.discard()
        return self.trace

    def _followed_file(self, metadata: dict[str, Any], kept: list[pa.Table]) -> Path | None:
        """The file written as the windows landed, now that they are all in (None: there is none,
        because none was started or the windows left the folder; the file is written the usual way)."""
        if self._following is None:
            return None
        self._late = (metadata, kept)
        self._windows_done.set()
        self._following.join()
        self._following = None
        return self._followed if isinstance(self._followed, Path) else None

    def _from_segments(self, segments: SegmentWriter, kept: list[pa.Table], metadata: dict[str, Any]) -> Trace:
        """The trace file from the segments (and any window kept in memory), a window at a time;
        the spans are read back from it only when asked for. Where it cannot be written, every
        window and the final metadata are left for ``xsp recover``."""
        assert self.output is not None
        try:
            written = write_trace_tables(self.output, itertools.chain(segments.tables(), kept), metadata)
        except OSError as exc:
            self.error = str(exc)
            segments.keep([(segments.count + 1 + i, table) for i, table in enumerate(kept)])
            lost_before = segments.dropped_spans
            folders = segments.keep_finished(metadata)
            lost = segments.dropped_spans - lost_before
            where = " and ".join(str(folder) for folder in folders) or "no folder (none could be written)"
            kept_where = (f"its windows and metadata are kept in {where}" if not lost else
                          f"{lost:,} spans of its windows could be written nowhere and are lost (counted in its "
                          f"dropped records); what was kept, and its metadata, are in {where}")
            # a run in parts keeps every part's windows beside its first: recover finds them from the folder
            recover = self.output.parent if PART_FILE.match(self.output.name) else self.output
            self.warn(f"the trace file was not written: {exc}; {kept_where} "
                      f"(`xsp recover {recover}` writes it once the cause is fixed)")
            for note in segments.take_notes():
                self.warn(note)
            left = list(segments.tables())
            return Trace(spans=spans_from_arrow(self.output, pa.concat_tables(left)) if left
                         else conform(pd.DataFrame()), metadata=metadata)
        segments.discard()
        return Trace(source=written, metadata=metadata)

    def record_export(self, report: ExportReport) -> None:
        """On the export's thread: its outcome into the trace, and into its file."""
        if self.trace is None:
            return
        self.trace.metadata["export"] = report.as_metadata()
        if self.output is not None and self.error is None:
            try:
                self.trace.save(self.output)
            except OSError as exc:
                self.error = str(exc)
        alone, beside_spans = self.metrics_problems or (None, None)
        if report.error is not None:
            self.warn(report.summary() + (f"; {beside_spans}" if beside_spans else ""))
        elif alone is not None:
            self.warn(alone)


def tracer_details(run: RunningSession) -> dict[str, Any]:
    """What tracers report about themselves (a CUPTI clock offset, say), by tracer name."""
    details = {}
    for tracer in run.tracers:
        try:
            report = tracer.metadata()
        except Exception as exc:
            run.warn(f"tracer {tracer.name} could not describe itself: {exc}")
            continue
        if report is not None:
            details[tracer.name] = report
    return details
