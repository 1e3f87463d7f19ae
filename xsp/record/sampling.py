"""Always-on sampling (``xsp.trace(sample=RATE)``): as each step begins, decide whether it is
recorded below the model level, and note the request it serves.

Every step is timed at the model level (its ``predict`` or step span). A fraction ``RATE`` of
steps is recorded at the deeper levels the session asked for; so are the steps after a slow one
(slower than :attr:`SamplingPolicy.slow_factor` times the running median of
:data:`MEDIAN_STEPS` steps: every step of the warm-up, then one in :data:`MEDIAN_EVERY`) and
the steps a capture asked for (:meth:`StepSampler.capture`). The other steps pass their layers
through unrecorded: the module-call wrapper tests one flag of the thread
(``ThreadBuffer.step_limit``) per call.

The deep steps drawn rotate through the runs of a leveled experiment (:meth:`StepSampler.rotate`:
layers to depth 1, 2, ..., every layer, then operators), and the steps not drawn are its
model-only run: the figures over a window are then leveled, free of xsp's own overhead, without
running anything twice. The steps after a slow one, and those a capture asks for, are recorded
at every level.

When an OpenTelemetry span is current where a step begins (the service's HTTP or gRPC span, set
by its instrumentation, on its thread or asyncio task), the step joins that span's trace: its
note keeps the trace and span ids, and the span table puts the step's root under that span
(:mod:`xsp.table.sampling`). A request the application's sampler dropped records nothing below
the model level, and its spans are not exported.

The hot path only appends a tuple per step (:attr:`NoteKind.DECISION`); the notes become columns
when a window is interpreted.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import enum
import os
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from xsp.core.clock import now_ns
from xsp.core.schema import Level, StepSampling
from xsp.record import hotpath
from xsp.record.columns import NOTE_FIELDS, NoteField, note_rows

MEDIAN_STEPS: Final = 255
"""Steps the running median of step durations is taken over."""
DEFAULT_SLOW_FACTOR: Final = 5.0
DEFAULT_SLOW_STEPS: Final = 3
"""Steps recorded deep after a slow one."""
SLOW_SHARE: Final = 0.01
"""At most this share of the steps (and at least the first slow one's) is recorded deep because a
step before was slow: on a busy machine a step five times the median is not rare, and deep
recording must stay the exception."""
MEDIAN_EVERY: Final = 8
"""After the warm-up, one step in this many is added to the running median."""
WARMUP_STEPS: Final = 20
"""Steps timed before a step can be called slow (the median of fewer says little)."""


class NoteKind(enum.IntEnum):
    """What a step note (:attr:`ThreadBuffer.step_notes`) says."""

    DECISION = 0
    """A step began: ``(time_ns, DECISION, reason, trace_id, span_id, plan, 0)`` (``plan``: 1 + the
    index in :attr:`StepSampler.plans` of how deep it is recorded, 0 for the model level only)."""
    SLOW = 1
    """The thread's step that ended before ``time_ns`` was slow: ``(time_ns, SLOW, 0, 0, 0,
    duration_ns, median_ns)``."""


REASONS: Final = (StepSampling.MODEL_ONLY, StepSampling.SAMPLED, StepSampling.AFTER_SLOW, StepSampling.CAPTURE,
                  StepSampling.REQUEST_NOT_SAMPLED)
"""A decision's reason, by its code in a note."""
_MODEL_ONLY, _SAMPLED, _AFTER_SLOW, _CAPTURE, _NOT_SAMPLED = range(len(REASONS))
_LOW_BITS: Final = (1 << 64) - 1


def note_as_before(core: StepCore, buffer: Any, time_ns: int) -> None:
    """A step that began at ``time_ns`` as part of the one decided last on ``buffer``'s thread, and
    was split off it (a model's calls that joined another model's step, then became steps of
    their own as it went on alone: :meth:`xsp.record.steps.AutoSteps._joins`): noted and counted
    as that one was decided, which its records followed. Nothing where that decision has left the
    thread with a window."""
    decision = _last_decision(buffer)
    if decision is not None:
        reason, trace_id, span_id, plan = decision
        core.note(buffer, time_ns, reason, trace_id or None, span_id or None, plan)


