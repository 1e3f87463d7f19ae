"""Profiling schedules: which steps of a long run are recorded (torch.profiler's ``schedule``).

Counted in steps (the automatic steps of :mod:`xsp.record.steps`, or ``xsp.step()`` blocks),
from the session's start: the first ``skip_first`` steps are not recorded; then cycles of
``wait`` steps not recorded, ``warmup`` steps recorded and thrown away (they bring the program
to its steady state with the tracers' cost included), and ``active`` steps recorded and kept,
``repeat`` times (0: until the session ends). A step that is not recorded costs a top-level
check per module call, nothing per layer.

Each step's action is the one ``torch.profiler.schedule`` gives it (tests/unit/test_schedule.py
holds the two equal over every combination of the counts). Where it differs: every count has
a default (``active=1``, the others 0), where torch requires ``wait``, ``warmup`` and
``active``; torch's ``skip_first_wait`` is not offered; and the steps of every active span go
to one trace (torch hands each span to ``on_trace_ready`` apart, at its last step:
``RECORD_AND_SAVE``, here a plain record).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields
from typing import Any

from xsp.core.errors import XspError


class ScheduleError(XspError, ValueError):
    """A schedule that cannot be followed (a negative count, no active step, an unknown field)."""


class StepAction(enum.Enum):
    """What a session does with one step."""

    SKIP = "skip"
    """Nothing is recorded."""
    WARMUP = "warmup"
    """Recorded, then discarded."""
    RECORD = "record"
    """Recorded and kept."""


@dataclass(frozen=True)
class Schedule:
    """Which steps to record, as torch.profiler's ``schedule(skip_first, wait, warmup, active, repeat)``.

    Example:
        >>> schedule = Schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=1)
        >>> [schedule.action(step).value for step in range(7)]
        ['skip', 'skip', 'warmup', 'record', 'record', 'skip', 'skip']
    """

    skip_first: int = 0
    wait: int = 0
    warmup: int = 0
    active: int = 1
    repeat: int = 0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"schedule {field.name} must be a whole number >= 0, not {value!r}")
        if self.active < 1:
            raise ScheduleError("schedule active must be at least 1 (no step would ever be recorded)")

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """``"skip_first=10,wait=1,warmup=1,active=3,repeat=2"`` (any subset, any order)."""
        values: dict[str, Any] = {}
        known = {field.name for field in fields(cls)}
        for part in filter(None, (piece.strip() for piece in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in known:
                raise ScheduleError(f"schedule part {part!r} is not one of {', '.join(sorted(known))} = a number")
            try:
                values[key] = int(value)
            except ValueError:
                raise ScheduleError(f"schedule {key} must be a whole number, not {value.strip()!r}") from None
        return cls(**values)

    @property
    def cycle(self) -> int:
        return self.wait + self.warmup + self.active

    def action(self, step: int) -> StepAction:
        """What to do with step ``step`` (0 = the session's first)."""
        if step < self.skip_first:
            return StepAction.SKIP
        into = step - self.skip_first
        if self.repeat and into >= self.repeat * self.cycle:
            return StepAction.SKIP
        position = into % self.cycle
        if position < self.wait:
            return StepAction.SKIP
        return StepAction.WARMUP if position < self.wait + self.warmup else StepAction.RECORD

    def as_metadata(self) -> dict[str, int]:
        return asdict(self)


def schedule_of(value: Schedule | str | dict[str, int] | None) -> Schedule | None:
    """A :class:`Schedule` from what ``xsp.trace(schedule=...)`` accepts."""
    if value is None or isinstance(value, Schedule):
        return value
    if isinstance(value, str):
        return Schedule.parse(value)
    if isinstance(value, dict):
        try:
            return Schedule(**value)
        except TypeError as exc:
            raise ScheduleError(f"not a schedule: {exc}") from None
    raise ScheduleError(f"not a schedule: {value!r}")
