"""Every option of a session (``xsp.trace``, ``xsp run``), parsed and checked once, in one frozen
object: :class:`TraceOptions`. A session reads its options there and nowhere else; what it decides
from them as it runs (the file's name for this rank, a collector found unreachable) is its own."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from xsp.core.levels import LevelsArg, parse_levels
from xsp.core.metadata import default_service_name
from xsp.core.options import checked_layer_depth, checked_output_name, checked_span_budget
from xsp.core.schema import DEFAULT_OUTPUT, Level
from xsp.export.target import OtlpTarget, span_budget_from_env
from xsp.record import nvtx as nvtx_ranges
from xsp.record.columns import DEFAULT_MAX_EVENTS
from xsp.record.sampling import DEFAULT_SLOW_FACTOR, SamplingPolicy
from xsp.record.schedule import Schedule, schedule_of

DEFAULT_LEVELS: Final = ("model", "layer")
SAMPLE_VARIABLE: Final = "XSP_SAMPLE"
"""The ``sample`` of a session that was given none (``xsp run --sample`` sets it for the script)."""
DEFAULT_LONG_STEP_S: Final = 1.0
"""Steps at least this long are exported to OTLP as soon as they end."""
WINDOW_S = 1.0
"""A window closes at the first step end this long after the last one closed: its spans are
then interpreted and written to disk (and exported) while the program runs on. (Read as each
session's options are made: a test may change it.)"""
ALWAYS_ON_WINDOW_S = 60.0
"""An always-on session's windows close this long apart, unless ``window_s`` or
:data:`WINDOW_VARIABLE` says otherwise (OpenTelemetry's default interval for
exporting metrics, whose figures come from the windows). Each window costs about the same
whatever it holds (a helper process forked, about 130 ms of CPU, and 150-190 ms of
interpretation before its first span), on top of about 15 µs a request. The example service at
400 requests a second spent 54-71 µs a request off its request thread with 10 s windows, 33-42
with 30 s (``benchmarks/production.py``). ``WINDOW_EVENTS`` still bounds what a window holds."""
WINDOW_VARIABLE: Final = "XSP_WINDOW_S"
"""An always-on session's window interval, in seconds, where ``window_s`` is not given (a service's
setting, as ``XSP_SAMPLE`` is; ``xsp run`` passes it on)."""
CAPTURE_WINDOW_S = 1.0
"""While a capture (``xsp capture``) is under way, windows close at most this long apart: its file
is complete about a second after its last step, not a window's time later."""
WINDOW_EVENTS = 50_000
"""A window also closes at the first step end after this many records: interpreting a window
takes memory in proportion to its records, so this bounds the session's memory."""


@dataclass(frozen=True)
class TraceOptions:
    """What a session was asked to do, checked (:meth:`parse` makes one; see :func:`xsp.trace`
    for each option)."""

    levels: tuple[Level, ...]
    output: Path | None
    """The trace file asked for (absolute: the program may change directory before it is written)."""
    target: OtlpTarget | None
    """The collector to export to (None: no export)."""
    service_name: str
    max_events: int
    long_step_s: float
    schedule: Schedule | None
    calibrate: bool
    span_budget: int
    """Spans a step may export (0: no limit), from the option or else the environment."""
    span_budget_from_env: bool
    """The budget came from the environment (its problems are said at the start)."""
    dataset: Path | None
    """The dataset folder the file goes into, absolute."""
    backward: bool
    layer_depth: int | None
    nvtx: bool
    """Whether spans push NVTX ranges as they run (see :mod:`xsp.record.nvtx`)."""
    window_s: float
    """See :data:`WINDOW_S`."""
    window_events: int
    """See :data:`WINDOW_EVENTS`."""
    sampling: SamplingPolicy | None = None
    """Always on (``sample=``): which steps are recorded below the model level (None: every step)."""
    sampling_env_problem: str | None = None
    """``XSP_SAMPLE`` was set but could not be used (said at the start)."""
    window_env_problem: str | None = None
    """``XSP_WINDOW_S`` was set but could not be used (said at the start)."""
    rotate_s: float | None = None
    """With ``dataset``: the file is sealed as a part, and the next begun, this often (None: never)."""
    rotate_bytes: int | None = None
    """With ``dataset``: ... or once its windows take this many bytes (None: no limit)."""

    @property
    def rotates(self) -> bool:
        """The trace is written in parts (``rotate``)."""
        return bool(self.rotate_s or self.rotate_bytes)

    @classmethod
    def parse(cls, levels: LevelsArg = DEFAULT_LEVELS, output: str | os.PathLike[str] | None = DEFAULT_OUTPUT,
              otlp_endpoint: str | None = None, service_name: str | None = None, otlp_protocol: str | None = None,
              max_events: int = DEFAULT_MAX_EVENTS, long_step_s: float = DEFAULT_LONG_STEP_S,
              schedule: Schedule | str | dict[str, int] | None = None, calibrate: bool = False,
              span_budget: int | None = None, dataset: str | os.PathLike[str] | None = None,
              backward: bool = True, layer_depth: int | None = None, nvtx: bool | None = None,
              sample: float | None = None, slow_factor: float | None = None,
              rotate: str | float | None = None, window_s: float | None = None) -> TraceOptions:
        """The options of :func:`xsp.trace`, checked.

        Raises:
            ValueError: an option is out of range or cannot be parsed (the message names it).
        """
        budget = checked_span_budget(span_budget)
        if output is not None:
            checked_output_name(str(output))
        sampling, env_problem = _sampling(sample, DEFAULT_SLOW_FACTOR if slow_factor is None else slow_factor)
        if slow_factor is not None and sample is None and not environment_sampling_set():
            raise ValueError("slow_factor applies to always-on sessions only: give sample too")
        rotate_s, rotate_bytes = parse_rotation(rotate)
        windows_s, window_problem = _window_interval(window_s, sampling is not None)
        if rotate_s is not None:  # a part is sealed when a window closes: at least as often as parts are due
            windows_s = min(windows_s, rotate_s)
        if (rotate_s or rotate_bytes) and dataset is None:
            raise ValueError("rotate writes the trace as parts of a dataset: give dataset=DIR too (xsp run --dataset)")
        return cls(
            levels=parse_levels(levels), output=None if output is None else Path(output).absolute(),
            target=OtlpTarget.resolve(otlp_endpoint, otlp_protocol),
            service_name=service_name or default_service_name(), max_events=max_events, long_step_s=long_step_s,
            schedule=schedule_of(schedule), calibrate=calibrate,
            span_budget=span_budget_from_env() if budget is None else budget, span_budget_from_env=budget is None,
            dataset=None if dataset is None else Path(dataset).absolute(), backward=backward,
            layer_depth=checked_layer_depth(layer_depth), nvtx=nvtx_ranges.wanted(nvtx),
            window_s=windows_s, window_events=WINDOW_EVENTS, sampling=sampling, sampling_env_problem=env_problem,
            window_env_problem=window_problem, rotate_s=rotate_s, rotate_bytes=rotate_bytes)


def _window_interval(window_s: float | None, always_on: bool) -> tuple[float, str | None]:
    """How often the session's windows close, and the problem with ``XSP_WINDOW_S`` where it was
    set but cannot be used (said, not raised: the environment is not the program's own call).
    Raises ValueError naming ``window_s`` where it is out of range."""
    if window_s is not None:
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not 0 < window_s < math.inf:
            raise ValueError(f"window_s must be a number of seconds above 0, not {window_s!r}")
        return float(window_s), None
    if not always_on:
        return WINDOW_S, None
    from_env = os.environ.get(WINDOW_VARIABLE, "").strip()
    if not from_env:
        return ALWAYS_ON_WINDOW_S, None
    try:
        value = float(from_env)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:
        return ALWAYS_ON_WINDOW_S, (f"{WINDOW_VARIABLE} is not used: it must be a number of seconds above 0, not "
                                    f"{from_env!r}; windows close every {ALWAYS_ON_WINDOW_S:g} s")
    return value, None


_SECONDS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_BYTES: Final = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}