def _last_decision(buffer: Any) -> tuple[int, int, int, int] | None:
    """``(reason, trace id, span id, plan)`` of the latest decision still in ``buffer``'s notes,
    kept as tuples or packed."""
    latest: tuple[int, int, int, int, int] | None = None
    for note in reversed(buffer.step_notes):
        if note[1] == NoteKind.DECISION:
            latest = (note[0], note[2], note[3], note[4], note[5] - 1)
            break
    view = memoryview(note_rows(buffer.packed_notes)).cast("q")
    for row in range(len(view) - NOTE_FIELDS, -1, -NOTE_FIELDS):
        if view[row + NoteField.KIND] == NoteKind.DECISION:
            if latest is None or view[row + NoteField.TIME_NS] > latest[0]:
                high, low = view[row + NoteField.TRACE_HIGH] & _LOW_BITS, view[row + NoteField.TRACE_LOW] & _LOW_BITS
                trace_id = high << 64 | low
                latest = (view[row + NoteField.TIME_NS], view[row + NoteField.REASON], trace_id,
                          view[row + NoteField.SPAN_ID] & _LOW_BITS, view[row + NoteField.PLAN_OR_DURATION_NS] - 1)
            break
    return None if latest is None else latest[1:]
DEEP_REASONS: Final = frozenset({StepSampling.SAMPLED, StepSampling.AFTER_SLOW, StepSampling.CAPTURE})
"""Reasons of the steps recorded at every level the session asked for."""


MODEL_ONLY_LIMIT: Final = -1
"""``ThreadBuffer.step_limit`` of a step timed at the model level only."""
EVERY_DEPTH: Final = 0


@dataclass(frozen=True)
class DepthPlan:
    """How deep a drawn step is recorded: one run of a leveled experiment."""

    label: str
    """The run's name (``model+layer<=1``, ``model+layer``, ``model+layer+operator``)."""
    step_limit: int
    """``ThreadBuffer.step_limit`` for the step: 0, every module call depth; ``k``, down to ``k``."""
    levels: frozenset[str]
    """The levels whose spans the step keeps."""


@dataclass(frozen=True)
class SamplingPolicy:
    """Which steps go deep (checked by :meth:`parse`)."""

    rate: float
    """The fraction of steps recorded below the model level."""
    slow_factor: float = DEFAULT_SLOW_FACTOR
    """A step this many times the running median is slow (0: no slow-step rule)."""
    slow_steps: int = DEFAULT_SLOW_STEPS
    """Steps recorded deep after a slow one."""

    @classmethod
    def parse(cls, rate: float | str, slow_factor: float = DEFAULT_SLOW_FACTOR,
              slow_steps: int = DEFAULT_SLOW_STEPS) -> SamplingPolicy:
        """Raises ValueError naming the option that is out of range."""
        try:
            value = float(rate)
        except (TypeError, ValueError):
            raise ValueError(f"sample must be a number from 0 to 1, not {rate!r}") from None
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"sample must be from 0 to 1 (a fraction of steps), not {rate!r}")
        if slow_factor != 0 and slow_factor <= 1.0:
            raise ValueError(f"slow_factor must be above 1 (times the median step), or 0 for none, not {slow_factor}")
        if slow_steps < 0:
            raise ValueError(f"slow_steps must be 0 or more, not {slow_steps}")
        return cls(rate=value, slow_factor=float(slow_factor), slow_steps=int(slow_steps))

    def as_metadata(self) -> dict[str, Any]:
        return {"rate": self.rate, "slow_factor": self.slow_factor, "slow_steps": self.slow_steps}


class NotedThread(Protocol):
    """The thread a decision is made for (:class:`xsp.record.recording.ThreadBuffer`)."""

    step_notes: list[tuple[int, ...]]
    step_trace: int | None


