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
import enum
import random
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from xsp.core.clock import now_ns
from xsp.core.schema import StepSampling

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


class SteppingThread(NotedThread, Protocol):
    """A recording thread whose steps the sampler follows (:class:`xsp.record.recording.ThreadBuffer`)."""

    decided_ns: int
    step_limit: int

    @property
    def steps(self) -> Any: ...


AmbientContext = Callable[[], "tuple[int, int, bool] | None"]


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


class StepSampler:
    """Decides each step's depth as it begins, and learns step durations as they end.

    Args:
        policy: the rate and the slow-step rule.
        ambient: the probe of the current OpenTelemetry span (None: steps join no request).
        seed: of the random draws (tests).
    """

    def __init__(self, policy: SamplingPolicy, ambient: AmbientContext | None = None, seed: int | None = None) -> None:
        self.policy = policy
        self.ambient = ambient
        self._draw = random.Random(seed).random
        self._recent: deque[int] = deque(maxlen=MEDIAN_STEPS)
        self._sorted: list[int] = []
        self._lock = threading.Lock()
        self._slow_left = 0
        self._capture_left = 0
        self._capture_first = 0
        self.begun = 0
        """Steps begun (decided) so far, on every thread: a capture's steps are counted on from it."""
        self._counts = [0] * len(REASONS)
        self._slow_threshold_ns = 0
        """Steps longer than this are slow (0: none yet, the median is not known)."""
        self._ended = 0
        self.slow_steps = 0
        """Steps found slow so far."""
        self.probe_errors = 0
        """Steps whose current OpenTelemetry span could not be read (they join no request)."""
        self.plans: list[DepthPlan] = []
        """Every depth plan used so far (notes name them by position: the list only grows)."""
        self._rotation: list[int] = []
        self._turn = 0
        self._full = -1

    @property
    def median_ns(self) -> int:
        """The running median step duration (0 before any step ended)."""
        values = self._sorted
        return values[len(values) // 2] if values else 0

    def capture(self, steps: int, first: int | None = None) -> int | None:
        """Record ``steps`` steps (on any thread) at every level the session has, from the step
        numbered ``first`` in :attr:`begun`'s count (None: the next). Returns that number, or None
        while another capture is still under way."""
        with self._lock:
            if self._capture_left:
                return None
            self._capture_first = self.begun if first is None else max(int(first), 0)
            self._capture_left = max(int(steps), 0)
            return self._capture_first

    def cancel_capture(self) -> None:
        """Forget the steps a capture still asks for."""
        with self._lock:
            self._capture_left = 0

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
        if before_ns:
            self.step_ended(before_ns, buffer)
        buffer.decided_ns = buffer.steps.start_ns
        buffer.step_limit = self.decide(buffer, time_ns)

    def decide(self, buffer: NotedThread, time_ns: int) -> int:
        """A step of ``buffer``'s thread begins (its first top-level call starts at ``time_ns``):
        how deep it is recorded (``ThreadBuffer.step_limit``: :data:`MODEL_ONLY_LIMIT`, 0 for
        every depth, or a depth). Notes the decision in the buffer."""
        trace_id = span_id = 0
        request_sampled = True
        if self.ambient is not None:
            try:
                current = self.ambient()
            except Exception:  # the application's context must never break its own call
                current = None
                self.probe_errors += 1
            if current is not None:
                trace_id, span_id, request_sampled = current
        if not request_sampled:
            reason = _NOT_SAMPLED
        elif self._capture_left or self._slow_left:
            reason = self._armed()
        elif self._draw() < self.policy.rate:
            reason = _SAMPLED
        else:
            reason = _MODEL_ONLY
        plan, limit = -1, MODEL_ONLY_LIMIT
        if reason == _SAMPLED or reason == _AFTER_SLOW or reason == _CAPTURE:
            plan, limit = self._plan(reason == _SAMPLED)
        buffer.step_notes.append((time_ns, NoteKind.DECISION, reason, trace_id, span_id, plan + 1, 0))
        self._counts[reason] += 1
        self.begun += 1
        return limit

    def _plan(self, drawn: bool) -> tuple[int, int]:
        """The plan (its index, -1 for none) and step limit of a deep step."""
        rotation = self._rotation
        if not rotation:
            return -1, EVERY_DEPTH
        if drawn:
            turn = self._turn
            self._turn = turn + 1  # (two threads may take the same turn: the rotation stays about even)
            plan = rotation[turn % len(rotation)]
        else:
            plan = self._full
        return plan, self.plans[plan].step_limit

    def _armed(self) -> int:
        with self._lock:  # several threads may take the last armed step
            if self._capture_left and self.begun >= self._capture_first:
                self._capture_left -= 1
                return _CAPTURE
            if self._slow_left:
                self._slow_left -= 1
                return _AFTER_SLOW
        return _SAMPLED if self._draw() < self.policy.rate else _MODEL_ONLY

    @property
    def decided(self) -> Counter[StepSampling]:
        """Steps decided so far, by reason."""
        return Counter({reason: count for reason, count in zip(REASONS, self._counts) if count})

    def step_ended(self, duration_ns: int, buffer: NotedThread | None) -> None:
        """A step of ``buffer``'s thread lasted ``duration_ns``: a slow one arms the next steps
        (and is noted in the buffer). The running median is kept over every step during the
        warm-up, then over one step in :data:`MEDIAN_EVERY` (a comparison is all the others cost)."""
        threshold = self._slow_threshold_ns
        if threshold and duration_ns > threshold and buffer is not None:
            self._slow(duration_ns, buffer)
        self._ended += 1
        if self._ended > WARMUP_STEPS and self._ended % MEDIAN_EVERY:
            return
        with self._lock:  # steps end on many threads of a server
            recent, ordered = self._recent, self._sorted
            if len(recent) == recent.maxlen:
                del ordered[bisect.bisect_left(ordered, recent[0])]
            recent.append(duration_ns)
            bisect.insort(ordered, duration_ns)
            if len(ordered) >= WARMUP_STEPS and self.policy.slow_factor:
                self._slow_threshold_ns = int(self.policy.slow_factor * ordered[len(ordered) // 2])

    def _slow(self, duration_ns: int, buffer: NotedThread) -> None:
        policy = self.policy
        self.slow_steps += 1
        buffer.step_notes.append((now_ns(), NoteKind.SLOW, 0, 0, 0, duration_ns, self.median_ns))
        armed_so_far = self._counts[_AFTER_SLOW]
        with self._lock:
            if armed_so_far + policy.slow_steps <= max(policy.slow_steps, SLOW_SHARE * self.begun):
                self._slow_left = max(self._slow_left, policy.slow_steps)

    def as_metadata(self) -> dict[str, Any]:
        """The trace's ``sampling``: the policy and what it decided."""
        steps = {reason.value: count for reason, count in zip(REASONS, self._counts)}
        return {**self.policy.as_metadata(), "steps": steps,
                "slow_steps_found": self.slow_steps, "median_step_ns": self.median_ns,
                "joins_requests": self.ambient is not None, "probe_errors": self.probe_errors}
