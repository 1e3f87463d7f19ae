"""A session while it runs: one :class:`RunningSession` owns what a session records with, from
its start (:func:`xsp.session.starting.start` makes it) to its end (:mod:`xsp.session.ending`
turns it into a :class:`xsp.Trace`): the clock, the rank, the recording, the tracers, the
windows interpreted and exported while the program runs, and the output file.

Where the trace file goes is decided here, once, at the start (:func:`output_for`: the name
asked for, this rank's own, or the dataset's); only a process group set up inside the block,
which makes the process one rank of a job, renames it at the end (:meth:`RunningSession.settle_rank`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from xsp.core import contention, machine_speed
from xsp.core.clock import ClockSync, now_ns
from xsp.core.metadata import environment
from xsp.core.rank import (
    RankInfo,
    current_backend,
    dataset_path,
    numbered_run,
    part_path,
    rank_info,
    rank_path,
)
from xsp.core.schema import FILE_SUFFIX, Level
from xsp.export.target import OtlpTarget
from xsp.record.recording import Recording
from xsp.record.sampling import SamplingPolicy, StepSampler
from xsp.session.capture import CaptureDesk
from xsp.session.control import ControlChannel
from xsp.session.interpreting import WindowInterpreter
from xsp.session.options import TraceOptions
from xsp.session.output_name import OutputName
from xsp.session.scheduled import ScheduledSteps
from xsp.session.windows import WindowWorker
from xsp.tracers.base import Tracer

if TYPE_CHECKING:
    from xsp.export.metrics import LatencyMetrics


def stop_quietly(tracer: Tracer, warn: Callable[[str], None]) -> None:
    """Stop ``tracer``; a failure is said with ``warn``, never raised."""
    try:
        tracer.stop()
    except Exception as exc:
        warn(f"tracer {tracer.name} failed to stop: {exc}")


def output_for(options: TraceOptions, rank: RankInfo | None, run_id: str | None,
               warn: Callable[[str], None]) -> Path | None:
    """The file a session starting now writes (before its name is claimed): the one asked for,
    or with ``dataset`` the dataset's place for this run and rank (its folder made; None, said,
    where it cannot be); one rank of a distributed job writes its own beside the name asked for."""
    if options.dataset is not None:
        assert run_id is not None
        path = dataset_path(options.dataset, run_id, 0 if rank is None else rank.rank, options.service_name)
        if options.rotates:
            path = part_path(path.parent, 0)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # the program runs on; the trace stays in memory (session.trace)
            warn(f"cannot write into the dataset {options.dataset} ({exc.strerror or exc}): the trace is not "
                 "written to a file")
            return None
        return path
    if options.output is not None and rank is not None:
        return rank_path(options.output, rank.rank)
    return options.output


MOST_RUN_NUMBERS: Final = 1000
"""The run ids tried (``<run>``, ``<run>-2``...) before the last is taken whatever its folder holds."""


def claim_dataset_place(options: TraceOptions, rank: RankInfo | None, run: str, output_name: OutputName,
                        warn: Callable[[str], None]) -> tuple[Path | None, str]:
    """``(file, run id)`` of a session writing into a dataset, its name claimed in ``output_name``.

    A run's rank folder holds one session's trace: its parts (``rotate``) are numbered from 0,
    and a second session writing them would replace some and leave the others, two runs mixed
    into one. So where this run's folder holds an earlier run's traces (a rerun with the same
    ``XSP_RUN_ID``, a container restarted), a killed run's windows waiting for ``xsp recover``, or
    a live session's claim, this run takes the next free id, ``<run>-2``, and says so."""
    for number in range(1, MOST_RUN_NUMBERS):
        numbered = numbered_run(run, number)
        path = output_for(options, rank, numbered, warn)
        if path is None:
            return None, numbered
        if number < MOST_RUN_NUMBERS - 1 and any(path.parent.glob(f"*{FILE_SUFFIX}")):
            continue
        claimed = output_name.claim_exactly(path)
        if claimed is None and number < MOST_RUN_NUMBERS - 1:
            continue
        if number > 1:
            assert options.dataset is not None
            earlier = dataset_path(options.dataset, run, 0 if rank is None else rank.rank, options.service_name).parent
            warn(f"{earlier} already holds a run's trace (or a live session, or a killed run's windows waiting for "
                 f"`xsp recover`); this run is {numbered} and writes {path} instead, leaving it as it was")
        return claimed or path, numbered
    raise AssertionError("unreachable: the last number is taken whatever holds it")