class SteppingThread(NotedThread, Protocol):
    """A recording thread whose steps the sampler follows (:class:`xsp.record.recording.ThreadBuffer`)."""

    decided_ns: int
    step_limit: int
    step_operators: bool

    @property
    def steps(self) -> Any: ...


PROBE_TRACE_ID: Final = 0x5A3F_0001_0002_0003_0004_0005_0006_0007
PROBE_SPAN_ID: Final = 0x0A0B_0C0D_0E0F_1011
"""The ids of the spans xsp makes to see how OpenTelemetry's spans read (they are never exported)."""

AmbientContext = Callable[[], "tuple[int, int, bool] | None"]
ContextLocation = tuple[contextvars.ContextVar[Any], str, Callable[[type], bool]]
"""Where OpenTelemetry keeps the current span: its context variable, the span's key in it, and
which span classes give their context as their ``_context`` (:func:`reads_context_plainly`)."""


def otel_context_probe() -> AmbientContext | None:
    """A function giving the (trace id, span id, sampled) of the OpenTelemetry span current in
    the caller's context, or None when no valid span is; None when OpenTelemetry's API is not
    installed."""
    try:
        from opentelemetry import trace as otel_trace
    except ImportError:  # pragma: no cover - opentelemetry-sdk is a dependency
        return None
    current_span = otel_trace.get_current_span

    def ambient() -> tuple[int, int, bool] | None:
        context = current_span().get_span_context()
        if not context.is_valid:
            return None
        return context.trace_id, context.span_id, bool(context.trace_flags & 1)

    return ambient


def otel_context_location() -> ContextLocation | None:
    """Where ``opentelemetry.trace.get_current_span`` reads the current span, so that xsp's C
    sampler reads it there without running the API's Python (about 3 µs a request, its caches
    cold after the model ran); None where OpenTelemetry keeps its context elsewhere (another
    ``OTEL_PYTHON_CONTEXT``) or is laid out otherwise. The sampler checks the reading against
    the API's before it relies on it (:class:`StepSampler`)."""
    try:
        from opentelemetry import context as otel_context
        from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
        from opentelemetry.trace import propagation
    except ImportError:  # pragma: no cover - opentelemetry-sdk is a dependency
        return None
    runtime = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    variable = getattr(runtime, "_current_context", None)
    key = getattr(propagation, "_SPAN_KEY", None)
    if type(runtime) is not ContextVarsRuntimeContext or not isinstance(variable, contextvars.ContextVar):
        return None
    return (variable, key, reads_context_plainly) if isinstance(key, str) else None


def reads_context_plainly(span_class: type) -> bool:
    """Whether a span of ``span_class`` gives its ``_context`` from ``get_span_context`` and does
    nothing else, so that xsp's C sampler may read ``_context`` instead of calling it (two frames of
    Python a request): its ``get_span_context`` is the SDK span's or ``NonRecordingSpan``'s, seen
    giving ``_context`` in this version of OpenTelemetry, and no class attribute ``_context``
    stands in front of the span's own. The sampler asks once a class, and again when it changes."""
    if "_context" in dir(span_class):
        return False
    return getattr(span_class, "get_span_context", None) in _plain_span_readers()