def parse_rotation(rotate: str | float | None) -> tuple[float | None, int | None]:
    """``rotate`` as (seconds, bytes): a number of seconds, or ``30m``, ``1h``, ``500MB``, or both
    (``1h,500MB``: whichever comes first). Raises ValueError naming the option."""
    if rotate is None:
        return None, None
    if isinstance(rotate, (int, float)) and not isinstance(rotate, bool):
        if rotate <= 0:
            raise ValueError(f"rotate must be above 0 seconds, not {rotate}")
        return float(rotate), None
    seconds: float | None = None
    size: int | None = None
    for part in str(rotate).replace(" ", "").lower().split(","):
        number = part.rstrip("smhdkgb")
        unit = part[len(number):]
        try:
            value = float(number)
        except ValueError:
            value = -1.0
        if value <= 0 or unit not in {**_SECONDS, **_BYTES, "": 1}:
            raise ValueError(f"rotate must be a time (30m, 1h, 2d) or a size (500MB, 2GB), or both "
                             f"(1h,500MB), not {rotate!r}")
        if unit in _BYTES:
            size = int(value * _BYTES[unit])
        else:
            seconds = value * _SECONDS.get(unit, 1.0)
    return seconds, size


_ENVIRONMENT_SAMPLING: ContextVar[bool] = ContextVar("xsp_environment_sampling", default=True)


@contextmanager
def without_environment_sampling() -> Iterator[None]:
    """Sessions made inside read no ``XSP_SAMPLE``: xsp's own measuring sessions (calibration, the
    runs of a leveled experiment) record every step at every level, whatever the service sets."""
    token = _ENVIRONMENT_SAMPLING.set(False)
    try:
        yield
    finally:
        _ENVIRONMENT_SAMPLING.reset(token)


def environment_sampling_set() -> bool:
    """Whether ``XSP_SAMPLE`` is set (to anything)."""
    return bool(os.environ.get(SAMPLE_VARIABLE, "").strip())


def _sampling(sample: float | None, slow_factor: float) -> tuple[SamplingPolicy | None, str | None]:
    """The sampling asked for, else ``XSP_SAMPLE``'s. A value it cannot use is a problem to say,
    not an error (the environment is not the program's own call), and the session then runs as
    with ``XSP_SAMPLE=0``: a service's mistyped setting must not record every request at every
    level, a tracing cost many times the always-on one."""
    if sample is not None:
        return SamplingPolicy.parse(sample, slow_factor), None
    from_env = os.environ.get(SAMPLE_VARIABLE, "").strip()
    if not from_env or not _ENVIRONMENT_SAMPLING.get():
        return None, None
    try:
        return SamplingPolicy.parse(from_env, slow_factor), None
    except ValueError as exc:
        return (SamplingPolicy.parse(0.0, slow_factor),
                f"{SAMPLE_VARIABLE} is not used: {exc}; the session runs always on as with {SAMPLE_VARIABLE}=0 "
                "(every step timed at the model level, none sampled deeper)")