@dataclass(eq=False)
class RunningSession:
    """What one session records with, from its start to its end (see the module docs). Made by
    :func:`xsp.session.starting.start`, with every part in place; its own methods change it."""

    options: TraceOptions
    """What the session was asked to do."""
    thread_id: int
    """The native id of the thread that opened the session."""
    warn: Callable[[str], None]
    """How a problem is said (the session's warning, kept for the trace's metadata)."""
    recording: Recording
    """The per-thread buffers the tracers record into (:mod:`xsp.record.recording`)."""
    clock: ClockSync
    """How host-clock readings map to epoch nanoseconds (measured at the start)."""
    threads_at_start: tuple[int, int] | None
    """The threads' time on a CPU and waiting for one at the start (:mod:`xsp.core.contention`)."""
    rank: RankInfo | None
    """This process's rank when it is one of a distributed job (see :mod:`xsp.core.rank`)."""
    run_id: str | None
    """With ``dataset``: this run's id, its ``run=`` partition."""
    output_name: OutputName
    """The claim on the output's name (held until the session ends)."""
    output: Path | None
    """The trace file (None when none is written): see :func:`output_for`."""
    target: OtlpTarget | None
    """The collector spans are exported to (None: none asked for, or found unreachable at the start)."""
    collector_down: str | None
    """Why the collector asked for did not answer at the start (None: it did, or none was asked
    for); where :attr:`target` is None then, nothing was sent to it."""
    interpreter: WindowInterpreter
    """Turns closed windows into span tables and keeps what they leave (segments, counts)."""
    tracers: list[Tracer]
    """The tracers started, in the order they started (and stop)."""
    unavailable: dict[Level, str]
    """Why each level asked for has no tracer here."""
    windows: WindowWorker | None
    """The thread that interprets (and exports) windows while the program runs, if any."""
    steps: ScheduledSteps | None
    """With a schedule: the steps it kept, warmed up and skipped."""
    start_ns: int
    """When it began recording (host clock)."""
    watching: list[Callable[[], None]] = field(default_factory=list)
    """What it added to its recording's ``on_new_thread`` (taken out when it hands over)."""
    sampler: StepSampler | None = None
    """An always-on session's (``sample=``): decides how deep each step is recorded."""
    metrics: LatencyMetrics | None = None
    """An always-on session's step and layer latency, sent as OTLP metrics (with a collector)."""
    control: ControlChannel | None = None
    """The socket ``xsp capture`` reaches it at (None: none could be made, or none was asked for)."""
    desk: CaptureDesk | None = None
    """What answers the control channel's requests."""
    part: int = 0
    """With ``rotate``: the part being written (its file is :attr:`output`)."""
    part_started_ns: int = 0
    """When that part began (host clock)."""
    part_bytes_per_window_byte: float = 1.0
    """With a size to ``rotate`` at: what a sealed part takes on disk for each byte its windows took
    before (a part is compressed Parquet, a window's segment is not), learned at each seal. 1
    until the first seal: the first part is the smaller."""
    part_windows: int = 0
    """With a size to ``rotate`` at: the windows written into the part being written so far."""
    ending: bool = False
    """The session's end has begun: the part being written is the last (no more are sealed)."""
    sealing: threading.RLock = field(default_factory=threading.RLock, repr=False)
    """Held while a part is sealed, and while the end begins: the end never takes the path of a
    part being sealed (the window thread's rotation and the ending thread raced: the last file
    went to the sealed part's path, over it, with the next part's index)."""

    def rotate_if_due(self) -> None:
        """With ``rotate``, after a window is written: once the part is old or large enough, seal it
        (its windows become a trace file of their own, readable while the program runs) and
        begin the next; a part that cannot be written stays for the next try (said once)."""
        with self.sealing:
            self._rotate_if_due()

    def _rotate_if_due(self) -> None:
        options, segments = self.options, self.interpreter.segments
        if segments is None or self.output is None or self.ending or not options.rotates:
            return
        started = self.part_started_ns or self.start_ns
        # a part is sealed as a window closes, a little after the part's time: a part due within
        # half a window is sealed now, not a window later (with windows as long as the parts, each
        # part came out twice as long as asked)
        due_ns = (options.rotate_s - options.window_s / 2) * 1e9 if options.rotate_s is not None else None
        aged = due_ns is not None and now_ns() - started >= due_ns
        grown, written = False, 0
        if options.rotate_bytes is not None:
            # sealed before a next window of the part's mean size would take it past the size: a
            # part is about that large at most, unless a window is larger by itself
            written = segments.written_bytes()
            self.part_windows += 1
            next_window = written / self.part_windows
            grown = (written + next_window) * self.part_bytes_per_window_byte > options.rotate_bytes
        if not (aged or grown):
            return
        metadata = {**self.start_metadata(), "machine_speed": machine_speed.measure(),
                    "part": {"index": self.part, "sealed_at_ns": time.time_ns(), "last": False}}
        try:
            sealed = segments.seal(self.output, metadata)
            if written > 0:
                self.part_bytes_per_window_byte = sealed.stat().st_size / written
            self.part_windows = 0
        except OSError as exc:
            if self.part_started_ns >= 0:
                self.warn(f"part {self.part} of the trace could not be written ({exc}); its windows are kept for the "
                          "next part")
            self.part_started_ns = -1  # said once; tried again at the next window
            return
        self.part += 1
        self.part_started_ns = now_ns()
        self.output = part_path(self.output.parent, self.part)

    def step_sampler(self) -> StepSampler:
        """The session's step sampler; a session that samples no steps gets one that records
        every step at every level (a capture arms it)."""
        if self.sampler is None:
            self.sampler = StepSampler(SamplingPolicy(rate=1.0, slow_factor=0.0))
            self.recording.sample_steps(self.sampler)
        return self.sampler

    def open_control(self) -> None:
        """Listen for ``xsp capture`` (:mod:`xsp.session.capture`)."""
        self.desk = CaptureDesk(self.interpreter, self.options.levels, self.windows is not None, self.step_sampler,
                                self.start_metadata, None if self.rank is None else self.rank.rank)
        self.control = ControlChannel.open(self.desk.handle, self.warn)

    def close_control(self) -> None:
        """Take no more requests, and seal no more parts (the session is ending): a part being
        sealed is sealed first, so that :attr:`output` is the last part's path from here on."""
        with self.sealing:
            self.ending = True
        if self.control is not None:
            self.control.close()
        if self.desk is not None:
            self.desk.closing = True

    def end_captures(self, why: str) -> None:
        """A capture still under way is told why it ends incomplete."""
        if self.desk is not None:
            self.desk.close(why)

    def stop_quietly(self, tracer: Tracer) -> None:
        """Stop ``tracer``; a failure is said, never raised."""
        stop_quietly(tracer, self.warn)

    def settle_rank(self) -> None:
        """The rank as the end finds it (the backend the job ended with; a process group set up
        inside the block), and so the file's name: decided before the file is begun."""
        if self.rank is not None:
            self.rank = self.rank.with_backend(current_backend() or self.recording.backend)
            return
        if self.output is None or self.options.dataset is not None:
            return
        found = rank_info(seen=self.recording.process_group)
        if found is None:
            return
        # the process group was set up inside the block, without a launcher's variables: the file
        # is still this rank's own (its spans take their rank from the metadata when loaded)
        self.rank = found
        requested = self.output_name.requested or self.output
        self.output_name.release()  # the name asked for was taken as a whole: this rank's own is claimed now
        self.output = self.output_name.take(rank_path(requested, found.rank), self.warn)

    def release_output(self) -> None:
        """Give the output's name back (the file, if written, stays)."""
        self.output_name.release()

    def described(self, clock: ClockSync, machine_times: dict[str, Any] | None = None) -> dict[str, Any]:
        """The metadata known from the start: host, versions, levels, tracers, clock; and the
        machine's speed where it was timed (:mod:`xsp.core.machine_speed`, at the end)."""
        nvtx = self.recording.nvtx
        return {
            **environment(),
            "service_name": self.options.service_name,
            "levels": [level.value for level in self.options.levels],
            "layer_depth": self.options.layer_depth,
            "tracers": [tracer.name for tracer in self.tracers],
            "unavailable": {level.value: reason for level, reason in self.unavailable.items()},
            "clock": {"host_to_epoch_ns": clock.host_to_epoch_ns, "uncertainty_ns": clock.uncertainty_ns,
                      "drift_ns": clock.drift_ns},
            "distributed": None if self.rank is None else self.rank.as_metadata(),
            "run_id": self.run_id,
            "machine_speed": machine_times,
            "contention": contention.since(self.threads_at_start),
            "nvtx": None if nvtx is None else nvtx.facts(),
            "sampling": None if self.sampler is None else self.sampler.as_metadata(),
        }

    def start_metadata(self) -> dict[str, Any]:
        """What a recovery of this session needs to know, and what is known at its start."""
        state = self.interpreter.state
        return {
            **self.described(self.clock),
            "session_ids": {"trace_id": state.session_trace_id, "span_id": state.session_span_id},
            "session_start_ns": self.start_ns + self.clock.host_to_epoch_ns,
            "session_thread_id": self.thread_id,
            "window_s": self.options.window_s,
        }