def _plain_span_readers() -> tuple[Callable[..., Any], ...]:
    """The ``get_span_context`` functions seen giving the span's ``_context``: ``NonRecordingSpan``'s
    and, once OpenTelemetry's SDK is imported (never imported here: a span of the SDK's means it is),
    the SDK span's."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    context = SpanContext(PROBE_TRACE_ID, PROBE_SPAN_ID, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    made: list[Callable[[], Any]] = [lambda: NonRecordingSpan(context)]
    sdk = sys.modules.get("opentelemetry.sdk.trace")
    if sdk is not None:
        provider = sdk.TracerProvider(sampler=sdk.sampling.ALWAYS_ON, shutdown_on_exit=False)
        made.append(lambda: provider.get_tracer("xsp").start_span("probe"))
    readers: list[Callable[..., Any]] = []
    for make in made:
        with contextlib.suppress(Exception):  # a version whose spans are made otherwise: none read plainly
            span = make()
            if span.get_span_context() is getattr(span, "_context", None):
                readers.append(type(span).get_span_context)
    return tuple(readers)


class StepCore(Protocol):
    """The per-step part of a :class:`StepSampler` (C where xsp's extension is built, else
    :class:`PySamplerCore`): what the recording calls as steps begin and end."""

    armed: int
    begun: int
    last_begun_ns: int
    probe_errors: int

    @property
    def median_ns(self) -> int: ...

    def step_begins(self, buffer: SteppingThread, time_ns: int, before_ns: int = 0, /) -> None: ...

    def decide(self, buffer: NotedThread, time_ns: int, /) -> int: ...

    def depth(self, buffer: NotedThread, time_ns: int, /) -> tuple[int, bool]: ...

    def step_ended(self, duration_ns: int, buffer: NotedThread | None, /) -> None: ...

    def note(self, buffer: NotedThread, time_ns: int, reason: int, trace_id: int | None, span_id: int | None,
             plan: int, /) -> None: ...

    def draw(self) -> float: ...

    def ambient_span(self) -> tuple[int | None, int | None, bool]: ...

    def other_request(self, buffer: NotedThread, /) -> bool:
        """Whether the application's span current now belongs to another trace than the one
        current where ``buffer``'s open step began (``buffer.step_trace``)."""
        ...

    def counts(self) -> list[int]: ...


_MASK_64: Final = (1 << 64) - 1


