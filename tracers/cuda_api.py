"""The ``cuda_api`` level: every CUDA runtime and driver call, from CUPTI's activity records.

Each call becomes a span on the host thread that made it (its parent found by interval
inclusion, or by the external correlation id of the layer that made it), carrying the
correlation id that links it to the kernels, copies and sets it launched.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level
from xsp.record.recording import Recording
from xsp.record.window import Window
from xsp.tracers.base import Tracer
from xsp.tracers.cuda.records import ActivityColumns
from xsp.tracers.cuda.rows import api_rows
from xsp.tracers.cuda.source import API_KINDS, SOURCE, CuptiSource, pairing_note, record_path
from xsp.tracers.module_calls.interceptor import INTERCEPTOR


class CuptiTracer(Tracer):
    """A tracer reading some CUPTI activity kinds through the shared source."""

    name: ClassVar[str]
    level: ClassVar[Level]
    kinds: ClassVar[tuple[Any, ...]]
    starts_first: ClassVar[bool] = True
    """Started before the other tracers: CUPTI has one subscriber per process, and the operator
    level's profiler (Kineto's ``libkineto_init`` in some PyTorch versions, even CPU-only) would
    otherwise take it, losing the CUDA levels for the rest of the process. Started first, xsp holds
    it and Kineto, refused, records operators without CUPTI."""
    interprets_in_child = True
    """Its records are drained into the window before a helper process is forked
    (:meth:`prepare`): the helper only turns columns into rows."""

    def __init__(self, source: CuptiSource = SOURCE) -> None:
        self.source = source
        self._notes: list[str] = []
        """The session's notes (said once, when it ends)."""

    def available(self) -> str | None:
        return self.source.available()

    def start(self, recording: Recording) -> None:
        self.source.acquire(self.name, self.kinds)
        INTERCEPTOR.correlate(self.source.correlation_hooks())
        source = self.source
        self._notes = recording.notes
        # while another client holds CUPTI, layer calls push no id onto its stack
        self.source.listen(self.name, lambda: INTERCEPTOR.correlate(None),
                           lambda: INTERCEPTOR.correlate(source.correlation_hooks()))
        for note in (self.source.path_note, self.source.pairing):
            if note is not None:
                recording.notes.append(note)

    def stop(self) -> None:
        """Flush and release CUPTI; problems on the way are raised together, after cleaning up.
        Each time xsp let go of CUPTI for another client is said once (a note of the session)."""
        self.source.release(self.name)
        for down in self.source.stand_downs:
            self._notes.append(down.describe())
        if not self.source.running:
            INTERCEPTOR.correlate(None)
        if self.source.warnings:
            problems, self.source.warnings = self.source.warnings, []
            raise RuntimeError("; ".join(problems))

    def step_end_hook(self) -> Callable[[], None] | None:
        """Flush CUPTI's completed buffers (on a background thread)."""
        return self.source.step_ended

    def metadata(self) -> dict[str, Any]:
        """How CUPTI was used (record path, clock, what was left out), for the trace's metadata."""
        return self.source.metadata()

    @abstractmethod
    def rows(self, records: ActivityColumns) -> pd.DataFrame:
        """Span rows for this tracer's kinds among ``records``."""

    def prepare(self, window: Window) -> None:
        """In this process, before the window is interpreted (perhaps in a forked helper): take
        CUPTI's completed buffers into the window."""
        self.source.records_for(window, flush=True)

    def collect(self, window: Window) -> pd.DataFrame:
        return self.rows(self.source.records_for(window))


class CudaApiTracer(CuptiTracer):
    """CUDA runtime and driver API calls."""

    name: ClassVar[str] = "cuda_api"
    level: ClassVar[Level] = Level.CUDA_API
    kinds: ClassVar[tuple[Any, ...]] = API_KINDS

    def rows(self, records: ActivityColumns) -> pd.DataFrame:
        return api_rows(records, self.source.clock)


def record_path_here() -> tuple[str, str | None, str | None]:
    """``(path, why, pairing)`` for ``xsp doctor``: how the CUDA levels would read CUPTI's records
    here (``C``, ``Python (cupti-python)`` or ``none``), why not C, and a line when cupti-python's
    CUPTI is not of PyTorch's CUDA release (None when it is)."""
    path, why = record_path()
    return path, why, pairing_note()