class PySamplerCore:
    """The Python twin of xsp's C ``SamplerCore`` (``xsp/record/_hotpath/sampler.c``): the same
    draws from the same seed, the same notes and counts (tests hold the two equal). Used where the
    extension is not built.

    Args:
        rate: the fraction of steps drawn for deep recording.
        slow_factor: a step this many times the running median is slow (0: none is).
        seed: of the draws (splitmix64).
        ambient: the Python probe of the current OpenTelemetry span (None: steps join no request).
        on_armed: ``(buffer, time_ns, trace_id, span_id) -> (step limit, operators)``: decides,
            notes and counts a step while :attr:`armed` (after a slow step, or captured).
        on_plan: ``() -> (plan, step limit, operators)`` of a drawn step (``operators``: whether it
            records the operator level).
        on_slow: ``(duration_ns, buffer)``: a step was slow.
        median_steps, warmup_steps, median_every: the running median's (see the module).
        context: where OpenTelemetry keeps the current span (the C core reads it there; here the
            probe does).
    """

    def __init__(self, rate: float, slow_factor: float, seed: int, ambient: AmbientContext | None,
                 on_armed: Callable[[Any, int, int | None, int | None], tuple[int, bool]],
                 on_plan: Callable[[], tuple[int, int, bool]], on_slow: Callable[[int, Any], None],
                 median_steps: int, warmup_steps: int, median_every: int,
                 context: ContextLocation | None = None) -> None:
        self.rate, self.slow_factor = rate, slow_factor
        self._draws = seed & _MASK_64
        self.ambient, self.on_armed, self.on_plan, self.on_slow = ambient, on_armed, on_plan, on_slow
        self.median_steps, self.warmup_steps, self.median_every = median_steps, warmup_steps, median_every
        self.armed = 0
        self.begun = self.ended = self.threshold_ns = self.probe_errors = 0
        self.last_begun_ns = 0
        """When the last step decided began (host clock; 0: none yet)."""
        self._counts = [0] * len(REASONS)
        self._recent: deque[int] = deque(maxlen=median_steps)
        self._sorted: list[int] = []

    @property
    def median_ns(self) -> int:
        values = self._sorted
        return values[len(values) // 2] if values else 0

    def draw(self) -> float:
        self._draws = (self._draws + 0x9E3779B97F4A7C15) & _MASK_64
        z = self._draws
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
        return ((z ^ (z >> 31)) >> 11) * 2.0 ** -53

    def counts(self) -> list[int]:
        return list(self._counts)

    def ambient_span(self) -> tuple[int | None, int | None, bool]:
        if self.ambient is None:
            return None, None, True
        try:
            current = self.ambient()
        except Exception:  # the application's context must never break its own call
            self.probe_errors += 1
            return None, None, True
        return (None, None, True) if current is None else (current[0], current[1], bool(current[2]))

    def other_request(self, buffer: NotedThread) -> bool:
        return self.ambient_span()[0] != buffer.step_trace

    def step_begins(self, buffer: SteppingThread, time_ns: int, before_ns: int = 0) -> None:
        if before_ns > 0:
            self.step_ended(before_ns, buffer)
        buffer.decided_ns = buffer.steps.start_ns
        buffer.step_limit, buffer.step_operators = self.depth(buffer, time_ns)

    def decide(self, buffer: NotedThread, time_ns: int) -> int:
        return self.depth(buffer, time_ns)[0]

    def depth(self, buffer: NotedThread, time_ns: int) -> tuple[int, bool]:
        """The step's limit, and whether it records operators (what :meth:`decide` decides)."""
        trace_id, span_id, request_sampled = self.ambient_span()
        buffer.step_trace = trace_id
        plan, limit, operators = -1, MODEL_ONLY_LIMIT, False
        if not request_sampled:
            reason = _NOT_SAMPLED
        elif self.armed:
            return self.on_armed(buffer, time_ns, trace_id, span_id)
        elif self.draw() < self.rate:
            reason = _SAMPLED
            plan, limit, operators = self.on_plan()
        else:
            reason = _MODEL_ONLY
        self.note(buffer, time_ns, reason, trace_id, span_id, plan)
        return limit, operators

    def note(self, buffer: NotedThread, time_ns: int, reason: int, trace_id: int | None, span_id: int | None,
             plan: int) -> None:
        buffer.step_notes.append((time_ns, NoteKind.DECISION, reason, trace_id or 0, span_id or 0, plan + 1, 0))
        self._counts[reason] += 1
        self.begun += 1
        self.last_begun_ns = time_ns

    def step_ended(self, duration_ns: int, buffer: NotedThread | None) -> None:
        if self.threshold_ns and duration_ns > self.threshold_ns and buffer is not None:
            self.on_slow(duration_ns, buffer)
        self.ended += 1
        if self.ended > self.warmup_steps and self.ended % self.median_every:
            return
        recent, ordered = self._recent, self._sorted
        if len(recent) == recent.maxlen:
            del ordered[bisect.bisect_left(ordered, recent[0])]
        recent.append(duration_ns)
        bisect.insort(ordered, duration_ns)
        if len(ordered) >= self.warmup_steps and self.slow_factor:
            self.threshold_ns = int(self.slow_factor * ordered[len(ordered) // 2])


def new_core(*args: Any, **kwargs: Any) -> StepCore:
    """xsp's C ``SamplerCore`` where the extension is built, else :class:`PySamplerCore` (same arguments)."""
    extension = hotpath.load()
    core: StepCore = (PySamplerCore if extension is None else extension.SamplerCore)(*args, **kwargs)
    return core


def _reads_alike(core: StepCore, ambient: AmbientContext) -> bool:
    """Whether ``core`` reads the current OpenTelemetry span as ``ambient`` does: on a sampled span
    and an unsampled one of known ids, and on what is current here."""
    try:
        from opentelemetry import trace as otel_trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
    except ImportError:  # pragma: no cover - opentelemetry-sdk is a dependency
        return False

    def as_probed() -> tuple[int | None, int | None, bool]:
        found = ambient()
        return (None, None, True) if found is None else (found[0], found[1], bool(found[2]))

    readings = [(core.ambient_span(), as_probed())]
    for flags in (TraceFlags.SAMPLED, TraceFlags.DEFAULT):
        span = NonRecordingSpan(SpanContext(PROBE_TRACE_ID, PROBE_SPAN_ID, is_remote=False,
                                            trace_flags=TraceFlags(flags)))
        with otel_trace.use_span(span):
            readings.append((core.ambient_span(), as_probed()))
    return all(read == probed for read, probed in readings)


class StepSampler:
    """Decides each step's depth as it begins, and learns step durations as they end.

    The per-step work is its :attr:`core`'s (in C where xsp's extension is built): what the
    recording calls. This class owns the policy, the capture, the steps after a slow one and the
    depth plans, which the core calls back for.

    Args:
        policy: the rate and the slow-step rule.
        ambient: the probe of the current OpenTelemetry span (None: steps join no request).
        seed: of the random draws (tests).
        context: where OpenTelemetry keeps the current span (:func:`otel_context_location`), for
            the C core to read it there; checked against ``ambient`` first.
    """

    def __init__(self, policy: SamplingPolicy, ambient: AmbientContext | None = None, seed: int | None = None,
                 context: ContextLocation | None = None) -> None:
        self.policy = policy
        self.ambient = ambient
        self._lock = threading.Lock()
        self._slow_left = 0
        self._capture_left = 0
        self._capture_first = 0
        self.slow_steps = 0
        """Steps found slow so far."""
        self.plans: list[DepthPlan] = []
        """Every depth plan used so far (notes name them by position: the list only grows)."""
        self._rotation: list[int] = []
        self._turn = 0
        self._full = -1
        seed_value = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed) & _MASK_64
        arguments = (policy.rate, policy.slow_factor, seed_value, ambient, self._armed, self._plan, self._slow,
                     MEDIAN_STEPS, WARMUP_STEPS, MEDIAN_EVERY)
        core = new_core(*arguments, context=context if ambient is not None else None)
        if context is not None and ambient is not None and not _reads_alike(core, ambient):
            core = new_core(*arguments)
        self.core: StepCore = core
        """What the recording calls as each step begins and ends
        (:meth:`xsp.record.recording.Recording.sample_steps`)."""

    @property
    def begun(self) -> int:
        """Steps begun (decided) so far, on every thread: a capture's steps are counted on from it."""
        return self.core.begun

    @property
    def last_begun_ns(self) -> int:
        """When the last step decided began, on any thread (host clock; 0: none yet)."""
        return self.core.last_begun_ns

    @property
    def probe_errors(self) -> int:
        """Steps whose current OpenTelemetry span could not be read (they join no request)."""
        return self.core.probe_errors

    @property
    def median_ns(self) -> int:
        """The running median step duration (0 before any step ended)."""
        return self.core.median_ns

    def capture(self, steps: int, first: int | None = None) -> int | None:
        """Record ``steps`` steps (on any thread) at every level the session has, from the step
        numbered ``first`` in :attr:`begun`'s count (None: the next). Returns that number, or None
        while another capture is still under way."""
        with self._lock:
            if self._capture_left:
                return None
            self._capture_first = self.begun if first is None else max(int(first), 0)
            self._capture_left = max(int(steps), 0)
            self._rearm()
            return self._capture_first

    def cancel_capture(self) -> None:
        """Forget the steps a capture still asks for."""
        with self._lock:
            self._capture_left = 0
            self._rearm()

    def _rearm(self) -> None:
        """(under the lock) The core hands steps back while a capture or slow steps are due."""
        self.core.armed = int(bool(self._capture_left or self._slow_left))

    def rotate(self, plans: list[DepthPlan]) -> None:
        """Drawn steps are recorded by these plans in turn; steps after a slow one and captured
        ones by the last (the deepest)."""
        with self._lock:
            known = {plan.label: index for index, plan in enumerate(self.plans)}
            order = []
            for plan in plans:
                if plan.label not in known:
                    known[plan.label] = len(self.plans)
                    self.plans.append(plan)
                order.append(known[plan.label])
            self._rotation, self._full = order, (order[-1] if order else -1)

    def step_begins(self, buffer: SteppingThread, time_ns: int, before_ns: int = 0) -> None:
        """A step of ``buffer``'s thread begins with a top-level call at ``time_ns``: decide how deep
        it is recorded (``buffer.step_limit``). ``before_ns``: how long the step before it lasted,
        where the caller knows (xsp's C wrapper; 0: it was told through ``on_long_step``)."""
        self.core.step_begins(buffer, time_ns, before_ns)

    def decide(self, buffer: NotedThread, time_ns: int) -> int:
        """A step of ``buffer``'s thread begins (its first top-level call starts at ``time_ns``):
        how deep it is recorded (``ThreadBuffer.step_limit``: :data:`MODEL_ONLY_LIMIT`, 0 for
        every depth, or a depth). Notes the decision in the buffer."""
        return self.core.decide(buffer, time_ns)

    def step_ended(self, duration_ns: int, buffer: NotedThread | None) -> None:
        """A step of ``buffer``'s thread lasted ``duration_ns``: a slow one arms the next steps
        (and is noted in the buffer). The running median is kept over every step during the
        warm-up, then over one step in :data:`MEDIAN_EVERY` (a comparison is all the others cost)."""
        self.core.step_ended(duration_ns, buffer)

    def _plan(self, drawn: bool = True) -> tuple[int, int, bool]:
        """The plan (its index, -1 for none), step limit and operator level of a deep step."""
        rotation = self._rotation
        if not rotation:
            return -1, EVERY_DEPTH, True
        if drawn:
            turn = self._turn
            self._turn = turn + 1  # (two threads may take the same turn: the rotation stays about even)
            plan = rotation[turn % len(rotation)]
        else:
            plan = self._full
        chosen = self.plans[plan]
        return plan, chosen.step_limit, Level.OPERATOR.value in chosen.levels

    def _armed(self, buffer: NotedThread, time_ns: int, trace_id: int | None,
               span_id: int | None) -> tuple[int, bool]:
        """The core's decision while steps after a slow one or of a capture are due."""
        with self._lock:  # several threads may take the last armed step
            reason = -1
            if self._capture_left and self.begun >= self._capture_first:
                self._capture_left -= 1
                reason = _CAPTURE
            elif self._slow_left:
                self._slow_left -= 1
                reason = _AFTER_SLOW
            self._rearm()
        if reason < 0:
            reason = _SAMPLED if self.core.draw() < self.policy.rate else _MODEL_ONLY
        plan, limit, operators = -1, MODEL_ONLY_LIMIT, False
        if reason != _MODEL_ONLY:
            plan, limit, operators = self._plan(reason == _SAMPLED)
        self.core.note(buffer, time_ns, reason, trace_id, span_id, plan)
        return limit, operators

    @property
    def decided(self) -> Counter[StepSampling]:
        """Steps decided so far, by reason."""
        return Counter({reason: count for reason, count in zip(REASONS, self.core.counts()) if count})

    def _slow(self, duration_ns: int, buffer: NotedThread) -> None:
        policy = self.policy
        self.slow_steps += 1
        buffer.step_notes.append((now_ns(), NoteKind.SLOW, 0, 0, 0, duration_ns, self.median_ns))
        armed_so_far = self.core.counts()[_AFTER_SLOW]
        with self._lock:
            if armed_so_far + policy.slow_steps <= max(policy.slow_steps, SLOW_SHARE * self.begun):
                self._slow_left = max(self._slow_left, policy.slow_steps)
                self._rearm()

    def as_metadata(self) -> dict[str, Any]:
        """The trace's ``sampling``: the policy and what it decided."""
        steps = {reason.value: count for reason, count in zip(REASONS, self.core.counts())}
        return {**self.policy.as_metadata(), "steps": steps,
                "slow_steps_found": self.slow_steps, "median_step_ns": self.median_ns,
                "joins_requests": self.ambient is not None, "probe_errors": self.probe_errors}
